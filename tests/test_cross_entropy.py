"""Cross-entropy over given logits: every option and combination against a float64 reference, gradients,
layouts, extreme values, errors, compile, and the torch-cpu variant.

On the CPU the Triton kernels run under the interpreter with a launch table of 256-column chunks, so vocabularies
of a few hundred classes already take the multi-chunk path; on a GPU the shapes are realistic.
"""

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE, EXACT_BF16_ROUNDING, ON_GPU, GivesNoGradient
from numerics import assert_close_ratio, rel_err

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REDUCTIONS = ("mean", "sum", "none")
SHAPE = (4, 512, 32000) if ON_GPU else (3, 5, 300)  # (batch, tokens, vocab)


# ----------------------------------------------------------------------------------------------------------
# Reference, written from the definition (log_softmax, gather), in float64.
# ----------------------------------------------------------------------------------------------------------

def reference_float64(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                      lse_square_scale=0.0, softcap=None):
    """(loss, z_loss) exactly, in float64; differentiable in ``logits``."""
    x = logits.double()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    n_classes = x.shape[-1]
    w = weight.double() if weight is not None else torch.ones(n_classes, dtype=torch.float64, device=x.device)
    counted = target != ignore_index
    y = torch.where(counted, target, 0).long()
    log_p = torch.log_softmax(x, dim=-1)
    nll = -w[y] * log_p.gather(-1, y[..., None])[..., 0]
    lse = torch.logsumexp(x, dim=-1)
    per_token = (1 - label_smoothing) * nll
    if label_smoothing:  # (skipped at 0: masked -inf logits would give 0 * inf)
        per_token = per_token - label_smoothing / n_classes * (w * log_p).sum(-1)
    z = lse_square_scale * lse * lse
    per_token = torch.where(counted, per_token + z, 0.0)
    z = torch.where(counted, z, 0.0)
    if reduction == "none":
        return per_token, z
    if reduction == "sum":
        return per_token.sum(), z.sum()
    denominator = torch.where(counted, w[y], 0.0).sum()
    scale = 1.0 / denominator if denominator != 0 else 0.0
    return per_token.sum() * scale, z.sum() * scale


def baseline(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap):
    """What a model computes without us: fp32 upcast, then torch's cross_entropy (the error baseline)."""
    x = logits.float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    loss = torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]), target.reshape(-1), weight,
                                             ignore_index=ignore_index, reduction=reduction,
                                             label_smoothing=label_smoothing)
    if reduction == "none":
        loss = loss.view(target.shape)
    if lse_square_scale:
        counted = target != ignore_index
        z = torch.where(counted, lse_square_scale * torch.logsumexp(x, -1) ** 2, 0.0)
        if reduction == "mean":
            w_y = weight[torch.where(counted, target, 0)] if weight is not None else torch.ones_like(z)
            z = z.sum() / torch.where(counted, w_y, 0.0).sum()
        elif reduction == "sum":
            z = z.sum()
        loss = loss + z
    return loss


def make_inputs(shape, dtype, ignore_index=-100, ignored_fraction=0.3, device=DEVICE, scale=3.0):
    logits = (scale * torch.randn(shape, device=device)).to(dtype)
    target = torch.randint(0, shape[-1], shape[:-1], device=device)
    target = torch.where(torch.rand(shape[:-1], device=device) < ignored_fraction, ignore_index, target)
    return logits, target


def leaf(t):
    """``t`` as a leaf that requires grad, with its strides (``clone`` would make a row slice contiguous)."""
    return t.detach().requires_grad_(True)


