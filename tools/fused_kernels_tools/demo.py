"""`demo` (`make demo`): build v1 and v2, publish them to a local Hub, load them back and check every op.

The orchestration (`python -m fused_kernels_tools demo`):
  1. builds every version of releases.toml from its own source (`release build`);
  2. starts the local Hub (`hub serve`, a subprocess on a free port, temporary storage, `myorg` trusted);
  3. publishes v1 and v2 with the publisher (subprocesses with HF_ENDPOINT);
  4. runs this module as a fresh interpreter (`python -m fused_kernels_tools.demo`) with HF_ENDPOINT and a
     fresh HF_HOME: `kernels.get_kernel(repo, revision="v2")` and `get_kernel(repo, version=1)`, which
     variant was chosen and why, every exported function forward and backward against float64 references;
  5. stops the server, always.
Exit status 0 only when everything passed.

Checks: `CHECKS` maps each exported function to a check; an exported function without an entry fails the
demo, so a new kernel has to bring its check along.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .errors import ToolError

TOOLS_DIR = Path(__file__).resolve().parent.parent
DEMO_ORG = "myorg"
# Variables that would make the client talk elsewhere, reuse state, or break kernels 0.17.2 (telemetry off
# makes its user agent end in a space, which httpx refuses: docs hub-http-protocol.md §7).
CLIENT_ENV_REMOVE = ("HF_HUB_DISABLE_TELEMETRY", "DO_NOT_TRACK", "DISABLE_TELEMETRY", "HF_HUB_OFFLINE",
                     "LOCAL_KERNELS", "KERNELS_CACHE", "HF_HUB_CACHE", "HF_TOKEN", "HF_TOKEN_PATH",
                     "HUGGING_FACE_HUB_TOKEN", "TRITON_INTERPRET")


# ======================================================================================================
# Orchestration (the `demo` subcommand)
# ======================================================================================================

def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def _indent(text: str) -> str:
    return "\n".join("   " + line for line in text.rstrip().splitlines())


def client_env(endpoint: str, hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV_REMOVE}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_PROGRESS_BARS="1",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(TOOLS_DIR), os.environ.get("PYTHONPATH")])))
    return env


def _tool(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fused_kernels_tools", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


class LocalHub:
    """`hub serve` as a subprocess: started on a free port, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, root: Path, work: Path):
        self.root, self.port_file, self.log = root, work / "hub.port", work / "hub.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> "LocalHub":
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(TOOLS_DIR), os.environ.get("PYTHONPATH")])))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fused_kernels_tools", "hub", "serve", "--root", str(self.root), "--port", "0",
                 "--trusted-org", DEMO_ORG, "--port-file", str(self.port_file)],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while not self.port_file.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise ToolError(f"the local Hub did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(self.port_file.read_text())}"
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _publish_all(versions: list[int], built: dict[int, Path], source: Path, env: dict[str, str]) -> bool:
    for version in versions:
        _step(f"3. publish v{version}")
        t0 = time.monotonic()
        proc = _tool("publish", str(built[version]), "--source", str(source), "--allow-dirty", env=env)
        print(_indent(proc.stdout + proc.stderr))
        if proc.returncode != 0:
            print(f"   FAIL: publishing v{version} failed (exit {proc.returncode})")
            return False
        print(f"   ({time.monotonic() - t0:.1f} s)")
    return True


def run_demo(source: Path, workdir: Path | None, keep: bool) -> int:
    from .publish import default_repo_id
    from .releases import build_releases, load_releases

    sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with the subprocesses' output
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fused-kernels-demo-")) if workdir is None else workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    repo_id = default_repo_id(source)
    status = 1
    try:
        releases = load_releases(source / "releases.toml")
        versions = [r.version for r in releases]
        _step(f"1. build v{', v'.join(map(str, versions))} from releases.toml")
        built = build_releases(source, source / "releases.toml", work / "release", allow_dirty=True)
        print(f"   ({time.monotonic() - started:.1f} s)")

        with LocalHub(work / "hub", work) as hub:
            _step(f"2. local Hub at {hub.url} (storage {work / 'hub'}, trusted org {DEMO_ORG})")
            published = _publish_all(versions, built, source, client_env(hub.url, work / "hf-publisher"))
            if published:
                newest, oldest = max(versions), min(versions)
                _step(f"4. load from the Hub in a fresh process (HF_ENDPOINT={hub.url}, fresh HF_HOME) and check the ops")
                loads = [f"revision=v{newest}", f"version={oldest}"]
                t0 = time.monotonic()
                proc = subprocess.run([sys.executable, "-m", "fused_kernels_tools.demo", "--repo-id", repo_id, *loads],
                                      env=client_env(hub.url, work / "hf-client"), text=True, timeout=600)
                print(f"   ({time.monotonic() - t0:.1f} s)")
                status = proc.returncode
    finally:
        if keep or workdir is not None:
            print(f"\nwork directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    verdict = "PASS" if status == 0 else "FAIL"
    print(f"\ndemo: {verdict} in {time.monotonic() - started:.1f} s")
    return 0 if status == 0 else 1


# ======================================================================================================
# Client side: runs in a fresh interpreter with HF_ENDPOINT already set (python -m fused_kernels_tools.demo)
# ======================================================================================================

# Max normwise relative error |out - ref|_max / |ref|_max allowed against the float64 reference, per dtype:
# 4 units of rounding of bf16 (2^-8) and fp16 (2^-11); fp32 allows for other reduction orders (GPU).
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
DTYPES = ("float32", "bfloat16", "float16")
EPS = 1e-6


def _rel_err(out, ref) -> float:
    import torch

    out64 = out.detach().to(torch.float64)
    scale = ref.abs().max().item() or 1.0
    return (out64 - ref).abs().max().item() / scale


def _inputs(dtype, device, seed, *shapes):
    """Standard normal tensors of the given shapes, drawn in float32 on the CPU (same values everywhere)."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
            for shape in shapes]


def _ref_rms_norm(x, w, mode):
    """float64 reference: RMS over the last dimension, then the scale (1 + w in gemma mode)."""
    import torch

    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    return x * rstd * ((1.0 + w) if mode == "gemma" else w)


def check_rms_norm(fk, device, dtype_name) -> list[tuple[str, float]]:
    """rms_norm in its three modes, forward and backward (dx, dweight)."""
    import torch

    dtype = getattr(torch, dtype_name)
    rows = []
    for i, mode in enumerate(("llama", "gemma", "plain")):
        x, w, dy = _inputs(dtype, device, 100 + i, (3, 5, 80), (80,), (3, 5, 80))
        w = (w * 0.1 + (0.0 if mode == "gemma" else 1.0)).detach()
        x.requires_grad_(True)
        w.requires_grad_(True)
        y = fk.rms_norm(x, w, eps=EPS, mode=mode)
        y.backward(dy)
        x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
        ref = _ref_rms_norm(x64, w64, mode)
        ref.backward(dy.double())
        rows += [(f"{mode} y", _rel_err(y, ref.detach())), (f"{mode} dx", _rel_err(x.grad, x64.grad)),
                 (f"{mode} dw", _rel_err(w.grad, w64.grad))]
    return rows


def check_fused_add_rms_norm(fk, device, dtype_name) -> list[tuple[str, float]]:
    """h = x + residual, (rms_norm(h), h): forward both outputs, backward dx, dresidual, dweight."""
    import torch

    dtype = getattr(torch, dtype_name)
    x, r, w, dy, dh = _inputs(dtype, device, 200, (4, 3, 72), (4, 3, 72), (72,), (4, 3, 72), (4, 3, 72))
    w = (w * 0.1 + 1.0).detach()
    for t in (x, r, w):
        t.requires_grad_(True)
    y, h = fk.fused_add_rms_norm(x, r, w, eps=EPS, mode="llama")
    torch.autograd.backward([y, h], [dy, dh])
    x64, r64, w64 = (t.detach().double().requires_grad_(True) for t in (x, r, w))
    h64 = x64 + r64
    ref = _ref_rms_norm(h64, w64, "llama")
    torch.autograd.backward([ref, h64], [dy.double(), dh.double()])
    return [("y", _rel_err(y, ref.detach())), ("h", _rel_err(h, h64.detach())), ("dx", _rel_err(x.grad, x64.grad)),
            ("dresidual", _rel_err(r.grad, r64.grad)), ("dw", _rel_err(w.grad, w64.grad))]


def _check_gated(fk, device, dtype_name, name, approximate, fused) -> list[tuple[str, float]]:
    """One gated activation (SiLU when `approximate` is None, else GELU), forward and backward, from two
    tensors or from one fused (..., 2I) tensor, against float64 `act(gate) * up`."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    width = 96
    x, dy = _inputs(dtype, device, 300, (3, 5, 2 * width), (3, 5, width))
    x.requires_grad_(True)
    kwargs = {} if approximate is None else {"approximate": approximate}
    y = getattr(fk, name)(x, **kwargs) if fused else getattr(fk, name)(x[..., :width], x[..., width:], **kwargs)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    gate, up = x64[..., :width], x64[..., width:]
    ref = (F.silu(gate) if approximate is None else F.gelu(gate, approximate=approximate)) * up
    ref.backward(dy.double())
    label = "silu" if approximate is None else f"gelu {approximate}"
    return [(f"{label} y", _rel_err(y, ref.detach())),
            (f"{label} dgate", _rel_err(x.grad[..., :width], x64.grad[..., :width])),
            (f"{label} dup", _rel_err(x.grad[..., width:], x64.grad[..., width:]))]


def check_swiglu(fk, device, dtype_name) -> list[tuple[str, float]]:
    """silu(gate) * up, forward and backward (dgate, dup)."""
    return _check_gated(fk, device, dtype_name, "swiglu", None, fused=False)


def check_geglu(fk, device, dtype_name) -> list[tuple[str, float]]:
    """gelu(gate) * up, exact and tanh-approximated, forward and backward."""
    return [row for approximate in ("none", "tanh")
            for row in _check_gated(fk, device, dtype_name, "geglu", approximate, fused=False)]


def check_silu_and_mul(fk, device, dtype_name) -> list[tuple[str, float]]:
    """silu(x[..., :I]) * x[..., I:] from one fused tensor, forward and backward."""
    return _check_gated(fk, device, dtype_name, "silu_and_mul", None, fused=True)


def check_gelu_and_mul(fk, device, dtype_name) -> list[tuple[str, float]]:
    """gelu(x[..., :I]) * x[..., I:], exact and tanh-approximated, from one fused tensor."""
    return [row for approximate in ("none", "tanh")
            for row in _check_gated(fk, device, dtype_name, "gelu_and_mul", approximate, fused=True)]


def _ref_rope(x, cos, sin):
    """float64 reference, half-split convention: pairs (x_i, x_{i+R/2}) as complex numbers times cos + i sin."""
    import torch

    half = cos.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:2 * half]) * torch.complex(cos[..., :half], sin[..., :half])
    return torch.cat([z.real, z.imag, x[..., 2 * half:]], -1)


