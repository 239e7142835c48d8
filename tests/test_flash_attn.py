"""Flash attention against an independent reference, with FlashAttention-2's test rule.

Rule (flash-attention's tests): with ``ref`` the attention computed in float32 from the same inputs and ``pt``
the same math done in the input dtype, ``max|ours - ref| <= 2 * max|pt - ref| + noise`` for the output and
``3 *`` for the gradients, where ``noise`` is the rounding of the reference itself. On CPU (Triton interpreter)
only fp16 runs: the interpreter multiplies bf16 dot operands wrongly (triton#11584); bf16 runs on the GPU.
"""

import math
import sys
import unittest.mock

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE, ON_GPU, GivesNoGradient

DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


def reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, s_aux=None, keep=None, dropout_p=0.0,
              scale=None, upcast=True):
    """Dense attention for (batch, seq, heads, dim) tensors, in float32 (upcast) or in the input dtype.

    Written from the definitions (bottom-right causal alignment, window bounds, tanh soft-capping, a sink
    logit per head, dropout by an explicit keep mask), not from the kernels."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
        s_aux = s_aux.float() if s_aux is not None else None
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    seq_q, seq_k = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    row = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)
    col = torch.arange(seq_k, device=q.device)[None, :]
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if causal:
        visible &= col <= row
    if window[0] >= 0:
        visible &= col >= row - window[0]
    if window[1] >= 0:
        visible &= col <= row + window[1]
    scores = scores.masked_fill(~visible, float("-inf"))
    if s_aux is not None:
        scores = torch.cat([scores, s_aux[None, :, None, None].expand(*scores.shape[:3], 1).to(scores.dtype)], -1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see nothing output 0
    if s_aux is not None:
        probs = probs[..., :-1]
    if keep is not None:
        probs = probs * keep / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out.to(dtype)


def _noise(x):
    return 2 * ((x + 0.3 - 0.3) - x).abs().max().item() if x.numel() else 0.0


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def check_rule(name, ours, pt, ref, factor, scale=0.0):
    """FA's test rule: our error against the float32 reference within ``factor`` times PyTorch's in the input dtype,
    plus rounding noise. ``scale``, the magnitude of the quantities the result is computed from, adds 8 float32
    ulps of it to that noise: where the exact result cancels to 0, PyTorch's formula may give exactly 0 (a softmax
    row over one key, whose dS = P * (dP - D) PyTorch returns as 0) and ours the rounding of the difference of
    two float32 dot products, dP and D = rowsum(dO * O), summed in different orders."""
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    ours_err, pt_err = _max_err(ours, ref), _max_err(pt, ref)
    bound = factor * pt_err + _noise(ref.float()) + 1e-5 + 2**-20 * scale
    assert ours_err <= bound, f"{name}: max error {ours_err:.3e} > {factor} x PyTorch's {pt_err:.3e} + noise"


def make_qkv(batch, seq_q, seq_k, heads, kv_heads, dim, dtype, scale=1.0):
    q = torch.randn(batch, seq_q, heads, dim, device=DEVICE, dtype=dtype) * scale
    k = torch.randn(batch, seq_k, kv_heads, dim, device=DEVICE, dtype=dtype) * scale
    v = torch.randn(batch, seq_k, kv_heads, dim, device=DEVICE, dtype=dtype)
    return q, k, v


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def reference_leaves(upcast, *tensors):
    """The leaves of a reference run: float32 copies for the float32 reference, so that its output and gradients
    are not rounded back to the input dtype (a float16 value 8.55 has an ulp of 0.0078, and a correctly rounded
    result of ours can sit one ulp from a rounded reference), else copies in the input dtype."""
    return leaves(*(t.float() for t in tensors)) if upcast else leaves(*tensors)


# The CPU tile of the backward through dS (``from_ds``): its query and key tiles differ from the dK/dV pass's 16 x 16,
# so its whole tiles and masked edges fall elsewhere than the tiles that pass wrote.
FROM_DS_TILE = {"block_m": 32, "block_n": 16, "num_warps": 4, "heavy_first": True, "budget": 1 << 30, "min_flops": 0}


def from_ds_tile(head_dim, budget=1 << 30):
    """A ``from_ds`` launch entry for tests: FROM_DS_TILE on the CPU; on a GPU the shipped head-dim-128 tile, with
    64-key tiles at two stages for larger head dims (shared memory), at any size of attention."""
    if not ON_GPU:
        return {**FROM_DS_TILE, "budget": budget}
    wide = head_dim > 128
    return {"block_m": 128, "block_n": 64 if wide else 128, "num_warps": 8, "num_stages": 2 if wide else 3,
            "heavy_first": True, "budget": budget, "min_flops": 0}


# (one_loop, desc, pipelined, from_ds) of ``tile_pick``, and their test ids.
TILE_FORMS = [(False, False, False, False), (True, False, False, False), (False, True, False, False),
              (True, True, False, False), (True, True, True, False), (True, True, False, True)]
TILE_FORM_IDS = ["three-loops-pointers", "one-loop-pointers", "three-loops-descriptors", "one-loop-descriptors",
                 "pipelined-descriptors", "through-ds"]


def tile_pick(table_pick, form):
    """A launch-table lookup that puts every pass in one form of its tile loop and of its streamed loads, whatever
    ``table_pick`` (the table's own lookup) says (``one_loop``: the masked edge tiles and the unmasked middle as
    three loops, or one loop that tests each tile; ``desc``: partner tiles through tensor descriptors where the batch
    is dense, else pointer loads; ``pipelined``: the forward's loop computing the next tile's scores ahead;
    ``from_ds``: the backward through dS, where the batch is dense and no sink needs the dQ pass, else the dQ pass).
    The one-loop forms also keep the dK/dV pass's loop over a kv head's query heads with MHA (``group_loop``), the
    three-loop forms compile it out; likewise the forward's scheduling fence (``pv_fence``; on a GPU only, the
    interpreter leaves it out). The pipelined forward holds two score tiles: on a GPU its tile runs at two stages
    (at three, the H200's head-dim-128 tile of 128 x 128 does not fit in shared memory)."""
    one_loop, desc, pipelined, from_ds = form

    def pick(family, kind, device, head_dim):
        tile = {**table_pick(family, kind, device, head_dim), "one_loop": one_loop, "desc": desc,
                "desc_min_flops": 0, "group_loop": one_loop, "pv_fence": one_loop, "pipelined": pipelined,
                "without_desc": {}}
        tile.pop("from_ds", None)
        if from_ds and kind == "backward_dq":
            tile["from_ds"] = from_ds_tile(head_dim)
        if pipelined and "num_stages" in tile:
            tile["num_stages"] = min(tile["num_stages"], 2)
        return tile

    return pick


@pytest.fixture(params=TILE_FORMS, ids=TILE_FORM_IDS)
def tile_form(request, fk, monkeypatch):
    """Every pass in one tile form (``tile_pick``): both MHA kernels of the dK/dV pass run in every test that uses
    this fixture."""
    monkeypatch.setattr(fk._flash_attn, "pick", tile_pick(fk._flash_attn.pick, request.param))
    return request.param


# Memory layouts of a (..., rows, heads, head_dim) input besides the contiguous one (``strided_view``).
LAYOUTS = ("contiguous", "heads_of_a_wider_tensor", "head_major", "every_other_row", "dims_of_a_wider_tensor")


def strided_view(t, layout):
    """A view with the values of ``t`` in one of LAYOUTS: heads sliced out of a tensor with more heads, the
    (heads, rows) storage order transformers' transposes give, every other row of a buffer, or the first head_dim
    columns of wider rows. The rest of each buffer is NaN, so a read outside the view shows in the results."""
    rows, heads, dim = t.shape[-3:]
    lead = t.shape[:-3]
    if layout == "contiguous":
        return t
    if layout == "head_major":
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)
    shape = {"heads_of_a_wider_tensor": (*lead, rows, heads + 3, dim),
             "every_other_row": (*lead, 2 * rows, heads, dim),
             "dims_of_a_wider_tensor": (*lead, rows, heads, dim + 8)}[layout]
    buffer = torch.full(shape, float("nan"), device=t.device, dtype=t.dtype)
    view = {"heads_of_a_wider_tensor": lambda b: b[..., 1:1 + heads, :],
            "every_other_row": lambda b: b[..., 1::2, :, :],
            "dims_of_a_wider_tensor": lambda b: b[..., :dim]}[layout](buffer)
    view.copy_(t)
    return view


