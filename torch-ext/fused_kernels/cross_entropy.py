"""Cross-entropy over given logits: torch ops, autograd, fake kernels and the functional API.

The loss (formulas in ``kernels_src/cross_entropy.py``) is torch's ``F.cross_entropy`` over the last
dimension, with class weights and label smoothing as torch defines them, plus a z-loss (``lse_square_scale *
logsumexp**2`` per counted token, not class-weighted) and optional logit soft-capping
(``softcap * tanh(logits / softcap)``, differentiated through). Math and losses are fp32 whatever the logits
dtype; the gradient has the logits dtype.

Reductions. ``"mean"`` divides the summed token losses (z-loss included) by D, the number of tokens whose
target is not ``ignore_index`` (with class weights: the sum of their targets' weights, as torch does). D is
computed on the device: no host synchronisation, so CUDA graphs and ``torch.compile(fullgraph=True)`` work.
When D is 0 (every token ignored, or every counted target's class weight 0) the loss and gradient are 0 (torch
gives NaN). ``"sum"`` adds them, ``"none"`` returns one loss per token (0 for ignored tokens). A target outside
``[0, vocab)`` that is not ``ignore_index`` makes its token's loss and gradient NaN (documented, device-side,
never an out-of-bounds access): the loss turns NaN.

Gradient traffic. In eager mode with reduction mean/sum, when bf16 or fp32 logits require grad, the gradient is
written during the forward pass (the row is re-read from L2 right after its log-sum-exp), so the backward only
multiplies it by the incoming gradient, in place, and skips even that on the device when the incoming
gradient is exactly 1 (``loss.backward()``). That buffer is the only extra memory. A second backward through
the same graph is refused (the buffer was consumed). With ``inplace_backward=True`` the gradient overwrites
the caller's logits instead (their autograd version is bumped, so an op that saved them raises rather than
computing a wrong gradient); by default the logits are never written. Reduction ``"none"``, fp16 logits
(``gradients_in_forward``) and every reduction under ``torch.compile`` keep the forward pure: it saves the
per-token log-sum-exp and the backward computes the gradient with the incoming gradient (each token's, or the
reduced loss's) folded in before it is rounded (one read, one write). The gradient has no autograd graph of its
own, so double backward raises (``refuses_double_backward``).

CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run the Triton kernels; otherwise a plain PyTorch
implementation of the same function runs (the ``torch-cpu`` variant). The helpers ``loss_constants``,
``loss_rows`` and ``scale_`` are shared with fused linear cross-entropy.
"""

import math
from typing import NamedTuple

import torch

from . import _checks
from ._autograd import refuses_double_backward
from ._build_info import BACKEND
from ._launch_config import multiprocessor_count, pick
from ._ops import add_op_namespace_prefix

if BACKEND == "cuda":
    from ._kernels import cross_entropy as _triton_ce
else:
    _triton_ce = None

REDUCTIONS = ("mean", "sum", "none")
TARGET_DTYPES = (torch.int64, torch.int32)
_CONFIG_FAMILY = "cross_entropy"


class LossOptions(NamedTuple):
    ignore_index: int
    reduction: str
    label_smoothing: float
    lse_square_scale: float
    softcap: float | None


def validate_options(opts: LossOptions):
    if isinstance(opts.ignore_index, bool) or not isinstance(opts.ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {opts.ignore_index!r}")
    # The kernels compare it with int64 targets: a value outside int64 has no such comparison.
    if not -2**63 <= opts.ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64, got {opts.ignore_index}")
    _checks.check_choice("reduction", opts.reduction, REDUCTIONS)
    ls = opts.label_smoothing
    if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not 0.0 <= ls <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {ls!r}")
    z = opts.lse_square_scale
    if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0:
        raise ValueError(f"lse_square_scale must be a finite number >= 0, got {z!r}")
    cap = opts.softcap
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap)
                            or cap <= 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {cap!r}")


