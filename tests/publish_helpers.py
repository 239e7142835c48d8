"""Helpers for the release and publish tests (test_releases.py, test_publish.py).

`release_source` is a git repository shaped like this one at the moment v1 is pinned: commit A holds the
kernel source (a snapshot of the working tree, as in tooling_helpers), commit B adds releases.toml (v1 =
commit A, v2 = HEAD) and CARD.md. `release_build` is `release build` of it (torch-cpu and torch-cuda only),
made once per session. Treat both as read-only; copy before editing.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tooling_helpers import REPO_ROOT, git, make_snapshot, run_tool, with_tools_on_path

VARIANTS = ("torch-cpu", "torch-cuda")
REPO_ID = "myorg/fused-kernels"

_session: dict[str, object] = {}


def package_all(source: Path) -> list[str]:
    tree = ast.parse((source / "torch-ext" / "fused_kernels" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("no __all__")


def releases_toml(entries: list[tuple[int, str, list[str]]]) -> str:
    blocks = [f'[[release]]\nversion = {v}\nsource = "{s}"\napi = {api!r}\n'.replace("'", '"') for v, s, api in entries]
    return "\n".join(blocks)


def release_source(tmp_path_factory) -> Path:
    if "source" not in _session:
        src = make_snapshot(tmp_path_factory.mktemp("release-source") / "src")
        commit_a = git(src, "rev-parse", "HEAD").strip()
        api = package_all(src)
        (src / "releases.toml").write_text(releases_toml([(1, commit_a, api), (2, "HEAD", api)]))
        shutil.copyfile(REPO_ROOT / "CARD.md", src / "CARD.md")
        git(src, "add", "-A")
        git(src, "commit", "-q", "-m", "releases: v1 pinned")
        _session["source"] = src
        _session["commits"] = (commit_a, git(src, "rev-parse", "HEAD").strip())
    return _session["source"]


def release_commits(tmp_path_factory) -> tuple[str, str]:
    """(commit A = v1's source, commit B = HEAD = v2's source) of release_source."""
    release_source(tmp_path_factory)
    return _session["commits"]


def release_build(tmp_path_factory) -> Path:
    """`release build` of release_source: <out>/v1, <out>/v2, torch-cpu and torch-cuda variants."""
    if "build" not in _session:
        out = tmp_path_factory.mktemp("release-build") / "out"
        run_tool("release", "build", "--source", str(release_source(tmp_path_factory)), "--out", str(out),
                 "--only", *VARIANTS)
        _session["build"] = out
    return _session["build"]


def tool(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m fused_kernels_tools ARGS` with exactly `env` (e.g. tests/hub_helpers.hub_env)."""
    return subprocess.run([sys.executable, "-m", "fused_kernels_tools", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def publish(build_dir: Path, source: Path, env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = tool("publish", str(build_dir), "--source", str(source), *args, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"publish failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def plain_env() -> dict:
    return {**os.environ, "PYTHONPATH": with_tools_on_path(), "PYTHONDONTWRITEBYTECODE": "1"}
