"""Gated activations (SwiGLU, GeGLU) from two tensors and from one fused gate_up tensor: numerics, layouts,
gradients, errors, torch.library integration, the torch-cpu variant and the MLP/activation layers.

The same tests run on the CPU (Triton interpreter, small shapes) and compiled on a GPU (realistic shapes).
"""

import copy
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels import KernelizeFallback, LocalLayerRepository, Mode, kernelize, replace_kernel_forward_from_hub
from kernels import use_kernel_mapping

from conftest import DEVICE, ON_GPU, REPO_ROOT
from model_helpers import VARIANTS, assert_same_step, loss_and_grads, variant_paths
from numerics import assert_close_ratio, rel_err

if str(REPO_ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "tools"))  # for fused_kernels_tools.reference_layers

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (public two-tensor function, public fused function, keyword arguments) per activation.
ACTIVATIONS = {
    "silu": ("swiglu", "silu_and_mul", {}),
    "gelu": ("geglu", "gelu_and_mul", {"approximate": "none"}),
    "gelu_tanh": ("geglu", "gelu_and_mul", {"approximate": "tanh"}),
}

# Widths covering one-tile rows, odd sizes and several column tiles of the device's launch table. Rows of a width that
# is not a multiple of 16 with a total that is ((8, 512, 3000), (16, 300)) are launched as one long row when gapless,
# and so, in the forward, are those whose width is ((1024, 14336), (2, 3, 11008), (64, 20000), (3, 5, 96)) where the
# entry sets ``one_row``. The forward's entries also go by the call's size (``max_elements``): the shapes reach every
# forward entry of the device's table (test_the_shapes_reach_every_forward_entry).
if ON_GPU:
    SHAPES = [(4096, 4096), (3, 1000, 2048), (17, 8193), (1024, 14336), (2, 3, 11008), (64, 20000), (8, 512, 3000)]
else:
    SHAPES = [(5, 1), (3, 7), (2, 3, 64), (9, 300), (3, 515), (16, 300), (3, 5, 96)]


# ----------------------------------------------------------------------------------------------------------
# References, written independently of the kernels.
# ----------------------------------------------------------------------------------------------------------

def reference_float64(gate, up, activation):
    """The exact function in float64, from the textbook formulas."""
    g = gate.double()
    if activation == "silu":
        act = g / (1.0 + torch.exp(-g))
    elif activation == "gelu":
        act = 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))
    else:
        act = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    return act * up.double()


def reference_module(gate, up, activation):
    """What the replaced module computes in the input dtype (`act_fn(gate) * up`): the error baseline."""
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="none" if activation == "gelu" else "tanh") * up


def leaf(t):
    """``t`` as a leaf that requires grad, with its strides (``clone`` would make a row slice contiguous)."""
    return t.detach().requires_grad_(True)


def run_ours(fk, activation, gate, up, fused, dout):
    """Forward + backward through the public function; returns (out, d_gate, d_up, grad of the fused input)."""
    two_tensor, fused_name, kwargs = ACTIVATIONS[activation]
    if fused:
        gate_up = leaf(torch.cat([gate, up], dim=-1))
        out = getattr(fk, fused_name)(gate_up, **kwargs)
        out.backward(dout)
        width = gate.shape[-1]
        return out, gate_up.grad[..., :width], gate_up.grad[..., width:], gate_up.grad
    gate, up = leaf(gate), leaf(up)
    out = getattr(fk, two_tensor)(gate, up, **kwargs)
    out.backward(dout)
    return out, gate.grad, up.grad, None


def make_inputs(shape, dtype, device=DEVICE):
    # Gates up to about +-4 cover the activations' curved region and both tails.
    gate = 2.0 * torch.randn(shape, device=device, dtype=torch.float32)
    up = torch.randn(shape, device=device, dtype=torch.float32)
    return gate.to(dtype), up.to(dtype)


def check_against_references(fk, gate, up, activation, dout=None):
    """Our outputs and gradients against float64, within a small factor of PyTorch's own error; inputs untouched.
    ``gate``/``up`` may be any strided views (two-tensor form)."""
    dtype = gate.dtype
    dout = torch.randn(gate.shape, device=gate.device, dtype=dtype) if dout is None else dout
    before = [t.clone() for t in (gate, up, dout)]

    two_tensor, _, kwargs = ACTIVATIONS[activation]
    g, u = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)  # leaves with the views' strides
    out = getattr(fk, two_tensor)(g, u, **kwargs)
    out.backward(dout)
    for b, after in zip(before, (gate, up, dout)):
        assert torch.equal(b, after), "an input or incoming gradient was modified"
    compare(out, g.grad, u.grad, gate, up, dout, activation)


def compare(out, d_gate, d_up, gate, up, dout, activation):
    dtype = gate.dtype
    g64, u64 = leaf(gate.double()), leaf(up.double())
    ref = reference_float64(g64, u64, activation)
    ref.backward(dout.double())
    gb, ub = leaf(gate), leaf(up)
    base = reference_module(gb, ub, activation)
    base.backward(dout)

    assert out.dtype == dtype and out.shape == gate.shape and out.is_contiguous()
    assert d_gate.dtype == dtype and d_up.dtype == dtype
    assert_close_ratio("out", out, base, ref.detach(), 2.0, dtype)
    assert_close_ratio("d_gate", d_gate, gb.grad, g64.grad, 3.0, dtype)
    assert_close_ratio("d_up", d_up, ub.grad, u64.grad, 3.0, dtype)


