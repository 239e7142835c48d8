"""The cached launch path (kernels_src/_launch.py) must pick exactly the compiled kernel Triton itself would.

GPU only: under the CPU interpreter every launch goes through Triton, so there is no cache to check.
"""

import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from conftest import ON_GPU

pytestmark = pytest.mark.skipif(not ON_GPU, reason="the launch cache is used only on CUDA devices")


def _triton_specialisation(kernel, args, constexprs, num_warps):
    """Triton's own specialisation of these arguments (what its compile cache is keyed on)."""
    binder = kernel.device_caches[torch.cuda.current_device()][-1]
    _, specialization, options = binder(*args, **constexprs, num_warps=num_warps)
    return repr(specialization), repr(options)


def test_key_separates_every_triton_specialisation(fk):
    launch = fk._kernels._launch
    kernel = fk._kernels.rms_norm._column_sum_kernel
    constexprs = {"BLOCK_ROWS": 16, "BLOCK_COLS": 32}
    storage = torch.zeros(4096 + 8, device="cuda")
    seen = {}
    # Aligned and misaligned pointers; integers that are 1, multiples of 16, neither, and beyond int32.
    for offset, rows, cols in itertools.product((0, 1, 4), (1, 16, 17, 2**31 + 16), (1, 32, 33)):
        args = (storage[offset:], storage[offset + 1:], rows, cols)
        ours = launch._args_key(args)
        theirs = _triton_specialisation(kernel, args, constexprs, 8)
        assert seen.setdefault(ours, theirs) == theirs, f"one launch key for two Triton specialisations: {args[2:]}"


@pytest.mark.parametrize("offset", [0, 1])
def test_cached_launch_matches_first_launch(fk, offset):
    """The first call compiles through Triton, later calls use the cached kernel: same results, also when the
    pointers' alignment (part of the key) changes between calls."""
    launch = fk._kernels._launch
    kernel = fk._kernels.rms_norm._column_sum_kernel
    for n_rows, n_cols in [(37, 45), (37, 45), (200, 64), (200, 64)]:
        partial = torch.randn(n_rows * n_cols + offset, device="cuda")[offset:].view(n_rows, n_cols)
        out = torch.full((n_cols + offset,), float("nan"), device="cuda")[offset:]
        launch.launch(kernel, (2,), (partial, out), (n_rows, n_cols), {"BLOCK_ROWS": 16, "BLOCK_COLS": 32}, 4)
        torch.testing.assert_close(out, partial.double().sum(0).float(), rtol=1e-5, atol=1e-5)


def test_value_memo_serves_new_values_and_alignments(fk, monkeypatch):
    """Calls with new scalar values of a known specialisation (45 and 47 columns: neither 1 nor a multiple of 16), with
    values of another (64 columns, a multiple of 16, which the compiled kernel may assume) and with pointers that
    change alignment run right, through the value memo and after it empties itself."""
    launch = fk._kernels._launch
    kernel = fk._kernels.rms_norm._column_sum_kernel
    monkeypatch.setattr(launch, "_BY_VALUE_LIMIT", 3)
    monkeypatch.setattr(launch, "_by_value", {})  # earlier tests' entries, beyond the limit
    calls = [(37, 64, 0), (37, 45, 0), (37, 47, 0), (37, 64, 1), (19, 47, 1), (37, 45, 0), (37, 64, 0), (37, 47, 1)]
    for n_rows, n_cols, offset in calls * 2:
        partial = torch.randn(n_rows * n_cols + offset, device="cuda")[offset:].view(n_rows, n_cols)
        out = torch.full((n_cols + offset,), float("nan"), device="cuda")[offset:]
        launch.launch(kernel, (2,), (partial, out), (n_rows, n_cols), {"BLOCK_ROWS": 16, "BLOCK_COLS": 32}, 4)
        torch.testing.assert_close(out, partial.double().sum(0).float(), rtol=1e-5, atol=1e-5)
        assert len(launch._by_value) <= 3


def test_scalars_must_be_numbers(fk):
    """A tensor among the scalars (their values key the memo) is refused, naming the kernel."""
    launch = fk._kernels._launch
    kernel = fk._kernels.rms_norm._column_sum_kernel
    partial, out = torch.zeros(4, 4, device="cuda"), torch.zeros(4, device="cuda")
    with pytest.raises(TypeError, match="_column_sum_kernel's scalars must be ints, floats or bools"):
        launch.launch(kernel, (1,), (partial,), (out, 4, 4), {"BLOCK_ROWS": 16, "BLOCK_COLS": 32}, 4)


@triton.jit
def _copy_tile_kernel(source, out_ptr, n_cols, BLOCK: tl.constexpr):
    """out[:BLOCK, :BLOCK] = one (BLOCK, BLOCK) box of ``source`` at (0, 0), zero past its extent (``n_cols``: an
    integer argument beside the descriptor, as the attention kernels have)."""
    tile = source.load([0, 0])
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets[:, None] * BLOCK + offsets[None, :], tile.to(out_ptr.dtype.element_ty))


def test_descriptor_keys_separate_every_triton_specialisation(fk):
    """Host tensor descriptors (the flash-attention passes' streamed tiles): element type, box and extents that
    Triton specialises on give different keys, and the cached launch reads through the right descriptor."""
    launch = fk._kernels._launch
    seen = {}
    for dtype, rows, cols in itertools.product((torch.float16, torch.bfloat16, torch.float32), (16, 24), (16, 32)):
        source = torch.randn(rows, cols, device="cuda", dtype=dtype)
        for block in (16, 32):
            descriptor = TensorDescriptor(source, [rows, cols], [cols, 1], [block, block])
            out = torch.full((block, block), float("nan"), device="cuda")
            args = (descriptor, out, cols)
            ours = launch._args_key(args)
            theirs = _triton_specialisation(_copy_tile_kernel, args, {"BLOCK": block}, 4)
            assert seen.setdefault(ours, theirs) == theirs, f"one key for two specialisations: {dtype} {block}"
            for _ in range(2):  # the first launch compiles through Triton, the second uses the cache
                out.fill_(float("nan"))
                launch.launch(_copy_tile_kernel, (1,), args[:2], args[2:], {"BLOCK": block}, 4)
                expected = torch.zeros(block, block, device="cuda")
                expected[:min(rows, block), :min(cols, block)] = source[:block, :block].float()
                assert torch.equal(out, expected)


def test_constexprs_must_follow_runtime_arguments(fk):
    launch = fk._kernels._launch
    kernel = fk._kernels.rms_norm._column_sum_kernel
    partial, out = torch.zeros(4, 4, device="cuda"), torch.zeros(4, device="cuda")
    with pytest.raises(ValueError, match="runtime arguments in order"):
        launch.launch(kernel, (1,), (partial, out), (4, 4), {"BLOCK_COLS": 32, "BLOCK_ROWS": 16}, 4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_launches_on_the_tensors_device(fk):
    """A kernel runs on its tensors' GPU even when another GPU is current (a model split across GPUs)."""
    launch = fk._kernels._launch
    kernel = fk._kernels.rms_norm._column_sum_kernel
    partial = torch.randn(37, 45, device="cuda:1")
    for _ in range(2):  # the first launch compiles through Triton, the second uses the cache
        out = torch.full((45,), float("nan"), device="cuda:1")
        with torch.cuda.device(0):
            launch.launch(kernel, (2,), (partial, out), (37, 45), {"BLOCK_ROWS": 16, "BLOCK_COLS": 32}, 4)
        torch.testing.assert_close(out, partial.double().sum(0).float(), rtol=1e-5, atol=1e-5)
