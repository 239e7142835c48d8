"""Gated activations of LLM MLPs (SwiGLU, GeGLU): torch ops, autograd, fake kernels and the functional API.

``act(gate) * up`` for ``act`` in SiLU, exact GELU and tanh-approximated GELU, from two tensors
(``swiglu``, ``geglu``) or from one fused ``gate_up`` tensor whose last dimension holds ``[gate | up]``
(``silu_and_mul``, ``gelu_and_mul``; the output of a fused ``gate_up_proj``), read in place through its two
halves. Math runs in fp32; outputs and gradients are in the input dtype, rounded once. The backward recomputes
the activation from ``gate``: only the inputs are kept for it. The fused form's gradient is one
``(..., 2 * I)`` tensor written directly by the kernel.

Inputs and incoming gradients are never written. CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``)
run the Triton kernels; otherwise a plain PyTorch implementation with the same numerics runs, which is what
the ``torch-cpu`` variant uses. A backward under ``create_graph`` (double backward) runs that implementation too,
whose ops autograd records, so the gradients are differentiable in turn (eager mode; the ops under torch.compile
are differentiable once).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _checks
from ._build_info import BACKEND
from ._launch_config import pick
from ._layout import shared_row_layouts
from ._ops import add_op_namespace_prefix
from .rms_norm import output_source, recompute_output, rms_norm

if BACKEND == "cuda":
    from ._kernels import swiglu as _triton_swiglu
else:
    _triton_swiglu = None

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh"}  # geglu's `approximate`, as in F.gelu
_CONFIG_FAMILY = "swiglu"


def _validate(gate, up, activation):
    """``up`` None: ``gate`` is the fused ``gate_up`` tensor."""
    _checks.check_choice("activation", activation, ACTIVATIONS)
    if up is None:
        _checks.check_tensor("gate_up", gate, min_ndim=1)
        if gate.shape[-1] % 2:
            raise ValueError(f"gate_up must have an even last dimension holding the gate and up halves, got shape "
                             f"{tuple(gate.shape)}")
        return
    _checks.check_tensor("gate", gate, min_ndim=1)
    _checks.check_tensor("up", up)
    _checks.check_same_shape("gate", gate, up=up)
    if up.dtype != gate.dtype:
        raise TypeError(f"up must have the dtype of gate ({gate.dtype}), got {up.dtype}")
    _checks.check_same_device("gate", gate, up=up)


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up views of a fused tensor (no copy)."""
    width = gate_up.shape[-1] // 2
    return gate_up[..., :width], gate_up[..., width:]


def _approximation(approximate: str) -> str:
    _checks.check_choice("approximate", approximate, tuple(APPROXIMATIONS))
    return APPROXIMATIONS[approximate]


# ----------------------------------------------------------------------------------------------------------
# Portable PyTorch implementation (torch-cpu variant; CPU tensors without the Triton interpreter), with the
# kernels' formulas (kernels_src/swiglu.py explains them).
# ----------------------------------------------------------------------------------------------------------

_TANH_SCALE = 2.0 * math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715


def _torch_activation(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(g) and act'(g) for fp32 g."""
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(g * math.sqrt(0.5)))
        return g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2.0 * math.pi)
    if activation == "silu":
        s = torch.sigmoid(g)
        act = g * s
        return act, s + act * (1.0 - s)
    s = torch.sigmoid(_TANH_SCALE * (g + _TANH_CUBIC * g.pow(3)))
    act = g * s
    return act, s + act * (1.0 - s) * (_TANH_SCALE * (1.0 + 3.0 * _TANH_CUBIC * g * g))


# Outputs are made contiguous, as the kernels' are and as the fake kernels declare them (torch.compile checks their
# strides): elementwise ops would follow the strides of the inputs.

def _torch_forward(gate, up, activation):
    return (_torch_activation(gate.float(), activation)[0] * up.float()).to(gate.dtype).contiguous()


def _torch_backward(dout, gate, up, activation):
    dy = dout.float()
    act, d_act = _torch_activation(gate.float(), activation)
    return (dy * up.float() * d_act).to(gate.dtype).contiguous(), (dy * act).to(gate.dtype).contiguous()


# ----------------------------------------------------------------------------------------------------------
# Triton launches.
# ----------------------------------------------------------------------------------------------------------

