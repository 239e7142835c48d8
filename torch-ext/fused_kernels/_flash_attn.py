"""Flash attention with FlashAttention-2's Python API: ops, autograd, fake kernels and the public functions.

Drop-in for ``flash_attn`` 2.8: ``flash_attn_func``, ``flash_attn_varlen_func`` and their qkv-/kv-packed
forms take the same arguments, defaults and return values (see each docstring), so transformers can load
this package with ``attn_implementation="myorg/fused-kernels@v2"``. Additions: ``s_aux`` (a per-head
attention-sink logit, with its gradient) and fp16/bf16 on any CUDA GPU Triton supports.

Semantics (FlashAttention-2): layouts ``(batch, seq, heads, head_dim)`` and, varlen, ``(total, heads,
head_dim)`` with contiguous int32 ``cu_seqlens``; GQA/MQA when ``heads % kv_heads == 0``; causal masks aligned
bottom-right when ``seq_q != seq_k``; ``window_size=(left, right)`` with -1 for unlimited; ``softcap > 0``
caps the scaled scores with ``softcap * tanh(s / softcap)``; rows that see no key output 0 and get lse
``+inf``. ``softmax_lse`` is fp32 natural-log: ``(batch, heads, seq_q)`` dense, ``(heads, total_q)`` varlen.

Host synchronisation: none, except that a ``max_seqlen`` given as a 0-d tensor (as transformers does for
packed sequences) is read with ``int()``, because the launch grid depends on it; pass Python ints to avoid it.

Determinism: the backward uses no atomics (dK/dV and dQ are separate passes), so gradients are bitwise
reproducible whatever ``deterministic`` says. Dropout masks come from a counter-based RNG whose seed is
drawn on the device from PyTorch's generator and saved for the backward.

Not supported (``NotImplementedError``): ``alibi_slopes``, ``block_table`` (paged KV). Double backward raises
(``refuses_double_backward``).
"""

import math
import operator

import torch

from . import _checks
from ._autograd import refuses_double_backward
from ._build_info import BACKEND
from ._launch_config import pick
from ._ops import add_op_namespace_prefix

if BACKEND == "cuda":
    from ._kernels import flash_attn as _triton_flash_attn
else:
    _triton_flash_attn = None

_CONFIG_FAMILY = "flash_attn"
_DTYPES = (torch.float16, torch.bfloat16)
# Stands for an unlimited window side: larger than any sequence, small enough that i + shift + bound fits int32.
_UNLIMITED = 1 << 30
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------------------
# Validation.
# ----------------------------------------------------------------------------------------------------------

def _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, softcap, window_left, window_right,
              s_aux):
    varlen = cu_seqlens_q is not None
    ndim = 3 if varlen else 4
    layout = "(total, heads, head_dim)" if varlen else "(batch, seq, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.check_tensor(name, t, dtypes=_DTYPES)
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-dimensional {layout}, got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if varlen:
        # Before the device check, which reads .device: a list of offsets gets this error, not an AttributeError.
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
                raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got "
                                 f"{cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__}"
                                 f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else ''}")
            # The kernels read the offsets as a plain array (FlashAttention-2 refuses strided ones too).
            if not cu.is_contiguous():
                raise ValueError(f"{name} must be contiguous, got stride {cu.stride()}; pass {name}.contiguous()")
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                             f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    _checks.check_same_device("q", q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, s_aux=s_aux)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    head_dim, n_heads, n_kv_heads = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k and v must have q's head_dim {head_dim}, got {k.shape[-1]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if head_dim % 8 != 0:  # reached only by calling the ops directly: the public functions pad such head dims
        raise ValueError(f"the flash-attention ops take head dims that are multiples of 8, got {head_dim}")
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(f"the number of q heads ({n_heads}) must be a multiple of the k/v heads ({n_kv_heads})")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must have q's batch size {q.shape[0]}, got {k.shape[0]}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale}")
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    if window_left < -1 or window_right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unlimited, got ({window_left}, {window_right})")
    if s_aux is not None:
        _checks.check_tensor("s_aux", s_aux, ndim=1)
        if s_aux.shape[0] != n_heads:
            raise ValueError(f"s_aux must have one logit per q head ({n_heads},), got {tuple(s_aux.shape)}")
        # The kernels read the logits as a plain array.
        if not s_aux.is_contiguous():
            raise ValueError(f"s_aux must be contiguous, got stride {s_aux.stride()}; pass s_aux.contiguous()")


