"""Describe tensors as strided rows without copying them.

The Triton kernels read a tensor of shape ``(*leading, n_cols)`` as ``n_rows = prod(leading)`` rows. Row ``r``
starts at ``(r // rows_inner) * stride_outer + (r % rows_inner) * stride_inner``: the leading dimensions are
split into an outer and an inner group, each of which must walk memory with a single stride. That covers
contiguous tensors, row slices of wider tensors and transposed ``(seq, batch, hidden)`` views, with no copy.
"""

import functools
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


def _layout_at_split(shape, stride, split: int):
    leading, leading_strides = shape[:-1], stride[:-1]
    outer = _group_stride(leading[:split], leading_strides[:split])
    inner = _group_stride(leading[split:], leading_strides[split:])
    if outer is None or inner is None:
        return None
    return (math.prod(leading[split:]), outer, inner, stride[-1])


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=4096)
def _plan(shape: tuple[int, ...], strides: tuple[tuple[int, ...], ...]):
    """(which tensors must be made contiguous, their layouts) for tensors of one shape with these strides.

    Cached: a model calls an op with a handful of shape/stride combinations, and recomputing this costs
    ~10 us of Python per call, as much as the kernel of a small layer."""
    for split in range(len(shape)):
        layouts = tuple(_layout_at_split(shape, stride, split) for stride in strides)
        if all(layout is not None for layout in layouts):
            return (False,) * len(strides), layouts
    copy = tuple(_layout_at_split(shape, stride, 0) is None for stride in strides)
    contiguous = _contiguous_strides(shape)
    return copy, tuple(_layout_at_split(shape, contiguous if c else stride, 0) for c, stride in zip(copy, strides))


def shared_row_layouts(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], tuple[RowLayout, ...]]:
    """Row layouts with one common ``rows_inner`` for tensors of one shape.

    Returns the tensors (unchanged, except that a tensor whose leading dimensions cannot be split into two
    strided groups at all, which takes three or more independent permutations, is made contiguous) and
    their layouts.
    """
    copy, layouts = _plan(tuple(tensors[0].shape), tuple(t.stride() for t in tensors))
    return [t.contiguous() if c else t for t, c in zip(tensors, copy)], layouts
