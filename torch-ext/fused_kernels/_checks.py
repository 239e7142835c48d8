"""Argument validation shared by every op: each failure names the argument and what was expected."""

import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ._build_info import BACKEND

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes=FLOAT_DTYPES, ndim: int | None = None, min_ndim: int | None = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_names(dtypes)}; got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-dimensional, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.device.type not in ("cuda", "cpu", "meta"):
        raise ValueError(f"{name} is on device {t.device}; fused_kernels supports cuda and cpu tensors")


def check_same_device(ref_name: str, ref: torch.Tensor, **others):
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must share a device")


def check_same_shape(ref_name: str, ref: torch.Tensor, **others):
    for name, t in others.items():
        if t is not None and t.shape != ref.shape:
            raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(t.shape)}")


def check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def shares_elements(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are one memory location: a dimension of size > 1 with stride 0, as ``expand``
    makes (what torch's own in-place ops refuse as "more than one element ... refers to a single memory
    location")."""
    strides = t.stride()
    return 0 in strides and any(size > 1 and stride == 0 for size, stride in zip(t.shape, strides))


def overwrites_grad_leaf(t: torch.Tensor) -> bool:
    """Whether writing into ``t`` would overwrite a leaf that requires grad (``t`` itself, or the tensor it is a view
    of): a parameter, whose values its other users still need; torch's in-place ops refuse it."""
    base = t if t._base is None else t._base
    return base.requires_grad and base.is_leaf


def check_writable_pair(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor):
    """For an op that writes ``a`` and ``b`` in place, each element once: no element may share memory with another,
    within either tensor or across the two. Across them it is refused where an overlap is certain (the same first
    element, or two gapless tensors whose extents meet); strided views interleaved in one buffer, such as q and k
    of a fused QKV projection, pass, as in torch's own overlap checks."""
    for name, t in ((name_a, a), (name_b, b)):
        if shares_elements(t):
            raise ValueError(f"{name} is written in place, but elements of it share memory (shape {tuple(t.shape)}, "
                             f"strides {t.stride()}: stride 0, as from expand()); pass {name}.clone()")
    if (a.device.type == "meta" or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            or a.numel() == 0 or b.numel() == 0):
        return  # (meta tensors have no memory: every one's data pointer is 0)
    (a_start, a_end, a_gapless), (b_start, b_end, b_gapless) = _extent(a), _extent(b)
    if a_start == b_start or (a_gapless and b_gapless and a_start < b_end and b_start < a_end):
        raise ValueError(f"{name_a} and {name_b} are written in place but share memory; pass separate tensors")


def _extent(t: torch.Tensor) -> tuple[int, int, bool]:
    """(first byte, byte past the last element, whether the elements fill that range) of a non-empty tensor."""
    span = 1
    for size, stride in zip(t.shape, t.stride()):
        span += (size - 1) * stride
    start = t.data_ptr()
    return start, start + span * t.element_size(), span == t.numel()


def check_choice(name: str, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


# Whether Triton's interpreter was on when our kernels were defined, as the kernels package read it (once, at
# import: reading the environment on every op call costs ~1 us of host time). The torch-cpu variant never runs
# Triton and has no kernels package.
if BACKEND == "cuda":
    from ._kernels._launch import INTERPRETING as _INTERPRETING
else:
    _INTERPRETING = False


def interpreting() -> bool:
    """True when Triton's CPU interpreter was on at import: CPU tensors then run the Triton kernels too."""
    return _INTERPRETING


def is_fake_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (``FakeTensorMode`` outside torch.compile, as torch's memory and runtime
    estimators use it): shapes without memory. The type test first: it costs ~30 ns, ``is_fake`` ~1 us."""
    return type(t) is not torch.Tensor and is_fake(t)


def runs_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` runs the Triton kernels: in a CUDA variant, for CUDA tensors and, under the
    interpreter, CPU tensors. Otherwise (the torch-cpu variant, CPU tensors) the op's PyTorch implementation runs,
    and so it does for fake tensors, which have no memory for a kernel to read."""
    return (BACKEND == "cuda" and (t.is_cuda or (t.device.type == "cpu" and interpreting()))
            and not is_fake_tensor(t))


def plain_linear(module) -> bool:
    """An ``nn.Linear`` whose forward and backward are exactly ``F.linear(x, weight, bias)``'s on plain tensors: no
    subclass (LoRA, quantised layers), no forward or backward hooks of its own or global ones (FSDP2 sharding it on
    its own, profilers, gradient clipping or masking hooks), no DTensor parameters. A layer that reads the weight
    itself may skip the module only then; anything else must be called as a module, so its forward and hooks run."""
    hooks = nn.modules.module
    global_hooks = (hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
                    or hooks._global_backward_pre_hooks)
    return (type(module) is nn.Linear and not global_hooks and not module._forward_hooks
            and not module._forward_pre_hooks and not module._backward_hooks and not module._backward_pre_hooks
            and all(type(p) in (torch.Tensor, nn.Parameter) for p in module.parameters(recurse=False)))
