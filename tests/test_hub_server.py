"""The local Hub server (tools/fused_kernels_tools/hub/) against the real clients: huggingface_hub 2.4.0 in this
process (through `use_local_hub`) and kernels 0.17.2 in fresh interpreters (through `run_client`), plus raw
HTTP for the error paths (no answer may ever be 5xx), concurrency, restarts, tokens and the CLI."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    BadRequestError,
    EntryNotFoundError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from conftest import ON_GPU, run_tool
from hub_helpers import HubServer, hub_api, hub_env, run_client, running_hub, use_local_hub

REPO = "acme/relu"
# huggingface_hub's legacy LFS upload PUTs a file object with `data=`, which httpx2 deprecates (client side).
LEGACY_LFS_PUT = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running server; this process's huggingface_hub points at it."""
    with running_hub(tmp_path) as server:
        use_local_hub(monkeypatch, server.url, tmp_path / "hf-home")
        yield server


def write_files(root: Path, files: dict[str, bytes | str]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def raw(server: HubServer, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
        conn: http.client.HTTPConnection | None = None) -> tuple[int, dict, bytes]:
    """One request with http.client (keep-alive when `conn` is given); every answer must be < 500."""
    own = conn is None
    if own:
        conn = http.client.HTTPConnection("127.0.0.1", server.port_number, timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    data = response.read()
    result = (response.status, {k.lower(): v for k, v in response.getheaders()}, data)
    if own:
        conn.close()
    assert response.status < 500, result
    return result


def commit_chain(server: HubServer, repo_id: str, revision: str, repo_type: str = "kernels") -> list[dict]:
    status, _, body = raw(server, "GET", f"/api/{repo_type}/{repo_id}/commits/{urllib.parse.quote(revision, safe='')}")
    assert status == 200
    commits = json.loads(body)
    for newer, older in zip(commits, commits[1:]):
        assert newer["parents"] == [older["id"]]
    assert commits[-1]["parents"] == []
    return commits


def ndjson(*items: dict) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


# ------------------------------------------------------------------------------------------------ repos, refs


def test_repos_branches_and_tags(hub):
    api = hub_api(hub)
    url = api.create_repo(REPO, repo_type="kernel")
    assert (url.repo_id, url.repo_type) == (REPO, "kernel")
    with pytest.raises(HfHubHTTPError) as exists:
        api.create_repo(REPO, repo_type="kernel")
    assert exists.value.response.status_code == 409
    assert api.create_repo(REPO, repo_type="kernel", exist_ok=True).repo_id == REPO

    refs = api.list_repo_refs(REPO, repo_type="kernel")
    assert [b.name for b in refs.branches] == ["main"] and refs.tags == []
    assert api.list_repo_files(REPO, repo_type="kernel") == [".gitattributes"]

    api.create_branch(REPO, repo_type="kernel", branch="v1")
    api.create_branch(REPO, repo_type="kernel", branch="v1", exist_ok=True)
    with pytest.raises(HfHubHTTPError) as branch_exists:
        api.create_branch(REPO, repo_type="kernel", branch="v1")
    assert branch_exists.value.response.status_code == 409
    v1 = api.upload_file(path_or_fileobj=b"one\n", path_in_repo="dir/a b.txt", repo_id=REPO, repo_type="kernel",
                         revision="v1")
    api.create_branch(REPO, repo_type="kernel", branch="v2", revision="v1")
    api.create_branch(REPO, repo_type="kernel", branch="feature/x", revision=v1.oid[:10])
    with pytest.raises(RevisionNotFoundError):
        api.create_branch(REPO, repo_type="kernel", branch="v3", revision="no-such-branch")
    with pytest.raises(BadRequestError):
        api.create_branch(REPO, repo_type="kernel", branch="refs/pr/1")

    heads = {b.name: b.target_commit for b in api.list_repo_refs(REPO, repo_type="kernel").branches}
    assert heads["v1"] == heads["v2"] == heads["feature/x"] == v1.oid != heads["main"]
    # a branch with '/' and a path with a space, through the quoting rules of doc §2
    path = hf_hub_download(REPO, "dir/a b.txt", repo_type="kernel", revision="feature/x")
    assert Path(path).read_bytes() == b"one\n"

    api.create_tag(REPO, repo_type="kernel", tag="release-1", revision="v1")
    refs = api.list_repo_refs(REPO, repo_type="kernel")
    assert [(t.name, t.target_commit) for t in refs.tags] == [("release-1", v1.oid)]
    assert api.kernel_info(REPO, revision="release-1").sha == v1.oid
    api.delete_tag(REPO, repo_type="kernel", tag="release-1")

    api.delete_branch(REPO, repo_type="kernel", branch="v2")
    assert "v2" not in {b.name for b in api.list_repo_refs(REPO, repo_type="kernel").branches}
    with pytest.raises(RevisionNotFoundError):
        api.delete_branch(REPO, repo_type="kernel", branch="v2")
    with pytest.raises(HfHubHTTPError) as main_refused:
        api.delete_branch(REPO, repo_type="kernel", branch="main")
    assert main_refused.value.response.status_code == 403

    # the other repo types: models have no URL prefix, datasets and spaces do
    for repo_type in ("model", "dataset", "space"):
        api.create_repo("acme/other", repo_type=repo_type, space_sdk="static" if repo_type == "space" else None)
        api.upload_file(path_or_fileobj=repo_type.encode(), path_in_repo="x.txt", repo_id="acme/other",
                        repo_type=repo_type)
        assert Path(hf_hub_download("acme/other", "x.txt", repo_type=repo_type)).read_bytes() == repo_type.encode()
    api.delete_repo("acme/other", repo_type="dataset")
    with pytest.raises(RepositoryNotFoundError):
        api.repo_info("acme/other", repo_type="dataset")
    assert api.model_info("acme/other").sha and api.space_info("acme/other").sha


def test_upload_folder_history_deletions_and_noop(hub, tmp_path):
    api = hub_api(hub)
    api.create_repo(REPO, repo_type="kernel")
    api.create_branch(REPO, repo_type="kernel", branch="v1")
    folder = write_files(tmp_path / "upload", {
        "README.md": "---\nlicense: apache-2.0\n---\n# relu\n",
        "build/torch-cpu/metadata.json": '{"name": "relu"}\n',
        "build/torch-cpu/relu/__init__.py": "TAG = 'one'\n",
        "build/torch-cuda/relu/__init__.py": "TAG = 'one'\n",
        "build/torch-cuda/relu/stale.py": "old = True\n",
    })
    first = api.upload_folder(repo_id=REPO, repo_type="kernel", folder_path=folder, revision="v1")
    (folder / "build/torch-cuda/relu/stale.py").unlink()
    (folder / "build/torch-cpu/relu/__init__.py").write_text("TAG = 'two'\n")
    second = api.upload_folder(repo_id=REPO, repo_type="kernel", folder_path=folder, revision="v1",
                               delete_patterns=["build/**"])
    assert second.oid != first.oid
    files = api.list_repo_files(REPO, repo_type="kernel", revision="v1")
    assert files == [".gitattributes", "README.md", "build/torch-cpu/metadata.json", "build/torch-cpu/relu/__init__.py",
                     "build/torch-cuda/relu/__init__.py"]
    # identical re-upload: the preupload oids match, no commit is made
    third = api.upload_folder(repo_id=REPO, repo_type="kernel", folder_path=folder, revision="v1",
                              delete_patterns=["build/**"])
    assert third.oid == second.oid
    chain = commit_chain(hub, REPO, "v1")
    assert [c["id"] for c in chain[:2]] == [second.oid, first.oid] and len(chain) == 3
    assert [c.commit_id for c in api.list_repo_commits(REPO, repo_type="kernel", revision="v1")] == \
        [c["id"] for c in chain]

    # explicit deletions: a folder, then a file that does not exist
    api.create_commit(REPO, repo_type="kernel", revision="v1", commit_message="drop cuda",
                      operations=[CommitOperationDelete("build/torch-cuda/", is_folder=True)])
    assert not any(f.startswith("build/torch-cuda") for f in api.list_repo_files(REPO, repo_type="kernel", revision="v1"))
    with pytest.raises(EntryNotFoundError):
        api.create_commit(REPO, repo_type="kernel", revision="v1", commit_message="x",
                          operations=[CommitOperationDelete("nope.txt")])

    # tree: non-recursive lists directories (what kernels needs to find variants), paths are full repo paths
    root = {(type(e).__name__, e.path) for e in api.list_repo_tree(REPO, repo_type="kernel", revision="v1")}
    assert root == {("RepoFile", ".gitattributes"), ("RepoFile", "README.md"), ("RepoFolder", "build")}
    variants = list(api.list_repo_tree(REPO, repo_type="kernel", revision="v1", path_in_repo="build"))
    assert [(type(e).__name__, e.path) for e in variants] == [("RepoFolder", "build/torch-cpu")]
    deep = {e.path: e for e in api.list_repo_tree(REPO, repo_type="kernel", revision=first.oid, recursive=True)}
    content = b"TAG = 'one'\n"
    blob = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
    entry = deep["build/torch-cuda/relu/__init__.py"]
    assert (entry.blob_id, entry.size, entry.lfs, entry.xet_hash) == (blob, len(content), None, None)
    assert "build/torch-cuda/relu" in deep and type(deep["build/torch-cuda/relu"]).__name__ == "RepoFolder"
    expanded = list(api.list_repo_tree(REPO, repo_type="kernel", revision="v1", path_in_repo="build/torch-cpu",
                                       expand=True))
    assert {e.path: e.last_commit.oid for e in expanded} == {"build/torch-cpu/metadata.json": first.oid,
                                                            "build/torch-cpu/relu": second.oid}
    info = api.get_paths_info(REPO, ["README.md", "build", "missing"], repo_type="kernel", revision="v1")
    assert [(type(e).__name__, e.path) for e in info] == [("RepoFile", "README.md"), ("RepoFolder", "build")]

    # downloads: a file at the old commit, a filtered snapshot of the branch
    old = hf_hub_download(REPO, "build/torch-cuda/relu/stale.py", repo_type="kernel", revision=first.oid)
    assert Path(old).read_text() == "old = True\n"
    snapshot = Path(snapshot_download(REPO, repo_type="kernel", revision="v1", allow_patterns=["build/torch-cpu/*"]))
    got = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert got == ["build/torch-cpu/metadata.json", "build/torch-cpu/relu/__init__.py"]
    assert (snapshot / "build/torch-cpu/relu/__init__.py").read_text() == "TAG = 'two'\n"


def test_large_regular_file_round_trip(hub):
    api = hub_api(hub)
    api.create_repo(REPO, repo_type="kernel")
    data = random.Random(2).randbytes(6 * 1024 * 1024)
    info = api.upload_file(path_or_fileobj=data, path_in_repo="big/blob.bin", repo_id=REPO, repo_type="kernel")
    path = Path(hf_hub_download(REPO, "big/blob.bin", repo_type="kernel", revision=info.oid))
    assert path.read_bytes() == data
    assert path.resolve().name == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # cache blob = ETag


def test_tree_and_commit_listings_are_paginated(tmp_path, monkeypatch):
    with running_hub(tmp_path, page_size=3) as server:
        use_local_hub(monkeypatch, server.url, tmp_path / "hf-home")
        api = hub_api(server)
        api.create_repo(REPO, repo_type="kernel")
        folder = write_files(tmp_path / "many", {f"build/torch-cpu/f{i:02d}.py": f"x = {i}\n" for i in range(10)})
        api.upload_folder(repo_id=REPO, repo_type="kernel", folder_path=folder)
        for i in range(4):
            api.upload_file(path_or_fileobj=str(i).encode(), path_in_repo="counter.txt", repo_id=REPO,
                            repo_type="kernel")
        expected = [".gitattributes", "counter.txt"] + [f"build/torch-cpu/f{i:02d}.py" for i in range(10)]
        assert sorted(api.list_repo_files(REPO, repo_type="kernel")) == sorted(expected)
        assert len(list(api.list_repo_tree(REPO, repo_type="kernel", path_in_repo="build/torch-cpu"))) == 10
        assert len(api.list_repo_commits(REPO, repo_type="kernel")) == 6

        # the Link header carries every query parameter and pins the commit the first page resolved
        head = api.kernel_info(REPO).sha
        status, headers, body = raw(server, "GET", f"/api/kernels/{REPO}/tree/main?recursive=true&expand=false")
        assert status == 200 and len(json.loads(body)) == 3
        link = re.fullmatch(r'<([^>]+)>; rel="next"', headers["link"]).group(1)
        parsed = urllib.parse.urlsplit(link)
        assert parsed.path == f"/api/kernels/{REPO}/tree/{head}"
        assert urllib.parse.parse_qs(parsed.query) == {"recursive": ["true"], "expand": ["false"], "cursor": ["3"]}
        _, headers, body = raw(server, "GET", f"{parsed.path}?{parsed.query}")
        assert len(json.loads(body)) == 3 and "link" in headers
        assert raw(server, "GET", f"/api/kernels/{REPO}/tree/main?cursor=oops")[0] == 400


# ------------------------------------------------------------------------------------------------ LFS


@LEGACY_LFS_PUT
def test_lfs_upload_and_download(tmp_path, monkeypatch):
    with running_hub(tmp_path, lfs_threshold=1024) as server:
        use_local_hub(monkeypatch, server.url, tmp_path / "hf-home")
        api = hub_api(server)
        api.create_repo(REPO, repo_type="kernel")
        big = random.Random(0).randbytes(5000)
        folder = write_files(tmp_path / "lfs", {"weights/big.bin": big, "small.txt": "small\n"})
        # with Xet enabled, an "lfs" answer sends the client to xet-write-token, which this server refuses
        # (fast, cleanly, nothing committed)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
        started = time.monotonic()
        with pytest.raises(Exception):
            api.upload_folder(repo_id=REPO, repo_type="kernel", folder_path=folder)
        assert time.monotonic() - started < 10 and api.list_repo_files(REPO, repo_type="kernel") == [".gitattributes"]
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        first = api.upload_folder(repo_id=REPO, repo_type="kernel", folder_path=folder)
        sha256 = hashlib.sha256(big).hexdigest()
        entries = {e.path: e for e in api.list_repo_tree(REPO, repo_type="kernel", recursive=True)}
        lfs = entries["weights/big.bin"].lfs
        assert (lfs.sha256, lfs.size, entries["weights/big.bin"].size) == (sha256, 5000, 5000)
        assert entries["small.txt"].lfs is None and entries["weights/big.bin"].xet_hash is None
        assert Path(hf_hub_download(REPO, "weights/big.bin", repo_type="kernel")).read_bytes() == big
        # the same content again: preupload answers the sha256, nothing is uploaded or committed
        assert api.upload_folder(repo_id=REPO, repo_type="kernel", folder_path=folder).oid == first.oid

        status, headers, _ = raw(server, "HEAD", f"/kernels/{REPO}/resolve/main/weights/big.bin")
        assert status == 200 and headers["x-repo-commit"] == first.oid
        assert headers["x-linked-etag"] == f'"{sha256}"' and headers["x-linked-size"] == "5000"
        assert headers["content-length"] == "5000" and not any(h.startswith("x-xet") for h in headers)
        status, headers, body = raw(server, "GET", f"/kernels/{REPO}/resolve/main/weights/big.bin",
                                    headers={"Range": "bytes=4990-"})
        assert (status, body, headers["content-range"]) == (206, big[4990:], "bytes 4990-4999/5000")
        assert raw(server, "GET", f"/kernels/{REPO}/resolve/main/small.txt", headers={"Range": "bytes=99-"})[0] == 416

        # the PUT URL is signed by the batch answer: a forged one is refused, content is verified
        other = b"y" * 2000
        oid = hashlib.sha256(other).hexdigest()
        batch = {"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256",
                 "objects": [{"oid": oid, "size": len(other)}]}
        status, _, body = raw(server, "POST", f"/kernels/{REPO}.git/info/lfs/objects/batch",
                              json.dumps(batch).encode(), {"Content-Type": "application/vnd.git-lfs+json"})
        href = urllib.parse.urlsplit(json.loads(body)["objects"][0]["actions"]["upload"]["href"])
        put = f"{href.path}?{href.query}"
        assert raw(server, "PUT", put.replace("sig=", "sig=0"), other)[0] == 403
        assert raw(server, "PUT", put, b"z" * 2000)[0] == 400  # wrong content for the oid
        assert raw(server, "PUT", put, other[:1000])[0] == 400  # short
        # a commit that references an LFS object never uploaded is refused as a whole
        head = api.kernel_info(REPO).sha
        payload = ndjson({"key": "header", "value": {"summary": "x"}},
                         {"key": "file", "value": {"path": "ok.txt", "content": "b2s=", "encoding": "base64"}},
                         {"key": "lfsFile", "value": {"path": "w.bin", "algo": "sha256", "oid": oid, "size": 2000}})
        assert raw(server, "POST", f"/api/kernels/{REPO}/commit/main", payload)[0] == 400
        assert api.kernel_info(REPO).sha == head
        assert raw(server, "PUT", put, other)[0] == 200
        assert raw(server, "POST", f"/api/kernels/{REPO}/commit/main", payload)[0] == 200
        assert Path(hf_hub_download(REPO, "w.bin", repo_type="kernel")).read_bytes() == other


# ------------------------------------------------------------------------------------------------ kernels


LOAD_AND_RUN = """
import sys, torch, kernels
from pathlib import Path

x = torch.randn(4, 96, dtype=torch.float32)
w = torch.randn(96, dtype=torch.float32)
expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

def check(fk, how):
    assert fk.VARIANT == VARIANT, (how, fk.VARIANT)
    torch.testing.assert_close(fk.rms_norm(x, w, eps=1e-6, mode="llama"), expected)
    print("ok", how, fk.VARIANT)

check(kernels.get_kernel("myorg/fused-kernels", revision="v1", trust_remote_code=True), "revision")
check(kernels.get_kernel("myorg/fused-kernels", version=1), "version (trusted org)")
path = kernels.install_kernel("myorg/fused-kernels", revision="v1")
assert Path(path).name == VARIANT, path
check(kernels.get_local_kernel(Path(path)), "install_kernel")
try:
    kernels.get_kernel("otherorg/fused-kernels", version=1)
except ValueError as e:
    assert "not from a trusted publisher" in str(e), e
    print("refused untrusted")
else:
    sys.exit("an untrusted org was loaded without trust_remote_code")
"""


def test_kernels_get_kernel_and_install_kernel_from_the_local_hub(tmp_path, monkeypatch):
    build = tmp_path / "build"
    run_tool("build", "--out", str(build), "--only", "torch-cpu", "torch-cuda")
    with running_hub(tmp_path, trusted_orgs=["myorg"]) as server:
        use_local_hub(monkeypatch, server.url, tmp_path / "hf-home")
        api = hub_api(server)
        for repo_id in ("myorg/fused-kernels", "otherorg/fused-kernels"):
            api.create_repo(repo_id, repo_type="kernel")
            api.create_branch(repo_id, repo_type="kernel", branch="v1")
            api.upload_folder(repo_id=repo_id, repo_type="kernel", folder_path=build, path_in_repo="build",
                              revision="v1")
        assert {b.name for b in api.list_repo_refs("myorg/fused-kernels", repo_type="kernel").branches} == {"main", "v1"}
        # of the two variants uploaded, kernels picks torch-cpu on a CPU machine (torch-cuda with CUDA)
        variant = "torch-cuda" if ON_GPU else "torch-cpu"
        proc = run_client(f"VARIANT = {variant!r}\n" + LOAD_AND_RUN, hub_env(server.url, tmp_path / "client-home"),
                          check=True)
    assert proc.stdout.splitlines() == [f"ok revision {variant}", f"ok version (trusted org) {variant}",
                                        f"ok install_kernel {variant}", "refused untrusted"]


def test_hub_env_and_run_client_reach_the_local_server(hub, tmp_path, monkeypatch):
    api = hub_api(hub)
    api.create_repo(REPO, repo_type="kernel")
    marker = f"served by {hub.url}\n".encode()
    api.upload_file(path_or_fileobj=marker, path_in_repo="marker.txt", repo_id=REPO, repo_type="kernel")
    for name in ("HF_HUB_DISABLE_TELEMETRY", "DO_NOT_TRACK", "DISABLE_TELEMETRY", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    env = hub_env(hub.url, tmp_path / "client-home")
    assert not {"HF_HUB_DISABLE_TELEMETRY", "DO_NOT_TRACK", "DISABLE_TELEMETRY", "HF_HUB_OFFLINE"} & set(env)
    assert env["HF_ENDPOINT"] == hub.url and env["HF_TOKEN"] == "hf_test"
    code = ("from huggingface_hub import hf_hub_download\n"
            f"print(open(hf_hub_download({REPO!r}, 'marker.txt', repo_type='kernel')).read(), end='')\n"
            "import fused_kernels_tools.hub\n")
    proc = run_client(code, env, check=True)
    assert proc.stdout.encode() == marker
    assert (tmp_path / "client-home" / "hub" / "kernels--acme--relu").is_dir()


# ------------------------------------------------------------------------------------------------ concurrency


def test_concurrent_commits_on_one_parent_one_wins(hub):
    api = hub_api(hub)
    api.create_repo(REPO, repo_type="kernel")
    base = api.kernel_info(REPO).sha
    contents = {i: random.Random(i).randbytes(300_000) for i in range(2)}
    barrier = threading.Barrier(2)
    results: dict[int, object] = {}

    def commit(i: int) -> None:
        barrier.wait()
        try:
            results[i] = api.create_commit(REPO, repo_type="kernel", commit_message=f"writer {i}", parent_commit=base,
                                           operations=[CommitOperationAdd(f"w{i}/data.bin", contents[i]),
                                                       CommitOperationAdd("shared.txt", f"writer {i}\n".encode())])
        except Exception as e:  # noqa: BLE001 - inspected below
            results[i] = e

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, r in results.items() if not isinstance(r, Exception)]
    losers = [i for i, r in results.items() if isinstance(r, Exception)]
    assert len(winners) == 1 and len(losers) == 1, results
    error = results[losers[0]]
    assert isinstance(error, HfHubHTTPError) and error.response.status_code == 412, error
    winner = winners[0]
    chain = commit_chain(hub, REPO, "main")
    assert [c["id"] for c in chain] == [results[winner].oid, base]
    assert Path(hf_hub_download(REPO, f"w{winner}/data.bin", repo_type="kernel")).read_bytes() == contents[winner]
    assert Path(hf_hub_download(REPO, "shared.txt", repo_type="kernel")).read_text() == f"writer {winner}\n"
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, f"w{losers[0]}/data.bin", repo_type="kernel")


def test_concurrent_commits_without_parent_all_land_in_one_chain(hub):
    api = hub_api(hub)
    api.create_repo(REPO, repo_type="kernel")

    def writer(i: int) -> None:
        for j in range(4):
            api.upload_file(path_or_fileobj=f"{i}-{j}".encode(), path_in_repo=f"t{i}/{j}.txt", repo_id=REPO,
                            repo_type="kernel")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(commit_chain(hub, REPO, "main")) == 17
    files = api.list_repo_files(REPO, repo_type="kernel")
    assert sorted(f for f in files if f.startswith("t")) == sorted(f"t{i}/{j}.txt" for i in range(4) for j in range(4))


# ------------------------------------------------------------------------------------------------ restart


def hub_state(server: HubServer, repo_id: str) -> dict:
    _, _, refs = raw(server, "GET", f"/api/kernels/{repo_id}/refs")
    state: dict = {"refs": json.loads(refs)}
    for ref in state["refs"]["branches"] + state["refs"]["tags"]:
        rev = urllib.parse.quote(ref["name"], safe="")
        state[ref["name"]] = {
            "commits": commit_chain(server, repo_id, ref["name"]),
            "tree": json.loads(raw(server, "GET", f"/api/kernels/{repo_id}/tree/{rev}?recursive=true")[2]),
        }
        for entry in state[ref["name"]]["tree"]:
            if entry["type"] == "file":
                entry["content"] = hashlib.sha256(
                    raw(server, "GET", f"/kernels/{repo_id}/resolve/{rev}/{urllib.parse.quote(entry['path'])}")[2]
                ).hexdigest()
    return state


@LEGACY_LFS_PUT
def test_restart_keeps_repos_branches_commits_and_files(tmp_path, monkeypatch):
    root = tmp_path / "store"
    big = random.Random(1).randbytes(4096)
    with running_hub(tmp_path, root=root, lfs_threshold=1024) as first:
        use_local_hub(monkeypatch, first.url, tmp_path / "hf-home")
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        api = hub_api(first)
        api.create_repo(REPO, repo_type="kernel")
        api.create_branch(REPO, repo_type="kernel", branch="v1")
        api.upload_folder(repo_id=REPO, repo_type="kernel", revision="v1",
                          folder_path=write_files(tmp_path / "f", {"a.txt": "a\n", "lfs/big.bin": big}))
        api.upload_file(path_or_fileobj=b"b\n", path_in_repo="b.txt", repo_id=REPO, repo_type="kernel", revision="v1")
        api.create_branch(REPO, repo_type="kernel", branch="v2", revision="v1")
        api.create_tag(REPO, repo_type="kernel", tag="t1", revision="v1")
        with pytest.raises(RuntimeError, match="in use"):
            HubServer(root).start()  # one server per root
        before = hub_state(first, REPO)
    with running_hub(tmp_path, root=root) as second:
        assert hub_state(second, REPO) == before
        assert raw(second, "GET", f"/kernels/{REPO}/resolve/v2/lfs/big.bin")[2] == big
        # and it keeps working: a new commit on top of the restored head
        use_local_hub(monkeypatch, second.url, tmp_path / "hf-home-2")
        hub_api(second).upload_file(path_or_fileobj=b"c\n", path_in_repo="c.txt", repo_id=REPO, repo_type="kernel",
                                    revision="v1")
        chain = commit_chain(second, REPO, "v1")
        assert chain[1:] == before["v1"]["commits"]


# ------------------------------------------------------------------------------------------------ errors


def test_client_errors_map_to_huggingface_hub_exceptions(hub):
    api = hub_api(hub)
    api.create_repo(REPO, repo_type="kernel")
    with pytest.raises(RepositoryNotFoundError):
        api.kernel_info("acme/missing")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/missing", "x", repo_type="kernel")
    with pytest.raises(RevisionNotFoundError):
        api.kernel_info(REPO, revision="v9")
    with pytest.raises(RevisionNotFoundError):
        list(api.list_repo_tree(REPO, repo_type="kernel", revision="v9"))
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, ".gitattributes", repo_type="kernel", revision="v9")
    with pytest.raises(RevisionNotFoundError):  # uploads need an existing branch
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x", repo_id=REPO, repo_type="kernel", revision="v9")
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "missing.txt", repo_type="kernel")
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree(REPO, repo_type="kernel", path_in_repo="build"))

    head = api.kernel_info(REPO).sha
    for path, code in [("/api/kernels/acme/missing/refs", "RepoNotFound"),
                       ("/api/kernels/acme/relu/revision/v9", "RevisionNotFound"),
                       ("/kernels/acme/relu/resolve/main/missing.txt", "EntryNotFound"),
                       ("/api/kernels/acme/relu/tree/main/missing", "EntryNotFound")]:
        for method in ("GET", "HEAD"):
            status, headers, body = raw(hub, method, path)
            assert status == 404 and headers["x-error-code"] == code and headers["x-error-message"]
            assert int(headers["content-length"]) == (len(body) if method == "GET" else int(headers["content-length"]))
            if method == "GET":
                assert json.loads(body)["error"]
    assert raw(hub, "HEAD", "/kernels/acme/relu/resolve/main/missing.txt")[1]["x-repo-commit"] == head


