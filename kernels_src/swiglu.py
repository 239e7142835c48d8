"""Gated activations (the GLU family of LLM MLPs): out = act(gate) * up, forward and backward.

``act`` (``ACTIVATION``, a compile-time switch) is SiLU (SwiGLU), the exact erf GELU or the tanh-approximated
GELU (GeGLU). Math runs in fp32 on values loaded in the input dtype; each output is rounded once, to its
tensor's dtype.

Shapes. ``gate`` and ``up`` are read as ``n_rows`` rows of ``n_cols`` elements, each through its own strides:
row ``r`` starts at ``(r // rows_inner) * stride_outer + (r % rows_inner) * stride_inner`` and element ``c`` of
a row sits at ``c * stride_col`` (the layouts of ``fused_kernels/_layout.py``). A fused ``gate_up`` tensor,
whose last dimension holds ``[gate | up]``, is not a special case: its halves are two views with the same
strides whose base pointers lie ``n_cols`` elements apart. Outputs are written at ``row * out_stride_row +
col``, so the backward can write ``d_gate`` and ``d_up`` straight into the two halves of one ``(..., 2 * I)``
gradient (``out_stride_row = 2 * I``). Row offsets are int64, so tensors past 2**31 elements are fine.

Grid. One program per ``(BLOCK_ROWS, BLOCK_COLS)`` tile, flattened to one grid axis (row blocks can outnumber
the 65535 limit of the other axes); consecutive programs take consecutive tiles of a row, so neighbouring
programs stream neighbouring memory. Triton specialises a column stride of 1 and 16-byte aligned pointers and
row strides, which is what lets the common layouts use 16-byte vector loads and stores.

Backward. ``d_up = dout * act(gate)`` and ``d_gate = dout * up * act'(gate)``; ``act`` is recomputed from
``gate``, so nothing but the inputs is kept for the backward. With ``STORE_PRODUCT`` the backward also writes the
forward's output ``act(gate) * up`` over ``dout``, each element where it was read: an MLP whose backward needs that
product (for the down projection's weight gradient) and owns ``dout`` then gets it from the same pass instead of
a second one that reads gate and up again.
"""

import triton
import triton.language as tl

from ._launch import cdiv, launch

# Compile-time activation switch (globals read inside @triton.jit must be tl.constexpr).
SILU = tl.constexpr(0)
GELU = tl.constexpr(1)
GELU_TANH = tl.constexpr(2)
ACTIVATION_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}

SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 * pi)
# tanh-GELU: 0.5 * (1 + tanh(u)) = sigmoid(2u), with 2u = TANH_SCALE * (g + TANH_CUBIC * g**3).
TANH_SCALE = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)
TANH_CUBIC = tl.constexpr(0.044715)


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """act(g) and act'(g) for fp32 g (the forward drops the derivative; the compiler removes its math)."""
    if ACTIVATION == GELU:
        cdf = 0.5 * (1.0 + tl.erf(g * SQRT_HALF))
        return g * cdf, cdf + g * tl.exp(-0.5 * g * g) * INV_SQRT_2PI
    # SiLU and tanh-GELU are both g * sigmoid(z(g)), so they share act' = s + g * s * (1 - s) * z'(g):
    # one sigmoid, and no tanh whose 1 - tanh**2 would cancel.
    if ACTIVATION == SILU:
        s = tl.sigmoid(g)
        act = g * s
        return act, s + act * (1.0 - s)
    # Tensors first in products with the constexpr constants: the interpreter keeps `constexpr * tensor` a
    # constexpr, which tl.sigmoid then rejects.
    g2 = g * g
    s = tl.sigmoid((g + g2 * g * TANH_CUBIC) * TANH_SCALE)
    act = g * s
    return act, s + act * (1.0 - s) * ((g2 * (3.0 * TANH_CUBIC) + 1.0) * TANH_SCALE)


