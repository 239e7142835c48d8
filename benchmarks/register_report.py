"""Registers and spills of the flash-attention kernels at the shipped tiles, compiled offline for an NVIDIA GPU
architecture: no GPU needed, only Triton and the ptxas it bundles.

Why. ptxas keeps at most 255 registers per thread and spills the rest to local memory, which a kernel then
re-reads and re-writes in every loop iteration. On the H200 the flash-attention dK/dV pass spills (its two fp32
accumulators plus its score tiles do not fit), and that is where the backward falls short. This reports it for
any tile and head dim on a machine without a GPU, so that tiles and kernel changes can be screened before they are
timed. The numbers come from the Triton it runs with: the CPU machines' 3.9 allocates registers similarly to the
H200's 3.6, not identically (dK/dV at 64x64, 4 warps: both at the limit and spilling; dQ: 210 against 213
registers, neither spilling). For the H200's own allocation run it with Triton 3.6 (``pip install --no-deps
--target /tmp/t36 triton==3.6.0``, then ``PYTHONPATH=/tmp/t36``): compiled that way, the RMSNorm backward's
spills matched what Triton reported on the H200 to the byte (144 and 96 bytes at 1 x 16384 on 8 and 16 warps).

    python benchmarks/register_report.py [--arch 90] [--head-dims 64 128 256] [--groups 1 4]
                                         [--device "NVIDIA H200"] [--tile dkdv=16,128,8,3]
                                         [--kernels forward dkdv dq] [--source modified_flash_attn.py]

How. The launchers of ``kernels_src/flash_attn.py`` are called with meta tensors of a benchmark shape while their
``launch`` records instead of launching. Each recorded launch is compiled with ``triton.compile`` for the target
with the specialisation Triton would give it on a GPU (integers equal to 1 become constants unless the kernel says
``do_not_specialize``, multiples of 16 and tensors are marked 16-divisible), and ``ptxas -v`` reports registers and
spill bytes.
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    # The kernels must be compiled, not interpreted: Triton reads this when it is imported (its standard library)
    # and when a kernel is defined. Only when run as a script: a process importing this module (a test of
    # ``parse_tile``) keeps its interpreter.
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels_src  # noqa: E402  (the package, importable from the repository root)

from launch_tables import package_launch_config, read_table  # noqa: E402

KERNELS = {"forward": "forward", "dkdv": "backward_dkdv", "dq": "backward_dq"}
# Each pass's on/off launch switch besides one_loop and desc (see kernels_src/flash_attn.py): the forward's
# ``pipelined`` and the dK/dV pass's ``group_loop``; the dQ pass has none. The forward's ``pv_fence`` is not one of
# them: it only reorders instructions (offline, sm_90a, head dim 128: 195 registers with and without it), so a
# ``--tile`` override leaves it off, and the shipped tiles report it as the table sets it.
SWITCHES = {"forward": "pipelined", "dkdv": "group_loop"}
_POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
                  torch.int32: "*i32", torch.bool: "*i1"}


def specialisation(kernel, args, constexprs):
    """(signature, constexprs, attributes) for ``triton.compile`` as Triton's binder would make them on a GPU."""
    names = kernel.arg_names
    not_specialised = set(kernel.do_not_specialize or ())
    signature, constants, attributes = {}, {}, {}
    for index, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = _POINTER_TYPES[value.dtype]
            attributes[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and name not in not_specialised:
                signature[name], constants[(index,)] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and name not in not_specialised:
                attributes[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, TensorDescriptor):
            element = _POINTER_TYPES[value.base.dtype].lstrip("*")
            signature[name] = f"tensordesc<{element}{list(value.block_shape)}>"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} of type {type(value).__name__}")
    for name, value in constexprs.items():
        signature[name] = "constexpr"
        constants[(names.index(name),)] = value
    return signature, constants, attributes


def registers_and_spills(kernel, args, constexprs, num_warps, num_stages, arch):
    """(registers, spill store bytes, spill load bytes) of one launch compiled for ``sm_<arch>``."""
    signature, constants, attributes = specialisation(kernel, args, constexprs)
    options = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages is not None else {})
    compiled = triton.compile(ASTSource(kernel, signature, constants, attributes), target=GPUTarget("cuda", arch, 32),
                              options=options)
    ptxas = get_ptxas(arch).path
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups())
    return registers, stores, loads


