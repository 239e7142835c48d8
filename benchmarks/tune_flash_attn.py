"""Tune the flash-attention launch tables for the GPU this runs on and write them into ``configs/flash_attn.json``.

Per head dim (64, 128, 256; rows ``max_cols`` of the table are head dims), on b=4, s=4096, 2048 / head_dim
heads, causal, bf16 (the shape class of h200-baselines.md): the forward's tile is the candidate with the fastest
forward; then the backward's two passes by coordinate descent: the dK/dV tile with the dQ tile fixed at the
current table's, then the dQ tile with the best dK/dV one; each pass's tile then with and without ``heavy_first``
(the order of its programs), the forward's with and without ``pipelined`` and ``pv_fence`` and the dK/dV tile's
with and without ``group_loop``. Then the forward's tile for short keys (``short``: b=16, s=1024), kept where it beats
the entry's own tile there by 3%, and last the tile of the backward through dS (the dQ entry's ``from_ds``), kept only
where that backward beats the dQ pass's. Candidates that do not fit (shared memory, registers) fail to launch and are
skipped.
The result is data: the package reads it at run time and never autotunes.

    python benchmarks/tune_flash_attn.py --build <variants dir> [--write torch-ext/fused_kernels/configs/flash_attn.json]
                                         [--head-dims 128]

Every tile is tried with its streamed tiles through tensor descriptors and with pointer loads (``desc``); an entry
whose fastest tile uses descriptors keeps the fastest pointer-load tile's differences as ``without_desc``.
Each candidate compiles once (seconds): a head dim takes several minutes, so ``--head-dims`` tunes a subset (the
table's rows for the others keep the current values).
"""

import argparse
import itertools
from pathlib import Path

import torch
from triton.testing import do_bench

from launch_tables import read_table, write_device_entries

HEAD_DIMS = (64, 128, 256)
BLOCK_M = (64, 128)
# The dK/dV pass holds a key tile and streams query tiles: narrow query tiles are tried there too. Its two fp32
# accumulators (dK and dV of the key tile) leave few registers for the score tiles: in an sm_90a build at head dim
# 128 (ptxas -v), every tile of 32 queries or more spilled, and 128 keys by 16 queries on 8 warps did not.
DKDV_BLOCK_M = (16, 32, 64, 128)
BLOCK_N = (32, 64, 128)
WARPS = (4, 8)
STAGES = (2, 3)
# One stage (no prefetch of the next query tile) is tried in the dK/dV pass too: it frees the shared memory and
# registers that the prefetched Q and dO tiles hold, and at head dim 256 it made the pass 20% faster on the H200.
DKDV_STAGES = (1, 2, 3)
# Each pass's tile loop as three specialised loops or as one (``one_loop``; see kernels_src/flash_attn.py): which
# is faster depends on the pass and head dim (on the H200 one loop won in dK/dV at every head dim and in the forward
# at 256, lost in dQ, and in the forwards at 64 and 128 won with descriptor loads and lost with pointer loads).
ONE_LOOP = (False, True)
# Streamed tiles through tensor descriptors or pointer loads (``desc``): the freed registers change which tile wins.
DESC = (False, True)
# Descriptors cost host time (see ``_streamed`` in kernels_src/flash_attn.py): below this many forward FLOPs an
# attention's launches ran host-bound on the H200 and pointer loads were faster in wall time (B8 H16 S2048 D64 causal,
# 6.9e10: 0.23 against 0.32 ms); from 1.4e11 (B4 H16 S4096 D64, B16 H32 S1024 D128) descriptors were.
DESC_MIN_FLOPS = 10**11
# The backward through dS (``from_ds``; ``flash_attn_backward`` in kernels_src/flash_attn.py): its dQ tiles, timed on
# the whole backward. Its scratch budget and the fewest dK/dV programs per launch are a memory choice and an occupancy
# floor, not tuned: on the H200 a launch of one pair of B2 Hq32 Hk8 S8192 (64 programs, under half of 132 SMs) took
# the backward from 6.7 to 10.5 ms, while launches of 256 programs (B8 Hq16 Hk8 S4096 d128 by 8 pairs) ran as fast
# per pair as larger ones. 768 MiB keeps the Qwen3-0.6B training step's peak (scratch of 8 pairs, 512 MiB) below
# the one its loss sets; 1 GiB (16 pairs) raised it by 0.2 GiB for 1% of its attention backward.
FROM_DS_STAGES = (2, 3, 4)
FROM_DS_BUDGET = 768 << 20
FROM_DS_MIN_PROGRAMS = 256
# Per head dim, the most granules (see ``_ds_chunk_pairs``) the launches may run per granule of pairs; beyond it the
# dQ pass was faster on the H200 (measured on shapes the tuning shape does not cover: whole backward through dS
# against the dQ pass 0.93-0.99 at 1.11, 1.00-1.03 at 1.14 with head dim 128; 0.86 at 1.2, 1.10 at 1.375 with 256).
# Head dim 64, where the dQ pass has won at the tuning shape, takes 128's value unmeasured.
FROM_DS_MAX_GRANULE_RATIO = {64: 1.12, 128: 1.12, 256: 1.25}
# The forward's tile for short keys (``_for_key_length`` in kernels_src/flash_attn.py): timed at this many keys (causal,
# 16k tokens), kept only where it is this much faster than the entry's own tile there, and used up to this length.
SHORT_SEQ = 1024
SHORT_MIN_GAIN = 0.97