def check(fk, logits, target, weight=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
          lse_square_scale=0.0, softcap=None, k=2.0):
    """Forward and backward of ours against the float64 reference; error ratio against the fp32 baseline."""
    dtype = logits.dtype
    opts = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                lse_square_scale=lse_square_scale, softcap=softcap)
    before = logits.clone()
    x = leaf(logits)
    loss, z_loss = fk.cross_entropy(x, target, weight, return_z_loss=True, **opts)
    grad = torch.randn(loss.shape, device=loss.device)
    loss.backward(grad)
    assert torch.equal(logits, before), "the caller's logits were modified"
    assert loss.dtype == torch.float32 and z_loss.dtype == torch.float32 and x.grad.dtype == dtype
    assert loss.shape == (target.shape if reduction == "none" else ())
    if not (target != ignore_index).any():  # torch's "mean" is NaN here; ours is 0 (test_all_tokens_ignored...)
        assert not loss.any() and not x.grad.any()
        return loss, x.grad

    xr = leaf(logits.double())
    loss_ref, z_ref = reference_float64(xr, target, weight, **opts)
    loss_ref.backward(grad.double())
    xb = leaf(logits)
    loss_base = baseline(xb, target, weight, **opts)
    loss_base.backward(grad)

    # Losses are fp32 sums over fp32 rows: judge them against the fp32 baseline's rounding.
    assert_close_ratio("loss", loss, loss_base, loss_ref, k, torch.float32)
    assert rel_err(z_loss, z_ref) < 1e-5
    assert_close_ratio("dlogits", x.grad, xb.grad, xr.grad, k, dtype)
    return loss, x.grad


# Every user-settable option, alone and combined: the full product in float32, the extremes in half precision.
OPTION_GRID = list(itertools.product(REDUCTIONS, (0.0, 0.1), (False, True), (None, 5.0), (0.0, 1e-3)))


@pytest.mark.parametrize("reduction, label_smoothing, with_weight, softcap, lse_square_scale", OPTION_GRID)
def test_every_option_combination(fk, poisoned_empty, reduction, label_smoothing, with_weight, softcap,
                                  lse_square_scale):
    torch.manual_seed(0)
    logits, target = make_inputs(SHAPE, torch.float32)
    weight = torch.rand(SHAPE[-1], device=DEVICE) + 0.1 if with_weight else None
    check(fk, logits, target, weight, reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
          lse_square_scale=lse_square_scale)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("all_options", [False, True])
def test_half_precision_logits(fk, poisoned_empty, dtype, reduction, all_options):
    torch.manual_seed(1)
    logits, target = make_inputs(SHAPE, dtype)
    options = dict(label_smoothing=0.2, softcap=30.0, lse_square_scale=1e-4) if all_options else {}
    weight = torch.rand(SHAPE[-1], device=DEVICE) + 0.1 if all_options else None
    check(fk, logits, target, weight, reduction=reduction, **options)


