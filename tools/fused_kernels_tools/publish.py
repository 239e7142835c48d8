"""`publish`: upload a build to branch `v<version>` of the Hub kernel repository, and the card to `main`.

Talks to `HF_ENDPOINT` (the real Hub by default, or `hub serve`) with `huggingface_hub.HfApi`; the token is
whatever huggingface_hub resolves (`HF_TOKEN` or the stored login) and is never printed.

One publish is one commit on the version branch holding every change: `build/<variant>/<file>` for every
file of every variant, `benchmarks/benchmark*.py` when the build has them, and the deletion of every file
under `build/` (and every `benchmarks/benchmark*.py`) of the branch that this build does not have, so a
variant no longer built disappears. Only files whose content differs from the branch (git blob ids) are
sent; an unchanged build makes no commit. The commit names the branch head it was computed against
(`parent_commit`), so a concurrent publish makes it fail instead of interleaving, and a failed commit
leaves the branch as it was. The card (README.md on `main`, rendered from CARD.md) is committed only when
its text changed.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .card import VersionInfo, card_values, describe_package, render
from .errors import ToolError

REPO_TYPE = "kernel"
CARD_PATH = "README.md"
VERSION_BRANCH = re.compile(r"v(\d+)")


def git_blob_id(data: bytes) -> str:
    """What the Hub reports as a regular file's `oid`: the git blob sha1."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def kernels_version(branch: str) -> int | None:
    """The version `kernels.get_kernel(version=N)` reads from a branch name (kernels/_versions.py: `v` and
    whatever int() takes), so `v01` and `v+1` are version 1 to it as much as `v1` is; None: not a version."""
    if not branch.startswith("v"):
        return None
    try:
        return int(branch[1:])
    except ValueError:
        return None


def _is_benchmark(path: str) -> bool:
    parent, name = path.rpartition("/")[::2]
    return parent == "benchmarks" and fnmatch.fnmatchcase(name, "benchmark*.py")


# ------------------------------------------------------------------------------------------------------
# The local build
# ------------------------------------------------------------------------------------------------------

@dataclass
class LocalBuild:
    root: Path
    variants: dict[str, Path]
    version: int
    name: str
    license: str
    commit: str
    dirty: bool
    files: dict[str, bytes] = field(default_factory=dict)  # path in the repository -> content

    @property
    def rev(self) -> str:
        return self.commit[:7] + ("_dirty" if self.dirty else "")


def _variant_files(variant: Path) -> dict[str, bytes]:
    files = {}
    for path in sorted(variant.rglob("*")):
        rel = path.relative_to(variant)
        if path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc":
            files[rel.as_posix()] = path.read_bytes()
    return files


def _check_digest(variant: Path, metadata) -> None:
    """The variant's files are the ones its metadata.json hashed, unchanged: a file edited, added or removed after
    the build would be published under a digest that no longer describes it (kernels checks it only in
    `verify-signature`, never at load). The full `check` takes seconds per build; hashing takes milliseconds."""
    from kernels._rust import Digest, DigestAlgorithm, DigestValidationError

    if metadata.digest is None:
        raise ToolError(f"{variant / 'metadata.json'}: no digest; rebuild with the builder")
    try:
        metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant))
    except DigestValidationError as e:
        listing = "; ".join(str(v) for v in e.violations)
        raise ToolError(f"{variant}: the files differ from metadata.json's digest ({listing}); rebuild instead of "
                        "editing a build") from None


