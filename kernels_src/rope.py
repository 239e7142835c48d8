"""Rotary position embedding (RoPE) of q and k in one launch, forward and inverse (the backward).

Indexing. q and k are read through four strides in the logical order (batch, seq, heads, head_dim), so both
``(batch, heads, seq, head_dim)`` (what transformers passes, usually a transposed view of
``(batch, seq, heads, head_dim)``) and ``(batch, seq, heads, head_dim)`` are read in place; the launcher only
permutes the strides. q and k share batch, seq and head_dim, and may have different head counts (GQA/MQA).
All offsets are int64, so tensors beyond 2**31 elements are fine.

Rotation. Only the first ``rotary_dim`` (R, even) columns of each head rotate, as R/2 pairs (x1, x2) by the
angle of pair i at that position:
    y1 = x1 * cos - x2 * sin,    y2 = x2 * cos + x1 * sin
HALF_SPLIT pairs column i with i + R/2 (transformers' ``rotate_half``); INTERLEAVED pairs 2i with 2i + 1
(GPT-J; each head's R columns are loaded as one contiguous run and split into even and odd members, so
the accesses are as wide as in the half-split case). The inverse rotation (``INVERSE``, the backward: the
rotation is orthogonal, so its transpose is its inverse) negates sin. The columns from R to head_dim pass
through: copied when the output is another tensor (``COPY_TAIL``), left alone in place. Math in fp32, stores
in the output's dtype.

cos/sin have R columns laid out as their convention duplicates each angle: ``cat(freqs, freqs)`` for
HALF_SPLIT (column i is read, i < R/2) and ``repeat_interleave(freqs, 2)`` for INTERLEAVED (column 2i is
read). Each is read through its own strides (they need not match). The row for (batch b, position s) is either
``b * stride_b + s * stride_s`` (tables already gathered per position, batch stride 0 to broadcast), or, with
``HAS_POSITIONS``, ``position_ids[b, s] * stride_s`` into a (max_positions, R) cache; a position outside the cache
reads NaN instead of out-of-bounds memory.

ROTARY_DIM and HEAD_DIM are compile-time constants: a model has one of each, and known column bounds let
the compiler prove whole 16-byte groups in or out of the masks, which keeps the loads and stores vectorised
(with runtime bounds every access was a 2-byte one on sm_90). Batch, sequence length and head counts are
runtime values, so new shapes never recompile.

Tiling. A program takes BLOCK_S positions of one batch entry, loads their cos/sin once, and loops over all
heads of q, then of k, BLOCK_HQ/BLOCK_HK heads at a time, so each angle is fetched from memory once per
position however many heads share it.
"""

import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2

