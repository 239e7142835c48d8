"""RoPE: numerics of both conventions, layouts, partial rotary, the position-id cache (varlen), in place,
gradients, errors, compile and the torch-cpu variant.

The same tests run on the CPU (Triton interpreter, small shapes) and compiled on a GPU (realistic shapes).
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE, ON_GPU
from numerics import assert_close_ratio, rel_err

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CONVENTIONS = {"half_split": False, "interleaved": True}

# (batch, seq, q_heads, k_heads, head_dim, rotary_dim): GQA, MQA, odd sizes, partial rotary.
if ON_GPU:
    SHAPES = [(4, 4096, 32, 8, 128, 128), (2, 1001, 28, 4, 128, 64), (3, 333, 12, 1, 80, 80),
              (1, 2047, 14, 2, 72, 48), (2, 517, 16, 16, 96, 96)]
else:
    SHAPES = [(2, 7, 4, 2, 16, 16), (1, 9, 3, 1, 24, 16), (3, 5, 6, 6, 10, 6), (1, 3, 5, 1, 80, 80),
              (2, 3, 3, 2, 96, 64), (1, 2, 2, 2, 72, 24)]


# ----------------------------------------------------------------------------------------------------------
# References, written independently of the kernels.
# ----------------------------------------------------------------------------------------------------------

def angle_tables(batch, seq, rotary_dim, interleaved, dtype, device=DEVICE, positions=None):
    """cos/sin as transformers' rotary modules build them: (batch, seq, rotary_dim), each angle stored twice,
    in the column layout of the convention (``cat(f, f)`` or ``repeat_interleave(f, 2)``)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float64) / rotary_dim))
    if positions is None:
        positions = torch.arange(seq, device=device, dtype=torch.float64).expand(batch, seq)
    freqs = positions.double()[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat([freqs, freqs], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def reference_float64(x, cos, sin, heads_dim, interleaved):
    """Each rotated pair as the complex number x1 + i x2, multiplied by cos + i sin, in float64."""
    x = x.double()
    xl = x if heads_dim == 2 else x.transpose(1, 2)  # (batch, seq, heads, head_dim)
    rotary_dim = cos.shape[-1]
    rot = xl[..., :rotary_dim]
    if interleaved:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2])
        w = torch.complex(cos.double()[..., 0::2], sin.double()[..., 0::2])
    else:
        z = torch.complex(rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:])
        w = torch.complex(cos.double()[..., : rotary_dim // 2], sin.double()[..., : rotary_dim // 2])
    z = z * w[:, :, None, :]
    if interleaved:
        rotated = torch.stack([z.real, z.imag], -1).flatten(-2)
    else:
        rotated = torch.cat([z.real, z.imag], -1)
    out = torch.cat([rotated, xl[..., rotary_dim:]], -1)
    return out if heads_dim == 2 else out.transpose(1, 2)


def reference_module(x, cos, sin, heads_dim, interleaved):
    """transformers' apply_rotary_pos_emb math in the input dtype (the error baseline)."""
    cos, sin = cos.to(x.dtype).unsqueeze(heads_dim), sin.to(x.dtype).unsqueeze(heads_dim)
    rotary_dim = cos.shape[-1]
    xr, tail = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        turned = torch.stack([-xr[..., 1::2], xr[..., 0::2]], -1).flatten(-2)
    else:
        turned = torch.cat([-xr[..., rotary_dim // 2:], xr[..., : rotary_dim // 2]], -1)
    return torch.cat([xr * cos + turned * sin, tail], -1)


def make_qk(batch, seq, q_heads, k_heads, head_dim, dtype, heads_dim=1, transposed=True, device=DEVICE):
    """q and k in the given layout; ``transposed``: a transposed view of the other layout's memory, as
    transformers' ``view(...).transpose(1, 2)`` produces."""
    def one(heads):
        if heads_dim == 1:
            shape = (batch, seq, heads, head_dim) if transposed else (batch, heads, seq, head_dim)
        else:
            shape = (batch, heads, seq, head_dim) if transposed else (batch, seq, heads, head_dim)
        t = torch.randn(shape, device=device, dtype=dtype)
        return t.transpose(1, 2) if transposed else t
    return one(q_heads), one(k_heads)


def leaf(t):
    """``t`` as a leaf that requires grad, with its strides (``clone`` would make a row slice contiguous)."""
    return t.detach().requires_grad_(True)


def check_against_references(fk, q, k, cos, sin, heads_dim, interleaved, position_ids=None, cos_cache=None,
                             sin_cache=None, inplace=False):
    """Forward and backward of one call against float64 and the dtype baseline; inputs must stay unchanged.
    cos/sin are the per-position tables the reference uses; with ``position_ids`` the op gets the caches."""
    dtype = q.dtype
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    before = [t.clone() for t in (q, k, cos, sin, dq, dk)]

    qa, ka = leaf(q), leaf(k)
    if inplace:
        # Autograd through the in-place form needs non-leaf inputs: rotate views of an identity.
        q_in, k_in = qa * 1, ka * 1
    else:
        q_in, k_in = qa, ka
    if position_ids is None:
        q_out, k_out = fk.apply_rotary_pos_emb(q_in, k_in, cos, sin, heads_dim, interleaved=interleaved,
                                               inplace=inplace)
    else:
        q_out, k_out = fk.apply_rotary_pos_emb_cached(q_in, k_in, cos_cache, sin_cache, position_ids,
                                                      heads_dim=heads_dim, interleaved=interleaved, inplace=inplace)
    if inplace:
        assert q_out is q_in and k_out is k_in
    assert q_out.shape == q.shape and q_out.dtype == dtype and k_out.shape == k.shape
    torch.autograd.backward([q_out, k_out], [dq, dk])
    for b, a in zip(before, (q, k, cos, sin, dq, dk)):
        assert torch.equal(b, a), "an input or incoming gradient was modified"

    for x, out, grad_out, grad_in in ((q, q_out, dq, qa.grad), (k, k_out, dk, ka.grad)):
        x64 = leaf(x.double())
        ref = reference_float64(x64, cos, sin, heads_dim, interleaved)
        ref.backward(grad_out.double())
        xb = leaf(x)
        base = reference_module(xb, cos, sin, heads_dim, interleaved)
        base.backward(grad_out)
        assert_close_ratio("y", out, base, ref, 2.0, dtype)
        assert_close_ratio("dx", grad_in, xb.grad, x64.grad, 2.0, dtype)
        # The partial-rotary tail passes through bit for bit, and so does its gradient.
        rotary_dim = cos.shape[-1]
        assert torch.equal(out.detach()[..., rotary_dim:], x[..., rotary_dim:])
        assert torch.equal(grad_in[..., rotary_dim:], grad_out[..., rotary_dim:])
    return q_out, k_out


# ----------------------------------------------------------------------------------------------------------
# Gathered cos/sin (transformers' apply_rotary_pos_emb).
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_matches_references(fk, poisoned_empty, shape, dtype, convention):
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = shape
    interleaved = CONVENTIONS[convention]
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, dtype)
    cos, sin = angle_tables(1, seq, rotary_dim, interleaved, dtype)
    check_against_references(fk, q, k, cos, sin, 1, interleaved)


@pytest.mark.parametrize("heads_dim", [1, 2])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed_view"])
@pytest.mark.parametrize("cos_batch", ["1", "B"])
def test_layouts(fk, poisoned_empty, heads_dim, transposed, cos_batch):
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = SHAPES[1]
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, torch.bfloat16, heads_dim, transposed)
    # Per-batch tables: different positions per sequence (left padding shifts them).
    positions = torch.arange(seq, device=DEVICE) + torch.arange(batch, device=DEVICE)[:, None] * 3
    cos, sin = angle_tables(batch, seq, rotary_dim, False, torch.bfloat16, positions=positions)
    if cos_batch == "1":
        cos, sin = cos[:1], sin[:1]
    q_out, _ = check_against_references(fk, q, k, cos, sin, heads_dim, False)
    assert q_out.stride() == torch.empty_like(q).stride(), "the output keeps the input's memory layout"


@pytest.mark.parametrize("heads_dim", [1, 2])
def test_gradients_take_the_layout_of_q_and_k(fk, heads_dim):
    """Incoming gradients in another layout than q and k (contiguous, while q and k are transposed views): the
    gradients come back in q's and k's own layout, so autograd need not copy them into a leaf's layout, nor a
    view's backward into its base's; the values are the reference's."""
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = SHAPES[1]
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, torch.float32, heads_dim, transposed=True)
    cos, sin = angle_tables(batch, seq, rotary_dim, False, torch.float32)
    qa, ka = leaf(q), leaf(k)
    q_out, k_out = fk.apply_rotary_pos_emb(qa, ka, cos, sin, heads_dim)
    dq, dk = torch.randn(q_out.shape, device=DEVICE), torch.randn(k_out.shape, device=DEVICE)
    assert dq.stride() != q.stride()
    grad_q, grad_k = torch.autograd.grad((q_out, k_out), (qa, ka), (dq, dk))
    for x, grad, grad_out in ((q, grad_q, dq), (k, grad_k, dk)):
        assert grad.stride() == x.stride()
        x64 = leaf(x.double())
        reference_float64(x64, cos, sin, heads_dim, False).backward(grad_out.double())
        torch.testing.assert_close(grad.double(), x64.grad, rtol=1e-5, atol=1e-5)


def test_strided_views_of_a_fused_projection(fk, poisoned_empty):
    """q and k as slices of one (batch, seq, (hq + hk) * head_dim) projection, and cos/sin sliced from
    wider tables: nothing is contiguous and nothing is copied."""
    batch, seq, q_heads, k_heads, head_dim = 2, 6, 4, 2, 16
    qk = torch.randn(batch, seq, (q_heads + k_heads) * head_dim, device=DEVICE)
    q = qk[..., : q_heads * head_dim].view(batch, seq, q_heads, head_dim).transpose(1, 2)
    k = qk[..., q_heads * head_dim:].view(batch, seq, k_heads, head_dim).transpose(1, 2)
    cos, sin = angle_tables(1, 2 * seq, head_dim, True, torch.float32)
    check_against_references(fk, q, k, cos[:, ::2], sin[:, ::2], 1, True)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_fp32_tables_with_half_inputs(fk, convention):
    interleaved = CONVENTIONS[convention]
    q, k = make_qk(2, 5, 3, 1, 32, torch.bfloat16)
    cos, sin = angle_tables(2, 5, 32, interleaved, torch.float32)
    check_against_references(fk, q, k, cos, sin, 1, interleaved)


@settings(max_examples=10 if not ON_GPU else 40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3), seq=st.integers(1, 9 if not ON_GPU else 700),
    q_heads=st.integers(1, 6), k_heads=st.integers(1, 6), half_head_dim=st.integers(1, 20 if not ON_GPU else 80),
    rotary_fraction=st.sampled_from([1.0, 0.5, 0.25]), dtype=st.sampled_from(DTYPES),
    interleaved=st.booleans(), heads_dim=st.sampled_from([1, 2]), transposed=st.booleans(),
    cos_batch_one=st.booleans(),
)
def test_property_random_shapes(fk, batch, seq, q_heads, k_heads, half_head_dim, rotary_fraction, dtype,
                                interleaved, heads_dim, transposed, cos_batch_one):
    torch.manual_seed(batch * 1009 + seq * 101 + half_head_dim)
    head_dim = 2 * half_head_dim
    rotary_dim = max(2, 2 * int(half_head_dim * rotary_fraction))
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, dtype, heads_dim, transposed)
    cos, sin = angle_tables(1 if cos_batch_one else batch, seq, rotary_dim, interleaved, dtype)
    check_against_references(fk, q, k, cos, sin, heads_dim, interleaved)


