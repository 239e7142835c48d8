"""SwiGLU (bf16), the gated activation of Llama/Qwen/Mistral MLPs, forward and forward+backward, against
`silu(gate) * up` in torch eager. Run by `kernels benchmark myorg/fused-kernels --version 2`; self-contained
(published alone). The runner checks one tensor per workload: the output, and the gate's gradient."""

import torch
from kernels import Benchmark


def reference(gate, up):
    return torch.nn.functional.silu(gate) * up


class SwiGLU(Benchmark):
    seed = 0

    def setup(self):
        tokens, intermediate = (16384, 14336) if self.device == "cuda" else (64, 352)
        options = dict(device=self.device, dtype=torch.bfloat16)
        # Bounded inputs keep outputs and gradients O(1) but below 1, where the 1-2 bf16 ulps between torch's
        # twice-rounded silu(gate) * up and our single rounding stay below the runner's fixed atol of 1e-2.
        self.gate = torch.empty(tokens, intermediate, **options).uniform_(-2, 2)
        self.up = torch.empty(tokens, intermediate, **options).uniform_(-0.5, 0.5)
        self.dy = torch.empty(tokens, intermediate, **options).uniform_(-0.5, 0.5)

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = self.kernel.swiglu(self.gate, self.up)

    def verify_forward(self):
        return reference(self.gate, self.up)

    def _forward_backward(self, swiglu):
        gate, up = self.gate.detach().requires_grad_(), self.up.detach().requires_grad_()
        swiglu(gate, up).backward(self.dy)
        return gate.grad

    def benchmark_forward_backward(self):
        self.out = self._forward_backward(self.kernel.swiglu)

    def verify_forward_backward(self):
        return self._forward_backward(reference)
