"""The builder (`python -m fused_kernels_tools build`) against the build contract of docs/architecture.md.

These tests check names, files, metadata, digests, ids and loading; never kernel numerics (test_rms_norm.py
does that). Expected values are derived here from build.toml / build-matrix.toml / torch-ext/ directly, not
from the builder's own helpers.
"""

from __future__ import annotations

import ast
import json
import platform
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
from kernels._rust import Build, Digest, DigestAlgorithm, Metadata
from kernels.archs import _supports_cuda_capability
from kernels.backends import CPU, CUDA
from kernels.validate import ArchValidator
from kernels.variants import _resolve_variant_for_system, get_variants_local
from packaging.version import Version

from conftest import TORCH_BACKEND
from tooling_helpers import (
    REPO_ROOT, git, python_subprocess, read_metadata, run_tool, session_build, session_snapshot,
)

MATRIX = tomllib.loads((REPO_ROOT / "build-matrix.toml").read_text())
BUILD_TOML = tomllib.loads((REPO_ROOT / "build.toml").read_text())
PYEXT = set(BUILD_TOML["torch-noarch"]["pyext"])
ARCH_VARIANTS = {
    f"torch{t.replace('.', '')}-cxx11-cu{c.replace('.', '')}-{platform}": MATRIX["cuda_capabilities"][c]
    for t, cudas in MATRIX["torch"].items() for c in cudas for platform in MATRIX["platforms"]
}
ALL_VARIANTS = set(ARCH_VARIANTS) | {"torch-cuda", "torch-cpu"}
GENERATED = {"_ops.py", "_build_info.py", "metadata.json"}
METADATA_KEYS = ["name", "id", "version", "license", "python-depends", "kernel-depends", "backend", "digest",
                 "provenance"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return session_snapshot(tmp_path_factory)


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    return session_build(tmp_path_factory)


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def source_files(root: Path) -> dict[str, bytes]:
    """What the contract says a variant copies from a source directory."""
    return {rel: data for rel, data in tree(root).items()
            if Path(rel).suffix[1:] in PYEXT and "__pycache__" not in rel.split("/")
            and rel not in {"_ops.py", "_build_info.py"}}


def constants(path: Path) -> dict:
    """Module-level `NAME = <literal>` assignments of a generated file."""
    return {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}


def build_info(variant: Path) -> dict:
    return constants(variant / "_build_info.py")


def ops_name(variant: Path) -> str:
    return constants(variant / "_ops.py")["_OPS_NAME"]


def test_build_toml_parses_with_kernels():
    build = Build.open(REPO_ROOT)
    assert sorted(str(b) for b in build.general.backends) == ["cpu", "cuda"]


def test_every_expected_variant_is_built(build):
    assert {p.name for p in build.iterdir()} == ALL_VARIANTS
    assert len(ARCH_VARIANTS) == 30
    for name in ("torch211-cxx11-cu126-x86_64-linux", "torch211-cxx11-cu128-x86_64-linux",
                 "torch211-cxx11-cu130-aarch64-linux", "torch212-cxx11-cu132-x86_64-linux",
                 "torch215-cxx11-cu130-aarch64-linux"):
        assert (build / name).is_dir(), name


def test_variant_files_follow_the_contract(build, source):
    package = source_files(source / "torch-ext" / "fused_kernels")
    kernels_src = source_files(source / "kernels_src")
    assert "__init__.py" in package and "layers.py" in package and "__init__.py" in kernels_src
    for variant in sorted(build.iterdir()):
        files = tree(variant)
        expected = dict(package)
        if variant.name != "torch-cpu":
            expected |= {f"_kernels/{rel}": data for rel, data in kernels_src.items()}
        assert set(files) == set(expected) | GENERATED, variant.name
        assert {rel: files[rel] for rel in expected} == expected, f"{variant.name}: copies differ from the source"
        assert not [rel for rel in files if rel.endswith(".pyc") or "__pycache__" in rel]


def test_metadata_parses_and_has_the_contract_shape(build, source):
    head = git(source, "rev-parse", "HEAD").strip()
    for variant in sorted(build.iterdir()):
        metadata = Metadata.read_from_file(variant / "metadata.json")
        raw = read_metadata(variant)
        assert list(raw) == METADATA_KEYS, variant.name
        assert raw["name"] == "fused-kernels" and str(metadata.name) == "fused-kernels"
        assert raw["version"] == BUILD_TOML["general"]["version"] and type(raw["version"]) is int
        assert raw["license"] == BUILD_TOML["general"]["license"]
        assert raw["python-depends"] == [] and raw["kernel-depends"] == []
        if variant.name in ARCH_VARIANTS:
            assert raw["backend"] == {"type": "cuda", "archs": ARCH_VARIANTS[variant.name]}
        else:
            assert raw["backend"] == {"type": variant.name.removeprefix("torch-")}
        assert raw["provenance"]["kernel"] == {"commit": head, "dirty": False}
        assert metadata.provenance.kernel.commit == head and not metadata.provenance.dirty
        assert (variant / "metadata.json").read_text().endswith("}\n")


def test_digest_equals_kernels_hash_variant(build):
    for variant in sorted(build.iterdir()):
        raw = read_metadata(variant)["digest"]
        assert raw["algorithm"] == "sha256"
        assert raw["files"] == Digest.hash_variant(DigestAlgorithm.SHA256, variant).files, variant.name
        assert set(raw["files"]) == set(tree(variant)) - {"metadata.json"}


def test_ids_and_namespaces_of_a_clean_build(build, source):
    rev = git(source, "rev-parse", "HEAD").strip()[:7]
    version = tomllib.loads((source / "build.toml").read_text())["general"]["version"]
    for variant in sorted(build.iterdir()):
        backend = "cpu" if variant.name == "torch-cpu" else "cuda"
        expected = f"_fused_kernels_{backend}_{rev}"
        assert read_metadata(variant)["id"] == expected
        assert ops_name(variant) == expected
        assert build_info(variant) == {"BACKEND": backend, "VARIANT": variant.name, "VERSION": version,
                                       "COMMIT": git(source, "rev-parse", "HEAD").strip(), "DIRTY": False}


def test_dirty_iff_the_tree_has_changes(source, tmp_path):
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(source), str(clone))
    rev = git(clone, "rev-parse", "HEAD").strip()[:7]

    # An ignored path (the default output build/) does not make the tree dirty, even after a build.
    for _ in range(2):
        run_tool("build", "--source", str(clone), "--only", "torch-cpu", "torch-cuda")
    assert read_metadata(clone / "build" / "torch-cpu")["id"] == f"_fused_kernels_cpu_{rev}"

    (clone / "NOTES.txt").write_text("an untracked file\n")
    out = tmp_path / "dirty-build"
    run_tool("build", "--source", str(clone), "--out", str(out), "--only", "torch-cpu", "torch-cuda")
    for name, backend in (("torch-cpu", "cpu"), ("torch-cuda", "cuda")):
        metadata = read_metadata(out / name)
        assert metadata["id"] == ops_name(out / name) == f"_fused_kernels_{backend}_{rev}_dirty"
        assert metadata["provenance"]["kernel"]["dirty"] is True
        assert build_info(out / name)["DIRTY"] is True