# Compile-time convention switch (globals read inside @triton.jit must be tl.constexpr).
HALF_SPLIT = tl.constexpr(0)
INTERLEAVED = tl.constexpr(1)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, batch, positions, pos_mask, n_heads, cos, sin,
                  x_stride_b, x_stride_s, x_stride_h, x_stride_d, o_stride_b, o_stride_s, o_stride_h, o_stride_d,
                  ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, CONVENTION: tl.constexpr,
                  COPY_TAIL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_PAIRS: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    """Rotate every head of one tensor at the program's positions; cos/sin are (BLOCK_S, BLOCK_PAIRS) fp32."""
    x_rows = batch * x_stride_b + positions * x_stride_s  # int64 (BLOCK_S,)
    o_rows = batch * o_stride_b + positions * o_stride_s
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    # Column indices are int64 like every offset: times a column stride below 2**31 their product can pass it (head_dim
    # an outer dimension of a tensor beyond 2**31 elements), and an int32 product wraps.
    for start in range(0, n_heads, BLOCK_H):
        heads = start + tl.arange(0, BLOCK_H).to(tl.int64)
        row_mask = pos_mask[:, None] & (heads < n_heads)[None, :]
        x_heads = (x_rows[:, None] + heads[None, :] * x_stride_h)[:, :, None]  # (BLOCK_S, BLOCK_H, 1)
        o_heads = (o_rows[:, None] + heads[None, :] * o_stride_h)[:, :, None]
        if CONVENTION == INTERLEAVED:
            # One contiguous load of the R columns, split into the even and odd members of each pair, so the
            # accesses stay as wide as in the half-split case.
            cols = tl.arange(0, 2 * BLOCK_PAIRS).to(tl.int64)
            mask = row_mask[:, :, None] & (cols < ROTARY_DIM)[None, None, :]
            x = tl.load(x_ptr + x_heads + cols * x_stride_d, mask=mask, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_S, BLOCK_H, BLOCK_PAIRS, 2)))
            y = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
            y = tl.reshape(y, (BLOCK_S, BLOCK_H, 2 * BLOCK_PAIRS))
            tl.store(out_ptr + o_heads + cols * o_stride_d, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            first = tl.arange(0, BLOCK_PAIRS).to(tl.int64)
            second = first + ROTARY_DIM // 2
            mask = row_mask[:, :, None] & (first < ROTARY_DIM // 2)[None, None, :]
            x1 = tl.load(x_ptr + x_heads + first * x_stride_d, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + x_heads + second * x_stride_d, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + o_heads + first * o_stride_d, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty),
                     mask=mask)
            tl.store(out_ptr + o_heads + second * o_stride_d, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty),
                     mask=mask)
        if COPY_TAIL:
            tail = ROTARY_DIM + tl.arange(0, BLOCK_TAIL).to(tl.int64)
            tail_mask = row_mask[:, :, None] & (tail < HEAD_DIM)[None, None, :]
            x = tl.load(x_ptr + x_heads + tail * x_stride_d, mask=tail_mask)
            tl.store(out_ptr + o_heads + tail * o_stride_d, x, mask=tail_mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
    seq_len, n_q_heads, n_k_heads, max_positions,
    q_stride_b, q_stride_s, q_stride_h, q_stride_d,
    qo_stride_b, qo_stride_s, qo_stride_h, qo_stride_d,
    k_stride_b, k_stride_s, k_stride_h, k_stride_d,
    ko_stride_b, ko_stride_s, ko_stride_h, ko_stride_d,
    cos_stride_b, cos_stride_s, cos_stride_d, sin_stride_b, sin_stride_s, sin_stride_d, pos_stride_b, pos_stride_s,
    ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, CONVENTION: tl.constexpr, INVERSE: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, COPY_TAIL: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    # A 1-D grid, sequence blocks varying fastest: CUDA caps the other grid axes at 65535, fewer than a batch may hold.
    n_blocks = tl.cdiv(seq_len, BLOCK_S)
    batch = (tl.program_id(0) // n_blocks).to(tl.int64)
    positions = (tl.program_id(0) % n_blocks).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    pos_mask = positions < seq_len

    if HAS_POSITIONS:
        cache_rows = tl.load(pos_ptr + batch * pos_stride_b + positions * pos_stride_s, mask=pos_mask,
                             other=0).to(tl.int64)
        angle_mask = pos_mask & (cache_rows >= 0) & (cache_rows < max_positions)
        cos_rows = cache_rows * cos_stride_s
        sin_rows = cache_rows * sin_stride_s
    else:
        angle_mask = pos_mask
        cos_rows = batch * cos_stride_b + positions * cos_stride_s
        sin_rows = batch * sin_stride_b + positions * sin_stride_s
    pairs = tl.arange(0, BLOCK_PAIRS).to(tl.int64)  # int64, as in _rotate_heads
    if CONVENTION == INTERLEAVED:
        angle_cols = 2 * pairs
    else:
        angle_cols = pairs
    angle_load_mask = angle_mask[:, None] & (pairs < ROTARY_DIM // 2)[None, :]
    # NaN for a position outside the cache: the rows it produces show the error instead of hiding it.
    cos = tl.load(cos_ptr + cos_rows[:, None] + (angle_cols * cos_stride_d)[None, :], mask=angle_load_mask,
                  other=float("nan")).to(tl.float32)
    sin = tl.load(sin_ptr + sin_rows[:, None] + (angle_cols * sin_stride_d)[None, :], mask=angle_load_mask,
                  other=float("nan")).to(tl.float32)
    if INVERSE:
        sin = -sin

    _rotate_heads(q_ptr, q_out_ptr, batch, positions, pos_mask, n_q_heads, cos, sin,
                  q_stride_b, q_stride_s, q_stride_h, q_stride_d, qo_stride_b, qo_stride_s, qo_stride_h,
                  qo_stride_d, ROTARY_DIM, HEAD_DIM, CONVENTION, COPY_TAIL, BLOCK_S, BLOCK_HQ, BLOCK_PAIRS,
                  BLOCK_TAIL)
    _rotate_heads(k_ptr, k_out_ptr, batch, positions, pos_mask, n_k_heads, cos, sin,
                  k_stride_b, k_stride_s, k_stride_h, k_stride_d, ko_stride_b, ko_stride_s, ko_stride_h,
                  ko_stride_d, ROTARY_DIM, HEAD_DIM, CONVENTION, COPY_TAIL, BLOCK_S, BLOCK_HK, BLOCK_PAIRS,
                  BLOCK_TAIL)


def _logical_layout(t, heads_dim):
    """Shape and strides of a q/k-shaped tensor in the logical (batch, seq, heads, head_dim) order."""
    shape, strides = t.shape, t.stride()
    if heads_dim == 1:
        return (shape[0], shape[2], shape[1], shape[3]), (strides[0], strides[2], strides[1], strides[3])
    return tuple(shape), strides


def _batch_broadcast_strides(t):
    """``t``'s strides with the leading (batch) one 0 where that dimension is 1, so that it broadcasts."""
    strides = t.stride()
    return (0, *strides[1:]) if t.shape[0] == 1 else strides


def rope(q, k, q_out, k_out, cos, sin, position_ids, rotary_dim, interleaved, inverse, *, heads_dim, block_s,
         block_h, num_warps):
    """Launch the rotation of q and k into q_out and k_out, which are the same objects as q and k in place.

    q, k, q_out and k_out are ``(batch, heads, seq, head_dim)`` (``heads_dim`` 1) or ``(batch, seq, heads,
    head_dim)`` (``heads_dim`` 2) tensors, any strides (q and k may differ in heads); only their strides are
    permuted, nothing is copied or viewed. Without ``position_ids``, cos and sin are (batch or 1, seq,
    rotary_dim) tables. With ``position_ids``, a (batch or 1, seq) integer tensor, they are (max_positions,
    rotary_dim) caches. ``block_h`` caps the heads per inner step.
    """
    (batch, seq_len, n_q_heads, head_dim), q_strides = _logical_layout(q, heads_dim)
    n_k_heads = k.shape[heads_dim]
    copy_tail = rotary_dim < head_dim and q_out is not q
    has_positions = position_ids is not None
    if has_positions:
        # (unused batch, row, column)
        cos_strides, sin_strides = (0, *cos.stride()), (0, *sin.stride())
        position_strides = _batch_broadcast_strides(position_ids)
    else:
        cos_strides, sin_strides = _batch_broadcast_strides(cos), _batch_broadcast_strides(sin)
        position_strides = (0, 0)
    launch(
        _rope_kernel, (cdiv(seq_len, block_s) * batch,),
        (q, k, q_out, k_out, cos, sin, position_ids if has_positions else cos),
        (seq_len, n_q_heads, n_k_heads, cos.shape[0] if has_positions else 0,
         *q_strides, *_logical_layout(q_out, heads_dim)[1], *_logical_layout(k, heads_dim)[1],
         *_logical_layout(k_out, heads_dim)[1], *cos_strides, *sin_strides, *position_strides),
        dict(ROTARY_DIM=rotary_dim, HEAD_DIM=head_dim, CONVENTION=(INTERLEAVED if interleaved else HALF_SPLIT).value,
             INVERSE=inverse, HAS_POSITIONS=has_positions, COPY_TAIL=copy_tail, BLOCK_S=block_s,
             BLOCK_HQ=min(block_h, next_power_of_2(max(n_q_heads, 1))),
             BLOCK_HK=min(block_h, next_power_of_2(max(n_k_heads, 1))),
             BLOCK_PAIRS=next_power_of_2(rotary_dim // 2),
             BLOCK_TAIL=next_power_of_2(head_dim - rotary_dim) if copy_tail else 1),
        num_warps)