@triton.jit
def _tile(n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """This program's row and column indices, and the in-bounds mask of its tile."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(n_cols, BLOCK_COLS)
    rows = (pid // col_blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = (pid % col_blocks) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    return rows, cols, (rows < n_rows)[:, None] & (cols < n_cols)[None, :]


@triton.jit
def _offsets(rows, cols, rows_inner, stride_outer, stride_inner, stride_col):
    """Element offsets of a tile of a strided tensor. Column offsets are int64 too: a column stride (a transposed
    view) times the row length can pass 2**31."""
    rows = rows.to(tl.int64)
    row_offsets = (rows // rows_inner) * stride_outer + (rows % rows_inner) * stride_inner
    return row_offsets[:, None] + cols.to(tl.int64)[None, :] * stride_col


@triton.jit
def _load(ptr, rows, cols, rows_inner, stride_outer, stride_inner, stride_col, mask):
    """A tile of a strided input, as fp32."""
    offsets = _offsets(rows, cols, rows_inner, stride_outer, stride_inner, stride_col)
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, rows, cols, stride_row, value, mask):
    tl.store(ptr + rows.to(tl.int64)[:, None] * stride_row + cols[None, :], value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_forward_kernel(
    gate_ptr, up_ptr, out_ptr,
    n_rows, n_cols, rows_inner,
    g_stride_outer, g_stride_inner, g_stride_col,
    u_stride_outer, u_stride_inner, u_stride_col,
    out_stride_row,
    ACTIVATION: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    g = _load(gate_ptr, rows, cols, rows_inner, g_stride_outer, g_stride_inner, g_stride_col, mask)
    u = _load(up_ptr, rows, cols, rows_inner, u_stride_outer, u_stride_inner, u_stride_col, mask)
    act, _ = _activation(g, ACTIVATION)
    _store(out_ptr, rows, cols, out_stride_row, act * u, mask)


@triton.jit
def _gated_backward_kernel(
    dout_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr,
    n_rows, n_cols, rows_inner,
    dy_stride_outer, dy_stride_inner, dy_stride_col,
    g_stride_outer, g_stride_inner, g_stride_col,
    u_stride_outer, u_stride_inner, u_stride_col,
    d_stride_row,
    ACTIVATION: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, STORE_PRODUCT: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    dy_offsets = _offsets(rows, cols, rows_inner, dy_stride_outer, dy_stride_inner, dy_stride_col)
    dy = tl.load(dout_ptr + dy_offsets, mask=mask, other=0.0).to(tl.float32)
    g = _load(gate_ptr, rows, cols, rows_inner, g_stride_outer, g_stride_inner, g_stride_col, mask)
    u = _load(up_ptr, rows, cols, rows_inner, u_stride_outer, u_stride_inner, u_stride_col, mask)
    act, d_act = _activation(g, ACTIVATION)
    _store(d_gate_ptr, rows, cols, d_stride_row, dy * u * d_act, mask)
    _store(d_up_ptr, rows, cols, d_stride_row, dy * act, mask)
    if STORE_PRODUCT:  # over dout, where this program alone has read it (see the module docstring)
        tl.store(dout_ptr + dy_offsets, (act * u).to(dout_ptr.dtype.element_ty), mask=mask)


def _grid(n_rows, n_cols, block_rows, block_cols):
    return (cdiv(n_rows, block_rows) * cdiv(n_cols, block_cols),)


def _gapless(layout, n_rows, n_cols):
    """Whether rows of this ``(rows_inner, stride_outer, stride_inner, stride_col)`` layout follow each other in
    memory without gaps, as in a contiguous tensor."""
    rows_inner, stride_outer, stride_inner, stride_col = layout
    return (stride_col == 1 and (rows_inner == 1 or stride_inner == n_cols)
            and (rows_inner >= n_rows or stride_outer == rows_inner * n_cols))


def _one_row_launch(layouts, out_stride_row, n_rows, n_cols, block_rows, block_cols, one_row):
    """(layouts, out_stride_row, n_rows, n_cols, block_rows, block_cols) of the launch.

    Triton knows a row stride is a multiple of 16 elements, or nothing about it: rows of, say, 1000 or 3000
    elements then move 2 bytes per access. When every tensor is gapless (and so is the output, row stride
    ``n_cols``), their rows are read as one long row instead, in tiles of as many elements as the launch table's:
    on the H200, 4096 x 3000 bf16 forward 26.9 -> 18.9 us, backward 38.8 -> 31.1, 4096 x 1000 forward 7.6 -> 4.9.
    Only when that row's length is a multiple of 16 too (its masked tail tile keeps whole vectors) and its column
    index fits int32. Rows that are multiples of 16 keep their launch unless the entry sets ``one_row``: a row of
    11008 elements is 5.4 tiles of 2048, and the last tile of every row runs mostly masked. H200 forward, bf16, CUDA
    graphs, the H200 entry's tile (1 x 2048 on 8 warps) as one long row against row by row, medians of six timings
    over three allocations (us): 1024 x 11008 16.9 against 17.5 (torch.compile 16.8), 4096 x 11008 63.6 against 67.6
    (63.5), 16384 x 11008 247.5 against 278.1 (247.8; row by row it took 252-278 depending on where the tensors lay,
    one long row 247-248, which is how a single earlier probe saw the opposite), 16384 x 14336 322.9 against 338.5
    (Liger 324.9); level at 4096 x 4096, 16384 x 4096 and 16384 x 2560 with 1 x 1024 tiles on 2 warps (within 0.2 us),
    4.9 against 5.4 at 1024 x 4096. The backward keeps its rows: there one long row measured level at every benchmark
    shape (within 0.3%; its row-by-row times did not move with the tensors' placement)."""
    total = n_rows * n_cols
    if ((n_cols % 16 == 0 and not one_row) or total % 16 or total + block_rows * block_cols >= 2**31
            or out_stride_row != n_cols or not all(_gapless(layout, n_rows, n_cols) for layout in layouts)):
        return layouts, out_stride_row, n_rows, n_cols, block_rows, block_cols
    return [(1, 0, 0, 1)] * len(layouts), total, 1, total, 1, block_rows * block_cols


def gated_forward(gate, gate_layout, up, up_layout, out, out_stride_row, n_rows, n_cols, activation, *,
                  block_rows, block_cols, num_warps, one_row=False):
    """Launch the forward: ``out[r, c] = act(gate[r, c]) * up[r, c]``.

    ``gate_layout``/``up_layout`` are ``(rows_inner, stride_outer, stride_inner, stride_col)`` with a common
    ``rows_inner``; ``out`` has unit column stride and row stride ``out_stride_row``. ``one_row``: see
    ``_one_row_launch``.
    """
    if gate_layout[0] != up_layout[0]:
        raise ValueError("gate and up must share the row grouping (rows_inner)")
    (gate_layout, up_layout), out_stride_row, n_rows, n_cols, block_rows, block_cols = _one_row_launch(
        (gate_layout, up_layout), out_stride_row, n_rows, n_cols, block_rows, block_cols, one_row)
    launch(_gated_forward_kernel, _grid(n_rows, n_cols, block_rows, block_cols),
           (gate, up, out), (n_rows, n_cols, gate_layout[0], *gate_layout[1:], *up_layout[1:], out_stride_row),
           dict(ACTIVATION=ACTIVATION_IDS[activation], BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols), num_warps)


def gated_backward(dout, dout_layout, gate, gate_layout, up, up_layout, d_gate, d_up, d_stride_row, n_rows, n_cols,
                   activation, *, block_rows, block_cols, num_warps, product_into_dout=False):
    """Launch the backward: ``d_gate`` and ``d_up`` (unit column stride, row stride ``d_stride_row``; for a fused
    input, the two halves of one gradient tensor). ``product_into_dout``: also overwrite ``dout`` with the forward's
    output ``act(gate) * up``, in ``dout``'s dtype."""
    if not dout_layout[0] == gate_layout[0] == up_layout[0]:
        raise ValueError("dout, gate and up must share the row grouping (rows_inner)")
    (dout_layout, gate_layout, up_layout), d_stride_row, n_rows, n_cols, block_rows, block_cols = _one_row_launch(
        (dout_layout, gate_layout, up_layout), d_stride_row, n_rows, n_cols, block_rows, block_cols, False)
    launch(_gated_backward_kernel, _grid(n_rows, n_cols, block_rows, block_cols),
           (dout, gate, up, d_gate, d_up), (n_rows, n_cols, gate_layout[0], *dout_layout[1:], *gate_layout[1:],
            *up_layout[1:], d_stride_row),
           dict(ACTIVATION=ACTIVATION_IDS[activation], BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
                STORE_PRODUCT=product_into_dout), num_warps)
