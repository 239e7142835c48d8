"""RMSNorm and the fused residual-add RMSNorm: torch ops, autograd, fake kernels and the functional API.

``mode`` picks the numerics of the module being replaced (see ``kernels_src/rms_norm.py`` for the formulas):
``"llama"`` (Llama, Qwen, Mistral: fp32 statistics, cast back before the weight), ``"gemma"`` (Gemma:
``1 + weight``, fp32 throughout) and ``"plain"`` (``torch.nn.RMSNorm``: fp32 throughout).

Output dtype: the input dtype, except in ``"llama"`` mode with a weight of another dtype, where it is the
promoted dtype, as ``weight * hidden.to(input_dtype)`` gives in the reference module.

Inputs and incoming gradients are never written. CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``)
run the Triton kernels; otherwise a plain PyTorch implementation with the same numerics runs, which is what
the ``torch-cpu`` variant uses. A backward under ``create_graph`` (double backward) runs that implementation too,
whose ops autograd records, so the gradients are differentiable in turn (eager mode; the ops under torch.compile
are differentiable once).
"""

import weakref

import torch

from . import _checks
from ._build_info import BACKEND
from ._launch_config import multiprocessor_count, pick
from ._layout import shared_row_layouts
from ._ops import add_op_namespace_prefix

if BACKEND == "cuda":
    from ._kernels import rms_norm as _triton_rms_norm
else:
    _triton_rms_norm = None

MODES = ("llama", "gemma", "plain")
_CONFIG_FAMILY = "rms_norm"


def _output_dtype(x: torch.Tensor, weight: torch.Tensor | None, mode: str) -> torch.dtype:
    if mode == "llama" and weight is not None:
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def _validate(x, weight, residual, eps, mode):
    _checks.check_tensor("x", x, min_ndim=1)
    if x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    if weight is not None:
        _checks.check_tensor("weight", weight, ndim=1)
        if weight.shape[0] != x.shape[-1]:
            raise ValueError(f"weight must have shape ({x.shape[-1]},) to match the hidden size of x, "
                             f"got {tuple(weight.shape)}")
    if residual is not None:
        _checks.check_tensor("residual", residual)
        _checks.check_same_shape("x", x, residual=residual)
        if residual.dtype != x.dtype:
            raise TypeError(f"residual must have the dtype of x ({x.dtype}), got {residual.dtype}")
    _checks.check_same_device("x", x, weight=weight, residual=residual)
    _checks.check_eps(eps)
    _checks.check_choice("mode", mode, MODES)


# ----------------------------------------------------------------------------------------------------------
# Portable PyTorch implementation (torch-cpu variant; CPU tensors without the Triton interpreter).
# ----------------------------------------------------------------------------------------------------------

def _torch_scale(weight, mode):
    w = weight.float()
    return w + 1.0 if mode == "gemma" else w


def _torch_rstd(h, eps):
    """Each row's 1 / sqrt(mean(h**2) + eps), fp32, of shape ``h.shape[:-1]``."""
    return torch.rsqrt(h.float().square().mean(-1) + eps)


def _torch_forward(h, weight, eps, mode, out_dtype):
    """(y, rstd), rstd of shape ``h.shape[:-1]`` in fp32."""
    rstd = _torch_rstd(h, eps)
    x_hat = h.float() * rstd.unsqueeze(-1)
    if mode == "llama":
        x_hat = x_hat.to(h.dtype).float()
    if weight is not None:
        x_hat = x_hat * _torch_scale(weight, mode)
    return x_hat.to(out_dtype), rstd


def _torch_backward(dy, d_residual_out, h, rstd, weight, mode, compute_dw):
    h32, dy32 = h.float(), dy.float()
    rstd = rstd.unsqueeze(-1)
    x_hat = h32 * rstd
    g = dy32 * _torch_scale(weight, mode) if weight is not None else dy32
    dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    if d_residual_out is not None:
        dx = dx + d_residual_out.float()
    dw = None
    if compute_dw:
        seen_by_weight = x_hat.to(h.dtype).float() if mode == "llama" else x_hat
        dw = (dy32 * seen_by_weight).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
    # Contiguous, as the kernels' dx and the fake kernel's: elementwise ops would follow the strides of h and dy.
    return dx.to(h.dtype).contiguous(), dw


