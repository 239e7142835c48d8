"""Tooling for the fused-kernels Hub kernel repository: `python -m fused_kernels_tools build|check`.

The builder turns the source tree (build.toml, build-matrix.toml, torch-ext/, kernels_src/) into the
variant directories that `kernels` loads; the checker verifies a build against the contract in
docs/architecture.md. Neither imports the kernel package itself in this process.
"""

__version__ = "0.1.0"
