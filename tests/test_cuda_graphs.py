"""Every op's forward and backward can be captured in a CUDA graph and replayed on new inputs, giving what eager
calls give on those inputs. Nothing derived from tensor values (a "mean" denominator over the targets that are
not ignored, the sequence boundaries of a varlen batch) may bake into the graph:
`torch.compile(mode="reduce-overhead")` and hand-captured training steps rely on it, and on a host as slow as the
H200's they are how small layers stop being host-bound.

GPU only. Dropout is off: replays draw fresh random numbers and eager calls others, so they could not be compared.
"""

import pytest
import torch

from conftest import ON_GPU
from numerics import rel_err
from op_cases import CASE_NAMES, forward_backward, op_cases

pytestmark = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")


def _refresh(inputs, spread, ignore_some):
    """New values in place. Floats are redrawn at ``spread`` times their current spread (a loss over new logits of
    the same spread would barely move). Targets (int64) are permuted and, with ``ignore_some``, every fifth is set
    to the ignore index, which changes the "mean" denominator. Sequence boundaries (int32 cu_seqlens) are
    mirrored: lengths (100, 156) become (156, 100) and back."""
    with torch.no_grad():
        for t in inputs:
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) * (spread * t.float().std()).to(t.dtype))
            elif t.dtype == torch.int64:
                t.copy_(t.roll(1))
                if ignore_some:
                    t[::5] = -100
            else:
                t.copy_(t[-1] - t.flip(0))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_forward_and_backward_replay_in_a_cuda_graph(fk, name):
    run, inputs = op_cases(fk, dropout_p=0.0)[name]
    leaves = [t for t in inputs if t.requires_grad]
    # Warm up on a side stream (compiles and caches the kernels), as torch.cuda.graph asks.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for leaf in leaves:
                leaf.grad = None
            forward_backward(run)
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outputs = forward_backward(run)
    graph_grads = [leaf.grad for leaf in leaves]  # the graph rewrites these on every replay

    for spread, ignore_some in ((2.0, False), (0.5, True)):
        _refresh(inputs, spread, ignore_some)
        graph.replay()
        replayed = [t.detach().clone() for t in (*graph_outputs, *graph_grads)]
        for leaf in leaves:
            leaf.grad = None
        eager_outputs = forward_backward(run)
        eager = [t.detach() for t in eager_outputs] + [leaf.grad for leaf in leaves]
        for index, (got, want) in enumerate(zip(replayed, eager)):
            # The same kernels on the same values; cuBLAS (the fused loss's GEMMs) may pick other algorithms
            # inside a capture, hence not bitwise. A value baked in from the captured inputs would be off by O(1).
            assert rel_err(got, want) < 1e-2, f"{name}: replayed tensor {index} differs from the eager result"
