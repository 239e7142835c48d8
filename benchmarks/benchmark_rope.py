"""RoPE of q and k in one launch (bf16, transformers' layout and cos/sin tables, GQA), forward and
forward+backward, against transformers' apply_rotary_pos_emb in torch eager. Run by
`kernels benchmark myorg/fused-kernels --version 2`; self-contained (published alone). The runner checks one
tensor per workload: the rotated q (forward) and its gradient (forward+backward); k is covered by the test suite."""

import torch
from kernels import Benchmark


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb with unsqueeze_dim=1."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Rope(Benchmark):
    seed = 0

    def setup(self):
        batch, q_heads, kv_heads, seq, head_dim = (4, 32, 8, 4096, 128) if self.device == "cuda" else (2, 4, 2, 16, 32)
        options = dict(device=self.device, dtype=torch.bfloat16)
        # transformers passes q and k as transposed views of (batch, seq, heads, head_dim) projections. Entries
        # within +-0.7 keep every rotated pair, and so every output and gradient, below 1 in magnitude, where a bf16
        # ulp is 2**-8: the reference's three roundings (two products and their sum in bf16) and our single one
        # then differ by less than the runner's fixed atol of 1e-2. Gaussian entries reach 2 at these sizes,
        # where those roundings alone came to 0.0156 (found on the H200).
        self.q = torch.empty(batch, seq, q_heads, head_dim, **options).uniform_(-0.7, 0.7).transpose(1, 2)
        self.k = torch.empty(batch, seq, kv_heads, head_dim, **options).uniform_(-0.7, 0.7).transpose(1, 2)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=self.device).float() / head_dim)
        freqs = torch.outer(torch.arange(seq, device=self.device).float(), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1).expand(batch, seq, head_dim)
        self.cos, self.sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        self.dq = torch.empty_like(self.q).uniform_(-0.7, 0.7)
        self.dk = torch.empty_like(self.k).uniform_(-0.7, 0.7)

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = self.kernel.apply_rotary_pos_emb(self.q, self.k, self.cos, self.sin)[0]

    def verify_forward(self):
        return reference(self.q, self.k, self.cos, self.sin)[0]

    def _forward_backward(self, rope):
        q, k = self.q.detach().requires_grad_(), self.k.detach().requires_grad_()
        torch.autograd.backward(rope(q, k, self.cos, self.sin), (self.dq, self.dk))
        return q.grad

    def benchmark_forward_backward(self):
        self.out = self._forward_backward(self.kernel.apply_rotary_pos_emb)

    def verify_forward_backward(self):
        return self._forward_backward(reference)
