"""Every kernel works under PyTorch's distributed engines: a tiny Qwen3 with all fused kernels, trained by 2
processes under DDP and FSDP2 (`fully_shard`, DTensor parameters; with activation checkpointing; with
`torch.compile` over the wrapped model; with a bf16/fp32 MixedPrecisionPolicy), gives the first step's
gradients and the loss curve of one process seeing the whole batch, and two runs of the same command agree
bit for bit (tests/distributed_worker.py does the training, in PyTorch's deterministic mode).

cpu: gloo and CPU tensors: the torch-cpu variant (on a CUDA torch, that torch's variant, whose ops take their
PyTorch path for CPU tensors; the GPUs stay visible, as in a user's CPU run). In CI: about 50 s on 2 cores, 30 s of
it the compiled launch (each rank compiles the model; cold Inductor cache), so CPU CI compiles one engine (DDP).
Measured on CPU: gradients within 0.8% of their scale (about two bf16 ulps; 0.5% with the mixed policy), losses
within 8e-5; without the engines' gradient reduction the gradients are off by 135%.
cuda: NCCL (NVLink multicast off), one GPU per rank, the variant `kernels` selects (Triton kernels, our flash
attention); runs where at least 2 GPUs are visible.
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
GPUS = torch.cuda.device_count()
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}"))]
# bf16 compute everywhere (flash attention takes fp16/bf16): the ranks sum their gradients in another order and
# round differently than one process does (and Inductor fuses bf16 ops without rounding between them), a few
# bf16 ulps (2^-8 relative) of each gradient's scale. A missing or doubled reduction is off by a factor of two
# or by a whole half-batch.
GRAD_TOLERANCE = 3e-2
LOSS_TOLERANCE = 1e-2

# Launches of 2 processes: the runs of one launch (tests/distributed_worker.py names them) share a start-up
# (imports, process group), most of a launch's cost. The single-process runs come last: rank 0 runs them alone
# while rank 1 waits, so they run with the kernels already compiled (a cold Triton cache on the GPU would
# otherwise keep rank 1 waiting near the collective timeout). The first launch is also relaunched for the
# reproducibility test.
MAIN_LAUNCH = ("ddp", "fsdp2", "fsdp2-checkpointing", "fsdp2-mixed", "single", "single-mixed")
LAUNCHES = {"cpu": [MAIN_LAUNCH, ("ddp-compile",)], "cuda": [MAIN_LAUNCH, ("ddp-compile", "fsdp2-compile")]}
# Two processes against the one-process run they must match. The mixed-precision reference is one process with
# fp32 master weights computing with bf16 copies of them, no autocast (distributed_worker.MasterWeights).
PARITY = {"ddp": "single", "ddp-compile": "single", "fsdp2": "single", "fsdp2-checkpointing": "single",
          "fsdp2-compile": "single", "fsdp2-mixed": "single-mixed"}


def launch(tmp_path, build_dir, device, runs):
    """Run ``runs`` in one torchrun command; returns {run name: result}."""
    out = tmp_path / f"{device}-{'+'.join(runs)}.pt"
    env = {**os.environ, "LOCAL_KERNELS": f"myorg/fused-kernels={build_dir}", "OMP_NUM_THREADS": "1",
           "NCCL_NVLS_ENABLE": "0"}
    # --standalone: a rendezvous on a free local port, so parallel runs never collide.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER), "--device", device, "--runs", *runs, "--out", str(out)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        _kill_run(out)
        proc.kill()
        pytest.fail(f"{device} {runs} timed out after 300 s")
    assert proc.returncode == 0, f"{device} {runs} failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    results = torch.load(out)
    out.unlink()  # a relaunch writes afresh
    for name, result in results.items():
        assert result["world"] == (1 if name.startswith("single") else 2)
        # transformers routes attention to our flash attention, on both devices.
        assert result["attention"] == "myorg/fused-kernels@v2", name
    return results


def _kill_run(out):
    """Kill torchrun and every rank of the run writing ``out`` (ranks are not in torchrun's process group)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out).encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


@pytest.fixture(scope="module")
def runs(tmp_path_factory, build_dir):
    """``runs(device, name)``: that run's result, from its launch, made once per module (the parity tests and
    the reproducibility test share them); pytest.skip where the device's launches leave the run out."""
    tmp, launched = tmp_path_factory.mktemp("runs"), {}

    def get(device, name):
        group = next((group for group in LAUNCHES[device] if name in group), None)
        if group is None:
            pytest.skip(f"{name}: not run on {device} (CI compiles one engine; a compiled launch takes 30 s)")
        if (device, group) not in launched:
            launched[device, group] = launch(tmp, build_dir, device, group)
        return launched[device, group][name]

    return get


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", PARITY)
def test_two_processes_match_one(runs, device, name):
    result, want = runs(device, name), runs(device, PARITY[name])
    # bf16 compute either way; the mixed runs keep fp32 weights and hand AdamW fp32 gradients.
    master = torch.float32 if name.endswith("mixed") else torch.bfloat16
    for run in (result, want):
        assert run["dtypes"] == {"compute": torch.bfloat16, "params": master, "grads": master}
    assert result["grads"].keys() == want["grads"].keys()
    for param, expected in want["grads"].items():
        got = result["grads"][param]
        scale = expected.abs().max().item()
        assert scale > 0, f"{param}: no gradient in the single-process run"
        error = (got - expected).abs().max().item() / scale
        assert error <= GRAD_TOLERANCE, f"{device} {name} {param}: gradient off by {error:.3e} of its scale"
    for step, (got, expected) in enumerate(zip(result["losses"], want["losses"])):
        assert abs(got - expected) <= LOSS_TOLERANCE * abs(expected), f"{device} {name} step {step}: loss {got} " \
                                                                      f"vs {expected}"


@pytest.mark.parametrize("device", DEVICES)
def test_runs_are_reproducible(tmp_path, build_dir, runs, device):
    """Deterministic mode: launching the same command again gives the same losses and gradients, bit for bit,
    for every run of it."""
    names = LAUNCHES[device][0]
    again = launch(tmp_path, build_dir, device, names)
    for name in names:
        first, second = runs(device, name), again[name]
        assert second["losses"] == first["losses"], f"{device} {name}: losses {second['losses']} vs {first['losses']}"
        for param, grad in first["grads"].items():
            assert torch.equal(second["grads"][param], grad), f"{device} {name} {param}: gradient differs"