def run_and_check(fk, q, k, v, *, s_aux=None, layouts=("contiguous",) * 3, **options):
    """Our output and gradients against the float32 and input-dtype references, by the FA test rule; ours reads
    q, k and v in ``layouts`` (see ``strided_view``)."""
    dout = torch.randn_like(q)
    grads = {}
    outs = {}
    for name, fn in (("ours", lambda *a, **kw: fk.flash_attn_func(*a, **kw)),
                     ("ref", lambda *a, **kw: reference(*a, **kw, upcast=True)),
                     ("pt", lambda *a, **kw: reference(*a, **kw, upcast=False))):
        if name == "ours":
            args = [strided_view(t.detach(), layout).requires_grad_() for t, layout in zip((q, k, v), layouts)]
        else:
            args = reference_leaves(name == "ref", q, k, v)
        sink = s_aux.detach().clone().requires_grad_() if s_aux is not None else None
        extra = dict(options)
        if name == "ours":
            extra = {key: val for key, val in extra.items() if key not in ("window", "scale")}
            extra["window_size"] = options.get("window", (-1, -1))
            if "scale" in options:
                extra["softmax_scale"] = options["scale"]
        out = fn(*args, s_aux=sink, **extra)
        out.backward(dout.to(out.dtype))
        outs[name] = out.detach()
        grads[name] = [a.grad for a in args] + ([sink.grad] if sink is not None else [])
    check_rule("out", outs["ours"], outs["pt"], outs["ref"], 2)
    gradient_scale = max(_max_err(g, torch.zeros_like(g)) for g in grads["ref"])
    for label, ours, pt, ref in zip(("dq", "dk", "dv", "ds_aux"), grads["ours"], grads["pt"], grads["ref"]):
        check_rule(label, ours, pt, ref, 3, gradient_scale)


CASES = [
    # batch, seq_q, seq_k, heads, kv_heads, dim, options
    (2, 37, 53, 4, 2, 32, {}),
    (1, 40, 24, 2, 1, 40, {"causal": True}),            # s_q > s_k: the first rows see nothing
    (2, 24, 61, 3, 3, 64, {"causal": True}),            # s_q < s_k: bottom-right alignment
    (1, 33, 33, 4, 1, 72, {"window": (5, 3)}),
    (2, 29, 29, 2, 2, 48, {"causal": True, "window": (7, 7)}),  # transformers' symmetric window with causal
    (1, 20, 30, 2, 1, 16, {"softcap": 3.0}),
    (1, 17, 17, 1, 1, 8, {}),                           # the smallest head dim of the kernels
    (1, 19, 23, 2, 1, 12, {"causal": True}),            # head dims off the multiples of 8: zero-padded to them,
    (1, 9, 9, 2, 2, 3, {}),                             # the default scale from the unpadded head dim
    (1, 1, 19, 2, 2, 32, {"causal": True}),              # one query row (decoding)
    (1, 133, 1, 4, 2, 128, {}),                          # one key: the exact dk is 0 (check_rule's scale)
]


@pytest.mark.usefixtures("tile_form")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:6])) + "-" + "-".join(c[6]) if isinstance(
    c, tuple) else str(c))
def test_matches_reference(fk, poisoned_empty, case, dtype):
    batch, seq_q, seq_k, heads, kv_heads, dim, options = case
    torch.manual_seed(seq_q * 1000 + seq_k)
    q, k, v = make_qkv(batch, seq_q, seq_k, heads, kv_heads, dim, dtype)
    run_and_check(fk, q, k, v, **options)


@settings(max_examples=12 if not ON_GPU else 30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_property_random_attention(fk, poisoned_empty, data):
    """Random shapes (lengths on and off tile boundaries, GQA groups, head dims), masks (causal, windows, both),
    soft caps, scales, sinks, memory layouts of q, k and v, and tile forms, by the FA test rule."""
    max_seq, max_dim = (600, 256) if ON_GPU else (70, 96)
    batch = data.draw(st.integers(1, 2), label="batch")
    seq_q = data.draw(st.integers(1, max_seq), label="seq_q")
    seq_k = data.draw(st.integers(1, max_seq), label="seq_k")
    kv_heads = data.draw(st.integers(1, 2), label="kv_heads")
    heads = kv_heads * data.draw(st.integers(1, 3), label="group")
    dim = data.draw(st.integers(1, max_dim // 8).map(lambda n: 8 * n) | st.integers(1, max_dim), label="dim")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    options = {"causal": data.draw(st.booleans(), label="causal")}
    if data.draw(st.booleans(), label="window"):
        sides = st.integers(-1, 40)
        options["window"] = (data.draw(sides, label="left"), data.draw(sides, label="right"))
    if data.draw(st.booleans(), label="softcap"):
        options["softcap"] = data.draw(st.floats(1.0, 20.0), label="softcap value")
    if data.draw(st.booleans(), label="scale"):
        options["scale"] = data.draw(st.floats(0.02, 0.5), label="scale value")
    with_sink = data.draw(st.booleans(), label="sink")
    layouts = tuple(data.draw(st.sampled_from(LAYOUTS), label=f"{name} layout") for name in "qkv")
    form = data.draw(st.sampled_from(TILE_FORMS), label="tile form")
    torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    q, k, v = make_qkv(batch, seq_q, seq_k, heads, kv_heads, dim, dtype)
    sink = torch.randn(heads, device=DEVICE) if with_sink else None
    with unittest.mock.patch.object(fk._flash_attn, "pick", tile_pick(fk._flash_attn.pick, form)):
        run_and_check(fk, q, k, v, s_aux=sink, layouts=layouts, **options)


@pytest.mark.usefixtures("tile_form")
@pytest.mark.parametrize("causal", [False, True])
def test_attention_sink(fk, poisoned_empty, causal):
    torch.manual_seed(3)
    q, k, v = make_qkv(2, 21, 21, 4, 2, 32, torch.float16)
    run_and_check(fk, q, k, v, s_aux=torch.randn(4, device=DEVICE), causal=causal)


def test_softcap_saturates(fk, poisoned_empty):
    """q and k scaled up so tanh saturates (FlashAttention's softcap test)."""
    torch.manual_seed(4)
    q, k, v = make_qkv(1, 25, 31, 2, 1, 32, torch.float16, scale=4.0)
    run_and_check(fk, q, k, v, softcap=5.0, causal=True)


@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.7])
def test_any_softmax_scale(fk, poisoned_empty, scale):
    """FlashAttention-2 accepts any softmax_scale. With a positive one the forward takes each row's max on q.k
    before scaling; a negative or zero one must not (the max of scale * q.k is then not scale * max(q.k), and
    0 * -inf in masked columns is NaN)."""
    torch.manual_seed(8)
    q, k, v = make_qkv(2, 27, 35, 2, 1, 32, torch.float16)
    run_and_check(fk, q, k, v, causal=True, scale=scale)


def test_fully_masked_rows_output_zero_and_infinite_lse(fk):
    q, k, v = make_qkv(1, 6, 2, 2, 2, 16, torch.float16)
    q, k, v = leaves(q, k, v)
    out, lse, _ = fk.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    # s_q=6, s_k=2, bottom-right causal: rows 0-3 see no key.
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isinf(lse[:, :, :4]).all() and (lse[:, :, :4] > 0).all()
    assert torch.isfinite(lse[:, :, 4:]).all()
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :4], torch.zeros_like(q.grad[:, :4]))


def test_lse_is_natural_log_of_scaled_scores(fk):
    torch.manual_seed(5)
    q, k, v = make_qkv(2, 9, 14, 2, 1, 16, torch.float16)
    _, lse, mask = fk.flash_attn_func(q, k, v, softmax_scale=0.3, return_attn_probs=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, 2)) * 0.3
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-4)
    assert lse.dtype == torch.float32 and lse.shape == (2, 2, 9) and mask is None


def _varlen_case(lengths_q, lengths_k, heads, kv_heads, dim, dtype, tail=0):
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32, device=DEVICE)
    total_q, total_k = int(cu_q[-1]) + tail, int(cu_k[-1]) + tail
    q = torch.randn(total_q, heads, dim, device=DEVICE, dtype=dtype)
    k = torch.randn(total_k, kv_heads, dim, device=DEVICE, dtype=dtype)
    v = torch.randn(total_k, kv_heads, dim, device=DEVICE, dtype=dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.usefixtures("tile_form")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 20], ids=["dim32", "dim20-padded"])