# ----------------------------------------------------------------------------------------------------------
# Numerics.
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [False, True], ids=["two_tensors", "fused"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_references(fk, poisoned_empty, activation, dtype, shape, fused):
    gate, up = make_inputs(shape, dtype)
    dout = torch.randn(shape, device=DEVICE, dtype=dtype)
    inputs_before = [t.clone() for t in (gate, up, dout)]
    out, d_gate, d_up, d_gate_up = run_ours(fk, activation, gate, up, fused, dout)
    for before, after in zip(inputs_before, (gate, up, dout)):
        assert torch.equal(before, after), "an input or incoming gradient was modified"
    if fused:
        # One (..., 2I) gradient, written whole by the kernel.
        assert d_gate_up.shape == (*shape[:-1], 2 * shape[-1]) and d_gate_up.is_contiguous()
    compare(out, d_gate, d_up, gate, up, dout, activation)


# Strided views the kernels must read in place.
LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed_leading": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
    "row_slice_of_wider": lambda t: torch.cat([t, t], dim=-1)[..., : t.shape[-1]],
    "column_stride_2": lambda t: torch.stack([t, t], dim=-1)[..., 0],
    "three_groups": lambda t: t.permute(2, 1, 0, 3).contiguous().permute(2, 1, 0, 3),
}
STRIDED_SHAPE = (4, 64, 8, 4096) if ON_GPU else (3, 4, 5, 200)


def test_the_shapes_reach_both_sides_of_each_size_limit(fk):
    """Where the device's forward entries go by the call's size (``max_elements``), SHAPES reach the entry for small
    calls and the one for larger calls of the same rows, so test_matches_references runs both tiles."""
    config = fk._launch_config
    entries = config.device_entries("swiglu", "forward", torch.device(DEVICE))
    reached = [config.select_entry(entries, shape[-1], math.prod(shape)) for shape in SHAPES]
    limited = [i for i, entry in enumerate(entries) if "max_elements" in entry]
    for i in limited:
        larger = next(j for j in range(i + 1, len(entries))
                      if entries[j]["max_cols"] == entries[i]["max_cols"] and "max_elements" not in entries[j])
        for side in (i, larger):
            assert config.select_entry([entries[side]], 1, 1) in reached, entries[side]


@pytest.mark.parametrize("gate_layout, up_layout", [
    ("transposed_leading", "transposed_leading"), ("row_slice_of_wider", "contiguous"),
    ("contiguous", "column_stride_2"), ("three_groups", "transposed_leading"), ("column_stride_2", "three_groups"),
])
def test_strided_inputs(fk, poisoned_empty, gate_layout, up_layout):
    gate, up = make_inputs(STRIDED_SHAPE, torch.bfloat16)
    check_against_references(fk, LAYOUTS[gate_layout](gate), LAYOUTS[up_layout](up), "silu")


@pytest.mark.parametrize("layout", ["transposed_leading", "row_slice_of_wider", "column_stride_2"])
def test_strided_fused_input(fk, poisoned_empty, layout):
    """A fused gate_up that is itself a strided view: the halves keep its strides."""
    gate, up = make_inputs(STRIDED_SHAPE, torch.bfloat16)
    gate_up = LAYOUTS[layout](torch.cat([gate, up], dim=-1)).requires_grad_(True)
    before = gate_up.detach().clone()
    out = fk.gelu_and_mul(gate_up, approximate="tanh")
    dout = torch.randn(out.shape, device=DEVICE, dtype=out.dtype)
    out.backward(dout)
    assert torch.equal(gate_up.detach(), before)
    width = gate.shape[-1]
    compare(out, gate_up.grad[..., :width], gate_up.grad[..., width:], gate, up, dout, "gelu_tanh")


def test_strided_incoming_gradient(fk):
    gate, up = make_inputs((6, 8, 300), torch.float32)
    dout = torch.randn(8, 6, 600, device=DEVICE).transpose(0, 1)[..., :300]
    contiguous = run_ours(fk, "gelu", gate, up, True, dout.contiguous())
    strided = run_ours(fk, "gelu", gate, up, True, dout)
    torch.testing.assert_close(strided[3], contiguous[3], rtol=0, atol=0)


@settings(max_examples=12 if not ON_GPU else 40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    leading=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    width=st.integers(1, 700 if not ON_GPU else 20000),
    dtype=st.sampled_from(DTYPES),
    activation=st.sampled_from(list(ACTIVATIONS)),
    gate_layout=st.sampled_from(["contiguous", "row_slice_of_wider", "column_stride_2"]),
    up_layout=st.sampled_from(["contiguous", "row_slice_of_wider", "column_stride_2"]),
)
def test_property_random_shapes(fk, leading, width, dtype, activation, gate_layout, up_layout):
    torch.manual_seed(len(leading) * 100003 + width)
    gate, up = make_inputs((*leading, width), dtype)
    check_against_references(fk, LAYOUTS[gate_layout](gate), LAYOUTS[up_layout](up), activation)


