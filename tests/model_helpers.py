"""Shared by the tests that kernelize a tiny transformers model and compare it with the unpatched one."""

import collections

import torch

from conftest import ON_GPU


def variant_paths(build_dir):
    """The builds a kernelize test loads: the variant `kernels` selects on a GPU; on CPU both the torch-cpu
    variant and the torch-cuda one (its Triton kernels run in the interpreter)."""
    if ON_GPU:
        return {"selected": build_dir}
    return {"torch-cpu": build_dir / "torch-cpu", "torch-cuda (interpreter)": build_dir / "torch-cuda"}


VARIANTS = ["selected"] if ON_GPU else ["torch-cpu", "torch-cuda (interpreter)"]


def loss_and_grads(model, input_ids):
    model.zero_grad()
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_same_step(logits, grads, ref_logits, ref_grads, dtype):
    """Logits and every parameter's gradient of the kernelized model match the unpatched model's: to bf16
    rounding in bf16, to float32 rounding otherwise."""
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, **tol)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **tol, msg=lambda m: f"{name}: {m}")


def kernel_calls(loss):
    """Calls of our ops in the graph of `loss`: {kernel submodule (e.g. "<id>.rms_norm"): count}. Each op runs
    as a torch.autograd.Function in eager mode, whose graph node records the Function's class."""
    counts, seen, stack = collections.Counter(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        forward_cls = getattr(node, "_forward_cls", None)
        if forward_cls is not None and forward_cls.__module__.startswith("_fused_kernels_"):
            counts[forward_cls.__module__] += 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    return counts