def candidates(block_ms, stage_counts):
    for block_m, block_n, warps, stages, one_loop, desc in itertools.product(block_ms, BLOCK_N, WARPS, stage_counts,
                                                                             ONE_LOOP, DESC):
        yield {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages, "one_loop": one_loop,
               "desc": desc}


def timed_candidate(label, timed, tile, shown):
    """``timed(tile)`` in milliseconds, or None where the candidate cannot run (out of shared memory or registers
    and the like: ``timed`` raises); printed either way, the candidate as ``shown``."""
    try:
        ms = timed(tile)
    except Exception as error:  # noqa: BLE001 - any failure to compile or launch: not a candidate
        print(f"  {label} {shown}: skipped ({type(error).__name__})", flush=True)
        return None
    print(f"  {label} {shown}: {ms * 1e3:.1f} us", flush=True)
    return ms


def fastest(label, timed, block_ms=BLOCK_M, stage_counts=STAGES):
    """(the candidate with the lowest time, the one among those with pointer loads); ``timed(config)`` returns
    milliseconds or raises if it cannot run."""
    best = {}
    for config in candidates(block_ms, stage_counts):
        ms = timed_candidate(label, timed, config, config)
        if ms is None:
            continue
        for kind in ("any", "pointers") if not config["desc"] else ("any",):
            if kind not in best or ms < best[kind][0]:
                best[kind] = (ms, config)
    for kind, (ms, config) in best.items():
        print(f"{label} ({kind}): {config} {ms * 1e3:.1f} us", flush=True)
    return best["any"][1], best["pointers"][1]


def table_entry(label, timed, tiles):
    """The launch entry from ``fastest``'s pair, each with its faster program order: the fastest tile, and when it
    streams through descriptors, the fastest pointer-load tile's differences as ``without_desc`` (what runs where
    descriptors cannot be used: varlen batches, misaligned tensors, attentions below ``DESC_MIN_FLOPS``)."""
    if not tiles[0]["desc"]:  # the fastest tile is the fastest pointer-load tile: no second order timing
        return with_order(label, timed, tiles[0])
    tile, pointer_tile = (with_order(label, timed, t) for t in tiles)
    keys = (set(tile) | set(pointer_tile)) - {"desc"}
    without_desc = {key: pointer_tile.get(key, False) for key in sorted(keys)
                    if tile.get(key, False) != pointer_tile.get(key, False)}
    tile = {**tile, "desc_min_flops": DESC_MIN_FLOPS}
    return {**tile, "without_desc": without_desc} if without_desc else tile


