"""RMSNorm forward and backward, optionally fused with the residual add of a pre-norm transformer block.

Shapes. Inputs are viewed as ``n_rows`` rows of ``n_cols`` elements. A row's start is
``(row // rows_inner) * stride_outer + (row % rows_inner) * stride_inner``, so any tensor whose leading
dimensions collapse into at most two strided groups (for instance a transposed ``(seq, batch, hidden)``
tensor seen as ``(batch, seq, hidden)``) is read in place. Element ``c`` of a row is at ``c * stride_col``;
Triton specialises a stride of 1, so the common contiguous case keeps vectorised loads. Outputs are
contiguous ``(n_rows, n_cols)``. All offsets are int64, so tensors beyond 2**31 elements are fine.

Modes (``MODE``), matching the Hugging Face modules they replace:
  LLAMA: y = w * cast(x * rstd)           (statistics in fp32, cast back to the input dtype before the weight)
  PLAIN: y = cast(x * rstd * w)           (fp32 throughout, like torch.nn.RMSNorm)
  GEMMA: y = cast(x * rstd * (1 + w))     (fp32 throughout, zero-centred weight)
with rstd = 1 / sqrt(mean(x**2) + eps).

Rows longer than one block (``SINGLE_PASS`` false) are processed in column chunks: a first pass gathers the
row statistics, a second pass produces the outputs (the re-read mostly hits L2).

Row alignment. Triton proves a row's start 16-byte aligned only from strides that are multiples of 16 elements, and
otherwise moves 2 or 4 bytes per access, although bf16 rows of 5000 elements (10000 bytes) all start on a boundary
(H200, forward 16384 x 5000: 183 us against 87 with 16-byte accesses). With ``ALIGN`` > 1 (elements per 16 bytes)
the host has checked that the row length and every stride a row uses are multiples of ``ALIGN``, and the kernels
rewrite them as ``(v // ALIGN) * ALIGN``: the same values, in a form from which the compiler derives that each row
starts on a boundary (a ``tl.multiple_of`` hint on them was lost in the compiler's rewriting). Rows that really start
off boundaries (4095 elements) keep 2-byte accesses, with launch tables of their own (fewer warps per row won there)
and one row per chunked backward tile (see ``rms_norm_backward``): splitting them into an aligned body and an edge
tile measured faster in some backward tiles and slower in others and in the forward (the edge tile, too small for the
block's layout, is replicated across its warps).

Dense rows. When whole rows fit one block of exactly their length (a power of two) and lie back to back in every
tensor, the single-pass forward gets ``DENSE``, as torch.compile's kernels, specialised to every size, have it:
offsets in int32 with a constant row stride (the host checked that they fit), no column mask and a constant divisor
for the mean, and the weight loaded with the row instead of after the rstd store. These shorten each program's chain
of dependent instructions, which is what a call of a few million elements waits on (H200, CUDA graphs, bf16, the
three against none: 1024 x 1024 on 2 warps 2.77 -> 2.64 us, torch.compile 2.61; 1024 x 4096 in 2 x 4096 tiles 5.54 ->
5.46; benchmarks/results/h200/rms_norm_small_calls.txt). The other tiles keep their code: loading their weight earlier
too made the padded whole-row forwards 8-12% slower.

Backward. With g = dy * w (LLAMA, PLAIN), dy * (1 + w) (GEMMA) or dy (no weight), and x_hat = x * rstd:
  dx = rstd * (g - x_hat * mean(g * x_hat))
  dw = sum over rows of dy * x_hat       (x_hat rounded to the input dtype first in LLAMA mode, as autograd
                                          sees it in the reference module)
The forward also stores each row's rstd (4 bytes a row). The backward grid is persistent: each program
walks its row blocks and accumulates its share of dw in fp32, written once to ``dw_partial[pid]``;
``column_sum`` then reduces the P partial rows in a fixed order, so dw is deterministic (no atomics). How a
program walks its rows and whether it reads the stored rstd depends on the tile (see the backward kernel).
"""

import functools

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2

# Compile-time mode switch (globals read inside @triton.jit must be tl.constexpr).
LLAMA = tl.constexpr(0)
PLAIN = tl.constexpr(1)
GEMMA = tl.constexpr(2)
MODE_IDS = {"llama": 0, "plain": 1, "gemma": 2}
# Largest whole-row backward tile (elements) that prefetches the next row block. On the H200 at 64M bf16
# elements, prefetching took the backward from 140-158 us to 114-120 us for rows of 1024 to 8192; a 16384-wide
# tile with its prefetched copy no longer fits the register file and fell to 225 us.
PREFETCH_MAX_TILE = 8192


