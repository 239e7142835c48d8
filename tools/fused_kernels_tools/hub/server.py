"""HTTP side of the local Hub: routing, request bodies, responses, tokens.

It speaks the subset of the Hugging Face Hub protocol that huggingface_hub 2.4.0 and kernels 0.17.2 use
(/work/shared/docs/hub-http-protocol.md, §9.2): repositories of every type (kernels is what matters),
branches and tags, tree listings, preupload, NDJSON commits, resolve (HEAD/GET with Range), the git-LFS
batch API with signed PUT URLs, commit history, organization overviews (trusted kernel publishers) and
validate-yaml. It never offers Xet: no `xetHash` in trees, no `X-Xet-*` headers.

Rules every answer follows:
- logical errors are 4xx with a JSON body `{"error": ...}`, `X-Error-Message` and, where huggingface_hub
  maps it to an exception class, `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound); the server
  never answers 5xx (the client retries those for about 20 s), an unexpected exception becomes a 400;
- the request body is always consumed (or the connection closed) before the next request is read, and
  every response carries Content-Length, so keep-alive connections stay in sync;
- a body larger than `max_body_bytes` is refused with 413 before it is read;
- with a token configured, writes need `Authorization: Bearer <token>` (401 without, 403 when wrong);
  the token and request headers are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .store import (
    NAME_RE, PLURAL_TO_TYPE, PREFIX_TO_TYPE, REPO_TYPES, SHA256_RE, Commit, HubError, Repo, Store, check_repo_id,
    check_repo_path, parse_commit_ndjson, read_chunks, tree_listing,
)

logger = logging.getLogger("fused_kernels_tools.hub")

DEFAULT_PAGE_SIZE = 1000
LFS_URL_TTL_S = 3600
HOST_RE = re.compile(r"(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?")
SAFE_HEADER_CHARS = re.compile(r"[^\x20-\x7e]")


@dataclass
class Response:
    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    file: Path | None = None  # streamed instead of `body`
    offset: int = 0
    length: int = 0

    @property
    def content_length(self) -> int:
        return self.length if self.file is not None else len(self.body)


def json_response(obj: Any, status: int = 200, content_type: str = "application/json") -> Response:
    return Response(status, [("Content-Type", content_type)], json.dumps(obj).encode())


def header_safe(text: str, limit: int = 1000) -> str:
    return SAFE_HEADER_CHARS.sub(" ", text)[:limit]


def error_response(error: HubError) -> Response:
    response = json_response({"error": error.message}, error.status)
    response.headers.append(("X-Error-Message", header_safe(error.message)))
    if error.code:
        response.headers.append(("X-Error-Code", error.code))
    response.headers.extend(error.headers.items())
    return response


def _flag(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes")


class Request:
    """One parsed request. The body is read on demand (`body()` or `iter_body()`); whatever the route did
    not read is drained by the handler before the response goes out."""

    def __init__(self, handler: "_Handler", max_body_bytes: int):
        self.handler = handler
        self.method: str = handler.command
        target = handler.path
        if not target.startswith("/"):  # absolute-form request target
            target = urllib.parse.urlsplit(target).path or "/"
        raw_path, _, raw_query = target.partition("?")
        segments = raw_path.split("/")[1:]
        if len(segments) > 1 and segments[-1] == "":
            segments.pop()
        self.raw_path = raw_path
        self.segments = [urllib.parse.unquote(s) for s in segments]
        self.query = {k: v[-1] for k, v in urllib.parse.parse_qs(raw_query, keep_blank_values=True).items()}
        self.headers = handler.headers
        self.max_body_bytes = max_body_bytes
        self.chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        self._left = 0
        self.consumed = not self.chunked
        self.broken = False  # refused half-way (too large, malformed chunks): the connection must close
        # A body that must not be read (too large, unknown length): answered with this error, then the
        # connection is closed.
        self.refused: HubError | None = None
        length = self.headers.get("Content-Length")
        if not self.chunked and length is not None:
            if not length.strip().isdigit():
                self.refused, self.consumed = HubError(400, f"Invalid Content-Length {length!r}"), False
            elif int(length) > max_body_bytes:
                self.refused, self.consumed = HubError(
                    413, f"Request body of {int(length)} bytes is larger than this server accepts "
                         f"({max_body_bytes} bytes)"), False
            else:
                self._left = int(length)
                self.consumed = self._left == 0

    def base_url(self, fallback: str) -> str:
        host = self.headers.get("Host")
        return f"http://{host}" if host and HOST_RE.fullmatch(host) else fallback

    def iter_body(self, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        rfile = self.handler.rfile
        if self.consumed:
            return
        if not self.chunked:
            while self._left > 0:
                chunk = rfile.read(min(chunk_size, self._left))
                if not chunk:
                    raise ConnectionError("client closed the connection in the middle of the body")
                self._left -= len(chunk)
                yield chunk
            self.consumed = True
            return
        total = 0
        while True:
            line = rfile.readline(1026)
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                self.broken = True
                raise HubError(400, "Malformed chunked request body") from None
            if size == 0:
                while rfile.readline(1026) not in (b"\r\n", b"\n", b""):
                    pass
                self.consumed = True
                return
            total += size
            if total > self.max_body_bytes:
                self.broken = True
                raise HubError(413, f"Request body is larger than this server accepts ({self.max_body_bytes} bytes)")
            left = size
            while left > 0:
                chunk = rfile.read(min(chunk_size, left))
                if not chunk:
                    raise ConnectionError("client closed the connection in the middle of the body")
                left -= len(chunk)
                yield chunk
            rfile.readline(3)

    def body(self) -> bytes:
        return b"".join(self.iter_body())

    def json(self) -> Any:
        data = self.body()
        if not data.strip():
            return {}
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise HubError(400, f"Malformed JSON body: {e}") from None

    def drain(self) -> None:
        for _ in self.iter_body():
            pass


# Route patterns: literal segments, SEG (any one segment), TYPE (a plural repo type), REST (the remaining
# segments, possibly none).
SEG, TYPE, REST = object(), object(), object()


def _match(pattern: tuple, segments: list[str]) -> list | None:
    captured: list = []
    for i, token in enumerate(pattern):
        if token is REST:
            captured.append(segments[i:])
            return captured
        if i >= len(segments):
            return None
        if token is SEG:
            captured.append(segments[i])
        elif token is TYPE:
            if segments[i] not in PLURAL_TO_TYPE:
                return None
            captured.append(PLURAL_TO_TYPE[segments[i]])
        elif token != segments[i]:
            return None
    return captured if len(segments) == len(pattern) else None


class HubApp:
    """The routes, over one Store. Independent of the socket layer (the handler feeds it Requests)."""

    def __init__(self, store: Store, token: str | None, trusted_orgs: Iterable[str], lfs_threshold: int | None,
                 max_body_bytes: int, page_size: int):
        self.store = store
        self.token = token
        self.trusted_orgs = frozenset(trusted_orgs)
        self.lfs_threshold = lfs_threshold
        self.max_body_bytes = max_body_bytes
        self.page_size = page_size
        self.url = ""  # set once the socket is bound
        self._lfs_secret = os.urandom(32)
        api = "api"
        self.routes: list[tuple[tuple, dict[str, Callable], bool]] = [
            # (pattern, {method: handler}, handler wants the repo resolved from (type, ns, name) captures)
            ((api, "repos", "create"), {"POST": self.create_repo}, False),
            ((api, "repos", "delete"), {"DELETE": self.delete_repo}, False),
            ((api, "validate-yaml"), {"POST": self.validate_yaml}, False),
            ((api, "agent-harnesses"), {"GET": self.agent_harnesses}, False),
            ((api, "whoami-v2"), {"GET": self.whoami}, False),
            ((api, "organizations", SEG, "overview"), {"GET": self.organization_overview}, False),
            ((api, TYPE, SEG, SEG), {"GET": self.repo_info}, True),
            ((api, TYPE, SEG, SEG, "revision", SEG), {"GET": self.repo_info}, True),
            ((api, TYPE, SEG, SEG, "refs"), {"GET": self.refs}, True),
            ((api, TYPE, SEG, SEG, "branch", SEG), {"POST": self.create_branch, "DELETE": self.delete_branch}, True),
            ((api, TYPE, SEG, SEG, "tag", SEG), {"POST": self.create_tag, "DELETE": self.delete_tag}, True),
            ((api, TYPE, SEG, SEG, "tree", SEG, REST), {"GET": self.tree}, True),
            ((api, TYPE, SEG, SEG, "paths-info", SEG), {"POST": self.paths_info}, True),
            ((api, TYPE, SEG, SEG, "preupload", SEG), {"POST": self.preupload}, True),
            ((api, TYPE, SEG, SEG, "commit", SEG), {"POST": self.commit}, True),
            ((api, TYPE, SEG, SEG, "commits", SEG), {"GET": self.commits}, True),
            ((api, TYPE, SEG, SEG, "xet-write-token", SEG), {"GET": self.no_xet}, True),
            ((api, TYPE, SEG, SEG, "xet-read-token", SEG), {"GET": self.no_xet}, True),
            (("_lfs", "upload", SEG), {"PUT": self.lfs_put}, False),
            (("_lfs", "objects", SEG), {"GET": self.lfs_get}, False),
        ]

    # ------------------------------------------------------------------------------------- dispatch

    def dispatch(self, req: Request) -> Response:
        method = "GET" if req.method == "HEAD" else req.method
        segments = req.segments
        for pattern, handlers, wants_repo in self.routes:
            captured = _match(pattern, segments)
            if captured is None:
                continue
            handler = handlers.get(method)
            if handler is None:
                allowed = ", ".join(sorted(handlers))
                raise HubError(405, f"Method {req.method} is not allowed on {req.raw_path} (allowed: {allowed})",
                               headers={"Allow": allowed})
            if wants_repo:
                repo_type, namespace, name, *rest = captured
                return handler(req, (repo_type, check_repo_id(namespace, name)), *rest)
            return handler(req, *captured)
        # web URLs: [<prefix>/]<ns>/<name>/resolve/<rev>/<path...> and [<prefix>/]<ns>/<name>.git/info/lfs/...
        for repo_type, rest in self._web_candidates(segments):
            if len(rest) >= 5 and rest[2] == "resolve":
                if method != "GET":
                    raise HubError(405, f"Method {req.method} is not allowed on resolve URLs", headers={"Allow": "GET, HEAD"})
                return self.resolve(req, (repo_type, check_repo_id(rest[0], rest[1])), rest[3], rest[4:])
            if rest[2:] == ["info", "lfs", "objects", "batch"] and rest[1].endswith(".git"):
                if method != "POST":
                    raise HubError(405, "The LFS batch API takes POST", headers={"Allow": "POST"})
                return self.lfs_batch(req, (repo_type, check_repo_id(rest[0], rest[1][: -len(".git")])))
        raise HubError(404, f"Not found: {req.method} {req.raw_path}")

    @staticmethod
    def _web_candidates(segments: list[str]) -> Iterator[tuple[str, list[str]]]:
        if len(segments) >= 4 and segments[0] in PREFIX_TO_TYPE:
            yield PREFIX_TO_TYPE[segments[0]], segments[1:]
        if len(segments) >= 3:
            yield "model", segments

    def require_write(self, req: Request) -> None:
        if self.token is None:
            return
        authorization = req.headers.get("Authorization")
        if not authorization:
            raise HubError(401, "This server requires a token for writes: send 'Authorization: Bearer <token>'",
                           headers={"WWW-Authenticate": "Bearer"})
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
            raise HubError(403, "Invalid token for this server: writes are refused")

    def repo(self, key: tuple[str, str]) -> Repo:
        return self.store.get_repo(*key)

    def base(self, req: Request) -> str:
        return req.base_url(self.url)

    def repo_url(self, req: Request, repo: Repo) -> str:
        return f"{self.base(req)}/{repo.url_prefix}{repo.repo_id}"

    # ------------------------------------------------------------------------------------- misc

    def agent_harnesses(self, req: Request) -> Response:
        return json_response({"standardEnvVars": [], "harnesses": {}})

    def validate_yaml(self, req: Request) -> Response:
        req.json()
        return json_response({"errors": [], "warnings": []})

    def whoami(self, req: Request) -> Response:
        if self.token is not None:
            self.require_write(req)
        return json_response({"type": "user", "name": "local", "fullname": "local",
                              "orgs": [{"type": "org", "name": o} for o in sorted(self.trusted_orgs)],
                              "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    def organization_overview(self, req: Request, org: str) -> Response:
        if not NAME_RE.fullmatch(org):
            raise HubError(404, f"Organization {org!r} not found")
        return json_response({"name": org, "fullname": org, "avatarUrl": "", "type": "org", "isVerified": False,
                              "numUsers": 0, "numModels": 0, "numDatasets": 0, "numSpaces": 0, "numFollowers": 0,
                              "trustedKernelPublisher": org in self.trusted_orgs})

    def no_xet(self, req: Request, key: tuple[str, str], revision: str) -> Response:
        self.repo(key)
        raise HubError(400, "This server has no Xet storage. Large files go through git-LFS: set "
                            "HF_HUB_DISABLE_XET=1 on the client (the server answers uploadMode 'lfs' for files of "
                            "at least lfs_threshold bytes).")

    # ------------------------------------------------------------------------------------- repos

    def _repo_key_from_body(self, body: dict) -> tuple[str, str]:
        name, organization = body.get("name"), body.get("organization")
        repo_type = body.get("type") or "model"
        if not isinstance(repo_type, str) or repo_type not in REPO_TYPES:
            raise HubError(400, f"Invalid repo type {repo_type!r}: expected one of {', '.join(REPO_TYPES)}")
        if not isinstance(name, str) or not isinstance(organization, str):
            raise HubError(400, "Give the repository as 'organization' and 'name' (this server has no user "
                                "namespaces: use repo ids of the form ns/name)")
        return repo_type, check_repo_id(organization, name)

    def create_repo(self, req: Request) -> Response:
        self.require_write(req)
        body = req.json()
        if not isinstance(body, dict):
            raise HubError(400, "Expected a JSON object")
        repo_type, repo_id = self._repo_key_from_body(body)
        private = bool(body.get("private")) or body.get("visibility") == "private"
        url = f"{self.base(req)}/{REPO_TYPES[repo_type][1]}{repo_id}"
        try:
            repo = self.store.create_repo(repo_type, repo_id, private)
        except HubError as e:
            if e.status == 409:  # huggingface_hub's exist_ok reads "url" from the 409 body
                response = json_response({"error": e.message, "url": url}, 409)
                response.headers.append(("X-Error-Message", header_safe(e.message)))
                return response
            raise
        return json_response({"url": url, "name": repo.repo_id, "id": repo.repo_id})

    def delete_repo(self, req: Request) -> Response:
        self.require_write(req)
        body = req.json()
        if not isinstance(body, dict):
            raise HubError(400, "Expected a JSON object")
        self.store.delete_repo(*self._repo_key_from_body(body))
        return json_response({})

    def repo_info(self, req: Request, key: tuple[str, str], revision: str = "main") -> Response:
        repo = self.repo(key)
        commit = self.store.resolve(repo, revision)
        return json_response({
            "_id": hashlib.sha1(f"{repo.repo_type}/{repo.repo_id}".encode()).hexdigest()[:24],
            "id": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": commit.id,
            "private": repo.private, "gated": False, "disabled": False, "likes": 0, "downloads": 0, "tags": [],
            "lastModified": commit.date, "createdAt": repo.created_at,
            "siblings": [{"rfilename": p} for p in sorted(commit.files)],
        })

    def refs(self, req: Request, key: tuple[str, str]) -> Response:
        repo = self.repo(key)
        with self.store.lock:
            branches, tags = dict(repo.branches), dict(repo.tags)
        result: dict[str, list] = {
            "branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": c} for b, c in sorted(branches.items())],
            "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": c} for t, c in sorted(tags.items())],
            "converts": [],
        }
        if _flag(req.query.get("include_prs")):
            result["pullRequests"] = []
        return json_response(result)

    def create_branch(self, req: Request, key: tuple[str, str], branch: str) -> Response:
        self.require_write(req)
        body = req.json()
        if not isinstance(body, dict):
            raise HubError(400, "Expected a JSON object")
        if body.get("emptyBranch"):
            raise HubError(400, "emptyBranch is not supported by this server")
        start = body.get("startingPoint")
        if start is not None and not isinstance(start, str):
            raise HubError(400, "startingPoint must be a string")
        repo = self.repo(key)
        self.store.create_branch(repo, branch, start)
        return json_response({})

    def delete_branch(self, req: Request, key: tuple[str, str], branch: str) -> Response:
        self.require_write(req)
        self.store.delete_branch(self.repo(key), branch)
        return json_response({})

    def create_tag(self, req: Request, key: tuple[str, str], revision: str) -> Response:
        self.require_write(req)
        body = req.json()
        if not isinstance(body, dict) or not isinstance(body.get("tag"), str):
            raise HubError(400, "Expected a JSON object with 'tag'")
        self.store.create_tag(self.repo(key), body["tag"], revision)
        return json_response({})

    def delete_tag(self, req: Request, key: tuple[str, str], tag: str) -> Response:
        self.require_write(req)
        self.store.delete_tag(self.repo(key), tag)
        return json_response({})

    # ------------------------------------------------------------------------------------- listings

    def _page(self, req: Request, items: list, next_url: Callable[[int], str]) -> Response:
        cursor_text = req.query.get("cursor", "0")
        if not cursor_text.isdigit():
            raise HubError(400, f"Invalid cursor {cursor_text!r}")
        cursor = int(cursor_text)
        page = items[cursor: cursor + self.page_size]
        response = json_response(page)
        if cursor + self.page_size < len(items):
            response.headers.append(("Link", f'<{next_url(cursor + self.page_size)}>; rel="next"'))
        return response

    def _last_commit(self, repo: Repo, commit: Commit, path: str) -> dict:
        last = self.store.last_commit_touching(repo, commit, path)
        return {"id": last.id, "title": last.title, "date": last.date}

    def tree(self, req: Request, key: tuple[str, str], revision: str, path_segments: list[str]) -> Response:
        repo = self.repo(key)
        commit = self.store.resolve(repo, revision)
        path = "/".join(path_segments)
        recursive, expand = _flag(req.query.get("recursive")), _flag(req.query.get("expand"))
        entries = tree_listing(commit.files, path, recursive)
        quoted_path = "/" + urllib.parse.quote(path, safe="") if path else ""
        response = self._page(req, entries, lambda cursor: (
            f"{self.base(req)}/api/{repo.plural}/{repo.repo_id}/tree/{commit.id}{quoted_path}?"
            + urllib.parse.urlencode({"recursive": str(recursive).lower(), "expand": str(expand).lower(),
                                      "cursor": cursor})))
        if expand:
            page = json.loads(response.body)
            for entry in page:
                entry["lastCommit"] = self._last_commit(repo, commit, entry["path"])
            response.body = json.dumps(page).encode()
        return response

    def paths_info(self, req: Request, key: tuple[str, str], revision: str) -> Response:
        repo = self.repo(key)
        content_type = (req.headers.get("Content-Type") or "").lower()
        raw = req.body()
        if content_type.startswith("application/json"):
            try:
                body = json.loads(raw or b"{}")
            except (ValueError, UnicodeDecodeError) as e:
                raise HubError(400, f"Malformed JSON body: {e}") from None
            paths, expand = body.get("paths", []), bool(body.get("expand"))
        else:
            form = urllib.parse.parse_qs(raw.decode("utf-8", "replace"))
            paths, expand = form.get("paths", []), _flag((form.get("expand") or ["false"])[-1])
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise HubError(400, "'paths' must be a list of strings")
        commit = self.store.resolve(repo, revision)
        result = []
        for path in paths:
            path = path.strip("/")
            if not path:
                continue
            check_repo_path(path)
            if path in commit.files:
                entry = commit.files[path].tree_json(path)
            else:
                parent = path.rsplit("/", 1)[0] if "/" in path else ""
                try:
                    siblings = tree_listing(commit.files, parent, recursive=False)
                except HubError:
                    continue
                entry = next((e for e in siblings if e["path"] == path), None)
                if entry is None:
                    continue
            if expand:
                entry["lastCommit"] = self._last_commit(repo, commit, path)
            result.append(entry)
        return json_response(result)

    def commits(self, req: Request, key: tuple[str, str], revision: str) -> Response:
        repo = self.repo(key)
        head = self.store.resolve(repo, revision)
        items = [{"id": c.id, "title": c.title, "message": c.message, "date": c.date, "parents": list(c.parents),
                  "authors": [{"user": c.author, "avatar": None}]} for c in self.store.history(repo, head)]
        return self._page(req, items, lambda cursor: (
            f"{self.base(req)}/api/{repo.plural}/{repo.repo_id}/commits/{head.id}?cursor={cursor}"))

    # ------------------------------------------------------------------------------------- uploads

    def preupload(self, req: Request, key: tuple[str, str], revision: str) -> Response:
        self.require_write(req)
        repo = self.repo(key)
        body = req.json()
        if _flag(req.query.get("create_pr")):
            raise HubError(400, "Pull requests are not supported by this server")
        files = body.get("files") if isinstance(body, dict) else None
        if not isinstance(files, list):
            raise HubError(400, "Expected a JSON object with a 'files' list")
        commit = self.store.resolve(repo, revision)
        answer = []
        for item in files:
            if not isinstance(item, dict):
                raise HubError(400, "Each entry of 'files' must be an object")
            path, size = check_repo_path(item.get("path")), item.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise HubError(400, f"{path!r}: 'size' must be a non-negative integer")
            mode = "lfs" if self.lfs_threshold is not None and size > 0 and size >= self.lfs_threshold else "regular"
            existing = commit.files.get(path)
            oid = None
            if existing is not None:
                oid = existing.lfs_sha256 if mode == "lfs" else (None if existing.lfs_sha256 else existing.oid)
            answer.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return json_response({"files": answer, "commitOid": commit.id})

    def commit(self, req: Request, key: tuple[str, str], revision: str) -> Response:
        self.require_write(req)
        repo = self.repo(key)
        if _flag(req.query.get("create_pr")):
            raise HubError(400, "Pull requests are not supported by this server")
        branch = revision[len("refs/heads/"):] if revision.startswith("refs/heads/") else revision
        if branch not in repo.branches:
            raise HubError(404, f"Invalid rev id: {revision} is not a branch of {repo.repo_id}", "RevisionNotFound")
        header, operations = parse_commit_ndjson(req.body())
        commit = self.store.commit(repo, branch, operations, header.get("summary") or "Upload files",
                                   header.get("description") or "", header.get("parentCommit"))
        return json_response({"commitOid": commit.id, "commitUrl": f"{self.repo_url(req, repo)}/commit/{commit.id}",
                              "pullRequestUrl": None})

    # ------------------------------------------------------------------------------------- LFS

    def _lfs_signature(self, oid: str, size: int, expires: int) -> str:
        return hmac.new(self._lfs_secret, f"{oid}:{size}:{expires}".encode(), hashlib.sha256).hexdigest()

    def lfs_batch(self, req: Request, key: tuple[str, str]) -> Response:
        body = req.json()
        if not isinstance(body, dict) or not isinstance(body.get("objects"), list):
            raise HubError(400, "Expected an LFS batch request with 'objects'")
        operation = body.get("operation")
        if operation not in ("upload", "download"):
            raise HubError(400, f"Unknown LFS operation {operation!r}")
        if operation == "upload":
            self.require_write(req)
        self.repo(key)
        if body.get("hash_algo", "sha256") != "sha256":
            raise HubError(400, "Only sha256 LFS objects are supported")
        base, expires = self.base(req), int(time.time()) + LFS_URL_TTL_S
        objects = []
        for obj in body["objects"]:
            oid, size = (obj.get("oid"), obj.get("size")) if isinstance(obj, dict) else (None, None)
            if not isinstance(oid, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise HubError(400, "Each LFS object needs a string 'oid' and a non-negative integer 'size'")
            if not SHA256_RE.fullmatch(oid):
                objects.append({"oid": oid, "size": size, "error": {"code": 422, "message": "oid must be a sha256"}})
                continue
            stored = self.store.lfs_size(oid)
            if operation == "download":
                if stored is None:
                    objects.append({"oid": oid, "size": size, "error": {"code": 404, "message": "Object does not exist"}})
                else:
                    objects.append({"oid": oid, "size": stored, "actions": {"download": {"href": f"{base}/_lfs/objects/{oid}"}}})
            elif stored == size:
                objects.append({"oid": oid, "size": size})  # already stored: no actions, the client skips it
            elif size > self.max_body_bytes:
                objects.append({"oid": oid, "size": size, "error": {
                    "code": 422, "message": f"Object larger than this server accepts ({self.max_body_bytes} bytes)"}})
            else:
                query = urllib.parse.urlencode({"size": size, "expires": expires,
                                                "sig": self._lfs_signature(oid, size, expires)})
                objects.append({"oid": oid, "size": size, "actions": {"upload": {"href": f"{base}/_lfs/upload/{oid}?{query}"}}})
        return json_response({"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                             content_type="application/vnd.git-lfs+json")

    def lfs_put(self, req: Request, oid: str) -> Response:
        """PUT of an LFS object to the signed URL from the batch answer (the client sends no token here)."""
        size_text, expires_text, signature = (req.query.get(k, "") for k in ("size", "expires", "sig"))
        if not SHA256_RE.fullmatch(oid) or not size_text.isdigit() or not expires_text.isdigit():
            raise HubError(400, "Malformed LFS upload URL")
        size, expires = int(size_text), int(expires_text)
        if not hmac.compare_digest(signature, self._lfs_signature(oid, size, expires)):
            raise HubError(403, "Invalid LFS upload signature: ask the batch API for a new URL")
        if expires < time.time():
            raise HubError(403, "Expired LFS upload URL: ask the batch API for a new one")
        if self.store.lfs_size(oid) == size:
            req.drain()
        else:
            self.store.put_lfs(oid, size, req.iter_body())
        return json_response({})

    def lfs_get(self, req: Request, oid: str) -> Response:
        if not SHA256_RE.fullmatch(oid) or self.store.lfs_size(oid) is None:
            raise HubError(404, f"LFS object {oid} not found", "EntryNotFound")
        path = self.store.lfs_path(oid)
        return Response(200, [("Content-Type", "application/octet-stream")], file=path, length=path.stat().st_size)

    # ------------------------------------------------------------------------------------- downloads

    def resolve(self, req: Request, key: tuple[str, str], revision: str, path_segments: list[str]) -> Response:
        repo = self.repo(key)
        commit = self.store.resolve(repo, revision)
        path = check_repo_path("/".join(path_segments))
        entry = commit.files.get(path)
        if entry is None:
            raise HubError(404, f"Entry {path!r} not found at {revision}", "EntryNotFound",
                           headers={"X-Repo-Commit": commit.id})
        content = self.store.content_path(entry)
        if not content.is_file():  # a damaged store: say so, without a 5xx the client would retry
            raise HubError(404, f"The content of {path!r} ({entry.etag}) is missing from this server's store",
                           "EntryNotFound", headers={"X-Repo-Commit": commit.id})
        headers = [("X-Repo-Commit", commit.id), ("ETag", f'"{entry.etag}"'), ("Accept-Ranges", "bytes"),
                   ("Content-Type", "application/octet-stream")]
        if entry.lfs_sha256:
            headers += [("X-Linked-Etag", f'"{entry.lfs_sha256}"'), ("X-Linked-Size", str(entry.size))]
        start, length, status = 0, entry.size, 200
        byte_range = req.headers.get("Range")
        if byte_range:
            parsed = _parse_range(byte_range, entry.size)
            if parsed == "unsatisfiable":
                raise HubError(416, f"Range {byte_range!r} is outside the file ({entry.size} bytes)",
                               headers={"Content-Range": f"bytes */{entry.size}", "X-Repo-Commit": commit.id})
            if parsed is not None:
                start, end = parsed
                length, status = end - start + 1, 206
                headers.append(("Content-Range", f"bytes {start}-{end}/{entry.size}"))
        return Response(status, headers, file=content, offset=start, length=length)


def _parse_range(value: str, size: int) -> tuple[int, int] | str | None:
    """A single `bytes=a-b`, `bytes=a-` or `bytes=-n` range; None (serve everything) for anything else."""
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", value)
    if not match or (not match.group(1) and not match.group(2)):
        return None
    first, last = match.group(1), match.group(2)
    if not first:
        n = int(last)
        if n == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or (last and int(last) < start):
        return "unsatisfiable"
    return start, end


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fused-kernels-hub"
    timeout = 300  # seconds a connection may stay silent (keep-alive idle or a stalled body)
    # Headers and a small body leave in one segment, without Nagle: otherwise every answer on a keep-alive
    # connection waits for the client's delayed ACK (about 40 ms).
    disable_nagle_algorithm = True
    wbufsize = 1 << 16
    server: "_HTTPServer"

    def handle_one_request(self) -> None:
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline, self.request_version, self.command = "", "", ""
                self.send_error(414, "Request line too long")
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return
            self._serve()
            self.wfile.flush()
        except (TimeoutError, ConnectionError, OSError):
            self.close_connection = True

    def handle_expect_100(self) -> bool:
        length = self.headers.get("Content-Length")
        if length and length.strip().isdigit() and int(length) > self.server.app.max_body_bytes:
            self.send_error(413, f"Request body larger than this server accepts ({self.server.app.max_body_bytes} bytes)")
            return False
        super().handle_expect_100()
        self.wfile.flush()  # the interim 100 Continue must leave now, not with the final answer
        return True

    def _serve(self) -> None:
        started = time.monotonic()
        app = self.server.app
        req: Request | None = None
        try:
            req = Request(self, app.max_body_bytes)
            if req.refused is not None:
                raise req.refused
            response = app.dispatch(req)
        except HubError as e:
            response = error_response(e)
        except (ConnectionError, TimeoutError):
            raise
        except Exception as e:  # a bug in a route: answer 400 (never 5xx, which clients retry) and keep serving
            logger.exception("hub: unexpected error in %s %s", self.command, req.raw_path if req else "?")
            response = error_response(HubError(400, f"Unexpected server error: {type(e).__name__}: {e}"))
        if req is None or req.refused is not None or req.broken:
            self.close_connection = True
        elif not req.consumed:
            try:
                req.drain()
            except HubError as e:
                response = error_response(e)
                self.close_connection = True
        self._send(response, head=self.command == "HEAD")
        if self.close_connection and req is not None and not req.consumed:
            self._linger()
        if self.server.log_requests:
            elapsed_ms = (time.monotonic() - started) * 1000
            path = req.raw_path if req else "?"
            print(f"hub: {self.command} {path} -> {response.status} ({response.content_length} bytes, "
                  f"{elapsed_ms:.0f} ms)", file=sys.stderr, flush=True)

    def _send(self, response: Response, head: bool) -> None:
        self.send_response(response.status)
        for name, value in response.headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(response.content_length))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if head:
            return
        if response.file is None:
            self.wfile.write(response.body)
            return
        with open(response.file, "rb") as f:
            for chunk in read_chunks(f, response.offset, response.length):
                self.wfile.write(chunk)

    def _linger(self) -> None:
        """After refusing a body we did not read: send what we have, then read and drop a bounded amount of
        what the client is still sending, so closing the socket does not reset the connection before the
        client has read our answer."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(2)
            dropped = 0
            while dropped < 64 << 20:
                chunk = self.connection.recv(1 << 16)
                if not chunk:
                    break
                dropped += len(chunk)
        except OSError:
            pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Errors raised by the request-line/header parser: same JSON shape as the routes, never 5xx."""
        status = 400 if code >= 500 else code
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # a status line and headers even for an unparseable request
        response = error_response(HubError(status, message or self.responses.get(code, ("Bad request",))[0]))
        try:
            self._send(response, head=getattr(self, "command", "") == "HEAD")
        except OSError:
            pass

    def version_string(self) -> str:
        return self.server_version

    def log_request(self, code: object = "-", size: object = "-") -> None:
        pass  # requests are logged by _serve when enabled (method, path, status; never headers)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], app: HubApp, log_requests: bool):
        self.app = app
        self.log_requests = log_requests
        self._connections: set[socket.socket] = set()
        self._handlers: set[threading.Thread] = set()
        self._connections_lock = threading.Lock()
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address), daemon=True)
        with self._connections_lock:
            self._connections.add(request)
            self._handlers.add(thread)
        thread.start()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._connections_lock:
                self._handlers.discard(threading.current_thread())

    def wait_for_handlers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._connections_lock:
            handlers = list(self._handlers)
        for thread in handlers:
            thread.join(max(0.0, deadline - time.monotonic()))

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("hub: connection error from %s", client_address, exc_info=True)


class HubServer:
    """A Hub-compatible HTTP server over the repositories stored under `root`.

    `HubServer(root).start()` binds `host:port` (port 0: a free port), serves in a daemon thread and
    returns the server; `url` is then "http://127.0.0.1:PORT". `stop()` closes the listening socket and the
    open connections and releases `root`. Also a context manager (start on enter, stop on exit).

    token: when set, every write (create/delete repo, branches, tags, preupload, commit, LFS upload) needs
    `Authorization: Bearer <token>`; reads stay open. trusted_orgs: organizations reported as trusted
    kernel publishers (`kernels.get_kernel` without `trust_remote_code`). lfs_threshold: files of at least
    this many bytes are uploaded through git-LFS (clients must set HF_HUB_DISABLE_XET=1); None: every file
    goes inline. page_size: entries per page of tree and commit listings (the Hub uses 1000).
    log_requests: one line per request on stderr (method, path, status; never headers).
    """

    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 trusted_orgs: Iterable[str] = (), lfs_threshold: int | None = None,
                 max_body_bytes: int = 2 * 1024**3, *, page_size: int = DEFAULT_PAGE_SIZE,
                 log_requests: bool = False):
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        if lfs_threshold is not None and lfs_threshold < 1:
            raise ValueError("lfs_threshold must be at least 1 byte")
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be at least 1")
        if token is not None and not token:
            raise ValueError("token must be a non-empty string or None")
        self.root = Path(root)
        self.host, self.port = host, port
        orgs = (trusted_orgs,) if isinstance(trusted_orgs, str) else tuple(trusted_orgs)
        self._options = dict(token=token, trusted_orgs=orgs, lfs_threshold=lfs_threshold,
                             max_body_bytes=max_body_bytes, page_size=page_size)
        self._log_requests = log_requests
        self._httpd: _HTTPServer | None = None
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self.store: Store | None = None
        self.app: HubApp | None = None

    def __repr__(self) -> str:  # never shows the token
        state = self.url if self._httpd else "stopped"
        return f"HubServer(root={str(self.root)!r}, {state})"

    def start(self) -> "HubServer":
        if self._httpd is not None:
            raise RuntimeError("the hub server is already running")
        store = Store(self.root)
        try:
            app = HubApp(store, **self._options)
            httpd = _HTTPServer((self.host, self.port), app, self._log_requests)
        except BaseException:
            store.close()
            raise
        self.store, self.app, self._httpd = store, app, httpd
        self._port = httpd.server_address[1]
        app.url = self.url
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"hub-server-{self.port_number}", daemon=True)
        self._thread.start()
        return self

    @property
    def port_number(self) -> int:
        """The bound port (still known after stop(), for messages and for tests that check it is closed)."""
        if self._port is None:
            raise RuntimeError("the hub server was never started")
        return self._port

    @property
    def url(self) -> str:
        host = self.host
        if host in ("", "0.0.0.0"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port_number}"

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.close_connections()
        httpd.wait_for_handlers(timeout=10)  # their sockets are closed: they finish at once
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        assert self.store is not None
        self.store.close()  # waits for a commit in progress, then refuses further changes

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
