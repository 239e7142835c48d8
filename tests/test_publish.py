"""The publisher (`python -m fused_kernels_tools publish`) and the demo, against the local Hub server with the
real huggingface_hub and kernels clients.

Builds come from `release build` of a two-commit repository (publish_helpers: v1 pinned to commit A, v2 =
HEAD), torch-cpu and torch-cuda variants only. Every test starts its own server; publishes and loads run in
fresh interpreters with HF_ENDPOINT (tests/hub_helpers.py).
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from conftest import TORCH_BACKEND
from hub_helpers import HubServer, hub_api, hub_env, run_client, running_hub, use_local_hub
from publish_helpers import (
    REPO_ID, package_all, publish, release_build, release_commits, release_source, releases_toml, tool,
)
from tooling_helpers import REPO_ROOT, git, make_snapshot, rehash, run_tool

from huggingface_hub.errors import RepositoryNotFoundError

TRUSTED = {"trusted_orgs": ["myorg"]}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return release_source(tmp_path_factory)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return release_build(tmp_path_factory)


@pytest.fixture
def hub(tmp_path):
    with running_hub(tmp_path, **TRUSTED) as server:
        yield server


@pytest.fixture
def env(hub, tmp_path) -> dict:
    return hub_env(hub.url, tmp_path / "hf-publisher")


def heads(server) -> dict[str, str]:
    refs = hub_api(server).list_repo_refs(REPO_ID, repo_type="kernel")
    return {b.name: b.target_commit for b in refs.branches}


def files(server, revision: str) -> dict[str, str]:
    """path -> blob id of every file on `revision`."""
    from huggingface_hub.hf_api import RepoFile

    return {e.path: e.blob_id for e in hub_api(server).list_repo_tree(REPO_ID, repo_type="kernel", revision=revision,
                                                                      recursive=True) if isinstance(e, RepoFile)}


def history(server, revision: str) -> list[str]:
    return [c.commit_id for c in hub_api(server).list_repo_commits(REPO_ID, repo_type="kernel", revision=revision)]


def card(server) -> str:
    with urllib.request.urlopen(f"{server.url}/kernels/{REPO_ID}/resolve/main/README.md") as response:
        return response.read().decode()


def local_files(build_dir: Path) -> set[str]:
    return {f"build/{p.relative_to(build_dir).as_posix()}" for p in build_dir.rglob("*") if p.is_file()}


def copy_build(src: Path, dest: Path, *variants: str) -> Path:
    dest.mkdir(parents=True)
    for name in variants:
        shutil.copytree(src / name, dest / name)
    return dest


# ---------------------------------------------------------------------------------------------------------
# Publish and load
# ---------------------------------------------------------------------------------------------------------

def test_publish_v1_v2_then_load_by_revision_and_version(hub, env, source, built, tmp_path, tmp_path_factory):
    commit_a, commit_b = release_commits(tmp_path_factory)
    first = publish(built / "v1", source, env)
    assert "create repo myorg/fused-kernels" in first.stdout and "create branch v1" in first.stdout
    assert f"committed to v1: {len(local_files(built / 'v1'))} added, 0 updated, 0 deleted" in first.stdout
    v1_head, v1_files = heads(hub)["v1"], files(hub, "v1")
    assert {p for p in v1_files if p.startswith("build/")} == local_files(built / "v1")
    assert history(hub, "v1")[1:] == history(hub, "main")[1:], "one commit on top of main's first commit"

    publish(built / "v2", source, env)
    assert heads(hub)["v1"] == v1_head and files(hub, "v1") == v1_files, "publishing v2 never touches v1"
    assert {p for p in files(hub, "v2") if p.startswith("build/")} == local_files(built / "v2")

    code = f"""
import sys, torch, kernels
repo = {REPO_ID!r}
v2 = kernels.get_kernel(repo, revision="v2")
v1 = kernels.get_kernel(repo, version=1)
also_v2 = kernels.get_kernel(repo, version=2)
assert also_v2 is v2 or also_v2.__name__ == v2.__name__
x = torch.randn(4, 32)
w = torch.rand(32) + 0.5
ys = [m.rms_norm(x, w, eps=1e-6, mode="gemma") for m in (v1, v2)]
assert torch.equal(ys[0], ys[1])
info = [sys.modules[m.__name__ + "._build_info"] for m in (v1, v2)]
ns = [sys.modules[m.__name__ + "._ops"]._OPS_NAME for m in (v1, v2)]
for space in ns:
    assert hasattr(getattr(torch.ops, space), "rms_norm")
