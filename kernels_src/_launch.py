"""Kernel launches with a fraction of the host time of ``kernel[grid](...)``.

Why. ``JITFunction.run`` binds and specialises every argument, builds the cache key, checks globals and
builds launch metadata on every call: 20-40 us of Python per launch on the H200 host, more than the GPU
time of the kernel on inputs below a few MB, and paid again for each launch of a backward. ``launch`` keeps
each compiled kernel under its own *specialisation key* and calls the compiled kernel's launcher directly.

The key holds what Triton specialises a kernel on: for each tensor its dtype and whether its address is 16-byte
aligned; for each host tensor descriptor its element type and box; for each integer whether it is 1, whether it
is divisible by 16 and whether it fits in int32; the constexpr values, ``num_warps``, ``num_stages`` and the
device. Two calls with equal keys therefore select the same compiled kernel that ``kernel[grid](...)`` would
(``tests/test_launch.py`` checks this against Triton's own binder on the GPU). Where the key holds more (an
argument Triton is told not to specialise, ``do_not_specialize``; a descriptor's extents and strides) it is finer
than Triton's, which only stores the same compiled kernel under two keys. The first call with a new
key goes through ``kernel[grid](...)``, which compiles (or loads from Triton's cache) and launches; so does every
call under the CPU interpreter, and every call while a Triton launch hook (a profiler) is installed, so profilers
still see every launch.

Computing that key walks every argument in Python (~2 us per ten arguments here, three to four times that on the
H200's hosts), so a second map, keyed on the scalar arguments' values themselves (one tuple, hashed in C), finds
the compiled kernel of a repeated call first; only a call with new values computes the specialisation key. That
map is a memo of the first (a value determines its specialisation; each launcher passes every parameter values of
one type), emptied when it grows large, as a stream of ever-new shapes would make it.
"""

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

_compiled: dict[tuple, object] = {}  # specialisation key -> compiled kernel
_by_value: dict[tuple, object] = {}  # (pointer key, scalar values) -> compiled kernel; a memo of _compiled
_BY_VALUE_LIMIT = 1 << 12  # keys of ~1-2 KB: a few MB at most
_SCALAR_TYPES = (int, float)  # bool is an int


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints. ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in recent
    Triton, about 2 us per host call, several times per launch; launchers use these instead."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _unsupported(value):
    raise TypeError(f"launch: unsupported kernel argument of type {type(value).__name__}")


def _args_key(args: tuple) -> tuple:
    """Triton's specialisation of the runtime arguments (see the module docstring), in one comprehension: a
    function call per argument cost more than the rest of the launch on the H200 host."""
    return tuple([
        (value.dtype, value.data_ptr() % 16 == 0) if isinstance(value, torch.Tensor)
        # bool before int: bool is an int subclass, and Triton types it i1.
        else (bool, value) if isinstance(value, bool)
        else (int, value == 1, value % 16 == 0, -(2**31) <= value < 2**31) if isinstance(value, int)
        else float if isinstance(value, float)
        else _descriptor_key(value) if isinstance(value, TensorDescriptor)
        else _unsupported(value)
        for value in args
    ])


def _descriptor_key(desc: TensorDescriptor) -> tuple:
    """A host tensor descriptor's specialisation: its element type, box and padding, and the base's alignment and
    every extent's and stride's integer key (finer than Triton's, which is harmless: see the module docstring)."""
    return (TensorDescriptor, desc.base.dtype, desc.base.data_ptr() % 16 == 0, tuple(desc.block_shape), desc.padding,
            tuple([(value == 1, value % 16 == 0) for value in (*desc.shape, *desc.strides)]))


def _launch_hooks_active() -> bool:
    hook = triton.knobs.runtime.launch_enter_hook
    # Triton 3.6 stores a callable or None; later versions a HookChain whose `calls` list may be empty.
    return hook is not None and bool(getattr(hook, "calls", True))


# Read once, as Triton reads it: `triton.jit` picks the interpreter when a kernel is defined (at this package's
# import), so a later change could not switch our kernels anyway; reading the environment costs ~1 us per call.
INTERPRETING = bool(triton.knobs.runtime.interpret)