# ----------------------------------------------------------------------------------------------------------
# Triton launches.
# ----------------------------------------------------------------------------------------------------------

def _triton_forward(x, weight, residual, eps, mode, out_dtype):
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    # empty_like: a third of the host time of torch.empty(shape, device=..., dtype=...).
    y = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    if n_rows == 0:
        return y, residual_out, rstd
    if residual is not None:
        (x, residual), layouts = shared_row_layouts(x, residual)
        x_layout, r_layout = layouts
    else:
        (x,), layouts = shared_row_layouts(x)
        x_layout, r_layout = layouts[0], None
    align = _triton_rms_norm.row_alignment(x.element_size(), layouts, n_rows, n_cols)
    config = pick(_CONFIG_FAMILY, "forward" if align else "forward_unaligned", x.device, n_cols, x.numel())
    _triton_rms_norm.rms_norm_forward(
        x, x_layout, weight.contiguous() if weight is not None else None, residual, r_layout, y, residual_out, rstd,
        n_rows, n_cols, float(eps), mode,
        block_rows=config["block_rows"], block_cols=config["block_cols"], num_warps=config["num_warps"], align=align,
        two_pass=config.get("two_pass", False))
    return y, residual_out, rstd


def _triton_backward(dy, d_residual_out, h, rstd, weight, eps, mode, compute_dw):
    n_cols = h.shape[-1]
    n_rows = h.numel() // n_cols
    dx = torch.empty_like(h, memory_format=torch.contiguous_format)
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if compute_dw else None
    if n_rows == 0:
        if dw is not None:
            dw.zero_()
        return dx, dw
    tensors = [dy, h] + ([d_residual_out] if d_residual_out is not None else [])
    tensors, layouts = shared_row_layouts(*tensors)
    dy, h = tensors[:2]
    d_residual_out, dr_layout = (tensors[2], layouts[2]) if d_residual_out is not None else (None, None)
    align = _triton_rms_norm.row_alignment(h.element_size(), layouts, n_rows, n_cols)
    config = pick(_CONFIG_FAMILY, "backward" if align else "backward_unaligned", h.device, n_cols)
    _triton_rms_norm.rms_norm_backward(
        dy, layouts[0], h, layouts[1], rstd.contiguous(), weight.contiguous() if weight is not None else None,
        d_residual_out, dr_layout, dx, dw, n_rows, n_cols, float(eps), mode,
        block_rows=config["block_rows"], block_cols=config["block_cols"], num_warps=config["num_warps"],
        num_programs=config["programs_per_sm"] * multiprocessor_count(h.device), align=align)
    return dx, dw


def _forward(x, weight, residual, eps, mode):
    """(y, residual_out, rstd): residual_out = x + residual, or None without a residual; rstd (fp32, shape
    ``x.shape[:-1]``) is what the backward reads instead of reducing each row again."""
    _validate(x, weight, residual, eps, mode)
    out_dtype = _output_dtype(x, weight, mode)
    if _checks.runs_triton(x):
        return _triton_forward(x, weight, residual, eps, mode, out_dtype)
    # A contiguous h gives contiguous outputs, as the kernels' are and as the fake kernels declare them (torch.compile
    # checks their strides): elementwise ops and reductions would follow the strides of x.
    h = (x if residual is None else x + residual).contiguous()
    y, rstd = _torch_forward(h, weight, eps, mode, out_dtype)
    return y, None if residual is None else h, rstd


def _backward_impl(dy, d_residual_out, h, rstd, weight, eps, mode, compute_dw):
    if dy is None:  # only the residual output of the fused form was used
        dy = torch.zeros(h.shape, device=h.device, dtype=h.dtype)
    if _checks.runs_triton(h):
        return _triton_backward(dy, d_residual_out, h, rstd, weight, eps, mode, compute_dw)
    return _torch_backward(dy, d_residual_out, h, rstd, weight, mode, compute_dw)


# ----------------------------------------------------------------------------------------------------------
# Ops (what torch.compile, export and opcheck see).
# ----------------------------------------------------------------------------------------------------------