print(v1.__name__, v2.__name__, ns[0], ns[1], info[0].VERSION, info[1].VERSION, info[0].COMMIT, info[1].COMMIT,
      v1.VARIANT, v2.VARIANT)
"""
    proc = run_client(code, hub_env(hub.url, tmp_path / "hf-client"), check=True)
    v1_id, v2_id, ns1, ns2, ver1, ver2, c1, c2, var1, var2 = proc.stdout.split()
    assert (v1_id, v2_id) == (f"_fused_kernels_{TORCH_BACKEND}_{commit_a[:7]}",
                              f"_fused_kernels_{TORCH_BACKEND}_{commit_b[:7]}")
    assert (ns1, ns2) == (v1_id, v2_id) and (ver1, ver2) == ("1", "2") and (c1, c2) == (commit_a, commit_b)
    assert var1 == var2 == f"torch-{TORCH_BACKEND}"


def test_republishing_an_unchanged_build_makes_no_commit(hub, env, source, built):
    publish(built / "v1", source, env)
    before = heads(hub)
    again = publish(built / "v1", source, env)
    assert "no changes: v1 already holds this build" in again.stdout
    assert "README.md on main: unchanged" in again.stdout
    assert heads(hub) == before


def test_variants_no_longer_built_disappear(hub, env, source, built, tmp_path):
    both = copy_build(built / "v2", tmp_path / "both", "torch-cpu", "torch-cuda")
    (both / "benchmarks").mkdir()
    (both / "benchmarks" / "benchmark_rms.py").write_text("print('bench')\n")
    (both / "benchmarks" / "helper.py").write_text("")  # not benchmark*.py: never published
    publish(both, source, env)
    assert "benchmarks/benchmark_rms.py" in files(hub, "v2")
    assert "benchmarks/helper.py" not in files(hub, "v2")
    head = heads(hub)["v2"]

    cpu_only = copy_build(built / "v2", tmp_path / "cpu-only", "torch-cpu")
    proc = publish(cpu_only, source, env)
    cuda_files = {p for p in local_files(both) if p.startswith("build/torch-cuda/")}
    assert f"0 added, 0 updated, {len(cuda_files) + 1} deleted" in proc.stdout
    after = files(hub, "v2")
    assert not [p for p in after if p.startswith("build/torch-cuda/") or p.startswith("benchmarks/")]
    assert {p for p in after if p.startswith("build/")} == local_files(cpu_only)
    assert history(hub, "v2")[:2] == [heads(hub)["v2"], head], "one new commit on top of the previous head"


def test_new_branch_starts_without_inherited_build_files(hub, env, source, built, tmp_path):
    """A new version branch starts from main; any build/ file there is not part of this build and goes."""
    api = hub_api(hub)
    api.create_repo(REPO_ID, repo_type="kernel")
    from huggingface_hub import CommitOperationAdd

    api.create_commit(REPO_ID, [CommitOperationAdd("build/torch-old/x.py", b"old\n")], commit_message="stray",
                      repo_type="kernel")
    publish(built / "v1", source, env)
    assert "build/torch-old/x.py" not in files(hub, "v1")
    assert "build/torch-old/x.py" in files(hub, "main")


# ---------------------------------------------------------------------------------------------------------
# Dry run
# ---------------------------------------------------------------------------------------------------------

def test_dry_run_without_a_repository_creates_nothing(hub, env, source, built):
    proc = publish(built / "v1", source, env, "--dry-run")
    out = proc.stdout.splitlines()
    assert out[0].startswith("dry run (nothing is changed): myorg/fused-kernels@v1")
    assert "create repo myorg/fused-kernels (type kernel)" in out and "create branch v1 (from main)" in out
    assert {line.split()[1] for line in out if line.startswith("add build/")} == local_files(built / "v1")
    assert "add README.md on main (card: v1)" in out and out[-1] == "dry run: nothing was changed"
    with pytest.raises(RepositoryNotFoundError):
        hub_api(hub).list_repo_refs(REPO_ID, repo_type="kernel")


def test_dry_run_on_an_existing_branch_changes_nothing(hub, env, source, built, tmp_path):
    publish(built / "v2", source, env)
    before_heads, before_files = heads(hub), files(hub, "v2")
    changed = copy_build(built / "v2", tmp_path / "changed", "torch-cpu")
    (changed / "torch-cpu" / "extra.py").write_text("X = 1\n")
    rehash(changed / "torch-cpu")
    proc = publish(changed, source, env, "--dry-run")
    lines = proc.stdout.splitlines()
    assert "create branch v2 (from main)" not in lines
    assert "add build/torch-cpu/extra.py" in lines and "update build/torch-cpu/metadata.json" in lines
    assert sum(line.startswith("delete build/torch-cuda/") for line in lines) == len(
        [p for p in before_files if p.startswith("build/torch-cuda/")])
    assert "README.md on main: unchanged" in lines or any(line.startswith("update README.md") for line in lines)
    assert heads(hub) == before_heads and files(hub, "v2") == before_files


# ---------------------------------------------------------------------------------------------------------
# The card
# ---------------------------------------------------------------------------------------------------------

def test_card_on_main_is_rendered_and_updated_only_when_it_changes(hub, env, source, built, tmp_path_factory):
    commit_a, commit_b = release_commits(tmp_path_factory)
    publish(built / "v1", source, env)
    text = card(hub)
    assert text.startswith("---\nlibrary_name: kernels\nlicense: apache-2.0\n")
    assert "{{" not in text and "}}" not in text
    assert "- `rms_norm(x, weight=None, eps=1e-06, mode='llama')`: RMS-normalise" in text
    assert "- `fused_add_rms_norm(x, residual, weight=None, eps=1e-06, mode='llama')`" in text
    assert "- `layers.RMSNorm`: Replaces ``LlamaRMSNorm``" in text and "- `layers.GemmaRMSNorm`" in text
    assert "BACKEND" not in text.split("## Functions")[1].split("## Layers")[0], "constants are not functions"
    assert f"| 1 | `v1` | `{commit_a[:7]}` |" in text and "| 2 | `v2`" not in text
    assert "- `torch-cpu` (CPU, plain PyTorch)" in text and "- `torch-cuda` (any CUDA torch, Triton)" in text
    assert 'get_kernel("myorg/fused-kernels", version=1, trust_remote_code=True)' in text
    assert 'revision="v1"' in text and '("myorg/fused-kernels:RMSNorm", {"revision": "v1", "trust_remote_code": True})' in text
    assert 'attn_implementation="myorg/fused-kernels@v2", allow_all_kernels=True' in text
    main_head = heads(hub)["main"]

    hub_api(hub).create_branch(REPO_ID, branch="v9", repo_type="kernel")  # a version branch without a build
    publish(built / "v1", source, env)
    assert heads(hub)["main"] == main_head, "an unchanged card makes no commit"

    publish(built / "v2", source, env)
    text = card(hub)
    assert f"| 1 | `v1` | `{commit_a[:7]}` |" in text and f"| 2 | `v2` | `{commit_b[:7]}` |" in text
    assert "## Functions (v2)" in text and 'revision="v2"' in text
    main_after_v2 = heads(hub)["main"]
    assert history(hub, "main")[1] == main_head, "one card commit on top of the previous one"

    # Republishing the older version keeps the card describing every branch (no change, no commit).
    publish(built / "v1", source, env)
    assert heads(hub)["main"] == main_after_v2


def test_card_template_placeholders_are_checked(hub, env, source, built, tmp_path):
    template = tmp_path / "CARD.md"
    template.write_text("---\nlibrary_name: kernels\n---\n# {{ repo_id }}\n{{ no_such_thing }}\n")
    proc = publish(built / "v1", source, env, "--card", str(template), check=False)
    assert proc.returncode == 1 and "card template uses unknown placeholders ['no_such_thing']" in proc.stderr
    template.write_text("---\nlibrary_name: kernels\n---\n# {{ repo_id }} v{{latest_version}}\n")
    publish(built / "v1", source, env, "--card", str(template))
    assert card(hub).endswith("# myorg/fused-kernels v1\n")


# ---------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------

def test_builds_that_do_not_match_the_release_table_are_refused(hub, env, source, built, tmp_path):
    # v1 is pinned to commit A: a build of HEAD labelled version 1 is not v1.
    head_as_v1 = tmp_path / "head-as-v1"
    run_tool("build", "--source", str(source), "--out", str(head_as_v1), "--only", "torch-cpu", "--version", "1")
    proc = publish(head_as_v1, source, env, check=False)
    assert proc.returncode == 1 and "v1 is defined by releases.toml as commit" in proc.stderr
    # An API that differs from the table.
    table = tmp_path / "releases.toml"
    api = package_all(source)
    table.write_text(releases_toml([(2, "HEAD", api + ["never_exported"])]))
    proc = publish(built / "v2", source, env, "--releases", str(table), check=False)
    assert proc.returncode == 1 and "no longer exports ['never_exported'] of v2's api" in proc.stderr
    # A version the table does not define.
    table.write_text(releases_toml([(3, "HEAD", api)]))
    proc = publish(built / "v2", source, env, "--releases", str(table), check=False)
    assert proc.returncode == 1 and "version 2 is not in" in proc.stderr
    # Variants of different versions in one build directory.
    mixed = copy_build(built / "v1", tmp_path / "mixed", "torch-cpu")
    shutil.copytree(built / "v2" / "torch-cuda", mixed / "torch-cuda")
    proc = publish(mixed, source, env, check=False)
    assert proc.returncode == 1 and "the variants disagree on version: torch-cpu=1, torch-cuda=2" in proc.stderr
    with pytest.raises(RepositoryNotFoundError):
        heads(hub)


def test_a_build_is_never_published_to_another_versions_branch(hub, env, source, built):
    """`--branch v1` with the v2 build replaced the frozen v1 (get_kernel(version=1) then loaded v2's code, API
    and metadata version); `v02` would be a second branch that kernels reads as version 2, and is refused as such
    (the message once told the user to publish a version-2 build as version 2, which it was)."""
    publish(built / "v1", source, env)
    v1_head = heads(hub)["v1"]
    for branch, read_as in (("v1", 1), ("v+1", 1)):
        proc = publish(built / "v2", source, env, "--branch", branch, check=False)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"--branch {branch} is version {read_as} to kernels, but" in proc.stderr
    proc = publish(built / "v2", source, env, "--branch", "v02", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--branch v02 is another name of version 2 to kernels, whose branch is v2: publish" in proc.stderr
    assert heads(hub)["v1"] == v1_head and set(heads(hub)) == {"main", "v1"}
    proc = publish(built / "v2", source, env, "--branch", "main", check=False)  # the card's branch, never builds
    assert proc.returncode == 1 and "--branch main holds the repository card alone" in proc.stderr, proc.stderr
    publish(built / "v2", source, env, "--branch", "ep-support")  # not a version: consumers pass revision=
    assert {p for p in files(hub, "ep-support") if p.startswith("build/")} == local_files(built / "v2")
    assert set(heads(hub)) == {"main", "v1", "ep-support"} and not any(p.startswith("build/") for p in files(hub, "main"))


@pytest.mark.parametrize("copy_as", ["torch-universal", "torch-cuda12"])
def test_a_variant_directory_renamed_after_the_build_is_refused(hub, env, source, built, tmp_path, copy_as):
    """kernels selects a variant by its directory's name and the digest covers only the files, so a copy of
    torch-cpu named torch-universal (loaded on every backend) or of torch-cuda named torch-cuda12 (never selected)
    passed as a valid build: refused before any request, naming what it was built as."""
    edited = copy_build(built / "v2", tmp_path / "edited", "torch-cpu", "torch-cuda")
    original = "torch-cpu" if copy_as == "torch-universal" else "torch-cuda"
    shutil.copytree(edited / original, edited / copy_as)
    proc = publish(edited, source, env, "--dry-run", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{edited / copy_as}: built as variant {original!r}; a variant directory renamed" in proc.stderr
    with pytest.raises(RepositoryNotFoundError):
        heads(hub)


@pytest.mark.parametrize("change", ["edited", "added", "removed"])
def test_a_build_changed_after_it_was_built_is_refused(hub, env, source, built, tmp_path, change):
    """Its metadata.json digest would no longer describe the files published under it (kernels never rehashes at
    load; `verify-signature` would fail): refused before any request, naming the variant and the file."""
    edited = copy_build(built / "v2", tmp_path / "edited", "torch-cpu", "torch-cuda")
    target = edited / "torch-cuda" / "layers.py"
    if change == "edited":
        target.write_text(target.read_text() + "# hotfix\n")
    elif change == "added":
        (edited / "torch-cuda" / "extra.py").write_text("")
    else:
        target.unlink()
    proc = publish(edited, source, env, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{edited / 'torch-cuda'}: the files differ from metadata.json's digest" in proc.stderr
    assert ("extra.py" if change == "added" else "layers.py") in proc.stderr
    with pytest.raises(RepositoryNotFoundError):
        hub_api(hub).list_repo_refs(REPO_ID, repo_type="kernel")


def test_a_dirty_build_needs_allow_dirty(hub, env, source, tmp_path):
    work = tmp_path / "work"
    subprocess.run(["git", "clone", "-q", str(source), str(work)], check=True)
    (work / "untracked.txt").write_text("x\n")
    out = tmp_path / "out"
    run_tool("release", "build", "--source", str(work), "--out", str(out), "--versions", "2", "--only", "torch-cpu",
             "--allow-dirty")
    proc = publish(out / "v2", work, env, check=False)
    assert proc.returncode == 1 and "was built from a dirty tree" in proc.stderr and "--allow-dirty" in proc.stderr
    proc = publish(out / "v2", work, env, "--allow-dirty")
    assert "warning: publishing a build of a dirty tree" in proc.stderr and "committed to v2" in proc.stdout


# ---------------------------------------------------------------------------------------------------------
# Concurrency and failures
# ---------------------------------------------------------------------------------------------------------

def test_a_publish_racing_another_fails_cleanly(hub, source, built, tmp_path, monkeypatch):
    """Publisher A reads the branch head, publisher B commits, then A commits against the old head: the Hub
    refuses A's commit (parent_commit), A says so, and the branch is B's commit on top of the old head."""
    env = hub_env(hub.url, tmp_path / "hf-b")
    publish(built / "v2", source, env)
    start = heads(hub)["v2"]
    cpu_only = copy_build(built / "v2", tmp_path / "cpu-only", "torch-cpu")
    with_extra = copy_build(built / "v2", tmp_path / "extra", "torch-cpu", "torch-cuda")
    (with_extra / "torch-cpu" / "extra.py").write_text("X = 2\n")
    rehash(with_extra / "torch-cpu")

    from fused_kernels_tools import publish as publisher

    use_local_hub(monkeypatch, hub.url, tmp_path / "hf-a")
    real_tree = publisher._tree
    raced = []

    def tree_then_race(api, repo_id, commit, recursive=True):
        result = real_tree(api, repo_id, commit, recursive)
        if not raced:
            raced.append(publish(cpu_only, source, env))  # B lands while A is preparing its commit
        return result

    monkeypatch.setattr(publisher, "_tree", tree_then_race)
    with pytest.raises(publisher.ToolError) as info:
        publisher.publish(publisher.Options(with_extra, source))
    message = str(info.value)
    b_head = heads(hub)["v2"]
    assert f"v2 moved from {start[:7]} to {b_head[:7]} while publishing" in message
    assert "nothing was committed" in message
    assert history(hub, "v2")[:2] == [b_head, start], "the branch is a clean chain: B on top of the old head"
    assert not [p for p in files(hub, "v2") if p.startswith("build/torch-cuda/") or p.endswith("extra.py")]


def test_concurrent_publishes_to_one_branch(hub, source, built, tmp_path, monkeypatch):
    """Two publishes of different builds at the same moment, both computed against the same head (a barrier
    holds each until the other has read the branch): exactly one commits, the other fails with the conflict
    message, and the branch is the winner's commit on top of the old head."""
    publish(built / "v2", source, hub_env(hub.url, tmp_path / "hf"))
    start, before = heads(hub)["v2"], history(hub, "v2")
    builds = [copy_build(built / "v2", tmp_path / "a", "torch-cpu"), copy_build(built / "v2", tmp_path / "b", "torch-cuda")]

    from fused_kernels_tools import publish as publisher

    use_local_hub(monkeypatch, hub.url, tmp_path / "hf-threads")
    real_tree, barrier = publisher._tree, threading.Barrier(2, timeout=60)

    def tree_then_wait(api, repo_id, commit, recursive=True):
        result = real_tree(api, repo_id, commit, recursive)
        if recursive:
            barrier.wait()
        return result

    monkeypatch.setattr(publisher, "_tree", tree_then_wait)
    outcomes: list = [None, None]

    def run(i: int) -> None:
        try:
            outcomes[i] = publisher.publish(publisher.Options(builds[i], source))
        except Exception as e:  # noqa: BLE001 - inspected below
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    winners = [i for i, outcome in enumerate(outcomes) if outcome == 0]
    losers = [outcome for outcome in outcomes if isinstance(outcome, publisher.ToolError)]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert "while publishing (another publish committed first): nothing was committed" in str(losers[0])
    chain = history(hub, "v2")
    assert chain[1:] == before and chain[1] == start, "one new commit, on top of the old head"
    winner = builds[winners[0]]
    assert {p for p in files(hub, "v2") if p.startswith("build/")} == local_files(winner)