# ----------------------------------------------------------------------------------------------------------
# Position ids and a cos/sin cache; packed (varlen) sequences.
# ----------------------------------------------------------------------------------------------------------

def cache_tables(max_positions, rotary_dim, interleaved, dtype):
    positions = torch.arange(max_positions, device=DEVICE)[None]
    cos, sin = angle_tables(1, max_positions, rotary_dim, interleaved, dtype, positions=positions)
    return cos[0], sin[0]


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("position_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("heads_dim", [1, 2])
def test_cached_positions(fk, poisoned_empty, convention, position_dtype, heads_dim):
    interleaved = CONVENTIONS[convention]
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = SHAPES[1]
    cos_cache, sin_cache = cache_tables(4 * seq + 7, rotary_dim, interleaved, torch.bfloat16)
    position_ids = torch.randint(0, cos_cache.shape[0], (batch, seq), device=DEVICE, dtype=position_dtype)
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, torch.bfloat16, heads_dim)
    check_against_references(fk, q, k, cos_cache[position_ids.long()], sin_cache[position_ids.long()], heads_dim,
                             interleaved, position_ids, cos_cache, sin_cache)


@pytest.mark.parametrize("cached", [False, True])
def test_cos_and_sin_with_different_strides(fk, poisoned_empty, cached):
    """cos and sin need not share a memory layout (here sin is a column-major copy): each is read through its own
    strides, never through the other's."""
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = SHAPES[1]
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, torch.float32)
    if cached:
        cos_cache, sin_cache = cache_tables(2 * seq + 3, rotary_dim, False, torch.float32)
        sin_cache = sin_cache.t().contiguous().t()
        position_ids = torch.randint(0, cos_cache.shape[0], (batch, seq), device=DEVICE)
        check_against_references(fk, q, k, cos_cache[position_ids], sin_cache[position_ids], 1, False, position_ids,
                                 cos_cache, sin_cache)
    else:
        positions = torch.arange(seq, device=DEVICE) + torch.arange(batch, device=DEVICE)[:, None]
        cos, sin = angle_tables(batch, seq, rotary_dim, False, torch.float32, positions=positions)
        sin = sin.transpose(1, 2).contiguous().transpose(1, 2)
        assert sin.stride() != cos.stride()
        check_against_references(fk, q, k, cos, sin, 1, False)


