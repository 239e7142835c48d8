"""Compile the gated-activation (SwiGLU/GeGLU) kernels for a real GPU target without a GPU.

Triton's CPU interpreter accepts code the GPU front end rejects (type mismatches across branches, wrong
constexpr use), so this compiles every kernel for sm_90 through ``triton.compile`` for each activation, dtype
and argument specialisation the launchers produce, and reports the widest global load and store in the PTX
(16-byte ``.v4`` accesses on the aligned unit-stride layouts; scalar ones on the unaligned or strided layout).

    python benchmarks/compile_offline.py [--arch 90]

Exit status 1 if any compilation fails or an aligned unit-stride layout is not vectorised.
"""

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
# How the launcher's integer arguments get specialised by Triton's JIT: "1" (a constexpr 1), "D" (divisible
# by 16) or "" (a plain i32). A contiguous (T, I) tensor has strides (0, I, 1); the fused [gate | up] halves
# have (0, 2I, 1) and an up pointer I elements further on. With I a multiple of 16 (every LLM width), the
# row length, the row strides and the pointers are all divisible by 16.
LAYOUTS = {
    # name: (specialisation of n_cols and the strides, pointers 16-byte aligned, vectorisation expected)
    "aligned": ({"n_cols": "D", "outer": "D", "inner": "D", "col": "1"}, True, True),
    "odd_width": ({"n_cols": "", "outer": "D", "inner": "", "col": "1"}, False, False),
    "column_stride": ({"n_cols": "D", "outer": "D", "inner": "D", "col": ""}, True, False),
}


def load_kernels():
    spec = importlib.util.spec_from_file_location("swiglu_kernels", REPO_ROOT / "kernels_src" / "swiglu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def signature_and_attrs(kernel, pointer_type, layout):
    """ASTSource's signature, constexprs (stride-1 arguments) and divisibility attributes for one layout."""
    strides, aligned, _ = layout
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name.endswith("_ptr"):
            signature[name] = pointer_type
            if aligned:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif name.isupper():
            signature[name] = "constexpr"
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


def widest(ptx, op):
    widths = [int(w) for w in re.findall(rf"{op}\.global(?:\.[a-z0-9_]+)*?\.v(\d)", ptx)]
    return max(widths, default=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    kernels = load_kernels()
    failures = 0
    for kernel in (kernels._gated_forward_kernel, kernels._gated_backward_kernel):
        for activation, activation_id in kernels.ACTIVATION_IDS.items():
            for dtype, pointer_type in DTYPES.items():
                for layout_name, layout in LAYOUTS.items():
                    signature, constexprs, attrs = signature_and_attrs(kernel, pointer_type, layout)
                    block_cols = 1024
                    for name, value in (("ACTIVATION", activation_id), ("BLOCK_ROWS", 1),
                                        ("BLOCK_COLS", block_cols)):
                        constexprs[(kernel.arg_names.index(name),)] = value
                    label = f"{kernel.fn.__name__:<24} {activation:<9} {dtype:<4} {layout_name:<14}"
                    try:
                        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                                  options={"num_warps": 4})
                    except Exception as error:  # report every failing combination, not only the first
                        failures += 1
                        print(f"FAIL {label} {type(error).__name__}: {str(error).strip().splitlines()[-1]}")
                        continue
                    ptx = compiled.asm["ptx"]
                    loads, stores = widest(ptx, "ld"), widest(ptx, "st")
                    vectorised = loads >= 4 and stores >= 4 if dtype == "fp32" else loads >= 4 and stores >= 2
                    ok = vectorised or not layout[2]
                    failures += not ok
                    print(f"{'ok  ' if ok else 'SLOW'} {label} ld.v{loads} st.v{stores}")
    print(f"{failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
