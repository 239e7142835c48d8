"""Read build.toml and build-matrix.toml into the kernel's identity and the list of variants to emit."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kernels._rust import Build, KernelName
from kernels.archs import _parse_cuda_arch
from kernels.variants import parse_variant

from .errors import ToolError

MATRIX_FILE = "build-matrix.toml"
SUPPORTED_BACKENDS = ("cuda", "cpu")


@dataclass(frozen=True)
class KernelConfig:
    name: str  # kebab-case Hub name, e.g. "fused-kernels"
    python_name: str  # "fused_kernels": the torch-ext/ package directory
    version: int
    license: str
    backends: tuple[str, ...]
    pyext: tuple[str, ...]  # extensions (no dot) of package files copied into a variant


@dataclass(frozen=True)
class Variant:
    name: str  # the directory name under build/
    backend: str  # "cuda" or "cpu"
    archs: tuple[str, ...] = ()  # CUDA capabilities, arch variants only


def load_config(source: Path) -> KernelConfig:
    """Parse build.toml with kernels' own parser; read what the binding does not expose with tomllib."""
    try:
        build = Build.open(source)
    except ValueError as e:
        raise ToolError(f"{source / 'build.toml'}: {e}") from None
    with open(source / "build.toml", "rb") as f:
        toml = tomllib.load(f)
    general, noarch = toml["general"], toml.get("torch-noarch", {})
    backends = tuple(str(b) for b in build.general.backends)
    unsupported = sorted(set(backends) - set(SUPPORTED_BACKENDS))
    if unsupported:
        raise ToolError(f"build.toml: backends {unsupported} are not supported by this builder (only cuda, cpu)")
    version = general["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ToolError(f"build.toml: version must be a non-negative integer, got {version!r}")
    return KernelConfig(
        name=general["name"],
        python_name=KernelName(general["name"]).python_name,
        version=version,
        license=general["license"],
        backends=backends,
        pyext=tuple(noarch.get("pyext", ["py", "pyi"])),
    )


def _major_minor(text: str, what: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if not m:
        raise ToolError(f"{MATRIX_FILE}: {what} {text!r} is not MAJOR.MINOR")
    return int(m.group(1)), int(m.group(2))


def arch_variant_name(torch_version: str, cuda_version: str, platform: str) -> str:
    """`torch<MAJ><MIN>-cxx11-cu<MAJ><MIN>-<cpu>-<os>`, verified to round-trip through kernels' parser."""
    t_major, t_minor = _major_minor(torch_version, "torch version")
    c_major, c_minor = _major_minor(cuda_version, "CUDA version")
    name = f"torch{t_major}{t_minor}-cxx11-cu{c_major}{c_minor}-{platform}"
    try:
        parsed = parse_variant(name)
    except ValueError as e:
        raise ToolError(f"{MATRIX_FILE}: variant {name!r} does not parse: {e}") from None
    framework, backend = parsed.framework, parsed.arch.backend
    if (
        parsed.variant_str != name
        or (framework.version.major, framework.version.minor) != (t_major, t_minor)
        or (backend.version.major, backend.version.minor) != (c_major, c_minor)
    ):
        raise ToolError(
            f"{MATRIX_FILE}: torch {torch_version} / CUDA {cuda_version} cannot be encoded in a variant name"
            f" ({name!r} would parse as torch {framework.version}, CUDA {backend.version})"
        )
    return name


def load_variants(source: Path, config: KernelConfig) -> list[Variant]:
    """Every variant the matrix produces, in a fixed order: arch variants, then torch-cuda, then torch-cpu."""
    variants: list[Variant] = []
    if "cuda" in config.backends:
        with open(source / MATRIX_FILE, "rb") as f:
            matrix = tomllib.load(f)
        capabilities = matrix.get("cuda_capabilities", {})
        for cuda_version, archs in capabilities.items():
            unknown = [a for a in archs if _parse_cuda_arch(a) is None]
            if not archs or unknown:
                raise ToolError(f"{MATRIX_FILE}: cuda_capabilities {cuda_version!r} has unparseable archs {unknown}")
        for torch_version, cuda_versions in matrix.get("torch", {}).items():
            for cuda_version in cuda_versions:
                if cuda_version not in capabilities:
                    raise ToolError(f"{MATRIX_FILE}: CUDA {cuda_version} (torch {torch_version}) has no [cuda_capabilities] entry")
                for platform in matrix.get("platforms", []):
                    name = arch_variant_name(torch_version, cuda_version, platform)
                    variants.append(Variant(name, "cuda", tuple(capabilities[cuda_version])))
        variants.append(Variant("torch-cuda", "cuda"))
    if "cpu" in config.backends:
        variants.append(Variant("torch-cpu", "cpu"))
    names = [v.name for v in variants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ToolError(f"{MATRIX_FILE}: duplicate variants {duplicates}")
    return variants
