"""Writing tuned launch tables (``torch-ext/fused_kernels/configs/<family>.json``), shared by the tune scripts."""

import json
from pathlib import Path


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