def test_varlen_matches_per_sequence_reference(fk, poisoned_empty, causal, head_dim):
    """Uneven, empty and length-1 sequences, plus rows past cu_seqlens[-1] (they get 0 and zero gradients); a head
    dim off the multiples of 8 too (padded, as FlashAttention-2 does)."""
    torch.manual_seed(6)
    lengths_q, lengths_k = [5, 0, 1, 19, 12], [7, 3, 1, 19, 0]
    q, k, v, cu_q, cu_k = _varlen_case(lengths_q, lengths_k, 4, 2, head_dim, torch.float16, tail=3)
    q, k, v = leaves(q, k, v)
    # max_seqlen as a NumPy integer and as a 0-d tensor (as transformers passes it), both taken as ints.
    out, lse, _ = fk.flash_attn_varlen_func(q, k, v, cu_q, cu_k, numpy.int64(max(lengths_q)),
                                            torch.tensor(max(lengths_k)), causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert lse.shape == (4, q.shape[0])
    for b in range(len(lengths_q)):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rows_k = slice(int(cu_k[b]), int(cu_k[b + 1]))
        qs, ks, vs = leaves(q[rows_q][None], k[rows_k][None], v[rows_k][None])
        results = {}
        for upcast in (True, False):
            a = reference_leaves(upcast, qs, ks, vs)
            ref = reference(*a, causal=causal, upcast=upcast)
            ref.backward(dout[rows_q][None].to(ref.dtype))
            results[upcast] = (ref.detach(), *[t.grad for t in a])
        for index, name in enumerate(("out", "dq", "dk", "dv")):
            ours = (out.detach()[rows_q], q.grad[rows_q], k.grad[rows_k], v.grad[rows_k])[index][None]
            check_rule(f"sequence {b} {name}", ours, results[False][index], results[True][index],
                       2 if index == 0 else 3)
    tail_q, tail_k = slice(int(cu_q[-1]), None), slice(int(cu_k[-1]), None)
    for t in (out.detach()[tail_q], q.grad[tail_q], k.grad[tail_k], v.grad[tail_k]):
        assert torch.equal(t, torch.zeros_like(t))
    assert torch.isinf(lse[:, tail_q]).all()


@settings(max_examples=8 if not ON_GPU else 30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_property_random_varlen(fk, poisoned_empty, data):
    """Random packed batches: sequence lengths from 0 (on and off tile boundaries), q and k lengths equal (self
    attention) or not, GQA groups, head dims, masks, soft caps, scales, sinks, memory layouts, max_seqlen above the
    longest sequence, rows past cu_seqlens[-1], and tile forms; each sequence by the FA test rule against the dense
    reference of its own rows, the rows past the last offset 0 with zero gradients, and the inputs unchanged."""
    max_len, max_dim = (300, 256) if ON_GPU else (40, 64)
    n_seqs = data.draw(st.integers(1, 4), label="sequences")
    lengths = st.lists(st.integers(0, max_len), min_size=n_seqs, max_size=n_seqs)
    lengths_q = data.draw(lengths, label="q lengths")
    lengths_k = lengths_q if data.draw(st.booleans(), label="k lengths = q lengths") else data.draw(
        lengths, label="k lengths")
    kv_heads = data.draw(st.integers(1, 2), label="kv_heads")
    heads = kv_heads * data.draw(st.integers(1, 3), label="group")
    dim = data.draw(st.integers(1, max_dim // 8).map(lambda n: 8 * n) | st.integers(1, max_dim), label="dim")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    causal = data.draw(st.booleans(), label="causal")
    window = (data.draw(st.integers(-1, 40), label="left"), data.draw(st.integers(-1, 40), label="right")) if (
        data.draw(st.booleans(), label="window")) else (-1, -1)
    softcap = data.draw(st.floats(1.0, 20.0), label="softcap") if data.draw(st.booleans(), label="capped") else 0.0
    scale = data.draw(st.floats(0.02, 0.5), label="scale") if data.draw(st.booleans(), label="scaled") else None
    with_sink = data.draw(st.booleans(), label="sink")
    layouts = [data.draw(st.sampled_from(LAYOUTS), label=f"{name} layout") for name in "qkv"]
    slack_q, slack_k = (data.draw(st.integers(0, 5), label=f"max_seqlen_{n} slack") for n in "qk")
    tail = data.draw(st.integers(0, 3), label="rows past the last offset")
    form = data.draw(st.sampled_from(TILE_FORMS), label="tile form")
    torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))

    q, k, v, cu_q, cu_k = _varlen_case(lengths_q, lengths_k, heads, kv_heads, dim, dtype, tail=tail)
    sink = torch.randn(heads, device=DEVICE) if with_sink else None
    originals = [t.clone() for t in (q, k, v)]
    ours = [strided_view(t, layout).requires_grad_() for t, layout in zip((q, k, v), layouts)]
    with unittest.mock.patch.object(fk._flash_attn, "pick", tile_pick(fk._flash_attn.pick, form)):
        out = fk.flash_attn_varlen_func(*ours, cu_q, cu_k, max(lengths_q) + slack_q, max(lengths_k) + slack_k,
                                        softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                                        s_aux=sink)
        dout = torch.randn_like(out)
        out.backward(dout)
    out, (dq, dk, dv) = out.detach(), (t.grad for t in ours)
    for t, original in zip(ours, originals):
        assert torch.equal(t.detach(), original)
    options = dict(causal=causal, window=window, softcap=softcap, scale=scale)
    for b in range(n_seqs):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rows_k = slice(int(cu_k[b]), int(cu_k[b + 1]))
        results = {}
        for upcast in (True, False):
            a = reference_leaves(upcast, q[rows_q][None], k[rows_k][None], v[rows_k][None])
            ref = reference(*a, s_aux=sink, upcast=upcast, **options)
            ref.backward(dout[rows_q][None].to(ref.dtype))
            results[upcast] = (ref.detach(), *[t.grad for t in a])
        for index, (name, value) in enumerate(zip(("out", "dq", "dk", "dv"),
                                                  (out[rows_q], dq[rows_q], dk[rows_k], dv[rows_k]))):
            check_rule(f"sequence {b} {name}", value[None], results[False][index], results[True][index],
                       2 if index == 0 else 3)
    for t in (out[int(cu_q[-1]):], dq[int(cu_q[-1]):], dk[int(cu_k[-1]):], dv[int(cu_k[-1]):]):
        assert torch.equal(t, torch.zeros_like(t))


@pytest.mark.parametrize("bad, clamped", [([0, 5, 20], [0, 5, 9]), ([-3, 5, 9], [0, 5, 9])],
                         ids=["past-the-rows", "negative"])
def test_varlen_offsets_outside_the_rows_are_clamped(fk, bad, clamped):
    """The offsets are not checked on the host (a synchronisation): the kernels clamp each sequence to the packed
    rows, so offsets past them or below 0 give the results of the clamped offsets, and never an access outside the
    tensors (which corrupted the CPU interpreter's heap before)."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(9, 2, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    dout = torch.randn_like(q)
    results = []
    for offsets in (bad, clamped):
        cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
        a = leaves(q, k, v)
        out = fk.flash_attn_varlen_func(*a, cu, cu, 16, 16, causal=True)
        out.backward(dout)
        results.append((out.detach(), *[t.grad for t in a]))
    for ours, want in zip(*results):
        assert torch.equal(ours, want)


def test_decreasing_varlen_offsets_stay_inside_the_tensors(fk):
    """Decreasing offsets make overlapping or empty sequences (wrong rows, as documented), but no out-of-bounds
    access: the call returns finite values."""
    q, k, v = leaves(*(torch.randn(9, 2, 16, device=DEVICE, dtype=torch.float16) for _ in range(3)))
    cu = torch.tensor([0, 7, 4, 9], dtype=torch.int32, device=DEVICE)
    out = fk.flash_attn_varlen_func(q, k, v, cu, cu, 16, 16)
    out.backward(torch.ones_like(out))
    assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))


def test_packed_variants_match_unpacked(fk):
    torch.manual_seed(7)
    q, k, v = make_qkv(2, 13, 13, 2, 2, 16, torch.float16)
    expected = fk.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(fk.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), causal=True), expected,
                               rtol=0, atol=0)
    torch.testing.assert_close(fk.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True), expected,
                               rtol=0, atol=0)
    cu = torch.tensor([0, 13, 26], dtype=torch.int32, device=DEVICE)
    flat = [t.reshape(26, 2, 16) for t in (q, k, v)]
    torch.testing.assert_close(
        fk.flash_attn_varlen_qkvpacked_func(torch.stack(flat, 1), cu, 13, causal=True).reshape(expected.shape),
        expected, rtol=0, atol=0)
    torch.testing.assert_close(
        fk.flash_attn_varlen_kvpacked_func(flat[0], torch.stack(flat[1:], 1), cu, cu, 13, 13,
                                           causal=True).reshape(expected.shape), expected, rtol=0, atol=0)


def test_strided_views_are_read_in_place(fk, poisoned_empty):
    """transformers passes (b, s, h, d) views of (b, h, s, d) tensors: same results as contiguous inputs."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(2, 3, 11, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    views = [t.transpose(1, 2) for t in (q, k, v)]
    expected = fk.flash_attn_func(*[t.contiguous() for t in views], causal=True)
    torch.testing.assert_close(fk.flash_attn_func(*views, causal=True), expected, rtol=0, atol=0)


@pytest.mark.usefixtures("tile_form")
def test_zero_strides_are_read_as_they_are(fk, poisoned_empty):
    """k and v expanded over the batch, and an upstream gradient expanded over all but the head dim (``(out *
    w).sum()`` gives one): stride-0 dimensions, which the tensor descriptors of the copy engine take too, give bitwise
    the output and gradients of contiguous copies."""
    torch.manual_seed(25)
    q, k, v = make_qkv(3, 40, 40, 4, 2, 32, torch.float16)
    k, v = k[:1].expand_as(k), v[:1].expand_as(v)
    w = torch.randn(32, device=DEVICE, dtype=q.dtype)
    results = []
    for prepare in (lambda t: t, torch.Tensor.contiguous):
        a = [t.detach().requires_grad_() for t in (q, prepare(k), prepare(v))]  # detach() keeps the strides
        out = fk.flash_attn_func(*a, causal=True)
        out.backward(prepare(w.expand_as(out)))
        results.append([out.detach()] + [t.grad for t in a])
    for name, expanded, contiguous in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(expanded, contiguous), name


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_strided_head_dim_is_copied_for_the_backward_too(fk, varlen):
    """q, k and v whose head dimension is strided (stride(-1) != 1) are copied, as FlashAttention-2 does: the same
    output and gradients as contiguous inputs. The backward once read the saved strided tensors as if their head
    dimension were contiguous (garbage gradients, silently)."""
    torch.manual_seed(25)
    q, k, v = make_qkv(2, 9, 11, 4, 2, 16, torch.float16)
    if varlen:
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    dout = torch.randn_like(q)
    results = []
    for layout in (lambda t: t, lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)):
        a = leaves(q, k, v)
        views = [layout(t) for t in a]
        if varlen:
            cu_q = torch.tensor([0, 9, 18], dtype=torch.int32, device=DEVICE)
            cu_k = torch.tensor([0, 11, 22], dtype=torch.int32, device=DEVICE)
            out = fk.flash_attn_varlen_func(*views, cu_q, cu_k, 9, 11, causal=True)
        else:
            out = fk.flash_attn_func(*views, causal=True)
        out.backward(dout)
        results.append((out.detach(), *[t.grad for t in a]))
    assert results[1][1].shape == q.shape
    for name, contiguous, strided in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(contiguous, strided), name


def test_descriptors_only_where_the_copy_engine_can_address_the_tiles(fk):
    """A launch entry's ``desc`` is honoured for dense tensors with 16-byte aligned base and strides in an attention
    of at least ``desc_min_flops``; a varlen batch (whose boxes would cross sequence ends), misaligned tensors and
    smaller attentions take pointer loads and the entry's ``without_desc`` tile."""
    streamed = fk._kernels.flash_attn._streamed
    tile = {"block_m": 16, "block_n": 32, "num_warps": 4, "one_loop": True, "desc": True, "desc_min_flops": 1000,
            "without_desc": {"one_loop": False}}
    dense = torch.randn(2, 40, 3, 24, device=DEVICE, dtype=torch.float16)
    used, desc, (descriptor,) = streamed(tile, False, 32, 24, 1000, dense)
    assert desc and used is tile
    assert descriptor.base is dense and descriptor.block_shape == [1, 32, 1, 32]
    assert list(descriptor.shape) == [2, 40, 3, 24] and list(descriptor.strides) == list(dense.stride())
    heads_of_9 = torch.randn(2, 40, 3, 9, device=DEVICE, dtype=torch.float16)[..., :8]  # 18-byte head stride
    shifted = torch.randn(2 * 40 * 3 * 24 + 1, device=DEVICE, dtype=torch.float16)[1:].view(2, 40, 3, 24)
    for varlen, flops, tensor in ((True, 1000, dense), (False, 1000, heads_of_9), (False, 1000, shifted),
                                  (False, 999, dense)):
        used, desc, (passed,) = streamed(tile, varlen, 32, tensor.shape[-1], flops, tensor)
        assert not desc and passed is tensor
        assert used == {**tile, "one_loop": False}
    assert streamed({**tile, "desc": False}, False, 32, 24, 1000, dense)[1] is False


@pytest.mark.parametrize("pairs_per_launch", [1, 3])
def test_backward_through_ds_in_launches_of_a_few_pairs(fk, poisoned_empty, monkeypatch, pairs_per_launch):
    """The backward through dS with a scratch budget of one or three (batch, kv head) pairs (four launches of one,
    or two of two): delta first, then the dK/dV pass and the dQ pass from dS in turn, each launch from its own first
    pair (four pairs: GQA, batch 2), with a bottom-right causal window, soft-capping and a query length whose scratch
    rows need padding to 16 bytes, against the references; with dropout, against the dQ pass (same mask)."""
    kernels_module = fk._kernels.flash_attn
    batch, seq_q, seq_k, heads, kv_heads, dim = (2, 300, 333, 8, 2, 64) if ON_GPU else (2, 37, 45, 4, 2, 16)
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    row = kernels_module._ds_row_length(seq_q, 2)
    assert row > seq_q
    per_pair = heads // kv_heads * seq_k * row * 2
    table_pick = fk._flash_attn.pick

    def pick(family, kind, device, head_dim):
        tile = {**table_pick(family, kind, device, head_dim), "desc": True, "desc_min_flops": 0, "without_desc": {}}
        if kind == "backward_dq":
            tile["from_ds"] = from_ds_tile(head_dim, budget=pairs_per_launch * per_pair + per_pair // 2)
        return tile

    launched = []

    def recording_launch(kernel, *args, **kwargs):
        launched.append(kernel.__name__)
        return launch(kernel, *args, **kwargs)

    launch = kernels_module.launch
    monkeypatch.setattr(fk._flash_attn, "pick", pick)
    monkeypatch.setattr(kernels_module, "launch", recording_launch)
    torch.manual_seed(19)
    q, k, v = make_qkv(batch, seq_q, seq_k, heads, kv_heads, dim, dtype)
    run_and_check(fk, q, k, v, causal=True, window=(seq_k // 3, 0), softcap=5.0)
    n_launches = -(-batch * kv_heads // pairs_per_launch)
    assert launched[-(1 + 2 * n_launches):] == (
        ["_bwd_delta_kernel"] + ["_bwd_dkdv_kernel", "_bwd_dq_from_ds_kernel"] * n_launches)

    # Dropout: the dQ from the stored dS against the dQ pass's recomputed one, same mask.
    results = {}
    for through_ds in (True, False):
        if not through_ds:
            monkeypatch.setattr(fk._flash_attn, "pick", lambda *a: {
                key: value for key, value in pick(*a).items() if key != "from_ds"})
        torch.manual_seed(20)
        a = leaves(q, k, v)
        out = fk.flash_attn_func(*a, dropout_p=0.2, causal=True)
        out.backward(torch.ones_like(out))
        results[through_ds] = [t.grad.float() for t in a]
    for name, with_ds, without in zip(("dq", "dk", "dv"), results[True], results[False]):
        torch.testing.assert_close(with_ds, without, atol=2e-2, rtol=2e-2, msg=name)


def test_backward_through_ds_falls_back_where_the_scratch_does_not_fit(fk, monkeypatch):
    """Where allocating the dS scratch runs out of device memory, ``_ds_scratch`` returns None and the backward takes
    the dQ pass instead of failing: the same launches and bitwise the same gradients as without ``from_ds``."""
    kernels_module = fk._kernels.flash_attn
    q = torch.empty(1, 8, 2, 16, dtype=torch.float16, device=DEVICE)
    assert kernels_module._ds_scratch(q, 2, 8, 8).shape == (2, 8, 8)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no room")

    with monkeypatch.context() as patched:
        patched.setattr(torch.Tensor, "new_empty", out_of_memory)
        assert kernels_module._ds_scratch(q, 2, 8, 8) is None

    table_pick = fk._flash_attn.pick
    launch = kernels_module.launch
    results = {}
    for name, scratch in (("no room", lambda *args: None), ("without from_ds", None)):
        def pick(family, kind, device, head_dim, scratch=scratch):
            tile = {**table_pick(family, kind, device, head_dim), "desc": True, "desc_min_flops": 0,
                    "without_desc": {}}
            if kind == "backward_dq" and scratch is not None:
                tile["from_ds"] = from_ds_tile(head_dim)
            return tile

        launched = []
        monkeypatch.setattr(fk._flash_attn, "pick", pick)
        monkeypatch.setattr(kernels_module, "launch", lambda kernel, *a, **kw: (
            launched.append(kernel.__name__), launch(kernel, *a, **kw)))
        if scratch is not None:
            monkeypatch.setattr(kernels_module, "_ds_scratch", scratch)
        torch.manual_seed(21)
        a = leaves(*make_qkv(1, 24, 24, 4, 2, 16, torch.float16))
        out = fk.flash_attn_func(*a, causal=True)
        out.backward(torch.ones_like(out))
        results[name] = ([t.grad for t in a], launched[-2:])
    assert results["no room"][1] == results["without from_ds"][1] == ["_bwd_dq_kernel", "_bwd_dkdv_kernel"]
    for with_fallback, without in zip(results["no room"][0], results["without from_ds"][0]):
        assert torch.equal(with_fallback, without)


def test_backward_through_ds_keeps_every_grid_axis_within_the_limit(fk, monkeypatch):
    """More (batch, head) pairs than a second grid axis holds (forced by a limit of 1 pair) in the backward through
    dS: every launch, delta's too, puts its pairs on the first axis, with bitwise the gradients of the 2-D grids.
    Delta's launch once kept a (tiles, batch * heads) grid, which CUDA refuses above 65535 pairs."""
    kernels_module = fk._kernels.flash_attn
    table_pick = fk._flash_attn.pick

    def pick(family, kind, device, head_dim):
        tile = {**table_pick(family, kind, device, head_dim), "desc": True, "desc_min_flops": 0, "without_desc": {}}
        if kind == "backward_dq":
            tile["from_ds"] = from_ds_tile(head_dim)
        return tile

    grids = []

    def recording_launch(kernel, grid, *args, **kwargs):
        grids.append((kernel.__name__, tuple(grid)))
        return launch(kernel, grid, *args, **kwargs)

    launch = kernels_module.launch
    monkeypatch.setattr(fk._flash_attn, "pick", pick)
    monkeypatch.setattr(kernels_module, "launch", recording_launch)
    torch.manual_seed(24)
    q, k, v = make_qkv(2, 24, 24, 4, 2, 16, torch.float16)
    dout = torch.randn_like(q)
    results = []
    for limit in (kernels_module._GRID_AXIS_LIMIT, 1):
        monkeypatch.setattr(kernels_module, "_GRID_AXIS_LIMIT", limit)
        grids.clear()
        a = leaves(q, k, v)
        fk.flash_attn_func(*a, causal=True).backward(dout)
        results.append([t.grad for t in a])
    names = [name for name, _ in grids]
    assert "_bwd_delta_kernel" in names and "_bwd_dq_from_ds_kernel" in names, names
    assert all(all(size <= 1 for size in grid[1:]) for _, grid in grids), grids
    for name, natural, flat in zip(("dq", "dk", "dv"), *results):
        assert torch.equal(natural, flat), name


def test_backward_through_ds_only_where_it_applies(fk):
    """``_ds_chunk_pairs``: the pairs per launch, in equal shares of the fewest launches whose dS fits ``budget``
    bytes (scratch rows padded to 16 bytes), rounded to multiples of the granule (the dK/dV pass's heavy-first group,
    or the pairs of ``min_programs / key_tiles`` programs, if larger) where the budget holds one; 0 (the dQ pass)
    without a ``from_ds`` entry, for varlen batches, with a sink, for a K the copy engine cannot address, below
    ``min_flops``, when one pair's dS exceeds the budget, or when several launches would each run fewer dK/dV programs
    than ``min_programs`` or, with a causal mask, run more than ``max_granule_ratio`` granules per granule of
    pairs."""
    chunk_pairs = fk._kernels.flash_attn._ds_chunk_pairs
    k = torch.empty(2, 50, 3, 16, dtype=torch.float16)
    one_pair = 2 * 50 * 48 * 2  # group of 2, 50 keys, 45 queries padded to 48, 2 bytes
    entry = {"budget": 4 * one_pair, "min_flops": 100, "min_programs": 8}

    def pairs(n_pairs, key_tiles=4, flops=100, group_limit=0, causal=True, **changes):
        return chunk_pairs({**entry, **changes}, False, None, k, n_pairs, 2, 45, 50, flops, key_tiles, group_limit,
                           causal)

    assert pairs(3) == 3 and pairs(4) == 4
    assert pairs(6, key_tiles=10) == 3  # two launches of 3 rather than 4 + 2
    assert pairs(9, key_tiles=10) == 3  # three of 3
    # Granules: 8 programs of 4 key tiles make 2 pairs (6: 3 + 3 -> 4 + 2; 9: 3 + 3 + 3 -> 4 + 4 + 1), a heavy-first
    # group of 3 pairs (7: 4 + 3 -> 3 + 3 + 1).
    assert pairs(6) == 4 and pairs(9) == 4
    assert pairs(7, key_tiles=10, group_limit=3) == 3
    assert pairs(3, key_tiles=10, group_limit=3) == 3 and pairs(4, key_tiles=10, group_limit=3) == 4
    assert pairs(9, key_tiles=10, group_limit=5) == 3  # a budget short of a granule: equal shares
    # Granules run per granule of pairs: 6 pairs as 4 + 2 run 3 granules for 3 (1.0); 9 as 4 + 4 + 1 run 5 for 4.5
    # (1.11); 7 as 3 + 3 + 1 (granule 3) 3 for 7 / 3 (1.29); 9 in three launches of 3 (granule 5) 3 for 1.8 (1.67).
    # Without a causal mask a part of a granule is only shorter; a single launch is never declined.
    assert pairs(9, max_granule_ratio=1.1, causal=False) == 4
    assert pairs(6, max_granule_ratio=1.0) == 4
    assert pairs(9, max_granule_ratio=1.12) == 4 and pairs(9, max_granule_ratio=1.1) == 0
    assert pairs(7, key_tiles=10, group_limit=3, max_granule_ratio=1.3) == 3
    assert pairs(7, key_tiles=10, group_limit=3, max_granule_ratio=1.25) == 0
    assert pairs(9, key_tiles=10, group_limit=5, max_granule_ratio=1.6) == 0
    assert pairs(3, key_tiles=10, group_limit=5, max_granule_ratio=1.0) == 3
    assert pairs(6, budget=one_pair) == 0  # six launches of one pair: 4 programs each, fewer than 8
    assert pairs(6, budget=one_pair, key_tiles=10) == 1
    assert pairs(6, budget=one_pair - 1) == 0
    assert pairs(6, flops=99) == 0
    assert chunk_pairs(None, False, None, k, 6, 2, 45, 50, 100, 4, 0, True) == 0
    assert chunk_pairs(entry, True, None, k, 6, 2, 45, 50, 100, 4, 0, True) == 0
    assert chunk_pairs(entry, False, torch.zeros(6), k, 6, 2, 45, 50, 100, 4, 0, True) == 0
    misaligned = torch.empty(2, 50, 3, 20, dtype=torch.float16)[..., :17]
    assert chunk_pairs(entry, False, None, misaligned, 6, 2, 45, 50, 100, 4, 0, True) == 0


def test_forward_takes_the_short_tile_up_to_its_key_length(fk, monkeypatch):
    """The forward entry's ``short`` overrides (tile shape, warps, stages) apply where seqlen_k is at most its
    ``max_seqlen_k``, and only there, in dense and varlen batches, with the same outputs as the entry's own tile."""
    kernels_module = fk._kernels.flash_attn
    table_pick = fk._flash_attn.pick
    short = {"max_seqlen_k": 40, "block_m": 32, "block_n": 32, "num_warps": 2}

    def pick(family, kind, device, head_dim):
        tile = table_pick(family, kind, device, head_dim)
        return {**tile, "short": short} if kind == "forward" else tile

    launched = []

    def recording_launch(kernel, grid, pointers, scalars, constexprs, num_warps, *args):
        if kernel is kernels_module._fwd_kernel:
            launched.append((constexprs["BLOCK_M"], constexprs["BLOCK_N"], num_warps))
        return launch(kernel, grid, pointers, scalars, constexprs, num_warps, *args)

    launch = kernels_module.launch
    monkeypatch.setattr(kernels_module, "launch", recording_launch)
    entry = table_pick("flash_attn", "forward", torch.device(DEVICE), 16)
    entry_tile = (entry["block_m"], entry["block_n"], entry["num_warps"])
    assert entry_tile != (32, 32, 2)
    torch.manual_seed(23)
    for seq_k, expected in ((40, (32, 32, 2)), (41, entry_tile)):
        q, k, v = make_qkv(2, 37, seq_k, 2, 1, 16, torch.float16)
        outputs = {}
        for with_short in (False, True):
            monkeypatch.setattr(fk._flash_attn, "pick", pick if with_short else table_pick)
            launched.clear()
            outputs[with_short] = fk.flash_attn_func(q, k, v, causal=True)
            assert launched == [expected if with_short else entry_tile]
        torch.testing.assert_close(outputs[True], outputs[False], atol=2e-3, rtol=0)
        # Varlen: the longest sequence's keys decide.
        cu_q = torch.tensor([0, 17, 37], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 1, seq_k + 1], dtype=torch.int32, device=DEVICE)
        keys = torch.cat([k[0], k[1, :1]]), torch.cat([v[0], v[1, :1]])
        launched.clear()
        fk.flash_attn_varlen_func(q[0], *keys, cu_q, cu_k, 20, seq_k, causal=True)
        assert launched == [expected]


def test_heavy_first_groups_of_equal_size(fk):
    """``_pairs_per_group``: the fewest groups within the limit (16 MB of partner tiles, at most 16 pairs), of equal
    size but for a smaller last one, only where the entry asks for heavy-first and the mask is causal."""
    pairs_per_group = fk._kernels.flash_attn._pairs_per_group
    tile, causal, two_mib = {"heavy_first": True}, (-1, 0), 2 << 20  # a limit of 8 pairs
    assert [pairs_per_group(tile, causal, two_mib, n) for n in (1, 3, 8, 11, 16, 17, 64)] == [1, 3, 8, 6, 8, 6, 8]
    assert pairs_per_group(tile, causal, 1, 40) == 14  # at most 16 pairs a group: 14 + 14 + 12
    assert pairs_per_group(tile, causal, two_mib, 0) == 1
    assert pairs_per_group(tile, (-1, 5), two_mib, 11) == 0
    assert pairs_per_group({}, causal, two_mib, 11) == 0


@pytest.mark.usefixtures("tile_form")
@pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])
def test_dropout_matches_reference_with_the_returned_mask(fk, with_sink):
    torch.manual_seed(9)
    q, k, v = make_qkv(2, 19, 23, 2, 1, 16, torch.float16)
    s_aux = torch.randn(2, device=q.device) if with_sink else None
    a = leaves(q, k, v)
    sink = s_aux.clone().requires_grad_() if with_sink else None
    out, _, keep = fk.flash_attn_func(*a, dropout_p=0.3, causal=True, return_attn_probs=True, s_aux=sink)
    assert keep.shape == (2, 2, 19, 23) and keep.dtype == torch.bool
    kept = keep.float().mean().item()
    assert abs(kept - 0.7) < 0.08, f"kept fraction {kept:.3f}, expected about 0.7"
    dout = torch.randn_like(out)
    out.backward(dout)
    results = {}
    for upcast in (True, False):
        r = reference_leaves(upcast, q, k, v)
        ref_sink = s_aux.clone().requires_grad_() if with_sink else None
        ref = reference(*r, causal=True, keep=keep, dropout_p=0.3, upcast=upcast, s_aux=ref_sink)
        ref.backward(dout.to(ref.dtype))
        results[upcast] = [ref.detach()] + [t.grad for t in r] + ([ref_sink.grad] if with_sink else [])
    ours = [out.detach()] + [t.grad for t in a] + ([sink.grad] if with_sink else [])
    for index, (name, value) in enumerate(zip(("out", "dq", "dk", "dv", "ds_aux"), ours)):
        check_rule(name, value, results[False][index], results[True][index], 2 if index == 0 else 3)


def test_backward_is_bitwise_deterministic(fk):
    torch.manual_seed(10)
    q, k, v = make_qkv(2, 45, 45, 4, 2, 32, torch.float16)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(3):
        a = leaves(q, k, v)
        fk.flash_attn_func(*a, causal=True, deterministic=True).backward(dout)
        runs.append([t.grad for t in a])
    for run in runs[1:]:
        for first, again in zip(runs[0], run):
            assert torch.equal(first, again)


def test_inputs_are_not_modified(fk):
    q, k, v = make_qkv(1, 9, 9, 2, 2, 16, torch.float16)
    copies = [t.clone() for t in (q, k, v)]
    a = leaves(q, k, v)
    fk.flash_attn_func(*a, causal=True).backward(torch.ones_like(q))
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)


@pytest.mark.skipif(not ON_GPU, reason="counts the CUDA kernels of a call")
# Pointer loads and the dQ pass; tensor descriptors (from 10^11 FLOPs) and the backward through dS.
@pytest.mark.parametrize("shape", [(2, 300, 300, 4, 2, 64), (1, 8192, 8192, 8, 8, 128)], ids=["pointers", "desc-ds"])
def test_eager_forward_backward_launches_only_attention_kernels(fk, shape):
    """Nothing but our kernels: no fill of the unread seed, no zero gradients materialised for lse and the seed, no
    copy of a returned gradient into the leaves (each costs a launch, tens of microseconds on the H200's host)."""
    a = leaves(*make_qkv(*shape, torch.bfloat16))
    dout = torch.randn_like(a[0])
    fk.flash_attn_func(*a, causal=True).backward(dout)  # compiles the kernels outside the profiled call
    for t in a:
        t.grad = None
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fk.flash_attn_func(*a, causal=True).backward(dout)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert "_fwd_kernel" in names and "_bwd_dkdv_kernel" in names, names
    assert [n for n in names if "at::" in n or n.startswith(("Memset", "Memcpy"))] == [], names


def test_backward_without_a_gradient_for_the_output(fk):
    """A consumer whose backward gives out no gradient: zero gradients for q, k and v, not an error."""
    a = leaves(*make_qkv(1, 9, 9, 2, 2, 16, torch.float16))
    other = torch.ones((), device=DEVICE, requires_grad=True)
    (GivesNoGradient.apply(fk.flash_attn_func(*a, causal=True)) * other).backward()
    assert all(t.grad is None or not t.grad.any() for t in a)
    assert other.grad is not None


@pytest.mark.parametrize("change, error, message", [
    (lambda q, k, v: (q.float(), k.float(), v.float()), TypeError, "q must have dtype float16, bfloat16"),
    (lambda q, k, v: (q, k.half() if q.dtype == torch.bfloat16 else k.bfloat16(), v), TypeError, "share a dtype"),
    (lambda q, k, v: (q[0], k[0], v[0]), ValueError, "4-dimensional"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "q's head_dim 16"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), ValueError, "head_dim must be between 1 and 256, got 0"),
    (lambda q, k, v: [t.repeat(1, 1, 1, 17)[..., :257] for t in (q, k, v)], ValueError,
     "head_dim must be between 1 and 256, got 257"),
    (lambda q, k, v: (q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1)), ValueError,
     "multiple of the k/v heads"),
    (lambda q, k, v: (q, k[:, :5], v), ValueError, "k and v must have the same shape"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch size"),
])
def test_bad_inputs_raise_clear_errors(fk, change, error, message):
    q, k, v = make_qkv(2, 8, 8, 4, 2, 16, torch.float16)
    with pytest.raises(error, match=message):
        fk.flash_attn_func(*change(q, k, v))


