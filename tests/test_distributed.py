"""Every kernel works under PyTorch's distributed engines: a tiny Qwen3 with all fused kernels, trained by 2
processes under DDP and under FSDP2 (`fully_shard`, DTensor parameters; also with activation checkpointing),
gives the first step's gradients and the loss curve of one process seeing the whole batch
(tests/distributed_worker.py does the training). Measured on CPU: gradients within 0.8% of their scale (about
two bf16 ulps), losses within 5e-5; without the engines' gradient reduction the gradients are off by 135%.

On CPU: gloo and the torch-cpu variant. On a machine with 2 GPUs: NCCL and the Triton kernels.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT

WORKER = REPO_ROOT / "tests" / "distributed_worker.py"
# bf16 everywhere (flash attention takes fp16/bf16): the ranks sum their gradients in another order and
# round differently than one process does, a few bf16 ulps (2^-8 relative) of each gradient's scale.
# A missing or doubled reduction is off by a factor of two or by a whole half-batch.
GRAD_TOLERANCE = 3e-2
LOSS_TOLERANCE = 1e-2


def run_worker(tmp_path, build_dir, engine, processes, *extra):
    out = tmp_path / f"{engine}.pt"
    env = {**os.environ, "LOCAL_KERNELS": f"myorg/fused-kernels={build_dir}", "OMP_NUM_THREADS": "1"}
    # --standalone: a rendezvous on a free local port, so parallel runs never collide.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(WORKER), "--engine", engine, "--out", str(out), *extra]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        _kill_run(out)
        proc.kill()
        pytest.fail(f"{engine} run timed out after 300 s")
    assert proc.returncode == 0, f"{engine} run failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return torch.load(out)


def _kill_run(out):
    """Kill torchrun and every rank of the run writing ``out`` (ranks are not in torchrun's process group)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out).encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, build_dir):
    return run_worker(tmp_path_factory.mktemp("single"), build_dir, "single", 1)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="the CUDA form of this test needs 2 GPUs")
@pytest.mark.parametrize("engine, checkpointing", [("ddp", False), ("fsdp2", False), ("fsdp2", True)],
                         ids=["ddp", "fsdp2", "fsdp2-checkpointing"])
def test_two_processes_match_one(tmp_path, build_dir, single_process, engine, checkpointing):
    result = run_worker(tmp_path, build_dir, engine, 2, *(["--checkpointing"] if checkpointing else []))
    assert result["world"] == 2 and single_process["world"] == 1
    assert result["grads"].keys() == single_process["grads"].keys()
    for name, want in single_process["grads"].items():
        got = result["grads"][name]
        scale = want.abs().max().item()
        assert scale > 0, f"{name}: no gradient in the single-process run"
        error = (got - want).abs().max().item() / scale
        assert error <= GRAD_TOLERANCE, f"{engine} {name}: gradient off by {error:.3e} of its scale"
    for step, (got, want) in enumerate(zip(result["losses"], single_process["losses"])):
        assert abs(got - want) <= LOSS_TOLERANCE * abs(want), f"{engine} step {step}: loss {got} vs {want}"
