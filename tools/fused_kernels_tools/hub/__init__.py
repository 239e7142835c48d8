"""A small Hugging Face Hub-compatible server for offline use, air-gapped clusters and tests.

`huggingface_hub` (2.4.0) and `kernels` (0.17.2) work against it through `HF_ENDPOINT`: create kernel
repositories, branches `vN`, upload folders (inline, or git-LFS with `HF_HUB_DISABLE_XET=1`), list refs and
trees, download files and snapshots, and `kernels.get_kernel(repo, version=N)`. Standard library only.

    from fused_kernels_tools.hub import HubServer
    with HubServer(root, trusted_orgs=["myorg"]) as server:   # or HubServer(...).start() / .stop()
        env = {"HF_ENDPOINT": server.url, ...}

Command line: `python -m fused_kernels_tools hub serve --root DIR [--port-file FILE] ...`.
Storage layout: store.py. HTTP routes and protocol rules: server.py.
"""

from .server import HubServer
from .store import HubError, Store

__all__ = ["HubServer", "HubError", "Store"]