def test_empty_inputs(fk):
    for shape in [(0, 3, 64), (4, 0)]:
        gate_up = torch.randn(*shape[:-1], 2 * shape[-1], device=DEVICE, requires_grad=True)
        out = fk.silu_and_mul(gate_up)
        assert out.shape == shape
        out.sum().backward()
        assert gate_up.grad.shape == gate_up.shape


def test_gradient_for_one_input_only(fk):
    gate = torch.randn(5, 64, device=DEVICE)
    up = torch.randn(5, 64, device=DEVICE, requires_grad=True)
    fk.swiglu(gate, up).sum().backward()
    assert rel_err(up.grad, F.silu(gate.double())) < 1e-6


def test_backward_twice(fk):
    """Nothing saved for the backward is overwritten by it (retain_graph)."""
    gate_up = torch.randn(7, 2 * 96, device=DEVICE, requires_grad=True)
    out = fk.silu_and_mul(gate_up)
    out.sum().backward(retain_graph=True)
    first = gate_up.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(gate_up.grad, 2 * first, rtol=0, atol=0)


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
@pytest.mark.parametrize("fused", [False, True], ids=["two_tensors", "fused"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_double_backward(request, module, activation, fused):
    """Under create_graph the gradients are differentiable in turn (gradient penalties, Hessian-vector products):
    the derivatives of a penalty on the gate and up gradients, in gate, up and the incoming gradient, match
    float64."""
    fk = request.getfixturevalue(module)
    two_tensor, fused_name, kwargs = ACTIVATIONS[activation]
    gate, up = make_inputs((5, 67), torch.float32)
    dout = torch.randn(gate.shape, device=DEVICE)
    probes = [torch.randn_like(gate), torch.randn_like(up)]

    def penalty_gradients(forward, gate, up, dout):
        first = torch.autograd.grad(forward(gate, up), (gate, up), dout, create_graph=True)
        penalty = sum((g * p.to(g.dtype)).sum() for g, p in zip(first, probes))
        return torch.autograd.grad(penalty, (gate, up, dout))

    def ours(gate, up):
        if fused:
            return getattr(fk, fused_name)(torch.cat([gate, up], dim=-1), **kwargs)
        return getattr(fk, two_tensor)(gate, up, **kwargs)

    def exact(gate, up):
        return reference_float64(gate, up, activation)

    got = penalty_gradients(ours, *(leaf(t) for t in (gate, up, dout)))
    want = penalty_gradients(exact, *(leaf(t.double()) for t in (gate, up, dout)))
    for name, g, w in zip(["gate", "up", "dout"], got, want):
        assert rel_err(g, w) < 1e-5, name


# ----------------------------------------------------------------------------------------------------------
# Bad input gives a clear error naming the argument.
# ----------------------------------------------------------------------------------------------------------

BAD_TWO_TENSOR = [
    (lambda d: (torch.randn(4, 8, device=d).double(), torch.randn(4, 8, device=d).double()), TypeError,
     "gate must have dtype"),
    (lambda d: (torch.randn(4, 8, device=d), torch.ones(4, 8, device=d, dtype=torch.int32)), TypeError,
     "up must have dtype"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(4, 8, device=d, dtype=torch.float16)), TypeError,
     "up must have the dtype of gate"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(4, 9, device=d)), ValueError,
     r"up must have the shape of gate \(4, 8\)"),
    (lambda d: (torch.tensor(1.0, device=d), torch.tensor(1.0, device=d)), ValueError,
     "gate must have at least 1 dimension"),
    (lambda d: ([1.0], torch.randn(1, device=d)), TypeError, "gate must be a torch.Tensor"),
]


@pytest.mark.parametrize("case", range(len(BAD_TWO_TENSOR)))
def test_bad_two_tensor_inputs(fk, case):
    make, error, message = BAD_TWO_TENSOR[case]
    with pytest.raises(error, match=message):
        fk.swiglu(*make(DEVICE))


@pytest.mark.parametrize("make, error, message", [
    (lambda d: torch.randn(4, 7, device=d), ValueError, r"gate_up must have an even last dimension.*\(4, 7\)"),
    (lambda d: torch.randn(4, 8, device=d, dtype=torch.float64), TypeError, "gate_up must have dtype"),
    (lambda d: torch.tensor(1.0, device=d), ValueError, "gate_up must have at least 1 dimension"),
])
def test_bad_fused_inputs(fk, make, error, message):
    with pytest.raises(error, match=message):
        fk.silu_and_mul(make(DEVICE))


def test_bad_approximate(fk):
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="approximate must be one of 'none', 'tanh'; got 'erf'"):
        fk.geglu(x, x, approximate="erf")
    with pytest.raises(ValueError, match="approximate must be one of"):
        fk.gelu_and_mul(x, approximate=True)


@pytest.mark.skipif(not ON_GPU, reason="needs a second device type")
def test_device_mismatch(fk):
    with pytest.raises(ValueError, match="up is on cpu but gate is on cuda"):
        fk.swiglu(torch.randn(4, 8, device="cuda"), torch.randn(4, 8))


# ----------------------------------------------------------------------------------------------------------
# torch.library integration.
# ----------------------------------------------------------------------------------------------------------