def load_kernels(source):
    """kernels_src/flash_attn.py, or a modified copy of it at ``source`` (imported as part of kernels_src).
    Compiling needs TRITON_INTERPRET unset before Triton is imported (run as a script, this module unsets it)."""
    path = source or Path(kernels_src.__file__).parent / "flash_attn.py"
    spec = importlib.util.spec_from_file_location("kernels_src.flash_attn", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "kernels_src"
    spec.loader.exec_module(module)
    return module


def recorded_launches(flash_attn, head_dim, group, tiles):
    """Every launch of one causal bf16 forward and backward at B1 S4096 with 2 kv heads and ``group`` query heads
    per kv head, keyed by kernel name: (kernel, args, constexprs, num_warps, num_stages). Besides the tiles, the
    group size changes the code: a group of 1 is specialised to the constant 1, which removes dK/dV's loop over
    the group's heads (MHA); larger groups keep it (GQA). A tile that streams through tensor descriptors does so
    whatever its ``desc_min_flops`` (this attention is smaller), and a dQ tile with ``from_ds`` takes the backward
    through dS whatever its ``min_flops``: the report shows what large attentions run."""
    launches = {}
    tiles = {kernel: {**tile, "desc_min_flops": 0} for kernel, tile in tiles.items()}
    if "from_ds" in tiles["backward_dq"]:
        tiles["backward_dq"]["from_ds"] = {**tiles["backward_dq"]["from_ds"], "min_flops": 0}

    def record(kernel, grid, pointers, scalars, constexprs, num_warps, num_stages=None):
        launches[kernel.__name__] = (kernel, (*pointers, *scalars), constexprs, num_warps, num_stages)

    batch, seq, kv_heads = 1, 4096, 2
    heads = kv_heads * group
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, out, dout, dq = (torch.empty(batch, seq, heads, head_dim, **meta) for _ in range(4))
    k, v, dk, dv = (torch.empty(batch, seq, kv_heads, head_dim, **meta) for _ in range(4))
    lse, delta = (torch.empty(batch, heads, seq, device="meta") for _ in range(2))
    seed = torch.empty(1, device="meta", dtype=torch.int64)
    common = (None, None, batch, seq, seq, head_dim**-0.5, 0.0, (1 << 30, 0), 0.0)
    original, flash_attn.launch = flash_attn.launch, record
    try:
        flash_attn.flash_attn_forward(q, k, v, out, lse, None, seed, *common, tile=tiles["forward"])
        flash_attn.flash_attn_backward(dout, q, k, v, out, lse, None, seed, dq, dk, dv, delta, None, *common,
                                       dkdv_tile=tiles["backward_dkdv"], dq_tile=tiles["backward_dq"])
    finally:
        flash_attn.launch = original
    return launches


def shipped_tile(table, kernel, device, head_dim):
    """The table's tile for ``device``, chosen by the package's own ``select_entry``."""
    entries = table[kernel].get(device) or table[kernel]["default"]
    return package_launch_config().select_entry(entries, head_dim)


def parse_tile(text):
    kernel, values = text.split("=")
    fields = [int(x) for x in values.split(",")]
    if kernel not in KERNELS or len(fields) not in (4, 5, 6, 7) or (len(fields) == 7 and kernel not in SWITCHES):
        raise argparse.ArgumentTypeError("--tile: expected KERNEL=block_m,block_n,num_warps,num_stages"
                                         f"[,one_loop[,desc[,switch]]] with KERNEL one of {sorted(KERNELS)} (a switch "
                                         f"only for {sorted(SWITCHES)}), got {text!r}")
    block_m, block_n, warps, stages, one_loop, desc, switch = fields + [0] * (7 - len(fields))
    tile = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages,
            "one_loop": bool(one_loop), "desc": bool(desc)}
    if kernel in SWITCHES:
        tile[SWITCHES[kernel]] = bool(switch)
    return KERNELS[kernel], tile


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90, 100 (default 90)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--device", default="NVIDIA H200", help="the launch table's device whose tiles are compiled")
    parser.add_argument("--tile", type=parse_tile, action="append", default=[],
                        help="override one kernel's tile: KERNEL=block_m,block_n,num_warps,num_stages"
                             "[,one_loop[,desc[,switch]]] (KERNEL: forward, dkdv or dq; one_loop 1: the tile loop as "
                             "one loop; desc 1: streamed tiles through tensor descriptors; switch 1: the forward "
                             "pipelined, the dK/dV pass's group loop kept with MHA; all default 0)")
    parser.add_argument("--kernels", nargs="+", choices=sorted(KERNELS), default=sorted(KERNELS))
    parser.add_argument("--source", type=Path,
                        help="a modified copy of kernels_src/flash_attn.py to compile instead (to screen a change)")
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 4],
                        help="query heads per kv head: 1 (MHA) and 4 (GQA, as Llama-3-8B) by default")
    args = parser.parse_args()
    table = read_table(None, "flash_attn")
    flash_attn = load_kernels(args.source)
    wanted = {f"_{'fwd' if k == 'forward' else 'bwd_' + k}_kernel" for k in args.kernels}
    if "dq" in args.kernels:  # where the backward goes through dS, its dQ pass is this kernel
        wanted.add("_bwd_dq_from_ds_kernel")
    print("| head dim | group | kernel | tile (block_m x block_n, warps, stages, loop form) | registers "
          "| spill stores / loads (bytes) |")
    print("|---|---|---|---|---|---|")
    for head_dim in args.head_dims:
        tiles = {kernel: shipped_tile(table, kernel, args.device, head_dim) for kernel in KERNELS.values()}
        tiles.update(dict(args.tile))
        for group in args.groups:
            for name, (kernel, launch_args, constexprs, warps, stages) in recorded_launches(flash_attn, head_dim, group,
                                                                                             tiles).items():
                if name not in wanted or (group != args.groups[0] and name != "_bwd_dkdv_kernel"):
                    continue  # only dK/dV loops over the group; elsewhere the group size is one index division
                registers, stores, loads = registers_and_spills(kernel, launch_args, constexprs, warps, stages,
                                                                args.arch)
                loops = "one loop" if constexprs.get("ONE_LOOP") or constexprs.get("PIPELINED") else "three loops"
                loops += ", pipelined" if constexprs.get("PIPELINED") else ""
                loops += ", P.V fence" if constexprs.get("PV_FENCE") else ""
                loops += ", group loop" if group == 1 and constexprs.get("SINGLE_HEAD") is False else ""
                tile = (f"{constexprs['BLOCK_M']}x{constexprs['BLOCK_N']}, {warps}, {stages if stages else 'default'}, "
                        f"{loops}")
                print(f"| {head_dim} | {group} | {name.strip('_')} | {tile} | {registers} | {stores} / {loads} |",
                      flush=True)


if __name__ == "__main__":
    main()
