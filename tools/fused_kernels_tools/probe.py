"""Runtime checks of built variants, run by `check` in a separate interpreter:

    python -m fused_kernels_tools.probe --specs JSON [--jobs N]

JSON is a list of {"dir": VARIANT_DIR, "block_triton": bool, "layers": bool}. This process imports torch
and kernels once, then forks one fresh child per variant, so each variant is imported in its own process
(its own sys.modules and torch op registry) without paying torch's import again. The caller sets
CUDA_VISIBLE_DEVICES="". A child imports its variant with `kernels.get_local_kernel`, then checks that
CUDA was not initialised, the public API (`__all__`) and, with "layers", every layer class against
LAYER_TABLE. "block_triton" makes any `import triton` fail, as on a machine without Triton.
Prints one line per variant: `PROBE_RESULT {"dir": ..., "problems": [[file, message], ...]}`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

RESULT_MARKER = "PROBE_RESULT "


class TritonBlocker:
    """Meta-path finder that refuses `triton` and its submodules."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "triton" or fullname.startswith("triton."):
            raise ImportError(f"import of {fullname!r} blocked: this variant must work without Triton")
        return None


def _own(value, package: str) -> bool:
    module = getattr(value, "__name__" if inspect.ismodule(value) else "__module__", None) or ""
    return module == package or module.startswith(package + ".")


def check_public_api(module) -> list[tuple[str, str]]:
    names = getattr(module, "__all__", None)
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return [("__init__.py", "the package must define __all__ as a list of names")]
    problems = [("__init__.py", f"__all__ lists {n!r}, which the package does not define")
                for n in names if not hasattr(module, n)]
    if "layers" not in names:
        problems.append(("__init__.py", "'layers' is not in __all__ (and `from . import layers` is needed for Hub layers)"))
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or name in names:
            continue
        if (inspect.ismodule(value) or inspect.isclass(value) or inspect.isfunction(value)) and _own(value, module.__name__):
            kind = "submodule" if inspect.ismodule(value) else "class" if inspect.isclass(value) else "function"
            problems.append(("__init__.py", f"public {kind} {name!r} is not in __all__ (list it, or give it a leading underscore)"))
    return problems


def _missing_state(name: str, layer, original) -> list[str]:
    """The layer's forward runs bound to an instance of `original`: every attribute the layer declares as
    a bare annotation must exist there. Best effort: skipped when `original(8)` cannot be constructed."""
    declared = [a for a in getattr(layer, "__annotations__", {}) if a not in ("can_torch_compile", "has_backward")]
    try:
        instance = original(8)
    except Exception:
        return []
    return [f"layer {name} declares `{attr}`, but {original.__name__} instances have no such attribute"
            for attr in declared if not hasattr(instance, attr)]


def check_layers(module, variant_dir: Path) -> list[tuple[str, str]]:
    from kernels.layer.layer import _validate_layer

    from .layer_table import LAYER_TABLE

    layers = getattr(module, "layers", None)
    if not inspect.ismodule(layers):
        return [("__init__.py", "the package has no `layers` module attribute (add `from . import layers`)")]
    where = Path(inspect.getsourcefile(layers)).resolve().relative_to(variant_dir.resolve()).as_posix()
    classes = sorted((n, c) for n, c in vars(layers).items() if inspect.isclass(c) and c.__module__ == layers.__name__)
    if not classes:
        return [(where, "defines no layer classes")]
    problems = []
    for name, cls in classes:
        targets = LAYER_TABLE.get(name)
        if targets is None:
            problems.append((where, f"layer {name} is not in fused_kernels_tools/layer_table.py:"
                                    " add the transformers classes it replaces"))
            continue
        for target in targets:
            module_name, _, class_name = target.rpartition(".")
            try:
                original = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError) as e:
                problems.append((where, f"layer {name}: cannot import {target} from layer_table.py: {e}"))
                continue
            if not inspect.isclass(original) and hasattr(type(original), "kernel_layer_name"):
                # A kernelizable function: kernelize validates against the module class it was turned into.
                original = type(original)
            try:
                _validate_layer(check_cls=original, cls=cls, repo=f"layers.{name}")
            except TypeError as e:
                problems.append((where, f"layer {name} cannot replace {class_name}: {e}"))
                continue
            problems += [(where, message) for message in _missing_state(name, cls, original)]
    return problems


def _failure_location(error: BaseException, variant_dir: Path) -> tuple[str, str]:
    root = variant_dir.resolve()
    inside = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve().is_relative_to(root)]
    if not inside:
        return "__init__.py", ""
    return Path(inside[-1].filename).resolve().relative_to(root).as_posix(), f" (line {inside[-1].lineno})"


def probe(variant_dir: Path, block_triton: bool, layers: bool) -> list[tuple[str, str]]:
    """Import one variant and check it; meant to run in a process that has not imported it before."""
    import kernels
    import torch

    if block_triton:
        if any(m == "triton" or m.startswith("triton.") for m in sys.modules):
            return [("__init__.py", "cannot check the variant without Triton: triton was imported before it")]
        sys.meta_path.insert(0, TritonBlocker())
    try:
        module = kernels.get_local_kernel(variant_dir)
    except Exception as e:
        where, line = _failure_location(e, variant_dir)
        return [(where, f"import failed{line}: {type(e).__name__}: {e}")]
    problems = []
    if torch.cuda.is_initialized():
        problems.append(("__init__.py", "importing the variant initialised CUDA; keep device work out of import time"))
    problems += check_public_api(module)
    if layers:
        problems += check_layers(module, variant_dir)
    return problems


def _child(spec: dict, result_path: Path) -> None:
    try:
        problems = probe(Path(spec["dir"]), spec.get("block_triton", False), spec.get("layers", False))
    except BaseException as e:  # report, never propagate out of a forked child
        problems = [("__init__.py", f"import check crashed: {type(e).__name__}: {e}")]
    result_path.write_text(json.dumps(problems))


def run_all(specs: list[dict], jobs: int) -> dict[str, list]:
    """Fork one child per spec, at most `jobs` at a time; returns {dir: problems}."""
    import kernels  # noqa: F401  (imported once here, inherited by every child)
    import kernels.layer.layer  # noqa: F401
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA initialised before forking")
    results: dict[str, list] = {}
    pending = list(enumerate(specs))
    running: dict[int, tuple[dict, Path]] = {}
    with tempfile.TemporaryDirectory(prefix="fk-probe-") as tmp:
        while pending or running:
            while pending and len(running) < jobs:
                index, spec = pending.pop(0)
                result_path = Path(tmp) / f"{index}.json"
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    code = 0
                    try:
                        _child(spec, result_path)
                    except BaseException:
                        code = 1
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                running[pid] = (spec, result_path)
            pid, status = os.wait()
            spec, result_path = running.pop(pid)
            if result_path.is_file():
                results[spec["dir"]] = json.loads(result_path.read_text())
            else:
                results[spec["dir"]] = [("__init__.py", f"import check died ({_describe(status)})")]
    return results


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fused_kernels_tools.probe")
    parser.add_argument("--specs", required=True, help="JSON list of {dir, block_triton, layers}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    sys.dont_write_bytecode = True  # never leave __pycache__ in the build
    for variant_dir, problems in run_all(json.loads(args.specs), max(1, args.jobs)).items():
        print(RESULT_MARKER + json.dumps({"dir": variant_dir, "problems": problems}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
