"""Tune the cross-entropy row kernel's launch table (``rows``) for the GPU this runs on and write it into
``configs/cross_entropy.json``.

For each vocabulary bucket it times every candidate column block, warp count and pipelining depth of the row
kernel as a training step's forward runs it (loss pass and gradient pass in one launch, the gradient into its
own buffer, reduction "mean"), on bf16 logits, and keeps the fastest whose results match the first candidate's.

Why these candidates: one program handles a row, reading it once for the log-sum-exp and once more for the
gradient. The second read comes from L2 only while few rows are in flight (a row of a 152k vocabulary is 304 KB,
the H200's L2 about 50 MB), and the number in flight is the programs resident per SM, which wide programs (32
warps) and deep pipelining (shared memory) bring down; whether one such program per SM still keeps enough bytes
in flight for the first read is what the timing decides. The result is data: the package reads it at run time and
never autotunes.

    python benchmarks/tune_cross_entropy.py --build <variants dir>
        [--write torch-ext/fused_kernels/configs/cross_entropy.json] [--buckets 32768 151936]

Each bucket serves the vocabularies up to it, the last one every larger vocabulary.
"""

import argparse
import itertools
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from launch_tables import bucket_entries, write_device_entries

BUCKETS = [2048, 8192, 32768, 151936]
N_ROWS = 4096
BLOCK_COLS = (2048, 4096, 8192, 16384, 32768)
WARPS = (4, 8, 16, 32)
STAGES = (1, 2, 3, 4)


def candidates(vocab):
    widest = triton.next_power_of_2(vocab)
    for block_cols, warps, stages in itertools.product(BLOCK_COLS, WARPS, STAGES):
        if block_cols <= widest and (block_cols == widest or block_cols < vocab):
            yield {"block_cols": block_cols, "num_warps": warps, "num_stages": stages}


def tune(ce, vocab):
    torch.manual_seed(0)
    logits = torch.randn(N_ROWS, vocab, device="cuda", dtype=torch.bfloat16) * 4
    target = torch.randint(0, vocab, (N_ROWS,), device="cuda")
    constants = torch.tensor([float(N_ROWS), 0.0], device="cuda")  # the "mean" denominator: every row counts
    loss = torch.empty(N_ROWS, device="cuda")
    row_stats = torch.empty(N_ROWS, 2, device="cuda")
    dlogits = torch.empty_like(logits)

    def run(config):
        ce.cross_entropy_rows(logits, target, None, constants, loss, None, row_stats, dlogits, None, N_ROWS, vocab,
                              -100, 0.0, 0.0, None, True, loss_pass=True, grad_pass=True, **config)

    def relative_error(got, want):
        return ((got.float() - want.float()).norm() / want.float().norm()).item()

    reference, best = None, None
    for config in candidates(vocab):
        for out in (loss, row_stats, dlogits):
            out.fill_(float("nan"))  # an element a candidate leaves unwritten fails the comparison
        try:
            run(config)
        except Exception as error:  # noqa: BLE001 - out of resources and the like: not a candidate
            print(f"  V={vocab} {config}: skipped ({type(error).__name__})", flush=True)
            continue
        if reference is None:
            reference = (loss.clone(), dlogits.clone())
        elif not (relative_error(loss, reference[0]) < 1e-5 and relative_error(dlogits, reference[1]) < 1e-2):
            print(f"  V={vocab} {config}: results differ from the first candidate's; not a candidate", flush=True)
            continue
        ms = do_bench(lambda: run(config), warmup=5, rep=25, return_mode="median")
        if best is None or ms < best[0]:
            best = (ms, config)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, required=True, help="directory of built variants")
    parser.add_argument("--write", type=Path, help="config file to update (the device's entry only)")
    parser.add_argument("--buckets", type=int, nargs="+", default=BUCKETS, help="vocabulary buckets (default: all)")
    args = parser.parse_args()

    import kernels

    fk = kernels.get_local_kernel(args.build)
    device_name = torch.cuda.get_device_name()
    configs = []
    for vocab in sorted(args.buckets):
        ms, config = tune(fk._kernels.cross_entropy, vocab)
        # Read twice and written once when nothing is reused from L2; above 1 x, the second read hit the cache.
        gbps = 3 * 2 * N_ROWS * vocab / (ms * 1e6)
        print(f"V={vocab:>7} T={N_ROWS}  {ms * 1e3:8.1f} us  {gbps:5.0f} GB/s as 3 passes  {config}", flush=True)
        configs.append((vocab, config))
    write_device_entries(args.write, device_name, {"rows": bucket_entries(configs)})


if __name__ == "__main__":
    main()