def _window(causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """(left, right) bounds for the kernels: -1 becomes unlimited and causal caps the right side at 0. A bound past
    ``_UNLIMITED`` (longer than any sequence: unlimited too) becomes it, whose sums with row positions fit int32; one
    near 2**31 overflowed them and hid every key (zero outputs and gradients)."""
    left = _UNLIMITED if window_left < 0 else min(window_left, _UNLIMITED)
    right = _UNLIMITED if window_right < 0 else min(window_right, _UNLIMITED)
    return left, 0 if causal else right


def _max_seqlen(value, name: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an int or a 0-d integer tensor, got {value.dtype}{tuple(value.shape)}")
        # Then checked as an int is: a negative one launched no programs, leaving the output silently all zeros.
        value = int(value.item())  # the launch grid depends on it (documented host sync)
    try:  # any integer (a NumPy one too), as FlashAttention-2's C++ binding takes it; never a bool or a float
        length = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        length = None
    if length is None or length < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return length


def _lse_shape(q, cu_seqlens_q):
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


# ----------------------------------------------------------------------------------------------------------
# Portable PyTorch implementation (torch-cpu variant; CPU tensors without the Triton interpreter).
# ----------------------------------------------------------------------------------------------------------

def _torch_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k):
    """(q rows, k rows, v rows) per sequence, each (seq, heads, dim)."""
    if cu_seqlens_q is None:
        return [(q[b], k[b], v[b]) for b in range(q.shape[0])]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]) for b in range(len(cq) - 1)]


def _torch_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, scale, window, softcap, s_aux, seed):
    """(out, lse) in float32 math, differentiable in q, k, v and s_aux (the backward recomputes through it)."""
    generator = torch.Generator(device="cpu").manual_seed(int(seed.item())) if dropout_p > 0 else None
    group = q.shape[-2] // k.shape[-2]
    outs, lses = [], []
    for qs, ks, vs in _torch_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k):
        ks, vs = ks.repeat_interleave(group, dim=1).float(), vs.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", qs.float(), ks) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        rows = torch.arange(qs.shape[0], device=q.device)[:, None] + (ks.shape[0] - qs.shape[0])
        cols = torch.arange(ks.shape[0], device=q.device)[None, :]
        visible = (cols >= rows - window[0]) & (cols <= rows + window[1])
        scores = scores.masked_fill(~visible, float("-inf"))
        if s_aux is not None:
            sink = s_aux.float()[:, None, None].expand(-1, qs.shape[0], 1)
            scores = torch.cat([scores, sink], dim=-1)
        # Rows that see nothing (no key, and no sink or a sink of -inf) get zero scores before the softmax: over
        # all -inf, logsumexp's backward is exp(-inf - -inf) = NaN, which the where below hides from the forward but
        # not from the gradients (0 * NaN into the sink's).
        seen = (scores > float("-inf")).any(dim=-1)
        scores = scores.masked_fill(~seen[..., None], 0.0)
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.where(seen[..., None], torch.exp(scores - row_lse[..., None]), 0.0)
        if s_aux is not None:
            probs = probs[..., :-1]
        if generator is not None:
            keep = torch.rand(probs.shape, generator=generator) >= dropout_p
            probs = probs * keep.to(probs.device) / (1.0 - dropout_p)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
        lses.append(torch.where(seen, row_lse, float("inf")))
    if cu_seqlens_q is None:
        if not outs:
            return torch.zeros(q.shape, device=q.device), torch.zeros(_lse_shape(q, None), device=q.device)
        return torch.stack(outs), torch.stack(lses)
    tail = q.shape[0] - int(cu_seqlens_q[-1])
    out = torch.cat(outs + [torch.zeros((tail, *q.shape[1:]), device=q.device)], dim=0)
    # Joined along the rows, so that lse (heads, total_q) is contiguous, as the fake kernel says.
    lse = torch.cat(lses + [torch.full((q.shape[1], tail), float("inf"), device=q.device)], dim=1)
    return out, lse


