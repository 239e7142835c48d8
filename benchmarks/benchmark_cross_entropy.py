"""Cross-entropy over a large vocabulary (bf16 logits, fp32 loss summed over tokens, so the
logits' gradient is O(1) and the runner's atol of 1e-2 means something), forward and forward+backward, against
torch eager (`cross_entropy(logits.float(), labels)`, transformers' loss). Run by
`kernels benchmark myorg/fused-kernels --version 2`; self-contained (published alone). The runner checks one
tensor per workload: the loss, and the logits' gradient."""

import torch
from kernels import Benchmark


def reference(logits, target):
    return torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum")


class CrossEntropy(Benchmark):
    seed = 0

    def setup(self):
        tokens, vocab = (8192, 151936) if self.device == "cuda" else (64, 1000)
        self.logits = torch.randn(tokens, vocab, device=self.device, dtype=torch.bfloat16)
        self.target = torch.randint(0, vocab, (tokens,), device=self.device)

    def benchmark_forward(self):
        self.out = self.kernel.cross_entropy(self.logits, self.target, reduction="sum")

    def verify_forward(self):
        return reference(self.logits, self.target)

    def _forward_backward(self, loss_fn):
        logits = self.logits.detach().requires_grad_()
        loss_fn(logits, self.target).backward()
        return logits.grad

    def benchmark_forward_backward(self):
        self.out = self._forward_backward(lambda x, t: self.kernel.cross_entropy(x, t, reduction="sum"))

    def verify_forward_backward(self):
        return self._forward_backward(reference)