def validate_target_and_weight(target, weight, leading_shape, n_classes, ref_name, ref):
    """target: integer class indices of shape ``leading_shape``; weight: optional ``(n_classes,)`` float."""
    _checks.check_tensor("target", target, dtypes=TARGET_DTYPES)
    if tuple(target.shape) != tuple(leading_shape):
        raise ValueError(f"target must have shape {tuple(leading_shape)} (the leading dimensions of {ref_name}), "
                         f"got {tuple(target.shape)}")
    if weight is not None:
        _checks.check_tensor("weight", weight, ndim=1)
        if weight.shape[0] != n_classes:
            raise ValueError(f"weight must have shape ({n_classes},), one weight per class, got {tuple(weight.shape)}")
    _checks.check_same_device(ref_name, ref, target=target, weight=weight)


def _validate(logits, target, weight, opts):
    _checks.check_tensor("logits", logits, min_ndim=1)
    if logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (class) dimension, got shape {tuple(logits.shape)}")
    validate_target_and_weight(target, weight, logits.shape[:-1], logits.shape[-1], "logits", logits)
    validate_options(opts)


# ----------------------------------------------------------------------------------------------------------
# Row computations shared with fused linear cross-entropy: Triton, or plain PyTorch with the same numerics.
# ----------------------------------------------------------------------------------------------------------

def _needs_weight_sum(weight, opts) -> bool:
    return weight is not None and opts.label_smoothing > 0


def loss_constants(target: torch.Tensor, weight, n_classes: int, opts: LossOptions) -> torch.Tensor:
    """fp32 ``[r, W]`` on the device: r = 1 / D, D the "mean" denominator over the flat ``target`` (r = 0 where D
    = 0), W the sum of the class weights (only computed when label smoothing needs it)."""
    if _checks.runs_triton(target):
        constants = torch.zeros(2, device=target.device, dtype=torch.float32)
        config = pick(_CONFIG_FAMILY, "constants", target.device, n_classes)
        _triton_ce.loss_constants(target, weight, constants, target.numel(), n_classes, opts.ignore_index,
                                  _needs_weight_sum(weight, opts), block=config["block_cols"],
                                  num_warps=config["num_warps"])
        return constants
    counted = (target != opts.ignore_index) & (target >= 0) & (target < n_classes)
    if weight is None:
        denominator = counted.sum().float()
    else:
        denominator = torch.where(counted, weight.float()[torch.where(counted, target, 0).long()], 0.0).sum()
    weight_sum = weight.float().sum() if _needs_weight_sum(weight, opts) else denominator.new_zeros(())
    return torch.stack([torch.where(denominator != 0, 1.0 / denominator, 0.0), weight_sum])


