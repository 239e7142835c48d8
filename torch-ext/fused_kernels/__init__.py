"""fused-kernels: fused Triton kernels for LLM training, forward and backward.

Load from the Hub with ``kernels.get_kernel("myorg/fused-kernels", version=1)``. Every function here is a
registered torch op (``torch.compile(fullgraph=True)``-safe, with fake and autograd registrations);
``layers`` holds the Hub layers that ``kernels.kernelize`` and transformers swap into models.
"""

from . import layers
from ._build_info import BACKEND, VARIANT, VERSION
from .cross_entropy import cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .rms_norm import fused_add_rms_norm, rms_norm

__version__ = str(VERSION)

__all__ = ["layers", "rms_norm", "fused_add_rms_norm", "cross_entropy", "fused_linear_cross_entropy", "BACKEND",
           "VARIANT"]