# ----------------------------------------------------------------------------------------------------------
# Forward and backward implementations.
# ----------------------------------------------------------------------------------------------------------

def _as_4d(t, varlen):
    return t.unsqueeze(0) if varlen else t


def _contiguous_last_dim(t):
    # FlashAttention-2 copies tensors whose head dimension is strided; so do we, to stay a drop-in.
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                  window_left, window_right, softcap, s_aux, *, zero_seed=True):
    _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, softcap, window_left, window_right,
              s_aux)
    q, k, v = (_contiguous_last_dim(t) for t in (q, k, v))
    window = _window(causal, window_left, window_right)
    if dropout_p > 0:
        seed = torch.randint(-(2**62), 2**62, (1,), device=q.device, dtype=torch.int64)
    elif zero_seed:
        seed = torch.zeros(1, device=q.device, dtype=torch.int64)
    else:
        # Without dropout nothing reads the seed. The eager path leaves it unwritten: zeroing it is a kernel launch,
        # ~30 us of host time per forward on the H200's host. The op zeros it: opcheck compares its outputs.
        seed = torch.empty(1, device=q.device, dtype=torch.int64)
    if not _checks.runs_triton(q):
        out, lse = _torch_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, window, softcap, s_aux,
                                    seed)
        return out.to(q.dtype), lse, seed
    varlen = cu_seqlens_q is not None
    if varlen:
        # Rows beyond cu_seqlens_q[-1] belong to no sequence: they get 0 and lse +inf, not garbage.
        out = torch.zeros(q.shape, device=q.device, dtype=q.dtype)
        lse = torch.full(_lse_shape(q, cu_seqlens_q), float("inf"), device=q.device)
    else:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        lse = torch.empty(_lse_shape(q, cu_seqlens_q), device=q.device, dtype=torch.float32)
    if q.numel() == 0:
        return out, lse, seed
    n_batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    seqlen_q = max_seqlen_q if varlen else q.shape[1]
    seqlen_k = max_seqlen_k if varlen else k.shape[1]
    _triton_flash_attn.flash_attn_forward(
        _as_4d(q, varlen), _as_4d(k, varlen), _as_4d(v, varlen), _as_4d(out, varlen), lse, s_aux, seed,
        cu_seqlens_q, cu_seqlens_k, n_batch, seqlen_q, seqlen_k, float(softmax_scale), float(softcap), window,
        float(dropout_p), tile=pick(_CONFIG_FAMILY, "forward", q.device, q.shape[-1]))
    return out, lse, seed


