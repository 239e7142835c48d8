"""Short training runs of a tiny Qwen3 with every fused kernel, under torchrun, for tests/test_distributed.py.

    LOCAL_KERNELS=myorg/fused-kernels=<build> torchrun --standalone --nproc_per_node N tests/distributed_worker.py \
        --device cpu|cuda --runs RUN [RUN ...] --out results.pt

A run is named ``engine[-option...]``: engine single (one process, rank 0), ddp or fsdp2 (every rank); options
checkpointing, compile, mixed (``fsdp2-checkpointing``, ``ddp-compile``, ``fsdp2-mixed``). The runs of one
command share its start-up (imports, process group), which costs far more than their training.

The kernels go in through the README helper (`use_fused_kernels`) before the engine wraps the model, and
`torch.compile` goes on last, over the wrapped model, as the README recipe does it. A fixed global batch is
split evenly between the ranks, so the mean of the ranks' losses is the global loss and the engine's averaged
gradient is the gradient of a single process seeing the whole batch. Rank 0 writes, for every run, the first
step's gradients (gathered whole for FSDP2's sharded parameters) and every step's global loss.

Precision: by default the model is bf16 through and through (parameters, gradients, AdamW state). ``mixed``
keeps fp32 master weights and computes in bf16: FSDP2 with MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32), and, for a single process, its reference written out by hand (see MasterWeights).

Everything runs in PyTorch's deterministic mode, so two runs of the same command must agree bit for bit.
cpu: gloo, the torch-cpu variant. cuda: NCCL, one GPU per rank, the Triton kernels and our flash attention.
"""

import argparse
import os
import sys
from pathlib import Path

# Reproducibility, read before torch sets up: cuBLAS needs a fixed workspace (read when its first handle is made);
# Inductor would otherwise time candidate kernels on the GPU and keep the fastest, which can change the numerics
# from one run to the next.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from fused_kernels_tools import engines  # noqa: E402
from fused_kernels_tools.integrate import use_fused_kernels  # noqa: E402

# CPU: as small as the kernels allow, the runs are dominated by start-up. CUDA: head_dim 64 and 256 tokens per
# sequence, so attention runs several query and key blocks of the flash-attention kernels.
SIZES = {
    "cpu": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False),
    "cuda": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024, tie_word_embeddings=False),
}
SEQ = {"cpu": 24, "cuda": 256}
BATCH = 4
ENGINES = ("single", "ddp", "fsdp2")
# checkpointing: of every decoder layer. compile: torch.compile over the wrapped model. mixed: fp32 master
# weights, bf16 compute.
OPTIONS = {"checkpointing", "compile", "mixed"}


class MasterWeights:
    """One process's mixed precision, the reference for FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32): fp32 master weights that AdamW updates, and bf16 copies of them in the model, which the
    forward and backward use as they are (no autocast: every op, our kernels included, sees bf16 weights and
    activations, as under FSDP2). Each gradient is computed in bf16, widened to fp32 for the master (FSDP2 widens
    it before reduce-scattering), and after the step the masters are rounded back into the model (FSDP2 rounds
    the fp32 shards when it gathers them). Only parameters change dtype: buffers (RoPE's inv_freq) stay fp32,
    as FSDP2 leaves them."""

    def __init__(self, model: torch.nn.Module):
        self.model_params = list(model.parameters())
        self.params = [p.detach().clone().requires_grad_() for p in self.model_params]
        with torch.no_grad():
            for p in self.model_params:
                p.data = p.data.to(torch.bfloat16)

    def grads_to_masters(self):
        for master, p in zip(self.params, self.model_params):
            master.grad, p.grad = p.grad.float(), None

    def masters_to_model(self):
        with torch.no_grad():
            for master, p in zip(self.params, self.model_params):
                p.copy_(master)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def parse_run(name: str) -> tuple[str, set[str]]:
    """``engine[-option...]`` -> (engine, options), e.g. ``fsdp2-compile`` -> ("fsdp2", {"compile"})."""
    engine, *options = name.split("-")
    if engine not in ENGINES or not set(options) <= OPTIONS:
        raise ValueError(f"run {name!r}: expected an engine of {ENGINES} and options of {sorted(OPTIONS)}")
    if engine == "ddp" and "mixed" in options:
        raise ValueError(f"run {name!r}: DDP has no public mixed-precision policy; use single or fsdp2")
    return engine, set(options)


def train(name: str, device: torch.device, steps: int) -> dict:
    """Run ``name`` for ``steps`` optimizer steps; what rank 0 writes for it."""
    engine, options = parse_run(name)
    rank, world = dist.get_rank(), dist.get_world_size()
    if engine == "single":
        # One process on the whole batch, with no collective: rank 0 runs it alone and the other ranks go on to
        # the next run, where they wait for rank 0 at the engine's first collective.
        if rank != 0:
            return None
        world = 1
    torch.manual_seed(0)  # the same initial weights on every rank and in the single-process run
    config = AutoConfig.for_model("qwen3", **SIZES[device.type])
    dtype = torch.float32 if "mixed" in options else torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    model.train()
    model = use_fused_kernels(model)
    attention = model.config._attn_implementation
    if "checkpointing" in options:
        # Each decoder layer's forward (our kernels included) runs again in the backward.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    param_names = [param_name for param_name, _ in model.named_parameters()]
    # The dtype the decoder computes in, as the engine runs it (FSDP2's policy casts parameters, not the model).
    compute_dtypes = []
    model.model.norm.register_forward_hook(lambda module, args, out: compute_dtypes.append(out.dtype))
    masters = MasterWeights(model) if engine != "fsdp2" and "mixed" in options else None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if "mixed" in options else None
    model = engines.wrap(model, engine, policy)
    params = masters.params if masters else list(model.parameters())
    if "compile" in options:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(params, lr=1e-3)

    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ[device.type]), generator=torch.Generator().manual_seed(1))
    rows = tokens.chunk(world)[rank].to(device)
    losses, first_grads, dtypes = [], None, None
    for _ in range(steps):
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        if masters:
            masters.grads_to_masters()
        if first_grads is None:
            first_grads = {name: full(p.grad) for name, p in zip(param_names, params)}
            dtypes = {"compute": compute_dtypes[0], "params": params[0].dtype, "grads": params[0].grad.dtype}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if masters:
            masters.masters_to_model()
        global_loss = loss.detach().float()
        if engine != "single":
            dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    return {"losses": losses, "grads": first_grads, "world": world, "dtypes": dtypes, "attention": attention}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--runs", nargs="+", required=True, help="engine[-option...] names, run in this order")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    for name in args.runs:
        parse_run(name)  # a bad name fails before the process group starts

    torch.use_deterministic_algorithms(True)
    device = engines.init_distributed(on_gpu=args.device == "cuda")
    results = {name: train(name, device, args.steps) for name in args.runs}
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    engines.leave()


if __name__ == "__main__":
    main()