def test_stale_generated_files_and_bytecode_in_the_source_are_not_copied(source, tmp_path):
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(source), str(clone))
    package = clone / "torch-ext" / "fused_kernels"
    (package / "_ops.py").write_text('_OPS_NAME = "_fused_kernels_cuda_stale"\n')  # ignored by .gitignore
    (package / "_build_info.py").write_text('BACKEND = "stale"\n')
    (package / "__pycache__").mkdir(exist_ok=True)
    (package / "__pycache__" / "layers.cpython-311.pyc").write_bytes(b"\0")
    (clone / "kernels_src" / "__pycache__").mkdir(exist_ok=True)
    (clone / "kernels_src" / "__pycache__" / "rms_norm.cpython-311.pyc").write_bytes(b"\0")
    run_tool("build", "--source", str(clone), "--out", str(tmp_path / "out"), "--only", "torch-cpu", "torch-cuda")
    rev = git(clone, "rev-parse", "HEAD").strip()[:7]
    for name, backend in (("torch-cpu", "cpu"), ("torch-cuda", "cuda")):
        variant = tmp_path / "out" / name
        assert ops_name(variant) == f"_fused_kernels_{backend}_{rev}"  # generated, and the tree is still clean
        assert build_info(variant)["BACKEND"] == backend
        assert not [rel for rel in tree(variant) if "__pycache__" in rel or rel.endswith(".pyc")]


