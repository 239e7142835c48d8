"""RMSNorm (Llama casting) and the fused residual form `h = x + r; y = norm(h)`, against eager PyTorch,
torch.compile, Liger and torch.nn.functional.rms_norm."""

import torch
import torch.nn.functional as F

from harness import OURS, Case, Env, OpBenchmark, compile_per_shape, optional_import

EPS = 1e-6
ROW_COUNTS = (1024, 4096, 16384, 65536)
HIDDEN_SIZES = (1024, 2048, 4096, 8192, 16384)
LARGE_ROW_HIDDEN_SIZES = (65536, 131072)  # at T=4096; peers that cannot run rows this long are recorded as such
# At T=16384: rows that start off 16-byte boundaries (bf16 rows of 4095 elements) or on them without a stride that
# Triton can tell is a multiple of 16 elements (5000).
ODD_HIDDEN_SIZES = (4095, 5000)
# At T=16384: models' hidden sizes between powers of two (Gemma-2-2B's 2304, Qwen3-4B's 2560), whose rows pad their
# whole-row tile to 4096 columns.
MODEL_HIDDEN_SIZES = (2304, 2560)
FUSED_ADD_SHAPE = {"T": 16384, "H": 4096}
QUICK_SHAPES = ({"T": 128, "H": 256}, {"T": 128, "H": 1000})  # 1000: a row length that is not a power of two


def llama_rms_norm(x, weight):
    """HF LlamaRMSNorm.forward: mean of squares in float32, normalise, cast back, then scale by the weight.
    On float32 inputs this is exactly the op's math, so it is also the reference."""
    input_dtype = x.dtype
    x32 = x.float()
    mean_square = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(mean_square + EPS)).to(input_dtype)


def add_then_llama_rms_norm(x, residual, weight):
    hidden = x + residual
    return llama_rms_norm(hidden, weight), hidden


def torch_rms_norm(x, weight):
    return F.rms_norm(x, x.shape[-1:], weight, EPS)


def add_then_torch_rms_norm(x, residual, weight):
    hidden = x + residual
    return torch_rms_norm(hidden, weight), hidden


def make_norm_inputs(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    rows, hidden = case.shape["T"], case.shape["H"]
    x = torch.randn(rows, hidden, dtype=case.dtype, device=device, requires_grad=True)
    # Near 1 like a trained norm's weight, but not constant, so a kernel that misapplies it fails the check.
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(case.dtype).requires_grad_()
    return {"x": x, "weight": weight}


def make_fused_add_inputs(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    inputs = make_norm_inputs(case, device)
    inputs["residual"] = torch.randn_like(inputs["x"]).requires_grad_()
    return inputs


def _sizes(case: Case) -> tuple[int, int]:
    """Bytes of one (T, H) activation and of the (H,) weight."""
    itemsize = case.dtype.itemsize
    return case.shape["T"] * case.shape["H"] * itemsize, case.shape["H"] * itemsize


def norm_bytes(case: Case, mode: str) -> int:
    activation, weight = _sizes(case)
    forward = 2 * activation + weight  # read x, w; write y
    backward = 3 * activation + 2 * weight  # read dy, x, w; write dx, dw
    return forward if mode == "fwd" else forward + backward


def fused_add_bytes(case: Case, mode: str) -> int:
    activation, weight = _sizes(case)
    forward = 4 * activation + weight  # read x, residual, w; write y, h
    # read dy, dh (the residual stream's gradient), h, w; write dx (which is also d residual), dw
    backward = 4 * activation + 2 * weight
    return forward if mode == "fwd" else forward + backward


def norm_cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(shape) for shape in QUICK_SHAPES]
    grid = [Case({"T": rows, "H": hidden}) for rows in ROW_COUNTS for hidden in HIDDEN_SIZES]
    return (grid + [Case({"T": 4096, "H": hidden}) for hidden in LARGE_ROW_HIDDEN_SIZES]
            + [Case({"T": 16384, "H": hidden}) for hidden in ODD_HIDDEN_SIZES + MODEL_HIDDEN_SIZES])


def benchmarks(env: Env) -> list[OpBenchmark]:
    ours = env.ours
    norm_providers = {
        OURS: lambda x, weight: ours.rms_norm(x, weight, eps=EPS, mode="llama"),
        "torch": llama_rms_norm,
    }
    fused_add_providers = {
        OURS: lambda x, residual, weight: ours.fused_add_rms_norm(x, residual, weight, eps=EPS, mode="llama"),
        "torch": add_then_llama_rms_norm,
    }
    if env.on_gpu:
        norm_providers["torch_compile"] = compile_per_shape(llama_rms_norm)
        fused_add_providers["torch_compile"] = compile_per_shape(add_then_llama_rms_norm)
        liger = optional_import("liger_kernel.ops", "liger")
        if liger is not None:
            # Liger's own defaults: llama casting, offset 0; RMSNorm writes dx into dy (in_place=True).
            norm_providers["liger"] = lambda x, weight: liger.LigerRMSNormFunction.apply(x, weight, EPS)
            fused_add_providers["liger"] = lambda x, residual, weight: liger.LigerFusedAddRMSNormFunction.apply(
                x, residual, weight, EPS
            )
    else:
        print("note: torch_compile and liger skipped on CPU")
    norm_providers["torch_rms_norm"] = torch_rms_norm
    fused_add_providers["torch_rms_norm"] = add_then_torch_rms_norm

    fused_add_cases = [Case(QUICK_SHAPES[-1] if env.quick else FUSED_ADD_SHAPE)]
    return [
        OpBenchmark(
            op="rms_norm",
            cases=norm_cases(env.quick),
            providers=norm_providers,
            make_inputs=make_norm_inputs,
            reference=llama_rms_norm,
            output_names=("y",),
            bytes_moved=norm_bytes,
        ),
        OpBenchmark(
            op="fused_add_rms_norm",
            cases=fused_add_cases,
            providers=fused_add_providers,
            make_inputs=make_fused_add_inputs,
            reference=add_then_llama_rms_norm,
            output_names=("y", "residual_out"),
            bytes_moved=fused_add_bytes,
        ),
    ]
