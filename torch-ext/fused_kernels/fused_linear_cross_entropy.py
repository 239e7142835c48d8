"""Fused linear cross-entropy: ``cross_entropy(hidden @ weight.T + bias, target)`` without storing the
``(tokens, vocab)`` logits. Torch ops, autograd, fake kernels and the functional API.

Algorithm. The tokens are processed in chunks of ``chunk_tokens`` rows, through one reused ``(chunk, vocab)``
buffer in the input dtype:
  1. ``logits = hidden_chunk @ weight.T (+ bias)``: a cuBLAS GEMM on tensor cores (fp32 accumulation, rounded to
     the input dtype, exactly what ``lm_head`` gives a model);
  2. the cross-entropy row kernel (``kernels_src/cross_entropy.py``) computes each token's loss and, when
     gradients are needed, overwrites the buffer with d(loss)/d(logits) in the same kernel;
  3. ``grad_hidden[chunk] = dlogits @ weight`` and ``grad_weight += dlogits.T @ hidden_chunk`` (and
     ``grad_bias += dlogits.sum(0)``).
The "mean" denominator is computed once over all tokens on the device before the first chunk, so every chunk's
gradient already carries the final 1/D (no host synchronisation).

Weight gradient. It is accumulated in one fp32 ``(vocab, hidden)`` buffer: the first chunk's GEMM writes it
(``mm`` with an fp32 output), later chunks add into it in the GEMM epilogue (``addmm`` with beta=1, fp32
output from half-precision operands), and it is rounded to the weight's dtype once at the end (accumulating in
bf16 across chunks is a known cause of divergence). Each later chunk re-reads and re-writes that buffer, so the
default chunk is as large as the memory budget allows (``CHUNK_BYTES`` of chunk logits, about three chunks for
8192 tokens of a 152k vocabulary): the alternative, a vocabulary-sliced loop whose GEMMs see all tokens as
their reduction dimension, would need the log-sum-exp of every token first and so compute the logits twice
(8 instead of 6 * tokens * vocab * hidden FLOPs). For fp32 weights the buffer is the gradient itself.

Memory, beyond the inputs: the chunk buffer (``chunk_tokens * vocab`` elements of the input dtype), the fp32
weight-gradient buffer (``4 * vocab * hidden`` bytes; for half-precision weights the rounded gradient,
``2 * vocab * hidden``, briefly coexists with it), and the hidden (and bias) gradients. Nothing grows with
``tokens * vocab``.

When the gradients are computed. Eager mode, reductions mean/sum: during the forward (as the fused CE does),
and the backward multiplies them in place by the incoming gradient, skipping that on the device when it is
exactly 1; a second backward through the same graph is refused. Reduction "none": the forward computes only
the losses, and the backward runs the chunked pass again with each token's incoming gradient folded into its
logits gradient. Under ``torch.compile`` the registered op computes the gradients in the forward when an input
requires grad, and the backward scales them out of place (or, for "none", recomputes as above).

Everything else (options, NaN for out-of-range targets, fp32 losses) is as in ``cross_entropy``. A NaN row
(out-of-range target) also makes the weight gradient NaN, since every token contributes to it.
"""

import torch

from . import _checks
from .cross_entropy import (LossOptions, loss_constants, loss_rows, new_row_stats, reduce_rows, scale_,
                            validate_options, validate_target_and_weight)
from ._ops import add_op_namespace_prefix

# Default budget for the chunk's logits buffer.
CHUNK_BYTES = 1 << 30
# Chunks are rounded up to a multiple of this many tokens (tensor-core tile friendly GEMM shapes).
_CHUNK_MULTIPLE = 64