def test_opcheck(fk):
    shape = (64, 2048) if ON_GPU else (6, 40)
    gate, up = (leaf(t) for t in make_inputs(shape, torch.float32))
    gate_up = leaf(torch.cat([gate, up], dim=-1))
    ops = fk._ops.ops
    for activation in ACTIVATIONS:
        torch.library.opcheck(ops.gated_activation, (gate, up, activation))
        torch.library.opcheck(ops.gated_activation_fused, (gate_up, activation))
    dout = torch.randn(shape, device=DEVICE)
    torch.library.opcheck(ops.gated_activation_backward, (dout, gate.detach(), up.detach(), "gelu"))
    torch.library.opcheck(ops.gated_activation_fused_backward, (dout, gate_up.detach(), "gelu_tanh"))


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
def test_opcheck_transposed_inputs(request, module):
    """The ops' outputs are contiguous whatever the inputs' strides, as the fake kernels declare them (opcheck
    compares the strides; inductor asserts them): also in the torch-cpu variant, whose elementwise ops would follow
    the strides of transposed inputs."""
    fk = request.getfixturevalue(module)
    transposed = LAYOUTS["transposed_leading"]
    gate, up = (transposed(t) for t in make_inputs((3, 4, 40), torch.float32))
    gate_up, dout = transposed(torch.cat([gate, up], dim=-1)), transposed(torch.randn(3, 4, 40, device=DEVICE))
    ops = fk._ops.ops
    torch.library.opcheck(ops.gated_activation, (leaf(gate), leaf(up), "silu"))
    torch.library.opcheck(ops.gated_activation_fused, (leaf(gate_up), "gelu"))
    torch.library.opcheck(ops.gated_activation_backward, (dout, gate, up, "gelu_tanh"))
    torch.library.opcheck(ops.gated_activation_fused_backward, (dout, gate_up, "silu"))


def test_compile_fullgraph(fk):
    torch._dynamo.reset()
    shape = (8, 256, 2048) if ON_GPU else (2, 3, 64)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    gate, up = make_inputs(shape, dtype)

    # The ops' outputs are returned as they are: arithmetic around them would be fused and rounded differently
    # by inductor than by eager, and this test compares bit for bit.
    def mlp_tail(gate, up, gate_up):
        return fk.swiglu(gate, up), fk.geglu(gate, up, approximate="tanh"), fk.gelu_and_mul(gate_up)

    compiled = torch.compile(mlp_tail, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    make_args = lambda: [leaf(gate), leaf(up), leaf(torch.cat([gate, up], dim=-1))]  # noqa: E731
    eager_args, compiled_args = make_args(), make_args()
    eager_outs, compiled_outs = mlp_tail(*eager_args), compiled(*compiled_args)
    for eager_out, compiled_out in zip(eager_outs, compiled_outs):
        torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)
    grads = [torch.randn_like(out) for out in eager_outs]
    torch.autograd.backward(eager_outs, grads)
    torch.autograd.backward(compiled_outs, grads)
    for a, b in zip(eager_args, compiled_args):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with ~20 GB free: offsets past 2**31 elements")
def test_offsets_beyond_int32(fk, large_gpu_memory):
    """A fused input of 2**31 + 2**15 elements: row offsets (row * 2I) pass 2**31 in the last rows."""
    rows, width = 2**16 + 1, 2**14
    gate_up = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = fk.silu_and_mul(gate_up)
    dout = torch.randn_like(out)
    out.backward(dout)
    for sl in (slice(0, 2), slice(rows - 2, rows)):  # the first rows, and the last, past 2**31
        x, dy = gate_up.detach()[sl], dout[sl]
        gate, up = x[:, :width], x[:, width:]
        grad = gate_up.grad[sl]
        compare(out[sl], grad[:, :width], grad[:, width:], gate, up, dy, "silu")