def _backward_impl(dout, q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_left, window_right, softcap, s_aux):
    """(dq, dk, dv, d s_aux or None)."""
    window = _window(causal, window_left, window_right)
    # q, k and v arrive as the caller passed them (saved for the backward before the forward's copies), so a strided
    # head dimension is copied again here.
    dout, q, k, v = (_contiguous_last_dim(t) for t in (dout, q, k, v))
    if not _checks.runs_triton(q):
        return _torch_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, window, softcap, s_aux,
                               seed)
    varlen = cu_seqlens_q is not None
    # Varlen rows beyond cu_seqlens[-1] get zero gradients, not uninitialised memory.
    new = torch.zeros if varlen else torch.empty
    dq, dk, dv = (new(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    dsink_rows = torch.zeros(lse.shape, device=q.device, dtype=torch.float32) if s_aux is not None else None
    if q.numel() > 0 and k.numel() > 0:
        n_batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
        seqlen_q = max_seqlen_q if varlen else q.shape[1]
        seqlen_k = max_seqlen_k if varlen else k.shape[1]
        delta = torch.empty(lse.shape, device=q.device, dtype=torch.float32)
        _triton_flash_attn.flash_attn_backward(
            _as_4d(dout, varlen), _as_4d(q, varlen), _as_4d(k, varlen), _as_4d(v, varlen), _as_4d(out, varlen), lse,
            s_aux, seed, _as_4d(dq, varlen), _as_4d(dk, varlen), _as_4d(dv, varlen), delta, dsink_rows,
            cu_seqlens_q, cu_seqlens_k, n_batch, seqlen_q, seqlen_k, float(softmax_scale), float(softcap), window,
            float(dropout_p), dkdv_tile=pick(_CONFIG_FAMILY, "backward_dkdv", q.device, q.shape[-1]),
            dq_tile=pick(_CONFIG_FAMILY, "backward_dq", q.device, q.shape[-1]))
    elif not varlen:
        dq.zero_(), dk.zero_(), dv.zero_()
    dsink = None
    if s_aux is not None:
        dsink = dsink_rows.sum(dim=-1) if varlen else dsink_rows.sum(dim=(0, 2))
        dsink = dsink.to(s_aux.dtype)
    return dq, dk, dv, dsink


def _torch_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, scale, window, softcap, s_aux, seed):
    # torch.func.vjp, not torch.autograd.grad: called as the backward op (torch.compile's backward graphs call it,
    # as does the op's autograd registration), this runs below the autograd dispatch key, where enable_grad
    # records nothing; vjp tracks gradients itself. Inputs that do not reach the output get zero gradients.
    def attention(q, k, v, *sink):
        return _torch_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, scale, window, softcap,
                                sink[0] if sink else None, seed)[0]

    sink = (s_aux.detach().float(),) if s_aux is not None else ()
    _, pullback = torch.func.vjp(attention, q.detach(), k.detach(), v.detach(), *sink)
    grads = pullback(dout.float())
    dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads[:3], (q, k, v)))
    dsink = grads[3].to(s_aux.dtype) if s_aux is not None else None
    return dq, dk, dv, dsink


# ----------------------------------------------------------------------------------------------------------
# Ops (what torch.compile, export and opcheck see).
# ----------------------------------------------------------------------------------------------------------

@torch.library.custom_op(add_op_namespace_prefix("flash_attn_forward"), mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                s_aux: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, softmax_lse, rng seed)."""
    return _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                         softmax_scale, causal, window_left, window_right, softcap, s_aux)


@_forward_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
      window_left, window_right, softcap, s_aux):
    _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, softcap, window_left, window_right,
              s_aux)
    return (q.new_empty(q.shape), q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32),
            q.new_empty(1, dtype=torch.int64))


@torch.library.custom_op(add_op_namespace_prefix("flash_attn_backward"), mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 softmax_lse: torch.Tensor, seed: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                 cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                 softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                 s_aux: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d s_aux); d s_aux is an empty tensor without a sink."""
    dq, dk, dv, dsink = _backward_impl(dout, q, k, v, out, softmax_lse, seed, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                                       window_right, softcap, s_aux)
    return dq, dk, dv, dsink if dsink is not None else q.new_empty(0)


@_backward_op.register_fake
def _(dout, q, k, v, out, softmax_lse, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
      softmax_scale, causal, window_left, window_right, softcap, s_aux):
    dsink = s_aux.new_empty(s_aux.shape) if s_aux is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


_NON_TENSOR_INPUTS = ("max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_left",
                      "window_right", "softcap")


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options, s_aux = inputs
    out, lse, seed = output
    ctx.save_for_backward(q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, s_aux)
    ctx.options = dict(zip(_NON_TENSOR_INPUTS, options))


def _op_backward(ctx, dout, _dlse, _dseed):
    q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, s_aux = ctx.saved_tensors
    dq, dk, dv, dsink = _backward_op(dout, q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, **ctx.options,
                                     s_aux=s_aux)
    return (dq, dk, dv, None, None) + (None,) * len(_NON_TENSOR_INPUTS) + (dsink if s_aux is not None else None,)


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


