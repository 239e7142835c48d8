"""fused-kernels: fused Triton kernels for LLM training, forward and backward.

Load from the Hub with ``kernels.get_kernel("myorg/fused-kernels", version=2, trust_remote_code=True)`` (version 1
has the norm, rotary and activation kernels alone). Every function here is a registered torch op
(``torch.compile(fullgraph=True)``-safe, with fake and autograd registrations); ``layers`` holds the Hub layers
that ``kernels.kernelize`` and transformers swap into models.
"""

from . import layers
from ._build_info import BACKEND, VARIANT, VERSION
from ._rope import apply_rotary_pos_emb, apply_rotary_pos_emb_cached
from ._flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .cross_entropy import cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .rms_norm import fused_add_rms_norm, rms_norm
from .swiglu import geglu, gelu_and_mul, silu_and_mul, swiglu

__version__ = str(VERSION)

__all__ = ["layers", "rms_norm", "fused_add_rms_norm", "apply_rotary_pos_emb", "apply_rotary_pos_emb_cached",
           "swiglu", "geglu", "silu_and_mul", "gelu_and_mul", "flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "cross_entropy", "fused_linear_cross_entropy", "BACKEND", "VARIANT"]
