"""Reference modules for the Hub layers that no transformers class corresponds to.

transformers has no ``(..., 2I) -> (..., I)`` gated-activation module (its fused-``gate_up_proj`` MLPs, e.g.
``Phi3MLP``, split and multiply inline), so the ``SiluAndMul``/``GeluAndMul``/``GeluTanhAndMul`` layers replace
modules of users' own models that opt in with ``@kernels.use_kernel_forward_from_hub("SiluAndMul")``. The
classes below define that contract in plain PyTorch: the forward signature `check` validates the layers
against (through ``layer_table.py``), and the unpatched modules the tests compare the layers with.
"""

import torch
import torch.nn.functional as F
from torch import nn


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.chunk(2, dim=-1)


class SiluAndMul(nn.Module):
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` of shape ``(..., 2I)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _halves(x)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """``gelu(x[..., :I]) * x[..., I:]`` with the exact (erf) GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _halves(x)
        return F.gelu(gate) * up


class GeluTanhAndMul(nn.Module):
    """``gelu(x[..., :I]) * x[..., I:]`` with the tanh approximation of GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _halves(x)
        return F.gelu(gate, approximate="tanh") * up
