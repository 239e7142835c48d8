"""The local Hub's data model, kept on disk under one root directory.

Layout::

    <root>/
      .lock                                  # held (flock) by the one server using this root
      objects/blobs/<2>/<38>                 # regular file contents, named by git blob sha1
      objects/lfs/<2>/<62>                   # LFS contents, named by sha256
      repos/<models|datasets|spaces|kernels>/<ns>/<name>/
        repo.json                            # {"type", "id", "private", "createdAt"}
        commits/<sha40>.json                 # immutable commit objects (parents, title, message, date, files)
        refs.json                            # {"branches": {name: sha}, "tags": {name: sha}}; written last

Every file is written to a temporary name and moved into place with os.replace. A mutation writes the
blobs first, then the commit object, then refs.json, so a crash at any point leaves the previous state
visible (plus unreferenced objects, which are harmless). A commit keeps the whole path -> file map of its
tree: simple, and small at the scale this server is meant for (tests, demos, air-gapped mirrors of a few
kernel repositories).

All repository state is read and changed under one lock (`Store.lock`); blob contents are immutable and
are streamed without it.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

# repo type -> (plural used in /api/<plural>/..., prefix of web URLs such as resolve)
REPO_TYPES: dict[str, tuple[str, str]] = {
    "model": ("models", ""),
    "dataset": ("datasets", "datasets/"),
    "space": ("spaces", "spaces/"),
    "kernel": ("kernels", "kernels/"),
}
PLURAL_TO_TYPE = {plural: repo_type for repo_type, (plural, _) in REPO_TYPES.items()}
PREFIX_TO_TYPE = {prefix.rstrip("/"): repo_type for repo_type, (_, prefix) in REPO_TYPES.items() if prefix}

SHA1_RE = re.compile(r"[0-9a-f]{40}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
HEX_PREFIX_RE = re.compile(r"[0-9a-f]{7,40}")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
MAX_PATH_LENGTH = 1024

GITATTRIBUTES = (
    b"# Files stored with Git LFS on the Hugging Face Hub.\n"
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n"
    b"*.pt filter=lfs diff=lfs merge=lfs -text\n"
    b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    b"*.so filter=lfs diff=lfs merge=lfs -text\n"
    b"*.tar.gz filter=lfs diff=lfs merge=lfs -text\n"
    b"*.zip filter=lfs diff=lfs merge=lfs -text\n"
)


class HubError(Exception):
    """A request the Hub refuses: answered with `status`, a JSON body `{"error": message}` and, when set, the
    `X-Error-Code` header that huggingface_hub maps to its exception classes."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})


def repo_not_found(repo_type: str, repo_id: str) -> HubError:
    return HubError(404, f"Repository {repo_type}s/{repo_id} not found", "RepoNotFound")


