"""Run the op benchmarks (`benchmarks/bench_<op>.py`) and write their results.

    python benchmarks/run.py [--ops rms_norm ...] [--quick] [--out DIR]

Builds the package from this checkout (or loads --kernel-path), checks every provider against a float32
reference, times the ones that pass, writes <out>/<op>.json, <op>.md, <op>_time.png, <op>_memory.png (GPU
only), and rebuilds <out>/summary.md from every op's latest <op>.json there. <out>: by default
benchmarks/results/h200 (the committed results) for a full run on an H200, benchmarks/results/local/<device>
(git-ignored) for any other run, which may not write into results/h200. On a machine without CUDA it runs
a slow smoke test: with TRITON_INTERPRET=1 our Triton kernels run in the interpreter, timing is wall-clock, and
torch.compile and Liger are skipped.
"""

import argparse
import importlib
import tempfile
from pathlib import Path

import torch

import harness

BENCHMARKS_DIR = Path(__file__).resolve().parent


def available_ops() -> list[str]:
    return sorted(path.stem.removeprefix("bench_") for path in BENCHMARKS_DIR.glob("bench_*.py"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", choices=available_ops(), default=available_ops())
    parser.add_argument("--quick", action="store_true", help="a tiny grid, for a smoke test")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/h200 for a full run on an H200 (the "
                        "committed results), benchmarks/results/local/<device> otherwise")
    parser.add_argument(
        "--kernel-path", type=Path, help="a directory of built variants (or one variant) instead of building now"
    )
    parser.add_argument("--providers", nargs="+", help=f"run only these providers (e.g. {harness.OURS} liger)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    args.out = harness.results_dir(args.out, smoke=args.quick)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="fused_kernels_build_") as build_dir:
        kernel_path = args.kernel_path or harness.build_variants(Path(build_dir))
        env = harness.Env(device=device, ours=harness.load_fused_kernels(kernel_path), quick=args.quick)
        copy_gbps = harness.measure_copy_gbps(device)
        gemm_tflops = harness.measure_gemm_tflops(device)
        header = harness.run_header(env, copy_gbps, gemm_tflops)
        print(f"copy bandwidth {copy_gbps:.0f} GB/s; dense GEMM {gemm_tflops:.0f} TFLOP/s; "
              f"fused_kernels variant {header['fused_kernels']['variant']}")

        args.out.mkdir(parents=True, exist_ok=True)
        only_providers = set(args.providers) if args.providers else None
        reports = []
        for op in args.ops:
            module = importlib.import_module(f"bench_{op}")
            rows = []
            for bench in module.benchmarks(env):
                rows += harness.run_benchmark(bench, env, copy_gbps, gemm_tflops, only_providers)
            harness.write_json(args.out / f"{op}.json", header, rows)
            reports.append(harness.markdown_report(op, header, rows))
            (args.out / f"{op}.md").write_text(reports[-1])
            harness.write_plots(args.out / f"{op}_time.png", args.out / f"{op}_memory.png", rows)

    summary = harness.summary_report(harness.read_results(args.out, available_ops()))
    (args.out / "summary.md").write_text(summary)
    print("\n" + "\n".join(reports) + "\n" + summary)
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