def load_build(build_dir: Path, source: Path) -> LocalBuild:
    """Every variant directory of `build_dir` (a directory holding metadata.json), checked for agreement."""
    from kernels._rust import Metadata
    from kernels.variants import parse_variant

    from .check import generated_constants

    if not build_dir.is_dir():
        raise ToolError(f"{build_dir}: no such build directory")
    variants: dict[str, Path] = {}
    for entry in sorted(build_dir.iterdir()):
        if entry.is_dir() and (entry / "metadata.json").is_file():
            try:
                parse_variant(entry.name)
            except ValueError as e:
                raise ToolError(f"{entry}: not a variant name kernels can select ({e})") from None
            build_info = entry / "_build_info.py"
            built_as = generated_constants(build_info).get("VARIANT") if build_info.is_file() else None
            if built_as != entry.name:
                # kernels selects a variant by its directory's name: a copy named torch-universal would load the CPU
                # build on every backend, one named torch-cuda12 never. Its digest cannot tell (it covers the files).
                raise ToolError(f"{entry}: built as variant {built_as!r}; a variant directory renamed or copied after "
                                "the build is not published (rebuild instead)")
            variants[entry.name] = entry
    if not variants:
        raise ToolError(f"{build_dir}: no build variants (directories with a metadata.json)")
    metas = {}
    for name, path in variants.items():
        try:
            metas[name] = Metadata.read_from_file(path / "metadata.json")
        except ValueError as e:
            raise ToolError(f"{path / 'metadata.json'}: {e}") from None
        _check_digest(path, metas[name])
    for what, get in (("version", lambda m: m.version), ("name", lambda m: str(m.name)),
                      ("license", lambda m: m.license),
                      ("source commit", lambda m: (m.provenance.kernel.commit, m.provenance.kernel.dirty)
                       if m.provenance and m.provenance.kernel else None)):
        values = {name: get(m) for name, m in metas.items()}
        if len(set(values.values())) > 1:
            listing = ", ".join(f"{n}={v}" for n, v in values.items())
            raise ToolError(f"{build_dir}: the variants disagree on {what}: {listing}; publish one build at a time")
    first = next(iter(metas.values()))
    if first.provenance is None or first.provenance.kernel is None:
        raise ToolError(f"{build_dir}: metadata.json has no provenance.kernel (source commit); rebuild with the builder")
    build = LocalBuild(build_dir, variants, first.version, str(first.name), first.license,
                       first.provenance.kernel.commit, first.provenance.kernel.dirty)
    for name, path in variants.items():
        for rel, data in _variant_files(path).items():
            build.files[f"build/{name}/{rel}"] = data
    bench_dirs = [build_dir / "benchmarks"]  # kernel-builder's bundle layout (release build writes it)
    if build_dir.resolve() == (source / "build").resolve():
        bench_dirs.append(source / "benchmarks")  # <kernel>/build: the kernel directory's benchmarks
    for bench_dir in bench_dirs:
        for path in sorted(bench_dir.glob("benchmark*.py")):
            build.files.setdefault(f"benchmarks/{path.name}", path.read_bytes())
    return build


def _local_info(build: LocalBuild, branch: str) -> VersionInfo:
    pick = "torch-cpu" if "torch-cpu" in build.variants else next(iter(build.variants))
    prefix = f"build/{pick}/"
    api, functions, layers = describe_package(lambda rel: build.files.get(prefix + rel))
    return VersionInfo(build.version, branch, build.commit, build.dirty, sorted(build.variants), api, functions, layers)


# ------------------------------------------------------------------------------------------------------
# Release table and repository defaults
# ------------------------------------------------------------------------------------------------------

def default_repo_id(source: Path) -> str:
    try:
        with open(source / "build.toml", "rb") as f:
            repo_id = tomllib.load(f).get("general", {}).get("hub", {}).get("repo-id")
    except FileNotFoundError:
        repo_id = None
    if not repo_id:
        raise ToolError(f"no [general.hub] repo-id in {source / 'build.toml'}: pass --repo-id")
    return repo_id


def check_release(build: LocalBuild, releases_file: Path) -> list[str]:
    """Problems that make `build` not the release table's version `build.version`; warnings are printed."""
    from .releases import api_problems, load_releases

    releases = {r.version: r for r in load_releases(releases_file)}
    release = releases.get(build.version)
    if release is None:
        return [f"version {build.version} is not in {releases_file} (defined: {sorted(releases)}); add it there first"]
    problems = []
    for path in build.variants.values():
        problems += api_problems(path, release.api, release.version)
    if release.pinned and build.commit != release.source:
        problems.append(f"v{release.version} is defined by {releases_file.name} as commit {release.source[:7]}, but this"
                        f" build is from {build.commit[:7]}: build it with `release build --versions {release.version}`")
    return problems


