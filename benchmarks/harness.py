"""Shared benchmark machinery: loading our package, timing, the correctness gate, peak memory,
byte-count floors, and the JSON / markdown / PNG writers.

An op module is a file `benchmarks/bench_<name>.py` defining

    def benchmarks(env: Env) -> list[OpBenchmark]

`run.py` finds these files, runs every OpBenchmark they return through `run_benchmark` and writes
`<name>.json`, `<name>.md`, `<name>_time.png` and `<name>_memory.png`. A new op needs only its file.

Conventions an op module follows:
- providers and the reference are plain functions of the named input tensors (the keys of
  `make_inputs`) returning one tensor or a tuple of tensors, in the order of `output_names`;
- `make_inputs` draws fresh random tensors and sets `requires_grad` on the ones to differentiate;
- the reference is the op's exact math; it runs on float32 copies of the inputs;
- `bytes_moved` counts each tensor read or written once (the floor-style count of h200-baselines.md);
- `flops`, for compute-bound ops, makes rows report TFLOP/s, and the floor becomes the longer of the byte floor
  and the FLOPs at the dense GEMM rate measured in the same run (a roofline).
"""

import contextlib
import importlib
import importlib.metadata
import itertools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Callable

import kernels
import torch
import triton
from triton.testing import do_bench

REPO_ROOT = Path(__file__).resolve().parent.parent
# The committed results that the README cites: full runs on an H200 write there by default, any other run under
# LOCAL_RESULTS_DIR (git-ignored), in a folder named after its device.
H200_RESULTS_DIR = REPO_ROOT / "benchmarks" / "results" / "h200"
LOCAL_RESULTS_DIR = REPO_ROOT / "benchmarks" / "results" / "local"
H200_NAME = "NVIDIA H200"
OURS = "fused_kernels"
MODES = ("fwd", "fwd+bwd")
WARMUP_MS = 25
REP_MS = 100
# Each provider is timed in this many rounds, the providers in turn within a round, and keeps its fastest round's
# median (REP_MS in all): noise from the host (another process, a clock change) then falls on one round of every
# provider instead of on the one provider timed while it lasted.
ROUNDS = 3
H200_L2_BYTES = 60 * 10**6
# Inputs smaller than the L2 are rotated among this many sets at most (see _input_set_count).
MAX_INPUT_SETS = 64
# Largest accepted ||out - ref|| / ||ref|| against the float32 reference, per input dtype
# (METHOD.md: bf16 operands land between 1e-3 and 1e-2; float32 far under 1e-3).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}

Provider = Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]


def is_ours(provider: str) -> bool:
    """OURS or another setting of ours ("OURS:setting"): never a peer that ours is compared with."""
    return provider == OURS or provider.startswith(OURS + ":")


@dataclass(frozen=True)
class Case:
    shape: dict[str, int]
    dtype: torch.dtype = torch.bfloat16

    def label(self) -> str:
        return " ".join(f"{name}={size}" for name, size in self.shape.items())


@dataclass
class OpBenchmark:
    op: str
    cases: list[Case]
    # OURS, other settings of ours named "OURS:setting" (e.g. another algorithm), and peers: every other provider.
    providers: dict[str, Provider]
    make_inputs: Callable[[Case, torch.device], dict[str, torch.Tensor]]
    reference: Provider
    output_names: tuple[str, ...]
    bytes_moved: Callable[[Case, str], int]
    # FLOPs per mode (2 per multiply-add), for compute-bound ops: rows then also report TFLOP/s, and the floor
    # counts the FLOPs at the measured GEMM rate.
    flops: Callable[[Case, str], int] | None = None
    # Losses: differentiate with gradient 1 (`loss.backward()`, what a training step does) instead of random.
    unit_grad_outputs: bool = False