def test_bad_options_raise_clear_errors(fk):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float16)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        fk.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="dropout_p"):
        fk.flash_attn_func(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="softcap"):
        fk.flash_attn_func(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="window_size"):
        fk.flash_attn_func(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match=r"window_size\[1\] must be an int, got 0.5"):
        fk.flash_attn_func(q, k, v, window_size=(-1, 0.5))
    for name in ("softmax_scale", "dropout_p", "softcap"):
        with pytest.raises(ValueError, match=f"{name} must be a number, got 'x'"):
            fk.flash_attn_func(q, k, v, **{name: "x"})
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
            fk.flash_attn_func(q, k, v, softmax_scale=scale)
    with pytest.raises(ValueError, match="s_aux"):
        fk.flash_attn_func(q, k, v, s_aux=torch.zeros(3, device=DEVICE))
    cu = torch.tensor([0, 8], device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32"):
        fk.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu.int(), 8, 8)
    # A 0-d tensor max_seqlen (as transformers passes) is checked as an int is: a negative one gave all-zero rows.
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= 0, got -1"):
        fk.flash_attn_varlen_func(q[0], k[0], v[0], cu.int(), cu.int(), torch.tensor(-1), 8)
    for bad in (8.0, True, "8"):
        with pytest.raises(ValueError, match="max_seqlen_q must be an int >= 0"):
            fk.flash_attn_varlen_func(q[0], k[0], v[0], cu.int(), cu.int(), bad, 8)
    # A bool tensor was read as the length 1 (rows past the first left at 0, silently).
    with pytest.raises(ValueError, match=r"max_seqlen_k must be an int or a 0-d integer tensor, got torch.bool"):
        fk.flash_attn_varlen_func(q[0], k[0], v[0], cu.int(), cu.int(), 8, torch.tensor(True, device=DEVICE))
    # Offsets as a list: an AttributeError from the device check before.
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32 tensor of batch \\+ 1 offsets, got list"):
        fk.flash_attn_varlen_func(q[0], k[0], v[0], [0, 8], cu.int(), 8, 8)
    with pytest.raises(NotImplementedError, match="block_table"):
        fk.flash_attn_varlen_func(q[0], k[0], v[0], cu.int(), cu.int(), 8, 8, block_table=cu)
    # The kernels read the offsets and the sinks as plain arrays: strided ones (here [0, 8] out of [0, 99, 8, 99],
    # heads of a (heads, 2) tensor) gave wrong rows and logits, silently.
    strided_cu = torch.tensor([0, 99, 8, 99], dtype=torch.int32, device=DEVICE)[::2]
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous"):
        fk.flash_attn_varlen_func(q[0], k[0], v[0], strided_cu, cu.int(), 8, 8)
    with pytest.raises(ValueError, match="cu_seqlens_k must be contiguous"):
        fk.flash_attn_varlen_func(q[0], k[0], v[0], cu.int(), strided_cu, 8, 8)
    with pytest.raises(ValueError, match="s_aux must be contiguous"):
        fk.flash_attn_func(q, k, v, s_aux=torch.zeros(2, 2, device=DEVICE)[:, 0])


