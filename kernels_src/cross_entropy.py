"""Cross-entropy over rows of logits: loss, log-sum-exp and the logits gradient, in fp32 whatever the input dtype.

Per row (token) with target ``y``, raw logits ``z_c`` (``c < V``), class weights ``w`` (all 1 without weights,
``W = sum_c w_c``), label smoothing ``eps``, z-loss scale ``s`` and optional soft-capping
``x_c = cap * tanh(z_c / cap)`` (``x = z`` without it):

  lse   = log sum_c exp(x_c)
  ce    = (1 - eps) * w_y * (lse - x_y) + (eps / V) * (W * lse - sum_c w_c * x_c)
  loss  = r * (ce + s * lse**2)       r = 1 / D under reduction "mean" (D = sum of w_y over counted rows; r = 0 where
                                      D = 0), else 1
  dloss/dz_c = r * g * ((1 - eps) * w_y * (p_c - [c == y]) + (eps * W / V + 2 * s * lse) * p_c - eps * w_c / V)
               * (1 - (x_c / cap)**2 with soft-capping)

with ``p = softmax(x)`` and ``g`` the incoming gradient of the row's loss. This is torch's cross_entropy with
``weight`` and ``label_smoothing`` (whose "mean" also divides by the sum of the targets' weights), plus the
z-loss, which is not class-weighted. Rows whose target is ``ignore_index`` get loss 0 and a zero gradient and
are not counted in D. A target outside ``[0, V)`` that is not ``ignore_index`` is never used as an address
(its loads are masked): that row's loss and gradient are NaN, so the bad label shows in the loss without a
host synchronisation.

``_cross_entropy_kernel`` runs one program per row and walks the row in ``BLOCK_COLS`` chunks:
  pass 1 (LOSS_PASS): an online log-sum-exp (running max, rescaled sum; one exp per element) and, with label
    smoothing, ``sum_c w_c * (max - x_c)`` (non-negative terms, so nothing cancels); then stores the row's
    loss (and z-loss), and its row statistics ``(max_c x_c, log sum_c exp(x_c - max))`` for a later backward;
  pass 2 (GRAD_PASS): re-reads the row from its end backwards (what pass 1 read last may still be in L2) and
    writes the gradient in the logits dtype. Without LOSS_PASS it reads the row statistics the forward stored.
Rows whose starts Triton cannot prove 16-byte aligned (a row length or stride that is not a multiple of 16
elements, GPT-2's 50257 classes) would move 2 or 4 bytes per access; with ``ALIGN`` > 1 each row is split into a
"body" of whole 16-byte vectors, from the row's first 16-byte boundary, which the blocks stream, and an edge tile of
the few columns before and after it. Both passes issue each block's load one iteration ahead, so a program's next
block is in flight while it reduces or writes the current one: with one program per row the row kernel at 8192 x
151936 on the H200 went from 1905 us (2048-column blocks, 4 warps) to 1859 us (8192-column blocks, 8 warps; 2048 x 4
warps stayed at 1905).
lse is kept as its two parts, and p_c = exp((x_c - max) - log_sum): with logits of magnitude 1e4, lse itself is
rounded to the ulp of the max (1e-3), which would be a 1e-3 relative error in every p_c.
The gradient may be written into the logits buffer itself (each element is read before it is written, by the
same program), which is how fused linear cross-entropy keeps one chunk buffer. ``g`` comes from
``grad_out_ptr`` (per row, or one value with stride 0) or is 1 when the gradient is written during the forward.
The gradient pass alone may also run over a column slice ``[col_start, col_start + n_cols)`` of rows of
``n_classes`` classes (the lse then comes from an earlier loss pass over whole rows): the vocabulary-sliced fused
linear cross-entropy computes its logits one vocabulary slice at a time. Offsets are int64, so ``rows * V``
beyond 2**31 is fine.

``_loss_constants_kernel`` computes on the device, in one program, D (the "mean" denominator) and W, so no
host synchronisation is needed. ``_scale_kernel`` multiplies a gradient computed during the forward by the
incoming gradient in place, and exits at once when that gradient is exactly 1 (``loss.backward()``).
"""

import triton
import triton.language as tl

from ._launch import INTERPRETING, cdiv, launch

INTERPRETED = tl.constexpr(INTERPRETING)  # globals read inside @triton.jit must be tl.constexpr