@dataclass
class Env:
    device: torch.device
    ours: ModuleType
    quick: bool

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Row:
    op: str
    mode: str
    shape: dict[str, int]
    dtype: str
    provider: str
    status: str  # "ok", "WRONG" (failed the correctness gate, not timed) or "unsupported" (raised)
    bytes_moved: int = 0
    ms: float | None = None
    # Summed device time of the call's kernels (GPU only): the call's cost in a training step whose host runs
    # ahead of the GPU. `ms` also holds host time wherever launching takes longer than the kernels run.
    gpu_ms: float | None = None
    gbps: float | None = None
    peak_mib: float | None = None  # fwd+bwd only
    ratio_vs_best_peer: float | None = None  # ms / fastest peer's ms: below 1 is faster than every peer
    floor_ms: float | None = None  # the longer of bytes at the copy bandwidth and FLOPs at the GEMM rate
    rel_err: dict[str, float | None] | None = None  # None where the output held NaN or inf
    tflops: float | None = None
    note: str = ""


# ---------------------------------------------------------------------------------------------------
# Loading the package and the peers


def build_variants(out_dir: Path) -> Path:
    """Build every variant of the package from this checkout into out_dir with the project's builder."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT / "tools"), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "fused_kernels_tools", "build", "--out", str(out_dir)]
    subprocess.run(command, cwd=REPO_ROOT, env=env, check=True)
    return out_dir


def load_fused_kernels(kernel_path: Path) -> ModuleType:
    """Load our package from a build directory (or a variant directory) the way users get it."""
    cuda_noarch = kernel_path / "torch-cuda"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1" and cuda_noarch.is_dir():
        # On a CPU machine `kernels` would pick torch-cpu, which has no Triton kernels; under the
        # interpreter the torch-cuda variant runs the real kernels on CPU tensors.
        kernel_path = cuda_noarch
    return kernels.get_local_kernel(kernel_path)


def optional_import(module_name: str, provider: str) -> ModuleType | None:
    """Import a peer's module, or print why its provider is skipped."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        print(f"note: provider {provider} skipped: {error}")
        return None


def compile_per_shape(fn: Callable) -> Callable:
    """torch.compile specialised to each shape (what a fixed-shape training run gets), compiled once per shape."""
    # Every benchmarked shape is one more recompile of the same code object; keep them all cached.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    return torch.compile(fn, dynamic=False)


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------
# Timing


def median_ms(fn: Callable[[], object], on_gpu: bool, grad_to_none: list[torch.Tensor] = (),
              rep_ms: float = REP_MS) -> float:
    """Median time of one call of fn, in milliseconds; grad_to_none gradients are reset before each call."""
    if on_gpu:
        return do_bench(fn, warmup=WARMUP_MS, rep=rep_ms, grad_to_none=list(grad_to_none), return_mode="median")
    # CPU smoke runs: CUDA events don't exist, so wall-clock a few calls after one warm-up call.
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1000
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 100):
        for tensor in grad_to_none:
            tensor.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def kernel_ms(fn: Callable[[], object], grad_to_none: list[torch.Tensor] = (), calls: int = 10) -> float:
    """Device time of the kernels (and copies) one call of fn launches, summed from torch.profiler over a few
    calls, in milliseconds: no host time and no gaps between kernels."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(calls):
            for tensor in grad_to_none:
                tensor.grad = None
            fn()
        torch.cuda.synchronize()
    # Only CUDA activity is recorded, so every event is a kernel, copy or memset and none is counted twice (with
    # CPU activity too, an operator's device time would repeat its kernels').
    return sum(event.device_time_total for event in profile.key_averages()) / calls / 1e3


def measure_copy_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    nbytes = 2**31 if device.type == "cuda" else 2**26
    source = torch.randint(-128, 128, (nbytes,), dtype=torch.int8, device=device)
    destination = torch.empty_like(source)
    ms = median_ms(lambda: destination.copy_(source), on_gpu=device.type == "cuda")
    return 2 * nbytes / ms / 1e6


def measure_gemm_tflops(device: torch.device) -> float:
    """Dense matmul rate in TFLOP/s: bf16 8192^3 on a GPU (the compute ceiling of h200-baselines.md), a small
    float32 one on a CPU smoke run."""
    on_gpu = device.type == "cuda"
    size, dtype = (8192, torch.bfloat16) if on_gpu else (256, torch.float32)
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    ms = median_ms(lambda: a @ b, on_gpu)
    return 2 * size**3 / ms / 1e9


def _input_set_count(working_set_bytes: int) -> int:
    """How many input sets to rotate so that the other sets' traffic (twice the L2) evicts a set before its reuse."""
    if working_set_bytes >= 2 * H200_L2_BYTES:
        return 1
    return min(MAX_INPUT_SETS, 1 + math.ceil(2 * H200_L2_BYTES / working_set_bytes))