def with_order(label, timed, tile):
    """``tile``, with ``heavy_first`` if that is faster: the order in which the pass's programs take the tiles
    (``_tile_of_head`` in kernels_src/flash_attn.py), timed on the chosen tile (the tuning shape is causal, where
    the order matters)."""
    heavy = {**tile, "heavy_first": True}
    natural_ms, heavy_ms = timed(tile), timed(heavy)
    print(f"{label} order: natural {natural_ms * 1e3:.1f} us, heavy first {heavy_ms * 1e3:.1f} us", flush=True)
    return heavy if heavy_ms < natural_ms else tile


def with_from_ds(label, timed, entry, head_dim):
    """The dQ ``entry`` with the fastest ``from_ds`` tile (then with its faster program order), or without one
    where no tile's backward through dS beats the dQ pass's."""
    entry = {key: value for key, value in entry.items() if key != "from_ds"}
    best_ms, best = timed(entry), None
    print(f"{label}: dQ pass {best_ms * 1e3:.1f} us", flush=True)
    for block_m, block_n, warps, stages in itertools.product(BLOCK_M, BLOCK_N, WARPS, FROM_DS_STAGES):
        from_ds = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                   "heavy_first": True, "budget": FROM_DS_BUDGET, "min_flops": DESC_MIN_FLOPS,
                   "min_programs": FROM_DS_MIN_PROGRAMS, "max_granule_ratio": FROM_DS_MAX_GRANULE_RATIO[head_dim]}
        ms = timed_candidate(label, timed, {**entry, "from_ds": from_ds}, from_ds)
        if ms is not None and ms < best_ms:
            best_ms, best = ms, from_ds
    if best is None:
        return entry
    from_ds = with_order(label, lambda tile: timed({**entry, "from_ds": tile}), {**best, "heavy_first": False})
    return {**entry, "from_ds": from_ds}


def with_short(label, timed, entry):
    """The forward ``entry`` with a ``short`` tile (shape, warps, stages; its other settings the entry's) where one is
    at least ``1 - SHORT_MIN_GAIN`` faster than the entry's own tile at ``SHORT_SEQ`` keys (``timed`` runs that
    shape); an old ``short`` is replaced either way."""
    entry = {key: value for key, value in entry.items() if key != "short"}
    entry_ms, best = timed(entry), None
    best_ms = entry_ms * SHORT_MIN_GAIN
    print(f"{label}: entry's tile {entry_ms * 1e3:.1f} us", flush=True)
    for block_m, block_n, warps, stages in itertools.product(BLOCK_M, BLOCK_N, WARPS, (2, 3)):
        short = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}
        ms = timed_candidate(label, timed, {**entry, **short}, short)
        if ms is not None and ms < best_ms:
            best_ms, best = ms, short
    return entry if best is None else {**entry, "short": {"max_seqlen_k": SHORT_SEQ, **best}}


