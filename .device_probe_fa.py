"""TFLOP/s of our flash attention vs SDPA flash / cuDNN at a few training shapes (bf16)."""
import sys, torch, kernels
from pathlib import Path
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
fk = kernels.get_local_kernel(Path(sys.argv[1]))
def flops(b, h, s, d, causal, mode):
    f = 4 * b * h * s * s * d // (2 if causal else 1)
    return f if mode == "fwd" else 2.5 * f
for (b, h, hk, s, d, causal) in [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True), (2, 32, 8, 8192, 128, True), (8, 16, 16, 2048, 64, True)]:
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)
    res = {}
    out = fk.flash_attn_func(q, k, v, causal=causal)
    res["ours fwd"] = do_bench(lambda: fk.flash_attn_func(q, k, v, causal=causal), warmup=25, rep=100)
    res["ours bwd"] = do_bench(lambda: out.backward(dout, retain_graph=True), warmup=25, rep=100, grad_to_none=[q, k, v])
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hk != h)
                res[f"{name} fwd"] = do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hk != h), warmup=25, rep=100)
                do = dout.transpose(1, 2)
                res[f"{name} bwd"] = do_bench(lambda: o.backward(do, retain_graph=True), warmup=25, rep=100, grad_to_none=[qt, kt, vt])
        except Exception as e:
            res[f"{name} fwd"] = float("nan"); print(name, "failed", str(e)[:100])
    line = " ".join(f"{k_} {flops(b, h, s, d, causal, k_.split()[-1]) / ms / 1e9:6.0f}" for k_, ms in res.items())
    print(f"b{b} h{h}/{hk} s{s} d{d} {'causal' if causal else 'full'}: TFLOP/s {line}", flush=True)
