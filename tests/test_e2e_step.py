"""benchmarks/e2e_step.py, the end-to-end training-step benchmark, on a tiny Qwen3 (seconds on a CPU, where ours is
the torch-cpu variant and torchrun uses gloo): every mode runs to the end, each provider in its own process, and
writes the report with the fields the GPU run fills in. The GPU numbers themselves come from the H200 runs."""

import collections
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace as Event

import pytest
import torch

from conftest import ON_GPU, REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "e2e_step.py"
TINY = ["--models", "tiny-qwen3", "--batch", "2", "--seq", "32", "--warmup", "1", "--steps", "2"]


def run_bench(build_dir, out, *args):
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--kernel-path", str(build_dir), "--out", str(out),
                           *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_one_device_each_provider_in_its_own_process(build_dir, tmp_path):
    # sdpa and sdpa_compile are left out to keep this fast: they run the same worker on stock transformers.
    run_bench(build_dir, tmp_path, "--providers", "liger", "fused_kernels", "fused_kernels_sdpa_attention")
    report = json.loads((tmp_path / "e2e_step.json").read_text())
    rows = {row["provider"]: row for row in report["results"]}
    assert set(rows) == {"liger", "fused_kernels", "fused_kernels_sdpa_attention"}
    assert rows["fused_kernels_sdpa_attention"]["status"] == "ok", rows["fused_kernels_sdpa_attention"]
    row = rows["fused_kernels"]
    assert row["status"] == "ok", row
    assert len(row["step_ms"]) == 2 and row["ms_per_step"] > 0
    assert row["tokens_per_s"] == pytest.approx(2 * 32 / (row["ms_per_step"] / 1000))
    assert (row.get("peak_gib") is not None) == ON_GPU
    if not ON_GPU:
        assert report["header"]["fused_kernels"]["variant"] == "torch-cpu"
    try:
        import liger_kernel  # noqa: F401
        assert rows["liger"]["status"] == "ok"
    except ImportError:
        assert rows["liger"]["status"] == "skipped"
    markdown = (tmp_path / "e2e_step.md").read_text()
    assert "| fused_kernels |" in markdown and "Targets for fused_kernels" in markdown


@pytest.mark.skipif(ON_GPU and torch.cuda.device_count() < 2, reason="the CUDA form needs 2 GPUs")
def test_scaling_on_one_and_two_processes(build_dir, tmp_path):
    run_bench(build_dir, tmp_path, "--nproc", "2", "--engines", "ddp", "fsdp2", "--providers", "fused_kernels")
    results = json.loads((tmp_path / "e2e_scaling.json").read_text())["results"]
    rows = {(row["engine"], row["world"]): row for row in results}
    assert set(rows) == {("single", 1), ("ddp", 2), ("fsdp2", 2)}
    for (engine, world), row in rows.items():
        assert row["status"] == "ok", row
        # tokens/s counts every rank's batch.
        assert row["tokens_per_s"] == pytest.approx(world * 2 * 32 / (row["ms_per_step"] / 1000))
    assert "| fused_kernels | ddp | 2 | 4 |" in (tmp_path / "e2e_scaling.md").read_text()


def test_profile_attributes_time_to_our_op_families(build_dir, tmp_path):
    run_bench(build_dir, tmp_path, "--profile", "fused_kernels")
    profile = (tmp_path / "e2e_profile_tiny-qwen3_fused_kernels.md").read_text()
    # On a CPU the torch-cpu variant's autograd Functions show as ops; on a GPU, our Triton kernels by name.
    for family in ("rms_norm", "rope", "flash_attn"):
        assert f"| {family} |" in profile
    assert not (tmp_path / "e2e_step.json").exists(), "a profile run must not overwrite the timing results"


def test_profile_names_the_op_that_launched_each_kernel(monkeypatch):
    """The profile's "launched by" column: each GPU kernel under the op that launched it and the outermost op around
    that one (profiler events stood in for by plain objects: a CPU machine launches no GPU kernels)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its sibling modules (harness, ...)
    spec = importlib.util.spec_from_file_location("e2e_step_under_test", SCRIPT)
    e2e_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e_step)
    kernel = lambda name: Event(name=name)  # noqa: E731
    node = Event(name="autograd::engine::evaluate_function: MmBackward0", cpu_parent=None, kernels=[])
    mm = Event(name="aten::mm", cpu_parent=node, kernels=[kernel("gemm"), kernel("gemm")])
    cat = Event(name="aten::cat", cpu_parent=None, kernels=[kernel("cat_copy")])
    idle = Event(name="aten::empty", cpu_parent=None, kernels=[])
    prof = Event(events=lambda: [node, mm, cat, idle, cat])
    assert e2e_step._launch_sites(prof) == {
        "gemm": collections.Counter({"aten::mm <- autograd::engine::evaluate_function: MmBackward0": 2}),
        "cat_copy": collections.Counter({"aten::cat": 2}),
    }
