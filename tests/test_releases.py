"""The release table (releases.toml) and `release build`: every published version rebuilds from its own source,
reproducibly, with its own version number, its fixed API, and ids distinct from the other versions'."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from publish_helpers import (
    VARIANTS, package_all, release_build, release_commits, release_source, releases_toml, tree_bytes,
)
from tooling_helpers import REPO_ROOT, git, python_subprocess, read_metadata, run_tool

from fused_kernels_tools.errors import ToolError
from fused_kernels_tools.releases import load_releases, static_all


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return release_source(tmp_path_factory)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return release_build(tmp_path_factory)


def clone(source: Path, dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(source), str(dest)], check=True)
    return dest


# ---------------------------------------------------------------------------------------------------------
# The repository's own table
# ---------------------------------------------------------------------------------------------------------

def test_repository_release_table_matches_its_sources():
    """v1 is pinned to a full commit whose __all__ is v1's api; v2 builds HEAD and its api is today's __all__
    (so changing the public API without updating releases.toml fails here)."""
    releases = load_releases(REPO_ROOT / "releases.toml")
    assert [r.version for r in releases] == [1, 2]
    v1, v2 = releases
    assert v1.pinned and len(v1.source) == 40
    assert git(REPO_ROOT, "rev-parse", f"{v1.source}^{{commit}}").strip() == v1.source
    init_at_v1 = git(REPO_ROOT, "show", f"{v1.source}:torch-ext/fused_kernels/__init__.py")
    tree = ast.parse(init_at_v1)
    at_v1 = next(ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__")
    assert list(v1.api) == at_v1
    assert v2.source == "HEAD"
    assert list(v2.api) == package_all(REPO_ROOT)


# ---------------------------------------------------------------------------------------------------------
# release build
# ---------------------------------------------------------------------------------------------------------

def test_each_version_builds_from_its_source_with_its_version(source, built, tmp_path_factory):
    commit_a, commit_b = release_commits(tmp_path_factory)
    assert sorted(p.name for p in built.iterdir()) == ["v1", "v2"]
    ids = {}
    for version, commit in ((1, commit_a), (2, commit_b)):
        variants = built / f"v{version}"
        assert sorted(p.name for p in variants.iterdir()) == sorted(VARIANTS)
        for name in VARIANTS:
            metadata = read_metadata(variants / name)
            assert metadata["version"] == version
            assert metadata["provenance"]["kernel"] == {"commit": commit, "dirty": False}
            backend = metadata["backend"]["type"]
            assert metadata["id"] == f"_fused_kernels_{backend}_{commit[:7]}"
            assert f"VERSION = {version}\n" in (variants / name / "_build_info.py").read_text()
            ids[(version, name)] = metadata["id"]
    assert ids[(1, "torch-cpu")] != ids[(2, "torch-cpu")] and ids[(1, "torch-cuda")] != ids[(2, "torch-cuda")]
    # v1's files are commit A's: the release table added in commit B is not part of the package anyway, so
    # compare against a direct build of an export of commit A.
    export = tmp_path_factory.mktemp("export-a")
    archive = subprocess.run(["git", "-C", str(source), "archive", "--format=tar", commit_a], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(export)], input=archive, check=True)
    direct = tmp_path_factory.mktemp("direct") / "out"
    run_tool("build", "--source", str(export), "--out", str(direct), "--commit", commit_a, "--version", "1",
             "--only", *VARIANTS)
    assert tree_bytes(direct) == tree_bytes(built / "v1")


def test_release_builds_are_byte_identical(source, built, tmp_path):
    again = tmp_path / "again"
    run_tool("release", "build", "--source", str(source), "--out", str(again), "--only", *VARIANTS)
    assert tree_bytes(again) == tree_bytes(built)
    # Rebuilding into the same directory replaces each version whole, with the same bytes.
    (again / "v1" / "torch-cpu" / "stray.py").write_text("")
    run_tool("release", "build", "--source", str(source), "--out", str(again), "--versions", "1", "--only", "torch-cpu")
    assert sorted(p.name for p in (again / "v1").iterdir()) == ["torch-cpu"]
    assert tree_bytes(again / "v1" / "torch-cpu") == tree_bytes(built / "v1" / "torch-cpu")
    assert not [p for p in again.iterdir() if p.name.startswith(".tmp")]


def test_v1_and_v2_load_side_by_side(built):
    code = f"""
