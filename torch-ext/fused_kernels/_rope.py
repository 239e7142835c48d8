"""Rotary position embedding (RoPE) of q and k: torch ops, autograd, fake kernels and the functional API.

Two entry points, one op underneath:

- ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``: transformers' function, with cos/sin already
  gathered per position, ``(batch or 1, seq, rotary_dim)``.
- ``apply_rotary_pos_emb_cached(q, k, cos_cache, sin_cache, position_ids)``: cos/sin looked up in a
  ``(max_positions, rotary_dim)`` cache by ``position_ids`` inside the kernel, so packed (varlen) sequences,
  whose positions restart at each sequence, need nothing gathered beforehand.

Layouts: q and k are ``(batch, heads, seq, head_dim)`` (heads at dim 1, transformers' layout, usually a
transposed view) or ``(batch, seq, heads, head_dim)`` (heads at dim 2), with any strides; nothing is copied
to make them contiguous. q and k may have different head counts (GQA/MQA). Outputs keep the layout of the
inputs (``torch.empty_like``).

Conventions: ``interleaved=False`` rotates column i with column i + R/2 (transformers' ``rotate_half``,
Llama, Qwen, Mistral) and reads cos/sin columns ``[:R/2]`` (transformers builds them as ``cat(freqs,
freqs)``); ``interleaved=True`` rotates columns 2i and 2i + 1 (GPT-J) and reads cos/sin columns ``[0::2]``
(built as ``freqs.repeat_interleave(2, -1)``). R = ``rotary_dim`` is the last dimension of cos/sin, even and at
most head_dim; the columns from R on pass through unchanged (partial rotary).

Math in fp32, outputs in the input dtype. The backward is the inverse rotation of the incoming gradients;
cos/sin get no gradient. Out of place by default: inputs are never written. With ``inplace=True`` q and k
are rotated in place and returned (their partial-rotary tail is untouched); autograd sees the mutation. Where
autograd records (q or k requires grad) and q or k is a view, or under torch.compile, the rotation runs out of place
and is copied into q and k (their tail rewritten with its own values), as autograd cannot take two inputs modified in
place by one Function when either is a view; a leaf that requires grad, or a view of one, is refused first. In place,
no element may share memory with another (``_checks.check_writable_pair``): it would be rotated twice.

CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run the Triton kernel; otherwise a plain
PyTorch implementation with the same numerics runs, which is what the ``torch-cpu`` variant uses.

(The module is private, unlike ``rms_norm.py``, because no public function shares its name to shadow it in
the package namespace; its public functions are exported by ``__init__.py``.)
"""

import functools

import torch

from . import _checks
from ._build_info import BACKEND
from ._launch_config import pick
from ._ops import add_op_namespace_prefix

if BACKEND == "cuda":
    from ._kernels import rope as _triton_rope
else:
    _triton_rope = None

_CONFIG_FAMILY = "rope"
POSITION_DTYPES = (torch.int32, torch.int64)


def _logical(t: torch.Tensor, heads_dim: int) -> torch.Tensor:
    """The (batch, seq, heads, head_dim) view of a q/k-shaped tensor."""
    return t if heads_dim == 2 else t.transpose(1, 2)


def _logical_shape(t: torch.Tensor, heads_dim: int) -> tuple[int, ...]:
    """The shape of ``_logical(t, heads_dim)``, without building the view (~1 us of host time each)."""
    batch, dim1, dim2, head_dim = t.shape
    return (batch, dim1, dim2, head_dim) if heads_dim == 2 else (batch, dim2, dim1, head_dim)


# Signatures of inputs that passed the checks (which read nothing else: shapes, dtypes, devices, heads_dim). The checks
# cost ~4 us of host time per call (~15 us on the H200's hosts), a tenth of a whole small RoPE call.
_valid_signatures: set = set()
_VALID_SIGNATURES_LIMIT = 4096


def _validate(q, k, cos, sin, position_ids, heads_dim):
    _checks.check_choice("heads_dim", heads_dim, (1, 2))  # first: it must be hashable to key the signature
    try:
        signature = (heads_dim, *[(t.shape, t.dtype, t.device) for t in (q, k, cos, sin)],
                     None if position_ids is None else (position_ids.shape, position_ids.dtype, position_ids.device))
        if signature in _valid_signatures:
            return
    except (AttributeError, TypeError):  # not tensors (the checks say which), or symbolic shapes (unhashable)
        signature = None
    _check_inputs(q, k, cos, sin, position_ids, heads_dim)
    if signature is not None:
        if len(_valid_signatures) >= _VALID_SIGNATURES_LIMIT:
            _valid_signatures.clear()
        _valid_signatures.add(signature)


