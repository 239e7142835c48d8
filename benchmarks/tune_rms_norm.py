"""Tune the RMSNorm launch table for the GPU this runs on and write it into ``configs/rms_norm.json``.

For each row-length bucket (``BUCKETS``) it times every candidate launch configuration of the forward
and the backward kernel on bf16 inputs of about 64M and 512M elements (``ELEMENTS``, both well past the L2 cache)
and keeps the one whose larger slowdown against the fastest at either size is the least.
The result is data: the package reads it at run time and never autotunes. ``--unaligned`` tunes the tables for
rows the kernels access 2 bytes at a time (``forward_unaligned``, ``backward_unaligned``: rows off 16-byte
boundaries), on rows one element shorter than each bucket.

    python benchmarks/tune_rms_norm.py --build <variants dir> [--write torch-ext/fused_kernels/configs/rms_norm.json]
                                       [--buckets 16384 32768 65536 131072] [--kernels forward] [--unaligned]
"""

import argparse
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from launch_tables import bucket_entries, read_table, write_device_entries

# Powers of two, and 3072: hidden sizes between 2048 and 4096 (Gemma-2's 2304, Qwen3's 2560, Llama-3.2's 3072) pad
# their whole-row tile to 4096 columns, where the tile tuned at 4096 itself (2 rows on 16 warps) lost 15-18% to one
# row on 4 warps on the H200 (forward at 64M bf16 elements: 2304 86.2 -> 70.8 us, 2560 81.4 -> 69.6, 3584 72.1 ->
# 69.8). Other widths between powers of two gained at most 3% from any tile of the tuner's (1536, 4608-7168) until the
# forward could read a whole row twice (``two_pass``): hence 5120, for 4097-5120 columns, where that on 4 warps beat
# the 8192 entry's tile by 5-8% (H200, CUDA graphs: 16384 x 5000 85.3 -> 80.3 us, 16384 x 4608 79.9 -> 74.0); at 6144
# it did not.
BUCKETS = [128, 256, 512, 1024, 2048, 3072, 4096, 5120, 8192, 16384, 32768, 65536, 131072]
# A tile can win at one size and lose at another: on the H200 at 8192 columns the forward holding one row on 8
# warps took 65.4 us at 8192 rows and 517.0 at 65536, the same tile reading its row twice (``two_pass``) 65.8 and
# 502.3 (CUDA graphs, 2026-12-01); timed at 64M elements alone, the tuner had kept the first. Timed at 64M and 512M
# (the benchmark grid's largest inputs, 65536 x 8192) it took ``two_pass`` for 1024-16384 columns; checked at 1024 to
# 65536 rows (benchmarks/results/h200/rms_norm_tables_ab.txt), that won or tied at every row count from 4096 columns
# on, but below them lost up to 18% with few rows (4096 x 1024: 4.3 -> 5.0 us), so the H200 forward table took
# it for the 4096, 8192 and 16384 buckets only (``--buckets``). A third size of 4M elements is too short for
# do_bench's event timing (8 us against a 4 us floor): its ratios were noise, and the tiles it picked inconsistent.
ELEMENTS = (64 * 1024 * 1024, 512 * 1024 * 1024)
WARPS = (4, 8, 16, 32)
PROGRAMS_PER_SM = (1, 2, 3, 4, 8)
# 2-byte accesses: fewer warps per row won on the H200 (16384 x 4095: forward 99 -> 84 us on 4 warps instead of 16,
# backward 247 -> 152 on 4 instead of 8), and tiles of more than 64 fp32 elements per thread lost everywhere.
UNALIGNED_WARPS = (2, 4, 8, 16, 32)
UNALIGNED_PROGRAMS_PER_SM = (1, 2, 4)
UNALIGNED_MAX_ELEMENTS_PER_THREAD = 64
# Chunks of long rows. The forward's first pass reduces each chunk as it arrives, so chunks of 16384 and 32768 fit
# beside the prefetched next one (H200, forward at 4096 x 65536 bf16, CUDA graphs: 327 us in chunks of 8192 columns
# before, 280 in chunks of 32768).
LOOPED_BLOCK_COLS = (4096, 8192, 16384, 32768)
MAX_SINGLE_PASS_COLS = 32768


def candidate_tiles(n_cols, unaligned):
    """(block_rows, block_cols, two_pass) triples: whole rows in one tile, held in registers across the reduction or
    read twice (``two_pass``, forward only), or column chunks of a long row (of one row when the rows are accessed 2
    bytes at a time: see rms_norm_backward)."""
    whole = triton.next_power_of_2(n_cols)
    tiles = []
    if whole <= MAX_SINGLE_PASS_COLS:
        tiles += [(rows, whole, two_pass) for rows in (1, 2, 4, 8, 16, 32, 64) for two_pass in (False, True)
                  if 1024 <= rows * whole <= 8192 or (rows == 1 and whole > 8192)]
    # Chunked tiles of several rows share each pass over the program's dw row among them. Up to 32768 elements:
    # the backward's first pass reads the forward's rstd instead of accumulating sum(h^2), so 8 x 4096 and
    # 4 x 8192 fit on 16 warps without spilling (ptxas, sm_90a).
    tiles += [(rows, cols, False) for cols in LOOPED_BLOCK_COLS for rows in ((1,) if unaligned else (1, 2, 4, 8))
              if cols < whole and rows * cols <= 32768]
    return tiles