# ----------------------------------------------------------------------------------------------------------
# The torch-cpu variant: plain PyTorch, same function.
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [False, True], ids=["two_tensors", "fused"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_torch_cpu_variant_matches_references(fk_cpu, poisoned_empty, activation, dtype, fused):
    assert fk_cpu.BACKEND == "cpu"
    gate, up = make_inputs((2, 5, 300), dtype, device="cpu")
    dout = torch.randn(gate.shape, dtype=dtype)
    out, d_gate, d_up, _ = run_ours(fk_cpu, activation, gate, up, fused, dout)
    compare(out, d_gate, d_up, gate, up, dout, activation)


def test_kernels_and_portable_path_agree(fk, fk_cpu):
    gate, up = make_inputs((7, 300), torch.float32, device="cpu")
    dout = torch.randn(7, 300)
    for activation in ACTIVATIONS:
        portable = run_ours(fk_cpu, activation, gate, up, True, dout)
        ours = run_ours(fk, activation, gate.to(DEVICE), up.to(DEVICE), True, dout.to(DEVICE))
        torch.testing.assert_close(ours[0].cpu(), portable[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours[3].cpu(), portable[3], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# The MLP layers' own Function (swiglu.gated_mlp): the activation's output is recomputed, not kept.
# ----------------------------------------------------------------------------------------------------------

def mlp_modules(hidden, intermediate, bias, dtype):
    torch.manual_seed(0)
    mlp = torch.nn.Module()
    mlp.gate_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
    mlp.up_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
    mlp.down_proj = torch.nn.Linear(intermediate, hidden, bias=bias)
    return mlp.to(device=DEVICE, dtype=dtype)


def mlp_step(forward, mlp, x, dout):
    """Output and the gradients of x and every parameter, after one backward of ``forward(mlp, x)``."""
    mlp.zero_grad()
    x = leaf(x)
    out = forward(mlp, x)
    out.backward(dout)
    return out.detach(), x.grad, {name: p.grad for name, p in mlp.named_parameters()}


@pytest.mark.parametrize("layer, activation", [("SwiGLUMLP", "silu"), ("GeGLUMLP", "gelu_tanh")])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlp_layer_matches_references(fk, layer, activation, bias, dtype):
    mlp = mlp_modules(48, 80, bias, dtype)
    x, dout = torch.randn(3, 7, 48, device=DEVICE, dtype=dtype), torch.randn(3, 7, 48, device=DEVICE, dtype=dtype)

    def module_forward(module, inputs):  # the replaced module, in its dtype: the error baseline
        return module.down_proj(reference_module(module.gate_proj(inputs), module.up_proj(inputs), activation))

    def exact_forward(module, inputs):
        return module.down_proj(reference_float64(module.gate_proj(inputs), module.up_proj(inputs), activation))

    out, dx, grads = mlp_step(getattr(fk.layers, layer).forward, mlp, x, dout)
    base_out, base_dx, base_grads = mlp_step(module_forward, mlp, x, dout)
    mlp64 = copy.deepcopy(mlp).double()
    ref_out, ref_dx, ref_grads = mlp_step(exact_forward, mlp64, x.double(), dout.double())
    assert out.dtype == dtype and dx.dtype == dtype
    assert_close_ratio("out", out, base_out, ref_out, 2.0, dtype)
    assert_close_ratio("dx", dx, base_dx, ref_dx, 3.0, dtype)
    for name, grad in grads.items():
        assert grad.dtype == dtype, name
        assert_close_ratio(name, grad, base_grads[name], ref_grads[name], 3.0, dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
def test_gradient_pass_writes_the_forward_output_over_its_incoming_gradient(request, poisoned_empty, module,
                                                                           activation, dtype):
    """What the MLP layers' backward uses (``_backward(..., product_into_dout=True)``): the same gradients as
    without, and the incoming gradient overwritten with exactly the forward's output; gate and up untouched."""
    fk = request.getfixturevalue(module)
    backward = sys.modules[fk.__name__ + ".swiglu"]._backward
    gate, up = make_inputs((5, 3, 67), dtype)
    dout = torch.randn(gate.shape, device=DEVICE, dtype=dtype)
    want_grads = backward(dout, gate, up, activation)
    inputs_before = [gate.clone(), up.clone()]
    two_tensor, _, kwargs = ACTIVATIONS[activation]
    want_product = getattr(fk, two_tensor)(gate, up, **kwargs)
    buffer = dout.clone()
    grads = backward(buffer, gate, up, activation, product_into_dout=True)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)
    assert torch.equal(buffer, want_product)
    assert all(torch.equal(before, after) for before, after in zip(inputs_before, (gate, up)))


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
def test_gradient_pass_writes_the_gradients_over_gate_and_up(request, poisoned_empty, module):
    """What the MLP layers' backward uses where the graph is not kept (``_backward(..., grads_into_inputs=True)``):
    the gradients are the same, bit for bit, and they are the gate and up tensors themselves."""
    fk = request.getfixturevalue(module)
    backward = sys.modules[fk.__name__ + ".swiglu"]._backward
    gate, up = make_inputs((5, 3, 67), torch.bfloat16)
    dout = torch.randn(gate.shape, device=DEVICE, dtype=gate.dtype)
    want_grads = backward(dout, gate, up, "silu")
    want_product = fk.swiglu(gate, up)
    buffer = dout.clone()
    grads = backward(buffer, gate, up, "silu", product_into_dout=True, grads_into_inputs=True)
    assert grads[0] is gate and grads[1] is up
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)
    assert torch.equal(buffer, want_product)


@pytest.mark.parametrize("layer", ["SwiGLUMLP", "GeGLUMLP"])
def test_mlp_layer_backward_twice(fk, layer):
    """With the graph kept (retain_graph), the MLP layer's backward leaves its saved gate and up intact: a second
    backward gives the same gradients, and they equal, bit for bit, those of a backward that wrote over them."""
    mlp = mlp_modules(48, 80, True, torch.bfloat16)
    x, dout = torch.randn(3, 7, 48, device=DEVICE, dtype=torch.bfloat16), torch.randn(3, 7, 48, device=DEVICE,
                                                                                       dtype=torch.bfloat16)
    forward = getattr(fk.layers, layer).forward
    _, once_dx, once = mlp_step(forward, mlp, x, dout)
    once = {name: grad.clone() for name, grad in once.items()}
    mlp.zero_grad()
    x = leaf(x)
    out = forward(mlp, x)
    out.backward(dout, retain_graph=True)
    first_dx, first = x.grad.clone(), {name: p.grad.clone() for name, p in mlp.named_parameters()}
    mlp.zero_grad()
    x.grad = None
    out.backward(dout)
    assert torch.equal(x.grad, first_dx) and torch.equal(first_dx, once_dx)
    for name, p in mlp.named_parameters():
        assert torch.equal(p.grad, first[name]) and torch.equal(first[name], once[name]), name


@pytest.mark.skipif(not ON_GPU, reason="measures CUDA memory")
def test_mlp_layer_backward_peak_memory(fk):
    """Above what the forward left, the MLP layer's backward holds at most one (tokens, intermediate) tensor (the
    hidden gradient, then the recomputed activation output over it), the (tokens, hidden) input gradient and the
    three weight gradients: the gate and up gradients are written over the saved gate and up."""
    tokens, hidden, intermediate = 16384, 256, 4096
    mlp = mlp_modules(hidden, intermediate, False, torch.bfloat16)
    x = leaf(torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16))
    dout = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    # One backward first, not measured: the autograd engine's device thread makes its own cuBLAS handle and workspace
    # at its first matmul, which would count here in whichever test of the process runs a CUDA backward first.
    fk.layers.SwiGLUMLP.forward(mlp, x).backward(dout)
    for tensor in (x, *mlp.parameters()):
        tensor.grad = None
    out = fk.layers.SwiGLUMLP.forward(mlp, x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(dout)
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - held
    bound = 2 * (tokens * intermediate + tokens * hidden + 3 * hidden * intermediate) + 8 * 2**20
    assert peak_extra <= bound, f"peak extra {peak_extra / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB"


def saved_activation_bytes(forward, module, x):
    """Bytes of the non-parameter tensors autograd keeps for the backward of ``forward(module, x)``."""
    parameters = {p.data_ptr() for p in module.parameters()}
    kept = {}

    def pack(t):
        if t.data_ptr() not in parameters:
            kept[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(module, leaf(x))
    return sum(kept.values())


def test_mlp_layer_keeps_only_its_input_gate_and_up(fk):
    tokens, hidden, intermediate = 64, 32, 96
    mlp = mlp_modules(hidden, intermediate, False, torch.float32)
    x = torch.randn(tokens, hidden, device=DEVICE)
    ours = saved_activation_bytes(fk.layers.SwiGLUMLP.forward, mlp, x)
    modules = saved_activation_bytes(lambda m, i: m.down_proj(fk.swiglu(m.gate_proj(i), m.up_proj(i))), mlp, x)
    assert ours == 4 * tokens * (hidden + 2 * intermediate)  # x, gate(x), up(x)
    assert modules == ours + 4 * tokens * intermediate  # ... and down_proj's input, act(gate) * up


def norm_then_mlp(fk, x, norm_weight, mlp, between=None):
    """Llama's pre-MLP block tail: our RMSNorm, then the MLP layer; ``between`` (if any) acts on the norm's output
    first."""
    y = fk.rms_norm(x, norm_weight, 1e-6)
    if between is not None:
        y = between(y)
    return fk.layers.SwiGLUMLP.forward(mlp, y)


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
def test_mlp_after_our_norm_keeps_the_norm_input_instead_of_its_output(request, module):
    fk = request.getfixturevalue(module)
    tokens, hidden, intermediate = 64, 32, 96
    block = torch.nn.Module()  # the norm's weight beside the MLP, so that both count as parameters
    block.mlp = mlp_modules(hidden, intermediate, False, torch.float32)
    block.norm_weight = torch.nn.Parameter(torch.rand(hidden, device=DEVICE) + 0.5)
    x = torch.randn(tokens, hidden, device=DEVICE)
    kept = saved_activation_bytes(lambda b, i: norm_then_mlp(fk, i, b.norm_weight, b.mlp), block, x)
    # The norm's input and its fp32 statistics, then gate and up: not the norm's output.
    assert kept == 4 * tokens * (hidden + 1 + 2 * intermediate)


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("between", ["none", "in_place"])
def test_mlp_after_our_norm_gradients_are_those_of_a_kept_input(request, module, dtype, between):
    """The recomputed norm output gives the gradients of a kept one (a copy, which the MLP keeps) bit for bit; a
    norm output modified in place before the MLP is kept, not recomputed from the norm's input."""
    fk = request.getfixturevalue(module)
    mlp = mlp_modules(48, 80, False, dtype)
    norm_weight = torch.nn.Parameter((torch.rand(48, device=DEVICE) + 0.5).to(dtype))
    x, dout = torch.randn(3, 7, 48, device=DEVICE, dtype=dtype), torch.randn(3, 7, 48, device=DEVICE, dtype=dtype)
    act = {"none": None, "in_place": lambda y: y.mul_(2.0)}[between]
    kept = {"none": torch.clone, "in_place": lambda y: y * 2.0}[between]
    grads = []
    for forward_between in (act, kept):
        mlp.zero_grad()
        norm_weight.grad = None
        leaf_x = leaf(x)
        norm_then_mlp(fk, leaf_x, norm_weight, mlp, forward_between).backward(dout)
        grads.append([leaf_x.grad, norm_weight.grad, *(p.grad for p in mlp.parameters())])
    for got, want in zip(*grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
def test_mlp_after_our_norm_without_a_graph_lets_the_norm_input_change(request, module):
    """A norm whose output needs no gradient (neither its input nor its weight needs one) keeps nothing for a
    backward, so the MLP layer keeps the norm's output, as the modules do, not its input: that input may then change
    in place before the MLP's backward, which torch's modules allow."""
    fk = request.getfixturevalue(module)
    mlp = mlp_modules(16, 24, False, torch.float32)
    x, dout = torch.randn(3, 5, 16, device=DEVICE), torch.randn(3, 5, 16, device=DEVICE)
    y = fk.rms_norm(x, torch.rand(16, device=DEVICE) + 0.5, 1e-6)
    out = fk.layers.SwiGLUMLP.forward(mlp, y)
    want = torch.autograd.grad(mlp.down_proj(F.silu(mlp.gate_proj(y)) * mlp.up_proj(y)), list(mlp.parameters()), dout)
    x.add_(1.0)
    got = torch.autograd.grad(out, list(mlp.parameters()), dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
def test_mlp_after_our_norm_whose_weight_changed_keeps_its_input(request, module):
    """A norm weight modified in place between the norm and the MLP layer (under no_grad): the layer keeps the norm's
    output instead of recomputing it with the new weight, and its weight gradients are those of that output."""
    fk = request.getfixturevalue(module)
    mlp = mlp_modules(16, 24, False, torch.float32)
    x, dout = torch.randn(3, 5, 16, device=DEVICE), torch.randn(3, 5, 16, device=DEVICE)
    norm_weight = torch.nn.Parameter(torch.rand(16, device=DEVICE) + 0.5)
    y = fk.rms_norm(x, norm_weight, 1e-6)
    with torch.no_grad():
        norm_weight.mul_(2.0)
    out = fk.layers.SwiGLUMLP.forward(mlp, y)
    want = torch.autograd.grad(mlp.down_proj(F.silu(mlp.gate_proj(y)) * mlp.up_proj(y)), list(mlp.parameters()), dout)
    got = torch.autograd.grad(out, list(mlp.parameters()), dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module", ["fk", "fk_cpu"])
@pytest.mark.parametrize("layer, activation", [("SwiGLUMLP", "silu"), ("GeGLUMLP", "gelu_tanh")])
@pytest.mark.parametrize("after_norm", [False, True], ids=["input", "after_our_norm"])
def test_mlp_layer_double_backward(request, module, layer, activation, after_norm):
    """Under create_graph the MLP layer's gradients are differentiable in turn: the derivatives of a penalty on the
    first gradients of the input and of every parameter match float64, also when the layer recomputes its input
    from our norm's (the norm's weight then gets its share)."""
    fk = request.getfixturevalue(module)
    mlp = mlp_modules(16, 24, True, torch.float32)
    mlp64 = copy.deepcopy(mlp).double()
    x, norm_weight = torch.randn(3, 5, 16, device=DEVICE), torch.rand(16, device=DEVICE) + 0.5
    dout = torch.randn_like(x)
    # One probe per first gradient: of x, of the norm's weight, of each parameter.
    probes = [torch.randn_like(t) for t in (x, *([norm_weight] if after_norm else []), *mlp.parameters())]

    def exact_mlp(module, inputs):
        return module.down_proj(reference_float64(module.gate_proj(inputs), module.up_proj(inputs), activation))

    def exact_norm(inputs, weight):
        return inputs * torch.rsqrt(inputs.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def penalty_gradients(forward, norm, module, dtype):
        x_, norm_weight_, dout_ = (leaf(t.to(dtype)) for t in (x, norm_weight, dout))
        tensors = [x_, *([norm_weight_] if after_norm else []), *module.parameters()]
        out = forward(module, norm(x_, norm_weight_) if after_norm else x_)
        first = torch.autograd.grad(out, tensors, dout_, create_graph=True)
        penalty = sum((g * p.to(dtype)).sum() for g, p in zip(first, probes))
        # The down projection's bias is in no first gradient: its derivative is zero.
        return torch.autograd.grad(penalty, [*tensors, dout_], allow_unused=True, materialize_grads=True)

    got = penalty_gradients(getattr(fk.layers, layer).forward, lambda i, w: fk.rms_norm(i, w, 1e-6), mlp,
                            torch.float32)
    want = penalty_gradients(exact_mlp, exact_norm, mlp64, torch.float64)
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel_err(g, w, scale=1e-6) < 1e-5, i


def test_mlp_layer_runs_wrapped_projections_as_modules(fk):
    """A projection that is not a plain nn.Linear (here one with a forward hook, as LoRA-style wrappers or FSDP2
    sharding it on its own would be) is called as a module, so its hook runs."""
    mlp = mlp_modules(16, 24, False, torch.float32)
    mlp.up_proj.register_forward_hook(lambda module, inputs, output: output * 2.0)
    x = torch.randn(5, 16, device=DEVICE)
    want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(fk.layers.SwiGLUMLP.forward(mlp, x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hook", ["full_backward", "full_backward_pre"])
def test_mlp_layer_runs_projections_with_backward_hooks_as_modules(fk, hook):
    """A projection with a backward hook (gradient masking, clipping or monitoring) is called as a module too, so the
    hook runs: the one-Function path skipped it (the hook never ran, and the masked gradient came out unmasked)."""
    mlp = mlp_modules(16, 24, False, torch.float32)
    calls = []

    def zero_the_gradient(module, grad, *rest):
        calls.append(module)
        return tuple(torch.zeros_like(g) if g is not None else None for g in grad)

    getattr(mlp.down_proj, f"register_{hook}_hook")(zero_the_gradient)
    x = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    fk.layers.SwiGLUMLP.forward(mlp, x).sum().backward()
    assert calls == [mlp.down_proj]
    assert torch.equal(x.grad, torch.zeros_like(x.grad))  # nothing reaches x past the zeroed gradient


# ----------------------------------------------------------------------------------------------------------
# Layers, swapped in with kernelize.
# ----------------------------------------------------------------------------------------------------------

def tiny_model(family, dtype):
    from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM

    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (GemmaConfig,
                                                                                             GemmaForCausalLM)
    config = config_class(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          attn_implementation="sdpa")
    torch.manual_seed(0)
    return model_class(config).to(device=DEVICE, dtype=dtype)


@pytest.fixture
def kernelizable(monkeypatch):
    """replace_kernel_forward_from_hub(cls, name) for the test's duration (it sets class attributes)."""
    def mark(cls, layer_name, condition=None):
        for attr in ("kernel_layer_name", "kernel_condition"):
            monkeypatch.setattr(cls, attr, None, raising=False)  # undone (removed) after the test
        replace_kernel_forward_from_hub(cls, layer_name, condition)
    return mark


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family, layer_name", [("llama", "SwiGLUMLP"), ("gemma", "GeGLUMLP")])
def test_kernelize_mlp_matches_unpatched(build_dir, kernelizable, variant, family, layer_name):
    """The README recipe: mark the transformers MLP class kernelizable, map it to our layer, kernelize."""
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    reference = tiny_model(family, dtype).train()
    patched = copy.deepcopy(reference)
    cls = type(reference.model.layers[0].mlp)  # LlamaMLP, GemmaMLP
    kernelizable(cls, layer_name)
    repo = LocalLayerRepository(variant_paths(build_dir)[variant], layer_name=layer_name)
    with use_kernel_mapping({layer_name: {DEVICE.type: repo}}, inherit_mapping=False):
        patched = kernelize(patched, mode=Mode.TRAINING, device=DEVICE.type, use_fallback=KernelizeFallback.NO_LAYER)

    mlps = [m for m in patched.modules() if type(m) is cls]
    assert mlps and all(m.forward.__func__.__module__.endswith(".layers") for m in mlps), \
        "kernelize did not swap in the Hub layer"
    input_ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    ref_logits, ref_grads = loss_and_grads(reference, input_ids)
    logits, grads = loss_and_grads(patched, input_ids)
    assert_same_step(logits, grads, ref_logits, ref_grads, dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layer_name", ["SiluAndMul", "GeluAndMul", "GeluTanhAndMul"])
def test_kernelize_activation_layer_matches_reference(build_dir, kernelizable, variant, layer_name):
    """An MLP with a fused gate_up projection whose activation module opts in to the layer name."""
    from fused_kernels_tools import reference_layers

    activation_class = getattr(reference_layers, layer_name)
    kernelizable(activation_class, layer_name)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(32, 2 * 48), activation_class(), torch.nn.Linear(48, 32))
    reference = reference.to(DEVICE)
    patched = copy.deepcopy(reference)
    repo = LocalLayerRepository(variant_paths(build_dir)[variant], layer_name=layer_name)
    with use_kernel_mapping({layer_name: {DEVICE.type: repo}}, inherit_mapping=False):
        patched = kernelize(patched, mode=Mode.TRAINING, device=DEVICE.type, use_fallback=KernelizeFallback.NONE)
    assert patched[1].forward.__func__.__module__.endswith(".layers")

    x = torch.randn(4, 5, 32, device=DEVICE)
    outputs = [model(x) for model in (reference, patched)]
    for out in outputs:
        out.square().sum().backward()
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    for (name, p_ref), p in zip(reference.named_parameters(), patched.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not ON_GPU, reason="transformers' KernelConfig supports only accelerator devices (not cpu)")
def test_transformers_kernel_config_swaps_registered_mlp(build_dir, kernelizable, monkeypatch):
    """KernelConfig accepts `SwiGLUMLP` once the MLP class is registered with replace_kernel_forward_from_hub."""
    from transformers import KernelConfig

    monkeypatch.setenv("LOCAL_KERNELS", f"myorg/fused-kernels={build_dir}")
    reference = tiny_model("llama", torch.bfloat16).train()
    patched = copy.deepcopy(reference)
    kernelizable(type(reference.model.layers[0].mlp), "SwiGLUMLP")
    repo = ("myorg/fused-kernels:SwiGLUMLP", {"revision": "v1", "trust_remote_code": True})
    config = KernelConfig({"SwiGLUMLP": repo}, inherit_mapping=False)
    patched.set_use_kernels(True, config)
    mlps = [m.mlp for m in patched.model.layers]
    assert all(m.forward.__func__.__module__.endswith(".layers") for m in mlps)

    input_ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    ref_logits, ref_grads = loss_and_grads(reference, input_ids)
    logits, grads = loss_and_grads(patched, input_ids)
    torch.testing.assert_close(logits, ref_logits, rtol=2e-2, atol=2e-2)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")
