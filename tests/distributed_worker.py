"""One short training run of a tiny Qwen3 with every fused kernel, under torchrun, for tests/test_distributed.py.

    LOCAL_KERNELS=myorg/fused-kernels=<build> torchrun --nproc_per_node N tests/distributed_worker.py \
        --engine single|ddp|fsdp2 [--checkpointing] --out result.pt

The kernels go in through the README helper (`use_fused_kernels`) before the engine wraps the model, as a user
would do it. A fixed global batch is split evenly between the ranks, so the mean of the ranks' losses is the
global loss and the engine's averaged gradient is the gradient of a single process seeing the whole batch.
Rank 0 writes the first step's gradients (gathered whole for FSDP2's sharded parameters) and every step's
global loss. CPU runs use gloo and the torch-cpu variant; CUDA runs NCCL, one GPU per rank.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from fused_kernels_tools import engines  # noqa: E402
from fused_kernels_tools.integrate import use_fused_kernels  # noqa: E402

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False)
BATCH, SEQ = 4, 24


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=engines.ENGINES, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every layer")
    args = parser.parse_args()

    device = engines.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial weights on every rank and in the single-process run
    config = AutoConfig.for_model("qwen3", **SIZES)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).to(device)
    model.train()
    model = use_fused_kernels(model)
    if args.checkpointing:
        # Each decoder layer's forward (our kernels included) runs again in the backward.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    names = [name for name, _ in model.named_parameters()]
    model = engines.wrap(model, args.engine)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    tokens = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = tokens.chunk(world)[rank].to(device)
    losses, first_grads = [], None
    for _ in range(args.steps):
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        if first_grads is None:
            first_grads = {name: full(p.grad) for name, p in zip(names, model.parameters())}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach().float()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    if rank == 0:
        torch.save({"losses": losses, "grads": first_grads, "world": world}, args.out)
    engines.leave()


if __name__ == "__main__":
    main()