def test_cached_positions_shared_over_the_batch(fk):
    batch, seq = 3, 6
    cos_cache, sin_cache = cache_tables(20, 16, False, torch.float32)
    position_ids = torch.arange(5, 5 + seq, device=DEVICE)[None]
    q, k = make_qk(batch, seq, 2, 1, 16, torch.float32)
    check_against_references(fk, q, k, cos_cache[position_ids], sin_cache[position_ids], 1, False, position_ids,
                             cos_cache, sin_cache)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_packed_varlen_sequences(fk, poisoned_empty, convention):
    """Three sequences packed into one (tokens, heads, head_dim) tensor, positions restarting at each: the same
    result as rotating each sequence on its own."""
    interleaved = CONVENTIONS[convention]
    lengths = (5, 1, 7) if not ON_GPU else (1000, 3, 2500)
    position_ids = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])
    cos_cache, sin_cache = cache_tables(max(lengths), 24, interleaved, torch.float16)
    tokens = sum(lengths)
    q = torch.randn(tokens, 4, 32, device=DEVICE, dtype=torch.float16)
    k = torch.randn(tokens, 2, 32, device=DEVICE, dtype=torch.float16)
    q_out, k_out = fk.apply_rotary_pos_emb_cached(q, k, cos_cache, sin_cache, position_ids, interleaved=interleaved)
    # As a batch of one sequence of all tokens against the per-position reference.
    cos, sin = cos_cache[position_ids][None], sin_cache[position_ids][None]
    for x, out in ((q, q_out), (k, k_out)):
        ref = reference_float64(x[None], cos, sin, 2, interleaved)[0]
        assert_close_ratio("packed", out, reference_module(x[None], cos, sin, 2, interleaved)[0], ref, 2.0,
                           torch.float16)
    # Each sequence separately through the gathered-table entry point gives identical values.
    start = 0
    for n in lengths:
        piece = slice(start, start + n)
        expected = fk.apply_rotary_pos_emb(q[None, piece], k[None, piece], cos_cache[None, :n], sin_cache[None, :n],
                                           2, interleaved=interleaved)
        assert torch.equal(q_out[piece], expected[0][0]) and torch.equal(k_out[piece], expected[1][0])
        start += n


@pytest.mark.parametrize("variant", ["kernels", "torch-cpu"])
@pytest.mark.parametrize("cache_size", [8, 0])
def test_position_outside_the_cache_gives_nan_rows(fk, fk_cpu, variant, cache_size):
    """Also with an empty cache, where every position is outside (the torch-cpu variant raised an IndexError)."""
    module = fk if variant == "kernels" else fk_cpu
    cos_cache, sin_cache = cache_tables(8, 16, False, torch.float32)
    cos_cache, sin_cache = cos_cache[:cache_size], sin_cache[:cache_size]
    position_ids = torch.tensor([[0, 3, 8, -1, 7]], device=DEVICE)
    q, k = make_qk(1, 5, 2, 1, 16, torch.float32)
    q_out, k_out = module.apply_rotary_pos_emb_cached(q, k, cos_cache, sin_cache, position_ids)
    bad = torch.tensor([False, False, True, True, False], device=DEVICE) | (cache_size == 0)
    for out in (q_out, k_out):
        assert out[:, :, bad].isnan().all() and out[:, :, ~bad].isfinite().all()


