"""Flash attention, forward and backward (FlashAttention-2 semantics), for dense and variable-length batches.

Layouts. q is ``(batch, seq_q, heads, head_dim)`` (dense) or ``(total_q, heads, head_dim)`` (varlen, sequence b
being rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``); k and v likewise with ``kv_heads`` heads. Every tensor is
addressed through its own batch/sequence/head strides (the batch stride is 0 for varlen), so the transposed
views transformers passes are read in place; only the head dimension must be contiguous. Offsets are int64.

Masking. Query row i of a sequence sees key j iff ``i + d - left <= j <= i + d + right`` with
``d = seq_k - seq_q`` (FlashAttention-2's bottom-right alignment); the launcher turns ``causal`` into
``right = 0`` and an unlimited side into a large bound. A row that sees no key outputs 0 and gets
``lse = +inf`` (so the backward's ``exp(s - lse)`` is 0 there, never NaN). Only tiles that straddle a
boundary (the causal diagonal, a window edge, a sequence end) evaluate the mask: ``_partner_tiles`` splits every
tile loop into masked edges and an unmasked middle, run as three loops or one (``_fwd_kernel``).

Scores. ``s = scale * q.k``, then ``softcap * tanh(s / softcap)`` when soft-capping. Softmax runs in base 2
(``exp2``; scores are multiplied by log2(e) once) with the online rescaling of FlashAttention-2. An attention
sink (``s_aux[head]``, gpt-oss) is an extra logit in every row's softmax with a zero value vector: it starts
the running max and sum. The returned lse is natural-log and includes the sink.

Dropout. ``keep(i, j)`` comes from Philox keyed by the seed and counted by (key index, query index,
batch * heads + head, 0): a function of the element's position only, so the forward and both backward
kernels regenerate the same mask whatever order they visit tiles in. Kept probabilities are scaled by
``1 / (1 - p)``.

Backward (deterministic by construction, no atomics). ``_bwd_dkdv_kernel`` owns one key tile of one kv head and
loops over the query tiles of every query head of its group, so the GQA reduction of dK/dV happens in registers.
It recomputes P from q, k and the lse:
  dV = P_drop^T dO,   dP = dO V^T (dropped and rescaled like P),   dS = P * (dP - delta),
  dS *= 1 - tanh^2 (soft-capping),   dQ = scale * dS K,   dK = scale * dS^T Q,
with ``delta_i = sum(dO_i * O_i)``. dQ needs a sum over key tiles, which that pass's programs cannot share without
atomics, so it comes one of two ways (``flash_attn_backward``): through dS, where the dK/dV pass also stores each
dS tile (2 bytes per score, into a scratch of a bounded number of (batch, head) pairs at a time) and
``_bwd_dq_from_ds_kernel`` computes dQ = dS K from it (5 matmuls per pair of tiles), after ``_bwd_delta_kernel``
computed delta; or, without that scratch (varlen batches, sinks, small attentions, head dim 64), by
``_bwd_dq_kernel``, which runs first, owns one query tile, stores its rows' delta and recomputes P, dP and dS over
its key tiles (7 matmuls per pair of tiles).

Streamed tiles. Each pass holds one tile and streams its partner tiles: K and V in the forward and dQ passes, Q and
dO in the dK/dV pass. Where the launch entry says ``desc`` and the batch is dense with 16-byte aligned base and
strides, those come through host tensor descriptors (``DESC``): the copy engine (TMA) fetches each tile into
shared memory, where the tensor cores read it, and the kernel computes no addresses and no load masks (rows past
the sequence end and dims past head_dim arrive as zeros). That frees registers (the head-dim-128 forward: 218
instead of 255) and issue slots; on the H200 it made the head-dim-128 forward 4-8% faster, and with the tile loop
as one loop 3-20% (the freed registers pay for the run-time edge test). Varlen batches keep pointer loads: a box
that crosses a sequence's end reads the next sequence's rows (zeros arrive only past the tensor's end), and one
non-finite value there would reach this sequence through 0 * inf.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._launch import INTERPRETING, cdiv, launch, next_power_of_2

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _seq_bounds(cu_seqlens_ptr, batch, fixed_len, total, IS_VARLEN: tl.constexpr):
    """(first row, length) of a batch element: from cu_seqlens (varlen) or the fixed dense length.

    The offsets are not checked on the host (that would need a synchronisation), so a varlen sequence is clamped to
    the ``total`` rows of the packed tensor: offsets past them, negative or decreasing ones give wrong rows, never an
    access outside the tensors."""
    start = 0
    length = fixed_len
    if IS_VARLEN:
        start = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + batch), 0), total)
        length = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + batch + 1), start), total) - start
    return start, length


@triton.jit
def _tile_ptrs(ptr, batch, head, stride_b, stride_s, stride_h, seq_start, positions, dims):
    """Pointers to the (positions, dims) tile of one head of one sequence."""
    base = ptr + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
    return base + (seq_start + positions).to(tl.int64)[:, None] * stride_s + dims[None, :]


@triton.jit
def _visible(queries, keys, seqlen_q, seqlen_k, window_left, window_right):
    """Which (query, key) pairs attend to each other (bounds, causality and window). ``queries`` and ``keys`` are
    index tensors broadcast against each other: ``rows[:, None], cols[None, :]`` for a (query, key) tile, the
    other way round for a transposed one."""
    shifted = queries + (seqlen_k - seqlen_q)
    return ((queries < seqlen_q) & (keys < seqlen_k) & (keys >= shifted - window_left)
            & (keys <= shifted + window_right))


@triton.jit
def _scores_log2(qk, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """The scores in log2 units: scale * q.k, soft-capped when HAS_SOFTCAP."""
    s = qk * scale
    if HAS_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): finite for every x (exp overflows to inf and gives 1).
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return s * LOG2E


@triton.jit
def _through_softcap(ds, s, softcap, HAS_SOFTCAP: tl.constexpr):
    """The gradient ds of the capped scores carried back to scale * q.k: times 1 - tanh^2, the tanh being the
    capped score (log2 units ``s``) over softcap."""
    if HAS_SOFTCAP:
        t = s / (softcap * LOG2E)
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def _dropout_keep(seed_ptr, batch_head, queries, keys, drop_threshold):
    """Keep mask of a tile: Philox of each element's position, kept when >= p * 2**32. ``queries`` and ``keys``
    are index tensors broadcast against each other, as in ``_visible``.

    The seed is read from device memory (drawn there by the caller), so no host value bakes into a CUDA graph."""
    seed = tl.load(seed_ptr)
    zero = (queries + keys).to(tl.uint32) * 0
    bits, _, _, _ = tl.philox(seed, zero + keys.to(tl.uint32), zero + queries.to(tl.uint32),
                              zero + batch_head.to(tl.uint32), zero)
    return bits.to(tl.int64) >= drop_threshold


@triton.jit
def _partner_tiles(start, BLOCK: tl.constexpr, length, partner_length, offset_lo, offset_hi,
                   PARTNER_BLOCK: tl.constexpr):
    """The partner tiles of the tile [start, start + BLOCK) of one axis (``length`` long): partner index j
    goes with index a iff ``a + offset_lo <= j <= a + offset_hi`` (queries and keys either way round).

    Returns (lo, full_lo, full_hi, hi): [lo, hi) covers every partner that some index of the tile goes with (lo
    on a tile boundary), and the tiles in [full_lo, full_hi) go with every index of the tile, so they need no
    masking; the tiles of [lo, full_lo) and [full_hi, hi) do (the diagonal of a causal mask, window edges,
    sequence ends). Without any whole tile, full_lo = full_hi = hi.
    """
    last = tl.minimum(start + BLOCK, length) - 1
    lo = (tl.maximum(start + offset_lo, 0) // PARTNER_BLOCK) * PARTNER_BLOCK
    hi = tl.minimum(last + offset_hi + 1, partner_length)
    full_lo = tl.cdiv(tl.maximum(last + offset_lo, 0), PARTNER_BLOCK) * PARTNER_BLOCK
    full_hi = (tl.maximum(tl.minimum(start + offset_hi + 1, partner_length), 0) // PARTNER_BLOCK) * PARTNER_BLOCK
    has_full = full_hi > full_lo
    return lo, tl.where(has_full, full_lo, hi), tl.where(has_full, full_hi, hi), hi


@triton.jit
def _run_bounds(run: tl.constexpr, ONE_LOOP: tl.constexpr, lo, full_lo, full_hi, hi):
    """[start, end) of one run of partner tiles from ``_partner_tiles``. Three runs: 0 the masked tiles before the
    whole ones, 1 the whole (unmasked) tiles, 2 the masked tiles after them; each kernel loops over the runs with a
    compile-time index, so that each run is its own loop with its own MASKED specialisation. ONE_LOOP: a single run
    over all of them, each tile testing at run time whether it is an edge tile (see ``_fwd_kernel``)."""
    if ONE_LOOP:
        return lo, hi
    elif run == 0:
        return lo, full_lo
    elif run == 1:
        return full_lo, full_hi
    else:
        return full_hi, hi


@triton.jit
def _is_edge(tile_start, full_lo, full_hi, ONE_LOOP: tl.constexpr):
    """Whether the partner tile at ``tile_start`` needs its mask: with ONE_LOOP, whether it lies outside the whole
    tiles [full_lo, full_hi); with three loops always True, since each run's MASKED flag decides at compile time."""
    if ONE_LOOP:
        return (tile_start < full_lo) | (tile_start >= full_hi)
    else:
        return True