def input_set_count(bench: OpBenchmark, case: Case) -> int:
    """The input sets a case rotates through: enough for the mode that moves the fewest bytes (the forward). With
    the forward+backward's count, forward rows reused sets still in L2, which do_bench's flush hides from the
    timings but which the profiler's GPU time (no flush) saw."""
    return _input_set_count(min(bench.bytes_moved(case, mode) for mode in MODES))


# ---------------------------------------------------------------------------------------------------
# Running one op


def _as_tuple(outputs) -> tuple[torch.Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _call(provider: Provider, inputs: dict, grad_outputs: tuple | None, mode: str) -> tuple[torch.Tensor, ...]:
    outputs = _as_tuple(provider(**inputs))
    if mode == "fwd+bwd":
        torch.autograd.backward(outputs, grad_outputs)
    return outputs


def _leaves(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in inputs.items() if tensor.requires_grad}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float | None:
    got = got.float()
    if not torch.isfinite(got).all():
        return None
    return (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()


@dataclass
class _Reference:
    outputs: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]  # "grad_<input>" -> float32 gradient


def _reference_and_grad_outputs(bench: OpBenchmark, case: Case, input_sets: list[dict]) -> tuple[_Reference, list]:
    """The float32 reference on the first input set, and one random gradient per output for every set."""
    float_inputs = {
        name: tensor.detach().float().requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else tensor
        for name, tensor in input_sets[0].items()
    }
    outputs = _as_tuple(bench.reference(**float_inputs))
    draw = torch.ones if bench.unit_grad_outputs else torch.randn
    grad_sets = [
        tuple(draw(output.shape, dtype=case.dtype, device=output.device) for output in outputs)
        for _ in input_sets
    ]
    torch.autograd.backward(outputs, [grad.float() for grad in grad_sets[0]])
    reference = _Reference(
        outputs={name: output.detach() for name, output in zip(bench.output_names, outputs)},
        grads={f"grad_{name}": leaf.grad for name, leaf in _leaves(float_inputs).items()},
    )
    return reference, grad_sets


def _check(bench, provider, inputs, grad_outputs, mode, reference: _Reference, tolerance) -> tuple[dict, str]:
    """Relative errors of one call against the reference, and a note naming what failed ("" if all pass)."""
    got = dict(zip(bench.output_names, _call(provider, inputs, grad_outputs, mode)))
    want = dict(reference.outputs)
    if mode == "fwd+bwd":
        got |= {f"grad_{name}": leaf.grad for name, leaf in _leaves(inputs).items()}
        want |= reference.grads
    errors, failures = {}, []
    for name, expected in want.items():
        actual = got.get(name)
        if actual is None or actual.shape != expected.shape:
            failures.append(f"{name} missing or of shape {None if actual is None else tuple(actual.shape)}")
            continue
        errors[name] = _relative_error(actual, expected)
        if errors[name] is None:
            failures.append(f"{name} holds NaN or inf")
        elif errors[name] > tolerance:
            failures.append(f"{name} rel err {errors[name]:.2e} > {tolerance:.0e}")
    return errors, "; ".join(failures)


def _peak_extra_mib(call: Callable[[], object]) -> float:
    """Peak memory allocated during one call beyond what was held before it (inputs, grad outputs)."""
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - held) / 2**20


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _floor_ms(bench: OpBenchmark, case: Case, mode: str, copy_gbps: float, gemm_tflops: float) -> float:
    floor = bench.bytes_moved(case, mode) / copy_gbps / 1e6
    if bench.flops is not None:
        floor = max(floor, bench.flops(case, mode) / gemm_tflops / 1e9)
    return floor


@dataclass
class _Measured:
    row: Row
    calls: list[Callable[[], object]]  # one call per input set, each with this provider's own gradients
    leaves: list[torch.Tensor]