def _check_rope(fk, device, dtype_name, cached) -> list[tuple[str, float]]:
    """q (2, 4 heads, 5, 24) and k (2 heads) with partial rotary (16 of 24): forward q/k, backward dq/dk."""
    import torch

    dtype = getattr(torch, dtype_name)
    q, k, dq, dk, angles = _inputs(dtype, device, 300, (2, 4, 5, 24), (2, 2, 5, 24), (2, 4, 5, 24), (2, 2, 5, 24),
                                   (9, 8))
    table = torch.cat([angles, angles], -1).double()
    cos_cache, sin_cache = table.cos(), table.sin()
    positions = torch.tensor([[0, 1, 2, 3, 4], [8, 6, 4, 2, 0]], device=device)
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    if cached:
        q_out, k_out = fk.apply_rotary_pos_emb_cached(q, k, cos_cache.to(dtype), sin_cache.to(dtype), positions)
    else:
        q_out, k_out = fk.apply_rotary_pos_emb(q, k, cos_cache[positions].to(dtype), sin_cache[positions].to(dtype))
    torch.autograd.backward([q_out, k_out], [dq, dk])
    # The reference uses the tables as the op saw them (rounded to dtype), unsqueezed over heads.
    cos, sin = (t.to(dtype).double()[positions][:, None] for t in (cos_cache, sin_cache))
    rows = []
    for name, x, out, grad_out, grad in (("q", q, q_out, dq, q.grad), ("k", k, k_out, dk, k.grad)):
        x64 = x.detach().double().requires_grad_(True)
        ref = _ref_rope(x64, cos, sin)
        ref.backward(grad_out.double())
        rows += [(f"{name}", _rel_err(out, ref.detach())), (f"d{name}", _rel_err(grad, x64.grad))]
    return rows


