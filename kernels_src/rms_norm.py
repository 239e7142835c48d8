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

Rows that start off 16-byte boundaries. Triton proves a row's start aligned only from strides that are multiples of 16
elements; otherwise it moves 2 or 4 bytes per access (H200, forward 16384 x 4095 bf16: 102.8 us against 70.1 at 4096;
16384 x 5000: 188.1 against 89.9 at 5008). With ``ALIGN`` > 1 (elements per 16 bytes) and ``PHASES`` 1, every row offset
is a multiple of ``ALIGN`` (the host checked), which the kernel shows the compiler (``_at_body``; an offset that is not
would be read rounded down, so the host's check is what keeps it correct). With ``PHASES`` > 1 the rows start as far
from a boundary as contiguous rows of ``n_cols`` would, a distance that repeats every ``PHASES`` rows: a tile then takes
``BLOCK_ROWS`` rows ``PHASES`` apart, all at the same distance, and splits them into a "body" of whole 16-byte vectors
from the first boundary on (``_row_split``), which the blocks stream as before, and an edge tile of the few columns
before and after it (``_edge_columns``). The body's weight is read unaligned, once per tile.

Backward. With g = dy * w (LLAMA, PLAIN), dy * (1 + w) (GEMMA) or dy (no weight), and x_hat = x * rstd:
  dx = rstd * (g - x_hat * mean(g * x_hat))
  dw = sum over rows of dy * x_hat       (x_hat rounded to the input dtype first in LLAMA mode, as autograd
                                          sees it in the reference module)
The forward also stores each row's rstd (4 bytes a row). The backward grid is persistent: each program
walks its row blocks and accumulates its share of dw in fp32, written once to ``dw_partial[pid]``;
``column_sum`` then reduces the P partial rows in a fixed order, so dw is deterministic (no atomics). How a
program walks its rows and whether it reads the stored rstd depends on the tile (see the backward kernel).
"""

import math

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
def _tile_rows(tile, phase, BLOCK_ROWS: tl.constexpr, PHASES: tl.constexpr):
    """The rows of a phase's ``tile``-th tile: ``BLOCK_ROWS`` rows ``PHASES`` apart (consecutive for 1 phase)."""
    return tile * (BLOCK_ROWS * PHASES) + phase + PHASES * tl.arange(0, BLOCK_ROWS)


@triton.jit
def _row_split(phase, n_cols, ALIGN: tl.constexpr, PHASES: tl.constexpr):
    """(head, body): a tile's rows are streamed over columns ``[head, head + body)``, from the rows' first 16-byte
    boundary in whole 16-byte vectors when ``PHASES`` > 1 (the other columns are the edge tile's), else whole."""
    if PHASES > 1:
        # The head reaches the boundary even when the row ends before it (the body is then empty), so that the
        # body's offsets stay multiples of ALIGN (see _at_body).
        head = (ALIGN - (phase * n_cols) % ALIGN) % ALIGN
        body = (tl.maximum(n_cols - head, 0) // ALIGN) * ALIGN
    else:
        head = 0
        body = n_cols
        if ALIGN > 1:
            body = (n_cols // ALIGN) * ALIGN  # equal, but now the compiler knows it is a multiple of ALIGN
    return head, body


@triton.jit
def _edge_columns(head, body, n_cols, ALIGN: tl.constexpr):
    """(columns, mask) of the edge tile: lanes [0, ALIGN) take the columns before the body, the others those after."""
    lanes = tl.arange(0, 2 * ALIGN)
    cols = tl.where(lanes < ALIGN, lanes, head + body + lanes - ALIGN)
    return cols, tl.where(lanes < ALIGN, lanes < tl.minimum(head, n_cols), cols < n_cols)


@triton.jit
def _at_body(row_offsets, head, ALIGN: tl.constexpr):
    """Offsets of the body's first column (unit column stride when ``ALIGN`` > 1), 16-byte aligned. They are
    multiples of ALIGN already (the host checked, or the head was chosen so); ``(o // ALIGN) * ALIGN`` says so in a
    form the compiler keeps (a tl.multiple_of hint on the offsets was lost in its rewriting: scalar accesses)."""
    if ALIGN > 1:
        row_offsets = ((row_offsets + head) // ALIGN) * ALIGN
    return row_offsets


@triton.jit
def _load_tile(ptr, row_offsets, cols, stride_col, mask):
    """A (rows, cols) tile of a strided tensor, as fp32."""
    return tl.load(ptr + row_offsets[:, None] + cols[None, :] * stride_col, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _weight_factor(w_ptr, cols, col_mask, MODE: tl.constexpr, CACHE: tl.constexpr):
    """The per-column factor the normalised row is multiplied by: w, or 1 + w in GEMMA mode (fp32). ``CACHE``:
    the load's cache modifier."""
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if MODE == GEMMA:
        w = w + 1.0
    return w


@triton.jit
def _load_input(x_ptr, x_rows, x_stride_col, residual_ptr, r_rows, r_stride_col, residual_out_ptr, out_rows, cols,
                mask, HAS_RESIDUAL: tl.constexpr):
    """One tile of the normalised input h (fp32): x, or x + residual, which is also stored as residual_out."""
    h = _load_tile(x_ptr, x_rows, cols, x_stride_col, mask)
    if HAS_RESIDUAL:
        # Round the sum to the input dtype, exactly as `x + residual` in the reference block does.
        h = (h + _load_tile(residual_ptr, r_rows, cols, r_stride_col, mask)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + out_rows[:, None] + cols[None, :], h, mask=mask)
        h = h.to(tl.float32)
    return h


@triton.jit
def _scale_by_weight(x_hat, w_ptr, cols, col_mask, INPUT_DTYPE: tl.constexpr, MODE: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr):
    """y before the final cast, for one tile of normalised rows."""
    if MODE == LLAMA:
        x_hat = x_hat.to(INPUT_DTYPE).to(tl.float32)
    if HAS_WEIGHT:
        x_hat = x_hat * _weight_factor(w_ptr, cols, col_mask, MODE, "")[None, :]
    return x_hat


@triton.jit
def _chunk_start(chunk, n_chunks, BLOCK_COLS: tl.constexpr):
    """First column of the ``chunk``-th chunk of a row walked backwards. A second pass over rows too long to stay
    on chip walks them backwards: it then starts on the chunks the first pass read last, the likeliest to be still
    in L2, whereas walking a span larger than what L2 keeps in the same order again gets no hits from an LRU-like
    cache (every miss evicts the chunk needed next)."""
    return (n_chunks - 1 - chunk) * BLOCK_COLS


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, residual_ptr, w_ptr, y_ptr, residual_out_ptr, rstd_ptr,
    n_rows, n_cols, rows_inner, eps,
    x_stride_outer, x_stride_inner, x_stride_col,
    r_stride_outer, r_stride_inner, r_stride_col,
    MODE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, SINGLE_PASS: tl.constexpr,
    ALIGN: tl.constexpr, PHASES: tl.constexpr,
):
    phase = tl.program_id(0) % PHASES
    rows = _tile_rows(tl.program_id(0) // PHASES, phase, BLOCK_ROWS, PHASES)
    row_mask = rows < n_rows
    x_rows = _row_offsets(rows, rows_inner, x_stride_outer, x_stride_inner)
    r_rows = _row_offsets(rows, rows_inner, r_stride_outer, r_stride_inner)
    out_rows = rows.to(tl.int64) * n_cols
    input_dtype = x_ptr.dtype.element_ty
    # The blocks below stream the body: columns head + c, c < body, through these row offsets and weight pointer.
    head, body = _row_split(phase, n_cols, ALIGN, PHASES)
    x_body = _at_body(x_rows, head, ALIGN)
    r_body = _at_body(r_rows, head, ALIGN)
    out_body = _at_body(out_rows, head, ALIGN)
    w_body = w_ptr + head
    if PHASES > 1:
        edge_cols, edge_col_mask = _edge_columns(head, body, n_cols, ALIGN)
        edge_mask = row_mask[:, None] & edge_col_mask[None, :]
        h_edge = _load_input(x_ptr, x_rows, x_stride_col, residual_ptr, r_rows, r_stride_col, residual_out_ptr,
                             out_rows, edge_cols, edge_mask, HAS_RESIDUAL)

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_COLS)
        col_mask = cols < body
        mask = row_mask[:, None] & col_mask[None, :]
        h = _load_input(x_ptr, x_body, x_stride_col, residual_ptr, r_body, r_stride_col, residual_out_ptr, out_body,
                        cols, mask, HAS_RESIDUAL)
        sum_sq = tl.sum(h * h, axis=1)
        if PHASES > 1:
            sum_sq += tl.sum(h_edge * h_edge, axis=1)
        rstd = tl.rsqrt(sum_sq / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        y = _scale_by_weight(h * rstd[:, None], w_body, cols, col_mask, input_dtype, MODE, HAS_WEIGHT)
        tl.store(y_ptr + out_body[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
        for start in range(0, body, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            mask = row_mask[:, None] & (cols < body)[None, :]
            h = _load_input(x_ptr, x_body, x_stride_col, residual_ptr, r_body, r_stride_col, residual_out_ptr,
                            out_body, cols, mask, HAS_RESIDUAL)
            sum_sq += h * h
        row_sum_sq = tl.sum(sum_sq, axis=1)
        if PHASES > 1:
            row_sum_sq += tl.sum(h_edge * h_edge, axis=1)
        rstd = tl.rsqrt(row_sum_sq / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        n_chunks = tl.cdiv(body, BLOCK_COLS)
        for chunk in range(0, n_chunks):  # backwards: see _chunk_start
            cols = _chunk_start(chunk, n_chunks, BLOCK_COLS) + tl.arange(0, BLOCK_COLS)
            col_mask = cols < body
            mask = row_mask[:, None] & col_mask[None, :]
            if HAS_RESIDUAL:
                h = _load_tile(residual_out_ptr, out_body, cols, 1, mask)
            else:
                h = _load_tile(x_ptr, x_body, cols, x_stride_col, mask)
            y = _scale_by_weight(h * rstd[:, None], w_body, cols, col_mask, input_dtype, MODE, HAS_WEIGHT)
            tl.store(y_ptr + out_body[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if PHASES > 1:
        y_edge = _scale_by_weight(h_edge * rstd[:, None], w_ptr, edge_cols, edge_col_mask, input_dtype, MODE,
                                  HAS_WEIGHT)
        tl.store(y_ptr + out_rows[:, None] + edge_cols[None, :], y_edge.to(y_ptr.dtype.element_ty), mask=edge_mask)


@triton.jit
def _weight_or_one(w_ptr, cols, col_mask, MODE: tl.constexpr, HAS_WEIGHT: tl.constexpr, CACHE: tl.constexpr):
    """The factor g = dy * factor uses: w, 1 + w (GEMMA), or 1 without a weight (fp32, per column)."""
    if HAS_WEIGHT:
        return _weight_factor(w_ptr, cols, col_mask, MODE, CACHE)
    return tl.full(cols.shape, 1.0, tl.float32)


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
        dx += _load_tile(dr_ptr, dr_rows, cols, dr_stride_col, mask)
    tl.store(dx_ptr + dx_rows[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_rows(ptr, rows, n_rows, rows_inner, stride_outer, stride_inner, stride_col, head, cols, col_mask,
               ALIGN: tl.constexpr):
    """Rows ``rows`` of a strided tensor at columns ``head + cols``, in its own dtype (rows past the end read
    nothing); ``ALIGN`` > 1 declares the columns from ``head`` on 16-byte aligned (see _at_body)."""
    offsets = _at_body(_row_offsets(rows, rows_inner, stride_outer, stride_inner), head, ALIGN)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    return tl.load(ptr + offsets[:, None] + cols[None, :] * stride_col, mask=mask, other=0.0)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr, h_ptr, rstd_ptr, w_ptr, d_residual_out_ptr, dx_ptr, dw_partial_ptr,
    n_rows, n_cols, rows_inner, eps,
    dy_stride_outer, dy_stride_inner, dy_stride_col,
    h_stride_outer, h_stride_inner, h_stride_col,
    dr_stride_outer, dr_stride_inner, dr_stride_col,
    MODE: tl.constexpr, HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, HAS_D_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, SINGLE_PASS: tl.constexpr, PREFETCH: tl.constexpr,
    ALIGN: tl.constexpr, PHASES: tl.constexpr,
):
    pid = tl.program_id(0)
    # A program keeps to the tiles of one phase (the grid is a multiple of PHASES), so its body and edge columns,
    # and with them its dw accumulators, stay put.
    phase = pid % PHASES
    program_in_phase = pid // PHASES
    programs_per_phase = tl.num_programs(0) // PHASES
    n_tiles = tl.cdiv(n_rows, BLOCK_ROWS * PHASES)  # per phase
    input_dtype = h_ptr.dtype.element_ty
    dw_row = dw_partial_ptr + pid.to(tl.int64) * n_cols
    head, body = _row_split(phase, n_cols, ALIGN, PHASES)
    w_body = w_ptr + head

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_COLS)
        col_mask = cols < body
        dw_acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
        if PHASES > 1:
            edge_cols, edge_col_mask = _edge_columns(head, body, n_cols, ALIGN)
            w_edge = _weight_or_one(w_ptr, edge_cols, edge_col_mask, MODE, HAS_WEIGHT, "")
            dw_edge_acc = tl.zeros((2 * ALIGN,), dtype=tl.float32)
        if PREFETCH:
            # The next tile's h and dy are requested before this tile's reductions and stores, so a program keeps
            # loads in flight across its whole loop (only a few programs fit per SM, since each holds a dw
            # accumulator), and the weight is loaded once. Tiles are strided (pid, pid + P, ...) and rstd is
            # recomputed: on the H200, at 16384 x 4096, contiguous tiles or reading the stored rstd (a load the
            # prefetch does not cover) each cost about 3% (118 against 114.6 us).
            first_tile = program_in_phase
            end_tile = n_tiles
            step = programs_per_phase
            w_factor = _weight_or_one(w_body, cols, col_mask, MODE, HAS_WEIGHT, "")
            rows_next = _tile_rows(first_tile, phase, BLOCK_ROWS, PHASES)
            h_next = _load_rows(h_ptr, rows_next, n_rows, rows_inner, h_stride_outer, h_stride_inner, h_stride_col,
                                head, cols, col_mask, ALIGN)
            dy_next = _load_rows(dy_ptr, rows_next, n_rows, rows_inner, dy_stride_outer, dy_stride_inner,
                                 dy_stride_col, head, cols, col_mask, ALIGN)
            if PHASES > 1:
                h_edge_next = _load_rows(h_ptr, rows_next, n_rows, rows_inner, h_stride_outer, h_stride_inner,
                                         h_stride_col, 0, edge_cols, edge_col_mask, 1)
                dy_edge_next = _load_rows(dy_ptr, rows_next, n_rows, rows_inner, dy_stride_outer, dy_stride_inner,
                                          dy_stride_col, 0, edge_cols, edge_col_mask, 1)
        else:
            # Tiles too wide to prefetch nearly fill the register file. Each program walks a contiguous run of tiles,
            # reads the forward's rstd (one block-wide reduction per row instead of two) and reloads the weight every
            # row (from L1/L2; holding it would spill): at 16384 x 16384 on 8 warps 507 us against 645 with strided
            # tiles and the statistics recomputed.
            tiles_per_program = tl.cdiv(n_tiles, programs_per_phase)
            first_tile = program_in_phase * tiles_per_program
            end_tile = tl.minimum(first_tile + tiles_per_program, n_tiles)
            step = 1
        for tile in range(first_tile, end_tile, step):
            rows = _tile_rows(tile, phase, BLOCK_ROWS, PHASES)
            if PREFETCH:
                # Both converted on arrival (see the dw term below); converting h only where it is used instead
                # changes the PTX of every prefetching tile (Triton 3.6, sm_90a).
                h_raw = h_next.to(tl.float32)
                dy_raw = dy_next.to(tl.float32)
                rows_next = _tile_rows(tile + step, phase, BLOCK_ROWS, PHASES)
                h_next = _load_rows(h_ptr, rows_next, n_rows, rows_inner, h_stride_outer, h_stride_inner,
                                    h_stride_col, head, cols, col_mask, ALIGN)
                dy_next = _load_rows(dy_ptr, rows_next, n_rows, rows_inner, dy_stride_outer, dy_stride_inner,
                                     dy_stride_col, head, cols, col_mask, ALIGN)
                if PHASES > 1:
                    h_edge = h_edge_next.to(tl.float32)
                    dy_edge = dy_edge_next.to(tl.float32)
                    h_edge_next = _load_rows(h_ptr, rows_next, n_rows, rows_inner, h_stride_outer, h_stride_inner,
                                             h_stride_col, 0, edge_cols, edge_col_mask, 1)
                    dy_edge_next = _load_rows(dy_ptr, rows_next, n_rows, rows_inner, dy_stride_outer,
                                              dy_stride_inner, dy_stride_col, 0, edge_cols, edge_col_mask, 1)
            else:
                h_raw = _load_rows(h_ptr, rows, n_rows, rows_inner, h_stride_outer, h_stride_inner, h_stride_col,
                                   head, cols, col_mask, ALIGN)
                dy_raw = _load_rows(dy_ptr, rows, n_rows, rows_inner, dy_stride_outer, dy_stride_inner,
                                    dy_stride_col, head, cols, col_mask, ALIGN)
                w_factor = _weight_or_one(w_body, cols, col_mask, MODE, HAS_WEIGHT, "")
                if PHASES > 1:
                    h_edge = _load_rows(h_ptr, rows, n_rows, rows_inner, h_stride_outer, h_stride_inner,
                                        h_stride_col, 0, edge_cols, edge_col_mask, 1).to(tl.float32)
                    dy_edge = _load_rows(dy_ptr, rows, n_rows, rows_inner, dy_stride_outer, dy_stride_inner,
                                         dy_stride_col, 0, edge_cols, edge_col_mask, 1).to(tl.float32)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            h = h_raw.to(tl.float32)
            if PHASES > 1:
                g_edge = dy_edge * w_edge[None, :]
            if PREFETCH:
                sum_sq = tl.sum(h * h, axis=1)
                if PHASES > 1:
                    sum_sq += tl.sum(h_edge * h_edge, axis=1)
                rstd = tl.rsqrt(sum_sq / n_cols + eps)
                x_hat = h * rstd[:, None]
                g = dy_raw * w_factor[None, :]
                # dy in fp32 from its arrival and the dw term formed before the reduction: 222 us at 16384 x 8192 on
                # the H200, against 259 with dy kept in bf16 and the term formed after the dx store.
                dw_term = _dw_term(dy_raw, x_hat, input_dtype, MODE)
                sum_gx = tl.sum(g * x_hat, axis=1)
                if PHASES > 1:
                    sum_gx += tl.sum(g_edge * h_edge, axis=1) * rstd
                mean_gx = sum_gx / n_cols
            else:
                # Nothing but the raw h and dy (packed bf16) and the dw accumulator stays live across the
                # reduction: the weight is loaded again after it, with an explicit .ca (the default caching) that
                # keeps the compiler from merging the two loads and holding the weight in registers. No spills on 8
                # or 16 warps at 16384 columns (ptxas, sm_90a), against 144 and 96 bytes with g held across it; on
                # the H200 at 16384 x 16384, 440 us on 16 warps against 501 (the best tile before, on 8 warps).
                rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
                sum_gh = tl.sum(dy_raw.to(tl.float32) * w_factor[None, :] * h, axis=1)
                if PHASES > 1:
                    sum_gh += tl.sum(g_edge * h_edge, axis=1)
                mean_gx = sum_gh * rstd / n_cols
                w_factor = _weight_or_one(w_body, cols, col_mask, MODE, HAS_WEIGHT, ".ca")
                x_hat = h * rstd[:, None]
                g = dy_raw.to(tl.float32) * w_factor[None, :]
            dr_rows = _row_offsets(rows, rows_inner, dr_stride_outer, dr_stride_inner)
            dx_rows = rows.to(tl.int64) * n_cols
            _store_dx(g, x_hat, rstd, mean_gx, d_residual_out_ptr, _at_body(dr_rows, head, ALIGN), dr_stride_col,
                      dx_ptr, _at_body(dx_rows, head, ALIGN), cols, mask, HAS_D_RESIDUAL)
            if PHASES > 1:
                edge_mask = row_mask[:, None] & edge_col_mask[None, :]
                x_hat_edge = h_edge * rstd[:, None]
                _store_dx(g_edge, x_hat_edge, rstd, mean_gx, d_residual_out_ptr, dr_rows, dr_stride_col, dx_ptr,
                          dx_rows, edge_cols, edge_mask, HAS_D_RESIDUAL)
                if COMPUTE_DW:
                    dw_edge_acc += tl.sum(tl.where(edge_mask, _dw_term(dy_edge, x_hat_edge, input_dtype, MODE), 0.0),
                                          axis=0)
            if COMPUTE_DW:
                if not PREFETCH:
                    dw_term = _dw_term(dy_raw, x_hat, input_dtype, MODE)
                if BLOCK_ROWS > 1:
                    dw_term = tl.where(mask, dw_term, 0.0)  # with eps = 0 a padded row's x_hat is NaN
                dw_acc += dw_term
        if COMPUTE_DW:
            tl.store(dw_row + head + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
            if PHASES > 1:
                tl.store(dw_row + edge_cols, dw_edge_acc, mask=edge_col_mask)
    else:
        tl.static_assert(PHASES == 1, "chunked rows take no edge tile: the host passes PHASES 1")
        # This program owns dw_partial[pid]; zero it before accumulating chunk by chunk.
        if COMPUTE_DW:
            for start in range(0, n_cols, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                tl.store(dw_row + cols, tl.zeros((BLOCK_COLS,), dtype=tl.float32), mask=cols < n_cols)
        n_chunks = tl.cdiv(body, BLOCK_COLS)
        for tile in range(program_in_phase, n_tiles, programs_per_phase):
            rows = _tile_rows(tile, phase, BLOCK_ROWS, PHASES)
            row_mask = rows < n_rows
            dy_rows = _at_body(_row_offsets(rows, rows_inner, dy_stride_outer, dy_stride_inner), head, ALIGN)
            h_rows = _at_body(_row_offsets(rows, rows_inner, h_stride_outer, h_stride_inner), head, ALIGN)
            dr_rows = _at_body(_row_offsets(rows, rows_inner, dr_stride_outer, dr_stride_inner), head, ALIGN)
            dx_rows = _at_body(rows.to(tl.int64) * n_cols, head, ALIGN)
            # Pass 1: the row statistic sum(g * h); rstd is the forward's.
            sum_gh = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
            for start in range(0, body, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                col_mask = cols < body
                mask = row_mask[:, None] & col_mask[None, :]
                h = _load_tile(h_ptr, h_rows, cols, h_stride_col, mask)
                g = _load_tile(dy_ptr, dy_rows, cols, dy_stride_col, mask)
                g = g * _weight_or_one(w_ptr, cols, col_mask, MODE, HAS_WEIGHT, "")[None, :]
                sum_gh += g * h
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            mean_gx = tl.sum(sum_gh, axis=1) * rstd / n_cols
            # Pass 2: dx, and this program's share of dw; backwards, starting on the chunks pass 1 read last, the
            # likeliest to be still in L2 (see _chunk_start).
            for chunk in range(0, n_chunks):
                cols = _chunk_start(chunk, n_chunks, BLOCK_COLS) + tl.arange(0, BLOCK_COLS)
                col_mask = cols < body
                mask = row_mask[:, None] & col_mask[None, :]
                h = _load_tile(h_ptr, h_rows, cols, h_stride_col, mask)
                dy = _load_tile(dy_ptr, dy_rows, cols, dy_stride_col, mask)
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


def _row_strides(layout):
    rows_inner, stride_outer, stride_inner, stride_col = layout
    return stride_outer, stride_inner, stride_col


def _row_alignment(tensors, layouts, n_rows, n_cols, split):
    """The kernels' ``(ALIGN, PHASES)`` for ``tensors`` of ``n_rows`` rows of ``n_cols`` elements, described by
    ``layouts`` (contiguous outputs too, with the inputs' ``rows_inner``).

    (1, 1) when Triton itself proves every row 16-byte aligned (row strides and length multiples of 16 elements)
    or when nothing can be (mixed element sizes, a column stride, data off a 16-byte boundary); (elements per 16
    bytes, 1) when every row starts on a 16-byte boundary anyway (bf16 rows of 5000); with ``split`` allowed,
    (elements per 16 bytes, phases) when every row starts as far from a boundary as in a contiguous tensor (bf16
    rows of 4095). See the module docstring."""
    strides = [n_cols] + [stride for layout in layouts for stride in layout[1:3]]
    if all(stride % 16 == 0 for stride in strides):
        return 1, 1
    element_size = tensors[0].element_size()
    align = 16 // element_size
    if align == 1 or any(t.element_size() != element_size or t.data_ptr() % 16 for t in tensors) or any(
            layout[3] != 1 for layout in layouts):
        return 1, 1

    def starts_at_multiples_of(step):
        """Whether row r of every tensor starts at r * step elements modulo ``align`` (strides that no row uses
        are left out)."""
        return all((rows_inner == 1 or (inner - step) % align == 0)
                   and (rows_inner >= n_rows or (outer - rows_inner * step) % align == 0)
                   for rows_inner, outer, inner, _ in layouts)

    if n_cols % align == 0 and starts_at_multiples_of(0):
        return align, 1
    if split and starts_at_multiples_of(n_cols):
        return align, align // math.gcd(n_cols, align)
    return 1, 1


def rms_norm_forward(x, x_layout, weight, residual, residual_layout, y, residual_out, rstd, n_rows, n_cols, eps,
                     mode, *, block_rows, block_cols, num_warps):
    """Launch the forward kernel.

    ``x_layout``/``residual_layout`` are ``(rows_inner, stride_outer, stride_inner, stride_col)`` (see the module
    docstring; both tensors share ``rows_inner``). ``y`` and ``residual_out`` are contiguous outputs, ``rstd`` a
    contiguous fp32 output of ``n_rows`` elements (the backward's input); ``residual``/``residual_out``/``weight``
    may be None.
    """
    rows_inner = x_layout[0]
    r_strides = _row_strides(residual_layout) if residual is not None else (0, 0, 0)
    output_layout = (rows_inner, rows_inner * n_cols, n_cols, 1)
    tensors, layouts = [x, y], [x_layout, output_layout]
    if residual is not None:
        tensors, layouts = tensors + [residual, residual_out], layouts + [residual_layout, output_layout]
    align, phases = _row_alignment(tensors, layouts, n_rows, n_cols, split=True)
    launch(
        _rms_norm_forward_kernel, (cdiv(n_rows, block_rows * phases) * phases,),
        (x, residual if residual is not None else x, weight if weight is not None else x, y,
         residual_out if residual_out is not None else y, rstd,
         n_rows, n_cols, rows_inner, eps, *_row_strides(x_layout), *r_strides),
        dict(MODE=MODE_IDS[mode], HAS_WEIGHT=weight is not None, HAS_RESIDUAL=residual is not None,
             BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, SINGLE_PASS=block_cols >= n_cols, ALIGN=align,
             PHASES=phases),
        num_warps)


def rms_norm_backward(dy, dy_layout, h, h_layout, rstd, weight, d_residual_out, d_residual_layout, dx, dw, n_rows,
                      n_cols, eps, mode, *, block_rows, block_cols, num_warps, num_programs):
    """Launch the backward: dx always (contiguous output), dw when ``dw`` is given (shape ``(n_cols,)``).

    ``h`` is the normalised input (``x``, or ``x + residual`` for the fused form) and ``rstd`` the forward's
    (contiguous fp32, ``n_rows`` elements); ``d_residual_out`` is the gradient reaching the fused form's residual
    output, added to dx. ``num_programs`` sizes the persistent grid.
    """
    rows_inner = h_layout[0]
    if dy_layout[0] != rows_inner or (d_residual_out is not None and d_residual_layout[0] != rows_inner):
        raise ValueError("dy, h and d_residual_out must share the row grouping (rows_inner)")
    single_pass = block_cols >= n_cols
    tensors, layouts = [dy, h, dx], [dy_layout, h_layout, (rows_inner, rows_inner * n_cols, n_cols, 1)]
    if d_residual_out is not None:
        tensors, layouts = tensors + [d_residual_out], layouts + [d_residual_layout]
    # Rows too long for one block are not split (the chunked pass takes no edge tile).
    align, phases = _row_alignment(tensors, layouts, n_rows, n_cols, split=single_pass)
    # A whole number of programs per phase (see the kernel).
    num_programs = phases * max(1, min(cdiv(num_programs, phases), cdiv(n_rows, block_rows * phases)))
    dw_partial = torch.empty((num_programs, n_cols), device=h.device, dtype=torch.float32) if dw is not None else h
    dr_strides = _row_strides(d_residual_layout) if d_residual_out is not None else (0, 0, 0)
    launch(
        _rms_norm_backward_kernel, (num_programs,),
        (dy, h, rstd, weight if weight is not None else h, d_residual_out if d_residual_out is not None else dy,
         dx, dw_partial, n_rows, n_cols, rows_inner, eps,
         *_row_strides(dy_layout), *_row_strides(h_layout), *dr_strides),
        dict(MODE=MODE_IDS[mode], HAS_WEIGHT=weight is not None, COMPUTE_DW=dw is not None,
             HAS_D_RESIDUAL=d_residual_out is not None,
             BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, SINGLE_PASS=single_pass,
             PREFETCH=single_pass and block_rows * block_cols <= PREFETCH_MAX_TILE, ALIGN=align, PHASES=phases),
        num_warps)
    if dw is not None:
        # Narrow strips and tall tiles: enough programs, and enough bytes in flight per program, that summing
        # a few thousand partial rows stays cheap next to the main kernel.
        strip = min(32, next_power_of_2(n_cols))
        launch(_column_sum_kernel, (cdiv(n_cols, strip),), (dw_partial, dw, num_programs, n_cols),
               dict(BLOCK_ROWS=128, BLOCK_COLS=strip), 8)
