"""Tune the SwiGLU/GeGLU launch table for the GPU this runs on and write it into ``configs/swiglu.json``.

For each row-width bucket (powers of two) it times every candidate tile and warp count of the forward and the
backward kernel (SiLU, bf16, contiguous rows, about 64M elements per tensor: well past the L2 cache) and keeps
the fastest. The activations differ only in a few fp32 instructions per element, so one table serves all
three. The result is data: the package reads it at run time and never autotunes.

Every forward entry it writes sets ``one_row`` (``_one_row_launch`` in ``kernels_src/swiglu.py``): gapless rows whose
width is a multiple of 16 are then read as one long row too, so that a width that is not a multiple of the tile (11008
in tiles of 2048) ends in no mostly masked tile. At the bucket widths timed here, powers of two and whole tiles, the two
launches read the same memory in the same order, so the tuning cannot choose it; it was measured at the benchmark's
widths instead.

The forward is also timed at SMALL_ELEMENTS, a call whose tensors the L2 cache holds. Where another tile wins there by
more than 2%, the bucket gets an entry for calls up to ``small_call_limit()`` elements (``max_elements``) before the
one for larger calls (on the H200 a tile of 16 elements per thread against 8 for large calls: 3-6% faster at 3.5-4M
elements with the cache flushed before each call, ~10% when the data stays in L2, level at 6-8M, ~1% slower beyond:
results/h200/swiglu_tiles_by_size.txt).

    python benchmarks/tune_swiglu.py --build <variants dir> [--write torch-ext/fused_kernels/configs/swiglu.json]
                                     [--buckets 4096 16384]

``--buckets`` tunes a coarser table (each bucket serves the widths up to it, the last one every wider row).
"""

import argparse
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from launch_tables import write_device_entries

BUCKETS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
TARGET_ELEMENTS = 64 * 1024 * 1024
SMALL_ELEMENTS = 4 * 1024 * 1024
TILE_ELEMENTS = (1024, 2048, 4096, 8192)
MAX_BLOCK_COLS = 8192
WARPS = (2, 4, 8, 16)


def candidate_tiles(n_cols):
    """(block_rows, block_cols) per tile size: whole rows (up to MAX_BLOCK_COLS wide), or a one-row chunk."""
    widest = min(triton.next_power_of_2(n_cols), MAX_BLOCK_COLS)
    tiles = set()
    for elements in TILE_ELEMENTS:
        for block_cols in (widest, elements):
            if block_cols <= min(widest, elements):
                tiles.add((elements // block_cols, block_cols))
    return sorted(tiles)


def time_ms(fn):
    return do_bench(fn, warmup=5, rep=25, return_mode="median")


def small_call_limit():
    """Elements of the largest call whose three bf16 tensors (gate, up, out) fill at most 3/4 of the L2 cache."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size * 3 // 4 // 6


def tune(kernel_module, n_cols, elements, kernels=("forward", "backward")):
    """{kernel: (ms, tile) of the fastest candidate, and "timings": {(kernel, tile items): ms}} at rows of
    ``n_cols`` and about ``elements`` elements per tensor."""
    n_rows = max(1, elements // n_cols)
    gate, up, dout = (torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, d_gate, d_up = (torch.empty_like(gate) for _ in range(3))
    layout = (n_rows, 0, n_cols, 1)
    calls = {
        "forward": lambda tile: kernel_module.gated_forward(gate, layout, up, layout, out, n_cols, n_rows, n_cols,
                                                            "silu", **tile),
        "backward": lambda tile: kernel_module.gated_backward(dout, layout, gate, layout, up, layout, d_gate, d_up,
                                                              n_cols, n_rows, n_cols, "silu", **tile),
    }
    best, timings = {}, {}
    for block_rows, block_cols in candidate_tiles(n_cols):
        for warps in WARPS:
            tile = dict(block_rows=block_rows, block_cols=block_cols, num_warps=warps)
            for kernel in kernels:
                ms = timings[kernel, tuple(tile.items())] = time_ms(lambda: calls[kernel](tile))
                if kernel not in best or ms < best[kernel][0]:
                    best[kernel] = (ms, tile)
    return {**best, "timings": timings}


def small_call_tile(small, large_tile):
    """The forward's tile for calls of SMALL_ELEMENTS, where it beats the large calls' tile there by more than 2%."""
    ms, tile = small["forward"]
    return tile if ms < 0.98 * small["timings"]["forward", tuple(large_tile.items())] else None


def to_entries(results, kernel):
    """Sorted table entries; the last bucket also serves every wider row."""
    one_row = {"one_row": True} if kernel == "forward" else {}
    entries = []
    for i, (n_cols, best, small_tile) in enumerate(results):
        max_cols = None if i == len(results) - 1 else n_cols
        if small_tile is not None and kernel == "forward":
            entries.append({"max_cols": max_cols, "max_elements": small_call_limit(), **small_tile, **one_row})
        entries.append({"max_cols": max_cols, **best[kernel][1], **one_row})
    return entries


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, required=True, help="directory of built variants")
    parser.add_argument("--write", type=Path, help="config file to update (the device's entry only)")
    parser.add_argument("--buckets", type=int, nargs="+", default=BUCKETS, help="row-width buckets (default: all)")
    args = parser.parse_args()

    import kernels

    fk = kernels.get_local_kernel(args.build)
    device_name = torch.cuda.get_device_name()
    results = []
    for n_cols in sorted(args.buckets):
        best = tune(fk._kernels.swiglu, n_cols, TARGET_ELEMENTS)
        small_tile = small_call_tile(tune(fk._kernels.swiglu, n_cols, SMALL_ELEMENTS, ("forward",)),
                                     best["forward"][1])
        results.append((n_cols, best, small_tile))
        n_rows = max(1, TARGET_ELEMENTS // n_cols)
        elements = n_rows * n_cols
        gbps = {k: (3 if k == "forward" else 5) * 2 * elements / (best[k][0] * 1e6) for k in ("forward", "backward")}
        print(f"I={n_cols:>6} T={n_rows:>7}  fwd {best['forward'][0] * 1e3:8.1f} us {gbps['forward']:5.0f} GB/s "
              f"{best['forward'][1]}  bwd {best['backward'][0] * 1e3:8.1f} us {gbps['backward']:5.0f} GB/s "
              f"{best['backward'][1]}  small calls: {small_tile}", flush=True)

    write_device_entries(args.write, device_name, {kernel: to_entries(results, kernel)
                                                   for kernel in ("forward", "backward")})


if __name__ == "__main__":
    main()
