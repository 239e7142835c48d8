"""`python -m fused_kernels_tools check`: passes on the real build, fails loudly on each kind of corruption.

Corruptions are planted in copies of the real build's variants. Source-level corruptions are re-digested
(tooling_helpers.rehash) so that each test sees the problem it planted, not only a digest mismatch.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from tooling_helpers import copy_variants, read_metadata, rehash, run_tool, session_build, write_metadata

from fused_kernels_tools.check import check_build
from fused_kernels_tools.rules import check_python_source


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    return session_build(tmp_path_factory)


def static_problems(build_dir: Path) -> list[str]:
    problems, _ = check_build(build_dir, runtime=False)
    return [str(p) for p in problems]


def rules(text: str, rel_path: str = "ops.py") -> list[str]:
    return [message for _, message in check_python_source(textwrap.dedent(text), rel_path=rel_path,
                                                          python_name="fused_kernels")]


# ---------------------------------------------------------------------------------------------------------
# The real build
# ---------------------------------------------------------------------------------------------------------

def test_check_passes_on_the_real_build(build):
    proc = run_tool("check", str(build))
    ok_lines = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert sorted(line.split()[1].rstrip(":") for line in ok_lines) == sorted(p.name for p in build.iterdir())
    assert "ERROR" not in proc.stderr
    assert not list(build.rglob("__pycache__")), "the import checks must not leave bytecode in the build"


# ---------------------------------------------------------------------------------------------------------
# Static rules, on source text
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code", [
    """
    import torch
    @torch.library.custom_op("myns::rms_norm", mutates_args=())
    def f(x: torch.Tensor) -> torch.Tensor: ...
    """,
    """
    from torch.library import triton_op
    @triton_op("myns::rms_norm", mutates_args=())
    def f(x): ...
    """,
    """
    import torch.library as tl
    tl.register_fake(f"{NS}::rms_norm")(lambda x: x)
    """,
    """
    import torch
    NAME = "myns::rms_norm"
    torch.library.register_autograd(NAME, backward)
    """,
    """
    from torch import library
    library.define("myns::rms_norm(Tensor x) -> Tensor")
    library.impl(qualname="myns::rms_norm", types="cpu", func=f)
    """,
    """
    from torch.library import *
    register_kernel("myns::rms_norm", "cpu")(f)
    """,
    """
    import torch
    lib = torch.library.Library("myns", "DEF")
    """,
    """
    import torch
    @torch.library.custom_op(qualname("rms_norm"), mutates_args=())
    def f(x): ...
    """,
    """
    import torch
    register = torch.library.custom_op  # an alias made by assignment, not by import
    @register("myns::rms_norm", mutates_args=())
    def f(x): ...
    """,
    """
    import torch
    library = torch.library
    fake = library.register_fake
    fake("myns::rms_norm")(lambda x: x)
    """,
])
def test_registrations_must_use_the_namespace_prefix(code):
    problems = rules(code)
    assert problems and all("add_op_namespace_prefix" in p for p in problems), problems


def test_registrations_through_the_prefix_pass():
    assert rules("""
        import torch
        from torch.library import Library, custom_op, register_fake
        from ._ops import _OPS_NAME, add_op_namespace_prefix, ops

        @custom_op(add_op_namespace_prefix("rms_norm"), mutates_args=())
        def _rms_norm(x: torch.Tensor) -> torch.Tensor: ...

        _rms_norm.register_fake(lambda x: x)                 # method on the op object
        register_fake(add_op_namespace_prefix("other"))(f)
        NAME = add_op_namespace_prefix("third")
        torch.library.impl(NAME, "cpu")(f)
        torch.library.register_autograd(_rms_norm, backward)  # op object
        torch.library.register_vmap(ops.rms_norm.default, rule)
        lib = Library(_OPS_NAME, "FRAGMENT")
        lib.define("fourth(Tensor x) -> Tensor")             # namespaced by the Library
        """) == []


@pytest.mark.parametrize("code, rel_path, expected", [
    ("import fused_kernels", "x.py", "absolute self-import"),
    ("from fused_kernels.rms_norm import rms_norm", "x.py", "absolute self-import"),
    ("import kernels_src.rms_norm", "x.py", "absolute self-import"),
    ("from _kernels import rms_norm", "x.py", "absolute self-import"),
    ("import numpy", "x.py", "not the stdlib, torch, triton"),
    ("from transformers import AutoModel", "x.py", "not the stdlib, torch, triton"),
    ("import triton", "rms_norm.py", "outside _kernels/"),
    ("def f():\n    import triton.language as tl", "layers.py", "outside _kernels/"),
    ("from .. import x", "x.py", "above the package root"),
    ("from ... import x", "_kernels/x.py", "above the package root"),
    ("import triton\n@triton.autotune(configs=[], key=[])\ndef f(): ...", "_kernels/x.py", "triton.autotune"),
    ("from triton import autotune", "_kernels/x.py", "autotune"),
    ("import importlib\nimportlib.import_module('fused_kernels.rms_norm')", "x.py", "absolute self-import"),
    ("from importlib import import_module\nimport_module('fused_kernels')", "x.py", "absolute self-import"),
    ("__import__('kernels_src.rms_norm')", "x.py", "absolute self-import"),
    ("import importlib as il\nil.import_module('triton')", "rms_norm.py", "outside _kernels/"),
    ("import importlib\nimportlib.import_module('numpy')", "x.py", "not the stdlib, torch, triton"),
])
def test_import_and_autotune_rules(code, rel_path, expected):
    problems = rules(code, rel_path)
    assert any(expected in p for p in problems), problems


def test_allowed_imports_pass():
    assert rules("import os, math, functools\nimport torch.nn\nfrom . import layers\nfrom ._ops import ops") == []
    assert rules("import triton\nimport triton.language as tl\nfrom .. import _ops", "_kernels/rms_norm.py") == []
    assert rules("from __future__ import annotations\nfrom .rms_norm import x", "__init__.py") == []
    assert rules("import importlib\nimportlib.import_module('.rms_norm', __package__)\nimportlib.import_module('json')"
                 "\n__import__('rms_norm', globals(), None, ['x'], 1)") == []
    assert rules("import torch\nfrom ._ops import add_op_namespace_prefix\nregister = torch.library.custom_op\n"
                 "@register(add_op_namespace_prefix('x'), mutates_args=())\ndef f(x): ...") == []


# ---------------------------------------------------------------------------------------------------------
# Corrupted builds, static checks (in process)
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def cpu_build(build, tmp_path) -> Path:
    return copy_variants(build, tmp_path / "build", "torch-cpu")


def test_clean_copy_has_no_static_problems(cpu_build):
    assert static_problems(cpu_build) == []


def test_edited_file_is_a_digest_mismatch(cpu_build):
    with open(cpu_build / "torch-cpu" / "__init__.py", "a") as f:
        f.write("# edited after the build\n")
    (cpu_build / "torch-cpu" / "extra.py").write_text("")
    (cpu_build / "torch-cpu" / "layers.py").unlink()
    problems = static_problems(cpu_build)
    assert any(p.startswith("torch-cpu/__init__.py: digest: File hash mismatch for __init__.py") for p in problems)
    assert any(p.startswith("torch-cpu/extra.py: digest: Unknown file") for p in problems)
    assert any(p.startswith("torch-cpu/layers.py: digest: Missing file") for p in problems)


def test_literal_registration_in_a_build(cpu_build):
    variant = cpu_build / "torch-cpu"
    (variant / "bad_registration.py").write_text(
        'import torch\n\n@torch.library.custom_op("myns::bad_op", mutates_args=())\n'
        "def bad_op(x: torch.Tensor) -> torch.Tensor:\n    return x.clone()\n")
    rehash(variant)
    assert static_problems(cpu_build) == [
        "torch-cpu/bad_registration.py:3: torch.library.custom_op: literal op name 'myns::bad_op'; register ops"
        " through add_op_namespace_prefix(...) from ._ops so each build has its own namespace"]


def test_absolute_self_import_in_a_build(cpu_build):
    variant = cpu_build / "torch-cpu"
    (variant / "bad_import.py").write_text("from fused_kernels import layers\n")
    rehash(variant)
    problems = static_problems(cpu_build)
    assert len(problems) == 1 and problems[0].startswith("torch-cpu/bad_import.py:1: absolute self-import"), problems


def test_registration_and_self_import_in_other_spellings_in_a_build(cpu_build):
    """An op registered through an assigned alias of custom_op and a lazy importlib self-import both passed
    `check` (static and import checks): the op is imported without error and the self-import runs only
    when called."""
    variant = cpu_build / "torch-cpu"
    (variant / "sneaky.py").write_text(
        "import importlib\n\nimport torch\n\nregister = torch.library.custom_op\n\n\n"
        '@register("myns::sneaky", mutates_args=())\n'
        "def sneaky(x: torch.Tensor) -> torch.Tensor:\n    return x.clone()\n\n\n"
        "def lazy():\n    return importlib.import_module('fused_kernels.rms_norm')\n")
    rehash(variant)
    problems = static_problems(cpu_build)
    assert any(p.startswith("torch-cpu/sneaky.py:8: torch.library.custom_op: literal op name 'myns::sneaky'")
               for p in problems), problems
    assert any(p.startswith("torch-cpu/sneaky.py:14: absolute self-import of 'fused_kernels.rms_norm'")
               for p in problems), problems


def test_triton_in_the_cpu_variant_is_reported(cpu_build):
    variant = cpu_build / "torch-cpu"
    (variant / "uses_triton.py").write_text("import triton\n")
    rehash(variant)
    assert any("torch-cpu/uses_triton.py:1: imports 'triton' outside _kernels/" in p for p in static_problems(cpu_build))


def test_pycache_in_a_build(cpu_build):
    cache = cpu_build / "torch-cpu" / "__pycache__"
    cache.mkdir()
    (cache / "layers.cpython-311.pyc").write_bytes(b"\0")
    (cpu_build / "torch-cpu" / "stray.pyc").write_bytes(b"\0")
    problems = static_problems(cpu_build)
    assert any(p.startswith("torch-cpu/__pycache__: bytecode cache") for p in problems), problems
    assert any(p.startswith("torch-cpu/stray.pyc: compiled bytecode") for p in problems), problems


@pytest.mark.parametrize("edit, expected", [
    (lambda m: m.update(version="1"), 'invalid type: string "1", expected usize'),
    (lambda m: m.update(name="fused_kernels"), "torch-cpu/metadata.json: Cannot parse metadata"),
    (lambda m: m.pop("provenance"), "torch-cpu/metadata.json: no 'provenance'"),
    (lambda m: m.update(id="_fused_kernels_cpu_dev"), "torch-cpu/_ops.py: _OPS_NAME ="),
    (lambda m: m["backend"].update(type="cuda"), "does not match the variant name (cpu)"),
    (lambda m: m["backend"].update(archs=["8.0"]), "a noarch variant must not list archs"),
    (lambda m: m.update({"python-depends": ["triton"]}), "unsupported kernel dependency: triton"),
    (lambda m: m["digest"].update(algorithm="sha512"), "digest algorithm is"),
], ids=["version-string", "name", "no-provenance", "id", "backend-type", "noarch-archs", "python-depends", "algorithm"])
def test_bad_metadata_field(cpu_build, edit, expected):
    metadata = read_metadata(cpu_build / "torch-cpu")
    edit(metadata)
    write_metadata(cpu_build / "torch-cpu", metadata)
    problems = static_problems(cpu_build)
    assert any(expected in p for p in problems), problems


def test_arch_variant_without_archs_and_version_disagreement(build, tmp_path):
    out = copy_variants(build, tmp_path / "build", "torch-cpu", "torch211-cxx11-cu130-x86_64-linux")
    arch = out / "torch211-cxx11-cu130-x86_64-linux"
    metadata = read_metadata(arch)
    del metadata["backend"]["archs"]
    built, changed = metadata["version"], metadata["version"] + 1
    metadata["version"] = changed
    write_metadata(arch, metadata)
    problems = static_problems(out)
    assert "torch211-cxx11-cu130-x86_64-linux/metadata.json: an arch variant must list backend.archs" in problems
    assert any(p.startswith(f"variants disagree on version (metadata.json): torch-cpu={built}, torch211-")
               for p in problems), problems
    assert any(f"torch211-cxx11-cu130-x86_64-linux/_build_info.py: VERSION = {built}, expected {changed}" in p
               for p in problems)


@pytest.mark.parametrize("variant, archs, refused", [
    ("torch211-cxx11-cu130-x86_64-linux", ["8.0"], "Hopper GPUs (capability 9.0)"),
    ("torch211-cxx11-cu130-x86_64-linux", ["9.0a", "10.0"], "Ampere GPUs (capability 8.0)"),
    ("torch211-cxx11-cu130-x86_64-linux", ["8.0", "9.0"], "Blackwell GPUs (capability 10.0)"),
    ("torch211-cxx11-cu126-x86_64-linux", ["8.0", "8.6"], "Hopper GPUs (capability 9.0)"),
])
def test_archs_that_make_check_arch_refuse_a_supported_gpu(build, tmp_path, variant, archs, refused):
    """kernels' check_arch reads a plain "X.Y" as X.Y and up within major X, "X.Ya" as X.Y alone: archs that leave
    out a generation the variant's CUDA supports make get_kernel refuse those GPUs (the contract's pitfall 17). The
    build declares the right ones; check passed a variant edited to ["8.0"] (refused on H100/H200 and B200)."""
    out = copy_variants(build, tmp_path / "build", variant)
    metadata = read_metadata(out / variant)
    metadata["backend"]["archs"] = archs
    write_metadata(out / variant, metadata)
    rehash(out / variant)
    problems = static_problems(out)
    assert any(p.startswith(f"{variant}/metadata.json: archs {archs} make kernels' check_arch refuse {refused}")
               for p in problems), problems


def test_stray_entries_in_the_build_directory(cpu_build):
    (cpu_build / "README.md").write_text("")
    (cpu_build / "cuda").mkdir()
    problems = static_problems(cpu_build)
    assert any(p.startswith("README.md: stray file") for p in problems), problems
    assert any(p.startswith("cuda: not a variant name") for p in problems), problems


def test_empty_or_missing_build_directory(tmp_path):
    assert static_problems(tmp_path) == ["no variant directories"]
    assert static_problems(tmp_path / "missing") == ["build directory does not exist"]


def test_cli_fails_loudly_with_one_line_per_problem(cpu_build):
    with open(cpu_build / "torch-cpu" / "layers.py", "a") as f:
        f.write("# edited\n")
    proc = run_tool("check", "--static-only", str(cpu_build), check=False)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR ")]
    assert errors == [f"ERROR {cpu_build}/torch-cpu/layers.py: digest: File hash mismatch for layers.py: "
                      + errors[0].split("layers.py: ", 2)[2]]
    assert proc.stderr.splitlines()[-1] == f"check failed: 1 problem(s) in {cpu_build}"


# ---------------------------------------------------------------------------------------------------------
# Corrupted builds, import checks (one CLI run in fresh processes per build)
# ---------------------------------------------------------------------------------------------------------

RUNTIME_CORRUPTIONS = {
    "__init__.py": """
        def public_helper():
            return 1
        """,
    "layers.py": """
        import torch as _torch_for_check_test


        class RMSNorm(_torch_for_check_test.nn.Module):
            def __init__(self):
                super().__init__()

            def forward(self, hidden_states):
                return hidden_states


        class GemmaRMSNorm(_torch_for_check_test.nn.Module):
            variance_epsilon: float

            def forward(self, x):
                return x


        class UnlistedLayer(_torch_for_check_test.nn.Module):
            def forward(self, x):
                return x


        class ApplyRotaryPosEmb(_torch_for_check_test.nn.Module):
            def forward(self, q, k, cos, sin):
                return q, k
        """,
}


@pytest.fixture(scope="module")
def runtime_check(build, tmp_path_factory) -> list[str]:
    out = copy_variants(build, tmp_path_factory.mktemp("runtime") / "build", "torch-cpu")
    variant = out / "torch-cpu"
    for file, code in RUNTIME_CORRUPTIONS.items():
        with open(variant / file, "a") as f:
            f.write(textwrap.dedent(code))
    rehash(variant)
    proc = run_tool("check", str(out), check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("ERROR ")]


def test_public_name_missing_from_all(runtime_check):
    assert any("torch-cpu/__init__.py: public function 'public_helper' is not in __all__" in line
               for line in runtime_check), runtime_check


def test_layer_with_an_init_is_rejected_by_kernels_validation(runtime_check):
    assert any("torch-cpu/layers.py: layer RMSNorm cannot replace LlamaRMSNorm: layers.RMSNorm must not override"
               " nn.Module constructor" in line for line in runtime_check), runtime_check


def test_layer_state_must_exist_on_the_replaced_class(runtime_check):
    assert any("layer GemmaRMSNorm declares `variance_epsilon`, but GemmaRMSNorm instances have no such attribute"
               in line for line in runtime_check), runtime_check


def test_layer_missing_from_the_table(runtime_check):
    assert any("torch-cpu/layers.py: layer UnlistedLayer is not in fused_kernels_tools/layer_table.py" in line
               for line in runtime_check), runtime_check


def test_function_layer_is_validated_against_the_kernelizable_function(runtime_check):
    """transformers' `apply_rotary_pos_emb` is a function turned into a module; the layer must match its arity."""
    assert any("torch-cpu/layers.py: layer ApplyRotaryPosEmb cannot replace apply_rotary_pos_emb: Forward signature"
               " of layers.ApplyRotaryPosEmb does not match" in line and "different number of arguments" in line
               for line in runtime_check), runtime_check


def test_cpu_variant_that_needs_triton_at_import_fails(build, tmp_path):
    """An import the static rules cannot see: the Triton blocker in the import check catches it."""
    out = copy_variants(build, tmp_path / "build", "torch-cpu")
    variant = out / "torch-cpu"
    (variant / "sneaky.py").write_text("import importlib\n\nimportlib.import_module('tri' + 'ton')\n")
    with open(variant / "__init__.py", "a") as f:
        f.write("\nfrom . import sneaky as _sneaky\n")
    rehash(variant)
    proc = run_tool("check", str(out), check=False)
    assert proc.returncode == 1
    assert "ERROR " + str(out) + "/torch-cpu/sneaky.py: import failed (line 3): ImportError: import of 'triton'" \
        " blocked" in proc.stderr, proc.stderr
