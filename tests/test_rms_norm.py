"""RMSNorm and fused residual-add RMSNorm: numerics, layouts, gradients, errors, compile and layers.

The same tests run on the CPU (Triton interpreter, small shapes) and compiled on a GPU (realistic shapes).
"""

import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE, EXACT_BF16_ROUNDING, ON_GPU
from numerics import assert_close_ratio, rel_err

MODES = ("llama", "gemma", "plain")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS = 1e-6

# Row lengths covering one-block rows, odd sizes and the chunked (looped) path of the device's launch table.
if ON_GPU:
    SHAPES = [(4096, 4096), (3, 1000, 2048), (512, 5000), (17, 8193), (1024, 16384), (64, 20000), (8, 65536),
              (2, 131075)]
else:
    SHAPES = [(5, 1), (3, 7), (2, 3, 64), (9, 300), (4, 1000), (3, 1537)]


# ----------------------------------------------------------------------------------------------------------
# References, written independently of the kernels.
# ----------------------------------------------------------------------------------------------------------

def reference_float64(x, weight, eps, mode, residual=None):
    """The exact function in float64: returns (y, h) with h = x + residual (or x)."""
    h = x.double() if residual is None else x.double() + residual.double()
    y = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.double() + 1.0 if mode == "gemma" else weight.double())
    return y, h


def reference_module(x, weight, eps, mode, residual=None):
    """What the replaced Hugging Face / PyTorch module computes in the input dtype (the error baseline)."""
    h = x if residual is None else x + residual
    if mode == "plain":
        return torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, eps), h
    h32 = h.float()
    normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    if mode == "llama":
        y = normed.to(h.dtype)
        return (weight * y if weight is not None else y), h
    y = normed * (1.0 + weight.float()) if weight is not None else normed
    return y.type_as(h), h


def make_inputs(shape, dtype, with_weight, with_residual, device=DEVICE):
    x = torch.randn(shape, device=device, dtype=dtype)
    weight = (1.0 + 0.5 * torch.randn(shape[-1], device=device)).to(dtype) if with_weight else None
    residual = torch.randn(shape, device=device, dtype=dtype) if with_residual else None
    return x, weight, residual


def leaf(t):
    """``t`` as a leaf that requires grad, with its strides (``clone`` would make a row slice contiguous)."""
    return None if t is None else t.detach().requires_grad_(True)


def run_ours(fk, x, weight, residual, mode, dy, d_res=None):
    """Forward + backward through our op; returns outputs and gradients."""
    x, weight, residual = leaf(x), leaf(weight), leaf(residual)
    if residual is None:
        y, h = fk.rms_norm(x, weight, EPS, mode), None
        y.backward(dy)
    else:
        y, h = fk.fused_add_rms_norm(x, residual, weight, EPS, mode)
        torch.autograd.backward([y, h], [dy, d_res])
    grads = [t.grad if t is not None else None for t in (x, weight, residual)]
    return y, h, grads


def check_against_references(fk, shape, dtype, mode, with_weight, with_residual, transform=None, device=DEVICE):
    x, weight, residual = make_inputs(shape, dtype, with_weight, with_residual, device)
    if transform is not None:
        x = transform(x)
        residual = transform(residual) if residual is not None else None
    dy = torch.randn(x.shape, device=x.device, dtype=x.dtype)
    d_res = torch.randn(x.shape, device=x.device, dtype=x.dtype) if with_residual else None
    inputs_before = [t.clone() for t in (x, weight, residual, dy, d_res) if t is not None]

    y, h, (dx, dw, dr) = run_ours(fk, x, weight, residual, mode, dy, d_res)

    # Nothing the caller owns was written.
    for before, after in zip(inputs_before, [t for t in (x, weight, residual, dy, d_res) if t is not None]):
        assert torch.equal(before, after), "an input or incoming gradient was modified"

    # Float64 reference with autograd for the exact gradients.
    xr, wr, rr = (leaf(t.double()) if t is not None else None for t in (x, weight, residual))
    y_ref, h_ref = reference_float64(xr, wr, EPS, mode, rr)
    torch.autograd.backward([y_ref] + ([h_ref] if with_residual else []),
                            [dy.double()] + ([d_res.double()] if with_residual else []))

    # PyTorch eager in the input dtype: the error baseline.
    xb, wb, rb = leaf(x), leaf(weight), leaf(residual)
    y_base, h_base = reference_module(xb, wb, EPS, mode, rb)
    torch.autograd.backward([y_base] + ([h_base] if with_residual else []),
                            [dy] + ([d_res] if with_residual else []))

    # dx is a difference of terms of size |rstd * g|; judge its rounding against that size.
    h64 = h_ref.detach()
    rstd64 = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS)
    g64 = dy.double() * (1.0 + weight.double() if mode == "gemma" else weight.double()) if with_weight else dy.double()
    dx_scale = (rstd64 * g64).norm().item()

    assert y.dtype == y_base.dtype and y.shape == x.shape
    assert_close_ratio("y", y, y_base, y_ref, 2.0, dtype)
    assert_close_ratio("dx", dx, xb.grad, xr.grad, 3.0, dtype, scale=dx_scale)
    if with_weight:
        assert dw.dtype == weight.dtype
        assert_close_ratio("dweight", dw, wb.grad, wr.grad, 3.0, dtype)
    if with_residual:
        assert_rounded_equal(h, h_base, "the residual output must equal x + residual in the input dtype")
        assert_close_ratio("dresidual", dr, rb.grad, rr.grad, 3.0, dtype, scale=dx_scale)