def test_bad_requests_get_4xx_and_the_server_keeps_serving(tmp_path, caplog):
    with running_hub(tmp_path, max_body_bytes=64 * 1024) as server:
        api = hub_api(server)
        api.create_repo(REPO, repo_type="kernel", exist_ok=True)
        commit = f"/api/kernels/{REPO}/commit/main"
        header = {"key": "header", "value": {"summary": "s"}}

        def file_op(path: str, content: str = "eA==") -> dict:
            return {"key": "file", "value": {"path": path, "content": content, "encoding": "base64"}}

        conn = http.client.HTTPConnection("127.0.0.1", server.port_number, timeout=30)
        cases = [
            ("POST", commit, b"{not json\n", 400),
            ("POST", commit, ndjson(file_op("a.txt")), 400),  # no header line
            ("POST", commit, ndjson(header, file_op("a.txt", "%%%not base64")), 400),
            ("POST", commit, ndjson(header, {"key": "rename", "value": {"path": "a"}}), 400),
            ("POST", commit, ndjson(header, file_op("../escape.txt")), 400),
            ("POST", commit, ndjson(header, file_op("/etc/passwd")), 400),
            ("POST", commit, ndjson(header, file_op("a//b.txt")), 400),
            ("POST", commit, ndjson({"key": "header", "value": {"parentCommit": "zzz"}}), 400),
            ("POST", commit + "?create_pr=1", ndjson(header), 400),
            # atomic: a valid addition followed by a failing operation commits nothing
            ("POST", commit, ndjson(header, file_op("new.txt"), {"key": "deletedFile", "value": {"path": "nope"}}), 404),
            ("POST", commit, ndjson(header, file_op("a"), file_op("a/b")), 400),  # a file where a folder goes
            ("POST", f"/api/kernels/{REPO}/commit/v9", ndjson(header), 404),
            ("POST", "/api/repos/create", b"[1, 2", 400),
            ("POST", "/api/repos/create", json.dumps({"name": "x", "type": "kernel"}).encode(), 400),
            ("POST", "/api/repos/create", json.dumps({"name": "..", "organization": "a", "type": "kernel"}).encode(), 400),
            ("POST", f"/api/kernels/{REPO}/preupload/main", json.dumps({"files": [{"path": "a", "size": -1}]}).encode(), 400),
            ("POST", f"/api/kernels/{REPO}/preupload/main", b"\xff\xfe", 400),
            ("GET", f"/kernels/{REPO}/resolve/main/../../../etc/passwd", None, 400),
            ("GET", f"/kernels/{REPO}/resolve/main/%2e%2e/x", None, 400),
            ("GET", f"/api/kernels/{REPO}/tree/main/..%2Fx", None, 400),
            ("GET", "/api/kernels/acme/re%20lu/refs", None, 400),
            ("GET", "/no/such/route", None, 404),
            ("GET", "/api/kernels/acme", None, 404),
            ("DELETE", commit, None, 405),
            ("PATCH", f"/api/kernels/{REPO}", b"{}", 405),
            ("BREW", f"/api/kernels/{REPO}/refs", None, 405),
            ("POST", f"/api/kernels/{REPO}/branch/v1", json.dumps({"startingPoint": 5}).encode(), 400),
            ("GET", f"/api/kernels/{REPO}/xet-write-token/main", None, 400),
        ]
        for method, path, body, expected in cases:
            status, headers, data = raw(server, method, path, body, conn=conn)
            assert status == expected, (method, path, status, data)
            assert json.loads(data)["error"] and headers["x-error-message"], (method, path)
            # the same keep-alive connection still answers a normal request
            assert raw(server, "GET", f"/api/kernels/{REPO}/refs", conn=conn)[0] == 200
        assert api.list_repo_files(REPO, repo_type="kernel") == [".gitattributes"]  # nothing was committed

        # bodies over max_body_bytes: refused from Content-Length, before reading; and mid-stream when chunked
        status, headers, _ = raw(server, "POST", commit, b"x" * (200 * 1024))
        assert status == 413 and headers.get("connection") == "close"
        chunked = http.client.HTTPConnection("127.0.0.1", server.port_number, timeout=30)
        chunked.request("POST", commit, body=iter([b"y" * 50_000] * 4), encode_chunked=True,
                        headers={"Transfer-Encoding": "chunked"})
        assert chunked.getresponse().status == 413
        chunked.close()
        # a chunked body within the limit works like any other
        chunked = http.client.HTTPConnection("127.0.0.1", server.port_number, timeout=30)
        chunked.request("POST", commit, body=iter([ndjson(header), ndjson(file_op("chunked.txt"))[:-1], b"\n"]),
                        encode_chunked=True, headers={"Transfer-Encoding": "chunked"})
        assert chunked.getresponse().status == 200
        chunked.close()
        # broken requests at the HTTP level
        for bad in (b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                    b"POST /api/validate-yaml HTTP/1.1\r\nContent-Length: abc\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", server.port_number), timeout=30) as s:
                s.sendall(bad)
                answer = s.recv(65536)
            status = int(answer.split(b" ", 2)[1])
            assert 400 <= status < 500, answer

        # an unexpected exception inside a route is answered 400 with its message, logged, and forgotten
        store = server.store
        original = store.resolve

        def broken(*args, **kwargs):
            raise RuntimeError("simulated bug")

        store.resolve = broken
        try:
            with caplog.at_level(logging.ERROR, logger="fused_kernels_tools.hub"):
                status, headers, data = raw(server, "GET", f"/api/kernels/{REPO}/revision/main", conn=conn)
        finally:
            store.resolve = original
        assert status == 400 and "simulated bug" in headers["x-error-message"] and b"simulated bug" in data
        assert any("unexpected error" in r.getMessage() for r in caplog.records)
        assert raw(server, "GET", f"/api/kernels/{REPO}/revision/main", conn=conn)[0] == 200
        assert sorted(api.list_repo_files(REPO, repo_type="kernel")) == [".gitattributes", "chunked.txt"]
        conn.close()