def _prepare(bench, case, mode, name, provider, input_sets, grad_sets, reference, floor_ms) -> _Measured:
    """The provider's row after the correctness gate (status WRONG or unsupported when it fails) and its calls."""
    dtype = str(case.dtype).removeprefix("torch.")
    row = Row(bench.op, mode, case.shape, dtype, name, "ok", bytes_moved=bench.bytes_moved(case, mode),
              floor_ms=floor_ms)
    leaves = [leaf for inputs in input_sets for leaf in _leaves(inputs).values()]
    if mode == "fwd+bwd":
        # Each provider gets its own gradient tensors: some peers (Liger's RMSNorm by default) write dx into dy.
        own_grad_sets = [tuple(grad.clone() for grad in grads) for grads in grad_sets]
    else:
        own_grad_sets = [None] * len(input_sets)
    calls = [
        lambda inputs=inputs, grads=grads: _call(provider, inputs, grads, mode)
        for inputs, grads in zip(input_sets, own_grad_sets)
    ]
    measured = _Measured(row, calls, leaves)
    with _errors_recorded(measured):
        row.rel_err, failures = _check(bench, provider, input_sets[0], own_grad_sets[0], mode, reference,
                                       TOLERANCE[case.dtype])
        if failures:
            row.status, row.note = "WRONG", failures
    return measured


@contextlib.contextmanager
def _errors_recorded(measured: _Measured):
    """An exception from a provider that cannot run a shape marks its row unsupported instead of ending the run;
    the gradients the calls left on the inputs are cleared either way."""
    try:
        yield
    except Exception as error:
        measured.row.status, measured.row.note = "unsupported", first_line(error)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    finally:
        for leaf in measured.leaves:
            leaf.grad = None


def _time_round(measured: _Measured, env: Env) -> None:
    """One timing round: the row keeps the fastest median of its rounds."""
    rotation = itertools.cycle(measured.calls)
    with _errors_recorded(measured):
        ms = median_ms(lambda: next(rotation)(), env.on_gpu, grad_to_none=measured.leaves, rep_ms=REP_MS / ROUNDS)
        measured.row.ms = ms if measured.row.ms is None else min(measured.row.ms, ms)


def _finish(bench, case, mode, measured: _Measured, env: Env) -> None:
    """GPU time, throughput and peak memory of a timed row."""
    row = measured.row
    with _errors_recorded(measured):
        if env.on_gpu:
            rotation = itertools.cycle(measured.calls)
            try:
                row.gpu_ms = kernel_ms(lambda: next(rotation)(), grad_to_none=measured.leaves)
            except RuntimeError as error:  # the profiler itself (no CUPTI, say): the row keeps its timing
                row.note = f"no GPU time: {first_line(error)}"
        row.gbps = row.bytes_moved / row.ms / 1e6
        if bench.flops is not None:
            row.tflops = bench.flops(case, mode) / row.ms / 1e9
        if mode == "fwd+bwd" and env.on_gpu:
            for leaf in measured.leaves:
                leaf.grad = None
            row.peak_mib = _peak_extra_mib(measured.calls[0])


def run_benchmark(bench: OpBenchmark, env: Env, copy_gbps: float, gemm_tflops: float,
                  only_providers: set[str] | None) -> list[Row]:
    providers = {name: fn for name, fn in bench.providers.items() if only_providers is None or name in only_providers}
    rows = []
    for case in bench.cases:
        input_sets = [bench.make_inputs(case, env.device) for _ in range(input_set_count(bench, case))]
        pristine = [{name: tensor.detach().clone() for name, tensor in inputs.items()} for inputs in input_sets]
        reference, grad_sets = _reference_and_grad_outputs(bench, case, input_sets)
        for mode in MODES:
            floor_ms = _floor_ms(bench, case, mode, copy_gbps, gemm_tflops)
            measured = []
            for name, fn in providers.items():
                measured.append(_prepare(bench, case, mode, name, fn, input_sets, grad_sets, reference, floor_ms))
                # Some peers write into their inputs (Liger's cross-entropy stores the gradient in the logits):
                # every provider, mode and round starts from the same values.
                _restore(input_sets, pristine)
            for _ in range(ROUNDS):
                for entry in measured:
                    if entry.row.status == "ok":
                        _time_round(entry, env)
                        _restore(input_sets, pristine)
            for entry in measured:
                if entry.row.status == "ok":
                    _finish(bench, case, mode, entry, env)
                    _restore(input_sets, pristine)
            mode_rows = [entry.row for entry in measured]
            del measured
            peer_times = [row.ms for row in mode_rows if not is_ours(row.provider) and row.status == "ok"]
            for row in mode_rows:
                if row.status == "ok" and peer_times:
                    row.ratio_vs_best_peer = row.ms / min(peer_times)
                print(_progress_line(row, case))
            rows += mode_rows
        del input_sets, pristine, grad_sets, reference
    return rows