def _check_inputs(q, k, cos, sin, position_ids, heads_dim):
    _checks.check_tensor("q", q, ndim=4)
    _checks.check_tensor("k", k, ndim=4)
    if k.dtype != q.dtype:
        raise TypeError(f"k must have the dtype of q ({q.dtype}), got {k.dtype}")
    q_shape, k_shape = _logical_shape(q, heads_dim), _logical_shape(k, heads_dim)
    batch, seq, _, head_dim = q_shape
    for what, index in (("batch size", 0), ("sequence length", 1), ("head_dim", 3)):
        if k_shape[index] != q_shape[index]:
            raise ValueError(f"k must have the {what} of q ({q_shape[index]}), got {k_shape[index]} "
                             f"(q {tuple(q.shape)}, k {tuple(k.shape)}, heads at dim {heads_dim})")
    cached = position_ids is not None
    cos_name, sin_name = ("cos_cache", "sin_cache") if cached else ("cos", "sin")
    _checks.check_tensor(cos_name, cos, ndim=2 if cached else 3)
    _checks.check_tensor(sin_name, sin)
    _checks.check_same_shape(cos_name, cos, **{sin_name: sin})
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"{cos_name}'s last dimension is rotary_dim and must be even, positive and at most "
                         f"head_dim ({head_dim}); got {rotary_dim}")
    if cached:
        _checks.check_tensor("position_ids", position_ids, dtypes=POSITION_DTYPES, ndim=2)
        if position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq:
            shapes = f"({batch}, {seq})" + (f" or (1, {seq})" if batch != 1 else "")
            raise ValueError(f"position_ids must have shape {shapes} to match q, got {tuple(position_ids.shape)}")
    elif cos.shape[0] not in (1, batch) or cos.shape[1] != seq:
        batches = f"{batch} or 1" if batch != 1 else "1"
        raise ValueError(f"cos must have shape ({batches}, {seq}, rotary_dim) to match q, got {tuple(cos.shape)}")
    _checks.check_same_device("q", q, k=k, **{cos_name: cos, sin_name: sin}, position_ids=position_ids)


# ----------------------------------------------------------------------------------------------------------
# Portable PyTorch implementation (torch-cpu variant; CPU tensors without the Triton interpreter).
# ----------------------------------------------------------------------------------------------------------