def _torch_rows(logits, target, weight, constants, opts, loss, z_loss, row_stats, dlogits, grad_out, loss_pass,
                grad_pass, n_classes, col_start):
    n_cols = logits.shape[1]
    eps, cap = opts.label_smoothing, opts.softcap
    z = logits.float()
    tanh = torch.tanh(z / cap) if cap is not None else None
    x = cap * tanh if cap is not None else z
    ignored = target == opts.ignore_index
    counted = ~ignored & (target >= 0) & (target < n_classes)
    y = torch.where(counted, target, 0).long()
    w = weight.float() if weight is not None else None
    w_y = w[y] if w is not None else torch.ones_like(x[:, 0])
    weight_sum = constants[1] if w is not None else float(n_classes)
    r = constants[0] if opts.reduction == "mean" else 1.0
    nan = float("nan")
    if loss_pass:
        # As in the kernel: a row whose logits are all -inf is shifted by 0 (its lse is then -inf, not NaN).
        row_max = x.amax(dim=1)
        row_max = torch.where(counted & (row_max > float("-inf")), row_max, 0.0)
        log_sum = torch.where(counted, (x - row_max[:, None]).exp().sum(1).log(), 0.0)
        row_stats.copy_(torch.stack([row_max, log_sum], dim=1))
    row_max, log_sum = row_stats.unbind(1)
    row_lse = row_max + log_sum
    if loss_pass:
        ce = (1 - eps) * w_y * ((row_max - x.gather(1, y[:, None])[:, 0]) + log_sum)
        if eps > 0:
            # sum_c w_c * (lse - x_c) as non-negative terms (see the kernel): no cancellation.
            gaps = row_max[:, None] - x
            ce = ce + eps / n_classes * ((gaps * w if w is not None else gaps).sum(1) + weight_sum * log_sum)
        z_part = opts.lse_square_scale * row_lse.square() if opts.lse_square_scale > 0 else torch.zeros_like(ce)
        loss.copy_(torch.where(ignored, 0.0, torch.where(counted, r * (ce + z_part), nan)))
        if z_loss is not None:
            z_loss.copy_(torch.where(ignored, 0.0, torch.where(counted, r * z_part, nan)))
    if grad_pass:
        scale = r * (grad_out.float().reshape(-1) if grad_out is not None else 1.0) * torch.ones_like(row_lse)
        coef_y = torch.where(ignored | counted, scale * (1 - eps) * w_y, nan)
        p = torch.exp((torch.where(counted[:, None], x, 0.0) - row_max[:, None]) - log_sum[:, None])
        # coef_y * (p - onehot): p - 1 is exact near 1, keeping a confident target's small gradient. The
        # smoothing and z-loss terms stay separate, so each cancels only against its own kind. The target's
        # column, where it lies in this block of columns.
        local_y = y - col_start
        hit = (local_y >= 0) & (local_y < n_cols)
        dx = coef_y[:, None] * p.scatter_add(1, torch.where(hit, local_y, 0)[:, None], -hit[:, None].to(p.dtype))
        if eps > 0:
            smoothing = (scale * eps / n_classes)[:, None]
            w_cols = w[None, col_start:col_start + n_cols] if w is not None else 1.0
            dx = dx + smoothing * (weight_sum * p - w_cols)
        dx = dx + (scale * 2 * opts.lse_square_scale * row_lse)[:, None] * p
        if cap is not None:
            dx = dx * (1 - tanh * tanh)
        dlogits.copy_(torch.where(ignored[:, None], 0.0, dx))


def loss_rows(logits, target, weight, constants, opts: LossOptions, *, loss=None, z_loss=None, row_stats,
              dlogits=None,
              grad_out=None, loss_pass: bool, grad_pass: bool, n_classes: int | None = None, col_start: int = 0):
    """Per-row losses and/or gradients of the 2-D ``logits`` against the flat ``target``.

    ``loss_pass`` writes ``loss`` and ``z_loss`` (optional; fp32, one per row, already multiplied by 1 / D under
    reduction "mean") and ``row_stats`` (``new_row_stats``: each row's log-sum-exp as max and log of the shifted
    sum). ``grad_pass`` writes the gradient into ``dlogits`` (may be ``logits`` itself), reading ``row_stats``
    when there is no loss pass, times ``grad_out`` when given (one per row, or one).
    A gradient pass alone may take a column slice: ``logits`` then holds columns ``[col_start, col_start +
    logits.shape[1])`` of rows of ``n_classes`` classes (default: whole rows)."""
    n_classes = logits.shape[1] if n_classes is None else n_classes
    if loss_pass and (col_start != 0 or n_classes != logits.shape[1]):
        raise ValueError(f"a loss pass needs whole rows, got columns [{col_start}, {col_start + logits.shape[1]}) "
                         f"of {n_classes}")
    if logits.shape[0] == 0:
        return
    if _checks.runs_triton(logits):
        config = pick(_CONFIG_FAMILY, "rows", logits.device, logits.shape[1])
        _triton_ce.cross_entropy_rows(
            logits, target, weight, constants, loss, z_loss, row_stats, dlogits, grad_out, logits.shape[0],
            logits.shape[1], opts.ignore_index, opts.label_smoothing, opts.lse_square_scale, opts.softcap,
            opts.reduction == "mean", loss_pass=loss_pass, grad_pass=grad_pass, block_cols=config["block_cols"],
            num_warps=config["num_warps"], num_stages=config.get("num_stages"), n_classes=n_classes,
            col_start=col_start)
    else:
        _torch_rows(logits, target, weight, constants, opts, loss, z_loss, row_stats, dlogits, grad_out, loss_pass,
                    grad_pass, n_classes, col_start)