# ------------------------------------------------------------------------------------------------------
# Talking to the Hub
# ------------------------------------------------------------------------------------------------------

class _Secrets:
    """Removes the token from anything we print (an error message could in principle quote a header)."""

    def __init__(self) -> None:
        from huggingface_hub import get_token

        token = get_token()
        self.token = token if token and len(token) >= 4 else None

    def __call__(self, text: str) -> str:
        return text.replace(self.token, "<token>") if self.token else text


def _refs(api, repo_id: str) -> dict[str, str] | None:
    """Branch name -> head commit; None when the repository does not exist."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
    except RepositoryNotFoundError:
        return None
    return {b.name: b.target_commit for b in refs.branches}


def _tree(api, repo_id: str, commit: str | None, recursive: bool = True) -> dict:
    """Path -> RepoFile at `commit` (files only)."""
    from huggingface_hub.hf_api import RepoFile

    if commit is None:
        return {}
    return {e.path: e for e in api.list_repo_tree(repo_id, revision=commit, repo_type=REPO_TYPE, recursive=recursive)
            if isinstance(e, RepoFile)}


def _same_content(remote, data: bytes) -> bool:
    if remote.lfs is not None:
        return remote.lfs.sha256 == hashlib.sha256(data).hexdigest() and remote.lfs.size == len(data)
    return remote.blob_id == git_blob_id(data)


def _remote_info(api, repo_id: str, branch: str, commit: str, cache: Path) -> VersionInfo | None:
    """The card's description of another version branch, from its files on the Hub."""
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.hf_api import RepoFolder

    try:
        entries = list(api.list_repo_tree(repo_id, path_in_repo="build", revision=commit, repo_type=REPO_TYPE))
    except EntryNotFoundError:
        return None
    variants = sorted(e.path.rsplit("/", 1)[-1] for e in entries if isinstance(e, RepoFolder))
    if not variants:
        return None
    pick = "torch-cpu" if "torch-cpu" in variants else variants[0]
    root = Path(api.snapshot_download(repo_id, repo_type=REPO_TYPE, revision=commit, cache_dir=cache,
                                      allow_patterns=[f"build/{pick}/*"])) / "build" / pick

    def read(rel: str) -> bytes | None:
        path = root / rel
        return path.read_bytes() if path.is_file() else None

    metadata = json.loads(read("metadata.json") or b"{}")
    kernel = metadata.get("provenance", {}).get("kernel", {})
    api_names, functions, layers = describe_package(read)
    return VersionInfo(int(VERSION_BRANCH.fullmatch(branch).group(1)), branch, kernel.get("commit", "?" * 7),
                       bool(kernel.get("dirty")), variants, api_names, functions, layers)


# ------------------------------------------------------------------------------------------------------
# Publish
# ------------------------------------------------------------------------------------------------------

@dataclass
class Options:
    build_dir: Path
    source: Path
    repo_id: str | None = None
    branch: str | None = None
    dry_run: bool = False
    card: Path | None = None  # None: <source>/CARD.md when it exists
    releases: Path | None = None  # None: <source>/releases.toml when it exists
    release_check: bool = True
    allow_dirty: bool = False


def _say(message: str) -> None:
    print(message, flush=True)


def publish(options: Options) -> int:
    secrets = _Secrets()
    try:
        return _publish(options, secrets)
    except ToolError as e:
        raise ToolError(secrets(str(e))) from None
    except Exception as e:  # network and HTTP errors: one clean line, never the token
        raise ToolError(secrets(f"{type(e).__name__}: {e}".strip())) from None


