"""The source revision a build is named after: `<first 7 hex of HEAD>` plus `_dirty` for a dirty tree."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .errors import ToolError


@dataclass(frozen=True)
class SourceRevision:
    commit: str  # 40 hex digits
    dirty: bool

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{40}", self.commit):
            raise ToolError(f"commit must be 40 lowercase hex digits, got {self.commit!r}")

    @property
    def rev(self) -> str:
        return self.commit[:7] + ("_dirty" if self.dirty else "")


def _git(source: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise ToolError(result.stderr.strip() or f"git {' '.join(args)} failed")
    return result.stdout


def git_revision(source: Path) -> SourceRevision:
    """HEAD of the git checkout holding `source`; dirty when `git status --porcelain` lists anything
    (tracked changes or untracked files; ignored files do not count)."""
    try:
        _git(source, "rev-parse", "--show-toplevel")
    except (ToolError, FileNotFoundError) as e:
        raise ToolError(
            f"{source} is not a git checkout ({e}); the build id comes from its commit."
            " Build from a git checkout, or pass --commit (and --dirty) for an exported tree."
        ) from None
    try:
        commit = _git(source, "rev-parse", "--verify", "HEAD").strip()
    except ToolError:
        raise ToolError(f"{source}: the git checkout has no commit yet; commit the source first") from None
    dirty = bool(_git(source, "status", "--porcelain", "--untracked-files=normal").strip())
    return SourceRevision(commit, dirty)