def time_ms(fn):
    return do_bench(fn, warmup=5, rep=25, return_mode="median")


def tune(kernel_module, n_cols, multiprocessors, unaligned, kernels=("forward", "backward")):
    """{kernel: (times in ms at each of ``ELEMENTS``, config)} of the kept candidate of each kernel tuned."""
    times = {kernel: {} for kernel in kernels}  # kernel -> config (as sorted items) -> times at each size
    for elements in ELEMENTS:
        n_rows = max(1, elements // n_cols)
        x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n_cols, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        y, dx, dw = torch.empty_like(x), torch.empty_like(x), torch.empty_like(w)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)  # the backward's input, whichever kernels are tuned
        layout = (n_rows, 0, n_cols, 1)
        align = kernel_module.row_alignment(x.element_size(), (layout,), n_rows, n_cols)
        assert (align is None) == unaligned, (n_cols, align)
        for block_rows, block_cols, two_pass in candidate_tiles(n_cols, unaligned):
            for warps in UNALIGNED_WARPS if unaligned else WARPS:
                if unaligned and block_rows * block_cols > UNALIGNED_MAX_ELEMENTS_PER_THREAD * 32 * warps:
                    continue
                tile = dict(block_rows=block_rows, block_cols=block_cols, num_warps=warps)
                if "forward" in kernels:
                    forward_tile = {**tile, "two_pass": True} if two_pass else tile
                    fwd = time_ms(lambda: kernel_module.rms_norm_forward(
                        x, layout, w, None, None, y, None, rstd, n_rows, n_cols, 1e-6, "llama", **forward_tile,
                        align=align))
                    times["forward"].setdefault(tuple(sorted(forward_tile.items())), []).append(fwd)
                backward_grids = UNALIGNED_PROGRAMS_PER_SM if unaligned else PROGRAMS_PER_SM
                for per_sm in backward_grids if "backward" in kernels and not two_pass else ():
                    bwd = time_ms(lambda: kernel_module.rms_norm_backward(
                        dy, layout, x, layout, rstd, w, None, None, dx, dw, n_rows, n_cols, 1e-6, "llama", **tile,
                        num_programs=per_sm * multiprocessors, align=align))
                    times["backward"].setdefault(tuple(sorted({**tile, "programs_per_sm": per_sm}.items())),
                                                 []).append(bwd)
        del x, dy, y, dx
    return {kernel: _least_worst_slowdown(by_config) for kernel, by_config in times.items()}


def _least_worst_slowdown(by_config):
    """(times, config) of the config whose largest ratio to the fastest time at any size is the least."""
    fastest = [min(times) for times in zip(*by_config.values())]
    config, config_times = min(by_config.items(),
                               key=lambda item: max(t / best for t, best in zip(item[1], fastest)))
    return config_times, dict(config)


def to_entries(results, kernel, current):
    """Sorted table entries: the tuned buckets' configs, and ``current``'s (the device's entries now) for the
    buckets not tuned. The last bucket is longer than any single-pass tile, so its chunked config also serves
    every longer row. ``current``'s entries for small calls (``max_elements``: chosen from CUDA-graph sweeps, which
    this tuner's event timing cannot resolve; results/h200/rms_norm_small_calls.txt) are kept, before their bucket's
    entry."""
    configs = {BUCKETS[-1] if entry["max_cols"] is None else entry["max_cols"]:
               {"block_cols": entry["max_cols"] or BUCKETS[-1],
                **{key: value for key, value in entry.items() if key != "max_cols"}}
               for entry in current if "max_elements" not in entry}
    configs.update({n_cols: best[kernel][1] for n_cols, best in results})
    entries = bucket_entries(sorted(configs.items()))
    for small in reversed([entry for entry in current if "max_elements" in entry]):
        entries.insert(next(i for i, entry in enumerate(entries) if entry["max_cols"] == small["max_cols"]), small)
    return entries


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, required=True, help="directory of built variants")
    parser.add_argument("--write", type=Path, help="config file to update (the device's entry only)")
    parser.add_argument("--buckets", type=int, nargs="+", choices=BUCKETS, default=BUCKETS,
                        help="hidden sizes to tune (default: all); the others keep the device's current entries")
    parser.add_argument("--kernels", nargs="+", choices=("forward", "backward"), default=("forward", "backward"),
                        help="kernels to tune (default: both); the others keep the device's current entries")
    parser.add_argument("--unaligned", action="store_true",
                        help="tune the tables for rows off 16-byte boundaries (each bucket less one element)")
    args = parser.parse_args()

    import kernels

    fk = kernels.get_local_kernel(args.build)
    device_name = torch.cuda.get_device_name()
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for bucket in args.buckets:
        n_cols = bucket - 1 if args.unaligned else bucket
        best = tune(fk._kernels.rms_norm, n_cols, multiprocessors, args.unaligned, args.kernels)
        results.append((bucket, best))
        print(f"H={n_cols:>6}  " + "  ".join(
            f"{kernel[:3]} {' / '.join(f'{t * 1e3:.1f}' for t in best[kernel][0])} us {best[kernel][1]}"
            for kernel in args.kernels), flush=True)

    table = read_table(args.write, "rms_norm")
    suffix = "_unaligned" if args.unaligned else ""
    write_device_entries(args.write, device_name, {
        kernel + suffix: to_entries(results, kernel, table.get(kernel + suffix, {}).get(device_name, []))
        for kernel in args.kernels})


if __name__ == "__main__":
    main()
