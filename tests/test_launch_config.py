"""Which launch-table entries a device gets: its own, else its architecture's tuned GPU's, else the defaults."""

import os

import pytest
import torch


def _families(fk):
    """Every launch table the package ships (configs/<family>.json)."""
    return sorted(name.removesuffix(".json") for name in os.listdir(fk._launch_config._CONFIG_DIR)
                  if name.endswith(".json"))


@pytest.fixture
def simulated_gpu(fk, monkeypatch):
    """Make the launch tables see cuda:0 as a GPU of a given name and compute capability."""
    config = fk._launch_config

    def simulate(name, capability):
        monkeypatch.setattr(config, "_device_name", lambda device_type, index: name)
        monkeypatch.setattr(config, "_capability", lambda device_type, index: capability)
        config._pick.cache_clear()

    yield simulate
    config._pick.cache_clear()


def _entries_used(fk, family, kernel, n_cols):
    return fk._launch_config.pick(family, kernel, torch.device("cuda", 0), n_cols)


@pytest.mark.parametrize("name, capability, expected", [
    ("NVIDIA H200", (9, 0), "NVIDIA H200"),
    ("NVIDIA H100 80GB HBM3", (9, 0), "NVIDIA H200"),     # no entries of its own: the H200's (same SM)
    ("NVIDIA A100-SXM4-80GB", (8, 0), "default"),
    ("NVIDIA B200", (10, 0), "default"),
])
def test_device_gets_its_own_else_its_architectures_else_default_entries(fk, simulated_gpu, name, capability,
                                                                         expected):
    config = fk._launch_config
    checked = 0
    for family in _families(fk):
        for kernel, per_device in config._table(family).items():
            assert "default" in per_device, f"{family}/{kernel} has no default entries"
            for n_cols in (64, 128, 256, 4096, 131072):
                want = config.select_entry(per_device.get(expected) or per_device["default"], n_cols)
                simulated_gpu(name, capability)
                # The picked parameters are the entry's (plus a derived block_cols where the entry has none).
                assert want.items() <= _entries_used(fk, family, kernel, n_cols).items(), (family, kernel, n_cols)
                checked += 1
    assert checked > 0


def test_the_architecture_fallback_names_a_tuned_gpu(fk):
    """Every GPU the fallback points at has entries in every family's table (a misspelt name would silently mean
    the defaults); kernels with a single launch for every device may have default entries only."""
    config = fk._launch_config
    for gpu in config._SAME_ARCHITECTURE.values():
        for family in _families(fk):
            assert any(gpu in per_device for per_device in config._table(family).values()), (family, gpu)


def test_entries_are_chosen_by_row_length_then_by_call_size(fk):
    config = fk._launch_config
    entries = [{"max_cols": 64, "num_warps": 1},
               {"max_cols": 4096, "max_elements": 1000, "num_warps": 2}, {"max_cols": 4096, "num_warps": 4},
               {"max_cols": None, "max_elements": 10_000, "num_warps": 8}, {"max_cols": None, "num_warps": 16}]
    cases = [((64, 10**9), 1), ((65, 1000), 2), ((4096, 1000), 2), ((4096, 1001), 4), ((4097, 10_000), 8),
             ((4097, 10_001), 16), ((10**6, 1), 8), ((100, None), 4), ((10**6, None), 16)]
    for (n_cols, n_elements), warps in cases:
        assert config.select_entry(entries, n_cols, n_elements) == {"num_warps": warps}, (n_cols, n_elements)


def test_an_entry_limited_by_size_is_followed_by_one_for_larger_calls(fk):
    """A launcher that passes no size skips ``max_elements`` entries, and a larger call must find an entry too."""
    config = fk._launch_config
    for family in _families(fk):
        for kernel, per_device in config._table(family).items():
            for device, entries in per_device.items():
                for i, entry in enumerate(entries):
                    if "max_elements" in entry:
                        assert any(later["max_cols"] == entry["max_cols"] and "max_elements" not in later
                                   for later in entries[i + 1:]), (family, kernel, device, i)


# What the launchers read from each kernel's entries (besides ``max_cols`` and ``max_elements``, which select the
# entry). The optional keys are read with a default, so a misspelt one would be ignored without a word (a
# "max_granule_ratio" under another name would switch its rule off): the tables may hold these keys only.
_FLASH_ATTN_TILE = {"block_m", "block_n", "num_warps", "num_stages", "one_loop", "heavy_first", "desc",
                    "desc_min_flops", "without_desc"}
_READ_KEYS = {
    ("rms_norm", "forward"): {"block_rows", "block_cols", "num_warps", "two_pass"},
    ("rms_norm", "forward_unaligned"): {"block_rows", "block_cols", "num_warps", "two_pass"},
    ("rms_norm", "backward"): {"block_rows", "block_cols", "num_warps", "programs_per_sm"},
    ("rms_norm", "backward_unaligned"): {"block_rows", "block_cols", "num_warps", "programs_per_sm"},
    ("cross_entropy", "rows"): {"block_cols", "num_warps", "num_stages"},
    ("cross_entropy", "constants"): {"block_cols", "num_warps"},
    ("cross_entropy", "scale"): {"block_cols", "num_warps", "programs_per_sm"},
    ("rope", "rope"): {"block_s", "block_h", "num_warps"},
    ("swiglu", "forward"): {"block_rows", "block_cols", "num_warps", "one_row"},
    ("swiglu", "backward"): {"block_rows", "block_cols", "num_warps"},
    ("flash_attn", "forward"): _FLASH_ATTN_TILE | {"pv_fence", "pipelined", "short"},
    ("flash_attn", "backward_dkdv"): _FLASH_ATTN_TILE | {"group_loop"},
    ("flash_attn", "backward_dq"): _FLASH_ATTN_TILE | {"from_ds"},
}
# Keys whose values are entries of their own, and what those may hold (``without_desc``: any key of its entry that
# switches a tile setting).
_NESTED_KEYS = {
    "short": {"max_seqlen_k", "block_m", "block_n", "num_warps", "num_stages"},
    "from_ds": {"block_m", "block_n", "num_warps", "num_stages", "heavy_first", "budget", "min_flops", "min_programs",
                "max_granule_ratio"},
}


def test_launch_tables_hold_only_keys_the_launchers_read(fk):
    config = fk._launch_config
    kernels = {(family, kernel) for family in _families(fk) for kernel in config._table(family)}
    assert kernels == set(_READ_KEYS), "a table's kernels changed: update _READ_KEYS with what its launcher reads"
    for family, kernel in sorted(kernels):
        allowed = _READ_KEYS[family, kernel]
        switches = allowed - {"without_desc", "desc", "desc_min_flops", "short", "from_ds"}
        for device, entries in config._table(family)[kernel].items():
            for entry in entries:
                where = (family, kernel, device, entry.get("max_cols"))
                keys = set(entry) - {"max_cols", "max_elements"}
                assert keys <= allowed, (where, keys - allowed)
                for key, nested in entry.items():
                    if key == "without_desc":
                        assert set(nested) <= switches, (where, key, set(nested) - switches)
                    elif key in _NESTED_KEYS:
                        assert set(nested) <= _NESTED_KEYS[key], (where, key, set(nested) - _NESTED_KEYS[key])
