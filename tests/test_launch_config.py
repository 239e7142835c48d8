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