def _ref_cross_entropy(x, target, ignore_index=-100):
    """float64 reference: mean over non-ignored tokens of logsumexp(x) - x[target]."""
    import torch

    counted = target != ignore_index
    y = torch.where(counted, target, 0)
    per_token = torch.logsumexp(x, -1) - x.gather(-1, y[..., None])[..., 0]
    return torch.where(counted, per_token, 0.0).sum() / counted.sum()


def check_cross_entropy(fk, device, dtype_name) -> list[tuple[str, float]]:
    """cross_entropy (mean, one ignored token): loss and dlogits."""
    import torch

    dtype = getattr(torch, dtype_name)
    (x,) = _inputs(dtype, device, 300, (6, 300))
    target = torch.arange(6, device=device) * 37
    target[2] = -100
    x.requires_grad_(True)
    loss = fk.cross_entropy(x, target)
    loss.backward()
    x64 = x.detach().double().requires_grad_(True)
    ref = _ref_cross_entropy(x64, target)
    ref.backward()
    return [("loss", _rel_err(loss, ref.detach())), ("dlogits", _rel_err(x.grad, x64.grad))]


def check_fused_linear_cross_entropy(fk, device, dtype_name) -> list[tuple[str, float]]:
    """fused_linear_cross_entropy (mean, two chunks, one ignored token): loss, dhidden, dweight."""
    import torch

    dtype = getattr(torch, dtype_name)
    hidden, weight = _inputs(dtype, device, 400, (6, 32), (300, 32))
    weight = (weight * 0.2).detach()
    target = torch.arange(6, device=device) * 41
    target[3] = -100
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    loss = fk.fused_linear_cross_entropy(hidden, weight, target, chunk_tokens=4)
    loss.backward()
    h64, w64 = (t.detach().double().requires_grad_(True) for t in (hidden, weight))
    ref = _ref_cross_entropy(h64 @ w64.T, target)
    ref.backward()
    return [("loss", _rel_err(loss, ref.detach())), ("dhidden", _rel_err(hidden.grad, h64.grad)),
            ("dweight", _rel_err(weight.grad, w64.grad))]


