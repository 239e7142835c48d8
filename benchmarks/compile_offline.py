"""Compile the gated-activation (SwiGLU/GeGLU) and RMSNorm kernels for a real GPU target without a GPU.

Triton's CPU interpreter accepts code the GPU front end rejects (type mismatches across branches, wrong
constexpr use), and it cannot show whether a kernel's accesses are 16 bytes wide. This compiles the kernels for
sm_90 through ``triton.compile`` for each variant, dtype and argument specialisation the launchers produce, and
reports how wide its global accesses are: 16-byte ``.v4`` accesses where every row is known to start on a 16-byte
boundary (Triton specialises integers divisible by 16; RMSNorm's ``ALIGN`` rewrite covers rows of 8 * odd bf16
elements), single-element ones where rows start off boundaries or columns are strided. For the gated kernels it
reports the widest load and store; for RMSNorm, whose weight is read aligned whatever the rows, the number of
single-element accesses. ``tests/test_benchmark_scripts.py`` runs it.

    python benchmarks/compile_offline.py [--arch 90]

Exit status 1 if any compilation fails or a layout expected to be vectorised is not.
"""

import argparse
import importlib
import os
import re
import sys
from pathlib import Path

# Compiling needs the real JIT functions, not the interpreter's (a test run on a CPU machine exports it).
os.environ.pop("TRITON_INTERPRET", None)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
ELEMENTS_PER_16_BYTES = {"bf16": 8, "fp16": 8, "fp32": 4}
# How the launchers' integer arguments get specialised by Triton's JIT: "1" (a constexpr 1), "D" (divisible by 16)
# or "" (a plain i32). A contiguous (T, I) tensor has strides (0, I, 1); the fused [gate | up] halves have (0, 2I, 1)
# and an up pointer I elements further on. With I a multiple of 16 (every LLM width), the row length, the row
# strides and the pointers are all divisible by 16. "length_aligned" is a row length that is a multiple of 16 bytes
# but not of 16 elements (bf16 rows of 5000), where RMSNorm passes ALIGN > 1 and SwiGLU has no such rewrite.
LAYOUTS = {
    # name: (specialisation of n_cols and the strides, pointers 16-byte aligned, vectorised by SwiGLU, by RMSNorm)
    "aligned": ({"n_cols": "D", "outer": "D", "inner": "D", "col": "1"}, True, True, True),
    "length_aligned": ({"n_cols": "", "outer": "D", "inner": "", "col": "1"}, True, False, True),
    "odd_width": ({"n_cols": "", "outer": "D", "inner": "", "col": "1"}, False, False, False),
    "column_stride": ({"n_cols": "D", "outer": "D", "inner": "D", "col": ""}, True, False, False),
}
# RMSNorm launches: (kernel, block_rows, block_cols, single pass, prefetch, dense); rows of up to 1000 elements fit
# in one 1024-wide block, longer ones are walked in 1024-wide chunks. The forward's prefetch (None here) follows the
# layout, as its launcher chooses it: on for rows accessed 16 bytes at a time, off otherwise. ``dense``: the forward's
# DENSE (rows of exactly one block, back to back), compiled for the aligned layout only.
RMS_NORM_TILES = [("forward", 2, 1024, True, None, False), ("forward", 2, 1024, True, None, True),
                  ("forward", 1, 1024, False, None, False),
                  ("backward", 2, 1024, True, True, False), ("backward", 1, 8192, True, False, False),
                  ("backward", 1, 1024, False, False, False)]


def load_kernels(family):
    """``kernels_src/<family>.py``, imported from the package (as register_report.py does) so that its relative
    imports resolve."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module(f"kernels_src.{family}")


def signature_and_attrs(kernel, pointer_type, layout, fp32_pointers=()):
    """ASTSource's signature, constexprs (stride-1 arguments) and divisibility attributes for one layout."""
    strides, aligned = layout[0], layout[1]
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name.endswith("_ptr"):
            signature[name] = "*fp32" if name in fp32_pointers else pointer_type
            if aligned or name in fp32_pointers:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif name.isupper():
            signature[name] = "constexpr"
        elif name == "eps":
            signature[name] = "fp32"
        else:
            kind = next((k for k in ("outer", "inner", "col") if name.endswith(f"stride_{k}")), None)
            if name == "n_cols":
                spec = strides["n_cols"]
            elif kind:
                spec = strides[kind]
            else:  # out/d row strides follow the row length; n_rows and rows_inner do not matter
                spec = strides["n_cols"] if name.endswith("stride_row") else ""
            if spec == "1":
                signature[name] = "constexpr"
                constexprs[(index,)] = 1
            else:
                signature[name] = "i32"
                if spec == "D":
                    attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