# ----------------------------------------------------------------------------------------------------------
# In place.
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("cached", [False, True])
def test_inplace_matches_out_of_place(fk, convention, cached):
    interleaved = CONVENTIONS[convention]
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = SHAPES[2]
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, torch.bfloat16)
    cos_cache, sin_cache = cache_tables(seq + 3, rotary_dim, interleaved, torch.bfloat16)
    position_ids = torch.randint(0, seq + 3, (batch, seq), device=DEVICE)
    cos, sin = cos_cache[position_ids], sin_cache[position_ids]
    expected = fk.apply_rotary_pos_emb(q, k, cos, sin, interleaved=interleaved)
    q2, k2 = q.clone(), k.clone()
    if cached:
        out = fk.apply_rotary_pos_emb_cached(q2, k2, cos_cache, sin_cache, position_ids, interleaved=interleaved,
                                             inplace=True)
    else:
        out = fk.apply_rotary_pos_emb(q2, k2, cos, sin, interleaved=interleaved, inplace=True)
    assert out[0] is q2 and out[1] is k2
    assert torch.equal(q2, expected[0]) and torch.equal(k2, expected[1])


def test_inplace_leaves_the_tail_and_neighbours_alone(fk):
    """In place writes exactly the rotary columns of q and k: not the tail, not the rest of a shared buffer."""
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = 2, 5, 3, 1, 24, 8
    qkv = torch.randn(batch, seq, (q_heads + 2 * k_heads) * head_dim, device=DEVICE)
    before = qkv.clone()
    q = qkv[..., : q_heads * head_dim].view(batch, seq, q_heads, head_dim)
    k = qkv[..., q_heads * head_dim: (q_heads + k_heads) * head_dim].view(batch, seq, k_heads, head_dim)
    cos, sin = angle_tables(1, seq, rotary_dim, False, torch.float32)
    expected = fk.apply_rotary_pos_emb(q, k, cos, sin, 2)
    fk.apply_rotary_pos_emb(q, k, cos, sin, 2, inplace=True)
    changed = (qkv != before).view(batch, seq, -1, head_dim)
    assert not changed[..., rotary_dim:].any() and not changed[:, :, q_heads + k_heads:].any()
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_inplace_gradients(fk, convention):
    interleaved = CONVENTIONS[convention]
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = SHAPES[1]
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, torch.float32)
    cos, sin = angle_tables(1, seq, rotary_dim, interleaved, torch.float32)
    check_against_references(fk, q, k, cos, sin, 1, interleaved, inplace=True)


def test_inplace_refuses_elements_that_share_memory(fk):
    """In place, an element that shares memory with another would be rotated twice: expanded q or k, k the same
    memory as q, and two gapless tensors that overlap are refused before anything is written; out of place the
    same inputs are fine."""
    batch, seq, heads, head_dim = 2, 3, 2, 8
    q, k = make_qk(batch, seq, heads, heads, head_dim, torch.float32, transposed=False)
    cos, sin = angle_tables(1, seq, head_dim, False, torch.float32)
    flat = torch.randn(q.numel() + head_dim, device=DEVICE)
    overlapping = flat[:q.numel()].view(q.shape), flat[head_dim:].view(q.shape)
    cases = [((q[:1].expand_as(q), k), "q is written in place, but elements of it share memory"),
             ((q, k[:, :1].expand_as(k)), "k is written in place, but elements of it share memory"),
             ((q, q), "q and k are written in place but share memory"),
             (overlapping, "q and k are written in place but share memory")]
    for (q_in, k_in), message in cases:
        q_before, k_before = q_in.clone(), k_in.clone()
        with pytest.raises(ValueError, match=message):
            fk.apply_rotary_pos_emb(q_in, k_in, cos, sin, inplace=True)
        assert torch.equal(q_in, q_before) and torch.equal(k_in, k_before)
        q_out, k_out = fk.apply_rotary_pos_emb(q_in, k_in, cos, sin)
        expected_q, expected_k = fk.apply_rotary_pos_emb(q_before, k_before, cos, sin)
        assert torch.equal(q_out, expected_q) and torch.equal(k_out, expected_k)


@pytest.mark.parametrize("variant", ["kernels", "torch-cpu"])
def test_inplace_on_inference_tensors_outside_inference_mode_is_refused(fk, fk_cpu, variant):
    """As torch refuses ``t.mul_(2)`` on them, before anything is written (before the fix, q and k were rotated
    and autograd refused afterwards; the torch-cpu variant left q rotated and k not)."""
    module = fk if variant == "kernels" else fk_cpu
    with torch.inference_mode():
        q, k = make_qk(1, 3, 2, 1, 8, torch.float32)
    q_before, k_before = q.clone(), k.clone()
    cos, sin = angle_tables(1, 3, 8, False, torch.float32)
    with pytest.raises(RuntimeError, match="q is an inference tensor"):
        module.apply_rotary_pos_emb(q, k, cos, sin, inplace=True)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    expected = module.apply_rotary_pos_emb(q, k, cos, sin)  # out of place they are fine, and in inference mode
    with torch.inference_mode():
        module.apply_rotary_pos_emb(q, k, cos, sin, inplace=True)
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


@pytest.mark.parametrize("inplace", [False, True])
def test_meta_tensors(fk, inplace):
    """Shapes only: in place was refused as "q and k share memory" (every meta tensor's data pointer is 0)."""
    q, k = (torch.empty(2, heads, 5, 8, device="meta") for heads in (4, 2))
    cos = sin = torch.empty(1, 5, 8, device="meta")
    q_out, k_out = fk.apply_rotary_pos_emb(q, k, cos, sin, inplace=inplace)
    assert (q_out.shape, k_out.shape, q_out.device.type) == (q.shape, k.shape, "meta")
    assert (q_out is q and k_out is k) == inplace