# Every exported function needs an entry here: the demo fails on an exported function without one.
def _ref_attention(q, k, v, causal):
    """float64 reference for (batch, seq, heads, dim) tensors: softmax(q k^T / sqrt(d)) v, GQA by repetition,
    causal masks aligned bottom-right as in FlashAttention-2."""
    import torch

    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        rows = torch.arange(q.shape[1])[:, None] + (k.shape[1] - q.shape[1])
        scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > rows, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v)


def _check_attention(fk, device, dtype_name, form) -> list[tuple[str, float]]:
    """Causal GQA attention (q 2 x 24 x 4 heads x 32, k/v 2 heads) through one of the FA2-style entry points,
    forward and backward, against float64. float32 is not an FA2 dtype: the check is that it is refused."""
    import torch

    if dtype_name == "float32":
        q = torch.zeros(1, 4, 2, 32, device=device)
        try:
            fk.flash_attn_func(q, q, q)
        except TypeError:
            return [("rejects float32", 0.0)]
        return [("accepted float32", 1.0)]
    dtype = getattr(torch, dtype_name)
    q, k, v, dout = _inputs(dtype, device, 400, (2, 24, 4, 32), (2, 24, 2, 32), (2, 24, 2, 32), (2, 24, 4, 32))
    for t in (q, k, v):
        t.requires_grad_(True)
    cu = torch.tensor([0, 24, 48], dtype=torch.int32, device=device)
    flat = [t.reshape(48, *t.shape[2:]) for t in (q, k, v)]
    if form == "dense":
        out = fk.flash_attn_func(q, k, v, causal=True)
    elif form == "varlen":
        out = fk.flash_attn_varlen_func(*flat, cu, cu, 24, 24, causal=True).reshape(q.shape)
    elif form == "kvpacked":
        out = fk.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True)
    else:  # varlen_kvpacked
        out = fk.flash_attn_varlen_kvpacked_func(flat[0], torch.stack(flat[1:], 1), cu, cu, 24, 24,
                                                 causal=True).reshape(q.shape)
    out.backward(dout)
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_(True) for t in (q, k, v))
    ref = _ref_attention(q64, k64, v64, causal=True)
    ref.backward(dout.cpu().double())
    return [("out", _rel_err(out.cpu(), ref.detach())), ("dq", _rel_err(q.grad.cpu(), q64.grad)),
            ("dk", _rel_err(k.grad.cpu(), k64.grad)), ("dv", _rel_err(v.grad.cpu(), v64.grad))]