@pytest.mark.parametrize("logits", [[[12.0], [9.0], [11.0]], [[2.0, -1.5, 0.7], [3.5, -2.0, 1.5]]],
                         ids=["one_class", "target_is_max"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_soft_capped_rows_where_the_target_is_the_max(fk, logits, reduction):
    """Where the target is the (capped) max, lse - x_y must be log(sum) alone and its p - 1 exact: with one class
    the loss is the z-loss and the gradient its own, so any rounding left in max - x_y or x - max is the whole error
    (found by the property test on the H200: the compiler fused cap * tanh into those subtractions; half an ulp of
    a capped logit of 8 is 8e-5 of this loss). Logits near the cap, where the GPU's approximate exp and division give
    the capped logit ~1e-7 of relative error (~1e-6 at half a cap below 0, close to the bound)."""
    logits = torch.tensor(logits, device=DEVICE)
    target = logits.argmax(-1)
    check(fk, logits, target, reduction=reduction, softcap=10.0, lse_square_scale=1e-4)


@pytest.mark.parametrize("ignore_index", [-100, 3, -1])
def test_ignore_index_values(fk, ignore_index):
    """Any ignore_index, including a real class id (then that class is never a target)."""
    torch.manual_seed(2)
    logits, target = make_inputs(SHAPE, torch.float32, ignore_index=ignore_index, ignored_fraction=0.5)
    check(fk, logits, target, ignore_index=ignore_index, label_smoothing=0.1)


@settings(max_examples=10 if not ON_GPU else 40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    leading=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    vocab=st.integers(1, 700 if not ON_GPU else 70000),
    dtype=st.sampled_from(DTYPES),
    reduction=st.sampled_from(REDUCTIONS),
    label_smoothing=st.sampled_from([0.0, 0.05]),
    with_weight=st.booleans(),
    softcap=st.sampled_from([None, 10.0]),
    lse_square_scale=st.sampled_from([0.0, 1e-4]),
    ignored_fraction=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_property_random_shapes(fk, leading, vocab, dtype, reduction, label_smoothing, with_weight, softcap,
                                lse_square_scale, ignored_fraction):
    torch.manual_seed(vocab)
    logits, target = make_inputs((*leading, vocab), dtype, ignored_fraction=ignored_fraction)
    weight = torch.rand(vocab, device=DEVICE) + 0.1 if with_weight else None
    check(fk, logits, target, weight, reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
          lse_square_scale=lse_square_scale)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("with_weight", [False, True])
def test_all_tokens_ignored_gives_zero(fk, reduction, with_weight):
    logits = leaf(torch.randn(4, 50, device=DEVICE))
    target = torch.full((4,), -100, device=DEVICE)
    weight = torch.rand(50, device=DEVICE) if with_weight else None
    loss = fk.cross_entropy(logits, target, weight, reduction=reduction, label_smoothing=0.1)
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("variant", ["kernels", "torch-cpu"])
def test_mean_over_targets_weighing_zero_gives_zero(fk, fk_cpu, variant):
    """Class weights can mask classes instead of ignore_index: when every counted target weighs 0, D is 0 and "mean"
    gives 0 with a zero gradient, as when all tokens are ignored (torch: NaN), also where label smoothing and the
    z-loss, which the target's weight does not scale, give those tokens a loss (the kernels once returned that loss
    unnormalised)."""
    mod, device = (fk, DEVICE) if variant == "kernels" else (fk_cpu, "cpu")
    logits, target = make_inputs((4, 50), torch.float32, ignored_fraction=0.0, device=device)
    weight = torch.rand(50, device=device) + 0.1
    weight[target] = 0.0
    x = leaf(logits)
    loss = mod.cross_entropy(x, target, weight, label_smoothing=0.1, lse_square_scale=1e-2)
    loss.backward()
    assert loss.item() == 0.0 and not x.grad.any()


def test_empty_batch(fk):
    logits = leaf(torch.randn(0, 50, device=DEVICE))
    target = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert fk.cross_entropy(logits, target, reduction="none").shape == (0,)
    loss = fk.cross_entropy(logits, target)
    assert loss.item() == 0.0
    loss.backward()
    assert logits.grad.shape == (0, 50)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_single_token(fk, reduction):
    logits, target = make_inputs((1, 300), torch.bfloat16, ignored_fraction=0.0)
    check(fk, logits, target, reduction=reduction)
    check(fk, logits[0], target[0], reduction=reduction)  # (vocab,) logits with a scalar target


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_extreme_logits(fk, softcap):
    """Logits of +-1e4 and -inf (masked vocabulary entries, never a target) stay finite and exact."""
    torch.manual_seed(3)
    logits, target = make_inputs((6, 300), torch.float32, ignored_fraction=0.2)
    logits[0, :] = -1e4
    logits[1, 7] = 1e4
    logits[2, target[2] if target[2] >= 0 else 0] = 1e4  # a confidently right token: loss ~0
    logits[:, 250:] = float("-inf")
    target = torch.where(target >= 250, 5, target)
    loss, grad = check(fk, logits, target, reduction="none", softcap=softcap)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert torch.equal(grad[:, 250:], torch.zeros_like(grad[:, 250:]))


def test_confident_true_class_gradient(fk):
    """The true class pushed far above the rest: its gradient p_y - 1 is tiny and must not lose its digits."""
    torch.manual_seed(4)
    logits, target = make_inputs((8, 300), torch.bfloat16, ignored_fraction=0.0, scale=1.0)
    logits[torch.arange(8), target] = 12.0
    check(fk, logits, target, reduction="sum")


# Strided views read in place: a row slice of a wider tensor, a transposed (tokens, batch) layout, column stride 2.
LAYOUTS = {
    "row_slice_of_wider": lambda t: torch.cat([t, t], dim=-1)[..., : t.shape[-1]],
    "transposed_leading": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
    "column_stride_2": lambda t: torch.stack([t, t], dim=-1)[..., 0],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_logits(fk, poisoned_empty, layout):
    torch.manual_seed(5)
    logits, target = make_inputs(SHAPE, torch.bfloat16)
    check(fk, LAYOUTS[layout](logits), target, label_smoothing=0.1)


def test_int32_target(fk):
    logits, target = make_inputs(SHAPE, torch.float32)
    expected = fk.cross_entropy(logits, target, reduction="none")
    assert torch.equal(fk.cross_entropy(logits, target.int(), reduction="none"), expected)


def test_out_of_range_target_poisons_only_its_token(fk):
    """The documented behaviour: NaN loss and gradient for that token, no out-of-bounds access, others exact."""
    logits, target = make_inputs((4, 300), torch.float32, ignored_fraction=0.0)
    for bad in (300, -5):
        target[1] = bad
        x = leaf(logits)
        loss = fk.cross_entropy(x, target, reduction="none")
        loss.sum().backward()
        assert torch.isnan(loss[1]) and torch.isnan(x.grad[1]).all()
        keep = torch.tensor([0, 2, 3])
        ref = reference_float64(logits[keep], target[keep], reduction="none")[0]
        assert rel_err(loss[keep], ref) < 1e-6 and torch.isfinite(x.grad[keep]).all()
        assert torch.isnan(fk.cross_entropy(logits, target))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_inplace_backward_overwrites_logits_only_when_asked(fk, reduction):
    torch.manual_seed(6)
    logits, target = make_inputs(SHAPE, torch.bfloat16)
    before = logits.clone()
    x0 = leaf(logits)
    loss0 = fk.cross_entropy(x0, target, reduction=reduction)
    loss0.backward()
    assert torch.equal(x0, before), "by default the logits are never written"

    x = leaf(logits)
    work = x * 1  # a non-leaf the loss may overwrite
    loss = fk.cross_entropy(work, target, reduction=reduction, inplace_backward=True)
    assert torch.equal(loss, loss0)
    assert torch.equal(work.detach(), x0.grad), "the opted-in logits buffer should hold the gradient"
    loss.backward()
    assert torch.equal(x.grad, x0.grad)


def test_inplace_backward_with_expanded_logits_uses_a_new_buffer(fk):
    """Expanded logits (every row one memory location) cannot hold each row's gradient: with inplace_backward the
    gradient still goes to a buffer of its own, and the expanded row keeps its values."""
    torch.manual_seed(8)
    logits, _ = make_inputs((1, 300), torch.float32)
    target = torch.randint(0, 300, (5,), device=DEVICE)
    row = leaf(logits)
    before = logits.clone()
    loss = fk.cross_entropy(row.expand(5, 300), target, reduction="sum", inplace_backward=True)
    loss.backward()
    assert torch.equal(row.detach(), before)
    row64 = leaf(logits.double())
    ref_loss, _ = reference_float64(row64.expand(5, 300), target, reduction="sum")
    ref_loss.backward()
    assert rel_err(loss, ref_loss) < 1e-6 and rel_err(row.grad, row64.grad) < 1e-5


@pytest.mark.parametrize("view", [False, True])
def test_inplace_backward_never_overwrites_a_leaf_that_requires_grad(fk, view):
    """A leaf that requires grad (a parameter), or a view of one, keeps its values: the gradient gets a buffer of its
    own, as torch's in-place ops would refuse to write there."""
    torch.manual_seed(9)
    logits, target = make_inputs((6, 300), torch.float32)
    x = leaf(logits)
    loss = fk.cross_entropy(x[1:] if view else x, target[1:] if view else target, inplace_backward=True)
    loss.backward()
    assert torch.equal(x.detach(), logits)
    x64 = leaf(logits.double())
    reference_float64(x64[1:] if view else x64, target[1:] if view else target)[0].backward()
    assert rel_err(x.grad, x64.grad) < 1e-5


def test_inplace_backward_with_overlapping_rows_uses_a_new_buffer(fk):
    """Rows that overlap without a zero stride (unfold: each row starts one element after the previous) cannot hold
    their gradients either: written in place, each row's gradient overwrote the next row's logits before they were
    read (wrong gradient, silently)."""
    torch.manual_seed(8)
    base, target = torch.randn(5 + 299, device=DEVICE), torch.randint(0, 300, (5,), device=DEVICE)
    x = leaf(base)
    work = x * 1  # a non-leaf the loss may overwrite
    loss = fk.cross_entropy(work.unfold(0, 300, 1), target, reduction="sum", inplace_backward=True)
    loss.backward()
    assert torch.equal(work.detach(), base)
    x64 = leaf(base.double())
    reference_float64(x64.unfold(0, 300, 1), target, reduction="sum")[0].backward()
    assert rel_err(x.grad, x64.grad) < 1e-5


def test_inplace_backward_is_visible_to_autograd(fk):
    """An op that saved the logits for its own backward raises instead of silently using the gradient."""
    logits, target = make_inputs((4, 300), torch.float32)
    x = leaf(logits)
    y = torch.exp(x)  # exp saves its output
    loss = fk.cross_entropy(y, target, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_loss_backward_with_unit_and_other_gradients(fk):
    """loss.backward() (gradient exactly 1, scaling skipped on the device) and a scaled loss agree."""
    logits, target = make_inputs(SHAPE, torch.float32)
    x1, x3 = leaf(logits), leaf(logits)
    fk.cross_entropy(x1, target).backward()
    (3 * fk.cross_entropy(x3, target)).backward()
    assert rel_err(x3.grad, 3 * x1.grad) < 1e-6


@pytest.mark.parametrize("scale_value", [1.0, 3.0])
def test_gradient_scaling_walks_every_block(fk, scale_value):
    """The in-place scaling of forward-computed gradients, with far more column blocks than programs (each program
    walks several, the last row's last block partial), and a scale of exactly 1, which must leave the tensor as
    it is."""
    x = torch.randn(7, 45, device=DEVICE)
    scale = torch.tensor([scale_value], device=DEVICE)
    want = x * scale_value
    fk._kernels.cross_entropy.scale_(x, scale, block=8, num_warps=1, num_programs=4)
    assert torch.equal(x, want)


def _entries_off(grad, want, tolerance=0.1):
    """How many entries of ``grad`` are more than ``tolerance`` off the float64 ``want`` (relative; zeros included)."""
    return ((grad.double() - want).abs() > tolerance * want.abs()).sum().item()


@pytest.mark.parametrize("variant", ["kernels", "torch-cpu"])
def test_fp16_gradient_under_a_loss_scale(fk, fk_cpu, variant):
    """fp16 logits under a GradScaler-sized loss scale keep every gradient entry that torch's fp32 math keeps: the
    scale is applied before the gradient is rounded (rounded first, divided by the token count, the small
    probabilities underflowed to 0), and in fp32 (65536 is inf in fp16)."""
    module = fk if variant == "kernels" else fk_cpu
    device = DEVICE if variant == "kernels" else "cpu"
    torch.manual_seed(7)
    n_tokens, vocab = (8192, 1000) if ON_GPU and variant == "kernels" else (1024, 64)
    logits = (2 * torch.randn(n_tokens, vocab, device=device)).half()
    target = torch.randint(0, vocab, (n_tokens,), device=device)
    for scale in (2.0**15, 2.0**16):
        reference = leaf(logits.double())
        torch.nn.functional.cross_entropy(reference, target).backward()
        want = reference.grad * scale
        ours, torch_fp32 = leaf(logits), leaf(logits)
        (module.cross_entropy(ours, target) * scale).backward()
        (torch.nn.functional.cross_entropy(torch_fp32.float(), target) * scale).backward()
        assert ours.grad.isfinite().all()
        # Subnormal entries hold a few bits: a last-bit difference in the fp32 math puts one 10% off.
        assert _entries_off(ours.grad, want) <= 1.2 * _entries_off(torch_fp32.grad, want) + 1e-3 * want.numel()


@pytest.mark.parametrize("variant", ["kernels", "torch-cpu"])
def test_bf16_gradient_scaled_in_fp32(fk, fk_cpu, variant):
    """A bf16 gradient computed in the forward and scaled by an incoming gradient that bf16 cannot hold (1/3) is
    scaled in fp32: no bias from a rounded scale against the gradient computed with the scale folded in (reduction
    "none"). On the GPU only for the kernels: the CPU interpreter truncates to bf16 instead of rounding, a bias of
    its own."""
    if variant == "kernels" and not EXACT_BF16_ROUNDING:
        pytest.skip("the interpreter truncates fp32 to bf16")
    module = fk if variant == "kernels" else fk_cpu
    device = DEVICE if variant == "kernels" else "cpu"
    logits, target = make_inputs((512, 300), torch.bfloat16, device=device)
    mean, none = leaf(logits), leaf(logits)
    (module.cross_entropy(mean, target) / 3).backward()
    (module.cross_entropy(none, target, reduction="none").sum()
     / (target != -100).sum() / 3).backward()
    ratio = mean.grad.float().abs().sum() / none.grad.float().abs().sum()
    assert abs(ratio.item() - 1) < 5e-4


def test_z_loss_output_and_a_loss_without_gradient(fk):
    """The returned z-loss gets no gradient (autograd hands None for it), and a consumer of the loss that gives it no
    gradient leaves zero gradients: neither changes nor breaks the backward."""
    logits, target = make_inputs(SHAPE, torch.float32)
    x1, x2, x3 = leaf(logits), leaf(logits), leaf(logits)
    fk.cross_entropy(x1, target, lse_square_scale=1e-3).backward()
    loss, _ = fk.cross_entropy(x2, target, lse_square_scale=1e-3, return_z_loss=True)
    loss.backward()
    assert torch.equal(x2.grad, x1.grad)
    other = torch.ones((), device=DEVICE, requires_grad=True)
    (GivesNoGradient.apply(fk.cross_entropy(x3, target)) * other).backward()
    assert (x3.grad is None or not x3.grad.any()) and other.grad is not None


def test_second_backward_through_the_graph_is_refused(fk):
    logits, target = make_inputs((4, 300), torch.float32)
    loss = fk.cross_entropy(leaf(logits), target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("variant", ["kernels", "torch-cpu"])
def test_double_backward_is_refused(fk, fk_cpu, variant, reduction):
    """The gradient has no autograd graph of its own (kernels, or torch-cpu formulas with the forward's log-sum-exp
    as a constant): a first backward with create_graph=True works, a backward through its gradient raises. It once
    gave torch's "does not require grad" error, a second derivative silently lacking this op's terms (a gradient
    penalty through a layer before the loss), or, in the torch-cpu variant with reduction "none", a wrong one."""
    mod, device = (fk, DEVICE) if variant == "kernels" else (fk_cpu, "cpu")
    logits, target = make_inputs((4, 50), torch.float32, device=device)
    x = leaf(logits)
    grad, = torch.autograd.grad(mod.cross_entropy(x, target, reduction=reduction).sum(), x, create_graph=True)
    x64 = leaf(logits.double())
    grad64, = torch.autograd.grad(reference_float64(x64, target, reduction=reduction)[0].sum(), x64)
    assert rel_err(grad, grad64) < 1e-5
    with pytest.raises(RuntimeError, match="cross_entropy: double backward is not supported"):
        (grad * torch.randn_like(grad)).sum().backward()


def test_no_grad_forward_matches(fk):
    logits, target = make_inputs(SHAPE, torch.bfloat16)
    x = leaf(logits)
    with torch.no_grad():
        loss = fk.cross_entropy(x, target, label_smoothing=0.1)
    assert not loss.requires_grad
    assert torch.equal(loss, fk.cross_entropy(x, target, label_smoothing=0.1).detach())


def test_deterministic(fk):
    logits, target = make_inputs(SHAPE, torch.bfloat16)
    torch.manual_seed(10)
    first = check(fk, logits, target)
    torch.manual_seed(10)
    second = check(fk, logits, target)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


# ----------------------------------------------------------------------------------------------------------
# Bad input gives a clear error naming the argument.
# ----------------------------------------------------------------------------------------------------------

def _bad(**overrides):
    args = dict(logits=torch.randn(4, 8, device=DEVICE), target=torch.zeros(4, dtype=torch.int64, device=DEVICE))
    args.update({k: v(DEVICE) if callable(v) else v for k, v in overrides.items()})
    return args


BAD_INPUTS = [
    (_bad(logits=lambda d: torch.randn(4, 8, device=d).double()), TypeError, "logits must have dtype"),
    (_bad(logits=lambda d: torch.randn(4, 0, device=d)), ValueError, "non-empty last"),
    (_bad(target=lambda d: torch.zeros(4, device=d)), TypeError, "target must have dtype int64, int32"),
    (_bad(target=lambda d: torch.zeros(4, dtype=torch.int16, device=d)), TypeError, "target must have dtype"),
    (_bad(target=lambda d: torch.zeros(5, dtype=torch.int64, device=d)), ValueError, r"target must have shape \(4,\)"),
    (_bad(target=lambda d: torch.zeros(4, 1, dtype=torch.int64, device=d)), ValueError, "target must have shape"),
    (_bad(weight=lambda d: torch.rand(7, device=d)), ValueError, r"weight must have shape \(8,\)"),
    (_bad(weight=lambda d: torch.ones(8, dtype=torch.int64, device=d)), TypeError, "weight must have dtype"),
    (_bad(reduction="avg"), ValueError, "reduction must be one of"),
    (_bad(label_smoothing=1.5), ValueError, "label_smoothing must be"),
    (_bad(lse_square_scale=-1.0), ValueError, "lse_square_scale must be"),
    (_bad(softcap=0.0), ValueError, "softcap must be"),
    (_bad(ignore_index=1.5), TypeError, "ignore_index must be an int"),
    (_bad(ignore_index=2**63), ValueError, "ignore_index must fit in int64, got 9223372036854775808"),
    (_bad(ignore_index=-2**63 - 1), ValueError, "ignore_index must fit in int64"),
    (_bad(logits=[1.0]), TypeError, "logits must be a torch.Tensor"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_inputs_raise_clear_errors(fk, case):
    kwargs, error, message = BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        fk.cross_entropy(**kwargs)


@pytest.mark.skipif(not ON_GPU, reason="needs a second device type")
def test_device_mismatch(fk):
    with pytest.raises(ValueError, match="target is on cpu but logits is on cuda"):
        fk.cross_entropy(torch.randn(4, 8, device="cuda"), torch.zeros(4, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------------------
# torch.library integration.
# ----------------------------------------------------------------------------------------------------------

def test_opcheck(fk):
    logits, target = make_inputs((6, 40) if not ON_GPU else (64, 4096), torch.float32)
    weight = torch.rand(logits.shape[-1], device=DEVICE)
    ops = fk._ops.ops
    torch.library.opcheck(ops.cross_entropy, (leaf(logits), target, weight, -100, "mean", 0.1, 1e-4, 20.0, True))
    torch.library.opcheck(ops.cross_entropy, (leaf(logits), target, None, -100, "none", 0.0, 0.0, None, False))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_compile_fullgraph(fk, reduction):
    torch._dynamo.reset()
    logits, target = make_inputs((2, 64, 4096) if ON_GPU else (2, 3, 300), torch.float32)

    def step(logits, target):
        loss, z_loss = fk.cross_entropy(logits * 2, target, reduction=reduction, label_smoothing=0.1,
                                        lse_square_scale=1e-4, return_z_loss=True)
        return loss, z_loss

    compiled = torch.compile(step, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x_eager, x_compiled = leaf(logits), leaf(logits)
    eager_out, compiled_out = step(x_eager, target), compiled(x_compiled, target)
    for a, b in zip(eager_out, compiled_out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    eager_out[0].sum().backward()
    compiled_out[0].sum().backward()
    torch.testing.assert_close(x_eager.grad, x_compiled.grad, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------
# The torch-cpu variant: plain PyTorch, same function.
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_cpu_variant_matches_reference(fk_cpu, poisoned_empty, reduction, dtype):
    assert fk_cpu.BACKEND == "cpu"
    torch.manual_seed(7)
    logits, target = make_inputs((3, 5, 300), dtype, device="cpu")
    weight = torch.rand(300) + 0.1
    check(fk_cpu, logits, target, weight, reduction=reduction, label_smoothing=0.1, softcap=20.0,
          lse_square_scale=1e-4)
    check(fk_cpu, logits, target, reduction=reduction)


def test_kernels_and_portable_path_agree(fk, fk_cpu):
    logits, target = make_inputs((7, 300), torch.float32, device="cpu")
    weight = torch.rand(300)
    target[2] = 300  # out of range: NaN in both
    options = dict(reduction="none", label_smoothing=0.1, softcap=20.0, lse_square_scale=1e-4)
    ours = fk.cross_entropy(logits.to(DEVICE), target.to(DEVICE), weight.to(DEVICE), **options).cpu()
    portable = fk_cpu.cross_entropy(logits, target, weight, **options)
    torch.testing.assert_close(ours, portable, rtol=1e-5, atol=1e-6, equal_nan=True)


# ----------------------------------------------------------------------------------------------------------
# Large vocabularies and int64 offsets (GPU).
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not ON_GPU, reason="large vocabularies are too slow for the CPU interpreter")
@pytest.mark.parametrize("vocab", [131072, 151936, 262144])
def test_large_vocabulary(fk, vocab):
    torch.manual_seed(8)
    logits, target = make_inputs((256, vocab), torch.bfloat16)
    check(fk, logits, target, label_smoothing=0.1, lse_square_scale=1e-4)


@pytest.mark.skipif(not ON_GPU, reason="needs more than 2**31 logits (4.3 GB in bf16)")
def test_more_than_2_pow_31_logits(fk, large_gpu_memory):
    """tokens * vocab > 2**31: the last rows sit beyond any int32 offset. Checked row-wise against a float32
    computation on the tail (a float64 copy of everything would not fit comfortably)."""
    tokens, vocab = 8300, 262144
    assert tokens * vocab > 2**31
    torch.manual_seed(9)
    logits = torch.randn(tokens, vocab, device=DEVICE, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)
    x = logits.requires_grad_(True)
    loss = fk.cross_entropy(x, target, reduction="sum")
    grad = torch.autograd.grad(loss, x)[0]
    tail = slice(tokens - 16, tokens)
    xt = logits.detach()[tail].double().requires_grad_(True)
    rows_ref = torch.nn.functional.cross_entropy(xt, target[tail], reduction="none")
    rows_ref.sum().backward()
    rows = fk.cross_entropy(logits.detach(), target, reduction="none")[tail]  # the whole tensor: int64 offsets
    assert rel_err(rows, rows_ref) < 1e-6
    assert rel_err(grad[tail], xt.grad) < 1e-2
    total_ref = torch.nn.functional.cross_entropy(logits.detach().float(), target, reduction="sum")
    assert rel_err(loss, total_ref) < 1e-5