def chunk_tokens_for(n_tokens: int, vocab: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: the fewest equal chunks whose logits fit in about ``chunk_bytes``."""
    if n_tokens == 0:
        return 1
    n_chunks = max(1, -(-n_tokens * vocab * itemsize // chunk_bytes))
    per_chunk = -(-n_tokens // n_chunks)
    return min(n_tokens, -(-per_chunk // _CHUNK_MULTIPLE) * _CHUNK_MULTIPLE)


def _validate(hidden, weight, target, bias, class_weight, opts, chunk_tokens):
    _checks.check_tensor("hidden", hidden, min_ndim=1)
    _checks.check_tensor("weight", weight, ndim=2)
    if weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"weight must have shape (vocab, {hidden.shape[-1]}) with vocab > 0 to match hidden "
                         f"{tuple(hidden.shape)}, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have the dtype of hidden ({hidden.dtype}), got {weight.dtype}")
    if bias is not None:
        _checks.check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0] or bias.dtype != hidden.dtype:
            raise ValueError(f"bias must be a ({weight.shape[0]},) tensor of dtype {hidden.dtype}, got "
                             f"{tuple(bias.shape)} {bias.dtype}")
    _checks.check_same_device("hidden", hidden, weight=weight, bias=bias)
    if class_weight is not None:
        _checks.check_tensor("class_weight", class_weight, ndim=1)
        if class_weight.shape[0] != weight.shape[0]:
            raise ValueError(f"class_weight must have shape ({weight.shape[0]},), got {tuple(class_weight.shape)}")
    validate_target_and_weight(target, None, hidden.shape[:-1], weight.shape[0], "hidden", hidden)
    _checks.check_same_device("hidden", hidden, class_weight=class_weight)
    validate_options(opts)
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")


def _accumulate_weight_grad(acc, dlogits, hidden_chunk, first):
    """acc (fp32) = or += dlogits.T @ hidden_chunk, accumulating in fp32."""
    if acc.dtype == dlogits.dtype:
        if first:
            torch.mm(dlogits.t(), hidden_chunk, out=acc)
        else:
            acc.addmm_(dlogits.t(), hidden_chunk)
    elif acc.is_cuda:
        # Half-precision operands, fp32 output: the GEMM reads and writes the fp32 buffer directly.
        if first:
            torch.mm(dlogits.t(), hidden_chunk, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, dlogits.t(), hidden_chunk, out_dtype=torch.float32, out=acc)
    else:
        # CPU has no mixed-precision GEMM: upcast the operands (same products, fp32 sums).
        if first:
            torch.mm(dlogits.t().float(), hidden_chunk.float(), out=acc)
        else:
            acc.addmm_(dlogits.t().float(), hidden_chunk.float())


def _run(hidden, weight, target, bias, class_weight, opts, return_z_loss, chunk_tokens, needs, grad_rows=None):
    """The chunked pass. Returns (loss, z_loss or None, grad_hidden, grad_weight, grad_bias), each gradient None
    unless requested in ``needs`` (hidden, weight, bias); gradients include ``grad_rows`` when given (one
    incoming gradient per token, reduction "none")."""
    _validate(hidden, weight, target, bias, class_weight, opts, chunk_tokens)
    n_hidden, vocab = hidden.shape[-1], weight.shape[0]
    hidden2d, target1d = hidden.reshape(-1, n_hidden), target.reshape(-1).contiguous()
    class_weight = class_weight.contiguous() if class_weight is not None else None
    n_tokens = target1d.numel()
    need_hidden, need_weight, need_bias = needs
    need_bias = need_bias and bias is not None
    any_grad = need_hidden or need_weight or need_bias
    device = hidden.device

    constants = loss_constants(target1d, class_weight, vocab, opts)
    rows = torch.empty(n_tokens, device=device, dtype=torch.float32)
    z_rows = torch.empty_like(rows) if return_z_loss else None
    row_stats = new_row_stats(n_tokens, device)
    grad_hidden = torch.empty((n_tokens, n_hidden), device=device, dtype=hidden.dtype) if need_hidden else None
    # The first chunk's GEMM overwrites the whole buffer; it needs zeros only when there is no chunk at all.
    allocate = torch.empty if n_tokens else torch.zeros
    weight_acc = allocate((vocab, n_hidden), device=device, dtype=torch.float32) if need_weight else None
    bias_acc = torch.zeros(vocab, device=device, dtype=torch.float32) if need_bias else None
    chunk = min(chunk_tokens, max(n_tokens, 1))
    buffer = torch.empty((chunk, vocab), device=device, dtype=hidden.dtype)
    weight_t = weight.t()
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        hidden_chunk, logits = hidden2d[start:end], buffer[: end - start]
        if bias is not None:
            torch.addmm(bias, hidden_chunk, weight_t, out=logits)
        else:
            torch.mm(hidden_chunk, weight_t, out=logits)
        loss_rows(logits, target1d[start:end], class_weight, constants, opts, loss=rows[start:end],
                  z_loss=z_rows[start:end] if z_rows is not None else None, row_stats=row_stats[start:end],
                  dlogits=logits if any_grad else None,
                  grad_out=grad_rows[start:end] if grad_rows is not None else None,
                  loss_pass=True, grad_pass=any_grad)
        if need_hidden:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if need_weight:
            _accumulate_weight_grad(weight_acc, logits, hidden_chunk, first=start == 0)
        if need_bias:
            bias_acc += torch.sum(logits, 0, dtype=torch.float32)
    del buffer
    loss = reduce_rows(rows, opts, target.shape)
    z_loss = reduce_rows(z_rows, opts, target.shape) if return_z_loss else None
    grad_weight = weight_acc.to(weight.dtype) if need_weight else None
    del weight_acc
    grad_bias = bias_acc.to(bias.dtype) if need_bias else None
    if grad_hidden is not None:
        grad_hidden = grad_hidden.view(hidden.shape)
    return loss, z_loss, grad_hidden, grad_weight, grad_bias


def _needs(hidden, weight, bias) -> tuple[bool, bool, bool]:
    if not torch.is_grad_enabled():
        return False, False, False
    return (isinstance(hidden, torch.Tensor) and hidden.requires_grad,
            isinstance(weight, torch.Tensor) and weight.requires_grad,
            isinstance(bias, torch.Tensor) and bias.requires_grad)


# ----------------------------------------------------------------------------------------------------------
# Ops (what torch.compile, export and opcheck see).
# ----------------------------------------------------------------------------------------------------------

def _empty(t):
    return t.new_empty(0)


@torch.library.custom_op(add_op_namespace_prefix("fused_linear_cross_entropy"), mutates_args=())
def _flce_op(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
             class_weight: torch.Tensor | None, ignore_index: int, reduction: str, label_smoothing: float,
             lse_square_scale: float, softcap: float | None, return_z_loss: bool, chunk_tokens: int,
             grad_hidden: bool, grad_weight: bool, grad_bias: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z_loss, grad_hidden, grad_weight, grad_bias). The flagged gradients are computed here (for an
    incoming gradient of 1) under reductions mean and sum, and by the backward op under "none"; empty tensors
    stand for what is not computed here."""
    opts = LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    in_forward = reduction != "none"
    loss, z_loss, dh, dw, db = _run(hidden, weight, target, bias, class_weight, opts, return_z_loss, chunk_tokens,
                                    (grad_hidden and in_forward, grad_weight and in_forward, grad_bias and in_forward))
    return (loss, z_loss if z_loss is not None else _empty(loss), dh if dh is not None else _empty(hidden),
            dw if dw is not None else _empty(weight), db if db is not None else _empty(hidden))


@_flce_op.register_fake
def _(hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, lse_square_scale,
      softcap, return_z_loss, chunk_tokens, grad_hidden, grad_weight, grad_bias):
    opts = LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    _validate(hidden, weight, target, bias, class_weight, opts, chunk_tokens)
    loss_shape = target.shape if reduction == "none" else ()
    loss = hidden.new_empty(loss_shape, dtype=torch.float32)
    z_loss = hidden.new_empty(loss_shape if return_z_loss else (0,), dtype=torch.float32)
    in_forward = reduction != "none"
    dh = hidden.new_empty(hidden.shape) if grad_hidden and in_forward else _empty(hidden)
    dw = weight.new_empty(weight.shape) if grad_weight and in_forward else _empty(weight)
    db = bias.new_empty(bias.shape) if grad_bias and in_forward and bias is not None else _empty(hidden)
    return loss, z_loss, dh, dw, db


@torch.library.custom_op(add_op_namespace_prefix("fused_linear_cross_entropy_backward"), mutates_args=())
def _flce_backward_op(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                      bias: torch.Tensor | None, class_weight: torch.Tensor | None, ignore_index: int,
                      reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None,
                      chunk_tokens: int, grad_hidden: bool, grad_weight: bool,
                      grad_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients recomputed chunk by chunk with per-token incoming gradients (reduction "none")."""
    opts = LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    _, _, dh, dw, db = _run(hidden, weight, target, bias, class_weight, opts, False, chunk_tokens,
                            (grad_hidden, grad_weight, grad_bias), grad_rows=grad_loss.reshape(-1).contiguous())
    return (dh if dh is not None else _empty(hidden), dw if dw is not None else _empty(weight),
            db if db is not None else _empty(hidden))


@_flce_backward_op.register_fake
def _(grad_loss, hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
      lse_square_scale, softcap, chunk_tokens, grad_hidden, grad_weight, grad_bias):
    return (hidden.new_empty(hidden.shape) if grad_hidden else _empty(hidden),
            weight.new_empty(weight.shape) if grad_weight else _empty(weight),
            bias.new_empty(bias.shape) if grad_bias and bias is not None else _empty(hidden))


def _op_setup_context(ctx, inputs, output):
    hidden, weight, target, bias, class_weight, *options = inputs
    ctx.options = options  # ignore_index ... grad_bias, as the ops take them
    ctx.reduction = options[1]
    if ctx.reduction == "none":
        ctx.save_for_backward(hidden, weight, target, bias, class_weight)
    else:
        ctx.save_for_backward(*output[2:])


def _op_backward(ctx, grad_loss, grad_z_loss, *unused):
    grad_hidden_flag, grad_weight_flag, grad_bias_flag = ctx.options[-3:]
    if ctx.reduction == "none":
        hidden, weight, target, bias, class_weight = ctx.saved_tensors
        ignore_index, reduction, label_smoothing, lse_square_scale, softcap, _, chunk_tokens = ctx.options[:7]
        dh, dw, db = _flce_backward_op(grad_loss, hidden, weight, target, bias, class_weight, ignore_index, reduction,
                                       label_smoothing, lse_square_scale, softcap, chunk_tokens, grad_hidden_flag,
                                       grad_weight_flag, grad_bias_flag)
    else:
        dh, dw, db = (g * grad_loss.to(g.dtype) for g in ctx.saved_tensors)
    return (dh if grad_hidden_flag else None, dw if grad_weight_flag else None, None,
            db if grad_bias_flag else None, None, None, None, None, None, None, None, None, None, None, None)


_flce_op.register_autograd(_op_backward, setup_context=_op_setup_context)


class _EagerFusedLinearCrossEntropy(torch.autograd.Function):
    """The eager path (no dispatcher round trips), gradients computed in the forward for mean/sum."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, class_weight, opts, return_z_loss, chunk_tokens, needs):
        grad_in_forward = any(needs) and opts.reduction != "none"
        loss, z_loss, dh, dw, db = _run(hidden, weight, target, bias, class_weight, opts, return_z_loss,
                                        chunk_tokens, needs if grad_in_forward else (False, False, False))
        ctx.opts, ctx.chunk_tokens, ctx.needs, ctx.grad_in_forward = opts, chunk_tokens, needs, grad_in_forward
        ctx.grads = (dh, dw, db)
        if any(needs) and not grad_in_forward:
            ctx.save_for_backward(hidden, weight, target, bias, class_weight)
        if z_loss is not None:
            ctx.mark_non_differentiable(z_loss)
        return loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_z_loss):
        if ctx.grad_in_forward:
            grads, ctx.grads = ctx.grads, None
            if grads is None:
                raise RuntimeError("fused_linear_cross_entropy: backward ran twice through the same graph; its "
                                   "gradients were computed in the forward and consumed by the first backward")
            for g in grads:
                if g is not None:
                    scale_(g.view(-1, g.shape[-1]) if g.dim() > 1 else g, grad_loss)
            dh, dw, db = grads
        else:
            hidden, weight, target, bias, class_weight = ctx.saved_tensors
            _, _, dh, dw, db = _run(hidden, weight, target, bias, class_weight, ctx.opts, False, ctx.chunk_tokens,
                                    ctx.needs, grad_rows=grad_loss.reshape(-1).contiguous())
        return dh, dw, None, db, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------------

def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, *, class_weight: torch.Tensor | None = None,
                               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                               lse_square_scale: float = 0.0, softcap: float | None = None,
                               return_z_loss: bool = False, chunk_tokens: int | None = None):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materialising the logits.

    Args:
        hidden: ``(..., hidden_size)`` float32/float16/bfloat16 (the decoder's final hidden states).
        weight: ``(vocab, hidden_size)`` of hidden's dtype (the LM head's weight; a view or a tied embedding
            weight is fine).
        target: int64/int32 token ids of shape ``hidden.shape[:-1]``; ``ignore_index`` marks tokens without loss.
        bias: optional ``(vocab,)`` LM-head bias.
        class_weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss: as in
            ``cross_entropy`` (``class_weight`` is its ``weight``).
        chunk_tokens: tokens per chunk; default: as many as fit ``CHUNK_BYTES`` (1 GiB) of chunk logits.

    Returns the fp32 loss, or ``(loss, z_loss)`` with ``return_z_loss``. Differentiable in ``hidden``,
    ``weight`` and ``bias``; the weight gradient is accumulated in fp32.
    """
    opts = LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    if chunk_tokens is None and isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor):
        n_tokens = hidden.numel() // hidden.shape[-1] if hidden.dim() and hidden.shape[-1] else 0
        chunk_tokens = chunk_tokens_for(n_tokens, weight.shape[0], hidden.element_size())
    needs = _needs(hidden, weight, bias)
    if torch.compiler.is_compiling():
        loss, z_loss, *_ = _flce_op(hidden, weight, target, bias, class_weight, *opts, return_z_loss, chunk_tokens,
                                    *needs)
    else:
        loss, z_loss = _EagerFusedLinearCrossEntropy.apply(hidden, weight, target, bias, class_weight, opts,
                                                           return_z_loss, chunk_tokens, needs)
    return (loss, z_loss) if return_z_loss else loss