def _restore(input_sets: list[dict], pristine: list[dict]) -> None:
    with torch.no_grad():
        for inputs, saved in zip(input_sets, pristine):
            for name, tensor in inputs.items():
                tensor.copy_(saved[name])


def _progress_line(row: Row, case: Case) -> str:
    where = f"{row.op:<20} {row.mode:<8} {case.label():<16} {row.provider:<15}"
    if row.status != "ok":
        return f"{where} {row.status}: {row.note}"
    worst = max(row.rel_err.values(), default=0.0)
    peak = "" if row.peak_mib is None else f"  peak {row.peak_mib:9.1f} MiB"
    tflops = "" if row.tflops is None else f"  {row.tflops:6.1f} TFLOP/s"
    return (
        f"{where} {row.ms:9.4f} ms  {row.gbps:7.0f} GB/s  {100 * row.floor_ms / row.ms:5.1f}% of floor"
        f"{tflops}{peak}  max rel err {worst:.1e}"
    )


# ---------------------------------------------------------------------------------------------------
# Results


def results_dir(out: Path | None, smoke: bool = False) -> Path:
    """Where a run writes its results: ``out`` (the scripts' ``--out``), by default ``H200_RESULTS_DIR`` for a full
    run on an H200 and ``LOCAL_RESULTS_DIR/<device>[-smoke]`` for any other (``smoke``: a reduced grid or model).
    Exits naming ``--out`` when a run that is not a full one on an H200 is pointed at ``H200_RESULTS_DIR``: its tables
    would replace the ones the README cites."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    committed = device == H200_NAME and not smoke
    if out is None:
        slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") + ("-smoke" if smoke else "")
        return H200_RESULTS_DIR if committed else LOCAL_RESULTS_DIR / slug
    if out.resolve() == H200_RESULTS_DIR.resolve() and not committed:
        run = "a smoke run" if smoke else f"a run on {device}"
        raise SystemExit(f"--out {out} holds the committed {H200_NAME} results, which {run} must not replace: "
                         f"leave --out out (results then go to {LOCAL_RESULTS_DIR}) or name another directory")
    return out


def run_header(env: Env, copy_gbps: float, gemm_tflops: float) -> dict:
    build_info = importlib.import_module(f"{env.ours.__name__}._build_info")
    if env.on_gpu:
        device = torch.cuda.get_device_name()
    else:
        device = f"cpu {platform.machine()}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    return {
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "liger_kernel": package_version("liger-kernel"),
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "copy_gbps": round(copy_gbps, 1),
        "gemm_tflops": round(gemm_tflops, 1),
        "fused_kernels": {"variant": build_info.VARIANT, "commit": build_info.COMMIT, "dirty": build_info.DIRTY},
        "quick": env.quick,
        "timing": f"median of triton.testing.do_bench (warmup {WARMUP_MS} ms, rep {REP_MS / ROUNDS:.0f} ms), the "
                  f"fastest of {ROUNDS} rounds that take the providers in turn"
        if env.on_gpu
        else "median wall clock (CPU smoke run)",
    }


def write_json(path: Path, header: dict, rows: list[Row]) -> None:
    path.write_text(json.dumps({"header": header, "rows": [asdict(row) for row in rows]}, indent=1) + "\n")


def _header_lines(header: dict) -> list[str]:
    ours = header["fused_kernels"]
    return [
        f"{header['device']}; torch {header['torch']}, triton {header['triton']}, "
        f"liger-kernel {header['liger_kernel']}; {header['date']}",
        f"fused_kernels {ours['variant']} at {ours['commit'][:10]}{' (dirty)' if ours['dirty'] else ''}; "
        f"{header['timing']}; copy {header['copy_gbps']:.0f} GB/s (read + write); "
        f"dense GEMM {header['gemm_tflops']:.0f} TFLOP/s.",
    ]


def _group(rows: list[Row], *fields: str) -> dict[tuple, list[Row]]:
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault(tuple(getattr(row, field) for field in fields), []).append(row)
    return groups


def _by_shape(rows: list[Row]) -> dict[tuple, dict[str, Row]]:
    """Rows of one (op, mode) keyed by shape, then by provider."""
    table: dict[tuple, dict[str, Row]] = {}
    for row in rows:
        table.setdefault(tuple(row.shape.items()), {})[row.provider] = row
    return table


def _cell(row: Row | None, text: Callable[[Row], str]) -> str:
    """text(row) for a timed row; otherwise why there is no number."""
    if row is None:
        return "—"
    return text(row) if row.status == "ok" else row.status


def _time_table(rows: list[Row]) -> list[str]:
    providers = list(dict.fromkeys(row.provider for row in rows))
    peers = [name for name in providers if name != OURS]
    dims = list(rows[0].shape)
    with_tflops = any(row.tflops is not None for row in rows)
    columns = dims + ["floor", OURS] + peers + ["ours ÷ best peer", "ours % of floor", "ours GB/s"]
    columns += ["ours TFLOP/s"] if with_tflops else []
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for shape, by_provider in _by_shape(rows).items():
        ours = by_provider.get(OURS)
        ours_ms = ours.ms if ours is not None and ours.status == "ok" else None

        def peer_text(peer: Row) -> str:
            return f"{peer.ms:.4f}" if ours_ms is None else f"{peer.ms:.4f} ({ours_ms / peer.ms:.2f})"

        cells = [str(size) for _, size in shape]
        cells.append(f"{next(iter(by_provider.values())).floor_ms:.4f}")
        cells.append(_cell(ours, lambda r: f"{r.ms:.4f}"))
        cells += [_cell(by_provider.get(peer), peer_text) for peer in peers]
        cells.append(_cell(ours, lambda r: "—" if r.ratio_vs_best_peer is None else f"{r.ratio_vs_best_peer:.2f}"))
        cells.append(_cell(ours, lambda r: f"{100 * r.floor_ms / r.ms:.0f}%"))
        cells.append(_cell(ours, lambda r: f"{r.gbps:.0f}"))
        if with_tflops:
            cells.append(_cell(ours, lambda r: f"{r.tflops:.0f}"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _provider_table(rows: list[Row], text: Callable[[Row], str]) -> list[str]:
    """One column per provider holding text(row): peak memory, TFLOP/s."""
    providers = list(dict.fromkeys(row.provider for row in rows))
    dims = list(rows[0].shape)
    lines = ["| " + " | ".join(dims + providers) + " |", "|" + "---|" * (len(dims) + len(providers))]
    for shape, by_provider in _by_shape(rows).items():
        cells = [str(size) for _, size in shape]
        cells += [_cell(by_provider.get(name), text) for name in providers]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _backward_table(forward: list[Row], forward_backward: list[Row]) -> list[str]:
    """TFLOP/s of the backward alone, one column per provider: (fwd+bwd FLOPs - fwd FLOPs) over (fwd+bwd median -
    fwd median), both from this run; the last column is ours from the summed GPU kernel times instead."""
    providers = list(dict.fromkeys(row.provider for row in forward_backward))
    dims = list(forward_backward[0].shape)
    columns = dims + providers + [f"{OURS} (GPU time)"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    forward_rows = _by_shape(forward)

    def backward_tflops(fwd: Row | None, both: Row | None, time: Callable[[Row], float | None]) -> str:
        if fwd is None or both is None or fwd.status != "ok" or both.status != "ok" or fwd.tflops is None:
            return "—" if fwd is None or both is None else (both.status if both.status != "ok" else fwd.status)
        fwd_time, both_time = time(fwd), time(both)
        if fwd_time is None or both_time is None or both_time <= fwd_time:
            return "—"
        # TFLOP/s x ms = GFLOP.
        return f"{(both.tflops * both.ms - fwd.tflops * fwd.ms) / (both_time - fwd_time):.0f}"

    for shape, by_provider in _by_shape(forward_backward).items():
        fwd_by_provider = forward_rows.get(shape, {})
        cells = [str(size) for _, size in shape]
        cells += [backward_tflops(fwd_by_provider.get(name), by_provider.get(name), lambda r: r.ms)
                  for name in providers]
        cells.append(backward_tflops(fwd_by_provider.get(OURS), by_provider.get(OURS), lambda r: r.gpu_ms))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _problems(rows: list[Row]) -> list[str]:
    return [
        f"- {row.op} {row.mode} {' '.join(f'{k}={v}' for k, v in row.shape.items())} {row.provider}: "
        f"{row.status}: {row.note}"
        for row in rows
        if row.status != "ok"
    ]


def markdown_report(title: str, header: dict, rows: list[Row]) -> str:
    lines = [f"# {title}", "", *_header_lines(header), ""]
    lines.append(
        "Times in ms (median). A peer cell reads `ms (ours ÷ peer)`: below 1 means ours is faster. "
        "floor = bytes moved (each tensor read or written once) ÷ measured copy bandwidth; for ops that count "
        "FLOPs, the FLOPs ÷ measured dense GEMM rate where that is longer (ours % of floor is then ours % of "
        "that compute ceiling)."
    )
    groups = _group(rows, "op", "mode")
    for (op, mode), group in groups.items():
        lines += ["", f"## {op}, {mode}, {group[0].dtype}", "", *_time_table(group)]
        if any(row.gpu_ms is not None for row in group):
            lines += ["", f"GPU kernel time of one {op} {mode} call (ms; torch.profiler, no host time):", "",
                      *_provider_table(group, lambda r: "—" if r.gpu_ms is None else f"{r.gpu_ms:.4f}")]
        if any(row.tflops is not None for row in group):
            lines += ["", f"TFLOP/s of every provider, {op} {mode}:", "",
                      *_provider_table(group, lambda r: f"{r.tflops:.0f}")]
        if mode == "fwd+bwd" and any(row.peak_mib is not None for row in group):
            lines += ["", f"Peak extra memory of one {op} fwd+bwd (MiB):", "",
                      *_provider_table(group, lambda r: f"{r.peak_mib:.1f}")]
        forward = groups.get((op, "fwd"))
        if mode == "fwd+bwd" and forward and any(row.tflops is not None for row in group):
            lines += ["", f"TFLOP/s of the {op} backward alone (fwd+bwd minus fwd, in FLOPs and in time):", "",
                      *_backward_table(forward, group)]
    problems = _problems(rows)
    if problems:
        lines += ["", "## Not timed", "", *problems]
    return "\n".join(lines) + "\n"


def read_results(out_dir: Path, ops: list[str]) -> dict[str, tuple[dict, list[Row]]]:
    """The latest run of each op in ``ops`` that has an ``<op>.json`` in ``out_dir``: {op: (header, rows)}."""
    results = {}
    for op in ops:
        path = out_dir / f"{op}.json"
        if path.exists():
            data = json.loads(path.read_text())
            results[op] = (data["header"], [Row(**row) for row in data["rows"]])
    return results


def _gpu_time_summary(group: list[Row]) -> tuple[str, str]:
    """(shapes where ours has the least GPU kernel time, "geomean (worst)" of ours ÷ the best peer's), over the
    shapes where ours and at least one peer have a GPU time."""
    ratios = []
    for by_provider in _by_shape(group).values():
        ours = by_provider.get(OURS)
        peers = [row.gpu_ms for name, row in by_provider.items()
                 if not is_ours(name) and row.status == "ok" and row.gpu_ms]
        if ours is not None and ours.status == "ok" and ours.gpu_ms and peers:
            ratios.append(ours.gpu_ms / min(peers))
    if not ratios:
        return "—", "—"
    geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    return f"{sum(r < 1 for r in ratios)}/{len(ratios)}", f"{geomean:.2f} ({max(ratios):.2f})"


def summary_report(results: dict[str, tuple[dict, list[Row]]]) -> str:
    """One line per op and mode over every op's latest run (``read_results``), so running a few ops keeps the
    others' lines; each line names the run it comes from."""
    lines = ["# Benchmark summary", ""]
    lines += [
        "Each op's latest run (its date and commit in the last columns; device, versions and ceilings in its file).",
        "ours ÷ best peer: geometric mean over shapes, and the worst shape (below 1: faster than every peer).",
        "GPU time: the same over the summed kernel time of a call (torch.profiler), which leaves out host "
        "launch time.",
        "",
        "| op | mode | shapes | ours fastest | ours ÷ best peer (geomean) | worst | GPU time: ours fastest | "
        "GPU time: ours ÷ best peer (geomean, worst) | ours % of floor (median) | not timed (any provider) | run | "
        "details |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for file_name, (header, rows) in results.items():
        run = f"{header['date'][:10]} {header['fused_kernels']['commit'][:7]}"
        for (op, mode), group in _group(rows, "op", "mode").items():
            ours = [row for row in group if row.provider == OURS and row.ratio_vs_best_peer is not None]
            ratios = [row.ratio_vs_best_peer for row in ours]
            if ratios:
                worst = max(ours, key=lambda row: row.ratio_vs_best_peer)
                geomean = f"{math.exp(statistics.fmean(math.log(r) for r in ratios)):.2f}"
                worst_text = f"{worst.ratio_vs_best_peer:.2f} at {' '.join(f'{k}={v}' for k, v in worst.shape.items())}"
                floor_text = f"{statistics.median(100 * row.floor_ms / row.ms for row in ours):.0f}%"
            else:
                geomean = worst_text = floor_text = "—"
            shapes = len(_by_shape(group))
            wins = sum(ratio < 1 for ratio in ratios)
            gpu_wins, gpu_text = _gpu_time_summary(group)
            not_timed = sum(row.status != "ok" for row in group)
            lines.append(
                f"| {op} | {mode} | {shapes} | {wins}/{len(ratios)} | {geomean} | {worst_text} | {gpu_wins} | "
                f"{gpu_text} | {floor_text} | {not_timed} | {run} | [{file_name}.md]({file_name}.md) |"
            )
    return "\n".join(lines) + "\n"


def write_plots(time_path: Path, memory_path: Path, rows: list[Row]) -> None:
    """Time (and, on a GPU, fwd+bwd peak memory) against the size of a call, a line per provider, a panel per op
    and mode. The size is the FLOPs for ops that count them (attention's sequence sweep keeps the bytes
    constant), else the bytes moved."""
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed; plots skipped")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def plot(path: Path, groups: dict[tuple, list[Row]], value: Callable[[Row], float], ylabel: str) -> None:
        figure, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
        for axis, ((op, mode), group) in zip(axes[0], groups.items()):
            by_flops = all(row.tflops is not None for row in group)
            for (provider,), provider_rows in _group(group, "provider").items():
                # TFLOP/s x ms = GFLOP.
                points = sorted((row.tflops * row.ms if by_flops else row.bytes_moved / 1e6, value(row))
                                for row in provider_rows)
                axis.plot(*zip(*points), marker="o", label=provider)
            axis.set(xscale="log", yscale="log", title=f"{op} {mode}", ylabel=ylabel)
            axis.set_xlabel("GFLOP per call" if by_flops else "bytes moved per call (MB)")
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)

    ok_rows = [row for row in rows if row.status == "ok"]
    plot(time_path, _group(ok_rows, "op", "mode"), lambda row: row.ms, "median time (ms)")
    memory_rows = [row for row in ok_rows if row.peak_mib is not None]
    if memory_rows:
        # A provider that allocates nothing extra would vanish from a log axis: show it at 0.001 MiB.
        plot(memory_path, _group(memory_rows, "op", "mode"), lambda row: max(row.peak_mib, 1e-3), "peak extra MiB")