def test_torch_cpu_variant_matches_reference(fk_cpu):
    torch.manual_seed(11)
    q, k, v = (t.cpu() for t in make_qkv(2, 11, 15, 4, 2, 16, torch.float16))
    a = leaves(q, k, v)
    sink = torch.randn(4, requires_grad=True)
    out = fk_cpu.flash_attn_func(*a, causal=True, window_size=(6, -1), softcap=4.0, s_aux=sink)
    r = leaves(q, k, v)
    r_sink = sink.detach().clone().requires_grad_()
    ref = reference(*r, causal=True, window=(6, -1), softcap=4.0, s_aux=r_sink)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout)
    for ours, want in zip([t.grad for t in a] + [sink.grad], [t.grad for t in r] + [r_sink.grad]):
        torch.testing.assert_close(ours.float(), want.float(), atol=5e-3, rtol=5e-3)


def test_torch_cpu_variant_compiles(fk_cpu):
    """The compiled backward graph calls the backward op, whose PyTorch implementation then runs below the
    autograd dispatch key (it once failed there with "does not require grad")."""
    torch._dynamo.reset()
    torch.manual_seed(12)
    q, k, v = (t.cpu() for t in make_qkv(2, 9, 9, 4, 2, 16, torch.float16))
    sink = torch.randn(4)

    def attention(q, k, v, sink):
        return fk_cpu.flash_attn_func(q, k, v, causal=True, s_aux=sink)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    eager_args, compiled_args = leaves(q, k, v, sink), leaves(q, k, v, sink)
    eager_out, compiled_out = attention(*eager_args), compiled(*compiled_args)
    dout = torch.randn_like(eager_out)
    eager_out.backward(dout)
    compiled_out.backward(dout)
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)
    for a, b in zip(eager_args, compiled_args):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


