"""The pieces of a torchrun worker that the distributed test (tests/distributed_worker.py) and the scaling benchmark
(benchmarks/e2e_step.py) share: joining the process group, wrapping a (kernelized) causal LM in DDP or FSDP2 the
way the README recommends, and leaving without the teardown hang.

CUDA runs use NCCL with one GPU per rank (LOCAL_RANK); CPU runs use gloo.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

ENGINES = ("single", "ddp", "fsdp2")


def init_distributed(on_gpu: bool | None = None, timeout_s: float = 90) -> torch.device:
    """Join torchrun's process group (NCCL on GPUs, else gloo; default: GPUs when there are any); returns this
    rank's device."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)  # before NCCL makes its communicators on the current device
    # A short collective timeout: a rank that dies or stalls fails the run in a minute or two instead of hanging it.
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return device


def wrap(model: torch.nn.Module, engine: str, mp_policy: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    """`model` under `engine`: "single" (unwrapped), "ddp", or "fsdp2" (one unit per decoder layer plus the root,
    with `mp_policy` when given)."""
    if engine == "single":
        return model
    if engine == "ddp":
        return DistributedDataParallel(model)
    if engine == "fsdp2":
        policy = mp_policy or MixedPrecisionPolicy()
        # The mesh on the model's own device type: fully_shard's default mesh is on the GPU whenever one is
        # visible, which would move a CPU (gloo) model's parameters to it.
        mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        # The root unit owns the embeddings, the final norm and lm_head: the fused loss reads lm_head's weight
        # inside the model's forward, where the root's pre-forward hook has gathered it.
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")


def leave() -> None:
    """Exit every rank together, skipping the process-group and interpreter teardown: a gloo rank tearing down
    while its peer still exits was seen to hang for good (one in a few runs on the CPU machines)."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
