"""RMSNorm with Llama numerics (bf16), forward and forward+backward, against transformers' LlamaRMSNorm math in
torch eager. Run by `kernels benchmark myorg/fused-kernels --version 2`; self-contained (published alone)."""

import torch
from kernels import Benchmark

EPS = 1e-6


def reference(x, weight):
    """LlamaRMSNorm.forward: statistics in fp32, normalised values cast back before the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class RMSNorm(Benchmark):
    seed = 0

    def setup(self):
        tokens, hidden = (16384, 4096) if self.device == "cuda" else (64, 256)
        options = dict(device=self.device, dtype=torch.bfloat16)
        self.x = torch.randn(tokens, hidden, **options)
        # The runner compares with a fixed atol of 1e-2: weights below 0.25 keep outputs and gradients under 2,
        # where one bf16 ulp (the rounding difference between two correct implementations) is below it.
        self.weight = torch.empty(hidden, **options).uniform_(0.05, 0.25).requires_grad_()
        self.dy = 0.5 * torch.randn(tokens, hidden, **options)

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = self.kernel.rms_norm(self.x, self.weight, EPS, mode="llama")

    def verify_forward(self):
        with torch.no_grad():
            return reference(self.x, self.weight)

    def _forward_backward(self, norm):
        x = self.x.detach().requires_grad_()  # a fresh leaf per call, so gradients never accumulate
        self.weight.grad = None
        norm(x).backward(self.dy)
        return x.grad

    def benchmark_forward_backward(self):
        self.out = self._forward_backward(lambda x: self.kernel.rms_norm(x, self.weight, EPS, mode="llama"))

    def verify_forward_backward(self):
        return self._forward_backward(lambda x: reference(x, self.weight))