def test_torch_cpu_variant_varlen_opcheck(fk_cpu):
    """The torch-cpu variant's varlen forward returns outputs laid out as its fake kernel says: its lse (heads,
    total_q) was a transposed (total_q, heads) tensor, which torch.compile's graphs then misread (inductor's stride
    assertion failed on every compiled varlen call)."""
    torch.manual_seed(26)
    q, k, v = leaves(*(torch.randn(11, 2, 16, dtype=torch.float16) for _ in range(3)))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    torch.library.opcheck(fk_cpu._ops.ops.flash_attn_forward, (q, k, v, cu, cu, 5, 5, 0.0, 0.25, True, -1, -1, 0.0,
                                                               None))


def test_opcheck(fk):
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    q, k, v = leaves(*make_qkv(2, 64, 64, 4, 2, 64, dtype) if ON_GPU else make_qkv(1, 16, 16, 2, 1, 16, dtype))
    sink = torch.randn(q.shape[2], device=DEVICE, requires_grad=True)
    ops = fk._ops.ops
    torch.library.opcheck(ops.flash_attn_forward, (q, k, v, None, None, q.shape[1], k.shape[1], 0.0, 0.125, True,
                                                   -1, -1, 0.0, sink))


def test_ops_refuse_head_dims_the_public_functions_pad(fk):
    """The ops take multiples of 8 only (the public functions pad other head dims before calling them)."""
    q, k, v = make_qkv(1, 8, 8, 2, 2, 12, torch.float16)
    with pytest.raises(ValueError, match="ops take head dims that are multiples of 8, got 12"):
        fk._ops.ops.flash_attn_forward(q, k, v, None, None, 8, 8, 0.0, 0.25, True, -1, -1, 0.0, None)


