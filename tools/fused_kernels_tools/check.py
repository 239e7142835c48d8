"""`check`: verify a build directory against docs/architecture.md and what `kernels` 0.17.2 accepts.

Static checks (metadata, digest, generated files, AST rules) run in this process. The import checks run
in one separate interpreter that imports torch once and forks a fresh child process per variant
(`probe.py`), in parallel, without a GPU.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kernels._rust import Digest, DigestAlgorithm, DigestValidationError, Metadata
from kernels.archs import _parse_cuda_arch, _supports_cuda_capability
from kernels.python_deps import _DEPENDENCY_DATA, validate_variant_dependencies
from kernels.variants import ArchVariant, parse_variant

from . import probe as probe_module
from .rules import check_python_source

TOOLS_DIR = Path(__file__).resolve().parent.parent
PROBE_TIMEOUT_S = 600


@dataclass(frozen=True)
class Problem:
    where: str  # "<variant>/<file>[:line]", "<entry>" in the build directory, "" for the whole build
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


@dataclass
class VariantReport:
    name: str
    path: Path
    metadata: Metadata | None = None
    problems: list[Problem] = field(default_factory=list)

    def add(self, file: str, message: str, line: int | None = None) -> None:
        suffix = f":{line}" if line else ""
        self.problems.append(Problem(f"{self.name}/{file}{suffix}", message))

    @property
    def backend(self) -> str | None:
        return str(self.metadata.backend.backend_type) if self.metadata else None

    def summary(self) -> str:
        m = self.metadata
        archs = ",".join(m.backend.archs or []) or "-"
        files = len(m.digest.files) if m.digest else 0
        return f"ok {self.name}: id={m.id} version={m.version} backend={self.backend} archs={archs} files={files}"


def generated_constants(path: Path) -> dict[str, object]:
    """Module-level `NAME = <literal>` assignments of a generated file (none if it does not parse)."""
    values: dict[str, object] = {}
    try:
        body = ast.parse(path.read_bytes()).body
    except (SyntaxError, ValueError):
        return values
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError):
                pass
    return values


# The GPUs every CUDA arch variant must load on (check_arch accepts a plain "X.Y" arch on capabilities X.Y and up of
# major X), by the first CUDA version that supports them.
_REQUIRED_GPUS = (("Ampere", (8, 0), (11, 0)), ("Hopper", (9, 0), (11, 8)), ("Blackwell", (10, 0), (12, 8)))


def _required_capabilities(cuda_version) -> list[tuple[str, tuple[int, int]]]:
    return [(gpu, capability) for gpu, capability, since in _REQUIRED_GPUS
            if (cuda_version.major, cuda_version.minor) >= since]


def _check_metadata(report: VariantReport) -> None:
    path = report.path / "metadata.json"
    if not path.is_file():
        report.add("metadata.json", "missing")
        return
    try:
        report.metadata = metadata = Metadata.read_from_file(path)
    except ValueError as e:
        report.add("metadata.json", str(e))
        return
    try:
        validate_variant_dependencies(report.path)
    except (ValueError, ImportError) as e:
        report.add("metadata.json", f"python-depends: {e}")
    raw = json.loads(path.read_text())
    for key in ("kernel-depends", "digest", "provenance"):
        if key not in raw:
            report.add("metadata.json", f"no {key!r}")
    variant = parse_variant(report.name)
    archs = metadata.backend.archs or []
    if isinstance(variant, ArchVariant):
        if report.backend != variant.arch.backend.name:
            report.add("metadata.json", f"backend type {report.backend!r} does not match the variant name ({variant.arch.backend.name})")
        if not archs:
            report.add("metadata.json", "an arch variant must list backend.archs")
        for arch in archs:
            if _parse_cuda_arch(arch) is None:
                report.add("metadata.json", f"arch {arch!r} is not a CUDA capability check_arch understands")
        if variant.arch.backend.name == "cuda":
            for gpu, capability in _required_capabilities(variant.arch.backend.version):
                if not _supports_cuda_capability(archs, capability):
                    report.add("metadata.json", f"archs {archs} make kernels' check_arch refuse {gpu} GPUs "
                                                f"(capability {capability[0]}.{capability[1]}), which CUDA "
                                                f"{variant.arch.backend.version} supports")
    else:
        if report.backend != variant.arch.backend_name:
            report.add("metadata.json", f"backend type {report.backend!r} does not match the variant name ({variant.arch.backend_name})")
        if archs:
            report.add("metadata.json", f"a noarch variant must not list archs (has {archs})")
    if metadata.digest is not None:
        if metadata.digest.algorithm != DigestAlgorithm.SHA256:
            report.add("metadata.json", f"digest algorithm is {metadata.digest.algorithm}, expected sha256")
        actual = Digest.hash_variant(DigestAlgorithm.SHA256, report.path)
        try:
            metadata.digest.validate(actual)
        except DigestValidationError as e:
            for violation in e.violations:
                report.add(getattr(violation, "path", None) or "metadata.json", f"digest: {violation}")


def _check_generated(report: VariantReport) -> None:
    metadata = report.metadata
    provenance = metadata.provenance
    if provenance is None or provenance.kernel is None:
        report.add("metadata.json", "provenance.kernel (source commit and dirty flag) is missing")
        return
    commit, dirty = provenance.kernel.commit, provenance.kernel.dirty
    expected_id = f"_{metadata.name.python_name}_{report.backend}_{commit[:7]}{'_dirty' if dirty else ''}"
    if metadata.id != expected_id:
        report.add("metadata.json", f"id {metadata.id!r} should be {expected_id!r} (namespace from backend, commit, dirty)")
    for file, expected in (
        ("_ops.py", {"_OPS_NAME": metadata.id}),
        ("_build_info.py", {"BACKEND": report.backend, "VARIANT": report.name, "VERSION": metadata.version,
                            "COMMIT": commit, "DIRTY": dirty}),
    ):
        if not (report.path / file).is_file():
            report.add(file, "missing (generated by the builder)")
            continue
        values = generated_constants(report.path / file)
        for key, value in expected.items():
            if values.get(key, "<missing>") != value:
                report.add(file, f"{key} = {values.get(key, '<missing>')!r}, expected {value!r}")
    ops_source = (report.path / "_ops.py").read_bytes().decode(errors="replace") if (report.path / "_ops.py").is_file() else ""
    if "def add_op_namespace_prefix(" not in ops_source or "\nops = " not in ops_source:
        report.add("_ops.py", "must define `ops` and `add_op_namespace_prefix`")
    if not (report.path / "__init__.py").is_file():
        report.add("__init__.py", "missing: kernels imports <variant>/__init__.py")
    has_kernels = (report.path / "_kernels").exists()
    if report.backend == "cuda" and not (report.path / "_kernels" / "__init__.py").is_file():
        report.add("_kernels/__init__.py", "missing: CUDA variants ship kernels_src/ as _kernels/")
    if report.backend != "cuda" and has_kernels:
        report.add("_kernels", f"present in a {report.backend} variant; only CUDA variants ship Triton kernels")


def _check_files(report: VariantReport) -> None:
    python_name = report.metadata.name.python_name if report.metadata else "fused_kernels"
    extra_allowed = frozenset()
    if report.metadata:
        for dep in report.metadata.python_depends:
            for table in (_DEPENDENCY_DATA.general, *_DEPENDENCY_DATA.backends.values()):
                if dep in table:
                    extra_allowed |= {p.import_name for p in table[dep].python if p.import_name}
    for dirpath, dirnames, filenames in os.walk(report.path):
        rel_dir = Path(dirpath).relative_to(report.path)
        for d in dirnames:
            if d == "__pycache__":
                report.add((rel_dir / d).as_posix(), "bytecode cache in the build; builds must not contain __pycache__")
        for filename in sorted(filenames):
            rel = (rel_dir / filename).as_posix()
            path = Path(dirpath) / filename
            if filename.endswith(".pyc"):
                if "__pycache__" not in rel.split("/"):
                    report.add(rel, "compiled bytecode in the build")
            elif filename.endswith(".py"):
                text = path.read_bytes().decode("utf-8", errors="replace")
                for line, message in check_python_source(text, rel_path=rel, python_name=python_name,
                                                         extra_allowed=extra_allowed):
                    report.add(rel, message, line)
            elif filename.endswith(".json") and rel != "metadata.json":
                try:
                    json.loads(path.read_bytes())
                except ValueError as e:
                    report.add(rel, f"invalid JSON: {e}")


def check_variant(path: Path) -> VariantReport:
    report = VariantReport(path.name, path)
    _check_metadata(report)
    if report.metadata is not None:
        _check_generated(report)
    _check_files(report)
    return report


def _check_consistency(reports: list[VariantReport]) -> list[Problem]:
    problems = []
    parsed = [r for r in reports if r.metadata is not None]
    for attribute, describe in (
        (lambda m: m.version, "version"),
        (lambda m: str(m.name), "name"),
        (lambda m: (m.provenance.kernel.commit, m.provenance.kernel.dirty) if m.provenance and m.provenance.kernel else None,
         "source commit"),
    ):
        values = {r.name: attribute(r.metadata) for r in parsed}
        if len(set(values.values())) > 1:
            listing = ", ".join(f"{name}={value}" for name, value in sorted(values.items()))
            problems.append(Problem("", f"variants disagree on {describe} (metadata.json): {listing}"))
    return problems


def _run_probes(reports: list[VariantReport], with_layers: set[str], jobs: int | None) -> dict[str, list[Problem]]:
    """Import every variant in its own fresh process (see probe.py), without a GPU."""
    specs = [{"dir": str(r.path), "layers": r.name in with_layers,
              # the torch-cpu variant must work where Triton is not installed
              "block_triton": r.backend != "cuda"} for r in reports]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(TOOLS_DIR), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "fused_kernels_tools.probe", "--specs", json.dumps(specs),
               "--jobs", str(jobs or os.cpu_count() or 1)]
    found: dict[str, list[Problem]] = {}
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        output, failure = "", f"timed out after {PROBE_TIMEOUT_S} s"
    else:
        last_error = (result.stderr.strip().splitlines() or ["no output"])[-1]
        output, failure = result.stdout, f"exit {result.returncode}: {last_error}"
    for line in output.splitlines():
        if line.startswith(probe_module.RESULT_MARKER):
            entry = json.loads(line[len(probe_module.RESULT_MARKER):])
            name = Path(entry["dir"]).name
            found[name] = [Problem(f"{name}/{file}", message) for file, message in entry["problems"]]
    for r in reports:
        if r.name not in found:
            found[r.name] = [Problem(f"{r.name}/__init__.py", f"import check did not report ({failure})")]
    return found


def _layer_representatives(reports: list[VariantReport]) -> set[str]:
    """One variant per group whose code is identical except `_build_info.py` (which differs in VARIANT
    only, as the static checks verify): layer validation imports transformers, so it runs once per group."""
    groups: dict[tuple, list[VariantReport]] = {}
    for r in reports:
        files = tuple(sorted((k, v) for k, v in r.metadata.digest.files.items() if k != "_build_info.py"))
        groups.setdefault((r.backend, files), []).append(r)
    return {min(group, key=lambda r: (not r.name.startswith("torch-"), r.name)).name for group in groups.values()}


def check_build(build_dir: Path, *, runtime: bool = True, jobs: int | None = None) -> tuple[list[Problem], list[str]]:
    """Returns (problems, one summary line per variant without problems)."""
    if not build_dir.is_dir():
        return [Problem("", "build directory does not exist")], []
    problems: list[Problem] = []
    variant_dirs = []
    for entry in sorted(build_dir.iterdir()):
        if entry.name == "benchmarks" and entry.is_dir():
            continue  # kernel-builder's bundle layout: benchmarks/benchmark*.py beside the variants (published too)
        if not entry.is_dir():
            problems.append(Problem(entry.name, "stray file: build/ must contain only variant directories"))
            continue
        try:
            canonical = parse_variant(entry.name).variant_str == entry.name
        except ValueError as e:
            canonical, reason = False, str(e)
        else:
            reason = "does not round-trip through kernels' variant parser"
        if not canonical:
            problems.append(Problem(entry.name, f"not a variant name kernels can select ({reason})"))
            continue
        variant_dirs.append(entry)
    if not variant_dirs:
        problems.append(Problem("", "no variant directories"))
    reports = [check_variant(path) for path in variant_dirs]
    problems += _check_consistency(reports)
    if runtime:
        loadable = [r for r in reports if r.metadata is not None and r.metadata.digest is not None]
        if loadable:
            found = _run_probes(loadable, _layer_representatives(loadable), jobs)
            for report in loadable:
                report.problems += found[report.name]
    for report in reports:
        problems += report.problems
    summaries = [r.summary() for r in reports if not r.problems and r.metadata is not None]
    return problems, summaries
