"""Fake tensors outside torch.compile: ``FakeTensorMode``, as torch's memory and runtime estimators use it, runs the
eager functions, which must then take the PyTorch implementation or the op's fake kernel (a fake tensor has no
memory for a Triton kernel to read) and give the real call's shapes and dtypes, and its gradients', without
launching anything or reading a data pointer."""

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from conftest import DEVICE, ON_GPU
from op_cases import CASE_NAMES, forward_backward, op_cases


def _metadata(tensors):
    return [None if t is None else (tuple(t.shape), t.dtype, t.device.type) for t in tensors]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_op_and_its_backward_under_fake_tensor_mode(fk, fk_cpu, name):
    """Against the real call: on the GPU ours, on the CPU the torch-cpu variant's (the same results, faster than
    the interpreter)."""
    torch.manual_seed(0)
    run, inputs = op_cases(fk if ON_GPU else fk_cpu, dropout_p=0.0, device=DEVICE)[name]
    real_outputs = forward_backward(run)
    real_grads = [t.grad for t in inputs]
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # such as torch's on reading a fake tensor's data pointer
        run, inputs = op_cases(fk, dropout_p=0.0, device=DEVICE)[name]
        outputs = forward_backward(run)
        grads = [t.grad for t in inputs]
    assert all(is_fake(t) for t in outputs + tuple(g for g in grads if g is not None))
    assert _metadata(outputs) == _metadata(real_outputs)
    assert _metadata(grads) == _metadata(real_grads)
