"""Hub layers: forward-only ``nn.Module`` classes that ``kernels.kernelize`` and transformers swap in.

A Hub layer has no constructor and no members of its own: its ``forward`` is bound to the module it
replaces, so it reads that module's state (declared below as bare annotations for documentation).
"""

import torch
from torch import nn

from .rms_norm import rms_norm
from ._rope import apply_rotary_pos_emb


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


class ApplyRotaryPosEmb(nn.Module):
    """Replaces transformers' ``apply_rotary_pos_emb`` (the kernelizable function ``rotary_pos_emb`` of Llama,
    Qwen, Mistral and most decoder models): half-split RoPE of q and k in one launch, out of place."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