def test_a_failing_commit_leaves_the_branch_as_it_was(hub, source, built, tmp_path, monkeypatch):
    """The commit carries a deletion the Hub refuses (a file that is not there): nothing of it is applied."""
    env = hub_env(hub.url, tmp_path / "hf")
    publish(built / "v2", source, env)
    before_heads, before_files = heads(hub), files(hub, "v2")
    changed = copy_build(built / "v2", tmp_path / "changed", "torch-cpu", "torch-cuda")
    (changed / "torch-cpu" / "extra.py").write_text("X = 3\n")
    rehash(changed / "torch-cpu")

    from fused_kernels_tools import publish as publisher

    use_local_hub(monkeypatch, hub.url, tmp_path / "hf-a")
    real_tree = publisher._tree

    def tree_with_a_ghost(api, repo_id, commit, recursive=True):
        result = dict(real_tree(api, repo_id, commit, recursive))
        if recursive:
            result["build/torch-ghost/gone.py"] = next(iter(result.values()))
        return result

    monkeypatch.setattr(publisher, "_tree", tree_with_a_ghost)
    with pytest.raises(publisher.ToolError) as info:
        publisher.publish(publisher.Options(changed, source))
    assert f"upload to v2 failed, nothing was committed (v2 is unchanged at {before_heads['v2'][:7]})" in str(info.value)
    assert heads(hub) == before_heads and files(hub, "v2") == before_files


