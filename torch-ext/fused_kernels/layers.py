"""Hub layers: forward-only ``nn.Module`` classes that ``kernels.kernelize`` and transformers swap in.

A Hub layer has no constructor and no members of its own: its ``forward`` is bound to the module it
replaces, so it reads that module's state (declared below as bare annotations for documentation).
"""

import torch
from torch import nn

from ._rope import apply_rotary_pos_emb
from .rms_norm import rms_norm
from .swiglu import geglu, gelu_and_mul, silu_and_mul, swiglu


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


class SwiGLUMLP(nn.Module):
    """Replaces ``LlamaMLP`` and its copies (Qwen2/Qwen3, Mistral, ...) whose ``act_fn`` is SiLU:
    ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the gated activation fused (forward and backward).
    transformers does not mark these classes kernelizable: see the README for
    ``kernels.replace_kernel_forward_from_hub``."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class GeGLUMLP(nn.Module):
    """Replaces ``GemmaMLP``/``Gemma2MLP``/``Gemma3MLP`` (``act_fn`` = ``gelu_pytorch_tanh``):
    ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x), approximate="tanh"))


class SiluAndMul(nn.Module):
    """``(..., 2I) -> (..., I)``: ``silu(x[..., :I]) * x[..., I:]``, for models with a fused ``gate_up_proj``
    that declare ``@use_kernel_forward_from_hub("SiluAndMul")`` (transformers has no such layer)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluAndMul(nn.Module):
    """``(..., 2I) -> (..., I)``: ``gelu(x[..., :I]) * x[..., I:]`` with the exact (erf) GELU."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul(x, approximate="none")


class GeluTanhAndMul(nn.Module):
    """``(..., 2I) -> (..., I)``: ``gelu(x[..., :I]) * x[..., I:]`` with the tanh approximation of GELU."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul(x, approximate="tanh")


class ApplyRotaryPosEmb(nn.Module):
    """Replaces transformers' ``apply_rotary_pos_emb`` (the kernelizable function ``rotary_pos_emb`` of Llama,
    Qwen, Mistral and most decoder models): half-split RoPE of q and k in one launch, out of place."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
