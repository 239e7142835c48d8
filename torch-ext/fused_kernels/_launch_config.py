"""Launch configurations, shipped as data (``configs/<family>.json``) and looked up per GPU model.

Nothing here autotunes or touches the GPU at import: the tables are read on first use, and the device is
asked for its name and multiprocessor count only when an op first runs on it. ``benchmarks/tune_*.py``
regenerates the tables on a GPU.

Table format: ``{kernel: {device name | "default" | "cpu": [entry, ...]}}``. A GPU without entries of its own
uses those of the tuned GPU of its architecture (``_SAME_ARCHITECTURE``), else "default". Entries are sorted by
``max_cols``; the first entry whose ``max_cols`` is at least the row length is used, and the last entry
(``max_cols`` null) covers every longer row. An entry may also hold ``max_elements``: it then serves only calls of at
most that many elements (launchers that pass ``n_elements``), and a later entry for the same rows without it serves
the larger calls. An entry without ``block_cols`` processes a whole row per block
(``block_cols = next_power_of_2(n_cols)``).
"""

import functools
import json
import os

import torch

_CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
# Under the interpreter a "program" is a Python loop iteration: a handful keeps persistent grids exercised.
_INTERPRETER_PROGRAMS = 3
# Compute capability -> the tuned GPU whose entries serve other GPUs of that capability without entries of their
# own. H100, H800 and GH200 have the H200's SM (registers, shared memory, tensor cores), so its tiles fit and keep
# their balance of compute to on-chip memory; only the HBM bandwidth differs. Not measured on those GPUs: the
# tuners (benchmarks/tune_*.py) give them entries of their own.
_SAME_ARCHITECTURE = {(9, 0): "NVIDIA H200"}


@functools.cache
def _table(family: str) -> dict:
    with open(os.path.join(_CONFIG_DIR, f"{family}.json"), encoding="utf-8") as f:
        return json.load(f)


@functools.cache
def _device_name(device_type: str, index: int) -> str:
    if device_type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(index)


@functools.cache
def _capability(device_type: str, index: int) -> tuple[int, int] | None:
    if device_type != "cuda":
        return None
    return torch.cuda.get_device_capability(index)


@functools.cache
def _multiprocessors(device_type: str, index: int) -> int:
    if device_type != "cuda":
        return _INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    if device.type == "cuda" and device.index is None:
        return torch.cuda.current_device()
    return device.index or 0


def pick(family: str, kernel: str, device: torch.device, n_cols: int, n_elements: int | None = None) -> dict:
    """The launch parameters for ``kernel`` of ``family`` on ``device`` for rows of ``n_cols`` elements, in a call
    of ``n_elements`` elements in all (None: entries with ``max_elements`` are skipped).

    The returned dict is shared between calls: read it, never modify it."""
    return _pick(family, kernel, device.type, _index(device), n_cols, n_elements)


def _serves(entry: dict, n_cols: int, n_elements: int | None) -> bool:
    limit = entry.get("max_elements")
    return ((entry["max_cols"] is None or n_cols <= entry["max_cols"])
            and (limit is None or (n_elements is not None and n_elements <= limit)))


def select_entry(entries: list[dict], n_cols: int, n_elements: int | None = None) -> dict:
    """The launch parameters of the first of one device's ``entries`` that serves rows of ``n_cols`` elements in a
    call of ``n_elements`` (a new dict, without ``max_cols`` and ``max_elements``). ``benchmarks/register_report.py``
    picks tiles through this too."""
    entry = next((e for e in entries if _serves(e, n_cols, n_elements)), entries[-1])
    return {k: v for k, v in entry.items() if k not in ("max_cols", "max_elements")}


def device_entries(family: str, kernel: str, device: torch.device) -> list[dict]:
    """The entries ``pick`` chooses from on ``device``: its own, else its architecture's tuned GPU's, else the
    defaults."""
    return _device_entries(family, kernel, device.type, _index(device))


def _device_entries(family: str, kernel: str, device_type: str, index: int) -> list[dict]:
    per_device = _table(family)[kernel]
    return (per_device.get(_device_name(device_type, index))
            or per_device.get(_SAME_ARCHITECTURE.get(_capability(device_type, index)))
            or per_device["default"])


@functools.lru_cache(maxsize=4096)
def _pick(family: str, kernel: str, device_type: str, index: int, n_cols: int, n_elements: int | None) -> dict:
    config = select_entry(_device_entries(family, kernel, device_type, index), n_cols, n_elements)
    config.setdefault("block_cols", 1 << max(0, (n_cols - 1).bit_length()))
    return config


def multiprocessor_count(device: torch.device) -> int:
    return _multiprocessors(device.type, _index(device))