def test_a_server_stopping_mid_publish_leaves_the_branch_as_it_was(source, built, tmp_path, monkeypatch):
    root = tmp_path / "hub"
    server = HubServer(root, **TRUSTED).start()
    try:
        publish(built / "v2", source, hub_env(server.url, tmp_path / "hf"))
        before_heads, before_files = heads(server), files(server, "v2")
        changed = copy_build(built / "v2", tmp_path / "changed", "torch-cpu")

        from huggingface_hub import _commit_api

        from fused_kernels_tools import publish as publisher

        use_local_hub(monkeypatch, server.url, tmp_path / "hf-a")
        real_send = _commit_api._send_commit

        def stop_then_send(**kwargs):
            server.stop()  # the server goes away between the preupload and the commit request
            return real_send(**kwargs)

        monkeypatch.setattr(_commit_api, "_send_commit", stop_then_send)
        with pytest.raises(publisher.ToolError) as info:
            publisher.publish(publisher.Options(changed, source))
        assert "upload to v2 failed, nothing was committed" in str(info.value)
    finally:
        server.stop()
    with HubServer(root, **TRUSTED) as restarted:
        assert heads(restarted) == before_heads and files(restarted, "v2") == before_files


# ---------------------------------------------------------------------------------------------------------
# The token
# ---------------------------------------------------------------------------------------------------------