def _publish(options: Options, secrets: _Secrets) -> int:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    source = options.source.resolve()
    build = load_build(options.build_dir, source)
    repo_id = options.repo_id or default_repo_id(source)
    branch = options.branch or f"v{build.version}"
    if branch == "main":
        raise ToolError("--branch main holds the repository card alone (kernels reads builds from version branches and "
                        f"custom ones): publish {options.build_dir} to v{build.version} (the default) or another branch")
    read_as = kernels_version(branch)
    if read_as is not None and branch != f"v{build.version}":
        # get_kernel(version=N) would load this build (or pick between two branches of one version), whose
        # metadata and API are another version's: a frozen v1 overwritten by a v2 build, say.
        if read_as == build.version:
            # A second spelling of the build's own version: two branches kernels would pick between.
            raise ToolError(f"--branch {branch} is another name of version {read_as} to kernels, whose branch is"
                            f" v{build.version}: publish {options.build_dir} there (the default)")
        raise ToolError(f"--branch {branch} is version {read_as} to kernels, but {options.build_dir} is a build of"
                        f" version {build.version}: publish it to v{build.version} (the default), to a branch kernels"
                        f" does not read as a version, or rebuild it as version {read_as}")

    if build.dirty:
        if not options.allow_dirty:
            raise ToolError(f"{options.build_dir} was built from a dirty tree ({build.rev}): commit the source and"
                            " rebuild, or pass --allow-dirty (local Hub try-outs only)")
        print(f"warning: publishing a build of a dirty tree ({build.rev})", file=sys.stderr)
    releases_file = options.releases or (source / "releases.toml")
    if options.release_check and (options.releases is not None or releases_file.is_file()):
        problems = check_release(build, releases_file)
        if problems:
            raise ToolError(f"refusing to publish {options.build_dir} as v{build.version}:\n  " + "\n  ".join(problems))
    card_template = None
    card_file = options.card or (source / "CARD.md")
    if options.card is not None or card_file.is_file():
        try:
            card_template = card_file.read_text()
        except OSError as e:
            raise ToolError(f"card template {card_file}: {e}") from None

    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    api = HfApi()
    dry = options.dry_run
    mode = "dry run (nothing is changed)" if dry else "publishing"
    _say(f"{mode}: {repo_id}@{branch} on {api.endpoint}: version {build.version}, source {build.rev},"
         f" {len(build.variants)} variants, {len(build.files)} files")

    refs = _refs(api, repo_id)
    if refs is None:
        _say(f"create repo {repo_id} (type kernel)")
        if not dry:
            api.create_repo(repo_id, repo_type=REPO_TYPE, exist_ok=True)
            refs = _refs(api, repo_id) or {}
    if refs is None or branch not in refs:
        _say(f"create branch {branch} (from main)")
        if dry:
            head = (refs or {}).get("main")  # what the new branch would start from
        else:
            api.create_branch(repo_id, branch=branch, repo_type=REPO_TYPE, exist_ok=True)
            refs = _refs(api, repo_id) or {}
            head = refs[branch]
    else:
        head = refs[branch]

    remote = _tree(api, repo_id, head)
    additions, updates, deletions = [], [], []
    for path, data in sorted(build.files.items()):
        if path not in remote:
            additions.append(path)
        elif not _same_content(remote[path], data):
            updates.append(path)
    for path in sorted(remote):
        if path not in build.files and (path.startswith("build/") or _is_benchmark(path)):
            deletions.append(path)

    status = 0
    if not (additions or updates or deletions):
        _say(f"no changes: {branch} already holds this build" + (f" (head {head[:7]})" if head else ""))
    else:
        if dry:
            for verb, paths in (("add", additions), ("update", updates), ("delete", deletions)):
                for path in paths:
                    _say(f"{verb} {path}")
        operations = [CommitOperationAdd(path, build.files[path]) for path in additions + updates]
        operations += [CommitOperationDelete(path) for path in deletions]
        summary = f"{len(additions)} added, {len(updates)} updated, {len(deletions)} deleted"
        if dry:
            _say(f"would commit to {branch}: {summary}")
        else:
            message = f"{build.name} v{build.version}: build of {build.rev} ({len(build.variants)} variants)"
            description = "Variants: " + ", ".join(sorted(build.variants))
            commit = _commit(api, repo_id, branch, head, operations, message, description, secrets)
            _say(f"committed to {branch}: {summary}: {commit}")

    if card_template is None:
        _say(f"no card template ({card_file}): {CARD_PATH} on main left as it is")
    else:
        status = _publish_card(api, repo_id, branch, build, card_template, refs, dry, secrets) or status
    if dry:
        _say("dry run: nothing was changed")
    return status


