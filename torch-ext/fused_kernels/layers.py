"""Hub layers: forward-only ``nn.Module`` classes that ``kernels.kernelize`` and transformers swap in.

A Hub layer has no constructor and no members of its own: its ``forward`` is bound to the module it
replaces, so it reads that module's state (declared below as bare annotations for documentation).
"""

import torch
from torch import nn

from .rms_norm import rms_norm


class RMSNorm(nn.Module):
    """Replaces ``LlamaRMSNorm`` and its copies (Qwen2/Qwen3, Mistral, ...): ``transformers`` layer name
    ``RMSNorm``. Statistics in fp32, normalised values cast back to the input dtype before the weight."""

    weight: torch.Tensor
    variance_epsilon: float

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, mode="llama")


class GemmaRMSNorm(nn.Module):
    """Replaces ``GemmaRMSNorm``/``Gemma2RMSNorm``/``Gemma3RMSNorm``: ``(1 + weight)`` scale, fp32 throughout."""

    weight: torch.Tensor
    eps: float

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, mode="gemma")