@triton.jit
def _rounded_product(a, b):
    """``a * b`` in fp32, rounded even where an add follows. The compiler fuses a plain product into the subtraction
    after it (one fma, the product never rounded): with soft-capping, ``x - max`` and ``max - x_y`` were then not 0
    at the max, which left up to half an ulp of the max in the target's ``p - 1`` and in the loss of rows whose
    target is the max (H200: 5e-5 relative error in the loss of one-class rows, 3e-4 in their gradient). PTX's
    ``mul.rn`` is never fused; the CPU interpreter, which cannot run PTX, fuses nothing."""
    if INTERPRETED:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _soft_cap(z, softcap, HAS_SOFTCAP: tl.constexpr):
    """(x, tanh(z / cap)): the capped logits in fp32 and the tanh the gradient needs (unused without capping)."""
    t = z
    if HAS_SOFTCAP:
        # tanh(u) = 1 - 2 / (exp(2u) + 1): saturates to +-1 without overflow (exp gives inf or 0). Near 0 it keeps
        # the absolute precision of the 1 it subtracts from (~6e-8, so ~6e-8 * cap in x), not a relative one: an
        # odd polynomial below |u| = 0.55 (relative error 1.1e-7) made Gemma-2's loss (cap 30) 31% slower on the
        # H200 (8192 x 256000 bf16, forward+backward 5254 -> 6916 us: this path is bound by its arithmetic).
        t = 1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0)
        z = _rounded_product(t, softcap)
    return z, t