@torch.library.custom_op(add_op_namespace_prefix("rms_norm"), mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): rstd (fp32, shape ``x.shape[:-1]``, not differentiable) is what the backward reads."""
    y, _, rstd = _forward(x, weight, None, eps, mode)
    return y, rstd


def _fake_rstd(x):
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


@_rms_norm_op.register_fake
def _(x, weight, eps, mode):
    _validate(x, weight, None, eps, mode)
    return x.new_empty(x.shape, dtype=_output_dtype(x, weight, mode)), _fake_rstd(x)


@torch.library.custom_op(add_op_namespace_prefix("fused_add_rms_norm"), mutates_args=())
def _fused_add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                           mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x + residual, rstd), rstd as in ``rms_norm``."""
    return _forward(x, weight, residual, eps, mode)


@_fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, mode):
    _validate(x, weight, residual, eps, mode)
    return x.new_empty(x.shape, dtype=_output_dtype(x, weight, mode)), x.new_empty(x.shape), _fake_rstd(x)


@torch.library.custom_op(add_op_namespace_prefix("rms_norm_backward"), mutates_args=())
def _rms_norm_backward_op(dy: torch.Tensor | None, d_residual_out: torch.Tensor | None, h: torch.Tensor,
                          rstd: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: str,
                          compute_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) for the normalised input ``h`` and the forward's ``rstd``; dw is an empty tensor unless
    ``compute_dw``."""
    dx, dw = _backward_impl(dy, d_residual_out, h, rstd, weight, eps, mode, compute_dw)
    return dx, dw if dw is not None else h.new_empty(0)


@_rms_norm_backward_op.register_fake
def _(dy, d_residual_out, h, rstd, weight, eps, mode, compute_dw):
    dw = weight.new_empty(weight.shape) if compute_dw else h.new_empty(0)
    return h.new_empty(h.shape), dw


def _backward(ctx, dy, d_residual_out, weight_input_index):
    h, rstd, weight = ctx.saved_tensors
    compute_dw = weight is not None and ctx.needs_input_grad[weight_input_index]
    dx, dw = _rms_norm_backward_op(dy, d_residual_out, h, rstd, weight, ctx.eps, ctx.mode, compute_dw)
    return dx, dw if compute_dw else None


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps, mode = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, output[1], weight)
    ctx.eps, ctx.mode = eps, mode


def _rms_norm_backward(ctx, dy, _d_rstd):
    dx, dw = _backward(ctx, dy, None, weight_input_index=1)
    return dx, dw, None, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)


def _fused_add_setup_context(ctx, inputs, output):
    _, _, weight, eps, mode = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(output[1], output[2], weight)
    ctx.eps, ctx.mode = eps, mode


def _fused_add_backward(ctx, dy, d_residual_out, _d_rstd):
    dh, dw = _backward(ctx, dy, d_residual_out, weight_input_index=2)
    # h = x + residual, so both inputs receive dh.
    return dh, dh, dw, None, None


_fused_add_rms_norm_op.register_autograd(_fused_add_backward, setup_context=_fused_add_setup_context)


class _EagerRMSNorm(torch.autograd.Function):
    """The eager path: the same forward and backward as the ops, without the dispatcher round trips.

    Calling a ``custom_op`` from eager Python costs tens of microseconds per call in the dispatcher and in
    ``torch._library`` (measured on the H200 host: ~100 us for the forward, far more for the backward), which
    dominates at the token counts of real layers. Outside ``torch.compile`` the public functions therefore
    run this Function; under compile they call the registered ops, whose fake and autograd registrations
    Dynamo uses.
    """

    @staticmethod
    def forward(ctx, x, weight, residual, eps, mode):
        y, residual_out, rstd = _forward(x, weight, residual, eps, mode)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x if residual is None else residual_out, rstd, weight)
        ctx.eps, ctx.mode, ctx.fused = eps, mode, residual is not None
        return y if residual is None else (y, residual_out)

    @staticmethod
    def backward(ctx, dy, d_residual_out=None):
        h, rstd, weight = ctx.saved_tensors
        compute_dw = weight is not None and ctx.needs_input_grad[1]
        if torch.is_grad_enabled():
            # create_graph (double backward): the gradients must be differentiable in turn, so they come from the
            # portable implementation, whose ops autograd records, with rstd recomputed from h: the saved one is a
            # constant to autograd, and its dependence on h is part of the second derivative.
            dy = torch.zeros_like(h) if dy is None else dy
            dx, dw = _torch_backward(dy, d_residual_out, h, _torch_rstd(h, ctx.eps), weight, ctx.mode, compute_dw)
        else:
            dx, dw = _backward_impl(dy, d_residual_out, h, rstd, weight, ctx.eps, ctx.mode, compute_dw)
        # h = x + residual, so both inputs of the fused form receive dx.
        return dx, dw, dx if ctx.fused else None, None, None


# ----------------------------------------------------------------------------------------------------------
# Outputs that a consumer may recompute instead of keeping.
# ----------------------------------------------------------------------------------------------------------

_SOURCE = "_fused_kernels_rms_norm_source"


def _record_source(y, x, weight, eps, mode):
    """Marks ``y`` as ``rms_norm(x, weight, eps, mode)`` (the eager, non-fused form): a layer that keeps its input
    for the backward, such as the MLP layers (``swiglu.gated_mlp``), can keep ``x`` instead, which this norm keeps
    anyway, and recompute ``y`` (``output_source``, ``recompute_output``). ``x`` is held weakly: the mark never
    keeps it alive. Only for a ``y`` that requires grad: otherwise the norm keeps nothing for a backward (no_grad,
    inference mode, inputs that need no gradient), and a consumer keeping ``x`` in place of ``y`` would refuse a
    later in-place change of ``x`` that torch's modules allow; inference tensors have no version counter at all."""
    setattr(y, _SOURCE, (weakref.ref(x), _versions(y, x, weight), weight, eps, mode))