def test_token_guards_writes_but_not_reads(tmp_path, monkeypatch, capfd, caplog):
    secret = "hf_local_secret_7f3a9c"
    with running_hub(tmp_path, token=secret, log_requests=True) as server:
        use_local_hub(monkeypatch, server.url, tmp_path / "hf-home", token=None)
        anonymous, wrong, good = hub_api(server, token=False), hub_api(server, token="hf_wrong"), hub_api(server, secret)
        writes = [
            lambda api: api.create_repo("acme/new", repo_type="kernel"),
            lambda api: api.create_branch(REPO, repo_type="kernel", branch="v1"),
            lambda api: api.upload_file(path_or_fileobj=b"x", path_in_repo="x", repo_id=REPO, repo_type="kernel"),
            lambda api: api.create_tag(REPO, repo_type="kernel", tag="t", revision="main"),
            lambda api: api.delete_branch(REPO, repo_type="kernel", branch="keep"),
            lambda api: api.delete_repo(REPO, repo_type="kernel"),
        ]
        good.create_repo(REPO, repo_type="kernel")
        good.create_branch(REPO, repo_type="kernel", branch="keep")
        for write in writes:
            for api, status in ((anonymous, 401), (wrong, 403)):
                with pytest.raises(HfHubHTTPError) as refused:
                    write(api)
                assert refused.value.response.status_code == status
        batch = json.dumps({"operation": "upload", "objects": [{"oid": "a" * 64, "size": 1}]}).encode()
        assert raw(server, "POST", f"/kernels/{REPO}.git/info/lfs/objects/batch", batch)[0] == 401
        assert raw(server, "POST", f"/kernels/{REPO}.git/info/lfs/objects/batch", batch,
                   {"Authorization": "Bearer nope"})[0] == 403
        # nothing changed, and reads need no token
        assert {b.name for b in anonymous.list_repo_refs(REPO, repo_type="kernel").branches} == {"main", "keep"}
        assert anonymous.list_repo_files(REPO, repo_type="kernel") == [".gitattributes"]
        assert Path(hf_hub_download(REPO, ".gitattributes", repo_type="kernel", token=False)).is_file()
        good.upload_file(path_or_fileobj=b"x", path_in_repo="x", repo_id=REPO, repo_type="kernel")
        assert anonymous.list_repo_files(REPO, repo_type="kernel") == [".gitattributes", "x"]
    out, err = capfd.readouterr()
    assert "hub: POST /api/repos/create -> 401" in err  # request logging was on
    assert secret not in out + err
    assert all(secret not in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_hub_serve(tmp_path):
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent / "tools"),
                                                                      os.environ.get("PYTHONPATH")])),
           "HUB_TEST_TOKEN": "hf_cli_secret_41"}
    proc = subprocess.Popen([sys.executable, "-m", "fused_kernels_tools", "hub", "serve", "--root", str(tmp_path / "root"),
                             "--port-file", str(port_file), "--token-env", "HUB_TEST_TOKEN", "--trusted-org", "myorg",
                             "--log-requests"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the server did not write its port file"
            time.sleep(0.05)
        port = int(port_file.read_text())
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{url}/api/organizations/myorg/overview") as response:
            assert json.load(response)["trustedKernelPublisher"] is True
        with urllib.request.urlopen(f"{url}/api/organizations/someone/overview") as response:
            assert json.load(response)["trustedKernelPublisher"] is False
        create = json.dumps({"name": "k", "organization": "myorg", "type": "kernel"}).encode()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{url}/api/repos/create", data=create))
        assert refused.value.code == 401
        request = urllib.request.Request(f"{url}/api/repos/create", data=create,
                                         headers={"Authorization": "Bearer hf_cli_secret_41"})
        with urllib.request.urlopen(request) as response:
            assert json.load(response)["url"] == f"{url}/kernels/myorg/k"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out == f"fused-kernels hub: serving {tmp_path / 'root'} at {url}\n"
    assert "hub: POST /api/repos/create -> 401" in err and "hf_cli_secret_41" not in out + err
    assert not port_file.exists()
    assert (tmp_path / "root" / "repos" / "kernels" / "myorg" / "k" / "refs.json").is_file()

    missing = subprocess.run([sys.executable, "-m", "fused_kernels_tools", "hub", "serve", "--root", str(tmp_path / "r2"),
                              "--token-env", "HUB_TEST_UNSET_VARIABLE"], env=env, capture_output=True, text=True)
    assert missing.returncode == 1 and "HUB_TEST_UNSET_VARIABLE" in missing.stderr