def launch(kernel, grid: tuple[int, ...], pointers: tuple, scalars: tuple, constexprs: dict, num_warps: int,
           num_stages: int | None = None) -> None:
    """``kernel[grid](*pointers, *scalars, **constexprs, num_warps=num_warps[, num_stages=num_stages])``, without
    Triton's per-call binding (``num_stages`` None: Triton's default software pipelining depth).

    The kernel's runtime arguments in its parameter order: first ``pointers`` (tensors and host tensor descriptors,
    the first one a tensor or a descriptor; a pointer that a constexpr switches off may be given an int instead),
    then ``scalars`` (ints, floats, bools); ``constexprs`` are its ``tl.constexpr`` parameters, which must follow
    them in the signature. The kernel runs on the first pointer's device, whatever the
    current device is (Triton itself launches on the current one, which breaks models split across GPUs in one
    process).
    """
    if INTERPRETING or _launch_hooks_active():
        kernel[grid](*pointers, *scalars, **constexprs, **_options(num_warps, num_stages))
        return
    first = pointers[0]
    device = (first.base if isinstance(first, TensorDescriptor) else first).get_device()
    if device != torch.cuda.current_device():
        with torch.cuda.device(device):
            _launch_on(device, kernel, grid, pointers, scalars, constexprs, num_warps, num_stages)
        return
    _launch_on(device, kernel, grid, pointers, scalars, constexprs, num_warps, num_stages)


def _options(num_warps: int, num_stages: int | None) -> dict:
    return {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}


def _launch_on(device: int, kernel, grid, pointers, scalars, constexprs, num_warps, num_stages) -> None:
    """The launch, with ``device`` current."""
    constexpr_values = tuple(constexprs.values())
    # id(kernel): a JITFunction hashes its source digest in Python (~1 us); our kernels are module-level objects that
    # live as long as the process, so their ids never pass to another kernel.
    pointer_key = _args_key(pointers)  # the pointers' specialisation; the scalars are keyed by value
    value_key = (id(kernel), device, num_warps, num_stages, constexpr_values, scalars, pointer_key)
    compiled = _by_value.get(value_key)
    if compiled is None:
        compiled = _specialised(device, kernel, grid, pointers, pointer_key, scalars, constexprs, constexpr_values,
                                num_warps, num_stages)
        if compiled is None:  # Triton compiled and launched it; the next call with these values finds it
            return
        if len(_by_value) >= _BY_VALUE_LIMIT:
            _by_value.clear()
        _by_value[value_key] = compiled
    grid_x, grid_y, grid_z = (tuple(grid) + (1, 1))[:3]
    # The raw-stream getter Triton itself uses: torch.cuda.current_stream() builds a Stream object (~5 us).
    stream = torch._C._cuda_getCurrentRawStream(device)
    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *pointers, *scalars, *constexpr_values)


def _specialised(device, kernel, grid, pointers, pointer_key, scalars, constexprs, constexpr_values, num_warps,
                 num_stages):
    """The compiled kernel of these arguments' specialisation (``pointer_key``: ``_args_key(pointers)``); None when
    there was none yet, after launching the call through ``kernel[grid](...)``, which compiles it (or loads it from
    Triton's cache)."""
    if not all(isinstance(value, _SCALAR_TYPES) for value in scalars):
        raise TypeError(f"launch: {kernel.__name__}'s scalars must be ints, floats or bools, got "
                        f"{[type(value).__name__ for value in scalars]}")
    args = (*pointers, *scalars)
    key = (id(kernel), device, num_warps, num_stages, constexpr_values, pointer_key + _args_key(scalars))
    compiled = _compiled.get(key)
    if compiled is None:
        if kernel.arg_names[len(args):] != list(constexprs):
            raise ValueError(f"launch: {kernel.__name__} takes {kernel.arg_names}; pass its runtime arguments in "
                             "order, then every constexpr in order")
        _compiled[key] = kernel[grid](*args, **constexprs, **_options(num_warps, num_stages))
    return compiled
