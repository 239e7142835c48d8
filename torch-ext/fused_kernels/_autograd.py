"""Refusing double backward where an op's gradients have no autograd graph of their own.

The Triton kernels record nothing, and the PyTorch formulas the torch-cpu variant and the eager fallbacks use treat
some forward results as constants (the losses' log-sum-exp, attention's saved inputs), so a second derivative would
silently lack the op's terms. The losses and flash attention raise instead, as torch's own fused attention does.
"""

import functools

import torch


class _RefusesDifferentiation(torch.autograd.Function):
    """The identity on a gradient that was computed without an autograd graph; its backward raises."""

    @staticmethod
    def forward(ctx, grad, op_name):
        ctx.op_name = op_name
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError(f"{ctx.op_name}: double backward is not supported (its gradients are computed without an "
                           "autograd graph, so they cannot be differentiated)")


def refuses_double_backward(op_name: str):
    """Decorates an autograd.Function's ``backward``: it runs without recording a graph, and under
    ``create_graph=True`` each gradient it returns goes through ``_RefusesDifferentiation``, so a backward through
    it raises. Otherwise a second derivative silently lacked this op's terms (see the module docstring; the fused
    linear cross-entropy's recomputation also failed in its ``out=`` GEMMs). torch's ``once_differentiable`` marks
    the gradients only when the incoming gradients require grad, which after ``loss.sum()`` they do not. The marked
    gradients hold no edge to the op's inputs (that would mean saving what the op does not keep, such as the
    logits), so ``torch.autograd.grad`` with respect to those inputs reports them unused rather than reaching the
    error."""
    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            if not torch.is_grad_enabled():  # create_graph=False
                return grads
            return tuple(_RefusesDifferentiation.apply(g.detach().requires_grad_(), op_name) if g is not None else None
                         for g in grads)
        return wrapper
    return decorate
