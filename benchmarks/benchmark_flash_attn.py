"""Causal flash attention with GQA (bf16, FlashAttention-2's `flash_attn_func`), forward and forward+backward,
against torch's scaled_dot_product_attention (the `sdpa` attention of transformers). Run by
`kernels benchmark myorg/fused-kernels --version 2`; self-contained (published alone). The runner checks one
tensor per workload: the output, and the gradient of q."""

import torch
from kernels import Benchmark


def reference(q, k, v):
    """SDPA on transformers' (batch, heads, seq, head_dim) layout, back to flash attention's."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


class FlashAttention(Benchmark):
    seed = 0

    def setup(self):
        batch, seq, q_heads, kv_heads, head_dim = (4, 4096, 32, 8, 128) if self.device == "cuda" else (1, 64, 4, 2, 32)
        options = dict(device=self.device, dtype=torch.bfloat16)
        # Scores of standard deviation ~2 make each row attend to a few keys, so the output is O(|v|), not an
        # average near 0 that the runner's fixed atol of 1e-2 would pass whatever we computed; |v| and the
        # incoming gradient below 1 keep outputs and gradients where one bf16 ulp is below that atol.
        self.q = 1.4 * torch.randn(batch, seq, q_heads, head_dim, **options)
        self.k = 1.4 * torch.randn(batch, seq, kv_heads, head_dim, **options)
        self.v = 0.25 * torch.randn(batch, seq, kv_heads, head_dim, **options)
        self.dout = 0.25 * torch.randn(batch, seq, q_heads, head_dim, **options)

    def _ours(self, q, k, v):
        return self.kernel.flash_attn_func(q, k, v, causal=True)

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = self._ours(self.q, self.k, self.v)

    def verify_forward(self):
        with torch.no_grad():
            return reference(self.q, self.k, self.v)

    def _forward_backward(self, attention):
        q, k, v = (t.detach().requires_grad_() for t in (self.q, self.k, self.v))
        attention(q, k, v).backward(self.dout)
        return q.grad

    def benchmark_forward_backward(self):
        self.out = self._forward_backward(self._ours)

    def verify_forward_backward(self):
        return self._forward_backward(reference)
