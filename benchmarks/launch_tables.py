"""Reading and writing tuned launch tables (``torch-ext/fused_kernels/configs/<family>.json``), shared by the tune
scripts."""

import functools
import importlib.util
import json
from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "torch-ext" / "fused_kernels" / "configs"


@functools.cache
def package_launch_config():
    """The package's own table lookup (``torch-ext/fused_kernels/_launch_config.py``), loaded by path: tools choose
    table entries exactly as the package does."""
    path = CONFIGS_DIR.parent / "_launch_config.py"
    spec = importlib.util.spec_from_file_location("fused_kernels_launch_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_table(path: Path | None, family: str) -> dict:
    """The launch table at ``path``, or without one the package's own table of ``family``."""
    return json.loads((path or CONFIGS_DIR / f"{family}.json").read_text())


def bucket_entries(configs: list[tuple[int, dict]]) -> list[dict]:
    """Table entries from ``(bucket, config)`` pairs sorted by bucket: each bucket serves the row lengths up to it
    and the last one every longer row. A config whose column block covers its whole bucket records no
    ``block_cols`` (it then follows the row length); the last bucket's block is kept, since it must also serve
    longer rows."""
    entries = []
    for i, (bucket, config) in enumerate(configs):
        last = i == len(configs) - 1
        if config["block_cols"] >= bucket and not last:
            config = {key: value for key, value in config.items() if key != "block_cols"}
        entries.append({"max_cols": None if last else bucket, **config})
    return entries


def write_device_entries(path: Path | None, device_name: str, entries: dict[str, list[dict]]) -> None:
    """Set ``device_name``'s entries for each kernel in the table at ``path``, keeping every other device's;
    without ``path``, print the table that would be written."""
    table = json.loads(path.read_text()) if path and path.exists() else {}
    for kernel, kernel_entries in entries.items():
        table.setdefault(kernel, {})[device_name] = kernel_entries
    text = json.dumps(table, indent=2) + "\n"
    if path:
        path.write_text(text)
        print(f"wrote {path}")
    else:
        print(text)