def new_row_stats(n_rows: int, device) -> torch.Tensor:
    """The (n_rows, 2) fp32 buffer of each row's (max, log sum exp(x - max)): lse in two parts, so that a
    backward from saved statistics gets softmax as exp((x - max) - log_sum), exact even for logits of 1e4."""
    return torch.empty((n_rows, 2), device=device, dtype=torch.float32)


def scale_(t: torch.Tensor, scale: torch.Tensor) -> None:
    """``t *= scale`` in place (``scale`` a one-element tensor), multiplied in fp32 and rounded once (a scale
    rounded to fp16 first overflows from 65504, GradScaler's 65536 included; to bf16, it is off by up to 0.4% for
    every element); free on the GPU when ``scale`` is exactly 1."""
    if _checks.runs_triton(t):
        config = pick(_CONFIG_FAMILY, "scale", t.device, t.shape[-1] if t.dim() else 1)
        _triton_ce.scale_(t, scale, block=config["block_cols"], num_warps=config["num_warps"],
                          num_programs=config["programs_per_sm"] * multiprocessor_count(t.device))
    elif t.dtype == torch.float32:
        t.mul_(scale.float())
    else:
        t.copy_(t.float().mul_(scale.float()))


def gradients_in_forward(reduction: str, dtype: torch.dtype) -> bool:
    """Whether a loss over inputs of ``dtype`` computes its gradients in the forward (then scaled by the incoming
    gradient): reductions mean and sum, except in fp16. An fp16 gradient rounded before that scale loses what
    torch keeps: with "mean" each entry is divided by the token count first, so under a GradScaler's loss scale
    (which exists because fp16 underflows) probabilities below about 6e-8 x tokens become 0 instead of scale /
    tokens times themselves; fp16 computes the gradient in the backward, with the incoming gradient folded in
    before its single rounding. bf16 and fp32 have fp32's exponent range: a gradient other than 1 costs them one
    more rounding, no underflow."""
    return reduction != "none" and dtype != torch.float16


def take_forward_grads(ctx, op_name: str, grad_loss: torch.Tensor) -> tuple:
    """The gradients an eager forward computed (``ctx.forward_grads``, None entries allowed), scaled in place by
    the incoming gradient of the loss; they are handed out once, so a second backward through the same graph
    raises instead of returning them scaled twice."""
    grads, ctx.forward_grads = ctx.forward_grads, None
    if grads is None:
        raise RuntimeError(f"{op_name}: backward ran twice through the same graph; its gradients were computed in "
                           "the forward and consumed by the first backward")
    for g in grads:
        if g is not None and g.numel():  # an empty one (hidden size 0) has nothing to scale, nor a view(-1, 0)
            scale_(g.view(-1, g.shape[-1]) if g.dim() > 1 else g, grad_loss)
    return grads


def reduce_rows(rows: torch.Tensor, opts: LossOptions, shape) -> torch.Tensor:
    """The reduced loss from per-row values (already divided by D under "mean")."""
    return rows.view(shape) if opts.reduction == "none" else rows.sum()


# ----------------------------------------------------------------------------------------------------------
# Forward and backward.
# ----------------------------------------------------------------------------------------------------------

def _can_hold_gradient(logits, logits2d) -> bool:
    """Whether the gradient may overwrite the caller's logits (``logits2d``: their rows) when inplace_backward allows
    it: unit column stride, rows that do not overlap (expanded logits, row stride 0, would take every row's gradient
    in the same memory; unfold()ed ones, row stride below the row length, each row's gradient in the next row's
    logits before they are read), and not the memory of a leaf that requires grad (a parameter would become its
    gradient)."""
    n_rows, n_cols = logits2d.shape
    return (logits2d.stride(1) == 1 and (n_rows <= 1 or logits2d.stride(0) >= n_cols)
            and not _checks.overwrites_grad_leaf(logits))


