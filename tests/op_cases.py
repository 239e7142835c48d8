"""One small forward call of every op (on the GPU unless told), shared by the host-synchronisation, CUDA-graph and
fake-tensor tests."""

import torch


def op_cases(fk, dropout_p=0.1, device="cuda"):
    """name -> (run, inputs): ``run()`` returns the tensors to differentiate (their sum's backward runs too);
    ``inputs`` are the tensors it reads, which a caller may overwrite in place between calls (int64: class
    targets in [0, 4000) or -100, ignored; int32: cu_seqlens of two sequences of 256 tokens, at most 156 long)."""
    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    tokens, hidden, vocab = 256, 512, 4000
    x, w, residual = rand(tokens, hidden), rand(hidden), rand(tokens, hidden)
    q, k = rand(2, 8, 128, 64), rand(2, 2, 128, 64)
    cos, sin = torch.randn(2, 128, 64, device=device), torch.randn(2, 128, 64, device=device)
    gate, up = rand(tokens, 1024), rand(tokens, 1024)
    qa, ka, va = rand(2, 128, 8, 64), rand(2, 128, 2, 64), rand(2, 128, 2, 64)
    cu_seqlens = torch.tensor([0, 100, 256], device=device, dtype=torch.int32)
    qv, kv, vv = rand(256, 8, 64), rand(256, 2, 64), rand(256, 2, 64)
    logits, target = rand(tokens, vocab, dtype=torch.float32), torch.randint(0, vocab, (tokens,), device=device)
    lm_head = (0.05 * torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16)).requires_grad_()
    return {
        "rms_norm": (lambda: (fk.rms_norm(x, w),), [x, w]),
        "fused_add_rms_norm": (lambda: fk.fused_add_rms_norm(x, residual, w), [x, residual, w]),
        "rope": (lambda: fk.apply_rotary_pos_emb(q, k, cos, sin), [q, k, cos, sin]),
        "swiglu": (lambda: (fk.swiglu(gate, up),), [gate, up]),
        "flash_attn": (lambda: (fk.flash_attn_func(qa, ka, va, causal=True, dropout_p=dropout_p),), [qa, ka, va]),
        "flash_attn_varlen": (lambda: (fk.flash_attn_varlen_func(qv, kv, vv, cu_seqlens, cu_seqlens, 156, 156,
                                                                 causal=True),), [qv, kv, vv, cu_seqlens]),
        "cross_entropy": (lambda: (fk.cross_entropy(logits, target, label_smoothing=0.1),), [logits, target]),
        "cross_entropy_none": (lambda: (fk.cross_entropy(logits, target, reduction="none"),), [logits, target]),
        "fused_linear_cross_entropy": (lambda: (fk.fused_linear_cross_entropy(x, lm_head, target),),
                                       [x, lm_head, target]),
        "fused_linear_cross_entropy_none": (lambda: (fk.fused_linear_cross_entropy(x, lm_head, target,
                                                                                   reduction="none"),),
                                            [x, lm_head, target]),
    }


CASE_NAMES = ["rms_norm", "fused_add_rms_norm", "rope", "swiglu", "flash_attn", "flash_attn_varlen", "cross_entropy",
              "cross_entropy_none", "fused_linear_cross_entropy", "fused_linear_cross_entropy_none"]


def forward_backward(run):
    """The outputs of ``run()``, after the backward of their sum."""
    outputs = run()
    sum(out.float().sum() for out in outputs).backward()
    return outputs
