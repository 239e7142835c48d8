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

Weight gradient. It is summed in fp32 ``(vocab, hidden)`` buffers: the first chunk's GEMM writes them (``mm``
with an fp32 output), later chunks add into them in the GEMM epilogue (``addmm`` with beta=1, fp32 output from
half-precision operands), and they are rounded to the weight's dtype once at the end (accumulating in bf16
across chunks is a known cause of divergence). For fp32 weights the buffer is the gradient itself. For half
precision the rounded gradient's own storage holds the fp32 sums of its first rows (up to half of them, which
is all it has room for) and a second buffer the rest; the end rounds both into that storage in place
(``_WeightGradSum``), so no rounded copy coexists with the sums. With a single chunk there are no sums: its GEMM
sums every token in fp32 inside cuBLAS and rounds once, straight into the gradient. So where all the logits take
no more memory than the fp32 sums would (half precision, ``tokens * b <= 4 * hidden``: 8192 tokens at hidden
size 4096 in bf16), the default is one chunk. Otherwise each later chunk re-reads and re-writes the
sums, so the default chunk is as large as the budget allows: ``CHUNK_BYTES`` of chunk logits (five chunks for
16384 tokens of a 152k vocabulary), but no more than half the fp32 sums, which are live beside the chunk. For a
small hidden size (Qwen3-0.6B: 0.58 GiB of sums) a larger chunk only raises the peak, and the sums' re-read per
chunk is cheap there: in the Qwen3-0.6B training step on the H200 (B=8 S=4096), chunks of half the sums (32)
instead of all of them (16) took the peak from 38.05 to 37.76 GiB for 397.0 against 392.4-395.0 ms per step.

