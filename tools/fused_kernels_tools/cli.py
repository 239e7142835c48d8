"""Command line: `python -m fused_kernels_tools build|check` (also the `fused-kernels-tools` script)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import ToolError


def _default_source() -> Path:
    """The repository these tools live in (tools/fused_kernels_tools/), else the current directory (when
    installed as the `fused-kernels-tools` script)."""
    checkout = Path(__file__).resolve().parents[2]
    return checkout if (checkout / "build.toml").is_file() else Path.cwd()


def _build(args: argparse.Namespace) -> int:
    from .build import build
    from .gitrev import SourceRevision

    revision = None
    if args.commit:
        revision = SourceRevision(args.commit, args.dirty)
    elif args.dirty:
        raise ToolError("--dirty needs --commit")
    out = args.out if args.out is not None else args.source / "build"
    written = build(args.source, out, args.only, revision)
    for variant in written:
        print(f"built {out / variant.name}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from .check import check_build

    problems, summaries = check_build(args.build_dir, runtime=not args.static_only, jobs=args.jobs)
    for line in summaries:
        print(line)
    for problem in problems:
        print(f"ERROR {args.build_dir / problem.where}: {problem.message}", file=sys.stderr)
    if problems:
        print(f"check failed: {len(problems)} problem(s) in {args.build_dir}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fused-kernels-tools", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="emit the build variants")
    build.add_argument("--source", type=Path, default=_default_source(), help="source checkout (default: repository root)")
    build.add_argument("--out", type=Path, default=None, help="output directory (default: <source>/build)")
    build.add_argument("--only", nargs="+", metavar="VARIANT", help="build only these variants")
    build.add_argument("--commit", help="source commit (40 hex) for a tree without .git, e.g. a Nix flake source")
    build.add_argument("--dirty", action="store_true", help="with --commit: the tree has uncommitted changes")
    build.set_defaults(run=_build)

    check = commands.add_parser("check", help="verify a build directory")
    check.add_argument("build_dir", type=Path, nargs="?", default=Path("build"))
    check.add_argument("--static-only", action="store_true", help="skip the per-variant import checks")
    check.add_argument("--jobs", type=int, default=None, help="parallel import checks (default: CPU count)")
    check.set_defaults(run=_check)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