def _commit(api, repo_id: str, branch: str, head: str, operations, message: str, description: str,
            secrets: _Secrets) -> str:
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = api.create_commit(repo_id, operations, commit_message=message, commit_description=description,
                                 revision=branch, repo_type=REPO_TYPE, parent_commit=head)
    except Exception as e:
        reason = secrets(str(e).splitlines()[0] if str(e) else type(e).__name__)
        try:
            now = (_refs(api, repo_id) or {}).get(branch)
        except Exception:
            now = None
        if now is not None and now != head:
            raise ToolError(f"{branch} moved from {head[:7]} to {now[:7]} while publishing (another publish committed"
                            f" first): nothing was committed; publish again to upload against the new head"
                            f" ({reason})") from None
        if isinstance(e, HfHubHTTPError) and e.response is not None and e.response.status_code in (409, 412):
            raise ToolError(f"{branch} changed while publishing (the Hub refused a commit on top of {head[:7]}):"
                            f" nothing was committed; publish again ({reason})") from None
        state = f"{branch} is unchanged at {head[:7]}" if now == head else f"{branch} was at {head[:7]} before"
        raise ToolError(f"upload to {branch} failed, nothing was committed ({state}): {reason}") from None
    return info.oid


def _card_infos(api, repo_id: str, branch: str, build: LocalBuild, refs: dict[str, str]) -> list[VersionInfo]:
    """What the card describes: every version branch, this build for `branch`, the Hub's files for the others."""
    versions: dict[str, str | None] = {name: commit for name, commit in refs.items() if VERSION_BRANCH.fullmatch(name)}
    if VERSION_BRANCH.fullmatch(branch):  # a custom branch is not a version of the card
        versions[branch] = None
    infos = []
    with tempfile.TemporaryDirectory(prefix="fused-kernels-card-") as cache:
        for name, commit in sorted(versions.items(), key=lambda item: int(item[0][1:])):
            if commit is None:
                infos.append(_local_info(build, name))
            else:
                info = _remote_info(api, repo_id, name, commit, Path(cache))
                if info is not None:
                    infos.append(info)
    return infos


def _publish_card(api, repo_id: str, branch: str, build: LocalBuild, template: str, refs, dry: bool,
                  secrets: _Secrets, attempts: int = 3) -> int:
    """README.md on main, committed only when the rendered text differs. Another publish may move main
    meanwhile (its own card): then the card is rendered again from the new state, a few times at most."""
    from huggingface_hub import CommitOperationAdd

    for attempt in range(attempts):
        now = dict(refs or {}) if dry else (_refs(api, repo_id) or {})
        infos = _card_infos(api, repo_id, branch, build, now)
        if not infos:
            _say(f"{CARD_PATH} on main: no version branch to describe; left as it is")
            return 0
        card = render(template, card_values(repo_id, build.license, infos)).encode()
        main_head = now.get("main")
        current = _tree(api, repo_id, main_head, recursive=False).get(CARD_PATH) if main_head else None
        if current is not None and _same_content(current, card):
            _say(f"{CARD_PATH} on main: unchanged")
            return 0
        verb = "update" if current is not None else "add"
        described = ", ".join(i.branch for i in infos)
        if dry:
            _say(f"{verb} {CARD_PATH} on main (card: {described})")
            return 0
        try:
            info = api.create_commit(repo_id, [CommitOperationAdd(CARD_PATH, card)], commit_message=f"Card: {described}",
                                     revision="main", repo_type=REPO_TYPE, parent_commit=main_head)
        except Exception as e:
            reason = secrets(str(e).splitlines()[0] if str(e) else type(e).__name__)
            try:
                moved = (_refs(api, repo_id) or {}).get("main") != main_head
            except Exception:
                moved = False
            if moved and attempt + 1 < attempts:
                continue
            print(f"error: the build is published but the card on main was not updated ({reason}); publish again",
                  file=sys.stderr)
            return 1
        _say(f"{'updated' if verb == 'update' else 'added'} {CARD_PATH} on main: {info.oid}")
        return 0
    return 1