def _triton_forward(gate, up, activation):
    n_cols = gate.shape[-1]
    # empty_like: a third of the host time of torch.empty(shape, device=..., dtype=...).
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    n_elements = out.numel()
    if n_elements == 0:
        return out
    (gate, up), (gate_layout, up_layout) = shared_row_layouts(gate, up)
    # By the call's size too: up to a few million elements (data the L2 cache can hold) a tile of 16 elements per
    # thread beat one of 8 by 3-10% on the H200, above it lost by up to 1% (results/h200/swiglu_tiles_by_size.txt).
    config = pick(_CONFIG_FAMILY, "forward", out.device, n_cols, n_elements)
    _triton_swiglu.gated_forward(gate, gate_layout, up, up_layout, out, n_cols, n_elements // n_cols, n_cols,
                                 activation, **config)
    return out


def _triton_backward(dout, gate, up, d_gate, d_up, d_stride_row, activation, product_into_dout=False):
    n_cols = gate.shape[-1]
    if d_gate.numel() == 0:
        return
    (dout, gate, up), layouts = shared_row_layouts(dout, gate, up)
    config = pick(_CONFIG_FAMILY, "backward", gate.device, n_cols)
    _triton_swiglu.gated_backward(dout, layouts[0], gate, layouts[1], up, layouts[2], d_gate, d_up, d_stride_row,
                                  d_gate.numel() // n_cols, n_cols, activation, **config,
                                  product_into_dout=product_into_dout)


def _forward(gate, up, activation):
    """act(gate) * up; ``up`` None: ``gate`` is the fused ``gate_up`` tensor."""
    _validate(gate, up, activation)
    if up is None:
        gate, up = _halves(gate)
    if _checks.runs_triton(gate):
        return _triton_forward(gate, up, activation)
    return _torch_forward(gate, up, activation)


def _backward(dout, gate, up, activation, product_into_dout=False, grads_into_inputs=False):
    """(d_gate, d_up), two new tensors of gate's shape. ``product_into_dout``: also overwrite ``dout`` (a contiguous
    tensor the caller owns) with the forward's output ``act(gate) * up``, bit for bit, from the same pass.
    ``grads_into_inputs``: write d_gate over ``gate`` and d_up over ``up`` instead (contiguous tensors the caller owns
    and reads no more; each element is read before the same program writes it) and return them."""
    if _checks.runs_triton(gate):
        if grads_into_inputs:
            d_gate, d_up = gate, up
        else:
            d_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
            d_up = torch.empty_like(d_gate)
        _triton_backward(dout, gate, up, d_gate, d_up, gate.shape[-1], activation, product_into_dout)
        return d_gate, d_up
    grads = _torch_backward(dout, gate, up, activation)
    if product_into_dout:
        dout.copy_(_torch_forward(gate, up, activation))
    if grads_into_inputs:
        gate.copy_(grads[0])
        up.copy_(grads[1])
        return gate, up
    return grads


def _backward_fused(dout, gate_up, activation):
    """The gradient of the fused input: one (..., 2I) tensor, its halves written by the kernel in place."""
    gate, up = _halves(gate_up)
    if _checks.runs_triton(gate_up):
        d_gate_up = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
        d_gate, d_up = _halves(d_gate_up)
        _triton_backward(dout, gate, up, d_gate, d_up, gate_up.shape[-1], activation)
        return d_gate_up
    return torch.cat(_torch_backward(dout, gate, up, activation), dim=-1)


# ----------------------------------------------------------------------------------------------------------
# Ops (what torch.compile, export and opcheck see).
# ----------------------------------------------------------------------------------------------------------

@torch.library.custom_op(add_op_namespace_prefix("gated_activation"), mutates_args=())
def _gated_activation_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return _forward(gate, up, activation)


@_gated_activation_op.register_fake
def _(gate, up, activation):
    _validate(gate, up, activation)
    return gate.new_empty(gate.shape)


@torch.library.custom_op(add_op_namespace_prefix("gated_activation_fused"), mutates_args=())
def _gated_activation_fused_op(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return _forward(gate_up, None, activation)


@_gated_activation_fused_op.register_fake
def _(gate_up, activation):
    _validate(gate_up, None, activation)
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op(add_op_namespace_prefix("gated_activation_backward"), mutates_args=())
def _gated_activation_backward_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                                  activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dout, gate, up, activation)


@_gated_activation_backward_op.register_fake
def _(dout, gate, up, activation):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


