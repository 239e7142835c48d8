"""Host-side cost of one call, on a shape too small to keep the GPU busy: where the microseconds go.

    python benchmarks/profile_overhead.py --build <variants dir>
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", type=Path, required=True)
    args = parser.parse_args()
    import kernels

    fk = kernels.get_local_kernel(args.build)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    y = torch.empty_like(x)
    rstd = torch.rsqrt(x.detach().float().square().mean(-1) + 1e-6)
    layout = (8, 0, 1024, 1)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    ops_module = sys.modules[f"{fk.__name__}.rms_norm"]
    backward_launch = lambda: fk._kernels.rms_norm.rms_norm_backward(
        dy, layout, x.detach(), layout, rstd, w.detach(), None, None, dx, dw, 8, 1024, 1e-6, "llama", block_rows=1,
        block_cols=1024, num_warps=4, num_programs=8, align=1)
    from triton.testing import do_bench
    print(f"backward launch, GPU time {do_bench(backward_launch, return_mode='median') * 1e3:.1f} us")
    cases = {
        "launcher only": lambda: fk._kernels.rms_norm.rms_norm_forward(
            x, layout, w, None, None, y, None, rstd, 8, 1024, 1e-6, "llama", block_rows=1, block_cols=1024,
            num_warps=4, align=1),
        "backward launcher only": backward_launch,
        "_triton_backward": lambda: ops_module._triton_backward(dy, None, x.detach(), rstd, w.detach(), 1e-6, "llama",
                                                                True),
        "_backward_impl": lambda: ops_module._backward_impl(dy, None, x.detach(), rstd, w.detach(), 1e-6, "llama",
                                                            True),
        "op forward, no grad": lambda: fk.rms_norm(x.detach(), w.detach()),
        "op forward, grad": lambda: fk.rms_norm(x, w),
        "op forward+backward": lambda: fk.rms_norm(x, w).backward(dy),
        "F.rms_norm forward+backward": lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6).backward(dy),
    }
    for name, fn in cases.items():
        print(f"{name:32s} {per_call_us(fn):8.1f} us/call")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(500):
        cases["op forward+backward"]()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