# Qualifiers between ``ld.global``/``st.global`` and the access's type, cache and eviction hints included
# (``.L1::evict_last``, ``.L2::cache_hint``), but not a vector width (``.v4``).
QUALIFIERS = r"(?:\.(?!v\d)[A-Za-z0-9_:]+)*"


def widest(ptx, op):
    widths = [int(w) for w in re.findall(rf"{op}\.global{QUALIFIERS}\.v(\d)", ptx)]
    return max(widths, default=1)


def scalar_accesses(ptx, bits):
    """Global loads and stores of single ``bits``-wide values (not vectors)."""
    return len(re.findall(rf"(?:ld|st)\.global{QUALIFIERS}\.[bfsu]{bits}\s", ptx))


def compile_ptx(kernel, signature, constexprs, attrs, num_warps, target, label):
    """The PTX of one specialisation, or None (reported) when it does not compile."""
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options={"num_warps": num_warps})
    except Exception as error:  # report every failing combination, not only the first
        print(f"FAIL {label} {type(error).__name__}: {str(error).strip().splitlines()[-1]}")
        return None
    return compiled.asm["ptx"]


def check_gated(target):
    kernels = load_kernels("swiglu")
    failures = 0
    for kernel in (kernels._gated_forward_kernel, kernels._gated_backward_kernel):
        for activation, activation_id in kernels.ACTIVATION_IDS.items():
            for dtype, pointer_type in DTYPES.items():
                for layout_name, layout in LAYOUTS.items():
                    signature, constexprs, attrs = signature_and_attrs(kernel, pointer_type, layout)
                    for name, value in (("ACTIVATION", activation_id), ("BLOCK_ROWS", 1), ("BLOCK_COLS", 1024)):
                        constexprs[(kernel.arg_names.index(name),)] = value
                    label = f"{kernel.fn.__name__:<26} {activation:<9} {dtype:<4} {layout_name:<14}"
                    ptx = compile_ptx(kernel, signature, constexprs, attrs, 4, target, label)
                    if ptx is None:
                        failures += 1
                        continue
                    loads, stores = widest(ptx, "ld"), widest(ptx, "st")
                    vectorised = loads >= 4 and stores >= 4 if dtype == "fp32" else loads >= 4 and stores >= 2
                    ok = vectorised or not layout[2]
                    failures += not ok
                    print(f"{'ok  ' if ok else 'SLOW'} {label} ld.v{loads} st.v{stores}")
    return failures


def check_rms_norm(target):
    kernels = load_kernels("rms_norm")
    failures = 0
    for kernel_name, block_rows, block_cols, single_pass, prefetch, dense in RMS_NORM_TILES:
        kernel = getattr(kernels, f"_rms_norm_{kernel_name}_kernel")
        for dtype, pointer_type in DTYPES.items():
            for layout_name, layout in LAYOUTS.items():
                if dense and layout_name != "aligned":
                    continue
                signature, constexprs, attrs = signature_and_attrs(
                    kernel, pointer_type, layout, fp32_pointers=("rstd_ptr", "dw_partial_ptr"))
                align = ELEMENTS_PER_16_BYTES[dtype] if layout_name == "length_aligned" else 1
                values = dict(MODE=kernels.MODE_IDS["llama"], HAS_WEIGHT=True, HAS_RESIDUAL=False, COMPUTE_DW=True,
                              HAS_D_RESIDUAL=False, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
                              SINGLE_PASS=single_pass, PREFETCH=layout[3] if prefetch is None else prefetch,
                              OUTPUT_COLS=block_cols // 2, ALIGN=align, DENSE=dense)
                for name in kernel.arg_names:
                    if name in values:
                        constexprs[(kernel.arg_names.index(name),)] = values[name]
                tile = f"{block_rows}x{block_cols}{'' if single_pass else ' chunks'}{' dense' if dense else ''}"
                label = f"{kernel.fn.__name__:<26} {tile:<13} {dtype:<4} {layout_name:<14}"
                ptx = compile_ptx(kernel, signature, constexprs, attrs, 4, target, label)
                if ptx is None:
                    failures += 1
                    continue
                # Widest access is no criterion here (the weight is always read aligned): count single-element
                # accesses instead; one 32-bit one is rstd's.
                scalar = scalar_accesses(ptx, 32 if dtype == "fp32" else 16)
                ok = scalar <= 1 or not layout[3]
                failures += not ok
                print(f"{'ok  ' if ok else 'SLOW'} {label} {scalar} single-element accesses")
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    failures = check_gated(target) + check_rms_norm(target)
    print(f"{failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