def _check_qkv_packed(fk, device, dtype_name, varlen) -> list[tuple[str, float]]:
    """The qkv-packed forms (equal head counts): q, k, v from one tensor, against float64."""
    import torch

    if dtype_name == "float32":
        return _check_attention(fk, device, dtype_name, "dense")
    dtype = getattr(torch, dtype_name)
    qkv, dout = _inputs(dtype, device, 500, (2, 20, 3, 2, 32), (2, 20, 2, 32))
    qkv.requires_grad_(True)
    if varlen:
        cu = torch.tensor([0, 20, 40], dtype=torch.int32, device=device)
        out = fk.flash_attn_varlen_qkvpacked_func(qkv.reshape(40, 3, 2, 32), cu, 20, causal=True).reshape(dout.shape)
    else:
        out = fk.flash_attn_qkvpacked_func(qkv, causal=True)
    out.backward(dout)
    qkv64 = qkv.detach().cpu().double().requires_grad_(True)
    ref = _ref_attention(*qkv64.unbind(2), causal=True)
    ref.backward(dout.cpu().double())
    return [("out", _rel_err(out.cpu(), ref.detach())), ("dqkv", _rel_err(qkv.grad.cpu(), qkv64.grad))]


CHECKS = {
    "flash_attn_func": lambda fk, device, dtype_name: _check_attention(fk, device, dtype_name, "dense"),
    "flash_attn_varlen_func": lambda fk, device, dtype_name: _check_attention(fk, device, dtype_name, "varlen"),
    "flash_attn_kvpacked_func": lambda fk, device, dtype_name: _check_attention(fk, device, dtype_name, "kvpacked"),
    "flash_attn_varlen_kvpacked_func":
        lambda fk, device, dtype_name: _check_attention(fk, device, dtype_name, "varlen_kvpacked"),
    "flash_attn_qkvpacked_func": lambda fk, device, dtype_name: _check_qkv_packed(fk, device, dtype_name, False),
    "flash_attn_varlen_qkvpacked_func":
        lambda fk, device, dtype_name: _check_qkv_packed(fk, device, dtype_name, True),
    "rms_norm": check_rms_norm,
    "fused_add_rms_norm": check_fused_add_rms_norm,
    "swiglu": check_swiglu,
    "geglu": check_geglu,
    "silu_and_mul": check_silu_and_mul,
    "gelu_and_mul": check_gelu_and_mul,
    "apply_rotary_pos_emb": lambda fk, device, dtype_name: _check_rope(fk, device, dtype_name, cached=False),
    "apply_rotary_pos_emb_cached": lambda fk, device, dtype_name: _check_rope(fk, device, dtype_name, cached=True),
    "cross_entropy": check_cross_entropy,
    "fused_linear_cross_entropy": check_fused_linear_cross_entropy,
}


def exported_functions(module) -> list[str]:
    return [name for name in getattr(module, "__all__", [])
            if inspect.isfunction(getattr(module, name, None)) or inspect.isbuiltin(getattr(module, name, None))]


def _explain(decisions) -> list[str]:
    """The chosen variant and why, then one line per family of rejected variants (same reason, other values)."""
    from kernels import VariantAccepted
    from kernels.variants import ArchVariant

    accepted = [d.variant for d in decisions if isinstance(d, VariantAccepted)]
    rejected = [d for d in decisions if not isinstance(d, VariantAccepted)]
    lines = []
    if accepted:
        chosen = accepted[0]
        if isinstance(chosen, ArchVariant):
            why = "a build compiled for this torch and backend; kernels prefers arch builds over noarch ones"
        else:
            arch_ok = any(isinstance(v, ArchVariant) for v in accepted)
            why = (f"noarch build for this system's backend ({chosen.arch.backend_name})"
                   + ("" if arch_ok else "; no arch build matches this system"))
        lines.append(f"chosen {chosen.variant_str}: {why}")
        if len(accepted) > 1:
            lines.append("also compatible, less preferred: " + ", ".join(v.variant_str for v in accepted[1:]))
    families: dict[str, list] = {}
    for d in rejected:
        families.setdefault(re.sub(r"\([^)]*\)", "(*)", d.reason, count=1), []).append(d)
    for members in sorted(families.values(), key=lambda m: -len(m)):
        example = members[0]
        more = f" and {len(members) - 1} more" if len(members) > 1 else ""
        lines.append(f"rejected {len(members):2d} ({example.variant.variant_str}{more}): {example.reason}")
    return lines