Low memory (``low_memory=True``). Instead of an fp32 ``(vocab, hidden)`` sum, the vocabulary goes in the outer
loop, which needs every token's log-sum-exp first:
  A. the loop above without gradients: every token's loss, z-loss and lse (its chunk buffer is freed before B);
  B. for each slice of ``chunk_vocab`` vocabulary rows: ``logits = hidden @ weight[slice].T (+ bias)`` for all
     tokens, the row kernel's gradient pass over that column slice (given the lse), then
     ``grad_weight[slice] = dlogits.T @ hidden`` (one GEMM over all tokens: fp32 sums inside the GEMM, written
     once in the weight's dtype), ``grad_bias[slice] = dlogits.sum(0)`` and ``grad_hidden += dlogits @
     weight[slice]`` into an fp32 ``(tokens, hidden)`` sum, rounded at the end.
The logits are computed twice: 8 instead of 6 * tokens * vocab * hidden FLOPs, about a third more time.

Memory beyond the inputs, with T tokens, H hidden, V vocabulary, b bytes per element of the input dtype, C
tokens per chunk and S vocabulary rows per slice (the returned gradients included; T + V sized vectors left
out):
  chunks:      4*V*H (fp32 sums, the gradient inside them) + C*V*b (chunk) + T*H*b (grad_hidden); T=16384
               H=4096 V=151936 bf16, five chunks of 3328 tokens by default: 2.32 + 0.94 + 0.12 = 3.39 GiB (the
               floor, C -> 0: 2.44 GiB; each of the T/C chunks re-reads and re-writes the 4*V*H bytes of sums once);
  one chunk:   T*V*b + V*H*b + T*H*b, the default only where T*V*b <= 4*V*H; T=8192, same H and V: 2.32 + 1.16 +
               0.06 = 3.54 GiB, against 2.32 + 0.78 + 0.06 = 3.16 GiB in three chunks, which take 7% longer;
  low memory:  V*H*b + 4*T*H + T*S*b in pass B (the weight gradient, the fp32 hidden-gradient sum, the slice;
               at the end the T*H*b grad_hidden takes the slice's place); pass A's C*V*b comes before it and by
               default is no larger. T=8192: 1.16 + 0.125 + 0.12 = 1.41 GiB (the floor, S -> 0: 1.35 GiB). The
               returned gradients alone are V*H*b + T*H*b = 1.22 GiB.
Nothing grows with ``tokens * vocab`` beyond the 4*V*H bytes of the fp32 sums.

When the gradients are computed. Eager mode, reductions mean/sum over bf16 or fp32 inputs: during the forward
(as the fused CE does), and the backward multiplies them in place by the incoming gradient, skipping that on the
device when it is exactly 1; a second backward through the same graph is refused. Reduction "none", and fp16
inputs (``gradients_in_forward``: an fp16 logits gradient divided by the token count before a GradScaler's scale
underflows): the forward computes only the losses, and the backward runs the whole computation again (with low
memory: passes A and B) with the incoming gradient (each token's, or the one of the reduced loss) folded into the
logits gradient before it is rounded. Under ``torch.compile`` the registered op computes the gradients in the
forward when an input requires grad and ``gradients_in_forward`` allows, and the backward scales them out of place
(or recomputes as above).

Everything else (options, NaN for out-of-range targets, fp32 losses, double backward refused) is as in
``cross_entropy``. A NaN row (out-of-range target) also makes the weight gradient NaN, since every token
contributes to it.
"""

import torch

from . import _checks
from ._autograd import refuses_double_backward
from .cross_entropy import (LossOptions, gradients_in_forward, loss_constants, loss_rows, new_row_stats, reduce_rows,
                            take_forward_grads, validate_options, validate_target_and_weight)
from ._ops import add_op_namespace_prefix

# Default budget for the token-chunked path's (chunk, vocab) logits buffer.
CHUNK_BYTES = 1 << 30
# Default budget for the vocabulary-sliced path's (tokens, slice) logits buffer.
SLICE_BYTES = 1 << 27
# Chunks and slices are rounded up to a multiple of this many rows (tensor-core tile friendly GEMM shapes).
_CHUNK_MULTIPLE = 64


def _equal_parts(n: int, other: int, itemsize: int, budget: int) -> int:
    """The size of the fewest equal parts of ``n`` whose ``(part, other)`` buffer fits in about ``budget``."""
    if n == 0:
        return 1
    n_parts = max(1, -(-n * other * itemsize // budget))
    per_part = -(-n // n_parts)
    return min(n, -(-per_part // _CHUNK_MULTIPLE) * _CHUNK_MULTIPLE)


def chunk_tokens_for(n_tokens: int, vocab: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: the fewest equal chunks whose logits fit in about ``chunk_bytes``."""
    return _equal_parts(n_tokens, vocab, itemsize, chunk_bytes)


def default_chunk_tokens(n_tokens: int, weight: torch.Tensor, low_memory: bool, weight_grad: bool = True) -> int:
    """Tokens per chunk when the caller gives none. One chunk of all tokens where, in half precision, all their
    logits take no more memory than the fp32 weight-gradient sums (``tokens * itemsize <= 4 * hidden``): one
    chunk needs no sums, since its GEMM sums every token in fp32 inside cuBLAS and rounds once, straight into the
    gradient, which saves the sums' re-reads, the rounding pass and two of every chunk's GEMMs (H200, T=8192
    H=4096 V=151936 bf16, forward+backward: 48.6 -> 45.2 ms, peak 3.16 -> 3.54 GiB, the logits then being
    larger than the chunk and half the sums they replace; benchmarks/results/h200/flce_one_chunk_ab.txt). Otherwise
    the fewest equal chunks within ``default_chunk_budget``."""
    vocab, n_hidden = weight.shape[0], weight.shape[-1]  # not unpacked: a bad weight's error comes later, clearer
    itemsize = weight.element_size()
    if not low_memory and weight_grad and itemsize < 4 and n_tokens * itemsize <= 4 * n_hidden:
        return max(n_tokens, 1)
    return chunk_tokens_for(n_tokens, vocab, itemsize, default_chunk_budget(weight, low_memory, weight_grad))


def default_chunk_budget(weight: torch.Tensor, low_memory: bool, weight_grad: bool = True) -> int:
    """Bytes of chunk logits the default chunk may hold: ``CHUNK_BYTES``, capped by the size of what is live beside
    the chunk anyway (never below ``SLICE_BYTES``). The default pass caps it at half the fp32 weight-gradient sums
    (when the weight needs a gradient: without one there are no sums, and no reason for smaller chunks; half,
    because a small head's extra chunks cost little and the peak is sums + chunk: see the module docstring); the
    low-memory loss pass ends before the gradient pass allocates the weight gradient, so there a chunk the size of
    the weight does not raise the peak."""
    if low_memory:
        alongside = weight.numel() * weight.element_size()
    elif weight_grad:
        alongside = weight.numel() * 4 // 2
    else:
        return CHUNK_BYTES
    return min(CHUNK_BYTES, max(SLICE_BYTES, alongside))


def chunk_vocab_for(n_tokens: int, vocab: int, itemsize: int, slice_bytes: int = SLICE_BYTES) -> int:
    """Vocabulary columns per slice (low-memory path): the fewest equal slices whose logits fit in about
    ``slice_bytes``."""
    return _equal_parts(vocab, n_tokens, itemsize, slice_bytes)


def _check_positive(name, value, optional):
    if optional and value is None:
        return
    # A SymInt is what torch.compile traces once the token count is dynamic: the default chunk_tokens and chunk_vocab
    # are computed from it.
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")


def _validate(hidden, weight, target, bias, class_weight, opts, chunk_tokens, chunk_vocab):
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
    _check_positive("chunk_tokens", chunk_tokens, optional=False)
    _check_positive("chunk_vocab", chunk_vocab, optional=True)


def _accumulate(acc, a, b, first):
    """acc (fp32) = or += a @ b, summing in fp32 whatever the operands' dtype."""
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
    elif acc.is_cuda:
        # Half-precision operands, fp32 output: the GEMM reads and writes the fp32 buffer directly.
        if first:
            torch.mm(a, b, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        # CPU has no mixed-precision GEMM: upcast the operands (same products, fp32 sums).
        if first:
            torch.mm(a.float(), b.float(), out=acc)
        else:
            acc.addmm_(a.float(), b.float())


def _round_in_place(src, dst):
    """``dst = src`` rounded to ``dst``'s 2-byte dtype, where the 1-D ``dst`` occupies the first half of the bytes
    of the 1-D fp32 ``src``. Element i is read at byte 4i and written at byte 2i, so the elements [s, 2s) go in
    one copy (their destination, bytes [2s, 4s), holds source elements below s, all read by earlier copies,
    which run before it in stream order); the first elements go through a small temporary."""
    n = src.numel()
    head = min(n, max(1, n // 64))
    first = src[:head].to(dst.dtype)
    start = head
    while start < n:
        end = min(2 * start, n)
        dst[start:end].copy_(src[start:end])
        start = end
    dst[:head].copy_(first)


class _WeightGradSum:
    """The token-chunked path's weight gradient: summed over the chunks in fp32, rounded once at the end.

    With one chunk there is nothing to carry between chunks: its GEMM sums every token in fp32 and rounds once,
    straight into the gradient. For fp32 weights the sum is the gradient. For half precision and several chunks, an
    fp32 ``(vocab, hidden)`` sum and a separately allocated rounded copy would peak at 6 * vocab * hidden bytes.
    Instead the gradient's own storage (2 * vocab * hidden bytes) holds the fp32 sums of the first rows (at most
    half), a separate fp32 buffer the others, and ``result`` rounds both into that storage in place: the peak is the
    4 * vocab * hidden bytes of the fp32 sums, and the returned gradient is an ordinary tensor that owns exactly its
    own storage."""

    def __init__(self, weight, zero, one_chunk):
        vocab, n_hidden = weight.shape
        new = torch.zeros if zero else torch.empty
        self.grad = new((vocab, n_hidden), device=weight.device, dtype=weight.dtype)
        if weight.dtype == torch.float32 or one_chunk:
            self.parts = [(0, self.grad)]
        else:
            # At most half the rows fit; a multiple of 64 keeps the second part's GEMM operands 16-byte aligned.
            split = vocab // 2 // _CHUNK_MULTIPLE * _CHUNK_MULTIPLE
            low = self.grad.view(-1)[: 2 * split * n_hidden].view(torch.float32).view(split, n_hidden)
            high = new((vocab - split, n_hidden), device=weight.device, dtype=torch.float32)
            self.parts = [(0, low), (split, high)]

    def add(self, dlogits, hidden_chunk, first):
        """Adds ``dlogits.T @ hidden_chunk`` (the first call writes instead; with one part, the gradient itself, in the
        operands' dtype, that is one ``mm`` into it)."""
        for row, acc in self.parts:
            if acc.numel():
                _accumulate(acc, dlogits[:, row:row + acc.shape[0]].t(), hidden_chunk, first)

    def result(self):
        if len(self.parts) == 2:
            (_, low), (_, high) = self.parts
            flat = self.grad.view(-1)
            _round_in_place(low.view(-1), flat[: low.numel()])
            # After the rounding above (stream order): this overwrites the upper half of the low rows' fp32 sums.
            flat[low.numel():].view(high.shape).copy_(high)
        grad, self.grad, self.parts = self.grad, None, None
        return grad


def _token_chunks(hidden2d, weight, target1d, bias, class_weight, constants, opts, rows, z_rows, row_stats,
                  chunk_tokens, needs, grad_rows):
    """The token-chunked pass (steps 1-3 of the module docstring): every token's loss, z-loss and lse, and the
    flagged gradients as (grad_hidden, _WeightGradSum, fp32 bias sum), each None when not flagged. The chunk
    buffer is freed when this returns, before the caller rounds the sums."""
    n_tokens, n_hidden = hidden2d.shape
    vocab, device = weight.shape[0], hidden2d.device
    need_hidden, need_weight, need_bias = needs
    any_grad = any(needs)
    grad_hidden = torch.empty((n_tokens, n_hidden), device=device, dtype=hidden2d.dtype) if need_hidden else None
    chunk = min(chunk_tokens, max(n_tokens, 1))
    # The first chunk's GEMM overwrites the whole sum; it needs zeros only when there is no chunk at all.
    weight_sum = _WeightGradSum(weight, zero=n_tokens == 0, one_chunk=chunk >= n_tokens) if need_weight else None
    bias_sum = torch.zeros(vocab, device=device, dtype=torch.float32) if need_bias else None
    buffer = torch.empty(chunk * vocab, device=device, dtype=hidden2d.dtype)
    weight_t = weight.t()
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        hidden_chunk, logits = hidden2d[start:end], buffer[: (end - start) * vocab].view(end - start, vocab)
        if bias is not None:
            torch.addmm(bias, hidden_chunk, weight_t, out=logits)
        else:
            torch.mm(hidden_chunk, weight_t, out=logits)
        loss_rows(logits, target1d[start:end], class_weight, constants, opts, loss=rows[start:end],
                  z_loss=z_rows[start:end] if z_rows is not None else None, row_stats=row_stats[start:end],
                  dlogits=logits if any_grad else None,
                  grad_out=grad_rows if grad_rows is None or grad_rows.numel() == 1 else grad_rows[start:end],
                  loss_pass=True, grad_pass=any_grad)
        if need_hidden:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if need_weight:
            weight_sum.add(logits, hidden_chunk, first=start == 0)
        if need_bias:
            bias_sum += torch.sum(logits, 0, dtype=torch.float32)
    return grad_hidden, weight_sum, bias_sum


def _vocab_slices(hidden2d, weight, target1d, bias, class_weight, constants, opts, row_stats, chunk_vocab,
                  needs, grad_rows):
    """The low-memory gradient pass, given every token's lse: one vocabulary slice at a time, its logits for all
    tokens, their gradient, then ``grad_weight[slice] = dlogits.T @ hidden`` (one GEMM over all tokens: fp32
    sums inside the GEMM, rounded once), ``grad_bias[slice]`` and the fp32 sum ``grad_hidden += dlogits @
    weight[slice]``. Returns (fp32 grad_hidden sum, grad_weight, fp32 grad_bias), each None when not flagged;
    the slice buffer is freed when this returns."""
    n_tokens, n_hidden = hidden2d.shape
    vocab, device = weight.shape[0], hidden2d.device
    need_hidden, need_weight, need_bias = needs
    # With no token the GEMMs reduce over nothing: torch writes zeros.
    hidden_sum = torch.empty((n_tokens, n_hidden), device=device, dtype=torch.float32) if need_hidden else None
    grad_weight = torch.empty((vocab, n_hidden), device=device, dtype=weight.dtype) if need_weight else None
    bias_sum = torch.empty(vocab, device=device, dtype=torch.float32) if need_bias else None
    width = min(chunk_vocab, vocab)
    buffer = torch.empty(n_tokens * width, device=device, dtype=hidden2d.dtype)
    for start in range(0, vocab, width):
        end = min(start + width, vocab)
        weight_slice, logits = weight[start:end], buffer[: n_tokens * (end - start)].view(n_tokens, end - start)
        if bias is not None:
            torch.addmm(bias[start:end], hidden2d, weight_slice.t(), out=logits)
        else:
            torch.mm(hidden2d, weight_slice.t(), out=logits)
        loss_rows(logits, target1d, class_weight, constants, opts, row_stats=row_stats, dlogits=logits,
                  grad_out=grad_rows, loss_pass=False, grad_pass=True, n_classes=vocab, col_start=start)
        if need_hidden:
            _accumulate(hidden_sum, logits, weight_slice, first=start == 0)
        if need_weight:
            torch.mm(logits.t(), hidden2d, out=grad_weight[start:end])
        if need_bias:
            torch.sum(logits, 0, dtype=torch.float32, out=bias_sum[start:end])
    return hidden_sum, grad_weight, bias_sum


def _run(hidden, weight, target, bias, class_weight, opts, return_z_loss, chunk_tokens, chunk_vocab, needs,
         grad_rows=None):
    """Both algorithms. ``chunk_vocab`` None: the token-chunked pass; otherwise a loss pass over token chunks,
    then the vocabulary-sliced gradient pass. Returns (loss, z_loss or None, grad_hidden, grad_weight,
    grad_bias), each gradient None unless requested in ``needs`` (hidden, weight, bias); gradients include
    ``grad_rows`` when given (one incoming gradient per token under reduction "none", or one for them all)."""
    _validate(hidden, weight, target, bias, class_weight, opts, chunk_tokens, chunk_vocab)
    n_hidden, vocab = hidden.shape[-1], weight.shape[0]
    target1d = target.reshape(-1).contiguous()
    # The token count from the target (hidden's leading shape): reshape(-1, 0) cannot infer it when hidden is 0 wide.
    hidden2d = hidden.reshape(target1d.numel(), n_hidden)
    class_weight = class_weight.contiguous() if class_weight is not None else None
    n_tokens = target1d.numel()
    needs = (needs[0], needs[1], needs[2] and bias is not None)
    device = hidden.device

    constants = loss_constants(target1d, class_weight, vocab, opts)
    rows = torch.empty(n_tokens, device=device, dtype=torch.float32)
    z_rows = torch.empty_like(rows) if return_z_loss else None
    row_stats = new_row_stats(n_tokens, device)
    chunk_args = (hidden2d, weight, target1d, bias, class_weight, constants, opts)
    if chunk_vocab is None:
        grad_hidden, weight_sum, bias_sum = _token_chunks(*chunk_args, rows, z_rows, row_stats, chunk_tokens, needs,
                                                          grad_rows)
        grad_weight = weight_sum.result() if weight_sum is not None else None
    else:
        _token_chunks(*chunk_args, rows, z_rows, row_stats, chunk_tokens, (False, False, False), None)
        grad_hidden = grad_weight = bias_sum = None
        if any(needs):
            grad_hidden, grad_weight, bias_sum = _vocab_slices(*chunk_args, row_stats, chunk_vocab, needs, grad_rows)
        if grad_hidden is not None and grad_hidden.dtype != hidden.dtype:
            grad_hidden = grad_hidden.to(hidden.dtype)
    loss = reduce_rows(rows, opts, target.shape)
    z_loss = reduce_rows(z_rows, opts, target.shape) if return_z_loss else None
    grad_bias = bias_sum.to(bias.dtype) if bias_sum is not None else None
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
             chunk_vocab: int | None, grad_hidden: bool, grad_weight: bool, grad_bias: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z_loss, grad_hidden, grad_weight, grad_bias). The flagged gradients are computed here (for an
    incoming gradient of 1) under reductions mean and sum, and by the backward op under "none"; empty tensors
    stand for what is not computed here."""
    opts = LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    in_forward = gradients_in_forward(reduction, hidden.dtype)
    loss, z_loss, dh, dw, db = _run(hidden, weight, target, bias, class_weight, opts, return_z_loss, chunk_tokens,
                                    chunk_vocab,
                                    (grad_hidden and in_forward, grad_weight and in_forward, grad_bias and in_forward))
    return (loss, z_loss if z_loss is not None else _empty(loss), dh if dh is not None else _empty(hidden),
            dw if dw is not None else _empty(weight), db if db is not None else _empty(hidden))


@_flce_op.register_fake
def _(hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, lse_square_scale,
      softcap, return_z_loss, chunk_tokens, chunk_vocab, grad_hidden, grad_weight, grad_bias):
    opts = LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    _validate(hidden, weight, target, bias, class_weight, opts, chunk_tokens, chunk_vocab)
    loss_shape = target.shape if reduction == "none" else ()
    loss = hidden.new_empty(loss_shape, dtype=torch.float32)
    z_loss = hidden.new_empty(loss_shape if return_z_loss else (0,), dtype=torch.float32)
    in_forward = gradients_in_forward(reduction, hidden.dtype)
    dh = hidden.new_empty(hidden.shape) if grad_hidden and in_forward else _empty(hidden)
    dw = weight.new_empty(weight.shape) if grad_weight and in_forward else _empty(weight)
    db = bias.new_empty(bias.shape) if grad_bias and in_forward and bias is not None else _empty(hidden)
    return loss, z_loss, dh, dw, db


@torch.library.custom_op(add_op_namespace_prefix("fused_linear_cross_entropy_backward"), mutates_args=())
def _flce_backward_op(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                      bias: torch.Tensor | None, class_weight: torch.Tensor | None, ignore_index: int,
                      reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None,
                      chunk_tokens: int, chunk_vocab: int | None, grad_hidden: bool, grad_weight: bool,
                      grad_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients recomputed with the incoming gradient folded in: one per token (reduction "none"), or one for
    all (mean or sum over fp16 inputs: ``gradients_in_forward``)."""
    opts = LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    _, _, dh, dw, db = _run(hidden, weight, target, bias, class_weight, opts, False, chunk_tokens, chunk_vocab,
                            (grad_hidden, grad_weight, grad_bias), grad_rows=grad_loss.reshape(-1).contiguous())
    return (dh if dh is not None else _empty(hidden), dw if dw is not None else _empty(weight),
            db if db is not None else _empty(hidden))


@_flce_backward_op.register_fake
def _(grad_loss, hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
      lse_square_scale, softcap, chunk_tokens, chunk_vocab, grad_hidden, grad_weight, grad_bias):
    return (hidden.new_empty(hidden.shape) if grad_hidden else _empty(hidden),
            weight.new_empty(weight.shape) if grad_weight else _empty(weight),
            bias.new_empty(bias.shape) if grad_bias and bias is not None else _empty(hidden))


def _op_setup_context(ctx, inputs, output):
    hidden, weight, target, bias, class_weight, *options = inputs
    ctx.options = options  # ignore_index ... grad_bias, as the ops take them
    ctx.in_forward = gradients_in_forward(options[1], hidden.dtype)
    if ctx.in_forward:
        ctx.save_for_backward(*output[2:])
    else:
        ctx.save_for_backward(hidden, weight, target, bias, class_weight)


def _op_backward(ctx, grad_loss, grad_z_loss, *unused):
    grad_hidden_flag, grad_weight_flag, grad_bias_flag = ctx.options[-3:]
    if not ctx.in_forward:
        hidden, weight, target, bias, class_weight = ctx.saved_tensors
        ignore_index, reduction, label_smoothing, lse_square_scale, softcap, _, *chunks = ctx.options[:8]
        dh, dw, db = _flce_backward_op(grad_loss, hidden, weight, target, bias, class_weight, ignore_index, reduction,
                                       label_smoothing, lse_square_scale, softcap, *chunks, grad_hidden_flag,
                                       grad_weight_flag, grad_bias_flag)
    else:
        # In fp32, rounded once (see scale_).
        dh, dw, db = ((g.float() * grad_loss.float()).to(g.dtype) for g in ctx.saved_tensors)
    return (dh if grad_hidden_flag else None, dw if grad_weight_flag else None, None,
            db if grad_bias_flag else None, None, None, None, None, None, None, None, None, None, None, None, None)


_flce_op.register_autograd(_op_backward, setup_context=_op_setup_context)


class _EagerFusedLinearCrossEntropy(torch.autograd.Function):
    """The eager path (no dispatcher round trips), gradients computed in the forward for mean/sum."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, class_weight, opts, return_z_loss, chunks, needs):
        grad_in_forward = any(needs) and gradients_in_forward(opts.reduction, hidden.dtype)
        loss, z_loss, dh, dw, db = _run(hidden, weight, target, bias, class_weight, opts, return_z_loss, *chunks,
                                        needs if grad_in_forward else (False, False, False))
        ctx.opts, ctx.chunks, ctx.needs, ctx.grad_in_forward = opts, chunks, needs, grad_in_forward
        ctx.forward_grads = (dh, dw, db)
        if any(needs) and not grad_in_forward:
            ctx.save_for_backward(hidden, weight, target, bias, class_weight)
        if z_loss is not None:
            ctx.mark_non_differentiable(z_loss)
        # z_loss never receives a gradient; materialised, it would be a zero fill per backward.
        ctx.set_materialize_grads(False)
        return loss, z_loss

    @staticmethod
    @refuses_double_backward("fused_linear_cross_entropy")
    def backward(ctx, grad_loss, grad_z_loss):
        if grad_loss is None:  # a consumer of the loss returned no gradient for it: zero gradients, as None says
            ctx.forward_grads = None
            return (None,) * 9
        if ctx.grad_in_forward:
            dh, dw, db = take_forward_grads(ctx, "fused_linear_cross_entropy", grad_loss)
        else:
            hidden, weight, target, bias, class_weight = ctx.saved_tensors
            _, _, dh, dw, db = _run(hidden, weight, target, bias, class_weight, ctx.opts, False, *ctx.chunks,
                                    ctx.needs, grad_rows=grad_loss.reshape(-1).contiguous())
        return dh, dw, None, db, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------------

def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, *, class_weight: torch.Tensor | None = None,
                               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                               lse_square_scale: float = 0.0, softcap: float | None = None,
                               return_z_loss: bool = False, chunk_tokens: int | None = None,
                               low_memory: bool = False, chunk_vocab: int | None = None):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materialising the logits.

    Args:
        hidden: ``(..., hidden_size)`` float32/float16/bfloat16 (the decoder's final hidden states).
        weight: ``(vocab, hidden_size)`` of hidden's dtype (the LM head's weight; a view or a tied embedding
            weight is fine).
        target: int64/int32 token ids of shape ``hidden.shape[:-1]``; ``ignore_index`` marks tokens without loss.
        bias: optional ``(vocab,)`` LM-head bias.
        class_weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss: as in
            ``cross_entropy`` (``class_weight`` is its ``weight``).
        chunk_tokens: tokens per chunk of the token-chunked pass; default: all of them where their logits take no
            more memory than the fp32 weight-gradient sums (half precision, ``tokens * itemsize <= 4 *
            hidden_size``; one chunk needs no sums), otherwise as many as fit ``CHUNK_BYTES`` (1 GiB) of chunk
            logits, and no more than half the fp32 sums (with ``low_memory``, the weight) take.
        low_memory: the vocabulary-sliced algorithm (module docstring): a third more GEMM work, and instead of
            the fp32 ``(vocab, hidden_size)`` weight-gradient sum only an fp32 ``(tokens, hidden_size)`` one.
        chunk_vocab: vocabulary columns per slice with ``low_memory``; default: as many as fit ``SLICE_BYTES``
            (128 MiB) of slice logits.

    Returns the fp32 loss, or ``(loss, z_loss)`` with ``return_z_loss``. Differentiable in ``hidden``,
    ``weight`` and ``bias``; the weight gradient is summed in fp32 and rounded once.
    """
    opts = LossOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    if not isinstance(low_memory, bool):
        raise TypeError(f"low_memory must be a bool, got {low_memory!r}")
    if chunk_vocab is not None and not low_memory:
        raise ValueError(f"chunk_vocab only applies with low_memory=True, got chunk_vocab={chunk_vocab!r}")
    needs = _needs(hidden, weight, bias)
    if isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor):
        n_tokens = hidden.numel() // hidden.shape[-1] if hidden.dim() and hidden.shape[-1] else 0
        if chunk_tokens is None:
            chunk_tokens = default_chunk_tokens(n_tokens, weight, low_memory, weight_grad=needs[1])
        if low_memory and chunk_vocab is None:
            chunk_vocab = chunk_vocab_for(n_tokens, weight.shape[0], hidden.element_size())
    if torch.compiler.is_compiling():
        loss, z_loss, *_ = _flce_op(hidden, weight, target, bias, class_weight, *opts, return_z_loss, chunk_tokens,
                                    chunk_vocab, *needs)
    else:
        loss, z_loss = _EagerFusedLinearCrossEntropy.apply(hidden, weight, target, bias, class_weight, opts,
                                                           return_z_loss, (chunk_tokens, chunk_vocab), needs)
    return (loss, z_loss) if return_z_loss else loss
