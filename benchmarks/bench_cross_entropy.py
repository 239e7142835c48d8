"""Cross-entropy over given logits (mean over non-ignored tokens, `loss.backward()`), against torch eager (the
fp32 upcast transformers does), torch.compile and Liger."""

import torch
import torch.nn.functional as F

from harness import OURS, Case, Env, OpBenchmark, compile_per_shape, optional_import

MAIN = {"T": 8192, "V": 151936}
GRID = [{"T": 8192, "V": vocab} for vocab in (32000, 128256, 151936, 262144)] + \
       [{"T": tokens, "V": 151936} for tokens in (2048, 16384)]
QUICK_SHAPES = ({"T": 64, "V": 500}, {"T": 32, "V": 1000})
IGNORED_FRACTION = 0.1


def torch_cross_entropy(logits, target):
    """transformers' ForCausalLMLoss: fp32 upcast, then torch's cross-entropy (ignore_index -100, mean)."""
    return F.cross_entropy(logits.float(), target)


def make_inputs(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    tokens, vocab = case.shape["T"], case.shape["V"]
    logits = (2 * torch.randn(tokens, vocab, device=device)).to(case.dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device=device)
    target = torch.where(torch.rand(tokens, device=device) < IGNORED_FRACTION, -100, target)
    return {"logits": logits, "target": target}


def bytes_moved(case: Case, mode: str) -> int:
    logits = case.shape["T"] * case.shape["V"] * case.dtype.itemsize
    target = case.shape["T"] * 8
    return logits + target if mode == "fwd" else 2 * logits + target  # fwd+bwd also writes the gradient


def benchmarks(env: Env) -> list[OpBenchmark]:
    ours = env.ours
    providers = {OURS: lambda logits, target: ours.cross_entropy(logits, target), "torch": torch_cross_entropy}
    if env.on_gpu:
        providers["torch_compile"] = compile_per_shape(torch_cross_entropy)
        liger = optional_import("liger_kernel.ops.cross_entropy", "liger")
        if liger is not None:
            # Liger writes the gradient into the logits during the forward (its default, no opt-out).
            providers["liger"] = lambda logits, target: liger.LigerCrossEntropyFunction.apply(logits, target, None)[0]
    else:
        print("note: torch_compile and liger skipped on CPU")
    cases = [Case(shape) for shape in (QUICK_SHAPES if env.quick else [MAIN] + [s for s in GRID if s != MAIN])]
    return [OpBenchmark(op="cross_entropy", cases=cases, providers=providers, make_inputs=make_inputs,
                        reference=torch_cross_entropy, output_names=("loss",), bytes_moved=bytes_moved,
                        unit_grad_outputs=True)]
