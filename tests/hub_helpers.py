"""Helpers for tests that talk to the local Hub server (`fused_kernels_tools.hub.HubServer`).

huggingface_hub reads `HF_ENDPOINT` when it is imported (doc §0.5) and the rest of the suite imports it (through
`kernels`) long before these tests run, so there are two ways to point a client at the local server:

- a fresh interpreter: `run_client(code, hub_env(server.url, tmp_path / "hf-home"))`. This is what
  `kernels.get_kernel` / `install_kernel` need, since kernels also captures its cache directory at import;
- in this process, for huggingface_hub alone: `use_local_hub(monkeypatch, server.url, hf_home)` patches the
  import-time constants (endpoint, download URL template, cache, agent-registry cache), so plain
  `HfApi()`, `hf_hub_download` and `snapshot_download` reach the local server.

Never set HF_HUB_DISABLE_TELEMETRY / DO_NOT_TRACK / DISABLE_TELEMETRY for kernels 0.17.2 clients: its
user agent then ends in a space and every request fails (doc §0.4); `hub_env` removes them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import REPO_ROOT

TOOLS_DIR = REPO_ROOT / "tools"
if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))

from fused_kernels_tools.hub import HubServer  # noqa: E402
from tooling_helpers import with_tools_on_path  # noqa: E402

# Variables that break kernels 0.17.2 (telemetry off), force offline mode, or send the client elsewhere.
REMOVED_VARS = ("HF_HUB_DISABLE_TELEMETRY", "DO_NOT_TRACK", "DISABLE_TELEMETRY", "HF_HUB_OFFLINE",
                "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "KERNELS_CACHE", "LOCAL_KERNELS", "HF_TOKEN_PATH",
                "HUGGING_FACE_HUB_TOKEN", "HF_HUB_DISABLE_XET")


@contextmanager
def running_hub(tmp_path: Path, **server_kwargs) -> Iterator[HubServer]:
    """A started HubServer storing under `tmp_path / "hub"` (or `root=`); stopped on exit."""
    root = server_kwargs.pop("root", tmp_path / "hub")
    with HubServer(root, **server_kwargs) as server:
        yield server


def hub_env(url: str, hf_home: Path, token: str | None = "hf_test") -> dict:
    """A full copy of os.environ for a client subprocess that talks to the hub at `url`, with its own
    HF_HOME (cache, token file) and `tools/` on PYTHONPATH. token=None: no HF_TOKEN at all. The GPU is hidden,
    so what the client loads (the torch-cpu variant) is the same on every machine."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    for name in REMOVED_VARS:
        env.pop(name, None)
    env["HF_ENDPOINT"] = url
    env["HF_HOME"] = str(hf_home)
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if token is None:
        env.pop("HF_TOKEN", None)
    else:
        env["HF_TOKEN"] = token
    for name in ("NO_PROXY", "no_proxy"):
        env[name] = ",".join(filter(None, [env.get(name), "127.0.0.1", "localhost"]))
    env["PYTHONPATH"] = with_tools_on_path()
    return env


def run_client(code: str, env: dict, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh interpreter (so HF_ENDPOINT from `env` is seen at import time).
    check=True raises AssertionError with the output when the exit status is not 0."""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"client failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def use_local_hub(monkeypatch, url: str, hf_home: Path, token: str | None = "hf_test") -> None:
    """Point the already-imported huggingface_hub of this process at `url` for the current test: the
    endpoint *and* the download URL template (patching only the endpoint sends downloads to huggingface.co),
    the cache (`hf_home/hub`), the agent-registry cache and the stored-token path (`hf_home/token`).
    Not enough for kernels, which captured its cache directory at import: use run_client for get_kernel."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(hf_home / ".agent_harnesses.json"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(hf_home / "token"))  # not the developer's login
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    if token is None:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    else:
        monkeypatch.setenv("HF_TOKEN", token)


def hub_api(server: HubServer, token: str | bool | None = "hf_test"):
    """An HfApi bound to `server` (token=False: send no token at all)."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=server.url, token=token)