def _versions(y, x, weight):
    """The version counters of ``y``, ``x`` and the weight, which an in-place change of any of them bumps (the
    weight's too: recomputing with a weight modified since would not give ``y``)."""
    return y._version, x._version, None if weight is None else weight._version


def output_source(y: torch.Tensor):
    """``(x, weight, eps, mode)`` such that ``recompute_output`` gives ``y`` bit for bit, or None: when ``y`` is
    not an output of ``rms_norm``, or it, its input or its weight was modified in place since, or the input is
    gone."""
    source = getattr(y, _SOURCE, None)
    if source is None:
        return None
    x_ref, versions, weight, eps, mode = source
    x = x_ref()
    if x is None or _versions(y, x, weight) != versions:
        return None
    return x, weight, eps, mode


def recompute_output(x, weight, eps, mode) -> torch.Tensor:
    """``rms_norm``'s output again, from the same input: the same kernel and launch, so the same bits."""
    return _forward(x, weight, None, eps, mode)[0]


# ----------------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             mode: str = "llama") -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` and scale it by ``weight``.

    Args:
        x: ``(..., hidden)`` float32/float16/bfloat16 tensor, any strides.
        weight: optional ``(hidden,)`` scale (``1 + weight`` in ``"gemma"`` mode).
        eps: added to the mean square before the reciprocal square root.
        mode: ``"llama"``, ``"gemma"`` or ``"plain"`` (see the module docstring).

    Differentiable in ``x`` and ``weight``.
    """
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, eps, mode)[0]
    y = _EagerRMSNorm.apply(x, weight, None, eps, mode)
    if y.requires_grad:  # only then does the norm keep x (see _record_source)
        _record_source(y, x, weight, eps, mode)
    return y


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                       eps: float = 1e-6, mode: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (rounded to the input dtype), then ``rms_norm(h)``; returns ``(normed, h)``.

    The pre-norm block step ``residual = hidden + residual; hidden = norm(residual)`` in one pass. Neither
    input is modified. Differentiable in ``x``, ``residual`` and ``weight``.
    """
    if residual is None:  # the shared eager path would return rms_norm(x) alone, which `y, h = ...` splits by rows
        raise TypeError("residual must be a torch.Tensor of x's shape and dtype, got None (use rms_norm without one)")
    if torch.compiler.is_compiling():
        y, h, _ = _fused_add_rms_norm_op(x, residual, weight, eps, mode)
        return y, h
    return _EagerRMSNorm.apply(x, weight, residual, eps, mode)