def client_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="demo client: load versions from HF_ENDPOINT and check the ops")
    parser.add_argument("--repo-id", required=True)
    parser.add_argument("loads", nargs="+", help="revision=<rev> or version=<N>")
    args = parser.parse_args(argv)

    import torch

    import kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"   endpoint {os.environ.get('HF_ENDPOINT')}, device {device}"
          f" ({torch.cuda.get_device_name() if device.type == 'cuda' else 'no GPU'}), torch {torch.__version__},"
          f" kernels {kernels.__version__}")
    failures: list[str] = []
    loaded = []
    for load in args.loads:
        key, _, value = load.partition("=")
        kwargs = {"revision": value} if key == "revision" else {"version": int(value)}
        label = f"{key}={value!r}" if key == "revision" else f"{key}={value}"
        print(f"\n   get_kernel({args.repo_id!r}, {label})")
        try:
            decisions = kernels.get_kernel_variants(args.repo_id, **kwargs)
            module = kernels.get_kernel(args.repo_id, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported, the demo fails
            failures.append(f"{label}: {type(e).__name__}: {e}")
            print(f"   FAIL {failures[-1]}")
            continue
        for line in _explain(decisions):
            print(f"     {line}")
        build_info = sys.modules.get(f"{module.__name__}._build_info")
        namespace = getattr(sys.modules.get(f"{module.__name__}._ops"), "_OPS_NAME", "?")
        version = getattr(build_info, "VERSION", "?")
        commit = getattr(build_info, "COMMIT", "?")[:7] + ("_dirty" if getattr(build_info, "DIRTY", False) else "")
        print(f"     loaded variant {getattr(module, 'VARIANT', '?')}: id {module.__name__}, ops torch.ops.{namespace},"
              f" version {version}, source {commit}")
        chosen = next((d.variant.variant_str for d in decisions if type(d).__name__ == "VariantAccepted"), None)
        if getattr(module, "VARIANT", None) != chosen:
            failures.append(f"{label}: loaded variant {getattr(module, 'VARIANT', None)}, resolver preferred {chosen}")
        expected_version = kwargs.get("version") or int(str(kwargs.get("revision", "v0")).lstrip("v") or 0)
        if version != expected_version:
            failures.append(f"{label}: metadata version {version}, expected {expected_version}")
        loaded.append((label, module))

        functions = exported_functions(module)
        missing = [name for name in functions if name not in CHECKS]
        if missing:
            failures.append(f"{label}: exported functions without a check in demo.CHECKS: {missing}")
        print(f"     {'op':<20} {'dtype':<9} {'worst check':<16} {'max rel err':>11} {'limit':>8}")
        for name in functions:
            if name not in CHECKS:
                print(f"     {name:<20} {'-':<9} {'NO CHECK':<16} {'':>11} {'':>8}  FAIL")
                continue
            for dtype in DTYPES:
                try:
                    rows = CHECKS[name](module, device, dtype)
                except Exception as e:  # noqa: BLE001
                    failures.append(f"{label}: {name} {dtype}: {type(e).__name__}: {e}")
                    print(f"     {name:<20} {dtype:<9} {'raised':<16} {'':>11} {'':>8}  FAIL ({type(e).__name__}: {e})")
                    continue
                limit = TOLERANCE[dtype]
                worst_label, worst = max(rows, key=lambda row: row[1])
                bad = [f"{what} {err:.2e}" for what, err in rows if not err <= limit]
                if bad:
                    failures.append(f"{label}: {name} {dtype}: above {limit:.1e}: {', '.join(bad)}")
                print(f"     {name:<20} {dtype:<9} {worst_label:<16} {worst:>11.2e} {limit:>8.1e}  "
                      f"{'FAIL' if bad else 'ok'} ({len(rows)} checks)")

    if len(loaded) > 1:
        names = [module.__name__ for _, module in loaded]
        namespaces = [sys.modules[f"{module.__name__}._ops"]._OPS_NAME for _, module in loaded]
        if len(set(names)) != len(names) or len(set(namespaces)) != len(namespaces):
            failures.append(f"versions share a module id or op namespace: {names}, {namespaces}")
        else:
            print(f"\n   side by side in one process: {', '.join(f'{label} -> {n}' for (label, _), n in zip(loaded, names))}")
    print()
    if failures:
        for failure in failures:
            print(f"   FAIL {failure}")
        print(f"   {len(failures)} failure(s)")
        return 1
    print("   all checks passed")
    return 0


def demo_main(args: argparse.Namespace) -> int:
    return run_demo(args.source.resolve(), args.workdir, args.keep)


if __name__ == "__main__":
    sys.exit(client_main())