def git_blob_sha1(data: bytes) -> str:
    """The id `git hash-object` gives `data` (what the Hub calls a file's oid)."""
    h = hashlib.sha1(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file the Hub keeps in git for an LFS file."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def check_repo_path(path: object) -> str:
    """A file path inside a repository: relative, '/'-separated, no empty, '.' or '..' segment."""
    if not isinstance(path, str) or not path:
        raise HubError(400, f"Invalid path {path!r}: expected a non-empty string")
    if len(path) > MAX_PATH_LENGTH:
        raise HubError(400, f"Invalid path {path[:80]!r}...: longer than {MAX_PATH_LENGTH} characters")
    if path.startswith("/"):
        raise HubError(400, f"Invalid path {path!r}: absolute paths are not allowed")
    if "\\" in path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise HubError(400, f"Invalid path {path!r}: backslashes and control characters are not allowed")
    for segment in path.split("/"):
        if segment in ("", ".", ".."):
            raise HubError(400, f"Invalid path {path!r}: empty, '.' and '..' segments are not allowed")
    if path.split("/")[0] == ".git":
        raise HubError(400, f"Invalid path {path!r}: .git is reserved")
    return path


def check_ref_name(name: object, what: str = "branch") -> str:
    """A branch or tag name following git's ref-name rules (a subset, enough to keep names sane)."""
    bad = (
        not isinstance(name, str) or not name or len(name) > 255
        or name.startswith(("-", "/", ".", "refs/")) or name.endswith(("/", ".", ".lock"))
        or ".." in name or "//" in name or "@{" in name or name == "@"
        or any(c in name for c in " ~^:?*[\\") or any(ord(c) < 32 or ord(c) == 127 for c in name)
        or SHA1_RE.fullmatch(name) is not None
    )
    if bad:
        raise HubError(400, f"Invalid {what} name {name!r}")
    return name  # type: ignore[return-value]


def check_repo_id(namespace: str, name: str) -> str:
    for part in (namespace, name):
        if not NAME_RE.fullmatch(part) or ".." in part or part.endswith((".git", ".")):
            raise HubError(400, f"Invalid repository id {namespace}/{name!s}: use letters, digits, '-', '_', '.'")
    return f"{namespace}/{name}"


@dataclass(frozen=True)
class FileEntry:
    """One file of a commit's tree. For an LFS file, `oid` is the git sha1 of its pointer file."""

    oid: str
    size: int
    lfs_sha256: str | None = None
    pointer_size: int | None = None

    @property
    def etag(self) -> str:
        return self.lfs_sha256 or self.oid

    def to_json(self) -> dict:
        d: dict = {"oid": self.oid, "size": self.size}
        if self.lfs_sha256 is not None:
            d["lfs"] = {"oid": self.lfs_sha256, "pointerSize": self.pointer_size}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "FileEntry":
        lfs = d.get("lfs")
        if lfs is None:
            return cls(d["oid"], d["size"])
        return cls(d["oid"], d["size"], lfs["oid"], lfs["pointerSize"])

    def tree_json(self, path: str) -> dict:
        d: dict = {"type": "file", "oid": self.oid, "size": self.size, "path": path}
        if self.lfs_sha256 is not None:
            d["lfs"] = {"oid": self.lfs_sha256, "size": self.size, "pointerSize": self.pointer_size}
        return d


@dataclass(frozen=True)
class Commit:
    id: str
    parents: tuple[str, ...]
    title: str
    message: str
    date: str
    author: str
    files: Mapping[str, FileEntry]

    def to_json(self) -> dict:
        return {
            "id": self.id, "parents": list(self.parents), "title": self.title, "message": self.message,
            "date": self.date, "author": self.author,
            "files": {path: entry.to_json() for path, entry in sorted(self.files.items())},
        }

    @classmethod
    def from_json(cls, d: dict) -> "Commit":
        return cls(d["id"], tuple(d["parents"]), d["title"], d["message"], d["date"], d["author"],
                   {path: FileEntry.from_json(e) for path, e in d["files"].items()})


# Commit operations, validated and decoded before anything is written.
@dataclass(frozen=True)
class AddFile:
    path: str
    data: bytes


@dataclass(frozen=True)
class AddLfsFile:
    path: str
    sha256: str
    size: int | None


@dataclass(frozen=True)
class DeleteFile:
    path: str


@dataclass(frozen=True)
class DeleteFolder:
    path: str


Operation = AddFile | AddLfsFile | DeleteFile | DeleteFolder


def parse_commit_ndjson(body: bytes) -> tuple[dict, list[Operation]]:
    """The commit endpoint's NDJSON: a header line, then one operation per line. Raises HubError(400)."""
    header: dict | None = None
    operations: list[Operation] = []
    for number, raw in enumerate(body.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise HubError(400, f"Malformed NDJSON: line {number} is not JSON ({e})") from None
        if not isinstance(item, dict) or not isinstance(item.get("key"), str) or not isinstance(item.get("value"), dict):
            raise HubError(400, f"Malformed NDJSON: line {number} must be an object with 'key' and an object 'value'")
        key, value = item["key"], item["value"]
        if key == "header":
            if header is not None or operations:
                raise HubError(400, f"Malformed NDJSON: line {number}: the header must come first, once")
            header = value
            continue
        if header is None:
            raise HubError(400, "Malformed NDJSON: the first line must be the header")
        path = value.get("path")
        if key == "file":
            if value.get("encoding", "base64") != "base64" or not isinstance(value.get("content"), str):
                raise HubError(400, f"Line {number}: 'file' needs a base64 'content' and encoding 'base64'")
            try:
                data = base64.b64decode(value["content"], validate=True)
            except (binascii.Error, ValueError) as e:
                raise HubError(400, f"Line {number}: invalid base64 content for {path!r} ({e})") from None
            operations.append(AddFile(check_repo_path(path), data))
        elif key == "lfsFile":
            oid, size = value.get("oid"), value.get("size")
            if value.get("algo", "sha256") != "sha256" or not isinstance(oid, str) or not SHA256_RE.fullmatch(oid):
                raise HubError(400, f"Line {number}: 'lfsFile' needs algo 'sha256' and a sha256 'oid'")
            if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
                raise HubError(400, f"Line {number}: 'lfsFile' size must be a non-negative integer")
            operations.append(AddLfsFile(check_repo_path(path), oid, size))
        elif key == "deletedFile":
            operations.append(DeleteFile(check_repo_path(path)))
        elif key == "deletedFolder":
            if not isinstance(path, str):
                raise HubError(400, f"Line {number}: 'deletedFolder' needs a path")
            operations.append(DeleteFolder(check_repo_path(path.rstrip("/"))))
        else:
            raise HubError(400, f"Line {number}: unknown operation {key!r}")
    if header is None:
        raise HubError(400, "Malformed NDJSON: empty commit payload (no header line)")
    parent = header.get("parentCommit")
    if parent is not None and (not isinstance(parent, str) or not HEX_PREFIX_RE.fullmatch(parent)):
        raise HubError(400, f"Invalid parentCommit {parent!r}: expected 7 to 40 lowercase hex digits")
    for key in ("summary", "description"):
        if header.get(key) is not None and not isinstance(header[key], str):
            raise HubError(400, f"Invalid commit header: {key!r} must be a string")
    return header, operations


def tree_listing(files: Mapping[str, FileEntry], path: str, recursive: bool) -> list[dict]:
    """Tree entries (files and directories, full repo paths) under `path` ('' = root), as the Hub lists
    them: direct children, or everything below when `recursive`. Directories get a content-derived oid."""
    path = path.strip("/")
    if path:
        check_repo_path(path)
        if path in files:
            raise HubError(404, f"{path!r} is a file, not a folder", "EntryNotFound")
    prefix = f"{path}/" if path else ""
    under = sorted((p for p in files if p.startswith(prefix)), key=lambda p: p.split("/"))
    if path and not under:
        raise HubError(404, f"Folder {path!r} does not exist", "EntryNotFound")
    dir_hashes: dict[str, "hashlib._Hash"] = {}
    entries: list[tuple[list[str], dict]] = []
    for p in under:
        parts = p.split("/")
        for depth in range(len(parts) - 1):
            d = "/".join(parts[: depth + 1])
            if len(d) <= len(path):
                continue
            if d not in dir_hashes:
                dir_hashes[d] = hashlib.sha1(b"tree\0")
                if recursive or depth == len(prefix.split("/")) - 1:
                    entries.append((d.split("/"), {"type": "directory", "path": d}))
            dir_hashes[d].update(f"{p[len(d) + 1:]}\0{files[p].oid}\n".encode())
        if recursive or len(parts) == len(prefix.split("/")):
            entries.append((parts, files[p].tree_json(p)))
    entries.sort(key=lambda item: item[0])
    result = []
    for _, entry in entries:
        if entry["type"] == "directory":
            entry["oid"] = dir_hashes[entry["path"]].hexdigest()
            entry["size"] = 0
        result.append(entry)
    return result


def subtree(files: Mapping[str, FileEntry], path: str) -> dict[str, str]:
    """path -> oid of every file at or under `path` (to tell whether a commit changed it)."""
    prefix = path + "/"
    return {p: e.oid for p, e in files.items() if p == path or p.startswith(prefix)}


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


@dataclass
class Repo:
    """In-memory state of one repository (mirrors repo.json, refs.json and commits/)."""

    repo_type: str
    repo_id: str
    path: Path
    private: bool
    created_at: str
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commit_ids: set[str] = field(default_factory=set)
    commits: dict[str, Commit] = field(default_factory=dict)  # loaded lazily
    deleted: bool = False

    @property
    def plural(self) -> str:
        return REPO_TYPES[self.repo_type][0]

    @property
    def url_prefix(self) -> str:
        return REPO_TYPES[self.repo_type][1]


class Store:
    """Repositories and objects under `root`. One Store per root: a second one (another server on the same
    directory) is refused, since both would keep their own view of the refs."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self._repos: dict[tuple[str, str], Repo] = {}
        self._closed = False
        self._lock_file = open(self.root / ".lock", "a+")
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise RuntimeError(f"{self.root} is in use by another hub server") from None
        (self.root / "objects" / "blobs").mkdir(parents=True, exist_ok=True)
        (self.root / "objects" / "lfs").mkdir(parents=True, exist_ok=True)
        (self.root / "repos").mkdir(exist_ok=True)

    def close(self) -> None:
        """Wait for a change in progress, refuse further ones, release the root."""
        with self.lock:
            self._closed = True
            if not self._lock_file.closed:
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
                self._lock_file.close()

    def _check_open(self, repo: Repo | None = None) -> None:
        if self._closed:
            raise HubError(400, "The hub server is stopping: no more changes are accepted")
        if repo is not None and repo.deleted:
            raise repo_not_found(repo.repo_type, repo.repo_id)

    # ------------------------------------------------------------------------------------------ objects

    def blob_path(self, oid: str) -> Path:
        return self.root / "objects" / "blobs" / oid[:2] / oid[2:]

    def lfs_path(self, sha256: str) -> Path:
        return self.root / "objects" / "lfs" / sha256[:2] / sha256[2:]

    def content_path(self, entry: FileEntry) -> Path:
        return self.lfs_path(entry.lfs_sha256) if entry.lfs_sha256 else self.blob_path(entry.oid)

    def put_blob(self, data: bytes) -> str:
        oid = git_blob_sha1(data)
        target = self.blob_path(oid)
        if not target.exists():
            _write_atomic(target, data)
        return oid

    def lfs_size(self, sha256: str) -> int | None:
        try:
            return self.lfs_path(sha256).stat().st_size
        except FileNotFoundError:
            return None

    def put_lfs(self, sha256: str, size: int, chunks: Iterable[bytes]) -> None:
        """Store an LFS object from `chunks`, verifying its size and sha256 before it becomes visible."""
        target = self.lfs_path(sha256)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            h, n = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    h.update(chunk)
                    n += len(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if n != size:
                raise HubError(400, f"LFS object {sha256}: received {n} bytes, expected {size}")
            if h.hexdigest() != sha256:
                raise HubError(400, f"LFS object {sha256}: content sha256 is {h.hexdigest()}")
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    # ---------------------------------------------------------------------------------------- repos

    def _repo_dir(self, repo_type: str, repo_id: str) -> Path:
        return self.root / "repos" / REPO_TYPES[repo_type][0] / repo_id

    def _load_repo(self, repo_type: str, repo_id: str) -> Repo | None:
        path = self._repo_dir(repo_type, repo_id)
        try:
            refs = json.loads((path / "refs.json").read_text())
            meta = json.loads((path / "repo.json").read_text())
        except FileNotFoundError:
            return None
        commit_ids = {p.stem for p in (path / "commits").glob("*.json") if SHA1_RE.fullmatch(p.stem)}
        return Repo(repo_type, repo_id, path, bool(meta.get("private")), meta["createdAt"],
                    dict(refs["branches"]), dict(refs["tags"]), commit_ids)

    def find_repo(self, repo_type: str, repo_id: str) -> Repo | None:
        with self.lock:
            key = (repo_type, repo_id)
            if key not in self._repos:
                repo = self._load_repo(repo_type, repo_id)
                if repo is None:
                    return None
                self._repos[key] = repo
            return self._repos[key]

    def get_repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.find_repo(repo_type, repo_id)
        if repo is None:
            raise repo_not_found(repo_type, repo_id)
        return repo

    def create_repo(self, repo_type: str, repo_id: str, private: bool = False) -> Repo:
        """A new repository whose `main` holds one commit with `.gitattributes` (as on the Hub)."""
        with self.lock:
            self._check_open()
            if self.find_repo(repo_type, repo_id) is not None:
                raise HubError(409, f"You already created this {repo_type} repo: {repo_id}")
            path = self._repo_dir(repo_type, repo_id)
            if path.exists():  # leftovers of an interrupted create or delete
                shutil.rmtree(path)
            created = now_iso()
            repo = Repo(repo_type, repo_id, path, private, created)
            _write_atomic(path / "repo.json", _json_bytes(
                {"type": repo_type, "id": repo_id, "private": private, "createdAt": created}))
            commit = self._new_commit(repo, (), {".gitattributes": FileEntry(self.put_blob(GITATTRIBUTES), len(GITATTRIBUTES))},
                                      "initial commit", "")
            self._set_refs(repo, branches={"main": commit.id})
            self._repos[(repo_type, repo_id)] = repo
            return repo

    def delete_repo(self, repo_type: str, repo_id: str) -> None:
        with self.lock:
            self._check_open()
            repo = self.get_repo(repo_type, repo_id)
            trash = repo.path.parent / f".deleted-{repo.path.name}-{os.urandom(4).hex()}"
            os.replace(repo.path, trash)
            repo.deleted = True  # a request still holding this Repo must not write into it
            del self._repos[(repo_type, repo_id)]
            shutil.rmtree(trash, ignore_errors=True)

    def _set_refs(self, repo: Repo, *, branches: dict[str, str] | None = None,
                  tags: dict[str, str] | None = None) -> None:
        """Persist the new refs, then adopt them in memory: a failed write leaves both as they were."""
        branches = repo.branches if branches is None else branches
        tags = repo.tags if tags is None else tags
        _write_atomic(repo.path / "refs.json", _json_bytes({"branches": branches, "tags": tags}))
        repo.branches, repo.tags = branches, tags

    def _new_commit(self, repo: Repo, parents: tuple[str, ...], files: dict[str, FileEntry], title: str,
                    message: str, author: str = "local") -> Commit:
        date = now_iso()
        while True:
            seed = json.dumps([list(parents), sorted((p, e.oid) for p, e in files.items()), title, message, date,
                               os.urandom(8).hex()])
            commit_id = hashlib.sha1(seed.encode()).hexdigest()
            if commit_id not in repo.commit_ids:
                break
        commit = Commit(commit_id, parents, title, message, date, author, dict(files))
        _write_atomic(repo.path / "commits" / f"{commit_id}.json", _json_bytes(commit.to_json()))
        repo.commit_ids.add(commit_id)
        repo.commits[commit_id] = commit
        return commit

    # ------------------------------------------------------------------------------------- revisions

    def get_commit(self, repo: Repo, commit_id: str) -> Commit:
        with self.lock:
            commit = repo.commits.get(commit_id)
            if commit is None:
                commit = Commit.from_json(json.loads((repo.path / "commits" / f"{commit_id}.json").read_text()))
                repo.commits[commit_id] = commit
            return commit

    def resolve(self, repo: Repo, revision: str) -> Commit:
        """Branch, tag, refs/heads/<b>, refs/tags/<t>, or a unique 7-40 hex commit prefix."""
        with self.lock:
            commit_id = repo.branches.get(revision) or repo.tags.get(revision)
            if commit_id is None and revision.startswith("refs/heads/"):
                commit_id = repo.branches.get(revision[len("refs/heads/"):])
            if commit_id is None and revision.startswith("refs/tags/"):
                commit_id = repo.tags.get(revision[len("refs/tags/"):])
            if commit_id is None and HEX_PREFIX_RE.fullmatch(revision):
                matches = [c for c in repo.commit_ids if c.startswith(revision)]
                if len(matches) == 1:
                    commit_id = matches[0]
            if commit_id is None:
                raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return self.get_commit(repo, commit_id)

    def history(self, repo: Repo, commit: Commit) -> Iterator[Commit]:
        """`commit` and its first-parent ancestors, newest first."""
        while True:
            yield commit
            if not commit.parents:
                return
            commit = self.get_commit(repo, commit.parents[0])

    def last_commit_touching(self, repo: Repo, commit: Commit, path: str) -> Commit:
        state = subtree(commit.files, path)
        found = commit
        for older in self.history(repo, commit):
            if subtree(older.files, path) != state:
                break
            found = older
        return found

    # ------------------------------------------------------------------------------------- mutations

    def create_branch(self, repo: Repo, branch: str, starting_point: str | None) -> Commit:
        with self.lock:
            self._check_open(repo)
            check_ref_name(branch)
            if branch in repo.branches:
                raise HubError(409, f"Reference refs/heads/{branch} already exists")
            start = self.resolve(repo, starting_point if starting_point is not None else "main")
            self._set_refs(repo, branches={**repo.branches, branch: start.id})
            return start

    def delete_branch(self, repo: Repo, branch: str) -> None:
        with self.lock:
            self._check_open(repo)
            if branch == "main":
                raise HubError(403, "The main branch cannot be deleted")
            if branch not in repo.branches:
                raise HubError(404, f"Branch {branch!r} does not exist", "RevisionNotFound")
            self._set_refs(repo, branches={name: oid for name, oid in repo.branches.items() if name != branch})

    def create_tag(self, repo: Repo, tag: str, revision: str) -> Commit:
        with self.lock:
            self._check_open(repo)
            check_ref_name(tag, "tag")
            if tag in repo.tags:
                raise HubError(409, f"Tag {tag!r} already exists")
            target = self.resolve(repo, revision)
            self._set_refs(repo, tags={**repo.tags, tag: target.id})
            return target

    def delete_tag(self, repo: Repo, tag: str) -> None:
        with self.lock:
            self._check_open(repo)
            if tag not in repo.tags:
                raise HubError(404, f"Tag {tag!r} does not exist", "RevisionNotFound")
            self._set_refs(repo, tags={name: oid for name, oid in repo.tags.items() if name != tag})

    def commit(self, repo: Repo, branch: str, operations: list[Operation], title: str, message: str,
               parent_commit: str | None = None) -> Commit:
        """Apply `operations` in order on the head of `branch` and move the branch to the new commit, or
        change nothing. Every operation is checked against the tree before anything is written."""
        with self.lock:
            self._check_open(repo)
            if branch not in repo.branches:
                raise HubError(404, f"Invalid rev id: {branch} is not a branch", "RevisionNotFound")
            head = self.get_commit(repo, repo.branches[branch])
            if parent_commit is not None and not head.id.startswith(parent_commit):
                raise HubError(412, f"A commit has happened since parentCommit {parent_commit} on branch "
                                    f"{branch!r} (head is {head.id}); refresh and try again")
            files = dict(head.files)
            blobs: dict[str, bytes] = {}
            for op in operations:
                if isinstance(op, DeleteFile):
                    if op.path not in files:
                        raise HubError(404, f"Cannot delete {op.path!r}: file does not exist on {branch!r}",
                                       "EntryNotFound")
                    del files[op.path]
                elif isinstance(op, DeleteFolder):
                    doomed = [p for p in files if p.startswith(op.path + "/")]
                    if not doomed:
                        raise HubError(404, f"Cannot delete folder {op.path!r}: it does not exist on {branch!r}",
                                       "EntryNotFound")
                    for p in doomed:
                        del files[p]
                else:
                    self._check_no_clash(files, op.path)
                    if isinstance(op, AddFile):
                        oid = git_blob_sha1(op.data)
                        blobs[oid] = op.data
                        files[op.path] = FileEntry(oid, len(op.data))
                    else:
                        size = self.lfs_size(op.sha256)
                        if size is None:
                            raise HubError(400, f"LFS object {op.sha256} for {op.path!r} was never uploaded")
                        if op.size is not None and op.size != size:
                            raise HubError(400, f"LFS object {op.sha256} for {op.path!r} has size {size}, "
                                                f"not {op.size}")
                        pointer = lfs_pointer(op.sha256, size)
                        files[op.path] = FileEntry(git_blob_sha1(pointer), size, op.sha256, len(pointer))
            for data in blobs.values():
                self.put_blob(data)
            commit = self._new_commit(repo, (head.id,), files, title, message)
            self._set_refs(repo, branches={**repo.branches, branch: commit.id})
            return commit

    @staticmethod
    def _check_no_clash(files: Mapping[str, FileEntry], path: str) -> None:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in files:
                raise HubError(400, f"Cannot add {path!r}: {'/'.join(parts[:depth])!r} is a file")
        prefix = path + "/"
        if any(p.startswith(prefix) for p in files):
            raise HubError(400, f"Cannot add {path!r}: a folder with that name exists")


def read_chunks(f: BinaryIO, start: int, length: int, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    f.seek(start)
    left = length
    while left > 0:
        chunk = f.read(min(chunk_size, left))
        if not chunk:
            return
        left -= len(chunk)
        yield chunk
