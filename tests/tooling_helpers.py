"""Helpers shared by the build/check tests (test_build.py, test_check.py).

They build from a *snapshot* of the working tree: the source paths the builder reads (tracked and untracked,
not ignored files, exactly what `git status` considers) copied into a fresh git repository with one commit.
That makes the build clean or dirty on demand and independent of the state of the developer's checkout.
The snapshot and its full build are made once per session (memoised here, so every test module shares them).
The build is never imported in the pytest process: imports happen in subprocesses, so no __pycache__ lands in it.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, run_tool  # run_tool: `python -m fused_kernels_tools ARGS` (check=False: inspect)

TOOLS_DIR = REPO_ROOT / "tools"
if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))

SOURCE_PATHS = ("build.toml", "build-matrix.toml", ".gitignore", "torch-ext", "kernels_src")
GIT = ["git", "-c", "user.name=fused-kernels-tests", "-c", "user.email=tests@invalid", "-c", "commit.gpgsign=false"]

_session: dict[str, object] = {}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def make_snapshot(dest: Path) -> Path:
    """A one-commit git repository holding the working tree's source paths; returns `dest`."""
    listed = git(REPO_ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *SOURCE_PATHS)
    dest.mkdir(parents=True)
    for rel in filter(None, listed.split("\0")):
        if (REPO_ROOT / rel).is_file():  # ls-files --cached still lists files deleted in the work tree
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO_ROOT / rel, dest / rel)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "snapshot")
    return dest


def session_snapshot(tmp_path_factory) -> Path:
    if "snapshot" not in _session:
        _session["snapshot"] = make_snapshot(tmp_path_factory.mktemp("snapshot") / "src")
    return _session["snapshot"]


def session_build(tmp_path_factory) -> Path:
    """Every variant of the clean snapshot, built once by the real CLI. Treat as read-only."""
    if "build" not in _session:
        out = tmp_path_factory.mktemp("clean-build") / "build"
        run_tool("build", "--source", str(session_snapshot(tmp_path_factory)), "--out", str(out))
        _session["build"] = out
    return _session["build"]


def copy_variants(build: Path, dest: Path, *names: str) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(build / name, dest / name)
    return dest


def read_metadata(variant: Path) -> dict:
    return json.loads((variant / "metadata.json").read_text())


def write_metadata(variant: Path, metadata: dict) -> None:
    (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")


def rehash(variant: Path) -> None:
    """Recompute the digest after a deliberate edit, so a test sees only the problem it planted."""
    from kernels._rust import Digest, DigestAlgorithm

    metadata = read_metadata(variant)
    metadata["digest"]["files"] = dict(sorted(Digest.hash_variant(DigestAlgorithm.SHA256, variant).files.items()))
    write_metadata(variant, metadata)


def with_tools_on_path() -> str:
    """PYTHONPATH for a subprocess: `tools/` first, then whatever this process had (a machine whose packages
    live on PYTHONPATH, such as the GPU host's, must keep them)."""
    return os.pathsep.join(filter(None, [str(TOOLS_DIR), os.environ.get("PYTHONPATH")]))


def require_module(name: str):
    """Import `name`, or skip the test where it is not installed; under CI=true (where requirements-dev.txt is
    installed) a missing module is a failure, so CI never skips silently."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} must be installed under CI=true: {error}")
        pytest.skip(f"{name} is not installed here ({error})")


def python_subprocess(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter without a GPU and without writing bytecode."""
    full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONPATH": with_tools_on_path(), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True)