def _forward(logits, target, weight, opts, return_z_loss, grad_in_forward, inplace):
    """(loss, z_loss or None, row_stats, constants, dlogits or None): dlogits when ``grad_in_forward`` (reduction mean
    or sum), written into the logits when ``inplace`` and they can hold it (``_can_hold_gradient``)."""
    _validate(logits, target, weight, opts)
    n_classes = logits.shape[-1]
    logits2d, target1d = logits.reshape(-1, n_classes), target.reshape(-1).contiguous()
    weight = weight.contiguous() if weight is not None else None
    n_rows = target1d.numel()
    constants = loss_constants(target1d, weight, n_classes, opts)
    rows = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    z_rows = torch.empty_like(rows) if return_z_loss else None
    row_stats = new_row_stats(n_rows, logits.device)
    dlogits = None
    if grad_in_forward:
        if inplace and _can_hold_gradient(logits, logits2d):
            dlogits = logits2d
        else:
            dlogits = torch.empty((n_rows, n_classes), device=logits.device, dtype=logits.dtype)
    loss_rows(logits2d, target1d, weight, constants, opts, loss=rows, z_loss=z_rows, row_stats=row_stats,
              dlogits=dlogits, loss_pass=True, grad_pass=grad_in_forward)
    loss = reduce_rows(rows, opts, target.shape)
    z_loss = reduce_rows(z_rows, opts, target.shape) if return_z_loss else None
    return loss, z_loss, row_stats, constants, dlogits


def _backward(grad_loss, logits, target, weight, row_stats, constants, opts):
    """The logits gradient from the saved row statistics, with the incoming gradient folded in."""
    n_classes = logits.shape[-1]
    logits2d = logits.reshape(-1, n_classes)
    dlogits = torch.empty(logits2d.shape, device=logits.device, dtype=logits.dtype)
    loss_rows(logits2d, target.reshape(-1).contiguous(), weight.contiguous() if weight is not None else None,
              constants, opts, row_stats=row_stats, dlogits=dlogits, grad_out=grad_loss.reshape(-1).contiguous(),
              loss_pass=False, grad_pass=True)
    return dlogits.view(logits.shape)


def _options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap) -> LossOptions:
    return LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)


# ----------------------------------------------------------------------------------------------------------
# Ops (what torch.compile, export and opcheck see).
# ----------------------------------------------------------------------------------------------------------

