"""The `benchmarks/benchmark_*.py` scripts that `kernels benchmark myorg/fused-kernels --version 2` runs: each
defines a `kernels.Benchmark` subclass, and kernels' own runner (the function the CLI calls per class) runs every
workload once on tiny CPU shapes with the torch-cpu variant, its verify step included (the runner raises when
our output is not allclose to the reference). The timings are meaningful only on a GPU.

Also the comparative suite `benchmarks/run.py` for attention: its smoke run, and the chunked float32 reference
that checks every provider (on the GPU it runs at s=16384, where only its chunking makes it fit)."""

import argparse
import json
import subprocess
import sys

import pytest
import torch
from kernels.benchmark import Benchmark

from conftest import ON_GPU, REPO_ROOT
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


BENCHMARKS_DIR = REPO_ROOT / "benchmarks"


def test_attention_suite_quick_run(build_dir, tmp_path):
    """`run.py --ops flash_attn --quick` (on a CPU: our kernels in the interpreter, float16): every provider of
    both masks passes the float32 check and is timed, and the JSON and markdown results are written."""
    command = [sys.executable, "run.py", "--ops", "flash_attn", "--quick", "--kernel-path", str(build_dir),
               "--out", str(tmp_path)]
    proc = subprocess.run(command, cwd=BENCHMARKS_DIR, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "flash_attn.json").read_text())["rows"]
    ours = [row for row in rows if row["provider"] == "fused_kernels"]
    assert {(row["mode"], row["shape"]["causal"]) for row in ours} == {(mode, causal) for mode in ("fwd", "fwd+bwd")
                                                                       for causal in (0, 1)}
    # On a GPU some SDPA backends may refuse the tiny head dim (recorded as unsupported); none may be wrong.
    allowed = {"ok", "unsupported"} if torch.cuda.is_available() else {"ok"}
    assert all(row["status"] == "ok" and row["tflops"] > 0 for row in ours), ours
    assert {row["status"] for row in rows} <= allowed, [row for row in rows if row["status"] not in allowed]
    report = (tmp_path / "flash_attn.md").read_text()
    assert "TFLOP/s of every provider, flash_attn fwd+bwd" in report


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_attention_reference_matches_one_pass(monkeypatch, causal):
    """The reference split into query chunks (here 5 rows each, the last one short) gives the output and
    gradients of one unchunked pass, with GQA; that pass matches torch's scaled_dot_product_attention."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import bench_flash_attn

    batch, seq, heads = 2, 37, 4
    monkeypatch.setattr(bench_flash_attn, "REFERENCE_CHUNK_SCORES", batch * heads * seq * 5)
    torch.manual_seed(0)
    q = torch.randn(batch, seq, heads, 8, requires_grad=True)
    k, v = (torch.randn(batch, seq, 2, 8, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(batch, seq, heads, 8)

    def output_and_grads(attention):
        out = attention(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), grad_out))

    chunked = output_and_grads(bench_flash_attn.chunked_reference(causal))
    one_pass = output_and_grads(lambda q, k, v: bench_flash_attn.eager_attention(q, k, v, causal))
    for got, want in zip(chunked, one_pass):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=causal, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(one_pass[0], sdpa, rtol=1e-5, atol=1e-5)


def test_offline_compile_vectorises_aligned_rows():
    """`compile_offline.py` compiles the SwiGLU/GeGLU and RMSNorm kernels for sm_90 (no GPU needed) and fails when a
    layout whose rows all start on 16-byte boundaries gets narrower accesses: RMSNorm's rows of 8 * odd bf16
    elements included, whose alignment only its ALIGN rewrite shows the compiler. Rows off boundaries must come out
    with single-element accesses, so the check can tell the two apart."""
    proc = subprocess.run([sys.executable, "compile_offline.py"], cwd=BENCHMARKS_DIR, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "0 failure(s)" in lines
    length_aligned = [line for line in lines if "_rms_norm_" in line and "length_aligned" in line]
    odd = [line for line in lines if "_rms_norm_" in line and "odd_width" in line]
    assert len(length_aligned) == len(odd) == 15
    assert all(int(line.split()[-3]) <= 1 for line in length_aligned)
    assert all(int(line.split()[-3]) > 8 for line in odd)


def test_rms_norm_tuner_keeps_untuned_buckets(monkeypatch):
    """tune_rms_norm.py --buckets rewrites only the tuned buckets' entries: with nothing tuned the device's table
    comes back unchanged (whole-row entries without block_cols, the last entry's chunked config kept), and a tuned
    bucket replaces exactly its own entry."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import tune_rms_norm

    table = json.loads((REPO_ROOT / "torch-ext/fused_kernels/configs/rms_norm.json").read_text())
    current = table["backward"]["NVIDIA H200"]
    assert tune_rms_norm.to_entries([], "backward", current) == current
    tuned = {"block_rows": 2, "block_cols": 4096, "num_warps": 8, "programs_per_sm": 1}
    entries = tune_rms_norm.to_entries([(65536, {"backward": (0.1, tuned)})], "backward", current)
    assert entries == [entry if entry["max_cols"] != 65536 else {"max_cols": 65536, **tuned} for entry in current]
    # The forward's entries for small calls (max_elements) stay before their bucket's, tuned or not.
    forward = table["forward"]["NVIDIA H200"]
    assert any("max_elements" in entry for entry in forward)
    assert tune_rms_norm.to_entries([], "forward", forward) == forward
    tuned = {"block_rows": 1, "block_cols": 8192, "num_warps": 16}
    entries = tune_rms_norm.to_entries([(8192, {"forward": (0.1, tuned)})], "forward", forward)
    assert entries == [entry if entry["max_cols"] != 8192 or "max_elements" in entry
                       else {"max_cols": 8192, "block_rows": 1, "num_warps": 16} for entry in forward]


def test_swiglu_tuner_adds_a_small_call_entry_only_where_another_tile_wins(monkeypatch):
    """tune_swiglu.py: a bucket gets a ``max_elements`` entry for small calls before its own only where the tile
    fastest at SMALL_ELEMENTS beats the large calls' tile there by more than 2%, and only in the forward; the
    package's lookup then picks each tile by the call's size."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import tune_swiglu
    from launch_tables import package_launch_config

    monkeypatch.setattr(tune_swiglu, "small_call_limit", lambda: 1000)
    large, small = {"block_rows": 1, "block_cols": 2048, "num_warps": 8}, {"block_rows": 1, "block_cols": 2048,
                                                                            "num_warps": 4}
    timings = {("forward", tuple(large.items())): 1.0}
    assert tune_swiglu.small_call_tile({"forward": (0.97, small), "timings": timings}, large) == small
    assert tune_swiglu.small_call_tile({"forward": (0.99, small), "timings": timings}, large) is None
    best = {"forward": (1.0, large), "backward": (1.0, large)}
    results = [(4096, best, None), (8192, best, small)]
    forward = tune_swiglu.to_entries(results, "forward")
    assert forward == [{"max_cols": 4096, **large, "one_row": True},
                       {"max_cols": None, "max_elements": 1000, **small, "one_row": True},
                       {"max_cols": None, **large, "one_row": True}]
    assert tune_swiglu.to_entries(results, "backward") == [{"max_cols": 4096, **large}, {"max_cols": None, **large}]
    select = package_launch_config().select_entry
    assert select(forward, 8192, 1000)["num_warps"] == 4 and select(forward, 8192, 1001)["num_warps"] == 8


def test_rms_norm_tuner_keeps_the_least_worst_slowdown(monkeypatch):
    """tune_rms_norm.py times each candidate at every size of ELEMENTS and keeps the one whose largest ratio to the
    fastest time at any size is the least: here not the fastest at either size."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import tune_rms_norm

    by_config = {(("num_warps", 4),): [0.98, 9.9], (("num_warps", 8),): [1.05, 9.0], (("num_warps", 16),): [1.0, 9.6]}
    # Fastest: 0.98 and 9.0; worst ratios 1.100, 1.071 and 1.067: 16 warps.
    assert tune_rms_norm._least_worst_slowdown(by_config) == ([1.0, 9.6], {"num_warps": 16})


def test_flash_attn_tuner_keeps_the_pointer_tile_for_descriptor_entries(monkeypatch):
    """tune_flash_attn.py: ``fastest`` returns the fastest tile overall and the fastest with pointer loads, and
    ``table_entry`` turns a descriptor winner into an entry that keeps the pointer tile's differences as
    ``without_desc`` (what varlen batches and small attentions run), each tile with its faster program order."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import tune_flash_attn

    def timed(tile):  # descriptors help, the one-loop form only with them, heavy-first helps pointer tiles
        if tile["num_warps"] == 4 and tile["num_stages"] == 3:
            raise RuntimeError("out of resources")
        return (1.0 - 0.1 * tile["desc"] - 0.05 * (tile["one_loop"] == tile["desc"])
                - 0.01 * tile.get("heavy_first", False) * (not tile["desc"]) + 0.001 * tile["block_n"] / 128)

    best, pointers = tune_flash_attn.fastest("test", timed)
    assert best["desc"] and best["one_loop"] and not pointers["desc"] and not pointers["one_loop"]
    entry = tune_flash_attn.table_entry("test", timed, (best, pointers))
    assert entry == {**best, "desc_min_flops": tune_flash_attn.DESC_MIN_FLOPS,
                     "without_desc": {"heavy_first": True, "one_loop": False}}
    assert tune_flash_attn.table_entry("test", timed, (pointers, pointers)) == {**pointers, "heavy_first": True}


def test_flash_attn_tuner_switches(monkeypatch):
    """tune_flash_attn.py: ``with_switch`` turns a launch switch on only when that is faster and runs; a descriptor
    entry's pointer-load fallback (not timed with the switch) keeps it off."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import tune_flash_attn

    entry = {"block_m": 128, "block_n": 64, "desc": True, "without_desc": {"one_loop": False}}
    faster = lambda tile: 1.0 - 0.1 * tile.get("pipelined", False)  # noqa: E731
    slower = lambda tile: 1.0 + 0.1 * tile.get("pipelined", False)  # noqa: E731

    def failing(tile):
        if tile.get("pipelined"):
            raise RuntimeError("out of resources")
        return 1.0

    assert tune_flash_attn.with_switch("test", faster, entry, "pipelined") == {
        **entry, "pipelined": True, "without_desc": {"one_loop": False, "pipelined": False}}
    assert tune_flash_attn.with_switch("test", slower, entry, "pipelined") == entry
    assert tune_flash_attn.with_switch("test", failing, entry, "pipelined") == entry
    pointers = {"block_m": 64, "desc": False}
    assert tune_flash_attn.with_switch("test", faster, pointers, "pipelined") == {**pointers, "pipelined": True}


def test_flash_attn_tuner_keeps_a_short_tile_only_where_it_wins(monkeypatch):
    """tune_flash_attn.py: ``with_short`` gives the forward entry the fastest tile at short keys (candidates that
    cannot run skipped) when it beats the entry's own tile there by ``1 - SHORT_MIN_GAIN``, else none; an old
    ``short`` is replaced either way."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import tune_flash_attn

    entry = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "one_loop": True,
             "short": {"max_seqlen_k": 1, "block_m": 16}}

    def timed(tile, gain):
        assert "short" not in tile and tile["one_loop"]
        if tile["num_warps"] == 8 and tile["block_m"] == 64:
            raise RuntimeError("out of resources")
        if (tile["block_m"], tile["block_n"], tile["num_warps"], tile["num_stages"]) == (64, 64, 4, 3):
            return 1.0 - gain
        return 1.0 + 0.01 * (tile["block_m"] != 128)

    chosen = tune_flash_attn.with_short("test", lambda tile: timed(tile, 0.1), entry)
    plain = {key: value for key, value in entry.items() if key != "short"}
    assert chosen == {**plain, "short": {"max_seqlen_k": tune_flash_attn.SHORT_SEQ, "block_m": 64, "block_n": 64,
                                         "num_warps": 4, "num_stages": 3}}
    assert tune_flash_attn.with_short("test", lambda tile: timed(tile, 0.02), entry) == plain


def test_flash_attn_tuner_keeps_the_backward_through_ds_only_where_it_wins(monkeypatch):
    """tune_flash_attn.py: ``with_from_ds`` gives the dQ entry the fastest ``from_ds`` tile (candidates that cannot
    run skipped) in its faster program order, and none when no tile beats the dQ pass; an old ``from_ds`` is
    replaced either way."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import tune_flash_attn

    entry = {"block_m": 128, "block_n": 64, "num_warps": 8, "from_ds": {"block_m": 1}}

    def timed(tile):
        from_ds = tile.get("from_ds")
        if from_ds is None:
            return 1.0
        if from_ds["num_stages"] == 4:
            raise RuntimeError("out of resources")
        # Fastest: 128 x 128 on 8 warps at 3 stages, in the natural order.
        return (0.9 - 0.1 * (from_ds["block_m"] == 128 and from_ds["block_n"] == 128 and from_ds["num_warps"] == 8
                             and from_ds["num_stages"] == 3) - 0.01 * (not from_ds["heavy_first"]))

    chosen = tune_flash_attn.with_from_ds("test", timed, entry, 128)
    assert chosen == {"block_m": 128, "block_n": 64, "num_warps": 8, "from_ds": {
        "block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "heavy_first": False,
        "budget": tune_flash_attn.FROM_DS_BUDGET, "min_flops": tune_flash_attn.DESC_MIN_FLOPS,
        "min_programs": tune_flash_attn.FROM_DS_MIN_PROGRAMS,
        "max_granule_ratio": tune_flash_attn.FROM_DS_MAX_GRANULE_RATIO[128]}}
    slower = lambda tile: 1.0 + 0.1 * ("from_ds" in tile)  # noqa: E731
    assert tune_flash_attn.with_from_ds("test", slower, entry, 128) == {"block_m": 128, "block_n": 64, "num_warps": 8}


def test_report_derives_the_backward_alone(monkeypatch):
    """The markdown report's backward-alone TFLOP/s: (fwd+bwd FLOPs - fwd FLOPs) / (fwd+bwd time - fwd time), from
    the medians per provider and from our GPU kernel times; a provider without both rows gets its status."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import harness

    def row(mode, provider, ms, gflop, gpu_ms=None, status="ok"):
        return harness.Row("attn", mode, {"s": 4096}, "bfloat16", provider, status, ms=ms, gpu_ms=gpu_ms,
                           tflops=None if ms is None else gflop / ms, floor_ms=0.5, gbps=1.0,
                           ratio_vs_best_peer=1.0)

    rows = [row("fwd", harness.OURS, 1.0, 100.0, gpu_ms=0.9), row("fwd", "peer", 2.0, 100.0),
            row("fwd", "partial", None, 100.0, status="unsupported"),
            row("fwd+bwd", harness.OURS, 3.0, 350.0, gpu_ms=2.15), row("fwd+bwd", "peer", 7.0, 350.0),
            row("fwd+bwd", "partial", 4.0, 350.0)]
    report = harness.markdown_report("attn", {"device": "d", "torch": "t", "triton": "t", "liger_kernel": "l",
                                              "date": "today", "timing": "median", "copy_gbps": 1.0,
                                              "gemm_tflops": 1.0,
                                              "fused_kernels": {"variant": "v", "commit": "c" * 10, "dirty": False}},
                                     rows)
    table = report.split("TFLOP/s of the attn backward alone")[1].splitlines()
    assert table[2] == f"| s | {harness.OURS} | peer | partial | {harness.OURS} (GPU time) |"
    # 250 GFLOP of backward: in 2 ms (ours), 5 ms (the peer), 1.25 ms of our GPU time.
    assert table[4] == "| 4096 | 125 | 50 | unsupported | 200 |"


def test_suite_times_providers_in_interleaved_rounds(monkeypatch):
    """harness.run_benchmark times every provider in ROUNDS rounds that take the providers in turn, and a row
    keeps its fastest round; a provider failing the correctness gate is not timed (WRONG), and one that raises
    in a later round is recorded as unsupported without stopping the others."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import harness

    called = []

    def provider(name, scale=1.0, raises_on_call=None):
        def run(x):
            called.append(name)
            if raises_on_call is not None and called.count(name) == raises_on_call:
                raise RuntimeError(f"{name} cannot run this")
            return x * 2 * scale
        return run

    # Each provider's call is counted once by the gate (fwd), then once per round by the fake median below.
    providers = {harness.OURS: provider(harness.OURS), "peer": provider("peer"), "wrong": provider("wrong", 1.5),
                 "flaky": provider("flaky", raises_on_call=3)}
    bench = harness.OpBenchmark(
        op="double", cases=[harness.Case({"n": 8}, torch.float32)], providers=providers,
        make_inputs=lambda case, device: {"x": torch.randn(case.shape["n"], device=device, requires_grad=True)},
        reference=lambda x: x * 2, output_names=("y",), bytes_moved=lambda case, mode: 64)
    monkeypatch.setattr(harness, "MODES", ("fwd",))
    scripted = {harness.OURS: [3.0, 1.0, 2.0], "peer": [2.5, 4.0, 2.0], "flaky": [1.0]}
    rounds = []

    def fake_median_ms(fn, on_gpu, grad_to_none=(), rep_ms=harness.REP_MS):
        fn()
        name = called[-1]
        rounds.append(name)
        assert rep_ms == harness.REP_MS / harness.ROUNDS
        return scripted[name].pop(0)

    monkeypatch.setattr(harness, "median_ms", fake_median_ms)
    env = harness.Env(device=torch.device("cpu"), ours=None, quick=True)
    rows = {row.provider: row for row in harness.run_benchmark(bench, env, copy_gbps=1.0, gemm_tflops=1.0,
                                                               only_providers=None)}
    assert harness.ROUNDS == 3
    assert rounds == [harness.OURS, "peer", "flaky", harness.OURS, "peer", harness.OURS, "peer"]
    assert rows[harness.OURS].ms == 1.0 and rows["peer"].ms == 2.0
    assert rows[harness.OURS].ratio_vs_best_peer == 0.5
    assert rows["wrong"].status == "WRONG" and rows["wrong"].ms is None
    assert rows["flaky"].status == "unsupported" and "cannot run this" in rows["flaky"].note


@pytest.mark.parametrize("module_name", sorted(f"bench_{op}" for op in OP_FAMILIES))
def test_rotated_input_sets_keep_every_mode_out_of_l2(monkeypatch, module_name):
    """Every case of the H200 grid rotates enough input sets that, in each mode, the other sets' traffic is twice the
    L2 (or the cap is reached): the profiler's GPU time flushes nothing between calls (the forward rows had the
    forward+backward's count, 1 set at RMSNorm 4096 x 4096 where 3 were needed)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import harness
    module = __import__(module_name)

    class Ours:  # the providers are only named here, never called
        def __getattr__(self, name):
            return None

    env = harness.Env(device=torch.device("cuda"), ours=Ours(), quick=False)  # the GPU grid; nothing is allocated
    for bench in module.benchmarks(env):
        for case in bench.cases:
            count = harness.input_set_count(bench, case)
            for mode in harness.MODES:
                moved = bench.bytes_moved(case, mode)
                assert (count == harness.MAX_INPUT_SETS or moved >= 2 * harness.H200_L2_BYTES
                        or (count - 1) * moved >= 2 * harness.H200_L2_BYTES), (bench.op, case.shape, mode, count)


@pytest.mark.parametrize("device, smoke, default, explicit_h200", [
    ("NVIDIA H200", False, "h200", "allowed"),
    ("NVIDIA H200", True, "local/nvidia-h200-smoke", "refused"),
    ("NVIDIA H100 80GB HBM3", False, "local/nvidia-h100-80gb-hbm3", "refused"),
    (None, False, "local/cpu", "refused"),
    (None, True, "local/cpu-smoke", "refused"),
])
def test_only_full_h200_runs_write_the_committed_results(monkeypatch, tmp_path, device, smoke, default,
                                                          explicit_h200):
    """The README cites benchmarks/results/h200: a CPU smoke run of e2e_step.py with the default --out replaced its
    H200 tables. Now only a full run on an H200 writes there (by default); any other run defaults to the git-ignored
    results/local/<device>[-smoke], and pointing it at results/h200 exits naming --out."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import harness
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: device)
    assert harness.results_dir(None, smoke=smoke) == BENCHMARKS_DIR / "results" / default
    assert harness.results_dir(tmp_path, smoke=smoke) == tmp_path
    if explicit_h200 == "allowed":
        assert harness.results_dir(BENCHMARKS_DIR / "results" / "h200", smoke=smoke) == harness.H200_RESULTS_DIR
    else:
        with pytest.raises(SystemExit, match="--out .*committed NVIDIA H200 results"):
            harness.results_dir(BENCHMARKS_DIR / "results" / ".." / "results" / "h200", smoke=smoke)


