"""SwiGLU `silu(gate) * up` from two tensors, and from one fused `gate_up` tensor (the output of a fused
gate_up_proj), against eager PyTorch, torch.compile and Liger."""

import torch
import torch.nn.functional as F

from harness import OURS, Case, Env, OpBenchmark, compile_per_shape, optional_import

TOKEN_COUNTS = (1024, 4096, 16384)
INTERMEDIATE_SIZES = (4096, 11008, 14336)
FUSED_SHAPE = {"T": 16384, "I": 14336}
QUICK_SHAPES = ({"T": 64, "I": 256}, {"T": 64, "I": 1000})  # 1000: a width that is not a power of two


def torch_swiglu(gate, up):
    """LlamaMLP's `act_fn(gate_proj(x)) * up_proj(x)` with act_fn = SiLU; on float32 it is also the reference."""
    return F.silu(gate) * up


def torch_silu_and_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def make_inputs(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    shape = (case.shape["T"], case.shape["I"])
    return {name: torch.randn(shape, dtype=case.dtype, device=device, requires_grad=True) for name in ("gate", "up")}


def make_fused_inputs(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    shape = (case.shape["T"], 2 * case.shape["I"])
    return {"gate_up": torch.randn(shape, dtype=case.dtype, device=device, requires_grad=True)}


def swiglu_bytes(case: Case, mode: str) -> int:
    activation = case.shape["T"] * case.shape["I"] * case.dtype.itemsize
    forward = 3 * activation  # read gate, up; write out
    backward = 5 * activation  # read dout, gate, up; write d_gate, d_up
    return forward if mode == "fwd" else forward + backward


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(shape) for shape in QUICK_SHAPES]
    return [Case({"T": tokens, "I": width}) for tokens in TOKEN_COUNTS for width in INTERMEDIATE_SIZES]


def benchmarks(env: Env) -> list[OpBenchmark]:
    ours = env.ours
    providers = {OURS: ours.swiglu, "torch": torch_swiglu}
    fused_providers = {OURS: ours.silu_and_mul, "torch": torch_silu_and_mul}
    if env.on_gpu:
        providers["torch_compile"] = compile_per_shape(torch_swiglu)
        fused_providers["torch_compile"] = compile_per_shape(torch_silu_and_mul)
        liger = optional_import("liger_kernel.ops.swiglu", "liger")
        if liger is not None:
            # Liger's SwiGLU takes the two halves; it makes them contiguous (a copy) for the fused layout.
            providers["liger"] = lambda gate, up: liger.LigerSiLUMulFunction.apply(gate, up)  # positional only
            fused_providers["liger"] = lambda gate_up: liger.LigerSiLUMulFunction.apply(*gate_up.chunk(2, dim=-1))
    else:
        print("note: torch_compile and liger skipped on CPU")

    fused_cases = [Case(QUICK_SHAPES[-1] if env.quick else FUSED_SHAPE)]
    return [
        OpBenchmark(
            op="swiglu",
            cases=cases(env.quick),
            providers=providers,
            make_inputs=make_inputs,
            reference=torch_swiglu,
            output_names=("out",),
            bytes_moved=swiglu_bytes,
        ),
        OpBenchmark(
            op="silu_and_mul",
            cases=fused_cases,
            providers=fused_providers,
            make_inputs=make_fused_inputs,
            reference=torch_silu_and_mul,
            output_names=("out",),
            bytes_moved=swiglu_bytes,
        ),
    ]