def test_the_token_never_appears_in_output(source, built, tmp_path):
    token = f"hf_{secrets.token_hex(16)}"
    with running_hub(tmp_path, token=token, **TRUSTED) as server:
        env = hub_env(server.url, tmp_path / "hf", token=token)
        outputs = [publish(built / "v1", source, env, "--dry-run"), publish(built / "v1", source, env),
                   publish(built / "v1", source, env)]
        assert "committed to v1" in outputs[1].stdout
        # A wrong token: refused by the server, and neither token is printed.
        wrong = f"hf_{secrets.token_hex(16)}"
        refused = publish(built / "v2", source, hub_env(server.url, tmp_path / "hf2", token=wrong), check=False)
        assert refused.returncode == 1 and refused.stderr.startswith("error: ")
        outputs.append(refused)
        # The token stored by `hf auth login` (no HF_TOKEN): resolved by huggingface_hub, not printed either.
        stored = hub_env(server.url, tmp_path / "hf3", token=None)
        (tmp_path / "hf3").mkdir()
        (tmp_path / "hf3" / "token").write_text(token)
        outputs.append(publish(built / "v2", source, stored))
        assert "committed to v2" in outputs[-1].stdout
    for proc in outputs:
        text = proc.stdout + proc.stderr
        assert token not in text and wrong not in text
        assert token[3:] not in text