@triton.jit
def _tile_of_head(seqlen, pairs_per_group, BLOCK: tl.constexpr, FLAT_GRID: tl.constexpr, HEAVY_FIRST: tl.constexpr,
                  HEAVY_LAST: tl.constexpr):
    """(first row, or column, of this program's tile; its batch * n_heads + head index).

    The launch grid is (tiles, pairs), or with FLAT_GRID one axis of cdiv(seqlen, BLOCK) tiles per pair; either
    way the hardware starts programs in the order of their linear index, which this maps to work. The natural
    order: a pair's tiles in order, one pair after another. HEAVY_FIRST: the pairs go in groups of
    ``pairs_per_group``; within a group the tiles go from the heaviest (HEAVY_LAST: the last tile of a pair, as a
    causal forward's last query tile; else the first), the group's pairs varying fastest. Causal tiles of one pair
    differ in work up to seqlen / BLOCK times, and in the natural order the kernel ends on the heavy tiles of its
    last pairs: a tail that a simulation of 132 SMs puts at 3-4% at 4k tokens. Small groups keep the programs that
    run at once on the partner tiles of a few pairs, in L2 (the launcher sizes them). It is a compile-time switch
    because its index arithmetic costs registers: 2 more in the head-dim-64 forward with pointer loads took it past
    the 128 that let two programs share an SM, 27% slower on the H200 (with descriptor loads it fits, and gains);
    which passes gain is measured per head dim (the launch table's ``heavy_first``).

    The flat grid serves only more (batch, head) pairs than a second grid axis holds (a packed batch of thousands
    of sequences): on the H200 it measured 25% slower in the head-dim-64 forward (whose division and remainder take
    it to 130 registers, as above) and 9% in its dQ pass than the 2-D grid (level at head dim 128)."""
    if not HEAVY_FIRST:
        if FLAT_GRID:
            n_tiles = tl.cdiv(seqlen, BLOCK)
            pid = tl.program_id(0)
            return (pid % n_tiles) * BLOCK, pid // n_tiles
        return tl.program_id(0) * BLOCK, tl.program_id(1)
    n_tiles = tl.cdiv(seqlen, BLOCK)
    if FLAT_GRID:
        program = tl.program_id(0)
        n_pairs = tl.num_programs(0) // n_tiles
    else:
        program = tl.program_id(1) * n_tiles + tl.program_id(0)
        n_pairs = tl.num_programs(1)
    group = program // (pairs_per_group * n_tiles)
    in_group = program - group * (pairs_per_group * n_tiles)
    pairs_in_group = tl.minimum(pairs_per_group, n_pairs - group * pairs_per_group)
    tile = in_group // pairs_in_group
    if HEAVY_LAST:
        tile = n_tiles - 1 - tile
    return tl.multiple_of(tile * BLOCK, BLOCK), group * pairs_per_group + in_group % pairs_in_group


@triton.jit
def _key_mask(cols, dims, seqlen_k, head_dim, MASKED: tl.constexpr):
    """Which elements of a (keys, head dim) tile exist: MASKED tiles may run past the sequence; the head dim is
    always checked (BLOCK_D is a power of two)."""
    if MASKED:
        return (cols < seqlen_k)[:, None] & (dims < head_dim)[None, :]
    else:
        return (dims < head_dim)[None, :]


