"""`python -m fused_kernels_tools hub serve`: run the local Hub server until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

from ..errors import ToolError


def _serve(args: argparse.Namespace) -> int:
    from .server import HubServer

    token = None
    if args.token_env is not None:
        token = os.environ.get(args.token_env)
        if not token:
            raise ToolError(f"--token-env {args.token_env}: that environment variable is not set or empty")
    try:
        server = HubServer(args.root, host=args.host, port=args.port, token=token, trusted_orgs=args.trusted_org,
                           lfs_threshold=args.lfs_threshold, max_body_bytes=args.max_body_bytes,
                           log_requests=args.log_requests)
    except ValueError as e:
        raise ToolError(str(e)) from None
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server.start()
        except (OSError, RuntimeError) as e:
            raise ToolError(f"cannot serve {args.root} on {args.host}:{args.port}: {e}") from None
        try:
            print(f"fused-kernels hub: serving {args.root} at {server.url}", flush=True)
            if args.port_file is not None:
                tmp = args.port_file.with_name(f".{args.port_file.name}.{os.getpid()}.tmp")
                try:
                    tmp.write_text(f"{server.port_number}\n")
                    os.replace(tmp, args.port_file)
                except OSError as e:
                    raise ToolError(f"cannot write the port file {args.port_file}: {e}") from None
            while not stop.wait(1.0):
                pass
        finally:
            server.stop()
            if args.port_file is not None:
                try:
                    args.port_file.unlink()
                except FileNotFoundError:
                    pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def add_hub_parser(commands: argparse._SubParsersAction) -> None:
    """Register `hub serve` on the tools' top-level subcommands."""
    hub = commands.add_parser("hub", help="the local Hub server (offline use, air-gapped clusters, tests)")
    hub_commands = hub.add_subparsers(dest="hub_command", required=True)
    serve = hub_commands.add_parser("serve", help="serve the repositories stored under --root over HTTP")
    serve.add_argument("--root", type=Path, required=True, help="storage directory (created if missing)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="port to bind (default: 0, a free port)")
    serve.add_argument("--token-env", metavar="VAR",
                       help="require 'Authorization: Bearer <token>' for writes, the token read from env var VAR")
    serve.add_argument("--trusted-org", action="extend", nargs="+", default=[], metavar="ORG",
                       help="report ORG as a trusted kernel publisher (repeatable)")
    serve.add_argument("--lfs-threshold", type=int, default=None, metavar="BYTES",
                       help="upload files of at least BYTES through git-LFS (clients need HF_HUB_DISABLE_XET=1)")
    serve.add_argument("--max-body-bytes", type=int, default=2 * 1024**3, metavar="BYTES",
                       help="largest request body accepted (default: 2 GiB)")
    serve.add_argument("--port-file", type=Path, default=None, metavar="FILE",
                       help="write the port to FILE once listening (removed on exit)")
    serve.add_argument("--log-requests", action="store_true", help="one line per request on stderr")
    serve.set_defaults(run=_serve)