@torch.library.custom_op(add_op_namespace_prefix("gated_activation_fused_backward"), mutates_args=())
def _gated_activation_fused_backward_op(dout: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return _backward_fused(dout, gate_up, activation)


@_gated_activation_fused_backward_op.register_fake
def _(dout, gate_up, activation):
    return gate_up.new_empty(gate_up.shape)


def _setup_context(ctx, inputs, output):
    *tensors, activation = inputs
    ctx.save_for_backward(*tensors)
    ctx.activation = activation


def _op_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    d_gate, d_up = _gated_activation_backward_op(dout, gate, up, ctx.activation)
    return d_gate, d_up, None


def _fused_op_backward(ctx, dout):
    (gate_up,) = ctx.saved_tensors
    return _gated_activation_fused_backward_op(dout, gate_up, ctx.activation), None


_gated_activation_op.register_autograd(_op_backward, setup_context=_setup_context)
_gated_activation_fused_op.register_autograd(_fused_op_backward, setup_context=_setup_context)


class _EagerGatedActivation(torch.autograd.Function):
    """The eager path: the same forward and backward as the ops, without the dispatcher round trips (a
    ``custom_op`` call from eager Python costs tens of microseconds; see ``rms_norm._EagerRMSNorm``). ``up``
    None: ``gate`` is the fused ``gate_up`` tensor."""

    @staticmethod
    def forward(ctx, gate, up, activation):
        out = _forward(gate, up, activation)
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph (double backward): the gradients must be differentiable in turn, so they come from the
            # portable implementation, whose ops autograd records.
            if up is None:
                return torch.cat(_torch_backward(dout, *_halves(gate), ctx.activation), dim=-1), None, None
            return *_torch_backward(dout, gate, up, ctx.activation), None
        if up is None:
            return _backward_fused(dout, gate, ctx.activation), None, None
        d_gate, d_up = _backward(dout, gate, up, ctx.activation)
        return d_gate, d_up, None


def _gated(gate, up, activation):
    if torch.compiler.is_compiling():
        if up is None:
            return _gated_activation_fused_op(gate, activation)
        return _gated_activation_op(gate, up, activation)
    return _EagerGatedActivation.apply(gate, up, activation)


# ----------------------------------------------------------------------------------------------------------
# The whole gated MLP, for the Hub layers.
# ----------------------------------------------------------------------------------------------------------

def _graph_kept() -> bool:
    """Whether the running backward keeps the graph for another one (``retain_graph``, ``create_graph``), so that
    the tensors saved for it must stay as they are. Where torch cannot tell (no such query), it is assumed to."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return query is None or query()


class _EagerGatedMLP(torch.autograd.Function):
    """``down(act(gate(x)) * up(x))`` keeping ``x``, ``gate(x)`` and ``up(x)`` for the backward, but not the
    activation's output, which the backward's gradient pass recomputes (bit for bit the forward's) for the down
    projection's weight gradient. Module by module, ``down_proj`` would keep that ``(tokens, intermediate)`` tensor
    as its input: one per layer, the largest activation of a training step. Gradients are what the modules give
    (``nn.Linear``'s, in the input dtype).

    When ``x`` is the output of our RMSNorm (the pre-MLP norm of Llama/Qwen blocks), the norm's input is kept
    instead, which the norm keeps for its own backward anyway, and ``x`` is recomputed from it for the weight
    gradients: one ``(tokens, hidden)`` tensor per layer fewer (Llama-3-8B at 32k tokens: 256 MiB a layer)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation):
        gate = F.linear(x, w_gate, b_gate)
        up = F.linear(x, w_up, b_up)
        source = output_source(x)
        # The biases (parameters: nothing more is kept) only for a backward under create_graph, which runs the
        # forward again (_differentiable_mlp_backward).
        if source is None:
            ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down, None, b_gate, b_up, b_down)
        else:
            norm_input, norm_weight, *ctx.norm_options = source
            ctx.save_for_backward(norm_input, gate, up, w_gate, w_up, w_down, norm_weight, b_gate, b_up, b_down)
        ctx.recompute_x = source is not None
        ctx.activation = activation
        return F.linear(_forward(gate, up, activation), w_down, b_down)

    @staticmethod
    def backward(ctx, dout):
        x, gate, up, w_gate, w_up, w_down, norm_weight, *biases = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _differentiable_mlp_backward(ctx, dout, x, (w_gate, w_up, w_down), biases, norm_weight)
        need_x, need_w_gate, need_w_up, need_w_down, need_b_gate, need_b_up, need_b_down, _ = ctx.needs_input_grad
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731 - (tokens, features) views for the weight GEMMs
        d_b_down = rows(dout).sum(0) if need_b_down else None
        # The gradient pass also recomputes the activation's output, over its incoming gradient d_hidden once read:
        # one pass over gate and up instead of two (H200, Qwen3-0.6B training step: the recomputing launch took
        # 3.9 of the 14.3 ms of gated-activation kernels per step). Unless the graph is kept for another backward,
        # it writes the gradients over gate and up, which nothing reads after it: this backward then allocates one
        # (tokens, intermediate) tensor instead of three (the Llama-3-8B step's memory peak was here, in its first
        # MLP backward).
        d_hidden = dout @ w_down
        d_gate, d_up = _backward(d_hidden, gate, up, ctx.activation, product_into_dout=need_w_down,
                                 grads_into_inputs=not _graph_kept() and gate.is_contiguous() and up.is_contiguous())
        d_w_down = rows(dout).t() @ rows(d_hidden) if need_w_down else None
        del d_hidden  # freed before the GEMMs below allocate theirs
        d_x = None
        if need_x:
            d_x = d_gate @ w_gate
            rows(d_x).addmm_(rows(d_up), w_up)  # summed in the GEMM's epilogue: no (tokens, hidden) temporary
        if ctx.recompute_x and (need_w_gate or need_w_up):
            x = recompute_output(x, norm_weight, *ctx.norm_options)
        d_w_gate = rows(d_gate).t() @ rows(x) if need_w_gate else None
        d_w_up = rows(d_up).t() @ rows(x) if need_w_up else None
        d_b_gate = rows(d_gate).sum(0) if need_b_gate else None
        d_b_up = rows(d_up).sum(0) if need_b_up else None
        return d_x, d_w_gate, d_w_up, d_w_down, d_b_gate, d_b_up, d_b_down, None


def _differentiable_mlp_backward(ctx, dout, x, weights, biases, norm_weight):
    """``_EagerGatedMLP``'s gradients under create_graph (double backward), where they must be differentiable in
    turn: the forward again, through ops that autograd records, and autograd's gradients of it."""
    if ctx.recompute_x:
        # Differentiably, through the norm's graph: a norm output is recomputed only where it required grad.
        x = rms_norm(x, norm_weight, *ctx.norm_options)
    (w_gate, w_up, w_down), (b_gate, b_up, b_down) = weights, biases
    out = F.linear(_gated(F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up), ctx.activation), w_down, b_down)
    inputs = (x, *weights, *biases)
    needs = ctx.needs_input_grad[:len(inputs)]
    grads = iter(torch.autograd.grad(out, [t for t, need in zip(inputs, needs) if need], dout, create_graph=True))
    return *(next(grads) if need else None for need in needs), None