def test_a_source_without_git_fails_clearly(source, tmp_path):
    exported = tmp_path / "exported"
    shutil.copytree(source, exported, ignore=shutil.ignore_patterns(".git"))
    proc = run_tool("build", "--source", str(exported), "--out", str(tmp_path / "out"), check=False)
    assert proc.returncode != 0
    assert "not a git checkout" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()

    # An exported tree (e.g. a Nix flake source) names its revision explicitly, as flake.nix does.
    commit = "0123456789abcdef0123456789abcdef01234567"
    run_tool("build", "--source", str(exported), "--out", str(tmp_path / "out"), "--only", "torch-cpu",
             "--commit", commit, "--dirty")
    assert read_metadata(tmp_path / "out" / "torch-cpu")["id"] == "_fused_kernels_cpu_0123456_dirty"
    assert read_metadata(tmp_path / "out" / "torch-cpu")["provenance"]["kernel"] == {"commit": commit, "dirty": True}
    proc = run_tool("build", "--source", str(exported), "--out", str(tmp_path / "out2"), "--dirty", check=False)
    assert proc.returncode != 0 and "--dirty needs --commit" in proc.stderr


def test_builds_are_byte_identical(source, build, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for out in (first, second, second):  # the third run replaces the second build in place
        run_tool("build", "--source", str(source), "--out", str(out))
    assert tree(first) == tree(second) == tree(build)


def test_only_and_removal_of_stale_variants(source, tmp_path):
    """A variant of ours that the matrix no longer produces goes; directories that are not ours stay."""
    out = tmp_path / "out"

    def variant_dir(name, metadata):
        path = out / name
        path.mkdir(parents=True)
        (path / "__init__.py").write_text("")
        if metadata is not None:
            (path / "metadata.json").write_text(metadata)

    variant_dir("torch299-cxx11-cu999-x86_64-linux", json.dumps({"name": "fused-kernels", "version": 1}))
    kept = {"torch298-cxx11-cu999-x86_64-linux": json.dumps({"name": "another-kernel"}),  # another kernel's
            "torch297-cxx11-cu999-x86_64-linux": None,  # no metadata: not a build's output
            "torch296-cxx11-cu999-x86_64-linux": "[1]",  # not metadata
            "my-notes": json.dumps({"name": "fused-kernels"})}  # not a variant name
    for name, metadata in kept.items():
        variant_dir(name, metadata)
    run_tool("build", "--source", str(source), "--out", str(out), "--only", "torch-cpu")
    assert sorted(p.name for p in out.iterdir()) == sorted(["torch-cpu", *kept])

    proc = run_tool("build", "--source", str(source), "--out", str(out), "--only", "torch299-cu999", check=False)
    assert proc.returncode != 0 and "torch299-cu999" in proc.stderr and "not produced by the matrix" in proc.stderr


def test_a_failed_build_leaves_previous_variants_whole(source, tmp_path, monkeypatch):
    import fused_kernels_tools.build as builder
    from fused_kernels_tools.errors import ToolError
    from fused_kernels_tools.gitrev import SourceRevision

    out = tmp_path / "out"
    builder.build(source, out, ["torch-cpu"], SourceRevision("1" * 40, False))
    before = tree(out)

    real_write_variant = builder.write_variant

    def failing_write_variant(dest, variant, *args):
        if variant.name == "torch-cuda":
            (dest / "half-written.py").parent.mkdir(parents=True)
            (dest / "half-written.py").write_text("")
            raise ToolError("simulated failure while writing torch-cuda")
        real_write_variant(dest, variant, *args)

    monkeypatch.setattr(builder, "write_variant", failing_write_variant)
    with pytest.raises(ToolError, match="simulated failure"):
        builder.build(source, out, ["torch-cpu", "torch-cuda"])
    assert tree(out) == before  # torch-cpu still the old build, no torch-cuda, no temporary directory
    assert sorted(p.name for p in out.iterdir()) == ["torch-cpu"]


# Simulated systems -> the variant kernels' own resolver picks from the real build.
SYSTEMS = [
    ("2.11", CUDA(Version("13.0")), "x86_64", "torch211-cxx11-cu130-x86_64-linux"),
    ("2.11", CUDA(Version("12.8")), "x86_64", "torch211-cxx11-cu128-x86_64-linux"),
    ("2.11", CUDA(Version("12.9")), "x86_64", "torch211-cxx11-cu128-x86_64-linux"),
    ("2.12", CUDA(Version("13.2")), "x86_64", "torch212-cxx11-cu132-x86_64-linux"),
    ("2.13", CUDA(Version("13.0")), "aarch64", "torch213-cxx11-cu130-aarch64-linux"),
    ("2.16", CUDA(Version("13.0")), "x86_64", "torch-cuda"),  # no arch variant for this torch
    ("2.11", CUDA(Version("12.4")), "x86_64", "torch-cuda"),  # no CUDA 12.x variant old enough
    ("2.13", CPU(), "x86_64", "torch-cpu"),
]


@pytest.mark.parametrize("torch_version, backend, cpu, expected", SYSTEMS,
                         ids=[f"torch{t}-{b.variant_str}-{c}" for t, b, c, _ in SYSTEMS])
def test_variant_selection_for_simulated_systems(build, torch_version, backend, cpu, expected):
    accepted, _ = _resolve_variant_for_system(
        variants=get_variants_local(build), selected_backend=backend, cpu=cpu, os="linux",
        torch_version=Version(torch_version), torch_cxx11_abi=True, tvm_ffi_version=None)
    assert accepted and accepted[0].variant_str == expected


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), (10, 0), (12, 0)])
def test_check_arch_accepts_ampere_hopper_blackwell(build, capability, monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    for name, archs in ARCH_VARIANTS.items():
        assert _supports_cuda_capability(archs, capability), (name, archs)
        ArchValidator().validate_metadata(metadata=Metadata.read_from_file(build / name / "metadata.json"), variant=name)


def test_check_arch_is_a_real_check(build, monkeypatch):
    """Control for the test above: a pre-Ampere device (7.5) is refused by every arch variant."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (7, 5))
    name = "torch211-cxx11-cu130-x86_64-linux"
    with pytest.raises(RuntimeError, match="does not support the current device"):
        ArchValidator().validate_metadata(metadata=Metadata.read_from_file(build / name / "metadata.json"), variant=name)


LOAD_SCRIPT = """
import json
from pathlib import Path
import kernels, torch
result = {}
local = kernels.get_local_kernel(Path(BUILD))
result["get_local_kernel"] = [Path(local.__file__).parent.name, local.__name__]
hub = kernels.get_kernel("myorg/fused-kernels", version=1)
result["get_kernel"] = [Path(hub.__file__).parent.name, hub.__name__]
cuda = kernels.get_local_kernel(Path(BUILD) / "torch-cuda")
result["torch-cuda dir"] = [Path(cuda.__file__).parent.name, cuda.__name__]
result["layers"] = [hasattr(m, "layers") for m in (local, hub, cuda)]
result["cuda initialised"] = torch.cuda.is_initialized()
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def loaded(build) -> dict:
    proc = python_subprocess(LOAD_SCRIPT.replace("BUILD", repr(str(build))),
                             env={"LOCAL_KERNELS": f"myorg/fused-kernels={build}", "HF_HUB_OFFLINE": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr
    return json.loads(lines[-1].removeprefix("RESULT "))


def expected_variant(build) -> str:
    """torch-cpu for a CPU torch; for a CUDA torch, its arch variant (``torch211-cxx11-cu130-x86_64-linux``)."""
    if TORCH_BACKEND == "cpu":
        return "torch-cpu"
    major, minor = torch.__version__.split(".")[:2]
    return f"torch{major}{minor}-cxx11-cu{torch.version.cuda.replace('.', '')}-{platform.machine()}-linux"


def test_get_local_kernel_picks_the_variant_of_this_torch(loaded, build):
    variant = expected_variant(build)
    assert loaded["get_local_kernel"] == [variant, read_metadata(build / variant)["id"]]


def test_local_kernels_get_kernel_picks_the_variant_of_this_torch(loaded, build):
    variant = expected_variant(build)
    assert loaded["get_kernel"] == [variant, read_metadata(build / variant)["id"]]


def test_torch_cuda_variant_directory_imports_without_a_gpu(loaded, build):
    assert loaded["torch-cuda dir"] == ["torch-cuda", read_metadata(build / "torch-cuda")["id"]]
    assert loaded["layers"] == [True, True, True]
    assert loaded["cuda initialised"] is False


def test_torch_cpu_variant_imports_with_triton_blocked(build):
    proc = python_subprocess(f"""
import sys
from pathlib import Path
from fused_kernels_tools.probe import TritonBlocker
sys.meta_path.insert(0, TritonBlocker())
try:
    import triton
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block triton")
import kernels
module = kernels.get_local_kernel(Path({str(build / 'torch-cpu')!r}))
assert hasattr(module, "layers")
assert not [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
print("IMPORTED", module.__name__)
""")
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED _fused_kernels_cpu_" in proc.stdout