@pytest.mark.parametrize("which", ["q", "k", "view_of_q"])
def test_inplace_on_a_leaf_that_requires_grad_is_refused(fk, which):
    """A leaf that requires grad (a parameter), or a view of one, is refused before anything is written (before the
    fix autograd's own error came after the kernel had rotated the leaf, and with only k a leaf, q was written too)."""
    q, k = make_qk(1, 3, 2, 1, 8, torch.float32)
    q_base = leaf(q.transpose(1, 2)) if which == "view_of_q" else leaf(q)
    q = q_base.transpose(1, 2) if which == "view_of_q" else q_base
    k = leaf(k) if which == "k" else leaf(k) * 1
    q_before, k_before = q.detach().clone(), k.detach().clone()
    cos, sin = angle_tables(1, 3, 8, False, torch.float32)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        fk.apply_rotary_pos_emb(q, k, cos, sin, inplace=True)
    assert torch.equal(q.detach(), q_before) and torch.equal(k.detach(), k_before)


@pytest.mark.parametrize("packed", [False, True], ids=["gathered", "packed_cached"])
def test_inplace_gradients_through_views(fk, packed):
    """In place with autograd on q and k that are views, as in a model: transposed views of a fused projection
    (transformers' layout) and the packed (tokens, heads, head_dim) form. Before the fix autograd refused them ("a
    Function that modifies inplace an input that is a view ... cannot return more than one Tensor"), after the kernel
    had written them. The outputs and the gradient of the projection are those of the out-of-place call."""
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = 2, 5, 3, 1, 16, 8
    x = torch.randn(batch, seq, 12, device=DEVICE)
    cos_cache, sin_cache = cache_tables(seq, rotary_dim, False, torch.float32)
    position_ids = torch.arange(seq, device=DEVICE)

    def rotate(weight, inplace):
        qk = x @ weight
        q, k = qk[..., : q_heads * head_dim], qk[..., q_heads * head_dim:]
        if packed:  # the batch's sequences packed, their positions restarting at 0
            q, k = q.reshape(-1, q_heads, head_dim), k.reshape(-1, k_heads, head_dim)
            return fk.apply_rotary_pos_emb_cached(q, k, cos_cache, sin_cache, position_ids.repeat(batch),
                                                  inplace=inplace)
        q = q.view(batch, seq, q_heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq, k_heads, head_dim).transpose(1, 2)
        return fk.apply_rotary_pos_emb(q, k, cos_cache[None], sin_cache[None], inplace=inplace)

    weight = torch.randn(12, (q_heads + k_heads) * head_dim, device=DEVICE)
    results = []
    for inplace in (False, True):
        w = leaf(weight)
        q_out, k_out = rotate(w, inplace)
        (q_out.square().sum() + (k_out * 3).sum()).backward()
        results.append((q_out.detach(), k_out.detach(), w.grad))
    for expected, got in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_inplace_views_with_cos_that_requires_grad(fk):
    """cos that requires grad (it gets no gradient) leaves the in-place rotation of views alone: before the fix
    autograd saw cos, so the outputs required grad and views of a buffer that does not were refused, after the
    kernel had written them."""
    batch, seq, heads, head_dim = 2, 5, 3, 16
    qk = torch.randn(batch, seq, 2 * heads * head_dim, device=DEVICE)
    q = qk[..., : heads * head_dim].view(batch, seq, heads, head_dim)
    k = qk[..., heads * head_dim:].view(batch, seq, heads, head_dim)
    cos, sin = angle_tables(1, seq, head_dim, False, torch.float32)
    expected = fk.apply_rotary_pos_emb(q, k, cos, sin, 2)
    q_out, k_out = fk.apply_rotary_pos_emb(q, k, leaf(cos), sin, 2, inplace=True)
    assert q_out is q and k_out is k
    assert torch.equal(q.detach(), expected[0]) and torch.equal(k.detach(), expected[1])


# ----------------------------------------------------------------------------------------------------------
# Gradient details.
# ----------------------------------------------------------------------------------------------------------

def test_gradient_of_one_output_only(fk):
    q, k = (leaf(t) for t in make_qk(2, 4, 3, 1, 16, torch.float32))
    cos, sin = angle_tables(1, 4, 16, False, torch.float32)
    q_out, _ = fk.apply_rotary_pos_emb(q, k, cos, sin)
    q_out.sum().backward()  # an expanded (stride 0) incoming gradient, and none for k
    q64 = leaf(q.detach().double())
    reference_float64(q64, cos, sin, 1, False).sum().backward()
    assert rel_err(q.grad, q64.grad) < 1e-6
    assert k.grad is None or not k.grad.any()


def test_double_backward(fk):
    """The gradient is itself a rotation, so it is differentiable: d/dq of <grad_q, v> is R(v)."""
    q, k = (leaf(t) for t in make_qk(1, 4, 2, 2, 8, torch.float32))
    cos, sin = angle_tables(1, 4, 8, True, torch.float32)
    g = leaf(torch.randn_like(q))
    q_out, _ = fk.apply_rotary_pos_emb(q, k, cos, sin, interleaved=True)
    (grad_q,) = torch.autograd.grad(q_out, q, g, create_graph=True)
    v = torch.randn_like(q)
    (grad_g,) = torch.autograd.grad(grad_q, g, v)
    # grad_q = R^T g, so d<grad_q, v>/dg = R v.
    expected = reference_float64(v, cos, sin, 1, True)
    assert rel_err(grad_g, expected) < 1e-6


def test_empty_sequence(fk):
    q, k = (leaf(t) for t in make_qk(2, 0, 3, 1, 8, torch.float32))
    cos, sin = angle_tables(1, 0, 8, False, torch.float32)
    q_out, k_out = fk.apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad.shape == q.shape