def assert_rounded_equal(ours, expected, message):
    if ours.dtype == torch.bfloat16 and not EXACT_BF16_ROUNDING:
        torch.testing.assert_close(ours.float(), expected.float(), rtol=2.0**-7, atol=0, msg=message)
    else:
        assert torch.equal(ours, expected), message


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_rms_norm_matches_references(fk, poisoned_empty, shape, dtype, mode):
    check_against_references(fk, shape, dtype, mode, with_weight=True, with_residual=False)


@pytest.mark.parametrize("shape", SHAPES[:: 2], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_fused_add_rms_norm_matches_references(fk, poisoned_empty, shape, dtype, mode):
    check_against_references(fk, shape, dtype, mode, with_weight=True, with_residual=True)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_weight(fk, poisoned_empty, dtype, with_residual):
    check_against_references(fk, SHAPES[-1], dtype, "plain", with_weight=False, with_residual=with_residual)


# Strided views the kernels must read in place.
LAYOUTS = {
    "transposed_leading": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
    "row_slice_of_wider": lambda t: torch.cat([t, t], dim=-1)[..., : t.shape[-1]],
    "column_stride_2": lambda t: torch.stack([t, t], dim=-1)[..., 0],
    "three_groups": lambda t: t.permute(2, 1, 0, 3).contiguous().permute(2, 1, 0, 3),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_strided_inputs(fk, poisoned_empty, layout, with_residual):
    shape = (3, 4, 5, 1000) if not ON_GPU else (4, 64, 32, 4096)
    check_against_references(fk, shape, torch.bfloat16, "llama", True, with_residual, LAYOUTS[layout])


def test_strided_incoming_gradient(fk):
    x, weight, _ = make_inputs((6, 8, 300), torch.float32, True, False)
    dy_wide = torch.randn(8, 6, 600, device=DEVICE)
    dy = dy_wide.transpose(0, 1)[..., :300]
    _, _, (dx, dw, _) = run_ours(fk, x, weight, None, "llama", dy)
    _, _, (dx_ref, dw_ref, _) = run_ours(fk, x, weight, None, "llama", dy.contiguous())
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    torch.testing.assert_close(dw, dw_ref, rtol=0, atol=0)


@settings(max_examples=12 if not ON_GPU else 40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    leading=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    hidden=st.integers(1, 1100 if not ON_GPU else 20000),
    dtype=st.sampled_from(DTYPES),
    mode=st.sampled_from(MODES),
    with_weight=st.booleans(),
    with_residual=st.booleans(),
    layout=st.sampled_from([None, "row_slice_of_wider", "column_stride_2"]),
)
def test_property_random_shapes(fk, leading, hidden, dtype, mode, with_weight, with_residual, layout):
    torch.manual_seed(len(leading) * 100003 + hidden)
    check_against_references(fk, (*leading, hidden), dtype, mode, with_weight, with_residual,
                             LAYOUTS[layout] if layout else None)


def test_weight_of_another_dtype_promotes_in_llama_mode(fk):
    x = torch.randn(4, 64, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(64, device=DEVICE, dtype=torch.float32)
    y = fk.rms_norm(x, weight, EPS, "llama")
    y_base, _ = reference_module(x, weight, EPS, "llama")
    assert y.dtype == torch.float32 == y_base.dtype
    assert rel_err(y, y_base) < (1e-5 if EXACT_BF16_ROUNDING else 2.0**-7)
    assert fk.rms_norm(x, weight, EPS, "plain").dtype == torch.bfloat16


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
@pytest.mark.parametrize("mode", ["llama", "plain"])
def test_fp32_weight_with_half_inputs_forward_and_backward(fk, poisoned_empty, mode, dtype, with_residual):
    """Half-precision activations with an fp32 weight (gpt-oss keeps its norm weights in fp32, as does training with
    fp32 master weights): y, dx, dweight (fp32) and dresidual against float64 by the error-ratio rule, the baseline
    being the replaced module in the input dtype (Llama's promotes to fp32; OLMo's, mode "plain", multiplies in fp32
    and rounds once to the input dtype)."""
    torch.manual_seed(5)
    shape = SHAPES[-1] if ON_GPU else (9, 300)
    x, _, residual = make_inputs(shape, dtype, False, with_residual)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], device=DEVICE)
    out_dtype = torch.float32 if mode == "llama" else dtype
    dy = torch.randn(shape, device=DEVICE, dtype=out_dtype)
    d_res = torch.randn(shape, device=DEVICE, dtype=dtype) if with_residual else None
    y, h, (dx, dw, dr) = run_ours(fk, x, weight, residual, mode, dy, d_res)
    assert (y.dtype, dx.dtype, dw.dtype) == (out_dtype, dtype, torch.float32)

    def baseline(x, weight, residual):
        h = x if residual is None else x + residual
        h32 = h.float()
        normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)
        return (weight * normed.to(dtype) if mode == "llama" else (weight * normed).to(dtype)), h

    grads = {}
    for name, fn, cast in (("ref", reference_float64, torch.Tensor.double), ("base", baseline, lambda t: t)):
        xs, ws, rs = (leaf(cast(t)) if t is not None else None for t in (x, weight, residual))
        y_out, h_out = fn(xs, ws, EPS, mode, rs) if name == "ref" else fn(xs, ws, rs)
        torch.autograd.backward([y_out] + ([h_out] if with_residual else []),
                                [dy.to(y_out.dtype)] + ([d_res.to(h_out.dtype)] if with_residual else []))
        grads[name] = y_out.detach(), xs.grad, ws.grad, rs.grad if rs is not None else None
    h64 = x.double() if residual is None else x.double() + residual.double()
    dx_scale = (torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS) * dy.double() * weight.double()).norm().item()
    for index, name, ours, scale in ((0, "y", y, 0.0), (1, "dx", dx, dx_scale), (2, "dweight", dw, 0.0),
                                     (3, "dresidual", dr, dx_scale)):
        if ours is not None:
            assert_close_ratio(name, ours, grads["base"][index], grads["ref"][index], 3.0 if index else 2.0, dtype,
                               scale=scale)


