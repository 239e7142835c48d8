"""No op makes the host wait for the GPU: under DDP and FSDP2 a host synchronisation inside a layer stalls the
rank's CPU until its queued kernels drain, so the next collective and kernels launch late on every rank.

On the GPU each op's forward and backward (after a warm-up call that compiles its kernels) runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising CUDA call (a device-to-host copy
such as ``.item()``, a pageable host-to-device copy, a stream or device synchronisation). The one documented
exception is FlashAttention-2's API taking ``max_seqlen`` as a 0-d tensor; the varlen case passes ints here.
"""

import pytest
import torch

from conftest import ON_GPU

pytestmark = pytest.mark.skipif(not ON_GPU, reason="CUDA's sync debug mode needs a GPU")


def _rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)


def _cases(fk):
    """name -> function returning the tensors to differentiate (their sum's backward runs too)."""
    tokens, hidden, vocab = 256, 512, 4000
    x, w = _rand(tokens, hidden), _rand(hidden)
    residual = _rand(tokens, hidden)
    q, k = _rand(2, 8, 128, 64), _rand(2, 2, 128, 64)
    cos, sin = torch.randn(2, 128, 64, device="cuda"), torch.randn(2, 128, 64, device="cuda")
    gate, up = _rand(tokens, 1024), _rand(tokens, 1024)
    qa, ka, va = _rand(2, 128, 8, 64), _rand(2, 128, 2, 64), _rand(2, 128, 2, 64)
    cu_seqlens = torch.tensor([0, 100, 256], device="cuda", dtype=torch.int32)
    qv, kv, vv = _rand(256, 8, 64), _rand(256, 2, 64), _rand(256, 2, 64)
    logits, target = _rand(tokens, vocab, dtype=torch.float32), torch.randint(0, vocab, (tokens,), device="cuda")
    lm_head = _rand(vocab, hidden)
    return {
        "rms_norm": lambda: (fk.rms_norm(x, w),),
        "fused_add_rms_norm": lambda: fk.fused_add_rms_norm(x, residual, w),
        "rope": lambda: fk.apply_rotary_pos_emb(q, k, cos, sin),
        "swiglu": lambda: (fk.swiglu(gate, up),),
        "flash_attn": lambda: (fk.flash_attn_func(qa, ka, va, causal=True, dropout_p=0.1),),
        "flash_attn_varlen": lambda: (fk.flash_attn_varlen_func(qv, kv, vv, cu_seqlens, cu_seqlens, 156, 156,
                                                                causal=True),),
        "cross_entropy": lambda: (fk.cross_entropy(logits, target, label_smoothing=0.1),),
        "cross_entropy_none": lambda: (fk.cross_entropy(logits, target, reduction="none"),),
        "fused_linear_cross_entropy": lambda: (fk.fused_linear_cross_entropy(x, lm_head, target),),
        "fused_linear_cross_entropy_none": lambda: (fk.fused_linear_cross_entropy(x, lm_head, target,
                                                                                  reduction="none"),),
    }


CASE_NAMES = ["rms_norm", "fused_add_rms_norm", "rope", "swiglu", "flash_attn", "flash_attn_varlen", "cross_entropy",
              "cross_entropy_none", "fused_linear_cross_entropy", "fused_linear_cross_entropy_none"]


def _forward_backward(run):
    outputs = run()
    sum(out.float().sum() for out in outputs).backward()


@pytest.mark.parametrize("name", CASE_NAMES)
def test_forward_and_backward_never_synchronise(fk, name):
    run = _cases(fk)[name]
    _forward_backward(run)  # compiles and caches the kernels, outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _forward_backward(run)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_the_check_catches_a_synchronisation():
    """The debug mode really raises here (so the test above can fail)."""
    value = torch.ones((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            value.item()
    finally:
        torch.cuda.set_sync_debug_mode("default")