# ----------------------------------------------------------------------------------------------------------
# Bad input gives a clear error naming the argument.
# ----------------------------------------------------------------------------------------------------------

def _ok(d, **overrides):
    q, k = make_qk(2, 4, 3, 1, 16, torch.float32, device=d)
    cos, sin = angle_tables(1, 4, 16, False, torch.float32, device=d)
    return {"q": q, "k": k, "cos": cos, "sin": sin, **overrides}


BAD_INPUTS = [
    (lambda d: _ok(d, q=[1.0]), TypeError, "q must be a torch.Tensor"),
    (lambda d: _ok(d, q=[1.0], inplace=True), TypeError, "q must be a torch.Tensor"),
    (lambda d: _ok(d, q=torch.randn(2, 3, 4, 16, device=d, dtype=torch.float64)), TypeError, "q must have dtype"),
    (lambda d: _ok(d, q=torch.randn(3, 4, 16, device=d)), ValueError, "q must be 4-dimensional"),
    (lambda d: _ok(d, k=torch.randn(2, 1, 4, 16, device=d, dtype=torch.float16)), TypeError,
     "k must have the dtype of q"),
    (lambda d: _ok(d, k=torch.randn(3, 1, 4, 16, device=d)), ValueError, "k must have the batch size of q"),
    (lambda d: _ok(d, k=torch.randn(2, 1, 5, 16, device=d)), ValueError, "k must have the sequence length of q"),
    (lambda d: _ok(d, k=torch.randn(2, 1, 4, 8, device=d)), ValueError, "k must have the head_dim of q"),
    (lambda d: _ok(d, cos=torch.randn(4, 16, device=d)), ValueError, "cos must be 3-dimensional"),
    (lambda d: _ok(d, cos=torch.randn(1, 5, 16, device=d), sin=torch.randn(1, 5, 16, device=d)), ValueError,
     r"cos must have shape \(2 or 1, 4, rotary_dim\)"),
    (lambda d: _ok(d, cos=torch.randn(3, 4, 16, device=d), sin=torch.randn(3, 4, 16, device=d)), ValueError,
     r"cos must have shape"),
    (lambda d: _ok(d, q=torch.randn(1, 3, 4, 16, device=d), k=torch.randn(1, 1, 4, 16, device=d),
                   cos=torch.randn(2, 4, 16, device=d), sin=torch.randn(2, 4, 16, device=d)), ValueError,
     r"cos must have shape \(1, 4, rotary_dim\) to match q, got \(2, 4, 16\)"),
    (lambda d: _ok(d, sin=torch.randn(1, 4, 8, device=d)), ValueError, "sin must have the shape of cos"),
    (lambda d: _ok(d, sin=torch.ones(1, 4, 16, device=d, dtype=torch.int32)), TypeError, "sin must have dtype"),
    (lambda d: _ok(d, cos=torch.randn(1, 4, 7, device=d), sin=torch.randn(1, 4, 7, device=d)), ValueError,
     "rotary_dim and must be even"),
    (lambda d: _ok(d, cos=torch.randn(1, 4, 18, device=d), sin=torch.randn(1, 4, 18, device=d)), ValueError,
     r"at most head_dim \(16\)"),
    (lambda d: _ok(d, unsqueeze_dim=3), ValueError, "unsqueeze_dim must be one of 1, 2"),
    (lambda d: _ok(d, unsqueeze_dim=2), ValueError, "k must have the sequence length of q"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_inputs_raise_clear_errors(fk, case):
    make, error, message = BAD_INPUTS[case]
    kwargs = make(DEVICE)
    with pytest.raises(error, match=message):
        fk.apply_rotary_pos_emb(**kwargs)


def _ok_cached(d, **overrides):
    q, k = make_qk(2, 4, 3, 1, 16, torch.float32, device=d)
    cos_cache, sin_cache = torch.randn(10, 16, device=d), torch.randn(10, 16, device=d)
    position_ids = torch.zeros(2, 4, device=d, dtype=torch.int64)
    return {"q": q, "k": k, "cos_cache": cos_cache, "sin_cache": sin_cache, "position_ids": position_ids,
            **overrides}


BAD_CACHED_INPUTS = [
    (lambda d: _ok_cached(d, position_ids=torch.zeros(2, 4, device=d)), TypeError,
     "position_ids must have dtype int32, int64"),
    (lambda d: _ok_cached(d, position_ids=torch.zeros(2, 5, device=d, dtype=torch.int64)), ValueError,
     r"position_ids must have shape \(2, 4\) or \(1, 4\) to match q"),
    (lambda d: _ok_cached(d, q=torch.randn(1, 3, 4, 16, device=d), k=torch.randn(1, 1, 4, 16, device=d),
                          position_ids=torch.zeros(1, 5, device=d, dtype=torch.int64)), ValueError,
     r"position_ids must have shape \(1, 4\) to match q"),
    (lambda d: _ok_cached(d, position_ids=None), TypeError, "position_ids must be a torch.Tensor"),
    (lambda d: _ok_cached(d, cos_cache=torch.randn(1, 10, 16, device=d)), ValueError,
     "cos_cache must be 2-dimensional"),
    (lambda d: _ok_cached(d, sin_cache=torch.randn(9, 16, device=d)), ValueError,
     "sin_cache must have the shape of cos_cache"),
    (lambda d: _ok_cached(d, heads_dim=0), ValueError, "heads_dim must be one of 1, 2"),
    (lambda d: _ok_cached(d, q=torch.randn(4, 3, 16, device=d), k=torch.randn(4, 1, 16, device=d),
                          position_ids=torch.zeros(2, 4, device=d, dtype=torch.int64)), ValueError,
     "position_ids must be 1-dimensional"),
    (lambda d: _ok_cached(d, q=torch.randn(4, 3, 16, device=d), k=torch.randn(4, 1, 16, device=d),
                          position_ids=torch.zeros(4, device=d, dtype=torch.int64), heads_dim=2), ValueError,
     "heads_dim must be 1 for packed"),
    (lambda d: _ok_cached(d, q=torch.randn(4, 3, 16, device=d)), ValueError, "k must be 3-dimensional"),
    # Packed: the errors show the shapes passed, not those of the (1, tokens, ...) views inside.
    (lambda d: _ok_cached(d, q=torch.randn(4, 3, 16, device=d), k=torch.randn(4, 1, 16, device=d),
                          position_ids=torch.zeros(5, device=d, dtype=torch.int64)), ValueError,
     r"position_ids must have q's number of tokens \(4\) as its first dimension, got shape \(5,\)"),
    (lambda d: _ok_cached(d, q=torch.randn(4, 3, 16, device=d), k=torch.randn(5, 1, 16, device=d),
                          position_ids=torch.zeros(4, device=d, dtype=torch.int64)), ValueError,
     r"k must have q's number of tokens \(4\) as its first dimension, got shape \(5, 1, 16\)"),
    (lambda d: _ok_cached(d, q=torch.randn(4, 3, 16, device=d), k=torch.randn(4, 1, 12, device=d),
                          position_ids=torch.zeros(4, device=d, dtype=torch.int64)), ValueError,
     r"k must have the head_dim of q \(16\), got 12 \(q \(4, 3, 16\), k \(4, 1, 12\)\)"),
    (lambda d: _ok_cached(d, q=torch.randn(1, 3, 16, device=d).expand(4, 3, 16), k=torch.randn(4, 1, 16, device=d),
                          position_ids=torch.zeros(4, device=d, dtype=torch.int64), inplace=True), ValueError,
     r"q is written in place, but elements of it share memory \(shape \(4, 3, 16\)"),
]


@pytest.mark.parametrize("case", range(len(BAD_CACHED_INPUTS)))
def test_bad_cached_inputs_raise_clear_errors(fk, case):
    make, error, message = BAD_CACHED_INPUTS[case]
    with pytest.raises(error, match=message):
        fk.apply_rotary_pos_emb_cached(**make(DEVICE))


@pytest.mark.skipif(not ON_GPU, reason="needs a second device type")
def test_device_mismatch(fk):
    with pytest.raises(ValueError, match="cos is on cpu but q is on cuda"):
        fk.apply_rotary_pos_emb(**_ok("cuda", cos=torch.randn(1, 4, 16), sin=torch.randn(1, 4, 16)))


# ----------------------------------------------------------------------------------------------------------
# torch.library integration.
# ----------------------------------------------------------------------------------------------------------

def test_opcheck(fk):
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = SHAPES[1]
    ops = fk._ops.ops
    q, k = (leaf(t) for t in make_qk(batch, seq, q_heads, k_heads, head_dim, torch.float32))
    cos, sin = angle_tables(1, seq, rotary_dim, False, torch.float32)
    torch.library.opcheck(ops.rope, (q, k, cos, sin, None, 1, False, False))
    cos_cache, sin_cache = cache_tables(seq + 4, rotary_dim, True, torch.float32)
    position_ids = torch.randint(0, seq + 4, (batch, seq), device=DEVICE, dtype=torch.int32)
    torch.library.opcheck(ops.rope, (q, k, cos_cache, sin_cache, position_ids, 1, True, True))
    q2, k2 = make_qk(batch, seq, q_heads, k_heads, head_dim, torch.float32, heads_dim=2)
    torch.library.opcheck(ops.rope_inplace, (q2, k2, cos, sin, None, 2, False))


@pytest.mark.parametrize("inplace", [False, True])
def test_compile_fullgraph(fk, inplace):
    torch._dynamo.reset()
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = SHAPES[0] if ON_GPU else SHAPES[1]
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, dtype)
    cos, sin = angle_tables(1, seq, rotary_dim, False, dtype)
    cos_cache, sin_cache = cache_tables(seq, rotary_dim, True, dtype)
    position_ids = torch.arange(seq, device=DEVICE)[None]

    def block(q, k):
        q, k = q * 1, k * 1  # non-leaf, so the in-place form is differentiable
        q, k = fk.apply_rotary_pos_emb(q, k, cos, sin, inplace=inplace)
        q, k = fk.apply_rotary_pos_emb_cached(q, k, cos_cache, sin_cache, position_ids, interleaved=True,
                                              inplace=inplace)
        return q, k

    compiled = torch.compile(block, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    eager_args, compiled_args = [leaf(t) for t in (q, k)], [leaf(t) for t in (q, k)]
    eager_out, compiled_out = block(*eager_args), compiled(*compiled_args)
    for a, b in zip(eager_out, compiled_out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    sum(o.float().sum() for o in eager_out).backward()
    sum(o.float().sum() for o in compiled_out).backward()
    for a, b in zip(eager_args, compiled_args):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    with torch.no_grad():  # the mutating op itself
        q2, k2 = q.clone(), k.clone()
        compiled_out = torch.compile(block, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")(q2, k2)
    for a, b in zip(eager_out, compiled_out):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)


@pytest.mark.skipif(not ON_GPU, reason="70,000 programs are too many for the CPU interpreter")
def test_batch_beyond_a_grid_axis(fk):
    """A batch above 65535, the cap of CUDA's second and third grid axes: the launch grid is 1-D."""
    torch.manual_seed(14)
    batch, seq = 70000, 3
    assert batch > 65535
    q, k = make_qk(batch, seq, 2, 1, 16, torch.float32)
    cos, sin = angle_tables(batch, seq, 16, False, torch.float32)
    check_against_references(fk, q, k, cos, sin, 1, False)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with ~10 GB free (tensors beyond 2**31 elements)")
def test_huge_tensor_int64_offsets(fk, large_gpu_memory):
    seq, q_heads, head_dim = 2**21 + 5, 8, 128  # q has more than 2**31 elements
    q = torch.randn(1, seq, q_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(1, seq, 1, head_dim, device=DEVICE, dtype=torch.bfloat16)
    cos_cache, sin_cache = cache_tables(seq, head_dim, False, torch.float32)
    position_ids = torch.arange(seq, device=DEVICE)[None]
    q_out, k_out = fk.apply_rotary_pos_emb_cached(q, k, cos_cache, sin_cache, position_ids, heads_dim=2)
    for piece in (slice(0, 7), slice(seq - 7, seq)):
        cos, sin = cos_cache[None, piece], sin_cache[None, piece]
        for x, out in ((q, q_out), (k, k_out)):
            ref = reference_float64(x[:, piece], cos, sin, 2, False)
            assert rel_err(out[:, piece], ref) < 1e-2


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_column_stride_beyond_int32_products(fk, convention):
    """A head_dim stride below 2**31 whose products with the column index are not: column 3 of q lies 3 * 715827883
    elements (> 2**31) into the storage, as when head_dim is an outer dimension of a tensor beyond 2**31 elements.
    The column offsets were int32 products, which wrapped: a read far outside the tensor (a crash on the CPU). The
    storage is mostly untouched virtual memory (4 GiB of it; four elements are written on the CPU)."""
    interleaved = CONVENTIONS[convention]
    head_dim, stride = 4, 715827883
    assert 3 * stride >= 2**31 > stride
    storage = torch.empty(3 * stride + 1, device=DEVICE, dtype=torch.float16)
    q = storage.as_strided((1, 1, 1, head_dim), (1, 1, 1, stride))
    q.copy_(torch.randn(1, 1, 1, head_dim, device=DEVICE))
    k = torch.randn(1, 1, 1, head_dim, device=DEVICE, dtype=torch.float16)
    cos, sin = angle_tables(1, 1, head_dim, interleaved, torch.float32, positions=torch.tensor([[5.0]], device=DEVICE))
    q_out, _ = fk.apply_rotary_pos_emb(q, k, cos, sin, 2, interleaved=interleaved)
    assert rel_err(q_out, reference_float64(q, cos, sin, 2, interleaved)) < 1e-3


# ----------------------------------------------------------------------------------------------------------
# The torch-cpu variant: plain PyTorch, same function.
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("heads_dim", [1, 2])
def test_torch_cpu_variant_matches_references(fk_cpu, poisoned_empty, dtype, convention, heads_dim):
    assert fk_cpu.BACKEND == "cpu"
    interleaved = CONVENTIONS[convention]
    batch, seq, q_heads, k_heads, head_dim, rotary_dim = 2, 9, 3, 1, 24, 16
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, dtype, heads_dim, device="cpu")
    cos, sin = angle_tables(1, seq, rotary_dim, interleaved, dtype, device="cpu")
    check_against_references(fk_cpu, q, k, cos, sin, heads_dim, interleaved)
    cos_cache, sin_cache = (t[0] for t in angle_tables(1, seq + 2, rotary_dim, interleaved, dtype, device="cpu"))
    position_ids = torch.randint(0, seq + 2, (batch, seq))
    check_against_references(fk_cpu, q, k, cos_cache[position_ids], sin_cache[position_ids], heads_dim, interleaved,
                             position_ids, cos_cache, sin_cache, inplace=True)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_kernels_and_portable_path_agree(fk, fk_cpu, convention):
    interleaved = CONVENTIONS[convention]
    q, k = make_qk(2, 7, 3, 2, 20, torch.float32, device="cpu")
    cos_cache, sin_cache = (t[0] for t in angle_tables(1, 9, 12, interleaved, torch.float32, device="cpu"))
    position_ids = torch.tensor([[0, 1, 2, 3, 9, 5, 6], [8, 7, 6, 5, 4, 3, 2]])  # 9: outside, NaN in both
    args = (q, k, cos_cache, sin_cache, position_ids)
    ours = fk.apply_rotary_pos_emb_cached(*(t.to(DEVICE) for t in args), interleaved=interleaved)
    portable = fk_cpu.apply_rotary_pos_emb_cached(*args, interleaved=interleaved)
    for a, b in zip(ours, portable):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-6, equal_nan=True)


# ----------------------------------------------------------------------------------------------------------
# The Hub layer in place of transformers' functions.
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["gpt_oss", "openai_privacy_filter"])
def test_layer_refuses_tables_of_other_conventions(fk, model):
    """gpt-oss and the OpenAI privacy filter declare their ``apply_rotary_pos_emb`` kernelizable under Llama's name,
    ``rotary_pos_emb``, but their cos/sin hold each angle once, ``(batch, seq, head_dim / 2)``, and rotate the whole
    head (half-split and interleaved: the inputs cannot tell which). The swapped-in layer refuses them; before the
    fix it rotated the first half of each head only, as partial rotary, silently wrong for both."""
    import importlib

    rotary = importlib.import_module(f"transformers.models.{model}.modeling_{model}").apply_rotary_pos_emb
    batch, seq, q_heads, k_heads, head_dim = 2, 5, 4, 2, 16
    q, k = make_qk(batch, seq, q_heads, k_heads, head_dim, torch.float32)
    cos, sin = angle_tables(batch, seq, head_dim, False, torch.float32)
    cos, sin = cos[..., : head_dim // 2], sin[..., : head_dim // 2]  # as their rotary embeddings return them
    rotary(q, k, cos, sin)  # what the model itself accepts
    with pytest.raises(ValueError, match=r"cos must have head_dim \(16\) columns"):
        fk.layers.ApplyRotaryPosEmb()(q, k, cos, sin)
