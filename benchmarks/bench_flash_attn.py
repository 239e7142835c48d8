"""Flash attention (`flash_attn_func`, causal and full, MHA and GQA) against SDPA with each backend forced
(FLASH_ATTENTION, i.e. FlashAttention-2; CUDNN_ATTENTION; EFFICIENT_ATTENTION), compiled FlexAttention, and, on
shapes small enough to hold the score matrix, transformers' eager attention.

Every provider gets the same (batch, seq, heads, head_dim) tensors, the layout of `flash_attn_func` and of
transformers' projections; the SDPA and FlexAttention providers take `transpose(1, 2)` views of them, as
transformers' sdpa attention does, so no provider's time includes a copy the others skip. TFLOP/s use
flash-attention's count: forward 4 * b * hq * s * s * d (halved when causal), backward 2.5 times the forward,
so fwd+bwd rows count 3.5 times the forward. The floor column is the FLOPs at the dense GEMM rate measured in
the same run. The float32 reference runs in query chunks under activation checkpointing, so it fits in memory
at s=16384 and every shape is checked.
"""

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from harness import OURS, Case, Env, OpBenchmark, compile_per_shape

# The shapes of issue 6 and h200-baselines.md, one with head dim 256, then a causal sequence sweep at about 16k
# tokens per call; the sweep passes through the first two causal shapes.
MAIN_SHAPES = (
    {"b": 4, "hq": 32, "hk": 32, "s": 4096, "d": 128, "causal": 0},
    {"b": 4, "hq": 32, "hk": 32, "s": 4096, "d": 128, "causal": 1},
    {"b": 8, "hq": 16, "hk": 16, "s": 2048, "d": 64, "causal": 1},
    {"b": 2, "hq": 32, "hk": 8, "s": 8192, "d": 128, "causal": 1},
    {"b": 1, "hq": 32, "hk": 8, "s": 16384, "d": 128, "causal": 1},
    {"b": 2, "hq": 16, "hk": 8, "s": 8192, "d": 256, "causal": 1},  # Gemma-2-9B's attention shape
)
SWEEP_TOKENS = 16384
SWEEP_SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
SWEEP_HEADS = {64: 16, 128: 32}  # head_dim -> heads
# Sequences shorter than a tile and not a power of two; kept tiny because our kernels run in the interpreter.
QUICK_SHAPES = (
    {"b": 1, "hq": 2, "hk": 1, "s": 40, "d": 16, "causal": 1},
    {"b": 1, "hq": 2, "hk": 2, "s": 24, "d": 16, "causal": 0},
)
# Eager attention holds b * hq * s * s scores in bf16 and float32 (and their gradients); above this many it is
# recorded as not run rather than spending the run's time and memory on it.
EAGER_MAX_SCORES = 2**30
# Scores per chunk of the float32 reference (1 GiB), which checkpointing keeps to one chunk's worth at a time.
REFERENCE_CHUNK_SCORES = 2**28


def eager_attention(q, k, v, causal: bool, first_query: int = 0):
    """transformers' eager attention on (b, s, h, d) tensors: k and v heads repeated for GQA, softmax in float32,
    probabilities cast back to the input dtype. On float32 inputs it is the op's exact math. The queries are
    positions first_query.. of the sequence whose keys are k (the reference evaluates query chunks)."""
    groups = q.shape[2] // k.shape[2]
    q = q.transpose(1, 2)
    k, v = (t.repeat_interleave(groups, 2).transpose(1, 2) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        query_positions = torch.arange(first_query, first_query + q.shape[2], device=q.device)
        future = torch.arange(k.shape[2], device=q.device) > query_positions[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).transpose(1, 2)


def bounded_eager_attention(causal: bool):
    def attend(q, k, v):
        scores = q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1]
        if scores > EAGER_MAX_SCORES:
            raise ValueError(f"eager attention not run: {scores} scores (b*hq*s*s) > {EAGER_MAX_SCORES}")
        return eager_attention(q, k, v, causal)

    return attend