def with_switch(label, timed, entry, key):
    """``entry`` with the launch switch ``key`` on if that is faster (a variant that cannot run is not): the
    forward's ``pipelined`` (see ``_fwd_tile`` in kernels_src/flash_attn.py) and ``pv_fence`` (``_fwd_kernel``) and
    the dK/dV pass's ``group_loop`` (``_bwd_dkdv_kernel``; the tuning shape is MHA, where it matters). An entry
    streaming through descriptors was timed with them only, so its pointer-load fallback keeps the switch off."""
    switched = {**entry, key: True}
    plain_ms = timed(entry)
    try:
        switched_ms = timed(switched)
    except Exception as error:  # noqa: BLE001 - out of resources and the like
        print(f"{label} {key}: off {plain_ms * 1e3:.1f} us, on skipped ({type(error).__name__})", flush=True)
        return entry
    print(f"{label} {key}: off {plain_ms * 1e3:.1f} us, on {switched_ms * 1e3:.1f} us", flush=True)
    if switched_ms >= plain_ms:
        return entry
    if entry.get("desc", False):
        switched["without_desc"] = {**entry.get("without_desc", {}), key: False}
    return switched


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, required=True, help="directory of built variants")
    parser.add_argument("--write", type=Path, help="config file to update (the device's entries only)")
    parser.add_argument("--head-dims", type=int, nargs="+", choices=HEAD_DIMS, default=HEAD_DIMS)
    args = parser.parse_args()
    import kernels

    fk = kernels.get_local_kernel(args.build)
    attn = fk._kernels.flash_attn
    table = read_table(args.write, "flash_attn")
    device_name = torch.cuda.get_device_name()
    # Start from the device's rows (or the defaults) so that head dims not tuned now keep theirs.
    tuned = {kernel: {entry["max_cols"]: entry for entry in table[kernel].get(device_name, table[kernel]["default"])}
             for kernel in ("forward", "backward_dkdv", "backward_dq")}
    for head_dim in args.head_dims:
        batch, seq, heads = 4, 4096, 2048 // head_dim
        q, k, v, out, dout = (torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                              for _ in range(5))
        lse = torch.empty(batch, heads, seq, device="cuda")
        seed = torch.zeros(1, device="cuda", dtype=torch.int64)
        common = (None, None, batch, seq, seq, head_dim ** -0.5, 0.0, (1 << 30, 0), 0.0)

        def forward(tile):
            run = lambda: attn.flash_attn_forward(q, k, v, out, lse, None, seed, *common, tile=tile)  # noqa: E731
            run()
            return do_bench(run, warmup=10, rep=50)

        forward_tile = table_entry(f"d={head_dim} forward", forward, fastest(f"d={head_dim} forward", forward))
        for switch in ("pipelined", "pv_fence"):
            forward_tile = with_switch(f"d={head_dim} forward", forward, forward_tile, switch)
        short_batch = batch * seq // SHORT_SEQ
        short_q, short_k, short_v, short_out = (torch.randn(short_batch, SHORT_SEQ, heads, head_dim, device="cuda",
                                                            dtype=torch.bfloat16) for _ in range(4))
        short_lse = torch.empty(short_batch, heads, SHORT_SEQ, device="cuda")

        def forward_short(tile):
            run = lambda: attn.flash_attn_forward(  # noqa: E731
                short_q, short_k, short_v, short_out, short_lse, None, seed, None, None, short_batch, SHORT_SEQ,
                SHORT_SEQ, head_dim ** -0.5, 0.0, (1 << 30, 0), 0.0, tile=tile)
            run()
            return do_bench(run, warmup=10, rep=50)

        forward_tile = with_short(f"d={head_dim} forward, {SHORT_SEQ} keys", forward_short, forward_tile)
        del short_q, short_k, short_v, short_out, short_lse
        attn.flash_attn_forward(q, k, v, out, lse, None, seed, *common, tile=forward_tile)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty_like(lse)

        def backward(dkdv_tile, dq_tile):
            run = lambda: attn.flash_attn_backward(  # noqa: E731
                dout, q, k, v, out, lse, None, seed, dq, dk, dv, delta, None, *common, dkdv_tile=dkdv_tile,
                dq_tile=dq_tile)
            run()
            return do_bench(run, warmup=10, rep=50)

        row = None if head_dim == HEAD_DIMS[-1] else head_dim
        current = {key: value for key, value in tuned["backward_dq"][row].items() if key != "max_cols"}
        dkdv_timed = lambda tile: backward(tile, current)  # noqa: E731
        dkdv_tile = with_switch(f"d={head_dim} backward dK/dV", dkdv_timed, table_entry(
            f"d={head_dim} backward dK/dV", dkdv_timed,
            fastest(f"d={head_dim} backward dK/dV", dkdv_timed, DKDV_BLOCK_M, DKDV_STAGES)), "group_loop")
        dq_timed = lambda tile: backward(dkdv_tile, tile)  # noqa: E731
        dq_tile = table_entry(f"d={head_dim} backward dQ", dq_timed, fastest(f"d={head_dim} backward dQ", dq_timed))
        dq_tile = with_from_ds(f"d={head_dim} backward through dS", dq_timed, dq_tile, head_dim)
        for kernel, tile in (("forward", forward_tile), ("backward_dkdv", dkdv_tile), ("backward_dq", dq_tile)):
            tuned[kernel][row] = {"max_cols": row, **tile}
    write_device_entries(args.write, device_name, {
        kernel: sorted(rows.values(), key=lambda e: e["max_cols"] or float("inf")) for kernel, rows in tuned.items()})


if __name__ == "__main__":
    main()
