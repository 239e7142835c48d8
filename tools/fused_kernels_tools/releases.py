"""`release`: the published major versions (releases.toml) and their reproducible builds.

Each published version (Hub branch `v<version>`) is defined by the source that builds it: a pinned git
commit, or "HEAD" for the development line while that version is not frozen, plus its public API (the
`__all__` of the package), which never changes once published. `release build` exports each version's
source (`git archive <commit>`), runs the builder on it with that commit as the build revision and the
release's version as the metadata version, and checks the result: the API equals the release's `api`, the
static build checks pass, and no two versions share an id or op namespace (so they load side by side).
"""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import ToolError
from .gitrev import SourceRevision, git_revision

RELEASES_FILE = "releases.toml"
HEAD = "HEAD"
TMP_PREFIX = ".tmp-release-"
BENCHMARKS_DIR = "benchmarks"
BENCHMARK_GLOB = "benchmark*.py"


@dataclass(frozen=True)
class Release:
    version: int
    source: str  # "HEAD" or a 40-hex commit
    api: tuple[str, ...]

    @property
    def branch(self) -> str:
        return f"v{self.version}"

    @property
    def pinned(self) -> bool:
        return self.source != HEAD


def load_releases(path: Path) -> list[Release]:
    """Parse and validate releases.toml; the releases in version order."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ToolError(f"{path}: no release table (one [[release]] per published version)") from None
    except tomllib.TOMLDecodeError as e:
        raise ToolError(f"{path}: {e}") from None
    unknown_top = sorted(set(data) - {"release"})
    if unknown_top:
        raise ToolError(f"{path}: unknown keys {unknown_top} (expected only [[release]] tables)")
    entries = data.get("release", [])
    if not isinstance(entries, list) or not entries:
        raise ToolError(f"{path}: no [[release]] entries")
    releases: list[Release] = []
    for i, entry in enumerate(entries):
        where = f"{path}: release #{i + 1}"
        unknown = sorted(set(entry) - {"version", "source", "api"})
        missing = sorted({"version", "source", "api"} - set(entry))
        if unknown or missing:
            raise ToolError(f"{where}: " + "; ".join(filter(None, [
                f"unknown keys {unknown}" if unknown else "", f"missing keys {missing}" if missing else ""])))
        version, source, api = entry["version"], entry["source"], entry["api"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ToolError(f"{where}: version must be a non-negative integer, got {version!r}")
        if not isinstance(source, str) or not (source == HEAD or re.fullmatch(r"[0-9a-f]{40}", source)):
            raise ToolError(f"{where} (v{version}): source must be \"HEAD\" or a full 40-hex commit, got {source!r}")
        if not isinstance(api, list) or not api or not all(isinstance(n, str) and n.isidentifier() for n in api):
            raise ToolError(f"{where} (v{version}): api must be a non-empty list of Python names")
        if len(set(api)) != len(api):
            raise ToolError(f"{where} (v{version}): api lists a name twice")
        releases.append(Release(version, source, tuple(api)))
    versions = [r.version for r in releases]
    if len(set(versions)) != len(versions):
        raise ToolError(f"{path}: a version is defined twice: {sorted(versions)}")
    if sum(1 for r in releases if not r.pinned) > 1:
        raise ToolError(f"{path}: only one version can build from HEAD (the development line)")
    return sorted(releases, key=lambda r: r.version)


def select(releases: list[Release], versions: list[int] | None) -> list[Release]:
    if not versions:
        return releases
    by_version = {r.version: r for r in releases}
    unknown = [v for v in versions if v not in by_version]
    if unknown:
        raise ToolError(f"versions {unknown} are not in the release table (defined: {sorted(by_version)})")
    return [by_version[v] for v in sorted(set(versions))]


# ------------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------------

def _git(checkout: Path, *args: str, binary: bool = False):
    result = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True)
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise ToolError(message or f"git {' '.join(args)} failed")
    return result.stdout if binary else result.stdout.decode()


def resolve_revision(checkout: Path, release: Release) -> SourceRevision:
    """The commit (and dirty flag) a release builds from."""
    if not release.pinned:
        return git_revision(checkout)
    try:
        _git(checkout, "cat-file", "-e", f"{release.source}^{{commit}}")
    except ToolError:
        try:
            shallow = _git(checkout, "rev-parse", "--is-shallow-repository").strip() == "true"
        except ToolError:
            shallow = False
        hint = "this is a shallow clone: `git fetch --unshallow`" if shallow else "fetch it, or fix releases.toml"
        raise ToolError(f"v{release.version}: source commit {release.source} is not in this repository ({hint})") from None
    return SourceRevision(release.source, False)


def _extract_tar(data: bytes, dest: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(dest, filter="data")


def export_source(checkout: Path, revision: SourceRevision, dest: Path) -> None:
    """The source of `revision` into `dest`: `git archive` of the commit, or, for a dirty development line,
    the working tree's files (tracked and untracked, not ignored: what `git status` considers)."""
    dest.mkdir(parents=True)
    if not revision.dirty:
        _extract_tar(_git(checkout, "archive", "--format=tar", revision.commit, binary=True), dest)
        return
    top = Path(_git(checkout, "rev-parse", "--show-toplevel").strip())
    listed = _git(top, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for rel in filter(None, listed.split("\0")):
        src = top / rel
        if src.is_file() and not src.is_symlink():  # ls-files --cached lists files deleted in the work tree
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / rel)


