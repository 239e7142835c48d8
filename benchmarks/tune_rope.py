"""Tune the RoPE launch table for the GPU this runs on and write it into ``configs/rope.json``.

Times every (block_s, block_h, num_warps) candidate of the rotation kernel on the issue's shape (q 4 x 32 heads x
4096 x 128, k 8 heads, bf16, the transposed (batch, heads, seq, head_dim) views transformers passes), forward
and inverse (the backward), and keeps the candidate with the lowest sum. One table entry serves every head_dim:
the kernel's work per position scales with the heads, not with the tile shape. The result is data: the
package reads it at run time and never autotunes.

    python benchmarks/tune_rope.py --build <variants dir> [--write torch-ext/fused_kernels/configs/rope.json]
"""

import argparse
import itertools
from pathlib import Path

import torch
from triton.testing import do_bench

from launch_tables import write_device_entries

BATCH, SEQ, Q_HEADS, K_HEADS, HEAD_DIM = 4, 4096, 32, 8, 128
BLOCK_S = (1, 2, 4, 8)
BLOCK_H = (4, 8, 16, 32)
WARPS = (2, 4, 8)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, required=True, help="directory of built variants")
    parser.add_argument("--write", type=Path, help="config file to update (the device's entry only)")
    args = parser.parse_args()

    import kernels

    rope = kernels.get_local_kernel(args.build)._kernels.rope
    q = torch.randn(BATCH, SEQ, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(BATCH, SEQ, K_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    angles = torch.randn(SEQ, HEAD_DIM // 2, device="cuda")
    table = torch.cat([angles, angles], -1)
    cos, sin = (t.bfloat16()[None].expand(BATCH, -1, -1) for t in (table.cos(), table.sin()))
    moved = 2 * (q.numel() + k.numel()) * q.element_size()
    best = None
    for block_s, block_h, warps in itertools.product(BLOCK_S, BLOCK_H, WARPS):
        config = dict(block_s=block_s, block_h=block_h, num_warps=warps)
        times = [do_bench(lambda inverse=inverse: rope.rope(q, k, q_out, k_out, cos, sin, None, HEAD_DIM, False,
                                                             inverse, heads_dim=2, **config), warmup=5, rep=25,
                          return_mode="median") for inverse in (False, True)]
        print(f"{config}  forward {times[0] * 1e3:6.1f} us ({moved / times[0] / 1e6:5.0f} GB/s)  "
              f"inverse {times[1] * 1e3:6.1f} us", flush=True)
        if best is None or sum(times) < best[0]:
            best = (sum(times), config)
    print(f"best {best[1]}: forward + inverse {best[0] * 1e3:.1f} us")

    write_device_entries(args.write, torch.cuda.get_device_name(), {"rope": [{"max_cols": None, **best[1]}]})


if __name__ == "__main__":
    main()