import sys, torch, kernels
mods = [kernels.get_local_kernel(__import__("pathlib").Path({str(built)!r}) / v / "torch-cpu") for v in ("v1", "v2")]
x = torch.randn(3, 16)
w = torch.rand(16) + 0.5
outs = [m.rms_norm(x, w, eps=1e-6, mode="llama") for m in mods]
assert torch.equal(outs[0], outs[1])
names = [m.__name__ for m in mods]
spaces = [sys.modules[n + "._ops"]._OPS_NAME for n in names]
assert len(set(names)) == 2 and names == spaces, (names, spaces)
for m, ns in zip(mods, spaces):
    assert hasattr(getattr(torch.ops, ns), "rms_norm")
    assert m.rms_norm.__module__ == ns + ".rms_norm"
versions = [sys.modules[n + "._build_info"].VERSION for n in names]
assert versions == [1, 2], versions
print("|".join(names))
"""
    proc = python_subprocess(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    v1_id, v2_id = proc.stdout.strip().split("|")
    assert v1_id != v2_id and v1_id.startswith("_fused_kernels_cpu_") and v2_id.startswith("_fused_kernels_cpu_")


def test_dirty_development_line_is_refused_unless_allowed(source, tmp_path):
    work = clone(source, tmp_path / "work")
    (work / "torch-ext" / "fused_kernels" / "layers.py").write_text(
        (work / "torch-ext" / "fused_kernels" / "layers.py").read_text() + "\n# local edit\n")
    out = tmp_path / "out"
    proc = run_tool("release", "build", "--source", str(work), "--out", str(out), "--only", "torch-cpu", check=False)
    assert proc.returncode == 1
    assert "v2 builds from HEAD and the working tree has uncommitted changes" in proc.stderr
    assert not out.exists() or not list(out.iterdir()), "nothing is built when one version is refused"
    # A pinned version does not depend on the working tree.
    run_tool("release", "build", "--source", str(work), "--out", str(out), "--versions", "1", "--only", "torch-cpu")
    proc = run_tool("release", "build", "--source", str(work), "--out", str(out), "--only", "torch-cpu", "--allow-dirty")
    assert "warning: v2 is built from a dirty working tree" in proc.stderr
    metadata = read_metadata(out / "v2" / "torch-cpu")
    assert metadata["id"].endswith("_dirty") and metadata["provenance"]["kernel"]["dirty"] is True
    assert "# local edit" in (out / "v2" / "torch-cpu" / "layers.py").read_text()
    assert not read_metadata(out / "v1" / "torch-cpu")["provenance"]["kernel"]["dirty"]


def test_api_mismatch_is_refused(source, tmp_path):
    work = clone(source, tmp_path / "work")
    commit_a = git(work, "rev-parse", "HEAD~1").strip()
    api = package_all(work)
    table = tmp_path / "releases.toml"
    table.write_text(releases_toml([(1, commit_a, [n for n in api if n != "fused_add_rms_norm"] + ["never_exported"]),
                                    (2, "HEAD", api)]))
    out = tmp_path / "out"
    proc = run_tool("release", "build", "--source", str(work), "--releases", str(table), "--out", str(out),
                    "--only", "torch-cpu", check=False)
    assert proc.returncode == 1
    assert "v1 (source " in proc.stderr and "is not publishable" in proc.stderr
    assert "exports ['fused_add_rms_norm'] that v1's api in releases.toml does not list" in proc.stderr
    assert "no longer exports ['never_exported'] of v1's api" in proc.stderr
    assert not (out / "v1").exists()


def test_same_source_for_two_versions_is_refused(source, tmp_path):
    work = clone(source, tmp_path / "work")
    head = git(work, "rev-parse", "HEAD").strip()
    api = package_all(work)
    table = tmp_path / "releases.toml"
    table.write_text(releases_toml([(1, head, api), (2, "HEAD", api)]))
    proc = run_tool("release", "build", "--source", str(work), "--releases", str(table), "--out", str(tmp_path / "o"),
                    check=False)
    assert proc.returncode == 1
    assert f"v1 and v2 build from the same source revision {head[:7]}" in proc.stderr


@pytest.mark.parametrize("text, message", [
    ('[[release]]\nversion = 1\nsource = "419ef83"\napi = ["layers"]\n', "full 40-hex commit"),
    ('[[release]]\nversion = 1\nsource = "HEAD"\napi = ["layers"]\n[[release]]\nversion = 1\nsource = "HEAD"\napi = ["x"]\n',
     "a version is defined twice"),
    ('[[release]]\nversion = 1\nsource = "HEAD"\napi = ["layers"]\n[[release]]\nversion = 2\nsource = "HEAD"\napi = ["x"]\n',
     "only one version can build from HEAD"),
    ('[[release]]\nversion = 1\nsource = "HEAD"\napi = ["layers"]\nbranch = "x"\n', "unknown keys ['branch']"),
    ('[[release]]\nversion = "1"\nsource = "HEAD"\napi = ["layers"]\n', "version must be a non-negative integer"),
    ('[[release]]\nversion = 1\nsource = "HEAD"\n', "missing keys ['api']"),
    ("", "no [[release]] entries"),
])
def test_table_validation(tmp_path, text, message):
    (tmp_path / "releases.toml").write_text(text)
    with pytest.raises(ToolError) as info:
        load_releases(tmp_path / "releases.toml")
    assert message in str(info.value)


def test_unknown_pinned_commit(source, tmp_path):
    api = package_all(source)
    table = tmp_path / "releases.toml"
    table.write_text(releases_toml([(1, "0" * 40, api), (2, "HEAD", api)]))
    proc = run_tool("release", "build", "--source", str(source), "--releases", str(table), "--out", str(tmp_path / "o"),
                    check=False)
    assert proc.returncode == 1 and "v1: source commit 0000000000000000000000000000000000000000 is not in this repository" in proc.stderr


def test_release_list(source, tmp_path_factory):
    commit_a, commit_b = release_commits(tmp_path_factory)
    proc = run_tool("release", "list", "--source", str(source))
    assert proc.stdout.splitlines()[0].startswith(f"v1: branch v1, source {commit_a}, api ['layers'")
    assert proc.stdout.splitlines()[1].startswith(f"v2: branch v2, source HEAD {commit_b}, api")


def test_builder_version_override(source, tmp_path):
    out = tmp_path / "out"
    run_tool("build", "--source", str(source), "--out", str(out), "--only", "torch-cpu", "--version", "7")
    assert read_metadata(out / "torch-cpu")["version"] == 7
    assert "VERSION = 7\n" in (out / "torch-cpu" / "_build_info.py").read_text()
    proc = run_tool("check", "--static-only", str(out))
    assert "version=7" in proc.stdout


def test_static_all_reads_the_literal(tmp_path):
    (tmp_path / "__init__.py").write_text('from .x import a\n__all__ = ["a", "b"]\n')
    assert static_all(tmp_path / "__init__.py") == ["a", "b"]
    (tmp_path / "__init__.py").write_text('__all__ = ["a"]\n__all__ += ["b"]\n')
    with pytest.raises(ToolError, match="no \\+="):
        static_all(tmp_path / "__init__.py")
    (tmp_path / "__init__.py").write_text("__all__ = names()\n")
    with pytest.raises(ToolError, match="literal list"):
        static_all(tmp_path / "__init__.py")


def test_a_shallow_clone_gets_a_hint(source, tmp_path):
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", source.as_uri(), str(shallow)], check=True)
    proc = run_tool("release", "build", "--source", str(shallow), "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 1
    assert "is not in this repository (this is a shallow clone: `git fetch --unshallow`)" in proc.stderr
