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
    written = build(args.source, out, args.only, revision, version=args.version)
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


def _release(args: argparse.Namespace) -> int:
    from .releases import build_releases, list_releases

    releases_file = args.releases if args.releases is not None else args.source / "releases.toml"
    if args.release_command == "list":
        for line in list_releases(args.source, releases_file):
            print(line)
        return 0
    build_releases(args.source, releases_file, args.out, args.versions, args.only, args.allow_dirty)
    return 0


def _publish(args: argparse.Namespace) -> int:
    from .publish import Options, publish

    return publish(Options(args.build_dir, args.source, args.repo_id, args.branch, args.dry_run, args.card,
                           args.releases, not args.no_release_check, args.allow_dirty))


def _demo(args: argparse.Namespace) -> int:
    from .demo import demo_main

    return demo_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fused-kernels-tools", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="emit the build variants")
    build.add_argument("--source", type=Path, default=_default_source(), help="source checkout (default: repository root)")
    build.add_argument("--out", type=Path, default=None, help="output directory (default: <source>/build)")
    build.add_argument("--only", nargs="+", metavar="VARIANT", help="build only these variants")
    build.add_argument("--commit", help="source commit (40 hex) for a tree without .git, e.g. a Nix flake source")
    build.add_argument("--dirty", action="store_true", help="with --commit: the tree has uncommitted changes")
    build.add_argument("--version", type=int, default=None,
                       help="published version (metadata version, Hub branch v<N>): the release table (releases.toml)"
                            " decides the published version; build.toml's `version` is the development line's")
    build.set_defaults(run=_build)

    check = commands.add_parser("check", help="verify a build directory")
    check.add_argument("build_dir", type=Path, nargs="?", default=Path("build"))
    check.add_argument("--static-only", action="store_true", help="skip the per-variant import checks")
    check.add_argument("--jobs", type=int, default=None, help="parallel import checks (default: CPU count)")
    check.set_defaults(run=_check)

    from .hub.cli import add_hub_parser  # `hub serve`: the local Hub server (hub/)

    add_hub_parser(commands)

    release = commands.add_parser("release", help="the published versions of releases.toml: list or build them")
    release_commands = release.add_subparsers(dest="release_command", required=True)
    for sub in (release_commands.add_parser("list", help="each version, its branch, source commit and api"),
                release_build := release_commands.add_parser("build", help="build each version from its own source")):
        sub.add_argument("--source", type=Path, default=_default_source(), help="git checkout (default: repository root)")
        sub.add_argument("--releases", type=Path, default=None, help="release table (default: <source>/releases.toml)")
    release_build.add_argument("--out", type=Path, required=True, help="output directory: <out>/v<N>/<variant>/")
    release_build.add_argument("--versions", type=int, nargs="+", metavar="N", help="only these versions (default: all)")
    release_build.add_argument("--only", nargs="+", metavar="VARIANT", help="build only these variants")
    release_build.add_argument("--allow-dirty", action="store_true",
                               help="build HEAD from a working tree with uncommitted changes (local try-outs only)")
    release.set_defaults(run=_release)

    publish = commands.add_parser("publish", help="upload a build to branch v<version> of the Hub kernel repository"
                                  " (HF_ENDPOINT; token from HF_TOKEN or the stored login)")
    publish.add_argument("build_dir", type=Path, help="a build: variant directories (e.g. <release out>/v2, or build/)")
    publish.add_argument("--source", type=Path, default=_default_source(),
                         help="source checkout for the defaults below (default: repository root)")
    publish.add_argument("--repo-id", help="Hub repository (default: build.toml [general.hub] repo-id)")
    publish.add_argument("--branch", help="branch (default: v<metadata version>)")
    publish.add_argument("--dry-run", action="store_true", help="print every operation, change nothing")
    publish.add_argument("--card", type=Path, help="card template for README.md on main (default: <source>/CARD.md)")
    publish.add_argument("--releases", type=Path, help="release table the build must match (default: <source>/releases.toml)")
    publish.add_argument("--no-release-check", action="store_true",
                         help="skip the release-table check (API and pinned commit of the version)")
    publish.add_argument("--allow-dirty", action="store_true",
                         help="publish a build of a dirty tree (local Hub try-outs only)")
    publish.set_defaults(run=_publish)

    demo = commands.add_parser("demo", help="build v1/v2, publish them to a local Hub, load them back, check the ops")
    demo.add_argument("--source", type=Path, default=_default_source(), help="git checkout (default: repository root)")
    demo.add_argument("--workdir", type=Path, help="work directory, kept afterwards (default: a temporary one, removed)")
    demo.add_argument("--keep", action="store_true", help="keep the work directory (builds, Hub storage)")
    demo.set_defaults(run=_demo)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