# ---------------------------------------------------------------------------------------------------------
# The demo (make demo)
# ---------------------------------------------------------------------------------------------------------

def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def test_demo_end_to_end(tmp_path):
    env = hub_env("http://unused.invalid", tmp_path / "unused")
    env.pop("HF_ENDPOINT")
    proc = tool("demo", "--workdir", str(tmp_path / "work"), env=env, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "demo: PASS" in out and "all checks passed" in out
    assert "get_kernel('myorg/fused-kernels', revision='v2')" in out and "get_kernel('myorg/fused-kernels', version=1)" in out
    if TORCH_BACKEND == "cpu":
        assert "chosen torch-cpu: noarch build for this system's backend (cpu)" in out
        assert "rejected  1 (torch-cuda): backend (cuda) does not match system backend (cpu)" in out
    for op in ("rms_norm", "fused_add_rms_norm"):
        assert sum(line.split()[:1] == [op] and line.endswith("checks)") for line in out.splitlines()) == 6
    assert "side by side in one process" in out
    url = next(line.split(" at ")[1].split()[0] for line in out.splitlines() if "local Hub at" in line)
    assert not _port_open(url), "the demo stops its server"
    assert not (tmp_path / "work" / "hub.port").exists()


def test_demo_fails_on_an_exported_function_without_a_check(hub, tmp_path):
    """The demo's client refuses a kernel exporting a function it has no check for."""
    src = make_snapshot(tmp_path / "src")
    init = src / "torch-ext" / "fused_kernels" / "__init__.py"
    text = init.read_text().replace('__all__ = ["layers",', '__all__ = ["layers", "unchecked",')
    init.write_text(text + "\n\ndef unchecked(x):\n    return x\n")
    git(src, "commit", "-q", "-am", "a function without a demo check")
    out = tmp_path / "out"
    run_tool("build", "--source", str(src), "--out", str(out), "--only", "torch-cpu", "torch-cuda", "--version", "2")
    publish(out, src, hub_env(hub.url, tmp_path / "hf"), "--no-release-check")
    proc = subprocess.run([sys.executable, "-m", "fused_kernels_tools.demo", "--repo-id", REPO_ID, "revision=v2"],
                          env=hub_env(hub.url, tmp_path / "hf-client"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "exported functions without a check in demo.CHECKS: ['unchecked']" in proc.stdout
    assert "unchecked            -         NO CHECK" in proc.stdout


def test_release_build_and_publish_carry_the_benchmark_scripts(hub, env, source, tmp_path):
    """This repository's `benchmarks/benchmark_*.py` (the `kernels benchmark` scripts) go, as kernel-builder puts
    them, beside the variants in `release build`'s output and onto the version branch."""
    with_benchmarks = tmp_path / "src"
    shutil.copytree(source, with_benchmarks)
    scripts = sorted((REPO_ROOT / "benchmarks").glob("benchmark_*.py"))
    (with_benchmarks / "benchmarks").mkdir()
    for script in scripts:
        shutil.copyfile(script, with_benchmarks / "benchmarks" / script.name)
    git(with_benchmarks, "add", "-A")
    git(with_benchmarks, "commit", "-q", "-m", "benchmark scripts")
    out = tmp_path / "dist"
    run_tool("release", "build", "--source", str(with_benchmarks), "--out", str(out), "--only", "torch-cpu")
    assert sorted(p.name for p in (out / "v2" / "benchmarks").iterdir()) == [p.name for p in scripts]

    publish(out / "v2", with_benchmarks, env)
    published = {p for p in files(hub, "v2") if p.startswith("benchmarks/")}
    assert published == {f"benchmarks/{p.name}" for p in scripts}
