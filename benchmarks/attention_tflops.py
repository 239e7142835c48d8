"""Flash attention TFLOP/s on a GPU: ours against SDPA's flash (FlashAttention-2) and cuDNN backends, bf16.

    python benchmarks/attention_tflops.py --build <variants dir>

FLOPs as flash-attention counts them: forward 4 * b * h * s * s * d (halved when causal), backward 2.5 times
the forward. A stopgap until attention joins `run.py`'s suite (it needs the harness to report FLOP rates against
a compute ceiling rather than bytes against the copy floor).
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

# (batch, q heads, kv heads, seq, head_dim, causal): the shapes of h200-baselines.md.
SHAPES = [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True), (2, 32, 8, 8192, 128, True),
          (8, 16, 16, 2048, 64, True)]


def tflops(b, h, s, d, causal, mode, ms):
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    return (flops if mode == "fwd" else 2.5 * flops) / ms / 1e9


def time_fwd_bwd(forward, leaves, dout):
    fwd = do_bench(forward, warmup=25, rep=100)
    out = forward()
    bwd = do_bench(lambda: out.backward(dout, retain_graph=True), warmup=25, rep=100, grad_to_none=leaves)
    return fwd, bwd


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, required=True, help="directory of built variants")
    args = parser.parse_args()
    import kernels

    fk = kernels.get_local_kernel(args.build)
    print(f"{torch.cuda.get_device_name()}; TFLOP/s, forward / backward")
    for b, h, hk, s, d, causal in SHAPES:
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        results = {"ours": time_fwd_bwd(lambda: fk.flash_attn_func(q, k, v, causal=causal), [q, k, v], dout)}
        # SDPA takes (b, h, s, d): the same memory, transposed.
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel(backend):
                results[name] = time_fwd_bwd(
                    lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hk != h),
                    [qt, kt, vt], dout.transpose(1, 2))
        cells = "  ".join(f"{name} {tflops(b, h, s, d, causal, 'fwd', f):4.0f} / {tflops(b, h, s, d, causal, 'bwd', w):4.0f}"
                          for name, (f, w) in results.items())
        print(f"b{b} h{h}/{hk} s{s} d{d} {'causal' if causal else 'full  '}: {cells}", flush=True)


if __name__ == "__main__":
    main()