# ------------------------------------------------------------------------------------------------------
# API
# ------------------------------------------------------------------------------------------------------

def static_all(init_py: Path) -> list[str]:
    """The literal `__all__` of a module, read with `ast` (the module is never imported)."""
    try:
        tree = ast.parse(init_py.read_bytes(), filename=str(init_py))
    except (OSError, SyntaxError) as e:
        raise ToolError(f"{init_py}: cannot read __all__ ({e})") from None
    found = None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            try:
                found = ast.literal_eval(node.value)
            except ValueError:
                raise ToolError(f"{init_py}:{node.lineno}: __all__ must be a literal list of names") from None
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == "__all__":
            raise ToolError(f"{init_py}:{node.lineno}: __all__ must be one literal list (no +=)")
    if not isinstance(found, (list, tuple)) or not all(isinstance(n, str) for n in found):
        raise ToolError(f"{init_py}: no literal __all__ list")
    return list(found)


def api_problems(variant_dir: Path, api: tuple[str, ...] | list[str], version: int) -> list[str]:
    """Differences between a built variant's `__all__` and the release's `api` (empty when equal)."""
    actual = static_all(variant_dir / "__init__.py")
    added = [n for n in actual if n not in api]
    removed = [n for n in api if n not in actual]
    problems = []
    if added:
        problems.append(f"exports {added} that v{version}'s api in releases.toml does not list")
    if removed:
        problems.append(f"no longer exports {removed} of v{version}'s api")
    if len(set(actual)) != len(actual):
        problems.append("__all__ lists a name twice")
    return [f"{variant_dir.name}: {p}" for p in problems]


# ------------------------------------------------------------------------------------------------------
# Build
# ------------------------------------------------------------------------------------------------------

def _variant_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "metadata.json").is_file())


def _check_distinct_revisions(checkout: Path, releases: list[Release]) -> dict[int, SourceRevision]:
    revisions = {r.version: resolve_revision(checkout, r) for r in releases}
    seen: dict[str, int] = {}
    for version, revision in revisions.items():
        if revision.rev in seen:
            raise ToolError(
                f"v{seen[revision.rev]} and v{version} build from the same source revision {revision.rev}: their ids"
                " and op namespaces would collide, so they could not load side by side. Pin the older version"
                " to its own commit (or commit the development line)."
            )
        seen[revision.rev] = version
    return revisions


def build_release(checkout: Path, release: Release, revision: SourceRevision, out: Path,
                  only: list[str] | None = None) -> Path:
    """Build one release into `out/v<version>/` (replaced whole, only once the new build passed its checks)."""
    from .build import build
    from .check import check_build

    out.mkdir(parents=True, exist_ok=True)
    dest = out / release.branch
    work = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{release.branch}-", dir=out))
    try:
        source, staged = work / "source", work / "build"
        export_source(checkout, revision, source)
        build(source, staged, only, revision, version=release.version)
        problems = []
        for variant in _variant_dirs(staged):
            problems += api_problems(variant, release.api, release.version)
        static, _ = check_build(staged, runtime=False)
        problems += [str(p) for p in static]
        if problems:
            raise ToolError(f"v{release.version} (source {revision.rev}) is not publishable:\n  " + "\n  ".join(problems))
        benchmarks = sorted((source / BENCHMARKS_DIR).glob(BENCHMARK_GLOB))
        if benchmarks:  # the bundle layout of kernel-builder: benchmarks/ beside the variants
            (staged / BENCHMARKS_DIR).mkdir()
            for path in benchmarks:
                shutil.copyfile(path, staged / BENCHMARKS_DIR / path.name)
        old = work / "old"
        if dest.exists():
            os.rename(dest, old)
        os.rename(staged, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def build_releases(checkout: Path, releases_file: Path, out: Path, versions: list[int] | None = None,
                   only: list[str] | None = None, allow_dirty: bool = False) -> dict[int, Path]:
    checkout = checkout.resolve()
    releases = load_releases(releases_file)
    revisions = _check_distinct_revisions(checkout, releases)
    selected = select(releases, versions)
    for release in selected:  # before building anything
        if revisions[release.version].dirty and not allow_dirty:
            raise ToolError(
                f"v{release.version} builds from HEAD and the working tree has uncommitted changes: commit them"
                " first (a published build names its commit), or pass --allow-dirty for a local try-out")
    built: dict[int, Path] = {}
    for release in selected:
        revision = revisions[release.version]
        if revision.dirty:
            print(f"warning: v{release.version} is built from a dirty working tree (HEAD {revision.commit[:7]} plus"
                  f" uncommitted changes, id suffix _dirty); the publisher refuses it without --allow-dirty",
                  file=sys.stderr)
        dest = build_release(checkout, release, revision, out, only)
        described = "HEAD " if not release.pinned else ""
        print(f"built v{release.version} from {described}{revision.rev} into {dest}"
              f" ({len(_variant_dirs(dest))} variants)")
        built[release.version] = dest
    return built


def list_releases(checkout: Path, releases_file: Path) -> list[str]:
    lines = []
    for release in load_releases(releases_file):
        revision = resolve_revision(checkout.resolve(), release)
        where = "HEAD " if not release.pinned else ""
        lines.append(f"v{release.version}: branch {release.branch}, source {where}{revision.commit}"
                     f"{' (dirty)' if revision.dirty else ''}, api {list(release.api)}")
    return lines