@triton.jit
def _row_offsets(rows, rows_inner, stride_outer, stride_inner):
    rows = rows.to(tl.int64)
    return (rows // rows_inner) * stride_outer + (rows % rows_inner) * stride_inner


@triton.jit
def _as_multiple(value, ALIGN: tl.constexpr):
    """``value``, a multiple of ``ALIGN`` (the host checked), in a form the compiler knows to be one."""
    if ALIGN > 1:
        value = (value // ALIGN) * ALIGN
    return value


@triton.jit
def _load_raw_tile(ptr, row_offsets, cols, stride_col, mask, POLICY: tl.constexpr):
    """A (rows, cols) tile of a strided tensor in its own dtype (0 where masked). ``POLICY``: the load's L2 eviction
    policy."""
    return tl.load(ptr + row_offsets[:, None] + cols[None, :] * stride_col, mask=mask, other=0.0,
                   eviction_policy=POLICY)


@triton.jit
def _load_tile(ptr, row_offsets, cols, stride_col, mask, POLICY: tl.constexpr):
    """``_load_raw_tile`` as fp32."""
    return _load_raw_tile(ptr, row_offsets, cols, stride_col, mask, POLICY).to(tl.float32)


@triton.jit
def _weight_factor(w_ptr, cols, col_mask, MODE: tl.constexpr, CACHE: tl.constexpr):
    """The per-column factor the normalised row is multiplied by: w, or 1 + w in GEMMA mode (fp32). ``CACHE``:
    the load's cache modifier."""
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if MODE == GEMMA:
        w = w + 1.0
    return w


@triton.jit
def _load_raw_input(x_ptr, x_rows, x_stride_col, residual_ptr, r_rows, r_stride_col, cols, mask,
                    HAS_RESIDUAL: tl.constexpr, POLICY: tl.constexpr):
    """One tile of x and one of the residual (x again without one), in their own dtypes, loaded with the L2 eviction
    policy ``POLICY``."""
    x = _load_raw_tile(x_ptr, x_rows, cols, x_stride_col, mask, POLICY)
    residual = x
    if HAS_RESIDUAL:
        residual = _load_raw_tile(residual_ptr, r_rows, cols, r_stride_col, mask, POLICY)
    return x, residual


@triton.jit
def _combine_input(x, residual, residual_out_ptr, out_rows, cols, mask, HAS_RESIDUAL: tl.constexpr,
                   POLICY: tl.constexpr):
    """The normalised input h (fp32) from raw tiles: x, or x + residual, which is also stored as residual_out (with
    the L2 eviction policy ``POLICY``)."""
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        # Round the sum to the input dtype, exactly as `x + residual` in the reference block does.
        h = (h + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + out_rows[:, None] + cols[None, :], h, mask=mask, eviction_policy=POLICY)
        h = h.to(tl.float32)
    return h


@triton.jit
def _weight_or_one(w_ptr, cols, col_mask, MODE: tl.constexpr, HAS_WEIGHT: tl.constexpr, CACHE: tl.constexpr):
    """The factor the normalised row (forward) or dy (backward) is multiplied by: w, 1 + w (GEMMA), or 1 without a
    weight (fp32, per column)."""
    if HAS_WEIGHT:
        return _weight_factor(w_ptr, cols, col_mask, MODE, CACHE)
    return tl.full(cols.shape, 1.0, tl.float32)


@triton.jit
def _scale_by_weight(x_hat, w_factor, w_ptr, cols, col_mask, INPUT_DTYPE: tl.constexpr, MODE: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr):
    """y before the final cast, for one tile of normalised rows: times ``w_factor`` (``_weight_or_one``), or, where
    that is None (a compile-time test), times the factor loaded here, after x_hat's rounding. Loading it before the
    rounding instead reorders the PTX of every tile, and made the padded whole-row forwards 8-12% slower on the H200
    (16384 x 2304 bf16: 39.9 -> 44.5 us)."""
    if MODE == LLAMA:
        x_hat = x_hat.to(INPUT_DTYPE).to(tl.float32)
    if HAS_WEIGHT:
        if w_factor is None:
            w_factor = _weight_factor(w_ptr, cols, col_mask, MODE, "")
        x_hat = x_hat * w_factor[None, :]
    return x_hat


@triton.jit
def _chunk_start(chunk, n_chunks, BLOCK_COLS: tl.constexpr):
    """First column of the ``chunk``-th chunk of a row walked backwards. A second pass over rows too long to stay
    on chip walks them backwards: it then starts on the chunks the first pass read last, the likeliest to be still
    in L2, whereas walking a span larger than what L2 keeps in the same order again gets no hits from an LRU-like
    cache (every miss evicts the chunk needed next)."""
    return (n_chunks - 1 - chunk) * BLOCK_COLS


@triton.jit
def _sum_of_squares(x_ptr, x_rows, x_stride_col, residual_ptr, r_rows, r_stride_col, residual_out_ptr, out_rows,
                    row_mask, n_cols, HAS_RESIDUAL: tl.constexpr, BLOCK_COLS: tl.constexpr, PREFETCH: tl.constexpr):
    """Pass 1 over rows too long for one block: sum(h^2) of each row (fp32), storing residual_out on the way. The
    lines the second pass reads again (x, or residual_out) are marked evict_last, x and the residual evict_first
    when they are not read again. With ``PREFETCH`` each block's loads are issued one iteration ahead."""
    if HAS_RESIDUAL:
        input_policy: tl.constexpr = "evict_first"
        residual_out_policy: tl.constexpr = "evict_last"
    else:
        input_policy: tl.constexpr = "evict_last"
        residual_out_policy: tl.constexpr = ""
    sum_sq = tl.zeros(row_mask.shape, dtype=tl.float32)
    if PREFETCH:
        first = tl.arange(0, BLOCK_COLS)
        x_next, residual_next = _load_raw_input(x_ptr, x_rows, x_stride_col, residual_ptr, r_rows, r_stride_col,
                                                first, row_mask[:, None] & (first < n_cols)[None, :], HAS_RESIDUAL,
                                                input_policy)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        if PREFETCH:
            x = x_next
            residual = residual_next
            ahead = cols + BLOCK_COLS
            x_next, residual_next = _load_raw_input(x_ptr, x_rows, x_stride_col, residual_ptr, r_rows, r_stride_col,
                                                    ahead, row_mask[:, None] & (ahead < n_cols)[None, :],
                                                    HAS_RESIDUAL, input_policy)
        else:
            x, residual = _load_raw_input(x_ptr, x_rows, x_stride_col, residual_ptr, r_rows, r_stride_col, cols, mask,
                                          HAS_RESIDUAL, input_policy)
        h = _combine_input(x, residual, residual_out_ptr, out_rows, cols, mask, HAS_RESIDUAL, residual_out_policy)
        sum_sq += tl.sum(h * h, axis=1)
    return sum_sq


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, residual_ptr, w_ptr, y_ptr, residual_out_ptr, rstd_ptr,
    n_rows, n_cols, rows_inner, eps,
    x_stride_outer, x_stride_inner, x_stride_col,
    r_stride_outer, r_stride_inner, r_stride_col,
    MODE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, SINGLE_PASS: tl.constexpr, ALIGN: tl.constexpr,
    PREFETCH: tl.constexpr, OUTPUT_COLS: tl.constexpr, DENSE: tl.constexpr,
):
    if DENSE:
        n_cols = BLOCK_COLS  # see "Dense rows" in the module docstring
    else:
        n_cols = _as_multiple(n_cols, ALIGN)  # see "Row alignment" above
        x_stride_outer = _as_multiple(x_stride_outer, ALIGN)
        x_stride_inner = _as_multiple(x_stride_inner, ALIGN)
        r_stride_outer = _as_multiple(r_stride_outer, ALIGN)
        r_stride_inner = _as_multiple(r_stride_inner, ALIGN)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    if DENSE:  # int32 offsets with a constant row stride
        x_rows = rows * BLOCK_COLS
        r_rows = x_rows
        out_rows = x_rows
    else:
        x_rows = _row_offsets(rows, rows_inner, x_stride_outer, x_stride_inner)
        r_rows = _row_offsets(rows, rows_inner, r_stride_outer, r_stride_inner)
        out_rows = rows.to(tl.int64) * n_cols
    input_dtype = x_ptr.dtype.element_ty

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_COLS)
        if DENSE:
            col_mask = tl.full((BLOCK_COLS,), True, tl.int1)  # folded away with the masks built from it
        else:
            col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x, residual = _load_raw_input(x_ptr, x_rows, x_stride_col, residual_ptr, r_rows, r_stride_col, cols, mask,
                                      HAS_RESIDUAL, "")
        w_factor = None
        if DENSE:  # with the row; otherwise after the rstd store, which may alias it (the compiler keeps the order)
            w_factor = _weight_or_one(w_ptr, cols, col_mask, MODE, HAS_WEIGHT, "")
        h = _combine_input(x, residual, residual_out_ptr, out_rows, cols, mask, HAS_RESIDUAL, "")
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        y = _scale_by_weight(h * rstd[:, None], w_factor, w_ptr, cols, col_mask, input_dtype, MODE, HAS_WEIGHT)
        tl.store(y_ptr + out_rows[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Rows too long for one block (or a whole-row tile run in two passes: see rms_norm_forward): pass 1 reduces
        # sum(h^2) block by block, pass 2 reads h again (x, or the residual_out that pass 1 stored) and writes y, in
        # blocks of OUTPUT_COLS. For pass 2 to find h in L2, pass 1 marks the lines that pass 2 reads evict_last and
        # everything else, read or written for the last time, evict_first. Pass 1 reduces each block as it arrives
        # (a running (BLOCK_ROWS, BLOCK_COLS) sum would not fit beside a prefetched block in the 32768-column blocks
        # of the H200 table) and, with PREFETCH, issues each block's loads one iteration ahead. H200, CUDA graphs,
        # bf16, us: 4096 x 65536 327 -> 280 (copy floor 253), 4096 x 131072 727 -> 657, 8192 x 32768 (whole-row tile
        # before) 281 -> 258.
        sum_sq = _sum_of_squares(x_ptr, x_rows, x_stride_col, residual_ptr, r_rows, r_stride_col, residual_out_ptr,
                                 out_rows, row_mask, n_cols, HAS_RESIDUAL, BLOCK_COLS, PREFETCH)
        rstd = tl.rsqrt(sum_sq / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        n_chunks = tl.cdiv(n_cols, OUTPUT_COLS)
        for chunk in range(0, n_chunks):  # backwards: see _chunk_start
            cols = _chunk_start(chunk, n_chunks, OUTPUT_COLS) + tl.arange(0, OUTPUT_COLS)
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            if HAS_RESIDUAL:
                h = _load_tile(residual_out_ptr, out_rows, cols, 1, mask, "evict_first")
            else:
                h = _load_tile(x_ptr, x_rows, cols, x_stride_col, mask, "evict_first")
            y = _scale_by_weight(h * rstd[:, None], None, w_ptr, cols, col_mask, input_dtype, MODE, HAS_WEIGHT)
            tl.store(y_ptr + out_rows[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask,
                     eviction_policy="evict_first")


@triton.jit
def _dw_term(dy, x_hat, INPUT_DTYPE: tl.constexpr, MODE: tl.constexpr):
    """dy * x_hat as the weight sees it (fp32; ``dy`` in any float dtype)."""
    if MODE == LLAMA:
        x_hat = x_hat.to(INPUT_DTYPE).to(tl.float32)
    return dy.to(tl.float32) * x_hat


@triton.jit
def _store_dx(g, x_hat, rstd, mean_gx, dr_ptr, dr_rows, dr_stride_col, dx_ptr, dx_rows, cols, mask,
              HAS_D_RESIDUAL: tl.constexpr):
    """dx = rstd * (g - x_hat * mean(g * x_hat)), plus the gradient reaching the fused form's residual output."""
    dx = rstd[:, None] * (g - x_hat * mean_gx[:, None])
    if HAS_D_RESIDUAL:
        dx += _load_tile(dr_ptr, dr_rows, cols, dr_stride_col, mask, "")
    tl.store(dx_ptr + dx_rows[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_row_block(ptr, block, rows_inner, stride_outer, stride_inner, stride_col, cols, col_mask, n_rows,
                    BLOCK_ROWS: tl.constexpr):
    """Whole rows ``block * BLOCK_ROWS ...`` of a strided tensor in its own dtype (rows past the end read nothing)."""
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offsets = _row_offsets(rows, rows_inner, stride_outer, stride_inner)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    return _load_raw_tile(ptr, offsets, cols, stride_col, mask, "")


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr, h_ptr, rstd_ptr, w_ptr, d_residual_out_ptr, dx_ptr, dw_partial_ptr,
    n_rows, n_cols, rows_inner, eps,
    dy_stride_outer, dy_stride_inner, dy_stride_col,
    h_stride_outer, h_stride_inner, h_stride_col,
    dr_stride_outer, dr_stride_inner, dr_stride_col,
    MODE: tl.constexpr, HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, HAS_D_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, SINGLE_PASS: tl.constexpr, PREFETCH: tl.constexpr,
    ALIGN: tl.constexpr,
):
    n_cols = _as_multiple(n_cols, ALIGN)  # see "Row alignment" in the module docstring
    dy_stride_outer = _as_multiple(dy_stride_outer, ALIGN)
    dy_stride_inner = _as_multiple(dy_stride_inner, ALIGN)
    h_stride_outer = _as_multiple(h_stride_outer, ALIGN)
    h_stride_inner = _as_multiple(h_stride_inner, ALIGN)
    dr_stride_outer = _as_multiple(dr_stride_outer, ALIGN)
    dr_stride_inner = _as_multiple(dr_stride_inner, ALIGN)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    input_dtype = h_ptr.dtype.element_ty
    dw_row = dw_partial_ptr + pid.to(tl.int64) * n_cols

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        dw_acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
        if PREFETCH:
            # The next row block's h and dy are requested before this block's reductions and stores, so a program
            # keeps loads in flight across its whole loop (only a few programs fit per SM, since each holds a dw
            # accumulator), and the weight is loaded once. Row blocks are strided (pid, pid + P, ...) and rstd is
            # recomputed: on the H200, at 16384 x 4096, contiguous blocks or reading the stored rstd (a load the
            # prefetch does not cover) each cost about 3% (118 against 114.6 us).
            first_block = pid
            end_block = n_row_blocks
            step = n_programs
            w_factor = _weight_or_one(w_ptr, cols, col_mask, MODE, HAS_WEIGHT, "")
            h_next = _load_row_block(h_ptr, first_block, rows_inner, h_stride_outer, h_stride_inner, h_stride_col,
                                     cols, col_mask, n_rows, BLOCK_ROWS)
            dy_next = _load_row_block(dy_ptr, first_block, rows_inner, dy_stride_outer, dy_stride_inner,
                                      dy_stride_col, cols, col_mask, n_rows, BLOCK_ROWS)
        else:
            # Tiles too wide to prefetch nearly fill the register file. Each program walks a contiguous run of row
            # blocks, reads the forward's rstd (one block-wide reduction per row instead of two) and reloads the
            # weight every row (from L1/L2; holding it would spill): at 16384 x 16384 on 8 warps 507 us against
            # 645 with strided blocks and the statistics recomputed.
            blocks_per_program = tl.cdiv(n_row_blocks, n_programs)
            first_block = pid * blocks_per_program
            end_block = tl.minimum(first_block + blocks_per_program, n_row_blocks)
            step = 1
        for block in range(first_block, end_block, step):
            if PREFETCH:
                # Both converted on arrival (see the dw term below); converting h only where it is used instead
                # changes the PTX of every prefetching tile (Triton 3.6, sm_90a).
                h_raw = h_next.to(tl.float32)
                dy_raw = dy_next.to(tl.float32)
                h_next = _load_row_block(h_ptr, block + step, rows_inner, h_stride_outer, h_stride_inner,
                                         h_stride_col, cols, col_mask, n_rows, BLOCK_ROWS)
                dy_next = _load_row_block(dy_ptr, block + step, rows_inner, dy_stride_outer, dy_stride_inner,
                                          dy_stride_col, cols, col_mask, n_rows, BLOCK_ROWS)
            else:
                h_raw = _load_row_block(h_ptr, block, rows_inner, h_stride_outer, h_stride_inner, h_stride_col, cols,
                                        col_mask, n_rows, BLOCK_ROWS)
                dy_raw = _load_row_block(dy_ptr, block, rows_inner, dy_stride_outer, dy_stride_inner, dy_stride_col,
                                         cols, col_mask, n_rows, BLOCK_ROWS)
                w_factor = _weight_or_one(w_ptr, cols, col_mask, MODE, HAS_WEIGHT, "")
            rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            h = h_raw.to(tl.float32)
            if PREFETCH:
                rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
                x_hat = h * rstd[:, None]
                g = dy_raw * w_factor[None, :]
                # dy in fp32 from its arrival and the dw term formed before the reduction: 222 us at 16384 x 8192 on
                # the H200, against 259 with dy kept in bf16 and the term formed after the dx store.
                dw_term = _dw_term(dy_raw, x_hat, input_dtype, MODE)
                mean_gx = tl.sum(g * x_hat, axis=1) / n_cols
            else:
                # Nothing but the raw h and dy (packed bf16) and the dw accumulator stays live across the
                # reduction: the weight is loaded again after it, with an explicit .ca (the default caching) that
                # keeps the compiler from merging the two loads and holding the weight in registers. No spills on 8
                # or 16 warps at 16384 columns (ptxas, sm_90a), against 144 and 96 bytes with g held across it; on
                # the H200 at 16384 x 16384, 440 us on 16 warps against 501 (the best tile before, on 8 warps).
                rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
                mean_gx = tl.sum(dy_raw.to(tl.float32) * w_factor[None, :] * h, axis=1) * rstd / n_cols
                w_factor = _weight_or_one(w_ptr, cols, col_mask, MODE, HAS_WEIGHT, ".ca")
                x_hat = h * rstd[:, None]
                g = dy_raw.to(tl.float32) * w_factor[None, :]
            _store_dx(g, x_hat, rstd, mean_gx, d_residual_out_ptr,
                      _row_offsets(rows, rows_inner, dr_stride_outer, dr_stride_inner), dr_stride_col, dx_ptr,
                      rows.to(tl.int64) * n_cols, cols, mask, HAS_D_RESIDUAL)
            if COMPUTE_DW:
                if not PREFETCH:
                    dw_term = _dw_term(dy_raw, x_hat, input_dtype, MODE)
                if BLOCK_ROWS > 1:
                    dw_term = tl.where(mask, dw_term, 0.0)  # with eps = 0 a padded row's x_hat is NaN
                dw_acc += dw_term
        if COMPUTE_DW:
            tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    else:
        # This program owns dw_partial[pid]; zero it before accumulating chunk by chunk.
        if COMPUTE_DW:
            for start in range(0, n_cols, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                tl.store(dw_row + cols, tl.zeros((BLOCK_COLS,), dtype=tl.float32), mask=cols < n_cols)
        n_chunks = tl.cdiv(n_cols, BLOCK_COLS)
        for block in range(pid, n_row_blocks, n_programs):
            rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            dy_rows = _row_offsets(rows, rows_inner, dy_stride_outer, dy_stride_inner)
            h_rows = _row_offsets(rows, rows_inner, h_stride_outer, h_stride_inner)
            dr_rows = _row_offsets(rows, rows_inner, dr_stride_outer, dr_stride_inner)
            dx_rows = rows.to(tl.int64) * n_cols
            # Pass 1: the row statistic sum(g * h); rstd is the forward's.
            sum_gh = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                h = _load_tile(h_ptr, h_rows, cols, h_stride_col, mask, "")
                g = _load_tile(dy_ptr, dy_rows, cols, dy_stride_col, mask, "")
                g = g * _weight_or_one(w_ptr, cols, col_mask, MODE, HAS_WEIGHT, "")[None, :]
                sum_gh += g * h
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            mean_gx = tl.sum(sum_gh, axis=1) * rstd / n_cols
            # Pass 2: dx, and this program's share of dw; backwards, starting on the chunks pass 1 read last, the
            # likeliest to be still in L2 (see _chunk_start).
            for chunk in range(0, n_chunks):
                cols = _chunk_start(chunk, n_chunks, BLOCK_COLS) + tl.arange(0, BLOCK_COLS)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                h = _load_tile(h_ptr, h_rows, cols, h_stride_col, mask, "")
                dy = _load_tile(dy_ptr, dy_rows, cols, dy_stride_col, mask, "")
                x_hat = h * rstd[:, None]
                g = dy * _weight_or_one(w_ptr, cols, col_mask, MODE, HAS_WEIGHT, "")[None, :]
                dw_term = _dw_term(dy, x_hat, input_dtype, MODE)
                _store_dx(g, x_hat, rstd, mean_gx, d_residual_out_ptr, dr_rows, dr_stride_col, dx_ptr, dx_rows,
                          cols, mask, HAS_D_RESIDUAL)
                if COMPUTE_DW:
                    partial = tl.load(dw_row + cols, mask=col_mask, other=0.0)
                    partial += tl.sum(tl.where(mask, dw_term, 0.0), axis=0)
                    tl.store(dw_row + cols, partial, mask=col_mask)


@triton.jit
def _column_sum_kernel(partial_ptr, out_ptr, n_partial_rows, n_cols, BLOCK_ROWS: tl.constexpr,
                       BLOCK_COLS: tl.constexpr):
    """out[c] = sum_p partial[p, c], summed in a fixed order (deterministic), stored in out's dtype."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, n_partial_rows, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_partial_rows)[:, None] & col_mask[None, :]
        acc += tl.load(partial_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_mask)


def _is_dense(layout, n_rows, n_cols):
    """Whether the rows of ``layout`` lie back to back, ``n_cols`` apart (the forward's ``DENSE``)."""
    rows_inner, _, stride_inner, stride_col = layout
    return rows_inner >= n_rows and (stride_inner == n_cols or n_rows == 1) and stride_col == 1


def _row_strides(layout):
    rows_inner, stride_outer, stride_inner, stride_col = layout
    return stride_outer, stride_inner, stride_col


@functools.lru_cache(maxsize=4096)
def row_alignment(element_size, layouts, n_rows, n_cols):
    """The launchers' ``align`` for rows of ``layouts``: 1 when Triton proves every row 16-byte aligned itself (row
    length and strides multiples of 16 elements), the elements per 16 bytes when the row length and every stride
    that a row uses are multiples of that (a stride that no row uses, the outer one when all rows are in the inner
    group or the inner one when that group has one row, may be anything: rewriting it changes no offset), and None
    when the rows are not all aligned or a column stride is not 1: the kernels then move 2 or 4 bytes per access,
    and the ops pick their launches from the tables for such rows (``forward_unaligned``, ``backward_unaligned``).
    ``layouts`` is a tuple (cached: a model has a few layouts, and the walk costs ~1 us of host time per call)."""
    if any(layout[3] != 1 for layout in layouts):
        return None
    align = 16 // element_size
    strides = [n_cols] + [stride for layout in layouts for stride in layout[1:3]]
    if all(stride % 16 == 0 for stride in strides):
        return 1
    aligned = n_cols % align == 0 and all(
        (rows_inner == 1 or inner % align == 0) and (rows_inner >= n_rows or outer % align == 0)
        for rows_inner, outer, inner, _ in layouts)
    return align if aligned else None


def rms_norm_forward(x, x_layout, weight, residual, residual_layout, y, residual_out, rstd, n_rows, n_cols, eps,
                     mode, *, block_rows, block_cols, num_warps, align, two_pass=False):
    """Launch the forward kernel.

    ``x_layout``/``residual_layout`` are ``(rows_inner, stride_outer, stride_inner, stride_col)`` (see the module
    docstring; both tensors share ``rows_inner``). ``y`` and ``residual_out`` are contiguous outputs, ``rstd`` a
    contiguous fp32 output of ``n_rows`` elements (the backward's input); ``residual``/``residual_out``/``weight``
    may be None. ``align``: ``row_alignment`` of the two layouts.

    The chunked pass 1 prefetches only rows of one input accessed 16 bytes at a time: the prefetched block doubles
    what a thread holds across the reduction, and with a second input (the residual) or 2-byte accesses (a 64-bit
    address per element) it was slower on the H200 (4096 x 65536 with a residual: 649 against 562 us; 16384 x 16383:
    436 against 395).

    The output pass of rows longer than one block takes half-width blocks: it reads from L2, and full-width ones were
    slower everywhere (up to 1.5x with 2-byte accesses).

    Single-pass launches of rows exactly one block long, back to back in x and the residual, take the kernel's
    ``DENSE`` path (module docstring, "Dense rows").

    ``two_pass`` (ignored with a residual) runs rows that fit in one block through the chunked kernel's two passes
    too, one full-width block each: the output pass reads the row again (from L1 or L2) instead of holding it in
    registers across the reduction, as torch.compile's kernel does. On the H200 (CUDA graphs, bf16, us) that won
    on rows padded far past their length, where a tile of 4 warps then suffices: 16384 x 5000 85.3 -> 80.3 (copy
    floor 77.1), 65536 x 5000 337.5 -> 310.4, 16384 x 4608 79.9 -> 74.0, 4096 x 5000 level (24.2 -> 24.4); but at
    6144 columns it was level or slower, and on full tiles it won only with many rows (16384 x 16384 257.8 -> 253.6,
    65536 x 4096 257 -> 251) and lost with fewer (4096 x 8192 34.2 -> 35.3, 1024 x 16384 19.6 -> 19.7, 1024 x 4096
    4.9 -> 5.3), and with a residual (16384 x 4096: 133 -> 142). The H200 table uses it for 4097-5120 columns and,
    since tiles were tuned at 64M and 512M elements, at 4096, 8192 and 16384 columns too, where against the tiles
    tuned at 64M alone it won or tied from 1024 to 65536 rows (65536 x 8192: 520.6 -> 503.2 us; 1024 x 4096: 4.6 ->
    4.5; benchmarks/results/h200/rms_norm_tables_ab.txt).
    """
    rows_inner = x_layout[0]
    r_strides = _row_strides(residual_layout) if residual is not None else (0, 0, 0)
    single_pass = block_cols >= n_cols and not (two_pass and residual is None)
    # Spelled out rather than a loop over the layouts: this runs on every call (0.26 against 0.62 us of host time).
    dense = (single_pass and block_cols == n_cols and (n_rows + block_rows) * n_cols < 2**31
             and _is_dense(x_layout, n_rows, n_cols)
             and (residual is None or _is_dense(residual_layout, n_rows, n_cols)))
    launch(
        _rms_norm_forward_kernel, (cdiv(n_rows, block_rows),),
        (x, residual if residual is not None else x, weight if weight is not None else x, y,
         residual_out if residual_out is not None else y, rstd),
        (n_rows, n_cols, rows_inner, eps, *_row_strides(x_layout), *r_strides),
        dict(MODE=MODE_IDS[mode], HAS_WEIGHT=weight is not None, HAS_RESIDUAL=residual is not None,
             BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
             SINGLE_PASS=single_pass, ALIGN=align or 1,
             PREFETCH=align is not None and residual is None and block_cols < n_cols,
             OUTPUT_COLS=block_cols if block_cols >= n_cols else block_cols // 2, DENSE=dense),
        num_warps)


def rms_norm_backward(dy, dy_layout, h, h_layout, rstd, weight, d_residual_out, d_residual_layout, dx, dw, n_rows,
                      n_cols, eps, mode, *, block_rows, block_cols, num_warps, num_programs, align):
    """Launch the backward: dx always (contiguous output), dw when ``dw`` is given (shape ``(n_cols,)``).

    ``h`` is the normalised input (``x``, or ``x + residual`` for the fused form) and ``rstd`` the forward's
    (contiguous fp32, ``n_rows`` elements); ``d_residual_out`` is the gradient reaching the fused form's residual
    output, added to dx. ``num_programs`` sizes the persistent grid. ``align``: ``row_alignment`` of the layouts.
    """
    rows_inner = h_layout[0]
    if dy_layout[0] != rows_inner or (d_residual_out is not None and d_residual_layout[0] != rows_inner):
        raise ValueError("dy, h and d_residual_out must share the row grouping (rows_inner)")
    single_pass = block_cols >= n_cols
    if align is None and not single_pass:
        # Chunks of several rows accessed 2 bytes at a time need a 64-bit address per element: ptxas then gave the
        # H200 table's 4 x 8192 and 8 x 4096 tiles 32 registers and 3.5-8.7 KB of spills per thread (16384 x 24584
        # bf16: 16.6 ms, against 1.10 with 16-byte accesses); one row per tile spills nothing.
        block_rows = 1
    num_programs = max(1, min(num_programs, cdiv(n_rows, block_rows)))
    dw_partial = torch.empty((num_programs, n_cols), device=h.device, dtype=torch.float32) if dw is not None else h
    dr_strides = _row_strides(d_residual_layout) if d_residual_out is not None else (0, 0, 0)
    launch(
        _rms_norm_backward_kernel, (num_programs,),
        (dy, h, rstd, weight if weight is not None else h, d_residual_out if d_residual_out is not None else dy,
         dx, dw_partial),
        (n_rows, n_cols, rows_inner, eps,
         *_row_strides(dy_layout), *_row_strides(h_layout), *dr_strides),
        dict(MODE=MODE_IDS[mode], HAS_WEIGHT=weight is not None, COMPUTE_DW=dw is not None,
             HAS_D_RESIDUAL=d_residual_out is not None,
             BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, SINGLE_PASS=single_pass,
             PREFETCH=single_pass and block_rows * block_cols <= PREFETCH_MAX_TILE, ALIGN=align or 1),
        num_warps)
    if dw is not None:
        # Narrow strips and tall tiles: enough programs, and enough bytes in flight per program, that summing
        # a few thousand partial rows stays cheap next to the main kernel.
        strip = min(32, next_power_of_2(n_cols))
        launch(_column_sum_kernel, (cdiv(n_cols, strip),), (dw_partial, dw), (num_programs, n_cols),
               dict(BLOCK_ROWS=128, BLOCK_COLS=strip), 8)