@triton.jit
def _fwd_scores(q, k_ptr, batch, kv_head, k_start, col_start, dims, seqlen_k, head_dim, stride_kb, stride_ks,
                stride_kh, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DESC: tl.constexpr):
    """q.k of the key tile at col_start; MASKED: keys past the sequence load as zeros."""
    if DESC:
        # Descriptors serve dense batches only (``_streamed``), whose sequences start at row 0 (k_start is 0).
        k = k_ptr.load([batch, col_start, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        cols = col_start + tl.arange(0, BLOCK_N)
        k = tl.load(_tile_ptrs(k_ptr, batch, kv_head, stride_kb, stride_ks, stride_kh, k_start, cols, dims),
                    mask=_key_mask(cols, dims, seqlen_k, head_dim, MASKED), other=0.0)
    return tl.dot(q, tl.trans(k))


@triton.jit
def _fwd_tile(acc, m_i, l_i, qk_given, q, rows, dims, col_start, k_ptr, v_ptr, batch, batch_head, kv_head, k_start,
              seqlen_q, seqlen_k, head_dim, scale, softcap, window_left, window_right, seed_ptr, drop_threshold,
              keep_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, edge,
              HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, MAX_ON_QK: tl.constexpr, MASKED: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DESC: tl.constexpr, PIPELINED: tl.constexpr):
    """One key tile of the forward's online softmax, and the next tile's q.k with PIPELINED (else qk_given,
    unused, comes back). MASKED tiles check bounds and, where ``edge`` holds (a runtime test in the one-loop form,
    the constant True otherwise), causality and the window.
    MAX_ON_QK: no soft cap and a positive scale, so max(scale * qk) = scale * max(qk).

    PIPELINED (one loop): this tile's q.k arrives as qk_given, computed by the previous tile, and the next tile's is
    issued between this tile's exponentials and its P.V matmul. Triton waits for a matmul's result right after
    issuing it when the loop uses that result, and matmuls complete in order: so the wait for the next q.k, issued
    there, lets P.V run on the tensor cores while the next tile's exponentials run. On the H200 that made the
    head-dim-256 forward 6-14% faster (B2 Hq16 Hk8 S8192 causal 2129 -> 1999 us, B4 H16 S4096 full 2212 -> 1938, B8
    Hq8 Hk4 S2048 causal 347 -> 315) and those at 64 and 128 slower (64: 358 -> 499 us, at 150 registers instead of
    118, past the 128 that let two programs share an SM; 128: 1-3%, at 255 registers, and its 128 x 128 tile no
    longer fits in shared memory at three stages)."""
    cols = col_start + tl.arange(0, BLOCK_N)
    col_mask = _key_mask(cols, dims, seqlen_k, head_dim, MASKED)
    if PIPELINED:
        qk = qk_given
    else:
        qk = _fwd_scores(q, k_ptr, batch, kv_head, k_start, col_start, dims, seqlen_k, head_dim, stride_kb,
                         stride_ks, stride_kh, MASKED, BLOCK_N, BLOCK_D, DESC)
    if MAX_ON_QK:
        # The scores are qk times the positive scale * log2(e): the row max is taken on qk and scaled once, and
        # each score enters exp2 through one fma (qk * c - m) instead of two multiplies and a subtraction. The
        # loop's elementwise work competes with its matmuls: this alone made the forward 4% faster on the H200.
        s = qk
        s_scale = scale * LOG2E
    else:
        s = _scores_log2(qk, scale, softcap, HAS_SOFTCAP)
        s_scale = 1.0
    if MASKED:
        if edge:
            s = tl.where(_visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left, window_right), s,
                         float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * s_scale)
    m_ref = m_new
    if MASKED:
        # A row with nothing visible yet keeps m = -inf; subtract 0 there so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * s_scale - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if HAS_DROPOUT:
        p = tl.where(_dropout_keep(seed_ptr, batch_head, rows[:, None], cols[None, :], drop_threshold),
                     p * keep_scale, 0.0)
    qk_next = qk_given
    if PIPELINED:
        # Past the last visible tile this is unused (one matmul per program instead of a second copy of the body).
        qk_next = _fwd_scores(q, k_ptr, batch, kv_head, k_start, col_start + BLOCK_N, dims, seqlen_k, head_dim,
                              stride_kb, stride_ks, stride_kh, True, BLOCK_N, BLOCK_D, DESC)
    if DESC:
        v = v_ptr.load([batch, col_start, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        v = tl.load(_tile_ptrs(v_ptr, batch, kv_head, stride_vb, stride_vs, stride_vh, k_start, cols, dims),
                    mask=col_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i, qk_next


@triton.jit
def _scheduling_fence():
    """``membar.cta``: ptxas moves no instruction across it. As a memory fence it orders this thread's earlier
    memory accesses before its later ones; where the launch table uses it (the forward's loop with its tiles coming
    through the copy engine, which then makes no memory accesses of its own but dropout's seed load) that costs
    nothing measurable. With pointer loads the forward was 1-10% slower with it, and runs without. Inline PTX, which
    the CPU interpreter cannot run: the launcher leaves the fence out there."""
    tl.inline_asm_elementwise("membar.cta; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sink_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seed_ptr,
    fixed_seqlen_q, fixed_seqlen_k, total_q, total_k, n_heads, group_size, head_dim, pairs_per_group, scale, softcap,
    window_left, window_right, drop_threshold, keep_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    IS_VARLEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    MAX_ON_QK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FLAT_GRID: tl.constexpr, ONE_LOOP: tl.constexpr, HEAVY_FIRST: tl.constexpr, DESC: tl.constexpr,
    PIPELINED: tl.constexpr, PV_FENCE: tl.constexpr,
):
    """Output rows and lse of a query tile over its visible key tiles.

    The key tiles run as three loops (masked edge, unmasked middle, masked edge: ``_run_bounds``), so the middle
    tiles' code carries no mask at all, or with ONE_LOOP as one loop whose tiles test at run time whether they are
    edge tiles. One loop compiles the tile body once and needs fewer registers (offline, sm_90a: the head-dim-128
    dK/dV pass spills 0 bytes instead of 160); which form is faster depends on the pass and head dim, so the launch
    table chooses (``one_loop``). PIPELINED (see ``_fwd_tile``) runs one loop.

    PV_FENCE: a ``_scheduling_fence`` after each tile, right behind the issue of its P.V matmul. It changes no value,
    only how ptxas schedules the loop body (SASS, sm_90a): the copy-engine requests for the tiles two stages ahead,
    which follow the matmul in program order, keep their ~40 instructions of address and uniform-register work
    behind it instead of between the softmax and the matmul, and the exponentials, row sums and bf16 conversions
    are interleaved around the V tile's barrier wait instead of all preceding it. On the H200 the head-dim-128
    forward got 7-11% faster (B4 H32 S4096 causal 1255 -> 1171 us, full 2282 -> 2026, B2 Hq32 Hk8 S8192 causal
    2301 -> 2125); at head dim 64 it was 2% slower, at 256 level and with pointer loads 1-10% slower, so the launch
    table decides (``pv_fence``). (Found because a copy of this kernel instrumented with %clock64 reads ran faster
    than the kernel: a clock read is such a fence too. A ``nanosleep`` there moved only the copy-engine work and
    gained nothing.)"""
    row_start, batch_head = _tile_of_head(fixed_seqlen_q, pairs_per_group, BLOCK_M, FLAT_GRID, HEAVY_FIRST, True)
    batch = batch_head // n_heads
    head = batch_head % n_heads
    kv_head = head // group_size
    q_start, seqlen_q = _seq_bounds(cu_seqlens_q_ptr, batch, fixed_seqlen_q, total_q, IS_VARLEN)
    k_start, seqlen_k = _seq_bounds(cu_seqlens_k_ptr, batch, fixed_seqlen_k, total_k, IS_VARLEN)
    if row_start >= seqlen_q:
        return

    rows = row_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = (rows < seqlen_q)[:, None] & (dims < head_dim)[None, :]
    q = tl.load(_tile_ptrs(q_ptr, batch, head, stride_qb, stride_qs, stride_qh, q_start, rows, dims),
                mask=row_mask, other=0.0)

    if HAS_SINK:
        m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(sink_ptr + head).to(tl.float32) * LOG2E
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32) + 1.0
    else:
        m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) - float("inf")
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    shift = seqlen_k - seqlen_q
    lo, full_lo, full_hi, hi = _partner_tiles(row_start, BLOCK_M, seqlen_q, seqlen_k, shift - window_left,
                                              shift + window_right, BLOCK_N)
    qk = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the first tile's q.k when PIPELINED
    if PIPELINED:
        qk = _fwd_scores(q, k_ptr, batch, kv_head, k_start, lo, dims, seqlen_k, head_dim, stride_kb, stride_ks,
                         stride_kh, True, BLOCK_N, BLOCK_D, DESC)
    for run in tl.static_range(1 if (ONE_LOOP or PIPELINED) else 3):
        start, end = _run_bounds(run, ONE_LOOP or PIPELINED, lo, full_lo, full_hi, hi)
        for col_start in range(start, end, BLOCK_N):
            edge = _is_edge(col_start, full_lo, full_hi, ONE_LOOP or PIPELINED)
            acc, m_i, l_i, qk = _fwd_tile(acc, m_i, l_i, qk, q, rows, dims, col_start, k_ptr, v_ptr, batch,
                                          batch_head, kv_head, k_start, seqlen_q, seqlen_k, head_dim, scale, softcap,
                                          window_left, window_right, seed_ptr, drop_threshold, keep_scale, stride_kb,
                                          stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, edge, HAS_SOFTCAP,
                                          HAS_DROPOUT, MAX_ON_QK, run != 1, BLOCK_N, BLOCK_D, DESC, PIPELINED)
            if PV_FENCE:
                _scheduling_fence()

    has_mass = l_i > 0.0
    out = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    tl.store(_tile_ptrs(o_ptr, batch, head, stride_ob, stride_os, stride_oh, q_start, rows, dims),
             out.to(o_ptr.dtype.element_ty), mask=row_mask)
    lse = tl.where(has_mass, (m_i + tl.log2(tl.where(has_mass, l_i, 1.0))) * LN2, float("inf"))
    lse_ptrs = lse_ptr + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + q_start + rows
    tl.store(lse_ptrs, lse, mask=rows < seqlen_q)


@triton.jit
def _recomputed_p(qk, lse_log2, scale, softcap, HAS_SOFTCAP: tl.constexpr, ONE_FMA: tl.constexpr):
    """P = exp2(scores - lse) of a backward tile recomputed from q.k, and the scores in log2 units (``lse_log2``
    comes broadcast against qk).

    ONE_FMA (no soft cap; the scores are then needed only here): each score enters exp2 through one fma
    (qk * scale*log2(e) - lse) instead of two multiplies and a subtraction, as in the forward, and the second value
    is q.k itself, which no caller reads. The loop's elementwise work competes with its matmuls: in the dK/dV pass
    this made the backward faster on the H200 at head dim 128 (B2 Hq32 Hk8 S8192 causal 7243 -> 6891 us, B1 S16384
    13574 -> 12933, B8 Hq16 Hk8 S4096 3661 -> 3575, MHA 4k causal level). The dQ pass does without it: there it took
    the head-dim-128 tile from 196 registers to 255 and spills (offline, sm_90a) and the backward 1-1.5% slower."""
    if ONE_FMA and not HAS_SOFTCAP:
        return tl.exp2(qk * (scale * LOG2E) - lse_log2), qk
    else:
        s = _scores_log2(qk, scale, softcap, HAS_SOFTCAP)
        return tl.exp2(s - lse_log2), s


@triton.jit
def _probabilities(q, k, lse_log2, rows, cols, seqlen_q, seqlen_k, scale, softcap, window_left, window_right,
                   edge, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """P of a (rows, cols) tile recomputed from the lse (0 where MASKED edge tiles mask), and the scores in log2
    units. Rows past the sequence have lse = +inf, so their P is 0 in every tile."""
    p, s = _recomputed_p(tl.dot(q, tl.trans(k)), lse_log2[:, None], scale, softcap, HAS_SOFTCAP, False)
    if MASKED:
        if edge:
            p = tl.where(_visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, window_left, window_right), p,
                         0.0)
    return p, s


@triton.jit
def _dkdv_tile(dk, dv, k, v, cols, dims, row_start, q_ptr, do_ptr, lse_ptr, delta_ptr, batch, head, n_heads, q_start,
               seqlen_q, seqlen_k, head_dim, scale, softcap, window_left, window_right, seed_ptr, drop_threshold,
               keep_scale, stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh,
               edge, ds_ptr, ds_pair, col_start, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               DESC: tl.constexpr, STORE_DS: tl.constexpr):
    """One query tile's contribution to dK and dV of the key tile (k, v); with STORE_DS, its dS^T tile (in the
    input dtype, as the dK matmul takes it) also goes to ``ds_ptr[ds_pair, keys, queries]`` for the dQ pass that
    reads it back (``_bwd_dq_from_ds_kernel``).

    Computed transposed, as (keys, queries) tiles: P^T = exp(K Q^T - lse) and dS^T are then the left operands
    of dV += P^T dO and dK += dS^T Q as they come out of the arithmetic, instead of register tiles that would
    have to be transposed first; only the loaded Q and dO tiles are read transposed."""
    rows = row_start + tl.arange(0, BLOCK_M)
    if MASKED:
        mask_t = (dims < head_dim)[:, None] & (rows < seqlen_q)[None, :]
    else:
        mask_t = (dims < head_dim)[:, None]
    if DESC:
        q_t = tl.trans(q_ptr.load([batch, row_start, head, 0]).reshape(BLOCK_M, BLOCK_D))
        do_t = tl.trans(do_ptr.load([batch, row_start, head, 0]).reshape(BLOCK_M, BLOCK_D))
    else:
        q_t = tl.load(tl.trans(_tile_ptrs(q_ptr, batch, head, stride_qb, stride_qs, stride_qh, q_start, rows,
                                          dims)), mask=mask_t, other=0.0)
        do_t = tl.load(tl.trans(_tile_ptrs(do_ptr, batch, head, stride_dob, stride_dos, stride_doh, q_start, rows,
                                           dims)), mask=mask_t, other=0.0)
    row_offsets = batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + q_start + rows
    lse_log2 = tl.load(lse_ptr + row_offsets, mask=rows < seqlen_q, other=float("inf")) * LOG2E
    delta = tl.load(delta_ptr + row_offsets, mask=rows < seqlen_q, other=0.0)
    p_t, s_t = _recomputed_p(tl.dot(k, q_t), lse_log2[None, :], scale, softcap, HAS_SOFTCAP, True)
    if MASKED:
        if edge:
            p_t = tl.where(_visible(rows[None, :], cols[:, None], seqlen_q, seqlen_k, window_left, window_right),
                           p_t, 0.0)
    dp_t = tl.dot(v, do_t)
    p_used = p_t
    if HAS_DROPOUT:
        keep = _dropout_keep(seed_ptr, batch * n_heads + head, rows[None, :], cols[:, None], drop_threshold)
        p_used = tl.where(keep, p_t * keep_scale, 0.0)
        dp_t = tl.where(keep, dp_t * keep_scale, 0.0)
    dv += tl.dot(p_used.to(do_t.dtype), tl.trans(do_t))
    ds_t = _through_softcap(p_t * (dp_t - delta[None, :]), s_t, softcap, HAS_SOFTCAP).to(q_t.dtype)
    if STORE_DS:
        # The copy engine clips the box at the scratch's sequence ends.
        ds_ptr.store([ds_pair, col_start, row_start], ds_t.reshape(1, BLOCK_N, BLOCK_M))
    dk += tl.dot(ds_t, tl.trans(q_t))
    return dk, dv


@triton.jit
def _dq_tile(dq, p_dp, q, do, lse_log2, delta, rows, dims, col_start, k_ptr, v_ptr, batch, batch_head, kv_head,
             k_start, seqlen_q, seqlen_k, head_dim, scale, softcap, window_left, window_right, seed_ptr,
             drop_threshold, keep_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, edge,
             HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SINK: tl.constexpr, MASKED: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DESC: tl.constexpr):
    """One key tile's contribution to dQ of the query tile and, with a sink, to each row's sum of P * dP."""
    cols = col_start + tl.arange(0, BLOCK_N)
    col_mask = _key_mask(cols, dims, seqlen_k, head_dim, MASKED)
    if DESC:
        k = k_ptr.load([batch, col_start, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_ptr.load([batch, col_start, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        k = tl.load(_tile_ptrs(k_ptr, batch, kv_head, stride_kb, stride_ks, stride_kh, k_start, cols, dims),
                    mask=col_mask, other=0.0)
        v = tl.load(_tile_ptrs(v_ptr, batch, kv_head, stride_vb, stride_vs, stride_vh, k_start, cols, dims),
                    mask=col_mask, other=0.0)
    p, s = _probabilities(q, k, lse_log2, rows, cols, seqlen_q, seqlen_k, scale, softcap, window_left,
                          window_right, edge, HAS_SOFTCAP, MASKED)
    dp = tl.dot(do, tl.trans(v))
    if HAS_DROPOUT:
        dp = tl.where(_dropout_keep(seed_ptr, batch_head, rows[:, None], cols[None, :], drop_threshold),
                      dp * keep_scale, 0.0)
    if HAS_SINK:
        p_dp += tl.sum(p * dp, axis=1)
    ds = _through_softcap(p * (dp - delta[:, None]), s, softcap, HAS_SOFTCAP)
    return dq + tl.dot(ds.to(k.dtype), k), p_dp


@triton.jit(do_not_specialize=["group_size", "first_pair"])
def _bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seed_ptr,
    ds_ptr, fixed_seqlen_q, fixed_seqlen_k, total_q, total_k, n_heads, n_kv_heads, group_size, head_dim,
    pairs_per_group, first_pair, scale, softcap,
    window_left, window_right, drop_threshold, keep_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    IS_VARLEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLAT_GRID: tl.constexpr,
    ONE_LOOP: tl.constexpr, HEAVY_FIRST: tl.constexpr, DESC: tl.constexpr, SINGLE_HEAD: tl.constexpr,
    STORE_DS: tl.constexpr,
):
    """dK and dV of a key tile, summed over the query tiles that see it in each query head of its kv head. The
    grid covers the (batch, kv head) pairs from ``first_pair`` on; with STORE_DS each query head's dS^T goes to the
    scratch ``ds_ptr`` (a descriptor of ``(pairs * group_size, seqlen_k, seqlen_q)``, indexed from this launch's
    first pair; see ``flash_attn_backward``).

    SINGLE_HEAD (one query head per kv head, and the launch entry without ``group_loop``) compiles the kernel
    without the loop over the group's heads. ``group_size`` is not specialised, so that with ``group_loop`` an MHA
    launch keeps that loop, running once: Triton would otherwise turn a group size of 1 into a constant and drop
    it, and on the H200 the kernel without the loop (same arithmetic, scheduled differently) made the MHA backward
    slower at head dims 128 and 256 (causal: B4 H32 S4096 D128 3717 against 3875 us, S8192 7019 against 7308,
    S16384 13476 against 14166; B4 H8 S4096 D256 2802 against 3068) and faster at head dim 64 (B8 H16 S2048 causal
    635 against 663 us; 0-1% at 4k) and by 1% at D128 without a mask (6855 against 6923 us)."""
    col_start, launch_pair = _tile_of_head(fixed_seqlen_k, pairs_per_group, BLOCK_N, FLAT_GRID, HEAVY_FIRST, False)
    batch_kv_head = first_pair + launch_pair
    batch = batch_kv_head // n_kv_heads
    kv_head = batch_kv_head % n_kv_heads
    q_start, seqlen_q = _seq_bounds(cu_seqlens_q_ptr, batch, fixed_seqlen_q, total_q, IS_VARLEN)
    k_start, seqlen_k = _seq_bounds(cu_seqlens_k_ptr, batch, fixed_seqlen_k, total_k, IS_VARLEN)
    if col_start >= seqlen_k:
        return

    cols = col_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_mask = _key_mask(cols, dims, seqlen_k, head_dim, True)
    k = tl.load(_tile_ptrs(k_ptr, batch, kv_head, stride_kb, stride_ks, stride_kh, k_start, cols, dims),
                mask=col_mask, other=0.0)
    v = tl.load(_tile_ptrs(v_ptr, batch, kv_head, stride_vb, stride_vs, stride_vh, k_start, cols, dims),
                mask=col_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    # Query rows that see key j: i in [j - shift - right, j - shift + left].
    shift = seqlen_k - seqlen_q
    lo, full_lo, full_hi, hi = _partner_tiles(col_start, BLOCK_N, seqlen_k, seqlen_q, -shift - window_right,
                                              -shift + window_left, BLOCK_M)
    members = 1 if SINGLE_HEAD else group_size
    for member in range(0, members):
        head = kv_head * members + member
        for run in tl.static_range(1 if ONE_LOOP else 3):  # see _fwd_kernel
            start, end = _run_bounds(run, ONE_LOOP, lo, full_lo, full_hi, hi)
            for row_start in range(start, end, BLOCK_M):
                edge = _is_edge(row_start, full_lo, full_hi, ONE_LOOP)
                dk, dv = _dkdv_tile(dk, dv, k, v, cols, dims, row_start, q_ptr, do_ptr, lse_ptr, delta_ptr, batch,
                                    head, n_heads, q_start, seqlen_q, seqlen_k, head_dim, scale, softcap, window_left,
                                    window_right, seed_ptr, drop_threshold, keep_scale, stride_qb, stride_qs,
                                    stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, edge,
                                    ds_ptr, launch_pair * members + member, col_start, HAS_SOFTCAP, HAS_DROPOUT,
                                    run != 1, BLOCK_M, BLOCK_N, BLOCK_D, DESC, STORE_DS)

    tl.store(_tile_ptrs(dk_ptr, batch, kv_head, stride_dkb, stride_dks, stride_dkh, k_start, cols, dims),
             (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_mask)
    tl.store(_tile_ptrs(dv_ptr, batch, kv_head, stride_dvb, stride_dvs, stride_dvh, k_start, cols, dims),
             dv.to(dv_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, sink_ptr, dsink_rows_ptr, cu_seqlens_q_ptr,
    cu_seqlens_k_ptr, seed_ptr, fixed_seqlen_q, fixed_seqlen_k, total_q, total_k, n_heads, group_size, head_dim,
    pairs_per_group, scale, softcap, window_left, window_right, drop_threshold, keep_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    IS_VARLEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SINK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLAT_GRID: tl.constexpr,
    ONE_LOOP: tl.constexpr, HEAVY_FIRST: tl.constexpr, DESC: tl.constexpr,
):
    """dQ of a query tile over its visible key tiles, and the tile's delta = rowsum(dO * O) for the dK/dV pass
    (stored before the loop; a separate pass for it took 76 us of the 4.0 ms backward at B4 H32 S4096 d128).
    With a sink, also each row's term -P_sink * dO.O of d(sink), with dO.O taken exactly as the row's sum of
    P * dP over the keys (fp32) rather than from the stored, rounded O."""
    row_start, batch_head = _tile_of_head(fixed_seqlen_q, pairs_per_group, BLOCK_M, FLAT_GRID, HEAVY_FIRST, True)
    batch = batch_head // n_heads
    head = batch_head % n_heads
    kv_head = head // group_size
    q_start, seqlen_q = _seq_bounds(cu_seqlens_q_ptr, batch, fixed_seqlen_q, total_q, IS_VARLEN)
    k_start, seqlen_k = _seq_bounds(cu_seqlens_k_ptr, batch, fixed_seqlen_k, total_k, IS_VARLEN)
    if row_start >= seqlen_q:
        return

    rows = row_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = (rows < seqlen_q)[:, None] & (dims < head_dim)[None, :]
    q = tl.load(_tile_ptrs(q_ptr, batch, head, stride_qb, stride_qs, stride_qh, q_start, rows, dims),
                mask=row_mask, other=0.0)
    do = tl.load(_tile_ptrs(do_ptr, batch, head, stride_dob, stride_dos, stride_doh, q_start, rows, dims),
                 mask=row_mask, other=0.0)
    row_offsets = batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + q_start + rows
    lse_log2 = tl.load(lse_ptr + row_offsets, mask=rows < seqlen_q, other=float("inf")) * LOG2E
    # From the stored (rounded) O, as dS = P * (dP - delta) uses it.
    o = tl.load(_tile_ptrs(o_ptr, batch, head, stride_ob, stride_os, stride_oh, q_start, rows, dims),
                mask=row_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + row_offsets, delta, mask=rows < seqlen_q)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    p_dp = tl.zeros((BLOCK_M,), dtype=tl.float32)

    shift = seqlen_k - seqlen_q
    lo, full_lo, full_hi, hi = _partner_tiles(row_start, BLOCK_M, seqlen_q, seqlen_k, shift - window_left,
                                              shift + window_right, BLOCK_N)
    for run in tl.static_range(1 if ONE_LOOP else 3):  # see _fwd_kernel
        start, end = _run_bounds(run, ONE_LOOP, lo, full_lo, full_hi, hi)
        for col_start in range(start, end, BLOCK_N):
            edge = _is_edge(col_start, full_lo, full_hi, ONE_LOOP)
            dq, p_dp = _dq_tile(dq, p_dp, q, do, lse_log2, delta, rows, dims, col_start, k_ptr, v_ptr, batch,
                                batch_head, kv_head, k_start, seqlen_q, seqlen_k, head_dim, scale, softcap,
                                window_left, window_right, seed_ptr, drop_threshold, keep_scale, stride_kb, stride_ks,
                                stride_kh, stride_vb, stride_vs, stride_vh, edge, HAS_SOFTCAP, HAS_DROPOUT, HAS_SINK,
                                run != 1, BLOCK_N, BLOCK_D, DESC)

    tl.store(_tile_ptrs(dq_ptr, batch, head, stride_dqb, stride_dqs, stride_dqh, q_start, rows, dims),
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_mask)
    if HAS_SINK:
        p_sink = tl.exp2(tl.load(sink_ptr + head).to(tl.float32) * LOG2E - lse_log2)
        tl.store(dsink_rows_ptr + row_offsets, -p_sink * p_dp, mask=rows < seqlen_q)


@triton.jit
def _bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, seqlen, n_heads, head_dim, stride_ob, stride_os, stride_oh, stride_dob,
                      stride_dos, stride_doh, stride_lb, stride_lh, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                      FLAT_GRID: tl.constexpr):
    """delta = rowsum(dO * O) of a (dense) query tile, which the dK/dV pass reads, from the stored (rounded) O as
    dS = P * (dP - delta) uses it. The backward through dS (``flash_attn_backward``) runs it first, in place of the
    dQ pass that computes it otherwise."""
    row_start, batch_head = _tile_of_head(seqlen, 0, BLOCK_M, FLAT_GRID, False, False)
    batch = batch_head // n_heads
    head = batch_head % n_heads
    rows = row_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows < seqlen)[:, None] & (dims < head_dim)[None, :]
    o = tl.load(_tile_ptrs(o_ptr, batch, head, stride_ob, stride_os, stride_oh, 0, rows, dims), mask=mask, other=0.0)
    do = tl.load(_tile_ptrs(do_ptr, batch, head, stride_dob, stride_dos, stride_doh, 0, rows, dims), mask=mask,
                 other=0.0)
    tl.store(delta_ptr + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + rows,
             tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=rows < seqlen)


@triton.jit(do_not_specialize=["first_pair"])
def _bwd_dq_from_ds_kernel(
    ds_ptr, k_ptr, dq_ptr, seqlen_q, seqlen_k, n_heads, group_size, head_dim, pairs_per_group, first_pair, scale,
    window_left, window_right, stride_dqb, stride_dqs, stride_dqh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLAT_GRID: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
):
    """dQ = scale * dS K of a (dense) query tile, with the dS^T tiles the dK/dV pass stored (``ds_ptr``: a descriptor
    of the scratch, box (1, BLOCK_N keys, BLOCK_M queries); ``k_ptr``: K's, box (1, BLOCK_N, 1, BLOCK_D)). The grid
    covers the (batch, query head) pairs from ``first_pair`` on, scratch pair 0 being the first. One matmul per key
    tile instead of the dQ pass's three: the scores, P and dP are not recomputed.

    Only tiles that straddle the mask's edges are masked: their unseen elements may hold whatever the scratch held
    (the dK/dV pass writes only the query tiles that see its keys), so they are selected away, never multiplied by
    0. Whole tiles were written in full; past the sequence ends the copy engine reads zeros."""
    row_start, launch_pair = _tile_of_head(seqlen_q, pairs_per_group, BLOCK_M, FLAT_GRID, HEAVY_FIRST, True)
    batch_head = first_pair + launch_pair
    batch = batch_head // n_heads
    kv_head = (batch_head % n_heads) // group_size
    rows = row_start + tl.arange(0, BLOCK_M)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    shift = seqlen_k - seqlen_q
    lo, full_lo, full_hi, hi = _partner_tiles(row_start, BLOCK_M, seqlen_q, seqlen_k, shift - window_left,
                                              shift + window_right, BLOCK_N)
    for run in tl.static_range(3):
        start, end = _run_bounds(run, False, lo, full_lo, full_hi, hi)
        for col_start in range(start, end, BLOCK_N):
            ds_t = ds_ptr.load([launch_pair, col_start, row_start]).reshape(BLOCK_N, BLOCK_M)
            if run != 1:
                cols = col_start + tl.arange(0, BLOCK_N)
                ds_t = tl.where(_visible(rows[None, :], cols[:, None], seqlen_q, seqlen_k, window_left,
                                         window_right), ds_t, 0.0)
            k = k_ptr.load([batch, col_start, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
            dq = tl.dot(tl.trans(ds_t), k, dq)
    dims = tl.arange(0, BLOCK_D)
    tl.store(_tile_ptrs(dq_ptr, batch, batch_head % n_heads, stride_dqb, stride_dqs, stride_dqh, 0, rows, dims),
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=(rows < seqlen_q)[:, None] & (dims < head_dim)[None, :])


@triton.jit
def _dropout_mask_kernel(mask_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seed_ptr, fixed_seqlen_q, fixed_seqlen_k,
                         total_q, total_k, n_heads, drop_threshold, max_seqlen_q, max_seqlen_k,
                         IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         FLAT_GRID: tl.constexpr):
    """The keep mask as a (batch, heads, max_seqlen_q, max_seqlen_k) bool tensor (for return_attn_probs)."""
    row_start, batch_head = _tile_of_head(max_seqlen_q, 1, BLOCK_M, FLAT_GRID, False, False)
    batch = batch_head // n_heads
    _, seqlen_q = _seq_bounds(cu_seqlens_q_ptr, batch, fixed_seqlen_q, total_q, IS_VARLEN)
    _, seqlen_k = _seq_bounds(cu_seqlens_k_ptr, batch, fixed_seqlen_k, total_k, IS_VARLEN)
    rows = row_start + tl.arange(0, BLOCK_M)
    base = mask_ptr + batch_head.to(tl.int64) * max_seqlen_q * max_seqlen_k
    for col_start in range(0, max_seqlen_k, BLOCK_N):
        cols = col_start + tl.arange(0, BLOCK_N)
        keep = _dropout_keep(seed_ptr, batch_head, rows[:, None], cols[None, :], drop_threshold)
        inside = (rows < seqlen_q)[:, None] & (cols < seqlen_k)[None, :]
        tl.store(base + rows.to(tl.int64)[:, None] * max_seqlen_k + cols[None, :], keep & inside,
                 mask=(rows < max_seqlen_q)[:, None] & (cols < max_seqlen_k)[None, :])


# ----------------------------------------------------------------------------------------------------------
# Launchers. Tensors arrive as 4-D views (batch, seq, heads, head_dim); varlen ones as (1, total, heads, dim)
# with cu_seqlens given. `window` is (left, right) already normalised (no -1, causal folded into right).
# ----------------------------------------------------------------------------------------------------------

# CUDA caps the second and third launch-grid axes at 65535 programs.
_GRID_AXIS_LIMIT = 65535


def _tile_grid(n_tiles: int, n_pairs: int) -> tuple[tuple[int, ...], bool]:
    """(launch grid, FLAT_GRID) for n_tiles tiles of each of n_pairs (batch, head) pairs; see ``_tile_of_head``."""
    if n_pairs <= _GRID_AXIS_LIMIT:
        return (n_tiles, n_pairs), False
    return (n_tiles * n_pairs,), True


def _group_limit(tile: dict, window: tuple[int, int], partner_bytes: int) -> int:
    """The most (batch, head) pairs per group of ``_tile_of_head``'s order for a pass: 0 (natural order) unless its
    launch entry asks for ``heavy_first`` and the tiles differ in work (a causal mask, ``right`` 0); then as many pairs
    as keep the partner tiles they stream (``partner_bytes`` per pair) within 16 MB, a third of the H200's L2, and at
    most 16 (enough to end the simulated tail at 1k tokens). Without a causal mask every tile does the same work: no
    tail to shorten."""
    if not tile.get("heavy_first", False) or window[1] != 0:
        return 0
    return max(1, min(16, (16 << 20) // max(partner_bytes, 1)))


def _pairs_per_group(tile: dict, window: tuple[int, int], partner_bytes: int, n_pairs: int) -> int:
    """``_tile_of_head``'s group size for a launch of ``n_pairs`` pairs: the fewest groups within ``_group_limit``,
    of equal size but for a smaller last one. A group's heaviest tile (a causal dK/dV pass's first key tile sees
    every query) runs about as long as the whole group's work per SM, and a last group of a few pairs starts its
    heaviest tiles only when the groups before have filled the SMs: on the H200 (B8 Hq16 Hk8 S4096 d128, groups of up
    to 8 pairs) a dK/dV launch of 11 pairs, groups of 8 and 3, took 569 us, one of 16 pairs 605 and one of 8 pairs
    307; a list-scheduling simulation of 132 SMs gives 11 pairs in groups of 6 and 5 a sixth less time than in 8
    and 3, and never more time than the groups of the limit for 3-100 pairs."""
    limit = _group_limit(tile, window, partner_bytes)
    if limit == 0:
        return 0
    n_pairs = max(n_pairs, 1)
    return cdiv(n_pairs, cdiv(n_pairs, limit))


def _strides3(t, varlen):
    """(batch, sequence, head) strides; varlen tensors are one (1, total, heads, dim) sequence of rows."""
    return 0 if varlen else t.stride(0), t.stride(1), t.stride(2)


def _block_d(head_dim):
    """The head-dim tile: a power of two, at least 16 (the smallest K of a tensor-core dot)."""
    return max(16, next_power_of_2(head_dim))


def _lse_strides(lse, varlen):
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _descriptor_ok(t):
    """Whether the copy engine can address ``t``: 16-byte aligned base and strides, unit last stride."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(s * size % 16 == 0 for s in t.stride()[:-1])


def _streamed(tile, varlen, block_rows, head_dim, flops, *tensors):
    """(tile, DESC, arguments) for the tensors a pass streams tile by tile (see "Streamed tiles" above).

    With the launch entry's ``desc``, an attention of at least its ``desc_min_flops`` (forward FLOPs, as the
    benchmarks count them) and dense tensors the copy engine can address: host tensor descriptors whose box is one
    (block_rows, head-dim) tile of one head. Otherwise the tensors themselves, and the entry's tile with its
    ``without_desc`` overrides applied: the tile that is fastest with descriptors need not be with pointer loads
    (registers decide, e.g. whether two programs fit on an SM). The minimum exists because descriptors cost host
    time: making and encoding one took ~20 us on the H200's host, which a small attention (whose launches the GPU
    finishes faster than the host issues them) pays in full; 6 per forward+backward."""
    if (tile.get("desc", False) and flops >= tile.get("desc_min_flops", 0) and not varlen
            and all(_descriptor_ok(t) for t in tensors)):
        box = [1, block_rows, 1, _block_d(head_dim)]
        return tile, True, tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), box) for t in tensors)
    return {**tile, **tile.get("without_desc", {})}, False, tensors


def _for_key_length(tile, seqlen_k):
    """The forward's ``tile`` with its ``short`` overrides (tile shape, warps, stages) where a query tile streams at
    most ``short["max_seqlen_k"]`` keys. Each program then runs few key tiles, so what it does once (load its query
    tile, normalise and store its output) weighs more, and smaller tiles, of which several programs fit on an SM,
    overlap one program's prologue and epilogue with another's loop. H200, causal, head dim 128, forward (us,
    do_bench): B16 H32 S1024 418 -> 367 with 64 x 64 tiles on 4 warps at 3 stages instead of 128 x 128 on 8; level
    at S2048 (650 -> 649); at S4096 the larger tile is 4% faster (1088 against 1128)."""
    short = tile.get("short")
    if short is None or seqlen_k > short["max_seqlen_k"]:
        return tile
    return {**tile, **{key: value for key, value in short.items() if key != "max_seqlen_k"}}


def _forward_flops(n_batch, n_heads, seqlen_q, seqlen_k, head_dim, window):
    """4 * b * h * s_q * s_k * d, halved with a causal mask: the size of an attention, as the benchmarks count it."""
    return 4 * n_batch * n_heads * seqlen_q * seqlen_k * head_dim // (2 if window[1] == 0 else 1)


def _dropout_args(dropout_p):
    """(Philox threshold, keep scale): an element is kept when its 32 random bits are >= p * 2**32."""
    if dropout_p <= 0.0:
        return 0, 1.0
    return min(int(dropout_p * 2**32), 2**32 - 1), 1.0 / (1.0 - dropout_p)


def flash_attn_forward(q, k, v, out, lse, sink, seed, cu_seqlens_q, cu_seqlens_k, n_batch, seqlen_q, seqlen_k,
                       scale, softcap, window, dropout_p, *, tile):
    """Write ``out`` (like q) and ``lse`` (fp32; dense ``(b, h, s_q)`` or varlen ``(h, total_q)``).

    q/k/v/out are 4-D ``(batch, seq, heads, head_dim)``; varlen tensors are ``(1, total, heads, head_dim)`` with
    ``cu_seqlens_*`` given and ``seqlen_*`` the maximum lengths. ``window`` is ``(left, right)`` normalised by
    the caller (no -1; causal folded into right). ``seed`` is a 1-element int64 tensor (used with dropout).
    ``tile`` is the launch configuration: ``block_m``, ``block_n``, ``num_warps`` and optionally ``num_stages``,
    ``one_loop`` and ``pv_fence`` (see ``_fwd_kernel``), ``pipelined`` (see ``_fwd_tile``), ``heavy_first`` (see
    ``_tile_of_head``), ``desc``, ``desc_min_flops`` and ``without_desc`` (see ``_streamed``), ``short`` (see
    ``_for_key_length``).
    """
    varlen = cu_seqlens_q is not None
    n_heads, n_kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
    threshold, keep_scale = _dropout_args(dropout_p)
    flops = _forward_flops(n_batch, n_heads, seqlen_q, seqlen_k, head_dim, window)
    tile = _for_key_length(tile, seqlen_k)
    tile, desc, (k_arg, v_arg) = _streamed(tile, varlen, tile["block_n"], head_dim, flops, k, v)
    block_m, block_n = tile["block_m"], tile["block_n"]
    # Each query tile streams the K and V of its kv head.
    pairs_per_group = _pairs_per_group(tile, window, 2 * seqlen_k * head_dim * k.element_size(), n_batch * n_heads)
    grid, flat = _tile_grid(cdiv(seqlen_q, block_m), n_batch * n_heads)
    launch(
        _fwd_kernel, grid,
        (q, k_arg, v_arg, out, lse, sink if sink is not None else lse, cu_seqlens_q if varlen else lse,
         cu_seqlens_k if varlen else lse, seed),
        (seqlen_q, seqlen_k, q.shape[1], k.shape[1], n_heads, n_heads // n_kv_heads, head_dim,
         pairs_per_group, scale, softcap, window[0], window[1], threshold, keep_scale,
         *_strides3(q, varlen), *_strides3(k, varlen), *_strides3(v, varlen), *_strides3(out, varlen),
         *_lse_strides(lse, varlen)),
        dict(IS_VARLEN=varlen, HAS_SOFTCAP=softcap > 0, HAS_SINK=sink is not None, HAS_DROPOUT=dropout_p > 0,
             MAX_ON_QK=softcap <= 0 and scale > 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(head_dim),
             FLAT_GRID=flat, ONE_LOOP=tile.get("one_loop", False), HEAVY_FIRST=pairs_per_group > 0,
             DESC=desc, PIPELINED=tile.get("pipelined", False),
             # The fence changes no value; the CPU interpreter cannot run its inline PTX.
             PV_FENCE=tile.get("pv_fence", False) and not INTERPRETING),
        tile["num_warps"], tile.get("num_stages"))


def _ds_chunk_pairs(from_ds, varlen, sink, k, n_kv_pairs, group_size, seqlen_q, seqlen_k, flops, key_tiles,
                    group_limit, causal):
    """How many (batch, kv head) pairs each launch of the backward through dS takes (its scratch holds their query
    heads' dS): the fewest launches whose scratch fits the entry's ``budget`` bytes, in equal shares, each a multiple
    of a granule where the budget holds one. 0 for the backward that recomputes dS in the dQ pass: without a
    ``from_ds`` entry, for varlen batches, with a sink (whose gradient the dQ pass sums), where the copy engine cannot
    address K, below the entry's ``min_flops``, where one pair's dS alone exceeds the budget, or where the launches
    would be several and either each run fewer dK/dV programs (``key_tiles`` per pair) than the entry's
    ``min_programs`` or, with a ``causal`` mask, together run more than ``max_granule_ratio`` granules (below) per
    granule of pairs.

    The rules come from the causal dK/dV pass, whose heaviest program (a first key tile, which sees every query) runs
    ``key_tiles`` times as long as its lightest. ``min_programs`` (about twice the SMs) is where a launch's work per SM
    falls to that program's time: below it the launch lasts as long as the program, not its work (one pair of B2 Hq32
    Hk8 S8192 d128 per launch, 64 programs on the H200's 132 SMs, took the backward from 6.7 to 10.5 ms). The granule is
    the pairs whose work per SM lasts that long, ``min_programs / key_tiles``, or the pass's heavy-first group
    (``group_limit`` pairs, ``_pairs_per_group``) if larger: a launch of a part of a granule more runs that part's
    heaviest programs after the rest, for as long as a whole one. H200 (dK/dV launches, us): B8 Hq16 Hk8 S4096 d128
    (granule 8) 307 for 8 pairs, 560-577 for 9-13 and 605 for 16, which made a 768 MiB budget's six launches of 11 pairs
    slower than the dQ pass (4353 against 3493 us per backward); B2 Hq16 Hk8 S8192 d256 (granule 2) 900 for 2 pairs,
    1725 for 3 and 1790 for 4. Where the pairs do not split into whole granules of at most the budget (12 pairs of 8-pair
    granules: 8 + 4, as long as 8 + 8), the dQ pass, in one launch, can be faster. Whole backward through dS against the
    dQ pass on the H200 (head dim 128, causal, S4096; granules run per granule of pairs): B4 H32 and B8 Hq16 Hk8 0.97
    (1.00), B3 H12 0.93 and B9 Hq12 Hk4 0.99 (1.11), B7 Hq12 Hk4 1.00-1.03 (1.14), B5 Hq12 Hk4 1.03 (1.2), B3 Hq12 Hk4
    1.10 (1.33); at head dim 256, where the dQ pass is slower, B5 Hq2 Hk1 S8192 0.86 (1.2) and B2 Hq16 Hk8 S8192 with
    launches of 3 pairs 1.10 (1.375): the table's ``max_granule_ratio`` is 1.12 at head dim 128, 1.25 at 256. Without
    a causal mask every program does the same work, and a launch of part of a granule is only shorter."""
    if from_ds is None or varlen or sink is not None or not _descriptor_ok(k) or flops < from_ds.get("min_flops", 0):
        return 0
    per_pair = group_size * seqlen_k * _ds_row_length(seqlen_q, k.element_size()) * k.element_size()
    most = from_ds["budget"] // per_pair
    if most == 0:
        return 0
    pairs = cdiv(n_kv_pairs, cdiv(n_kv_pairs, most))
    min_programs = from_ds.get("min_programs", 0)
    granule = max(1, group_limit, round(min_programs / key_tiles))
    if pairs < n_kv_pairs and most >= granule:
        pairs = min(most // granule, cdiv(pairs, granule)) * granule
    if pairs < n_kv_pairs:
        if pairs * key_tiles < min_programs:
            return 0
        # Each launch lasts as long as its pairs rounded up to whole granules.
        granules = n_kv_pairs // pairs * cdiv(pairs, granule) + cdiv(n_kv_pairs % pairs, granule)
        if causal and granules * granule > from_ds.get("max_granule_ratio", float("inf")) * n_kv_pairs:
            return 0
    return pairs


def _ds_scratch(q, n_heads, seqlen_k, row):
    """The dS scratch of ``n_heads`` query heads, or None where the device has no room left for it: the backward then
    takes the dQ pass, which needs none. The budget bounds the scratch, not what a training run that has nearly
    filled the device leaves free, and an attention that fits without the scratch must not fail for want of it."""
    try:
        return q.new_empty((n_heads, seqlen_k, row))
    except torch.OutOfMemoryError:
        return None


def _ds_row_length(seqlen_q, itemsize):
    """The scratch's row stride in elements: seqlen_q rounded up to 16 bytes, as the copy engine needs."""
    align = 16 // itemsize
    return -(-seqlen_q // align) * align


def flash_attn_backward(dout, q, k, v, out, lse, sink, seed, dq, dk, dv, delta, dsink_rows, cu_seqlens_q,
                        cu_seqlens_k, n_batch, seqlen_q, seqlen_k, scale, softcap, window, dropout_p, *, dkdv_tile,
                        dq_tile):
    """Write dq, dk, dv and, with a sink, ``dsink_rows`` (per-row terms; their sum per head is d sink).

    Arguments as in ``flash_attn_forward``; ``delta`` is an fp32 scratch tensor shaped like ``lse``, and
    ``dsink_rows`` a zeroed fp32 tensor shaped like ``lse``. The two passes have their own launch configurations
    (``dq_tile``, ``dkdv_tile``): one holds a query tile and streams key tiles, the other the reverse, so they favour
    opposite tile shapes. ``dkdv_tile`` may also set ``group_loop`` (see ``_bwd_dkdv_kernel``).

    Two schemes. Where ``dq_tile`` has a ``from_ds`` entry (tile, ``budget``, ``min_flops``, ``min_programs``,
    ``max_granule_ratio``) and the batch is dense, the backward goes through dS: ``_bwd_delta_kernel`` computes delta,
    then, a share of the (batch, kv head) pairs at a time (equal shares of whole granules whose bf16/fp16 dS fits
    ``budget`` bytes: ``_ds_chunk_pairs``), the dK/dV pass also stores each dS^T tile it computes into a scratch and
    ``_bwd_dq_from_ds_kernel`` reads it back for dQ = dS K: 5 matmuls per tile pair instead of 7, for 2 bytes written
    and read per score. On the H200 (whole backward, us, at 3b7fb0f): B4 H32 S4096 D128 causal 3683 -> 3475, B8 Hq16 Hk8
    3578 -> 3385, B2 Hq16 Hk8 S8192 D256 9896 -> 8322 (README, "Flash attention"). Otherwise (also where the device has
    no room for the scratch: ``_ds_scratch``) the dQ pass runs first (it writes delta, which the dK/dV pass reads) and
    recomputes P and dP itself."""
    varlen = cu_seqlens_q is not None
    n_heads, n_kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
    group_size = n_heads // n_kv_heads
    block_d = _block_d(head_dim)
    flops = _forward_flops(n_batch, n_heads, seqlen_q, seqlen_k, head_dim, window)
    dkdv_tile, dkdv_desc, (q_arg, dout_arg) = _streamed(dkdv_tile, varlen, dkdv_tile["block_m"], head_dim, flops, q,
                                                        dout)
    # What the programs of one pair stream at a time: its kv head's K and V (dQ pass), or the Q and dO of one query
    # head (dK/dV pass: a program walks its group's heads one after another, and the programs of a pair that run
    # together are at about the same head). Counting the whole group's Q and dO instead made the groups 2 pairs at
    # B16 Hq8 Hk2 S4096 and 1 at B2 Hq32 Hk8 S8192 (d128 causal), where the dK/dV pass took 7% longer than with 4-16
    # (H200, torch.profiler: 2101 against 1956-1987 us and 4237 against 3918-3998).
    dkdv_partner_bytes = 2 * seqlen_q * head_dim * q.element_size()
    threshold, keep_scale = _dropout_args(dropout_p)
    cu_q, cu_k = (cu_seqlens_q, cu_seqlens_k) if varlen else (lse, lse)
    lse_strides = _lse_strides(lse, varlen)
    shared = (scale, softcap, window[0], window[1], threshold, keep_scale)
    flags = dict(IS_VARLEN=varlen, HAS_SOFTCAP=softcap > 0, HAS_DROPOUT=dropout_p > 0)
    n_kv_pairs = n_batch * n_kv_heads
    from_ds = dq_tile.get("from_ds")
    chunk_pairs = _ds_chunk_pairs(from_ds, varlen, sink, k, n_kv_pairs, group_size, seqlen_q, seqlen_k, flops,
                                  cdiv(seqlen_k, dkdv_tile["block_n"]),
                                  _group_limit(dkdv_tile, window, dkdv_partner_bytes), window[1] == 0)
    ds = (_ds_scratch(q, chunk_pairs * group_size, seqlen_k, _ds_row_length(seqlen_q, q.element_size()))
          if chunk_pairs else None)

    def dkdv_pass(first_pair, n_pairs, ds_store):
        """The dK/dV pass over ``n_pairs`` (batch, kv head) pairs from ``first_pair``, storing dS through the
        descriptor ``ds_store`` unless it is None."""
        grid, flat = _tile_grid(cdiv(seqlen_k, dkdv_tile["block_n"]), n_pairs)
        pairs_per_group = _pairs_per_group(dkdv_tile, window, dkdv_partner_bytes, n_pairs)
        launch(
            _bwd_dkdv_kernel, grid,
            (q_arg, k, v, dout_arg, lse, delta, dk, dv, cu_q, cu_k, seed, ds_store if ds_store is not None else lse),
            (seqlen_q, seqlen_k, q.shape[1], k.shape[1], n_heads, n_kv_heads, group_size, head_dim, pairs_per_group,
             first_pair,
             *shared, *_strides3(q, varlen), *_strides3(k, varlen), *_strides3(v, varlen), *_strides3(dout, varlen),
             *_strides3(dk, varlen), *_strides3(dv, varlen), *lse_strides),
            dict(**flags, BLOCK_M=dkdv_tile["block_m"], BLOCK_N=dkdv_tile["block_n"], BLOCK_D=block_d,
                 FLAT_GRID=flat, ONE_LOOP=dkdv_tile.get("one_loop", False), HEAVY_FIRST=pairs_per_group > 0,
                 DESC=dkdv_desc, SINGLE_HEAD=group_size == 1 and not dkdv_tile.get("group_loop", False),
                 STORE_DS=ds_store is not None),
            dkdv_tile["num_warps"], dkdv_tile.get("num_stages"))

    if ds is not None:
        grid, flat = _tile_grid(cdiv(seqlen_q, 64), n_batch * n_heads)
        launch(_bwd_delta_kernel, grid, (out, dout, delta),
               (seqlen_q, n_heads, head_dim, *_strides3(out, False), *_strides3(dout, False), *lse_strides),
               dict(BLOCK_M=64, BLOCK_D=block_d, FLAT_GRID=flat), 4)
        # The descriptors' rows end at seqlen_q: stores clip there and loads read zeros past it.
        ds_shape, ds_strides = [ds.shape[0], seqlen_k, seqlen_q], list(ds.stride())
        ds_store = TensorDescriptor(ds, ds_shape, ds_strides, [1, dkdv_tile["block_n"], dkdv_tile["block_m"]])
        ds_load = TensorDescriptor(ds, ds_shape, ds_strides, [1, from_ds["block_n"], from_ds["block_m"]])
        k_desc = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, from_ds["block_n"], 1, block_d])
        for first_pair in range(0, n_kv_pairs, chunk_pairs):
            n_pairs = min(chunk_pairs, n_kv_pairs - first_pair)
            dkdv_pass(first_pair, n_pairs, ds_store)
            grid, flat = _tile_grid(cdiv(seqlen_q, from_ds["block_m"]), n_pairs * group_size)
            dq_pairs_per_group = _pairs_per_group(from_ds, window, seqlen_k * head_dim * k.element_size(),
                                                  n_pairs * group_size)
            launch(
                _bwd_dq_from_ds_kernel, grid, (ds_load, k_desc, dq),
                (seqlen_q, seqlen_k, n_heads, group_size, head_dim, dq_pairs_per_group, first_pair * group_size,
                 scale, window[0], window[1], *_strides3(dq, False)),
                dict(BLOCK_M=from_ds["block_m"], BLOCK_N=from_ds["block_n"], BLOCK_D=block_d, FLAT_GRID=flat,
                     HEAVY_FIRST=dq_pairs_per_group > 0),
                from_ds["num_warps"], from_ds.get("num_stages"))
        return

    dq_tile, dq_desc, (k_arg, v_arg) = _streamed(dq_tile, varlen, dq_tile["block_n"], head_dim, flops, k, v)
    dq_pairs_per_group = _pairs_per_group(dq_tile, window, 2 * seqlen_k * head_dim * k.element_size(),
                                          n_batch * n_heads)
    grid, flat = _tile_grid(cdiv(seqlen_q, dq_tile["block_m"]), n_batch * n_heads)
    launch(
        _bwd_dq_kernel, grid,
        (q, k_arg, v_arg, out, dout, lse, delta, dq, sink if sink is not None else lse,
         dsink_rows if dsink_rows is not None else lse, cu_q, cu_k, seed),
        (seqlen_q, seqlen_k, q.shape[1], k.shape[1], n_heads, group_size,
         head_dim, dq_pairs_per_group, *shared, *_strides3(q, varlen), *_strides3(k, varlen),
         *_strides3(v, varlen), *_strides3(out, varlen), *_strides3(dout, varlen), *_strides3(dq, varlen),
         *lse_strides),
        dict(**flags, HAS_SINK=sink is not None, BLOCK_M=dq_tile["block_m"], BLOCK_N=dq_tile["block_n"],
             BLOCK_D=block_d, FLAT_GRID=flat, ONE_LOOP=dq_tile.get("one_loop", False),
             HEAVY_FIRST=dq_pairs_per_group > 0, DESC=dq_desc),
        dq_tile["num_warps"], dq_tile.get("num_stages"))
    dkdv_pass(0, n_kv_pairs, None)


def dropout_keep_mask(mask, seed, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, total_q, total_k, dropout_p, *,
                      block_m=32, block_n=32):
    """Fill ``mask`` (bool, ``(batch, heads, seqlen_q, seqlen_k)``, max lengths for varlen) with the keep mask
    the kernels apply (False outside each sequence). ``total_*``: the packed tensors' rows (varlen; see
    ``_seq_bounds``)."""
    varlen = cu_seqlens_q is not None
    threshold, _ = _dropout_args(dropout_p)
    grid, flat = _tile_grid(cdiv(seqlen_q, block_m), mask.shape[0] * mask.shape[1])
    launch(
        _dropout_mask_kernel, grid,
        (mask, cu_seqlens_q if varlen else seed, cu_seqlens_k if varlen else seed, seed),
        (seqlen_q, seqlen_k, total_q, total_k, mask.shape[1], threshold, seqlen_q, seqlen_k),
        dict(IS_VARLEN=varlen, BLOCK_M=block_m, BLOCK_N=block_n, FLAT_GRID=flat), 4)
