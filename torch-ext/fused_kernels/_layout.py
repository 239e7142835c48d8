"""Describe tensors as strided rows without copying them.

The Triton kernels read a tensor of shape ``(*leading, n_cols)`` as ``n_rows = prod(leading)`` rows. Row ``r``
starts at ``(r // rows_inner) * stride_outer + (r % rows_inner) * stride_inner``: the leading dimensions are
split into an outer and an inner group, each of which must walk memory with a single stride. That covers
contiguous tensors, row slices of wider tensors and transposed ``(seq, batch, hidden)`` views, with no copy.
"""

import math

import torch

RowLayout = tuple[int, int, int, int]  # (rows_inner, stride_outer, stride_inner, stride_col)


def _group_stride(sizes, strides):
    """The single stride that walks the flattened dims, or None when they do not flatten without a copy."""
    stride = 0
    expected = None
    for size, step in zip(reversed(sizes), reversed(strides)):
        if size == 1:
            continue
        if expected is None:
            stride = step
        elif step != expected:
            return None
        expected = step * size
    return stride


def _layout_at_split(t: torch.Tensor, split: int):
    leading, leading_strides = t.shape[:-1], t.stride()[:-1]
    outer = _group_stride(leading[:split], leading_strides[:split])
    inner = _group_stride(leading[split:], leading_strides[split:])
    if outer is None or inner is None:
        return None
    return (math.prod(leading[split:]), outer, inner, t.stride(-1))


def shared_row_layouts(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], list[RowLayout]]:
    """Row layouts with one common ``rows_inner`` for tensors of one shape.

    Returns the tensors (unchanged, except that a tensor whose leading dimensions cannot be split into two
    strided groups at all, which takes three or more independent permutations, is made contiguous) and
    their layouts.
    """
    n_leading = tensors[0].dim() - 1
    for split in range(n_leading + 1):
        layouts = [_layout_at_split(t, split) for t in tensors]
        if all(layout is not None for layout in layouts):
            return list(tensors), layouts
    tensors = [t if _layout_at_split(t, 0) is not None else t.contiguous() for t in tensors]
    return tensors, [_layout_at_split(t, 0) for t in tensors]