@triton.jit
def _absorb(z, cols, mask, running_max, running_sum, gap_sum, seen_weight, shift, weight_ptr, softcap,
            HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """The loss pass's online log-sum-exp (and label smoothing's weighted gap sum) after one more tile of logits
    ``z`` at columns ``cols`` (``mask``: which are in the row)."""
    x, _ = _soft_cap(z.to(tl.float32), softcap, HAS_SOFTCAP)
    x = tl.where(mask, x, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(x, axis=0))
    # While every logit so far is -inf, subtract 0 instead of -inf (exp(-inf - -inf) would be NaN).
    new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    running_sum = running_sum * tl.exp(running_max - new_shift) + tl.sum(tl.exp(x - new_shift), axis=0)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            w = tl.where(mask, 1.0, 0.0)
        gap_sum += seen_weight * (new_shift - shift)
        gap_sum += tl.sum(tl.where(mask, w * (new_shift - x), 0.0), axis=0)
        seen_weight += tl.sum(w, axis=0)
    return new_max, running_sum, gap_sum, seen_weight, new_shift


@triton.jit
def _store_gradient(z, cols, mask, d_ptrs, y, col_start, row_max, log_sum, ignored, coef_y, coef_s, coef_z, coef_c,
                    weight_ptr, softcap, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                    HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Write d(loss)/d(logits) of one tile of logits ``z`` at columns ``cols`` of the slice to ``d_ptrs``."""
    x, t = _soft_cap(z.to(tl.float32), softcap, HAS_SOFTCAP)
    p = tl.exp((x - row_max) - log_sum)
    dx = coef_y * tl.where(col_start + cols == y, p - 1.0, p)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w_c = tl.load(weight_ptr + col_start + cols, mask=mask, other=0.0).to(tl.float32)
            dx += coef_s * p - coef_c * w_c
        else:
            dx += coef_s * p - coef_c
    if HAS_Z_LOSS:
        dx += coef_z * p
    if HAS_SOFTCAP:
        dx *= 1.0 - t * t
    dx = tl.where(ignored, 0.0, dx)
    tl.store(d_ptrs, dx.to(d_ptrs.dtype.element_ty), mask=mask)


# col_start is not specialised: Triton 3.6 on the H200 compiled a one-column slice starting at column 1 (n_cols and
# col_start both specialised to the constant 1) as if it started at column 0, giving that column the target's
# gradient (found by the fused linear cross-entropy property test; tests/test_fused_linear_cross_entropy.py).
@triton.jit(do_not_specialize=["col_start"])
def _cross_entropy_kernel(
    logits_ptr, target_ptr, weight_ptr, constants_ptr, grad_out_ptr, loss_ptr, z_loss_ptr, row_stats_ptr,
    dlogits_ptr, n_cols, n_classes, col_start, logits_stride_row, logits_stride_col, dlogits_stride_row,
    grad_out_stride, ignore_index, label_smoothing, lse_square_scale, softcap,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    MEAN: tl.constexpr, LOSS_PASS: tl.constexpr, STORE_Z_LOSS: tl.constexpr, GRAD_PASS: tl.constexpr,
    HAS_GRAD_OUT: tl.constexpr, BLOCK_COLS: tl.constexpr, ALIGN: tl.constexpr,
):
    # One program per row. (A capped grid of programs walking rows, so that the gradient pass re-reads each row
    # from L2, measured 1.2-1.6x slower on the H200 at every cap from 1 to 8 programs per SM; with this kernel's
    # loads issued a block ahead, 1.09-1.59x at 1-4 per SM: 2016 us at best against 1855, 8192 x 151936 bf16.)
    row = tl.program_id(0).to(tl.int64)
    row_offset = row * logits_stride_row
    row_ptr = logits_ptr + row_offset
    d_row_ptr = dlogits_ptr + row * dlogits_stride_row
    # The blocks cover the row's "body" [head, head + body): with ALIGN > 1 (elements per 16 bytes, for rows whose
    # starts Triton cannot prove 16-byte aligned), the columns from the first 16-byte boundary on, in whole 16-byte
    # vectors, so that its loads and stores stay 16 bytes wide; the edge tile below takes the columns before and
    # after. With ALIGN 1 the body is the whole row.
    if ALIGN > 1:
        # int32, so that the column offsets below stay 32-bit (int64 ones cost 159 instead of 80 registers).
        to_boundary = ((ALIGN - row_offset % ALIGN) % ALIGN).to(tl.int32)
        head = tl.minimum(to_boundary, n_cols)
        body = tl.multiple_of(((n_cols - head) // ALIGN) * ALIGN, ALIGN)
        # At the boundary even when the row ends before it (the body is then empty): the hints stay true.
        body_ptr = logits_ptr + tl.multiple_of(row_offset + to_boundary, ALIGN)
        d_body_ptr = dlogits_ptr + tl.multiple_of(row * dlogits_stride_row + to_boundary, ALIGN)
    else:
        head = 0
        body = n_cols
        body_ptr = row_ptr
        d_body_ptr = d_row_ptr
    y = tl.load(target_ptr + row).to(tl.int64)
    ignored = y == ignore_index
    in_range = (y >= 0) & (y < n_classes)
    counted = in_range & (y != ignore_index)
    y_safe = tl.where(counted, y, 0)
    if HAS_WEIGHT:
        w_y = tl.load(weight_ptr + y_safe).to(tl.float32)
        if HAS_SMOOTHING:
            weight_sum = tl.load(constants_ptr + 1)
        else:
            weight_sum = 0.0
    else:
        w_y = 1.0
        weight_sum = n_classes * 1.0
    r = 1.0
    if MEAN:
        r = tl.load(constants_ptr)  # 1 / D, or 0 (see _loss_constants_kernel)
    smoothing_per_class = label_smoothing / n_classes
    # Rows that are not counted read no logits: pass 1 does not run for them, pass 2 masks every load.
    n_read = tl.where(counted, body, 0)
    if ALIGN > 1:
        # The edge tile: lanes [0, ALIGN) take the columns before the body, lanes [ALIGN, 2 ALIGN) those after it.
        lanes = tl.arange(0, 2 * ALIGN)
        edge_cols = tl.where(lanes < ALIGN, lanes, head + body + lanes - ALIGN)
        edge_mask = ((lanes < ALIGN) & (lanes < head)) | ((lanes >= ALIGN) & (edge_cols < n_cols))
        # Not `edge_mask & counted`: the interpreter turns a block & a scalar into int32, which tl.load rejects.
        edge_read = edge_mask & (lanes < tl.where(counted, 2 * ALIGN, 0))
        z_edge = tl.load(row_ptr + edge_cols * logits_stride_col, mask=edge_read, other=0.0)

    if LOSS_PASS:
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.full((), 0.0, tl.float32)
        # Label smoothing needs sum_c w_c * (lse - x_c) = sum_c w_c * (max - x_c) + W * log(sum): kept as a sum
        # of non-negative terms measured from the current shift, never as W * lse - sum_c w_c * x_c, which
        # cancels catastrophically when the logits are large or the vocabulary tiny.
        gap_sum = tl.full((), 0.0, tl.float32)
        seen_weight = tl.full((), 0.0, tl.float32)
        shift = tl.full((), 0.0, tl.float32)
        if ALIGN > 1:
            running_max, running_sum, gap_sum, seen_weight, shift = _absorb(
                z_edge, edge_cols, edge_read, running_max, running_sum, gap_sum, seen_weight, shift, weight_ptr,
                softcap, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP)
        # Each block's load is issued one iteration ahead, so the row keeps streaming while a block is reduced.
        first = tl.arange(0, BLOCK_COLS)
        z_next = tl.load(body_ptr + first * logits_stride_col, mask=first < n_read, other=0.0)
        for start in range(0, n_read, BLOCK_COLS):
            offsets = start + tl.arange(0, BLOCK_COLS)
            z = z_next.to(tl.float32)
            ahead = offsets + BLOCK_COLS
            z_next = tl.load(body_ptr + ahead * logits_stride_col, mask=ahead < n_read, other=0.0)
            running_max, running_sum, gap_sum, seen_weight, shift = _absorb(
                z, head + offsets, offsets < body, running_max, running_sum, gap_sum, seen_weight, shift, weight_ptr,
                softcap, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP)
        # Rows that are not counted read nothing: give them lse 0 rather than log(0), which keeps -inf and NaN
        # out of their (discarded) arithmetic.
        row_max = shift
        log_sum = tl.log(tl.where(counted, running_sum, 1.0))
        lse = row_max + log_sum
        x_y, _ = _soft_cap(tl.load(row_ptr + y_safe * logits_stride_col, mask=counted, other=0.0).to(tl.float32),
                           softcap, HAS_SOFTCAP)
        # lse - x_y as (max - x_y) + log(sum): with logits of magnitude 1e4, max - x_y is exact and the small
        # log(sum) is not rounded to the ulp of the max first.
        ce = (1.0 - label_smoothing) * w_y * ((row_max - x_y) + log_sum)
        if HAS_SMOOTHING:
            ce += smoothing_per_class * (gap_sum + seen_weight * log_sum)
        z_loss = 0.0
        if HAS_Z_LOSS:
            z_loss = lse_square_scale * lse * lse
        loss = tl.where(ignored, 0.0, tl.where(counted, r * (ce + z_loss), float("nan")))
        tl.store(loss_ptr + row, loss)
        if STORE_Z_LOSS:
            tl.store(z_loss_ptr + row, tl.where(ignored, 0.0, tl.where(counted, r * z_loss, float("nan"))))
        tl.store(row_stats_ptr + 2 * row, row_max)
        tl.store(row_stats_ptr + 2 * row + 1, log_sum)
    else:
        row_max = tl.load(row_stats_ptr + 2 * row)
        log_sum = tl.load(row_stats_ptr + 2 * row + 1)
        lse = row_max + log_sum

    if GRAD_PASS:
        g = 1.0
        if HAS_GRAD_OUT:
            g = tl.load(grad_out_ptr + row * grad_out_stride).to(tl.float32)
        scale = r * g
        # The target's term is coef_y * (p - 1), computed as written: p - 1 is exact near p = 1, where a
        # confident prediction's small gradient would otherwise be lost to cancellation.
        coef_y = scale * (1.0 - label_smoothing) * w_y
        # Smoothing and z-loss terms stay separate, so each cancels only against its own kind, as in autograd.
        coef_s = scale * smoothing_per_class * weight_sum
        coef_z = scale * 2.0 * lse_square_scale * lse
        coef_c = scale * smoothing_per_class
        # An out-of-range target poisons its row's gradient (see the module docstring).
        coef_y = tl.where(ignored | counted, coef_y, float("nan"))
        if ALIGN > 1:
            _store_gradient(z_edge, edge_cols, edge_mask, d_row_ptr + edge_cols, y, col_start, row_max, log_sum,
                            ignored, coef_y, coef_s, coef_z, coef_c, weight_ptr, softcap, HAS_WEIGHT, HAS_SMOOTHING,
                            HAS_Z_LOSS, HAS_SOFTCAP)
        # From the body's end backwards (what the loss pass read last may still be in L2), one block ahead.
        last_start = (tl.cdiv(body, BLOCK_COLS) - 1) * BLOCK_COLS
        first = last_start + tl.arange(0, BLOCK_COLS)
        z_next = tl.load(body_ptr + first * logits_stride_col, mask=first < n_read, other=0.0)
        for back in range(0, body, BLOCK_COLS):
            offsets = (last_start - back) + tl.arange(0, BLOCK_COLS)
            z = z_next.to(tl.float32)
            ahead = offsets - BLOCK_COLS
            z_next = tl.load(body_ptr + ahead * logits_stride_col, mask=(ahead >= 0) & (ahead < n_read), other=0.0)
            _store_gradient(z, head + offsets, offsets < body, d_body_ptr + offsets, y, col_start, row_max, log_sum,
                            ignored, coef_y, coef_s, coef_z, coef_c, weight_ptr, softcap, HAS_WEIGHT, HAS_SMOOTHING,
                            HAS_Z_LOSS, HAS_SOFTCAP)


@triton.jit
def _loss_constants_kernel(target_ptr, weight_ptr, constants_ptr, n_rows, n_cols, ignore_index,
                           HAS_WEIGHT: tl.constexpr, WEIGHT_SUM: tl.constexpr, BLOCK: tl.constexpr):
    """constants[0] = r = 1 / D, D the number (or with weights the summed weight) of counted targets, and r = 0 where
    D = 0; constants[1] = W, the sum of the class weights, when WEIGHT_SUM. One program, fixed order: deterministic.

    D = 0 when no row is counted, and also when every counted target's class weight is 0: r = 0 then makes the loss
    and gradient 0 (torch: NaN), as when all rows are ignored (r = 1 would leave such rows' label-smoothing and z-loss
    terms, which their target's weight does not scale, summed instead of averaged). r is computed here, once, rather
    than in every program of the row kernel: there the same select and division made the gradient pass 3% slower on
    the H200 (8192 x 151936 bf16 forward+backward, 1.872 -> 1.930 ms)."""
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offsets
        y = tl.load(target_ptr + rows, mask=rows < n_rows, other=ignore_index).to(tl.int64)
        counted = (rows < n_rows) & (y != ignore_index) & (y >= 0) & (y < n_cols)
        if HAS_WEIGHT:
            acc += tl.load(weight_ptr + tl.where(counted, y, 0), mask=counted, other=0.0).to(tl.float32)
        else:
            acc += counted.to(tl.float32)
    denominator = tl.sum(acc, axis=0)
    tl.store(constants_ptr, tl.where(denominator != 0.0, 1.0 / denominator, 0.0))
    if WEIGHT_SUM:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            acc += tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        tl.store(constants_ptr + 1, tl.sum(acc, axis=0))


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, n_cols, stride_row, n_col_blocks, n_blocks, BLOCK: tl.constexpr):
    """x[row, :] *= scale[0] in place, for rows of ``n_cols`` elements ``stride_row`` apart, in ``n_blocks`` blocks
    of BLOCK columns (``n_col_blocks`` per row); nothing is read or written when the scale is exactly 1.

    A grid of a few programs per SM walks the blocks. With one program per block, merely launching the programs
    that find the scale to be 1 took 0.09 ms per ``loss.backward()`` of an 8192 x 151936 cross-entropy."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        for block in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            row = block // n_col_blocks
            cols = (block % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            ptrs = x_ptr + row.to(tl.int64) * stride_row + cols
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptrs, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


def loss_constants(target, weight, constants, n_rows, n_cols, ignore_index, weight_sum, *, block, num_warps):
    """Fill ``constants`` (fp32, 2 elements): [1 / D or 0, W]; W only when ``weight_sum`` (it needs class weights)."""
    launch(_loss_constants_kernel, (1,),
           (target, weight if weight is not None else constants, constants), (n_rows, n_cols, ignore_index),
           dict(HAS_WEIGHT=weight is not None, WEIGHT_SUM=weight_sum, BLOCK=block), num_warps)


def _row_alignment(logits, dlogits, n_cols):
    """The kernel's ALIGN: 1 when Triton itself can tell that every block of a row starts on a 16-byte boundary (row
    strides and length multiples of 16 elements), else the elements per 16 bytes when the rows can be split into
    edges and a 16-byte aligned body (unit column stride, 16-byte aligned data, and the gradient's rows as far from
    a boundary as the logits' rows). Otherwise 1: the kernel then moves 2 or 4 bytes per access, as Triton does
    for rows it cannot prove aligned (H200, loss and gradient, 8192 x 50257 bf16, GPT-2's vocabulary: 975 us that
    way, 693 split, 673 at 50304)."""
    tensors = [logits] if dlogits is None else [logits, dlogits]
    if n_cols % 16 == 0 and all(t.stride(0) % 16 == 0 for t in tensors):
        return 1
    align = 16 // logits.element_size()
    if any(t.stride(1) != 1 or t.data_ptr() % 16 or t.element_size() != logits.element_size()
           or (t.stride(0) - logits.stride(0)) % align for t in tensors):
        return 1
    return align


def cross_entropy_rows(logits, target, weight, constants, loss, z_loss, row_stats, dlogits, grad_out, n_rows, n_cols,
                       ignore_index, label_smoothing, lse_square_scale, softcap, mean, *, loss_pass, grad_pass,
                       block_cols, num_warps, num_stages=None, n_classes=None, col_start=0):
    """Launch the row kernel over ``n_rows`` rows of the 2-D ``logits`` (any strides).

    ``logits`` holds columns ``[col_start, col_start + n_cols)`` of rows of ``n_classes`` classes (default: the
    whole rows, ``n_classes = n_cols``). A gradient pass without a loss pass may take such a column slice (the
    vocabulary-sliced fused linear cross-entropy); a loss pass needs whole rows (the caller checks).

    ``loss`` (fp32, ``(n_rows,)``) and ``row_stats`` (fp32, contiguous ``(n_rows, 2)``: each row's max and log of
    its shifted sum, whose sum is lse) are written when ``loss_pass``; ``row_stats`` is read otherwise. ``z_loss``
    (may be None) receives the z-loss part of each row's loss. ``dlogits`` (2-D, unit column stride; may be
    ``logits`` itself) receives the gradient when ``grad_pass``, scaled by ``grad_out`` when given (one value
    per row, or a single value). ``softcap`` is None or > 0. One program per row. ``num_stages``: the software
    pipelining depth of the column loops (None: Triton's default).
    """
    n_classes = n_cols if n_classes is None else n_classes
    align = _row_alignment(logits, dlogits, n_cols)
    if grad_out is not None:
        grad_out_stride = 0 if grad_out.numel() == 1 else 1
    else:
        grad_out_stride = 0
    launch(
        _cross_entropy_kernel, (n_rows,),
        (logits, target, weight if weight is not None else constants, constants,
         grad_out if grad_out is not None else constants, loss if loss is not None else constants,
         z_loss if z_loss is not None else constants, row_stats, dlogits if dlogits is not None else logits),
        (n_cols, n_classes, col_start, logits.stride(0), logits.stride(1),
         dlogits.stride(0) if dlogits is not None else 0, grad_out_stride, ignore_index, float(label_smoothing),
         float(lse_square_scale),
         float(softcap) if softcap is not None else 1.0),
        dict(HAS_WEIGHT=weight is not None, HAS_SMOOTHING=label_smoothing > 0, HAS_Z_LOSS=lse_square_scale > 0,
             HAS_SOFTCAP=softcap is not None, MEAN=mean, LOSS_PASS=loss_pass, STORE_Z_LOSS=z_loss is not None,
             GRAD_PASS=grad_pass, HAS_GRAD_OUT=grad_out is not None, BLOCK_COLS=block_cols, ALIGN=align),
        num_warps, num_stages)


def scale_(x, scale, *, block, num_warps, num_programs):
    """``x *= scale`` in place (``scale``: a one-element device tensor), skipped on the device when it is 1.
    ``x`` is 2-D with unit column stride, or 1-D contiguous; at most ``num_programs`` programs."""
    x2d = x if x.dim() == 2 else x.view(1, -1)
    n_rows, n_cols = x2d.shape
    if x2d.numel() == 0:
        return
    n_col_blocks = cdiv(n_cols, block)
    n_blocks = n_rows * n_col_blocks
    launch(_scale_kernel, (min(n_blocks, num_programs),), (x2d, scale), (n_cols, x2d.stride(0), n_col_blocks, n_blocks),
           dict(BLOCK=block), num_warps)