@torch.library.custom_op(add_op_namespace_prefix("cross_entropy"), mutates_args=())
def _cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
                      reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None,
                      return_z_loss: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z_loss (empty unless ``return_z_loss``), row statistics (``new_row_stats``), constants [1 / D or 0,
    W]) with a pure forward."""
    opts = _options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    loss, z_loss, row_stats, constants, _ = _forward(logits, target, weight, opts, return_z_loss, False, False)
    return loss, z_loss if z_loss is not None else loss.new_empty(0), row_stats, constants


@_cross_entropy_op.register_fake
def _(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss):
    _validate(logits, target, weight,
              _options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap))
    loss_shape = target.shape if reduction == "none" else ()
    loss = logits.new_empty(loss_shape, dtype=torch.float32)
    z_loss = logits.new_empty(loss_shape if return_z_loss else (0,), dtype=torch.float32)
    return loss, z_loss, logits.new_empty((target.numel(), 2), dtype=torch.float32), \
        logits.new_empty((2,), dtype=torch.float32)


@torch.library.custom_op(add_op_namespace_prefix("cross_entropy_backward"), mutates_args=())
def _cross_entropy_backward_op(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                               weight: torch.Tensor | None, row_stats: torch.Tensor, constants: torch.Tensor,
                               ignore_index: int, reduction: str, label_smoothing: float, lse_square_scale: float,
                               softcap: float | None) -> torch.Tensor:
    opts = _options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    return _backward(grad_loss, logits, target, weight, row_stats, constants, opts)


@_cross_entropy_backward_op.register_fake
def _(grad_loss, logits, target, weight, row_stats, constants, ignore_index, reduction, label_smoothing,
      lse_square_scale, softcap):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _op_setup_context(ctx, inputs, output):
    logits, target, weight, *options, _ = inputs
    ctx.save_for_backward(logits, target, weight, output[2], output[3])
    ctx.options = options


def _op_backward(ctx, grad_loss, grad_z_loss, grad_row_stats, grad_constants):
    logits, target, weight, row_stats, constants = ctx.saved_tensors
    dlogits = _cross_entropy_backward_op(grad_loss, logits, target, weight, row_stats, constants, *ctx.options)
    return dlogits, None, None, None, None, None, None, None, None


_cross_entropy_op.register_autograd(_op_backward, setup_context=_op_setup_context)


class _EagerCrossEntropy(torch.autograd.Function):
    """The eager path (no dispatcher round trips; see rms_norm.py), with the gradient written during the
    forward for reductions mean and sum (module docstring)."""

    @staticmethod
    def forward(ctx, logits, target, weight, opts, return_z_loss, needs_grad, inplace):
        grad_in_forward = needs_grad and gradients_in_forward(opts.reduction, logits.dtype)
        loss, z_loss, row_stats, constants, dlogits = _forward(logits, target, weight, opts, return_z_loss,
                                                               grad_in_forward, inplace)
        ctx.opts, ctx.logits_shape, ctx.grad_in_forward = opts, logits.shape, grad_in_forward
        ctx.forward_grads = (dlogits,)
        if dlogits is not None and dlogits._base is not None:
            # A view, so of the caller's logits (_forward allocates a new buffer otherwise), which now hold the
            # gradient: make autograd's saved-tensor checks see the write. (Not by data pointers, which fake tensors
            # lack.)
            torch.autograd.graph.increment_version(logits)
        if needs_grad and not grad_in_forward:
            ctx.save_for_backward(logits, target, weight, row_stats, constants)
        if z_loss is not None:
            ctx.mark_non_differentiable(z_loss)
        # z_loss never receives a gradient; materialised, it would be a zero fill per backward.
        ctx.set_materialize_grads(False)
        return loss, z_loss

    @staticmethod
    @refuses_double_backward("cross_entropy")
    def backward(ctx, grad_loss, grad_z_loss):
        if grad_loss is None:  # a consumer of the loss returned no gradient for it: zero gradients, as None says
            ctx.forward_grads = None
            return (None,) * 7
        if ctx.grad_in_forward:
            dlogits, = take_forward_grads(ctx, "cross_entropy", grad_loss)
            dlogits = dlogits.view(ctx.logits_shape)
        else:
            logits, target, weight, row_stats, constants = ctx.saved_tensors
            dlogits = _backward(grad_loss, logits, target, weight, row_stats, constants, ctx.opts)
        return dlogits, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------------

def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None, *,
                  ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                  lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
                  inplace_backward: bool = False):
    """Cross-entropy of ``logits`` (``(..., vocab)``, classes last) against integer ``target`` (``(...)``).

    Args:
        logits: float32/float16/bfloat16, any strides (rows that cannot be viewed as one strided dimension
            are copied).
        target: int64 or int32 class indices; ``ignore_index`` marks tokens without a loss.
        weight: optional ``(vocab,)`` class weights (not differentiated), as in ``F.cross_entropy``.
        reduction: ``"mean"`` (over non-ignored tokens, or their targets' summed weights; 0 when all are
            ignored or those weights sum to 0), ``"sum"`` or ``"none"`` (fp32 losses of ``target``'s shape).
        label_smoothing: in [0, 1], torch's definition.
        lse_square_scale: z-loss coefficient: adds ``lse_square_scale * logsumexp(logits)**2`` per token.
        softcap: if given, logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2).
        return_z_loss: also return the z-loss part of the loss (reduced the same way, not differentiable).
        inplace_backward: allow the gradient to overwrite ``logits`` (saves one logits-sized buffer; eager mode,
            reductions mean/sum, bf16 or fp32 logits with unit column stride whose rows do not overlap, as
            expanded or unfold()ed ones do, and that are not a leaf requiring grad or a view of one; ignored
            otherwise and under ``torch.compile``).

    Returns the fp32 loss, or ``(loss, z_loss)`` with ``return_z_loss``. Differentiable in ``logits``.
    """
    opts = _options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    if torch.compiler.is_compiling():
        loss, z_loss, _, _ = _cross_entropy_op(logits, target, weight, *opts, return_z_loss)
    else:
        needs_grad = torch.is_grad_enabled() and isinstance(logits, torch.Tensor) and logits.requires_grad
        loss, z_loss = _EagerCrossEntropy.apply(logits, target, weight, opts, return_z_loss, needs_grad,
                                                bool(inplace_backward))
    return (loss, z_loss) if return_z_loss else loss