class _EagerFlashAttn(torch.autograd.Function):
    """The eager path: the ops' forward and backward without the custom_op dispatcher's host overhead
    (see ``rms_norm._EagerRMSNorm``); under torch.compile the public functions call the ops instead."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, s_aux, options):
        out, lse, seed = _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, **options, s_aux=s_aux, zero_seed=False)
        ctx.save_for_backward(q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, s_aux)
        ctx.options = options
        ctx.mark_non_differentiable(lse, seed)
        # lse and seed never receive gradients; materialised, they would be two zero fills per backward.
        ctx.set_materialize_grads(False)
        return out, lse, seed

    @staticmethod
    @refuses_double_backward("flash_attn")
    def backward(ctx, dout, _dlse, _dseed):
        if dout is None:  # a consumer of out returned no gradient for it: zero gradients, as None tells autograd
            return (None,) * 7
        q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, s_aux = ctx.saved_tensors
        dq, dk, dv, dsink = _backward_impl(dout, q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, **ctx.options,
                                           s_aux=s_aux)
        return dq, dk, dv, None, None, dsink, None


def _number(name, value) -> float:
    """A scalar option as a Python float; otherwise an error that names the option (``float()``'s does not). Plain
    ints and floats, what callers pass, take the first branch, the only one torch.compile then traces."""
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _integer(name, value) -> int:
    """A window bound as a Python int; floats are refused rather than truncated (FlashAttention-2 takes ints)."""
    if isinstance(value, int):
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def _pad_head_dim(q, k, v):
    """(q, k, v, None), or, where their common head dim is not a multiple of 8 (the kernels' granule), the three
    zero-padded to the next one and that head dim, to slice the output back to: FlashAttention-2's wrapper does the
    same (zero columns change no score, and the output's extra columns are dropped; autograd slices the gradients
    back through the pad). The pad is a copy of q, k and v; anything else is left to ``_validate``'s errors."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in tensors):
        return q, k, v, None
    head_dim = q.shape[-1]
    if head_dim % 8 == 0 or head_dim > MAX_HEAD_DIM or any(t.shape[-1] != head_dim for t in tensors):
        return q, k, v, None
    padding = (0, 8 - head_dim % 8)
    return (*(torch.nn.functional.pad(t, padding) for t in tensors), head_dim)


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               window_size, softcap, alibi_slopes, return_attn_probs, s_aux, block_table=None):
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported by fused_kernels' flash attention")
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV cache) is not supported by fused_kernels' flash attention")
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0  # head dim 0: refused by _validate
    else:
        softmax_scale = _number("softmax_scale", softmax_scale)
    q, k, v, head_dim = _pad_head_dim(q, k, v)
    options = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=_number("dropout_p", dropout_p),
                   softmax_scale=softmax_scale, causal=bool(causal),
                   window_left=_integer("window_size[0]", window_size[0]),
                   window_right=_integer("window_size[1]", window_size[1]), softcap=_number("softcap", softcap))
    # Fake tensors take the op too: its fake kernel gives the shapes, where the PyTorch implementation (see
    # runs_triton) would read the varlen offsets on the host, which fake tensors do not have.
    if torch.compiler.is_compiling() or _checks.is_fake_tensor(q):
        out, lse, seed = _forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, **options, s_aux=s_aux)
    else:
        out, lse, seed = _EagerFlashAttn.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, s_aux, options)
    if head_dim is not None:
        out = out[..., :head_dim]
    if not return_attn_probs:
        return out
    return out, lse, _dropout_mask(q, k, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p)


def _dropout_mask(q, k, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p):
    """The dropout keep mask ``(batch, heads, seq_q, seq_k)`` (bool) the call used, or None without dropout.

    FlashAttention-2 returns ``S_dmask`` here "for testing only"; this is the mask such tests reconstruct."""
    if dropout_p <= 0 or not _checks.runs_triton(q):
        return None
    varlen = cu_seqlens_q is not None
    n_batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    total_q, total_k = (q.shape[0], k.shape[0]) if varlen else (q.shape[1], k.shape[1])
    return _dropout_mask_op(seed, cu_seqlens_q, cu_seqlens_k, n_batch, q.shape[-2], max_seqlen_q, max_seqlen_k,
                            total_q, total_k, float(dropout_p))


