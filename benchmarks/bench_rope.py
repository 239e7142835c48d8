"""RoPE of q and k (Llama-3-8B heads: 32 q, 8 kv, head_dim 128), half-split, bf16, in the layout transformers
passes (a (batch, heads, seq, head_dim) transposed view of (batch, seq, heads, head_dim) projections), against
transformers' eager math, torch.compile and Liger. Outputs are returned as they are, never concatenated."""

import torch

from harness import OURS, Case, Env, OpBenchmark, compile_per_shape, optional_import

BATCH, Q_HEADS, K_HEADS, HEAD_DIM = 4, 32, 8, 128
SEQ_LENS = (1024, 2048, 4096, 8192)
QUICK_SHAPES = ({"B": 1, "S": 16, "HQ": 4, "HK": 2, "D": 64}, {"B": 2, "S": 9, "HQ": 3, "HK": 1, "D": 80})


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def transformers_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1); on float32 inputs it is also the reference."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def make_inputs(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    batch, seq, q_heads, k_heads, head_dim = (case.shape[n] for n in ("B", "S", "HQ", "HK", "D"))
    # (batch, seq, heads, head_dim) memory seen as (batch, heads, seq, head_dim), like q_proj(x).view().transpose()
    q = torch.randn(batch, seq, q_heads, head_dim, dtype=case.dtype, device=device).transpose(1, 2)
    k = torch.randn(batch, seq, k_heads, head_dim, dtype=case.dtype, device=device).transpose(1, 2)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # (1, seq, head_dim), as LlamaRotaryEmbedding returns it
    return {"q": q.requires_grad_(), "k": k.requires_grad_(), "cos": emb.cos().to(case.dtype),
            "sin": emb.sin().to(case.dtype)}


def rope_bytes(case: Case, mode: str) -> int:
    batch, seq, q_heads, k_heads, head_dim = (case.shape[n] for n in ("B", "S", "HQ", "HK", "D"))
    itemsize = case.dtype.itemsize
    qk = batch * seq * (q_heads + k_heads) * head_dim * itemsize
    tables = 2 * seq * head_dim * itemsize
    forward = 2 * qk + tables  # read q, k, cos, sin; write q_embed, k_embed
    backward = 2 * qk + tables  # read dq_embed, dk_embed, cos, sin; write dq, dk
    return forward if mode == "fwd" else forward + backward


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(shape) for shape in QUICK_SHAPES]
    return [Case({"B": BATCH, "S": seq, "HQ": Q_HEADS, "HK": K_HEADS, "D": HEAD_DIM}) for seq in SEQ_LENS]


def benchmarks(env: Env) -> list[OpBenchmark]:
    ours = env.ours
    providers = {
        OURS: lambda q, k, cos, sin: ours.apply_rotary_pos_emb(q, k, cos, sin),
        "torch": transformers_rope,
    }
    if env.on_gpu:
        providers["torch_compile"] = compile_per_shape(transformers_rope)
        liger = optional_import("liger_kernel.ops", "liger")
        if liger is not None:
            # Liger rotates q and k in place (and dq, dk in backward): give it clones, as a caller that still
            # needs q and k must. The clone is part of what using it costs.
            providers["liger"] = lambda q, k, cos, sin: liger.LigerRopeFunction.apply(q.clone(), k.clone(), cos, sin)
    else:
        print("note: torch_compile and liger skipped on CPU")
    return [
        OpBenchmark(
            op="rope",
            cases=cases(env.quick),
            providers=providers,
            make_inputs=make_inputs,
            reference=transformers_rope,
            output_names=("q_embed", "k_embed"),
            bytes_moved=rope_bytes,
        )
    ]