def _pair_columns(rotary_dim, interleaved, device):
    """Columns of the first and second element of each rotated pair; cos/sin are read at the first."""
    pairs = torch.arange(rotary_dim // 2, device=device)
    return (2 * pairs, 2 * pairs + 1) if interleaved else (pairs, pairs + rotary_dim // 2)


def _torch_angles(table, position_ids, batch, seq, columns):
    """(batch, seq, 1, R/2) fp32 entries of a cos/sin table; NaN for a position outside the cache, as the
    kernel gives."""
    table = table[..., columns].float()
    if position_ids is None:
        return table.expand(batch, seq, -1)[:, :, None, :]
    if table.shape[0] == 0:  # an empty cache: every position is outside it
        return table.new_full((batch, seq, 1, table.shape[-1]), float("nan"))
    positions = position_ids.long().expand(batch, seq)
    inside = (positions >= 0) & (positions < table.shape[0])
    rows = table[positions.clamp(0, table.shape[0] - 1)]
    return torch.where(inside[..., None], rows, float("nan"))[:, :, None, :]


def _torch_rope(q, k, q_out, k_out, cos, sin, position_ids, rotary_dim, interleaved, inverse):
    batch, seq = q.shape[:2]
    first, second = _pair_columns(rotary_dim, interleaved, q.device)
    c = _torch_angles(cos, position_ids, batch, seq, first)
    s = _torch_angles(sin, position_ids, batch, seq, first)
    if inverse:
        s = -s
    for x, out in ((q, q_out), (k, k_out)):
        x1, x2 = x[..., first].float(), x[..., second].float()
        if out is not x:
            out[..., rotary_dim:] = x[..., rotary_dim:]
        out[..., first] = (x1 * c - x2 * s).to(out.dtype)
        out[..., second] = (x2 * c + x1 * s).to(out.dtype)


# ----------------------------------------------------------------------------------------------------------
# Dispatch.
# ----------------------------------------------------------------------------------------------------------

def _rotate_into(q, k, q_out, k_out, cos, sin, position_ids, heads_dim, interleaved, inverse):
    """Rotate q and k into q_out and k_out (the same tensors for in place, which is how both implementations know
    to leave the tail); inputs already validated."""
    batch, seq = _logical_shape(q, heads_dim)[:2]
    if batch * seq == 0:
        return
    rotary_dim = cos.shape[-1]
    if _checks.runs_triton(q):
        # The launcher permutes the strides itself: views and broadcasts cost host time on every call.
        config = pick(_CONFIG_FAMILY, "rope", q.device, q.shape[-1])
        _triton_rope.rope(q, k, q_out, k_out, cos, sin, position_ids, rotary_dim, interleaved, inverse,
                          heads_dim=heads_dim, block_s=config["block_s"], block_h=config["block_h"],
                          num_warps=config["num_warps"])
        return
    qv, kv = _logical(q, heads_dim), _logical(k, heads_dim)
    q_out_v, k_out_v = (qv, kv) if q_out is q else (_logical(q_out, heads_dim), _logical(k_out, heads_dim))
    _torch_rope(qv, kv, q_out_v, k_out_v, cos, sin, position_ids, rotary_dim, interleaved, inverse)


def _dense_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """``t``'s strides when its elements fill a block of memory without gaps or overlap (any dimension order, as a
    transposed view has), else None."""
    return _dense_strides_of(t.shape, t.stride())


@functools.lru_cache(maxsize=1024)
def _dense_strides_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """Cached: a model rotates a handful of layouts, and the sort costs ~1 us per call."""
    expected = 1
    for size, stride in sorted(zip(shape, strides), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return None
        expected *= size
    return strides


def _empty_with_strides(like: torch.Tensor, strides: tuple[int, ...] | None) -> torch.Tensor:
    """An uninitialised tensor of ``like``'s shape, dtype and device with these strides (None: ``like``'s)."""
    if strides is None:
        return torch.empty_like(like)
    return like.new_empty_strided(like.shape, strides)


def _forward(q, k, cos, sin, position_ids, heads_dim, interleaved, inverse):
    _validate(q, k, cos, sin, position_ids, heads_dim)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _rotate_into(q, k, q_out, k_out, cos, sin, position_ids, heads_dim, interleaved, inverse)
    return q_out, k_out


def _forward_inplace(q, k, cos, sin, position_ids, heads_dim, interleaved):
    _validate(q, k, cos, sin, position_ids, heads_dim)
    # Not in _validate, whose result is cached by shape: the strides decide this. A shared element would be
    # rotated twice (expanded q, or k the same tensor as q), silently.
    _checks.check_writable_pair("q", q, "k", k)
    if not torch.is_inference_mode_enabled():  # refused by autograd only after both were written
        for name, t in (("q", q), ("k", k)):
            if t.is_inference():
                raise RuntimeError(f"{name} is an inference tensor (made under torch.inference_mode()) and cannot be "
                                   f"rotated in place outside inference mode; rotate out of place, or under "
                                   f"torch.inference_mode()")
    _rotate_into(q, k, q, k, cos, sin, position_ids, heads_dim, interleaved, False)


# ----------------------------------------------------------------------------------------------------------
# Ops (what torch.compile, export and opcheck see).
# ----------------------------------------------------------------------------------------------------------

@torch.library.custom_op(add_op_namespace_prefix("rope"), mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             position_ids: torch.Tensor | None, heads_dim: int, interleaved: bool,
             inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by the angles of cos/sin (``inverse``: rotated back), as new tensors."""
    return _forward(q, k, cos, sin, position_ids, heads_dim, interleaved, inverse)


@_rope_op.register_fake
def _(q, k, cos, sin, position_ids, heads_dim, interleaved, inverse):
    _validate(q, k, cos, sin, position_ids, heads_dim)
    return torch.empty_like(q), torch.empty_like(k)


def _rope_setup_context(ctx, inputs, output):
    _, _, cos, sin, position_ids, heads_dim, interleaved, inverse = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.heads_dim, ctx.interleaved, ctx.inverse = heads_dim, interleaved, inverse


def _rope_backward(ctx, dq, dk):
    # The rotation is orthogonal: its gradient is the opposite rotation, itself a differentiable call of the op.
    cos, sin, position_ids = ctx.saved_tensors
    dq, dk = _rope_op(dq, dk, cos, sin, position_ids, ctx.heads_dim, ctx.interleaved, not ctx.inverse)
    return dq, dk, None, None, None, None, None, None


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup_context)


@torch.library.custom_op(add_op_namespace_prefix("rope_inplace"), mutates_args={"q", "k"})
def _rope_inplace_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     position_ids: torch.Tensor | None, heads_dim: int, interleaved: bool) -> None:
    """Rotate q and k in place. A mutating op cannot carry an autograd formula (see ``_apply``)."""
    _forward_inplace(q, k, cos, sin, position_ids, heads_dim, interleaved)


@_rope_inplace_op.register_fake
def _(q, k, cos, sin, position_ids, heads_dim, interleaved):
    _validate(q, k, cos, sin, position_ids, heads_dim)


class _EagerRope(torch.autograd.Function):
    """The eager path: the same forward and backward as the ops, without the dispatcher round trips.

    Calling a ``custom_op`` from eager Python costs tens of microseconds per call (see ``rms_norm.py``), so
    outside ``torch.compile`` the public functions run this Function. In place, ``mark_dirty`` tells autograd
    that q and k were modified.
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, heads_dim, interleaved, inverse, inplace):
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.heads_dim, ctx.interleaved, ctx.inverse = heads_dim, interleaved, inverse
        if inplace:
            _forward_inplace(q, k, cos, sin, position_ids, heads_dim, interleaved)
            ctx.mark_dirty(q, k)
            outputs = q, k
        else:
            outputs = _forward(q, k, cos, sin, position_ids, heads_dim, interleaved, inverse)
        ctx.grad_strides = _dense_strides(q), _dense_strides(k)  # q and k are validated tensors by now
        return outputs

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, position_ids = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph: through apply again, so that the gradient is itself differentiable (double backward).
            dq, dk = _EagerRope.apply(dq, dk, cos, sin, position_ids, ctx.heads_dim, ctx.interleaved,
                                      not ctx.inverse, False)
        else:
            # The gradients have the shapes and dtype of the validated outputs: rotate them back directly, into
            # the memory layout of q and k themselves. Autograd would otherwise copy a gradient laid out like
            # the incoming one into the layout of a leaf q (231 us for q 4x32x4096x128 and k with 8 heads on the
            # H200, more than both rotations), or a view's backward (transpose, then view) would copy it.
            dq_out = _empty_with_strides(dq, ctx.grad_strides[0])
            dk_out = _empty_with_strides(dk, ctx.grad_strides[1])
            _rotate_into(dq, dk, dq_out, dk_out, cos, sin, position_ids, ctx.heads_dim, ctx.interleaved,
                         not ctx.inverse)
            dq, dk = dq_out, dk_out
        return dq, dk, None, None, None, None, None, None, None


def _without_grad(t):
    """cos/sin get no gradient, so autograd must not see them: one that requires grad would make the outputs require
    grad, and in place autograd then refuses q and k that are views (after the kernel wrote them), while the path of
    ``_apply`` for q or k that require grad fails in torch's copy_ for two views of one buffer that does not (after the
    first copy). Non-tensors go on to the checks, which name them."""
    return t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t


def _apply(q, k, cos, sin, position_ids, heads_dim, interleaved, inplace):
    cos, sin = _without_grad(cos), _without_grad(sin)
    compiling = torch.compiler.is_compiling()
    if inplace and torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k)):
        if not compiling:  # refuse before anything is written (compiled, the trace refuses it)
            _check_inplace_with_autograd(q, k, cos, sin, position_ids, heads_dim)
        # A Function that modifies two inputs in place is refused by autograd, after its forward ran, when either is a
        # view (the transposed view transformers passes, the packed form's q[None]), and the compiled path needs the
        # functional op: there, rotate out of place and write the result back into q and k (one pass more).
        if compiling or q._base is not None or k._base is not None:
            q_out, k_out = _apply(q, k, cos, sin, position_ids, heads_dim, interleaved, False)
            return q.copy_(q_out), k.copy_(k_out)
    if not compiling:
        return _EagerRope.apply(q, k, cos, sin, position_ids, heads_dim, interleaved, False, inplace)
    if not inplace:
        return _rope_op(q, k, cos, sin, position_ids, heads_dim, interleaved, False)
    _rope_inplace_op(q, k, cos, sin, position_ids, heads_dim, interleaved)
    return q, k


def _check_inplace_with_autograd(q, k, cos, sin, position_ids, heads_dim):
    """What ``_forward_inplace`` checks, and that neither q nor k is (a view of) a leaf that requires grad, which
    ``copy_`` refuses only for its own tensor: with k such a leaf, q would already have been written."""
    _validate(q, k, cos, sin, position_ids, heads_dim)
    _checks.check_writable_pair("q", q, "k", k)
    for name, t in (("q", q), ("k", k)):
        if _checks.overwrites_grad_leaf(t):
            raise RuntimeError(f"{name} is a leaf Variable that requires grad, or a view of one, and cannot be rotated "
                               f"in place while autograd records; rotate out of place, or under torch.no_grad()")


# ----------------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------------

def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1, *, interleaved: bool = False,
                         inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb``, fused: returns ``(q_embed, k_embed)``.

    Args:
        q: ``(batch, q_heads, seq, head_dim)`` with ``unsqueeze_dim=1`` or ``(batch, seq, q_heads, head_dim)``
            with ``unsqueeze_dim=2``; float32/float16/bfloat16, any strides.
        k: the same layout, dtype, batch, seq and head_dim as q; any number of heads.
        cos, sin: ``(batch or 1, seq, rotary_dim)``, as transformers' rotary embedding modules return them
            (float32, float16 or bfloat16, whatever q's is; read in fp32). ``rotary_dim`` (even, at most head_dim)
            columns of each head rotate; the rest pass through.
        unsqueeze_dim: where transformers would insert the heads dimension into cos/sin: 1 or 2 (above).
        interleaved: rotate pairs (2i, 2i + 1) (GPT-J) instead of (i, i + rotary_dim/2) (``rotate_half``).
        inplace: rotate q and k in place and return them (the tail beyond rotary_dim is left as it is); q and k
            whose elements share memory (expanded ones, or k the same memory as q) are refused, and so, while
            autograd records, is a leaf that requires grad or a view of one.

    Differentiable in q and k (cos and sin get no gradient).
    """
    _checks.check_choice("unsqueeze_dim", unsqueeze_dim, (1, 2))
    return _apply(q, k, cos, sin, None, unsqueeze_dim, interleaved, inplace)


def apply_rotary_pos_emb_cached(q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                                sin_cache: torch.Tensor, position_ids: torch.Tensor, *, heads_dim: int = 1,
                                interleaved: bool = False, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE with the angles looked up by position inside the kernel: returns ``(q_embed, k_embed)``.

    Args:
        q, k: ``(batch, heads, seq, head_dim)`` (``heads_dim=1``), ``(batch, seq, heads, head_dim)``
            (``heads_dim=2``), or packed ``(tokens, heads, head_dim)`` (``heads_dim=1``); as in
            ``apply_rotary_pos_emb``, k may have a different number of heads.
        cos_cache, sin_cache: ``(max_positions, rotary_dim)`` tables, row p for position p, in the column
            layout of the convention (see the module docstring).
        position_ids: int32/int64 positions, ``(batch, seq)`` or ``(1, seq)`` for 4-D q, ``(tokens,)`` for
            packed q; packed sequences simply restart their positions. A position outside
            ``[0, max_positions)`` yields NaN in its rows (it is not checked on the host, which would need a
            device sync).
        heads_dim, interleaved, inplace: see above and ``apply_rotary_pos_emb``.

    Differentiable in q and k.
    """
    _checks.check_tensor("q", q)
    _checks.check_tensor("position_ids", position_ids, dtypes=POSITION_DTYPES)
    if q.dim() == 3:
        _checks.check_tensor("k", k, ndim=3)
        _checks.check_tensor("position_ids", position_ids, dtypes=POSITION_DTYPES, ndim=1)
        if heads_dim != 1:
            raise ValueError(f"heads_dim must be 1 for packed (tokens, heads, head_dim) q and k, got {heads_dim!r}")
        # Here, not in the checks of the views below, whose errors would show shapes the caller never passed.
        for name, t in (("k", k), ("position_ids", position_ids)):
            if t.shape[0] != q.shape[0]:
                raise ValueError(f"{name} must have q's number of tokens ({q.shape[0]}) as its first dimension, got "
                                 f"shape {tuple(t.shape)}")
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"k must have the head_dim of q ({q.shape[2]}), got {k.shape[2]} (q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)})")
        if inplace:
            _checks.check_writable_pair("q", q, "k", k)
        # A batch of one sequence of all tokens: (1, tokens, heads, head_dim) views, positions (1, tokens).
        q_out, k_out = _apply(q[None], k[None], cos_cache, sin_cache, position_ids[None], 2, interleaved, inplace)
        return (q, k) if inplace else (q_out[0], k_out[0])
    if q.dim() != 4:
        raise ValueError(f"q must be 4-dimensional, or 3-dimensional (tokens, heads, head_dim) when packed; "
                         f"got shape {tuple(q.shape)}")
    return _apply(q, k, cos_cache, sin_cache, position_ids, heads_dim, interleaved, inplace)