def test_empty_batch(fk):
    x = torch.randn(0, 3, 64, device=DEVICE, requires_grad=True)
    weight = torch.randn(64, device=DEVICE, requires_grad=True)
    y = fk.rms_norm(x, weight, EPS, "llama")
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("n_cols", [1024, 1000, 997], ids=["aligned", "aligned-unproven", "off-boundaries"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("tile", [(2, 1024), (1, 16384), (2, 8192)],
                         ids=["prefetching", "widest-tile-without-prefetch", "row-pairs-without-prefetch"])
def test_both_whole_row_backward_schedules(fk, monkeypatch, tile, with_residual, n_cols):
    """The whole-row backward prefetches the next row block for tiles up to PREFETCH_MAX_TILE elements (strided
    row blocks, statistics recomputed) and loads plainly above (contiguous row blocks, the forward's rstd); both
    schedules give the reference gradients, whatever the device's launch table picks, also with a padded last
    row block (37 rows in pairs), for rows Triton proves 16-byte aligned, rows aligned by their length alone
    (1000 bf16) and rows off 16-byte boundaries (997)."""
    module = importlib.import_module(fk.__name__ + ".rms_norm")
    prefetches = tile[0] * tile[1] <= module._triton_rms_norm.PREFETCH_MAX_TILE
    assert prefetches == (tile == (2, 1024))
    table_pick = module.pick

    def pick_tile(family, kernel, device, n_cols, n_elements=None):
        config = table_pick(family, kernel, device, n_cols, n_elements)
        if not kernel.startswith("backward"):
            return config
        return {**config, "block_rows": tile[0], "block_cols": tile[1], "programs_per_sm": 3}

    monkeypatch.setattr(module, "pick", pick_tile)
    # Three programs in all, so that each walks several row blocks and hands its prefetched block on.
    monkeypatch.setattr(module, "multiprocessor_count", lambda device: 1)
    check_against_references(fk, (37, n_cols), torch.bfloat16, "llama", True, with_residual)


@pytest.mark.parametrize("n_cols", [1024, 1000, 997], ids=["aligned", "aligned-unproven", "off-boundaries"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("block_rows", [1, 2])
def test_whole_row_forward_read_twice(fk, poisoned_empty, monkeypatch, block_rows, with_residual, n_cols):
    """A whole-row forward tile with ``two_pass`` (the row read again for the output instead of held across the
    reduction; ignored with a residual) gives the reference results too, also with a padded last row block (37 rows
    in pairs), whatever the device's launch table picks."""
    module = importlib.import_module(fk.__name__ + ".rms_norm")
    table_pick = module.pick

    def pick_tile(family, kernel, device, n_cols, n_elements=None):
        config = table_pick(family, kernel, device, n_cols, n_elements)
        if not kernel.startswith("forward"):
            return config
        return {"block_rows": block_rows, "block_cols": 1 << (n_cols - 1).bit_length(), "num_warps": 4,
                "two_pass": True}

    monkeypatch.setattr(module, "pick", pick_tile)
    check_against_references(fk, (37, n_cols), torch.bfloat16, "llama", True, with_residual)


@pytest.mark.parametrize("case, dense", [
    ("contiguous", True), ("one_row", True), ("three_dims", True), ("not_a_power_of_two", False),
    ("row_slice_of_wider", False), ("residual_transposed", False)])
def test_dense_rows(fk, poisoned_empty, monkeypatch, case, dense):
    """The forward's DENSE path (rows of exactly one block, back to back: int32 offsets, no column mask, the weight
    loaded early) is taken exactly where it applies, and gives the reference results in every mode, without a
    weight, with a residual and with a padded last row block (37 rows in blocks of 8)."""
    module = importlib.import_module(fk.__name__ + ".rms_norm")
    kernels = importlib.import_module(fk.__name__ + "._kernels.rms_norm")
    table_pick = module.pick
    launches = []

    def pick_tile(family, kernel, device, n_cols, n_elements=None):
        config = table_pick(family, kernel, device, n_cols, n_elements)
        if not kernel.startswith("forward"):
            return config
        return {"block_rows": 8, "block_cols": 1 << (n_cols - 1).bit_length(), "num_warps": 4}

    def recording_launch(kernel, grid, pointers, scalars, constexprs, *args, **kwargs):
        if kernel is kernels._rms_norm_forward_kernel:
            launches.append(constexprs["DENSE"])
        return launch(kernel, grid, pointers, scalars, constexprs, *args, **kwargs)

    launch = kernels.launch
    monkeypatch.setattr(module, "pick", pick_tile)
    monkeypatch.setattr(kernels, "launch", recording_launch)
    shape, transform, residual_too = {
        "contiguous": ((37, 256), None, True), "one_row": ((1, 256), None, True),
        "three_dims": ((3, 5, 128), None, True), "not_a_power_of_two": ((37, 200), None, True),
        "row_slice_of_wider": ((37, 256), LAYOUTS["row_slice_of_wider"], True),
        "residual_transposed": ((5, 7, 128), LAYOUTS["transposed_leading"], False)}[case]
    for mode, with_weight, with_residual in (("llama", True, False), ("gemma", True, True), ("plain", False, True)):
        if residual_too:
            check_against_references(fk, shape, torch.bfloat16, mode, with_weight, with_residual, transform)
        else:  # x contiguous, the residual a transposed view
            x, weight, residual = make_inputs(shape, torch.bfloat16, with_weight, True)
            residual = transform(residual)
            y, h = fk.fused_add_rms_norm(x, residual, weight, EPS, mode)
            y_ref, h_ref = reference_float64(x.double(), weight.double() if with_weight else None, EPS, mode,
                                             residual.double())
            y_base, _ = reference_module(x, weight, EPS, mode, residual)
            assert_close_ratio("y", y, y_base, y_ref, 2.0, torch.bfloat16)
    assert launches and all(flag == dense for flag in launches)


def _alignment_plan(fk, x):
    """The kernels' ALIGN for rows of ``x`` (see "Row alignment" in kernels_src/rms_norm.py)."""
    kernels = importlib.import_module(fk.__name__ + "._kernels.rms_norm")
    layout_module = importlib.import_module(fk.__name__ + "._layout")
    (x,), layouts = layout_module.shared_row_layouts(x)
    return kernels.row_alignment(x.element_size(), layouts, x.numel() // x.shape[-1], x.shape[-1])


def test_alignment_plans(fk):
    """Which rows the kernels show the compiler to be 16-byte aligned (ALIGN > 1: length and row strides multiples
    of 16 bytes but not all of 16 elements, whatever the strides that no row uses), leave to Triton (1), or know to
    be accessed 2 or 4 bytes at a time (None)."""
    def plan(shape, dtype=torch.bfloat16, transform=None):
        x = torch.randn(shape, device=DEVICE, dtype=dtype)
        return _alignment_plan(fk, transform(x) if transform else x)

    assert plan((37, 4096)) == 1  # Triton proves it
    assert plan((37, 5000)) == 8 and plan((37, 5000), torch.float32) == 4 and plan((37, 5002), torch.float32) is None
    assert plan((37, 4095)) is None and plan((37, 4096), transform=LAYOUTS["column_stride_2"]) is None
    assert plan((3, 5, 1000), transform=LAYOUTS["transposed_leading"]) == 8  # both stride groups
    assert plan((37, 1000), transform=LAYOUTS["row_slice_of_wider"]) == 8  # row stride 2000
    assert plan((37, 1000), transform=lambda t: torch.cat([t, t[:, :4]], dim=-1)[:, :1000]) is None  # row stride 1004
    # One row: its stride is used by no row and does not count.
    assert plan((1, 1000), transform=lambda t: torch.cat([t, t[:, :1]], dim=-1)[:, :1000]) == 8


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape, transform", [
    ((37, 24), None), ((37, 40), "row_slice_of_wider"), ((3, 7, 712), None), ((4, 5, 520), "transposed_leading")],
    ids=str)
def test_rows_aligned_by_their_length(fk, poisoned_empty, shape, transform, dtype, with_residual):
    """Rows whose length and strides are multiples of 16 bytes but not all of 16 elements (ALIGN > 1): short,
    longer than a block (712 on the CPU's table), a slice of wider rows, and through both stride groups of a
    transposed view."""
    transform = LAYOUTS[transform] if transform else None
    x = torch.empty(shape, device=DEVICE, dtype=dtype)
    assert _alignment_plan(fk, transform(x) if transform else x) > 1
    for mode in ("llama", "gemma"):
        check_against_references(fk, shape, dtype, mode, True, with_residual, transform)


def test_backward_is_deterministic(fk):
    shape = (4096, 4096) if ON_GPU else (37, 300)
    x, weight, _ = make_inputs(shape, torch.bfloat16, True, False)
    dy = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    first = run_ours(fk, x, weight, None, "llama", dy)[2]
    second = run_ours(fk, x, weight, None, "llama", dy)[2]
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_gradient_only_for_weight(fk):
    x = torch.randn(5, 64, device=DEVICE)
    weight = torch.randn(64, device=DEVICE, requires_grad=True)
    fk.rms_norm(x, weight, EPS, "gemma").sum().backward()
    xr, wr = x.double(), weight.detach().double().requires_grad_(True)
    reference_float64(xr, wr, EPS, "gemma")[0].sum().backward()
    assert rel_err(weight.grad, wr.grad) < 1e-5


def test_unused_residual_output_gets_no_gradient(fk):
    x, weight, residual = (leaf(t) for t in make_inputs((6, 128), torch.float32, True, True))
    y, _ = fk.fused_add_rms_norm(x, residual, weight, EPS, "llama")
    y.sum().backward()
    xr, wr, rr = (leaf(t.detach().double()) for t in (x, weight, residual))
    reference_float64(xr, wr, EPS, "llama", rr)[0].sum().backward()
    assert rel_err(x.grad, xr.grad) < 1e-5 and rel_err(residual.grad, rr.grad) < 1e-5


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_double_backward(request, module, mode, with_residual):
    """Under create_graph the gradients are differentiable in turn (gradient penalties, Hessian-vector products):
    the derivatives of a penalty on the x and weight gradients, in x, weight, the residual and the incoming
    gradients, match float64, including the part that comes from rstd's dependence on x."""
    fk = request.getfixturevalue(module)
    x, weight, residual = make_inputs((5, 300), torch.float32, True, with_residual)
    dys = [torch.randn(x.shape, device=DEVICE) for _ in range(2 if with_residual else 1)]
    probes = [torch.randn_like(x), torch.randn_like(weight)]

    def penalty_gradients(norm, tensors):
        x, weight, residual, *dys = tensors
        outputs = norm(x, weight, residual)
        first = torch.autograd.grad(outputs, (x, weight), dys, create_graph=True)
        penalty = sum((g * p.to(g.dtype)).sum() for g, p in zip(first, probes))
        return torch.autograd.grad(penalty, [t for t in tensors if t is not None])

    def ours(x, weight, residual):
        if residual is None:
            return [fk.rms_norm(x, weight, EPS, mode)]
        return list(fk.fused_add_rms_norm(x, residual, weight, EPS, mode))

    def exact(x, weight, residual):
        return list(reference_float64(x, weight, EPS, mode, residual))[:len(dys)]

    tensors = [x, weight, residual, *dys]
    got = penalty_gradients(ours, [leaf(t) for t in tensors])
    want = penalty_gradients(exact, [leaf(t.double()) if t is not None else None for t in tensors])
    for name, g, w in zip(["x", "weight", "residual", "dy", "d_residual"][:len(got)], got, want):
        assert rel_err(g, w) < 1e-5, name


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
def test_inference_mode(request, module):
    """Under torch.inference_mode (serving, generation), for a normal input and an inference tensor, the output of
    any other call."""
    fk = request.getfixturevalue(module)
    x, weight, _ = make_inputs((4, 64), torch.float32, True, False)
    want = fk.rms_norm(x, weight, EPS, "llama")
    with torch.inference_mode():
        assert torch.equal(fk.rms_norm(x, weight, EPS, "llama"), want)
        assert torch.equal(fk.rms_norm(x.clone(), weight, EPS, "llama"), want)


# ----------------------------------------------------------------------------------------------------------
# Bad input gives a clear error naming the argument.
# ----------------------------------------------------------------------------------------------------------

BAD_INPUTS = [
    (lambda d: dict(x=torch.randn(4, 8, device=d).double()), TypeError, "x must have dtype"),
    (lambda d: dict(x=torch.ones(4, 8, device=d, dtype=torch.int32)), TypeError, "x must have dtype"),
    (lambda d: dict(x=torch.tensor(1.0, device=d)), ValueError, "x must have at least 1 dimension"),
    (lambda d: dict(x=torch.randn(4, 0, device=d)), ValueError, "non-empty last"),
    (lambda d: dict(x=torch.randn(4, 8, device=d), weight=torch.randn(7, device=d)), ValueError,
     r"weight must have shape \(8,\)"),
    (lambda d: dict(x=torch.randn(4, 8, device=d), weight=torch.randn(2, 8, device=d)), ValueError,
     "weight must be 1-dimensional"),
    (lambda d: dict(x=torch.randn(4, 8, device=d), weight=torch.ones(8, device=d, dtype=torch.int64)), TypeError,
     "weight must have dtype"),
    (lambda d: dict(x=torch.randn(4, 8, device=d), eps=-1.0), ValueError, "eps must be"),
    (lambda d: dict(x=torch.randn(4, 8, device=d), eps=float("nan")), ValueError, "eps must be"),
    (lambda d: dict(x=torch.randn(4, 8, device=d), mode="layer"), ValueError, "mode must be one of"),
    (lambda d: dict(x=[1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_inputs_raise_clear_errors(fk, case):
    make, error, message = BAD_INPUTS[case]
    kwargs = make(DEVICE)
    with pytest.raises(error, match=message):
        fk.rms_norm(kwargs.pop("x"), kwargs.pop("weight", None), kwargs.pop("eps", EPS), kwargs.pop("mode", "llama"))


@pytest.mark.parametrize("residual, error, message", [
    (lambda d: None, TypeError, "residual must be a torch.Tensor"),
    (lambda d: torch.randn(4, 9, device=d), ValueError, "residual must have the shape of x"),
    (lambda d: torch.randn(4, 8, device=d, dtype=torch.float16), TypeError, "residual must have the dtype of x"),
])
@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
def test_bad_residual(request, module, residual, error, message):
    fk = request.getfixturevalue(module)
    device = DEVICE if module == "fk" else "cpu"
    with pytest.raises(error, match=message):
        fk.fused_add_rms_norm(torch.randn(4, 8, device=device), residual(device), None, EPS, "llama")


@pytest.mark.skipif(not ON_GPU, reason="needs a second device type")
def test_device_mismatch(fk):
    with pytest.raises(ValueError, match="weight is on cpu but x is on cuda"):
        fk.rms_norm(torch.randn(4, 8, device="cuda"), torch.randn(8), EPS, "llama")


# ----------------------------------------------------------------------------------------------------------
# torch.library integration.
# ----------------------------------------------------------------------------------------------------------

def test_opcheck(fk):
    shape = (64, 2048) if ON_GPU else (6, 40)
    x, weight, residual = (leaf(t) for t in make_inputs(shape, torch.float32, True, True))
    ops = fk._ops.ops
    torch.library.opcheck(ops.rms_norm, (x, weight, EPS, "llama"))
    torch.library.opcheck(ops.fused_add_rms_norm, (x, residual, weight, EPS, "gemma"))
    dy = torch.randn(shape, device=DEVICE)
    rstd = ops.rms_norm(x.detach(), weight.detach(), EPS, "plain")[1]
    torch.library.opcheck(ops.rms_norm_backward, (dy, dy, x.detach(), rstd, weight.detach(), EPS, "plain", True))


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
def test_opcheck_transposed_inputs(request, module):
    """The ops' outputs are contiguous whatever the inputs' strides, as the fake kernels declare them (opcheck
    compares the strides; inductor asserts them): also in the torch-cpu variant, whose elementwise ops and
    reductions would follow the strides of a transposed x."""
    fk = request.getfixturevalue(module)
    x, weight, residual = make_inputs((3, 4, 40), torch.float32, True, True)
    x, residual, dy = (LAYOUTS["transposed_leading"](t) for t in (x, residual, torch.randn_like(x)))
    ops = fk._ops.ops
    torch.library.opcheck(ops.rms_norm, (leaf(x), leaf(weight), EPS, "llama"))
    torch.library.opcheck(ops.fused_add_rms_norm, (leaf(x), leaf(residual), leaf(weight), EPS, "gemma"))
    rstd = ops.rms_norm(x, weight, EPS, "plain")[1]
    torch.library.opcheck(ops.rms_norm_backward, (dy, dy, x, rstd, weight, EPS, "plain", True))


def test_compile_fullgraph(fk):
    torch._dynamo.reset()
    shape = (8, 256, 1024) if ON_GPU else (2, 3, 64)
    x, weight, residual = make_inputs(shape, torch.bfloat16 if ON_GPU else torch.float32, True, True)

    def block(x, residual, weight):
        y, h = fk.fused_add_rms_norm(x, residual, weight, EPS, "llama")
        return fk.rms_norm(y * 2, weight, EPS, "gemma"), h

    compiled = torch.compile(block, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    eager_args = [leaf(t) for t in (x, residual, weight)]
    compiled_args = [leaf(t) for t in (x, residual, weight)]
    eager_out = block(*eager_args)
    compiled_out = compiled(*compiled_args)
    for a, b in zip(eager_out, compiled_out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    sum(o.float().sum() for o in eager_out).backward()
    sum(o.float().sum() for o in compiled_out).backward()
    for a, b in zip(eager_args, compiled_args):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------
# The torch-cpu variant: plain PyTorch, same function.
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 300), (4, 1537)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_torch_cpu_variant_matches_references(fk_cpu, poisoned_empty, shape, dtype, mode, with_residual):
    assert fk_cpu.BACKEND == "cpu"
    check_against_references(fk_cpu, shape, dtype, mode, True, with_residual, device="cpu")


def test_kernels_and_portable_path_agree(fk, fk_cpu):
    x, weight, residual = make_inputs((7, 300), torch.float32, True, True, device="cpu")
    if ON_GPU:
        ours = [t.cpu() for t in fk.fused_add_rms_norm(x.cuda(), residual.cuda(), weight.cuda(), EPS, "gemma")]
    else:
        ours = fk.fused_add_rms_norm(x, residual, weight, EPS, "gemma")
    portable = fk_cpu.fused_add_rms_norm(x, residual, weight, EPS, "gemma")
    torch.testing.assert_close(ours[0], portable[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[1], portable[1])