def chunked_reference(causal: bool):
    """eager_attention evaluated a chunk of query rows at a time (each chunk recomputed in the backward), so the
    float32 reference never holds more than REFERENCE_CHUNK_SCORES scores."""

    def reference(q, k, v):
        batch, seq, heads = q.shape[:3]
        rows = max(1, REFERENCE_CHUNK_SCORES // (batch * heads * k.shape[1]))
        chunks = []
        for start in range(0, seq, rows):
            stop = min(start + rows, seq)
            # Causal rows up to stop - 1 see no key beyond it.
            keys = stop if causal else k.shape[1]
            chunks.append(checkpoint(eager_attention, q[:, start:stop], k[:, :keys], v[:, :keys], causal, start,
                                     use_reentrant=False))
        return torch.cat(chunks, dim=1)

    return reference


def sdpa(backend: SDPBackend, causal: bool):
    def attend(q, k, v):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    return attend


@functools.cache
def _causal_block_mask(seq: int, device: str):
    """FlexAttention's causal block mask, built once per length by the correctness check, before any timing."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq, seq, device=device)


def compiled_flex_attention(causal: bool):
    from torch.nn.attention.flex_attention import flex_attention

    compiled = compile_per_shape(flex_attention)

    def attend(q, k, v):
        mask = _causal_block_mask(q.shape[1], str(q.device)) if causal else None
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                       enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    return attend


def make_inputs(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    shape = case.shape
    q_shape = (shape["b"], shape["s"], shape["hq"], shape["d"])
    kv_shape = (shape["b"], shape["s"], shape["hk"], shape["d"])
    return {
        name: torch.randn(size, dtype=case.dtype, device=device, requires_grad=True)
        for name, size in (("q", q_shape), ("k", kv_shape), ("v", kv_shape))
    }


def bytes_moved(case: Case, mode: str) -> int:
    shape = case.shape
    q = shape["b"] * shape["s"] * shape["hq"] * shape["d"] * case.dtype.itemsize
    kv = shape["b"] * shape["s"] * shape["hk"] * shape["d"] * case.dtype.itemsize
    forward = 2 * q + 2 * kv  # read q, k, v; write out (the float32 row statistics are 1/64 of out or less)
    backward = 4 * q + 4 * kv  # read q, k, v, out, dout; write dq, dk, dv
    return forward if mode == "fwd" else forward + backward


def flops(case: Case, mode: str) -> int:
    shape = case.shape
    forward = 4 * shape["b"] * shape["hq"] * shape["s"] * shape["s"] * shape["d"] // (2 if shape["causal"] else 1)
    return forward if mode == "fwd" else forward + 5 * forward // 2


def cases(env: Env) -> list[Case]:
    # The Triton CPU interpreter gets bf16 tl.dot wrong, so the CPU smoke run uses float16.
    dtype = torch.bfloat16 if env.on_gpu else torch.float16
    if env.quick:
        return [Case(shape, dtype) for shape in QUICK_SHAPES]
    sweep = [
        {"b": SWEEP_TOKENS // seq, "hq": heads, "hk": heads, "s": seq, "d": head_dim, "causal": 1}
        for head_dim, heads in SWEEP_HEADS.items()
        for seq in SWEEP_SEQ_LENS
    ]
    return [Case(shape, dtype) for shape in list(MAIN_SHAPES) + [s for s in sweep if s not in MAIN_SHAPES]]


def benchmarks(env: Env) -> list[OpBenchmark]:
    ours = env.ours
    if not env.on_gpu:
        print("note: SDPA's cuDNN and memory-efficient backends and FlexAttention skipped on CPU")

    def benchmark(causal: bool) -> OpBenchmark:
        providers = {
            OURS: lambda q, k, v: ours.flash_attn_func(q, k, v, causal=causal),
            "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION, causal),
        }
        if env.on_gpu:
            providers["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION, causal)
            providers["sdpa_efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION, causal)
            providers["flex_attention"] = compiled_flex_attention(causal)
        providers["torch"] = bounded_eager_attention(causal)
        # One benchmark per mask because providers see only the tensors; both report as one op.
        return OpBenchmark(
            op="flash_attn",
            cases=[case for case in cases(env) if case.shape["causal"] == causal],
            providers=providers,
            make_inputs=make_inputs,
            reference=chunked_reference(causal),
            output_names=("out",),
            bytes_moved=bytes_moved,
            flops=flops,
        )

    return [benchmark(causal=False), benchmark(causal=True)]