def test_compile_fullgraph(fk):
    torch._dynamo.reset()
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    q, k, v = make_qkv(2, 128, 128, 8, 2, 64, dtype) if ON_GPU else make_qkv(1, 16, 16, 2, 1, 16, dtype)

    def attention(q, k, v):
        return fk.flash_attn_func(q, k, v, causal=True)

    compiled = torch.compile(attention, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    eager_args, compiled_args = leaves(q, k, v), leaves(q, k, v)
    eager_out, compiled_out = attention(*eager_args), compiled(*compiled_args)
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)
    dout = torch.randn_like(eager_out)
    eager_out.backward(dout)
    compiled_out.backward(dout)
    for a, b in zip(eager_args, compiled_args):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_compile_fullgraph_returns_the_dropout_mask(fk, varlen):
    """With dropout, ``return_attn_probs=True`` compiles in one graph (the keep mask is an op; its Triton launch once
    broke the graph, an error under fullgraph=True), with the eager call's output, lse and mask for the same seed."""
    torch._dynamo.reset()
    torch.manual_seed(27)
    q, k, v = make_qkv(2, 9, 11, 2, 1, 16, torch.float16)
    cu_q = torch.tensor([0, 9, 18], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 11, 22], dtype=torch.int32, device=DEVICE)

    def attention(q, k, v):
        if varlen:
            return fk.flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), cu_q, cu_k, 9, 11, dropout_p=0.3,
                                             causal=True, return_attn_probs=True)
        return fk.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)

    results = []
    for fn in (attention, torch.compile(attention, fullgraph=True, backend="aot_eager")):
        torch.manual_seed(28)  # the dropout seed
        results.append(fn(q, k, v))
    assert results[1][2].shape == (2, 2, 9, 11) and results[1][2].dtype == torch.bool
    for name, eager, compiled in zip(("out", "lse", "mask"), *results):
        assert torch.equal(eager, compiled), name


@pytest.mark.skipif(not ON_GPU, reason="realistic shapes run on the GPU")
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 8], ids=["gqa", "mha"])
def test_realistic_shapes(fk, dim, causal, kv_heads):
    """GQA and MHA both: with GQA the dK/dV pass loops over the query heads of each kv head."""
    torch.manual_seed(dim)
    q, k, v = make_qkv(2, 1000, 1000, 8, kv_heads, dim, torch.bfloat16)
    run_and_check(fk, q, k, v, causal=causal)


@pytest.mark.skipif(not ON_GPU, reason="the fence is inline PTX, which the CPU interpreter leaves out")
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=False, softcap=20.0, window_size=(300, 40)),
                                     dict(causal=True, dropout_p=0.1)], ids=["causal", "softcap-window", "dropout"])
def test_scheduling_fence_changes_no_value(fk, monkeypatch, dim, options):
    """The forward's P.V fence (``pv_fence``) only reorders instructions: output and lse are bitwise those of the
    same forward without it, through descriptors and pointer loads, whatever the launch table picks."""
    torch.manual_seed(dim)
    q, k, v = make_qkv(2, 1000, 1000, 8, 2, dim, torch.bfloat16)
    table_pick = fk._flash_attn.pick
    results = {}
    for desc in (True, False):
        for fence in (False, True):
            def pick(family, kind, device, head_dim, desc=desc, fence=fence):
                return {**table_pick(family, kind, device, head_dim), "one_loop": True, "desc": desc,
                        "desc_min_flops": 0, "pv_fence": fence, "without_desc": {}}
            monkeypatch.setattr(fk._flash_attn, "pick", pick)
            torch.manual_seed(1)  # the dropout seed
            out, lse, _ = fk.flash_attn_func(q, k, v, return_attn_probs=True, **options)
            results[desc, fence] = (out, lse)
    for desc in (True, False):
        for without, with_fence in zip(results[desc, False], results[desc, True]):
            assert torch.equal(without, with_fence), f"the fence changed a value (descriptors: {desc})"


@pytest.mark.parametrize("grid_limit, pairs_per_group", [(1, 0), (None, 3), (1, 3)],
                         ids=["flat-natural", "two-axis-heavy-first", "flat-heavy-first"])
