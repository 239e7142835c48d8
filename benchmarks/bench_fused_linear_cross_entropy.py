"""Fused linear cross-entropy, the LM-head GEMM plus its loss (`loss.backward()`), against torch eager
(bf16 logits, then the fp32 upcast loss of transformers), torch.compile and Liger's fused linear cross-entropy.
Sweeps tokens and vocabulary at H=4096.

Ours runs three ways: the default (token chunks of about 1 GiB of logits), the default with 1024-token chunks
(a smaller chunk buffer, more passes over the fp32 weight-gradient sums) and `low_memory=True` (vocabulary
slices; the logits are computed twice). TFLOP/s counts the 6*T*H*V FLOPs of the computation itself for all.

Read the fwd rows with care: the inputs require grad there, and ours (like Liger's) then computes the gradients
during the forward, which the backward only scales, so its "fwd" is nearly the whole training step while the
peers' is the forward alone. The fwd+bwd rows compare the same work."""

import torch
import torch.nn.functional as F

from harness import OURS, Case, Env, OpBenchmark, compile_per_shape, optional_import

MAIN = {"T": 8192, "H": 4096, "V": 151936}
SWEEP = [{"T": tokens, "H": 4096, "V": 151936} for tokens in (2048, 4096, 16384)] + \
        [{"T": 8192, "H": 4096, "V": vocab} for vocab in (32000, 128256, 262144)]
QUICK_SHAPES = ({"T": 64, "H": 32, "V": 300},)
IGNORED_FRACTION = 0.1


def torch_lm_head_loss(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight).float(), target)


def make_inputs(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    tokens, n_hidden, vocab = case.shape["T"], case.shape["H"], case.shape["V"]
    hidden = torch.randn(tokens, n_hidden, device=device).to(case.dtype).requires_grad_()
    weight = (torch.randn(vocab, n_hidden, device=device) / n_hidden**0.5).to(case.dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device=device)
    target = torch.where(torch.rand(tokens, device=device) < IGNORED_FRACTION, -100, target)
    return {"hidden": hidden, "weight": weight, "target": target}


def bytes_moved(case: Case, mode: str) -> int:
    tokens, n_hidden, vocab = case.shape["T"], case.shape["H"], case.shape["V"]
    inputs = (tokens + vocab) * n_hidden * case.dtype.itemsize + tokens * 8
    return inputs if mode == "fwd" else 2 * inputs  # fwd+bwd also writes grad_hidden and grad_weight


def flops(case: Case, mode: str) -> int:
    gemm = 2 * case.shape["T"] * case.shape["H"] * case.shape["V"]
    return gemm if mode == "fwd" else 3 * gemm


def benchmarks(env: Env) -> list[OpBenchmark]:
    ours = env.ours
    providers = {
        OURS: lambda hidden, weight, target: ours.fused_linear_cross_entropy(hidden, weight, target),
        f"{OURS}:chunk1024": lambda hidden, weight, target:
            ours.fused_linear_cross_entropy(hidden, weight, target, chunk_tokens=1024),
        f"{OURS}:low_memory": lambda hidden, weight, target:
            ours.fused_linear_cross_entropy(hidden, weight, target, low_memory=True),
        "torch": torch_lm_head_loss,
    }
    if env.on_gpu:
        providers["torch_compile"] = compile_per_shape(torch_lm_head_loss)
        liger = optional_import("liger_kernel.ops.fused_linear_cross_entropy", "liger")
        if liger is not None:
            # Liger's defaults (weight-gradient accumulation in the weight's dtype).
            providers["liger"] = lambda hidden, weight, target: \
                liger.LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, target)[0]
    else:
        print("note: torch_compile and liger skipped on CPU")
    cases = [Case(shape) for shape in (QUICK_SHAPES if env.quick else [MAIN] + SWEEP)]
    return [OpBenchmark(op="fused_linear_cross_entropy", cases=cases, providers=providers, make_inputs=make_inputs,
                        reference=torch_lm_head_loss, output_names=("loss",), bytes_moved=bytes_moved, flops=flops,
                        unit_grad_outputs=True)]
