"""Shared fixtures: build the variants once per session and load them the way users do.

On a CUDA machine the kernel under test is the variant `kernels` selects for this system (an arch variant).
On a CPU machine it is the `torch-cuda` variant loaded from its directory, whose Triton kernels run on CPU
tensors under Triton's interpreter (`TRITON_INTERPRET=1`, set below before Triton is imported); the
`torch-cpu` variant (plain PyTorch) is tested separately through `fk_cpu`.
"""

import fcntl
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The backend `kernels` loads variants for: that of the torch build (a CUDA wheel is "cuda" even with no GPU).
TORCH_BACKEND = "cuda" if torch.version.cuda else "cpu"

if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

# Triton's CPU interpreter converts float32 to bfloat16 by truncation, not round-to-nearest-even as the GPU
# does, so bit-exact bfloat16 comparisons hold only on the GPU; elsewhere they allow one bfloat16 ulp.
EXACT_BF16_ROUNDING = ON_GPU


def run_tool(*args: str, cwd: Path = REPO_ROOT, check: bool = True, env: dict | None = None):
    """Run `python -m fused_kernels_tools ARGS` from the source tree; returns the CompletedProcess."""
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT / "tools"), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONPATH": python_path, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "fused_kernels_tools", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"fused_kernels_tools {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


class GivesNoGradient(torch.autograd.Function):
    """Sums its input, and its backward returns no gradient for it: downstream of an op's output, autograd then
    calls the op's backward with None for that output (a test that the op handles it)."""

    @staticmethod
    def forward(ctx, x):
        return x.float().sum()

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory) -> Path:
    """All variants of the current source tree, built by the real builder."""
    out = tmp_path_factory.mktemp("build")
    run_tool("build", "--out", str(out))
    return out


@pytest.fixture(scope="session")
def fk(build_dir):
    """The kernel module whose ops the numerical tests exercise (Triton kernels)."""
    import kernels

    if ON_GPU:
        return kernels.get_local_kernel(build_dir)
    return kernels.get_local_kernel(build_dir / "torch-cuda")


@pytest.fixture(scope="session")
def fk_cpu(build_dir):
    """The torch-cpu variant: the portable PyTorch implementation of every op."""
    import kernels

    return kernels.get_local_kernel(build_dir / "torch-cpu")


@pytest.fixture
def poisoned_empty():
    """Make every `torch.empty` return NaN-filled memory, so an output element the kernel forgot to write
    shows up as NaN instead of passing by luck."""
    import torch.utils.deterministic

    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was_deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = was_filling


@pytest.fixture(autouse=True)
def release_cached_gpu_memory():
    """Hand the caching allocator's free blocks back to the driver after every GPU test: otherwise a pytest-xdist
    worker keeps the peak of the largest test it ran (tens of GB after the int64-offset tests), and the other
    workers' tests run out of memory on a GPU they share."""
    yield
    if ON_GPU:
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def large_gpu_memory(tmp_path_factory):
    """For tests that need 10 GB or more of GPU memory: at most one of them runs at a time across the pytest-xdist
    workers (an exclusive lock on a file in the directory all workers share), so parallel runs fit on one GPU."""
    lock_path = tmp_path_factory.getbasetemp().parent / "large-gpu-memory.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            gc.collect()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