def test_grids_and_program_orders_match_the_natural_order(fk, monkeypatch, grid_limit, pairs_per_group):
    """Bitwise the results of the (tiles, pairs) grid in the natural program order, for every pass (forward, delta,
    dK/dV, dQ and the dropout mask), dense with GQA and varlen: with the one-axis grid that more (batch, head) pairs
    than a grid axis holds switch to (forced by a limit of 1 pair) and with the tiles taken heaviest first in
    groups of 3 pairs (8 query-head pairs and 4 kv pairs dense, 12 varlen: full and partial last groups). A tile
    mapped to no program, or to two, leaves poisoned or doubly written rows and fails it."""
    torch.manual_seed(16)
    q, k, v = make_qkv(2, 21, 21, 4, 2, 16, torch.float16)
    lengths = [9, 0, 12]
    vq, vk, vv, cu, _ = _varlen_case(lengths, lengths, 4, 2, 16, torch.float16)
    dout, vdout = torch.randn_like(q), torch.randn_like(vq)
    kernels_module = fk._kernels.flash_attn

    def run_all():
        a = leaves(q, k, v)
        out, lse, keep = fk.flash_attn_func(*a, dropout_p=0.2, causal=True, return_attn_probs=True)
        out.backward(dout)
        va = leaves(vq, vk, vv)
        vout, vlse, _ = fk.flash_attn_varlen_func(*va, cu, cu, max(lengths), max(lengths), causal=True,
                                                  return_attn_probs=True)
        vout.backward(vdout)
        return [out, lse, keep, *[t.grad for t in a], vout, vlse, *[t.grad for t in va]]

    monkeypatch.setattr(kernels_module, "_pairs_per_group", lambda tile, window, partner_bytes, n_pairs: 0)
    torch.manual_seed(17)
    natural = run_all()
    monkeypatch.setattr(kernels_module, "_pairs_per_group",
                        lambda tile, window, partner_bytes, n_pairs: pairs_per_group)
    if grid_limit is not None:
        monkeypatch.setattr(kernels_module, "_GRID_AXIS_LIMIT", grid_limit)
    torch.manual_seed(17)
    other = run_all()
    for index, (expected, got) in enumerate(zip(natural, other)):
        assert torch.equal(expected, got), f"result {index} differs from the natural order on the two-axis grid"


@pytest.mark.usefixtures("tile_form")
def test_window_with_edges_on_both_sides_of_whole_tiles(fk, poisoned_empty):
    """A causal sliding window with soft-capping over enough tiles for masked edges on both sides of unmasked
    middle tiles, with GQA, in both forms of the tile loop."""
    torch.manual_seed(18)
    seq, left = (700, 300) if ON_GPU else (70, 40)
    q, k, v = make_qkv(2, seq, seq, 4, 2, 32, torch.float16)
    run_and_check(fk, q, k, v, causal=True, window=(left, 0), softcap=5.0)


@pytest.mark.parametrize("variant", ["fk", "fk_cpu"])
@pytest.mark.parametrize("window", [(2**31 - 1, 2**31 - 1), (-1, 2**31 - 8), (2**40, 0), (sys.maxsize, sys.maxsize)])
def test_windows_longer_than_any_sequence_are_unlimited(request, variant, window):
    """A window bound past every sequence is unlimited, as -1 is (FlashAttention-2's rule: keys within
    [i + s_k - s_q - left, i + s_k - s_q + right]). Bounds near 2**31 overflowed the kernels' int32 sums and hid every
    key (zero outputs and gradients); sys.maxsize overflowed the torch-cpu variant's int64 ones."""
    fk = request.getfixturevalue(variant)
    torch.manual_seed(19)
    q, k, v = make_qkv(1, 9, 7, 2, 1, 32, torch.float16)
    dout = torch.randn_like(q)
    results = []
    for window_size in (window, tuple(-1 if bound > 0 else bound for bound in window)):
        inputs = leaves(q, k, v)
        out = fk.flash_attn_func(*inputs, window_size=window_size)
        out.backward(dout)
        results.append([out, *(t.grad for t in inputs)])
    assert results[0][0].abs().sum() > 0
    for name, got, unlimited in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(got, unlimited), f"{name} with window_size={window} differs from the unlimited window's"


@pytest.mark.parametrize("variant", ["fk", "fk_cpu"])
@pytest.mark.parametrize("options", [{"causal": True}, {"window_size": (0, 0)}], ids=["causal", "window00"])
def test_sink_switched_off_with_rows_that_see_nothing(request, variant, options):
    """A sink of -inf (how a head's sink is switched off) where some rows see no key (s_q > s_k causal: rows 0-1; a
    (0, 0) window with s_q > s_k: row 0): that head behaves as without a sink, and its sink gets a zero gradient. The
    torch-cpu variant's gradient was NaN: those rows' lse is -inf, and exp(-inf - -inf) reached the backward."""
    fk = request.getfixturevalue(variant)
    device = DEVICE if variant == "fk" else "cpu"
    torch.manual_seed(21)
    q, k, v = (t.to(device) for t in make_qkv(1, 6, 4, 2, 2, 16, torch.float16))
    dout = torch.randn_like(q)
    sink = torch.tensor([float("-inf"), 0.5], device=device, requires_grad=True)
    x = leaves(q, k, v)
    out = fk.flash_attn_func(*x, s_aux=sink, **options)
    out.backward(dout)
    plain = leaves(q, k, v)
    fk.flash_attn_func(*plain, **options)[:, :, 0].backward(dout[:, :, 0])
    assert torch.equal(sink.grad[0], torch.zeros((), device=device)), sink.grad
    assert torch.isfinite(sink.grad[1]) and sink.grad[1] != 0
    assert torch.equal(out[:, :, 0], fk.flash_attn_func(q, k, v, **options)[:, :, 0])
    for name, with_sink, without in zip(("dq", "dk", "dv"), x, plain):
        torch.testing.assert_close(with_sink.grad[:, :, 0], without.grad[:, :, 0], msg=name)


@pytest.mark.parametrize("variant", ["fk", "fk_cpu"])
def test_double_backward_is_refused(request, variant):
    """The gradients have no autograd graph of their own (the kernels record nothing; the PyTorch implementation takes
    detached inputs): a first backward with create_graph=True gives the right gradients, a backward through them
    raises. A gradient penalty through attention once silently lost every attention term (kernels: dq without a
    graph, the penalty's gradient 2q) or got them wrong (torch-cpu)."""
    fk = request.getfixturevalue(variant)
    device = DEVICE if variant == "fk" else "cpu"
    torch.manual_seed(20)
    q, k, v = (t.to(device) for t in make_qkv(1, 6, 5, 2, 1, 16, torch.float16))
    x = leaves(q, k, v)
    dq, dk, dv = torch.autograd.grad(fk.flash_attn_func(*x, causal=True).pow(2).sum(), x, create_graph=True)
    x64 = leaves(*(t.double() for t in (q, k, v)))
    expected = torch.autograd.grad(reference(*x64, causal=True, upcast=False).pow(2).sum(), x64)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2, msg=f"{name} of the first backward")
    with pytest.raises(RuntimeError, match="flash_attn: double backward is not supported"):
        (dq.float().pow(2).sum() + dk.float().sum()).backward()


@pytest.mark.skipif(not ON_GPU, reason="65,600 heads of programs are too many for the CPU interpreter")
@pytest.mark.usefixtures("tile_form")
def test_more_batch_heads_than_a_grid_axis_holds(fk):
    """batch * heads above 65535, the cap of CUDA's second and third grid axes (a packed batch of thousands of
    short sequences): every pass then launches one program per (tile, batch, head) on the first axis, in every tile
    form (the backward through dS's delta launch once kept a 2-D grid, which CUDA refused). Dense and varlen (the
    same sequences packed) against the references."""
    torch.manual_seed(13)
    batch, seq, heads = 8200, 3, 8
    assert batch * heads > 65535
    q, k, v = make_qkv(batch, seq, seq, heads, heads, 64, torch.bfloat16)
    run_and_check(fk, q, k, v, causal=True)
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=DEVICE)
    packed = [t.reshape(batch * seq, heads, 64) for t in (q, k, v)]
    out = fk.flash_attn_varlen_func(*packed, cu, cu, seq, seq, causal=True)
    torch.testing.assert_close(out.view(batch, seq, heads, 64), fk.flash_attn_func(q, k, v, causal=True),
                               atol=0, rtol=0)


@pytest.mark.skipif(not ON_GPU, reason="needs ~10 GB of GPU memory")
def test_offsets_beyond_int32(fk, large_gpu_memory):
    """q with more than 2**31 elements: the last sequence's offsets only fit in int64."""
    seq = 2**31 // (16 * 128) + 64
    q = torch.randn(1, seq, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 64, 1, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 64, 1, 128, device="cuda", dtype=torch.bfloat16)
    out = fk.flash_attn_func(q, k, v)
    tail = slice(seq - 5, seq)
    want = reference(q[:, tail], k, v)
    torch.testing.assert_close(out[:, tail], want, atol=2e-2, rtol=2e-2)
    assert math.isfinite(out[:, -1].float().abs().max().item())