# An op, so that torch.compile traces the mask's Triton launch as one call (a raw launch breaks the graph).
@torch.library.custom_op(add_op_namespace_prefix("flash_attn_dropout_mask"), mutates_args=())
def _dropout_mask_op(seed: torch.Tensor, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                     n_batch: int, n_heads: int, max_seqlen_q: int, max_seqlen_k: int, total_q: int, total_k: int,
                     dropout_p: float) -> torch.Tensor:
    mask = seed.new_empty((n_batch, n_heads, max_seqlen_q, max_seqlen_k), dtype=torch.bool)
    _triton_flash_attn.dropout_keep_mask(mask, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q,
                                         total_k, dropout_p)
    return mask


@_dropout_mask_op.register_fake
def _(seed, cu_seqlens_q, cu_seqlens_k, n_batch, n_heads, max_seqlen_q, max_seqlen_k, total_q, total_k, dropout_p):
    return seed.new_empty((n_batch, n_heads, max_seqlen_q, max_seqlen_k), dtype=torch.bool)


# ----------------------------------------------------------------------------------------------------------
# Public API (FlashAttention-2 signatures).
# ----------------------------------------------------------------------------------------------------------

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, s_aux=None):
    """Attention over ``q (batch, seq_q, heads, head_dim)``, ``k, v (batch, seq_k, kv_heads, head_dim)``.

    Returns ``out (batch, seq_q, heads, head_dim)``, or ``(out, softmax_lse (batch, heads, seq_q) fp32,
    dropout keep mask or None)`` with ``return_attn_probs``. ``deterministic`` is accepted for compatibility:
    the backward is always deterministic. ``s_aux``: optional contiguous ``(heads,)`` attention-sink logits, finite
    or -inf (a head without a sink). Head dims 1 to 256; those not a multiple of 8 are zero-padded to one (a copy),
    as FlashAttention-2 does.
    """
    del deterministic
    return _attention(q, k, v, None, None, q.shape[1] if q.dim() == 4 else 0, k.shape[1] if k.dim() == 4 else 0,
                      dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, s_aux)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, s_aux=None):
    """Attention over packed sequences: ``q (total_q, heads, head_dim)``, ``k, v (total_k, kv_heads, head_dim)``,
    sequence b being rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` (contiguous int32 offsets). ``max_seqlen_*``: ints, or
    0-d tensors (read on the host). Returns ``out``, or ``(out, softmax_lse (heads, total_q), mask or None)``.

    As in FlashAttention-2, the offsets' values are not checked (that would need a host synchronisation): they must
    start at 0, never decrease and end at most at total_q / total_k, and no sequence may be longer than its
    ``max_seqlen`` (rows past it may be left at 0). Other offsets give wrong rows, but the kernels clamp each
    sequence to the packed rows, so they never read or write outside the tensors."""
    del deterministic
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k are required by flash_attn_varlen_func")
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, _max_seqlen(max_seqlen_q, "max_seqlen_q"),
                      _max_seqlen(max_seqlen_k, "max_seqlen_k"), dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, return_attn_probs, s_aux, block_table)


def _unpack(packed, index, name, count):
    if packed.dim() < 3 or packed.shape[-3] != count:
        raise ValueError(f"{name} must have {count} at dimension -3 (..., {count}, heads, head_dim), got shape "
                         f"{tuple(packed.shape)}")
    return packed.select(-3, index)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` on ``qkv (batch, seq, 3, heads, head_dim)``; the gradient flows back into qkv."""
    q, k, v = (_unpack(qkv, i, "qkv", 3) for i in range(3))
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` with ``kv (batch, seq_k, 2, kv_heads, head_dim)``."""
    k, v = (_unpack(kv, i, "kv", 2) for i in range(2))
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn_varlen_func`` on ``qkv (total, 3, heads, head_dim)``."""
    q, k, v = (_unpack(qkv, i, "qkv", 3) for i in range(3))
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_varlen_func`` with ``kv (total_k, 2, kv_heads, head_dim)``."""
    k, v = (_unpack(kv, i, "kv", 2) for i in range(2))
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