def gated_mlp(x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module,
              activation: str) -> torch.Tensor:
    """``down_proj(act(gate_proj(x)) * up_proj(x))``. In eager mode, with plain ``nn.Linear`` projections and no
    autocast, one Function that does not keep the activation's output (``_EagerGatedMLP``); otherwise the modules
    are called (``torch.compile`` plans its own memory, autocast decides its own dtypes)."""
    lean = (not torch.compiler.is_compiling() and not torch.is_autocast_enabled(x.device.type)
            and all(_checks.plain_linear(m) for m in (gate_proj, up_proj, down_proj)))
    if not lean:
        return down_proj(_gated(gate_proj(x), up_proj(x), activation))
    return _EagerGatedMLP.apply(x, gate_proj.weight, up_proj.weight, down_proj.weight, gate_proj.bias,
                                up_proj.bias, down_proj.bias, activation)


# ----------------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------------

def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the SwiGLU of Llama, Qwen and Mistral MLPs (``act_fn(gate_proj(x)) * up_proj(x)``).

    Args:
        gate, up: ``(..., I)`` float32/float16/bfloat16 tensors of one shape, dtype and device; any strides.

    Returns a new ``(..., I)`` tensor in the input dtype. Differentiable in ``gate`` and ``up``.
    """
    return _gated(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate, approximate) * up``: GeGLU. ``approximate="tanh"`` is the tanh approximation of Gemma's
    ``gelu_pytorch_tanh``; ``"none"`` the exact erf GELU (``F.gelu``'s convention).

    Args and result as in ``swiglu``.
    """
    return _gated(gate, up, _approximation(approximate))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]`` for a ``(..., 2I)`` tensor, e.g. the output of a fused
    ``gate_up_proj``; the halves are read in place (no split, no copy).

    Returns a new ``(..., I)`` tensor in the input dtype. Differentiable; the gradient is one ``(..., 2I)``
    tensor.
    """
    return _gated(gate_up, None, "silu")


def gelu_and_mul(gate_up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate_up[..., :I], approximate) * gate_up[..., I:]``: the fused-input form of ``geglu``."""
    return _gated(gate_up, None, _approximation(approximate))