@pytest.mark.parametrize("script, args", [("run.py", ["--ops", "rms_norm", "--quick"]),
                                          ("e2e_step.py", ["--models", "tiny-qwen3", "--batch", "1", "--seq", "8"])])
def test_smoke_runs_refuse_the_committed_results_before_any_work(script, args):
    """Both scripts check --out first: a smoke run aimed at results/h200 exits at once (no build, no timing) and the
    committed files stay as they are."""
    before = {path.name: path.stat().st_mtime_ns for path in (BENCHMARKS_DIR / "results" / "h200").iterdir()}
    proc = subprocess.run([sys.executable, script, *args, "--out", "results/h200"], cwd=BENCHMARKS_DIR,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "--out results/h200 holds the committed NVIDIA H200 results" in proc.stderr, (
        proc.stdout + proc.stderr)
    after = {path.name: path.stat().st_mtime_ns for path in (BENCHMARKS_DIR / "results" / "h200").iterdir()}
    assert after == before


def test_register_report_tile_overrides(monkeypatch):
    """`register_report.py --tile`: four to seven fields, the seventh the pass's launch switch (the forward's
    ``pipelined``, the dK/dV pass's ``group_loop``; the dQ pass has none), off unless given."""
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import register_report

    assert register_report.parse_tile("forward=128,64,8,2,1,1,1") == ("forward", {
        "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2, "one_loop": True, "desc": True,
        "pipelined": True})
    assert register_report.parse_tile("dkdv=64,128,8,3") == ("backward_dkdv", {
        "block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 3, "one_loop": False, "desc": False,
        "group_loop": False})
    assert register_report.parse_tile("dq=128,64,8,3,0,1")[1] == {
        "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "one_loop": False, "desc": True}
    for bad in ("dq=128,64,8,3,0,1,1", "forward=128,64,8", "attn=64,64,4,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            register_report.parse_tile(bad)


@pytest.mark.skipif(ON_GPU, reason="an offline tool for machines without a GPU (there, compiled kernels report "
                                   "their registers themselves)")
def test_register_report_compiles_offline():
    """`register_report.py` compiles the flash-attention kernels for sm_90a on a machine without a GPU and reads
    registers and spill bytes from `ptxas -v`: one row per kernel, and dK/dV once more per extra group size."""
    command = [sys.executable, "register_report.py", "--head-dims", "64", "--kernels", "forward", "dkdv",
               "--groups", "1", "2"]
    proc = subprocess.run(command, cwd=BENCHMARKS_DIR, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
            if line.startswith("| 64 ")]
    assert [(row[1], row[2]) for row in rows] == [("1", "fwd_kernel"), ("1", "bwd_dkdv_kernel"),
                                                  ("2", "bwd_dkdv_kernel")]
    for row in rows:
        stores, loads = (int(x) for x in row[5].split(" / "))
        assert 0 < int(row[4]) <= 255 and stores >= 0 and loads >= 0, row
