"""The `benchmarks/benchmark_*.py` scripts that `kernels benchmark myorg/fused-kernels --version 2` runs: each
defines a `kernels.Benchmark` subclass, and kernels' own runner (the function the CLI calls per class) runs every
workload once on tiny CPU shapes with the torch-cpu variant, its verify step included (the runner raises when
our output is not allclose to the reference). The timings are meaningful only on a GPU."""

import pytest
from kernels.benchmark import Benchmark

from conftest import REPO_ROOT
from tooling_helpers import require_module

SCRIPTS = sorted((REPO_ROOT / "benchmarks").glob("benchmark*.py"))
OP_FAMILIES = {"rms_norm", "rope", "swiglu", "cross_entropy", "fused_linear_cross_entropy", "flash_attn"}


def test_every_op_family_has_a_benchmark_script():
    assert {p.stem.removeprefix("benchmark_") for p in SCRIPTS} == OP_FAMILIES


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_script_verifies_on_the_cpu_variant(build_dir, script):
    # kernels.cli imports sigstore's cryptography, which the GPU host lacks.
    runner = require_module("kernels.cli.benchmark")
    discover_benchmark_classes, run_benchmark_class = runner.discover_benchmark_classes, runner.run_benchmark_class
    classes = discover_benchmark_classes(script, cwd=REPO_ROOT)
    assert len(classes) == 1 and issubclass(classes[0], Benchmark)
    results, _ = run_benchmark_class(classes[0], iterations=1, warmup=0, repo_id=str(build_dir / "torch-cpu"),
                                     is_local=True, revision="local")
    assert set(results) == {"forward", "forward_backward"}
    assert all(timing.verified for timing in results.values())
