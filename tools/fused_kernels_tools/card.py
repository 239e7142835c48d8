"""The README card of the Hub repository: a `{{ name }}` template (CARD.md) and what fills it.

The package of a variant is described statically (`ast`, never imported): the public API (`__all__`),
the functions among it (name, signature, first docstring line) and the Hub layers (classes of layers.py).
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import ToolError

PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")

Reader = Callable[[str], "bytes | None"]  # relative path in a variant directory -> content, None if absent


@dataclass(frozen=True)
class Function:
    name: str
    signature: str  # "(x, weight=None, eps=1e-06, mode='llama')", "" when unknown
    summary: str


@dataclass(frozen=True)
class Layer:
    name: str
    summary: str


@dataclass
class VersionInfo:
    version: int
    branch: str
    commit: str  # source commit of the build (metadata provenance)
    dirty: bool
    variants: list[str]
    api: list[str] = field(default_factory=list)
    functions: list[Function] = field(default_factory=list)
    layers: list[Layer] = field(default_factory=list)


def render(template: str, values: dict[str, str]) -> str:
    """Replace every `{{ name }}`; a name without a value is an error (a typo must not reach the Hub)."""
    missing = sorted({m.group(1) for m in PLACEHOLDER.finditer(template)} - set(values))
    if missing:
        raise ToolError(f"card template uses unknown placeholders {missing} (known: {', '.join(sorted(values))})")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


# ------------------------------------------------------------------------------------------------------
# Static description of a package
# ------------------------------------------------------------------------------------------------------

def _parse(read: Reader, rel: str) -> ast.Module | None:
    data = read(rel)
    if data is None:
        return None
    try:
        return ast.parse(data, filename=rel)
    except SyntaxError:
        return None


def _summary(node: ast.AST) -> str:
    doc = ast.get_docstring(node) or ""
    paragraph = doc.strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def _signature(fn: ast.FunctionDef) -> str:
    args = copy.deepcopy(fn.args)
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if arg is not None:
            arg.annotation = None
    return f"({ast.unparse(args)})"


def _module_file(read: Reader, module: str) -> str | None:
    base = module.replace(".", "/")
    for rel in (f"{base}.py", f"{base}/__init__.py"):
        if read(rel) is not None:
            return rel
    return None


def _top_level(tree: ast.Module, name: str) -> ast.AST | None:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node
    return None


def describe_package(read: Reader) -> tuple[list[str], list[Function], list[Layer]]:
    """(`__all__`, the functions it exports, the layers of layers.py) of a variant's package."""
    init = _parse(read, "__init__.py")
    if init is None:
        raise ToolError("the variant has no readable __init__.py")
    api = _static_all_from_tree(init)
    imported: dict[str, tuple[str | None, str]] = {}  # public name -> (module, name in it); module None: submodule
    for node in init.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                public = alias.asname or alias.name
                imported[public] = (node.module, alias.name) if node.module else (None, alias.name)
    functions = []
    for name in api:
        node = _top_level(init, name)
        if node is None and name in imported:
            module, original = imported[name]
            if module is None:
                continue  # a submodule (layers)
            rel = _module_file(read, module)
            tree = _parse(read, rel) if rel else None
            node = _top_level(tree, original) if tree else None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append(Function(name, _signature(node), _summary(node)))
        elif node is None and not name.isupper() and name != "layers":
            functions.append(Function(name, "", ""))  # unresolved: list it rather than hide it
    layers = []
    tree = _parse(read, "layers.py") or _parse(read, "layers/__init__.py")
    if tree is not None:
        layers = [Layer(n.name, _summary(n)) for n in tree.body
                  if isinstance(n, ast.ClassDef) and not n.name.startswith("_")]
    return api, functions, layers


def _static_all_from_tree(tree: ast.Module) -> list[str]:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                break
            if isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
                return list(value)
    raise ToolError("__init__.py has no literal __all__ list")


# ------------------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------------------

def _functions_section(info: VersionInfo) -> str:
    if not info.functions:
        return "None."
    lines = []
    for fn in info.functions:
        text = f"- `{fn.name}{fn.signature}`"
        lines.append(text + (f": {fn.summary}" if fn.summary else ""))
    return "\n".join(lines)


def _layers_section(info: VersionInfo) -> str:
    if not info.layers:
        return "None."
    return "\n".join(f"- `layers.{layer.name}`" + (f": {layer.summary}" if layer.summary else "")
                     for layer in info.layers)


def _versions_section(infos: list[VersionInfo]) -> str:
    rows = ["| version | branch | source commit | functions | layers | variants |", "|---|---|---|---|---|---|"]
    for info in sorted(infos, key=lambda i: i.version):
        functions = ", ".join(f"`{f.name}`" for f in info.functions) or "-"
        layers = ", ".join(f"`{layer.name}`" for layer in info.layers) or "-"
        commit = info.commit[:7] + (" (dirty)" if info.dirty else "")
        rows.append(f"| {info.version} | `{info.branch}` | `{commit}` | {functions} | {layers} | {len(info.variants)} |")
    return "\n".join(rows)


def _variants_section(info: VersionInfo) -> str:
    from kernels.variants import ArchVariant, parse_variant

    noarch, arch = [], {}
    for name in info.variants:
        try:
            parsed = parse_variant(name)
        except ValueError:
            noarch.append(f"- `{name}`")
            continue
        if isinstance(parsed, ArchVariant):
            key = name.split("-")[0]  # torch<MM>
            arch.setdefault(key, []).append(name)
        else:
            backend = parsed.arch.backend_name
            what = {"cpu": "CPU, plain PyTorch", "cuda": "any CUDA torch, Triton"}.get(backend, backend)
            noarch.append(f"- `{name}` ({what})")
    lines = sorted(noarch)
    for key in sorted(arch):
        names = sorted(arch[key])
        computes = sorted({n.split("-")[-3] for n in names})
        platforms = sorted({"-".join(n.split("-")[-2:]) for n in names})
        version = f"{key[5]}.{key[6:]}"
        lines.append(f"- torch {version}: {', '.join(computes)} on {', '.join(platforms)} "
                     f"(`{names[0]}`, ...)" if len(names) > 1 else f"- `{names[0]}`")
    return "\n".join(lines) if lines else "None."


def card_values(repo_id: str, license: str, infos: list[VersionInfo]) -> dict[str, str]:
    latest = max(infos, key=lambda i: i.version)
    attention = [i.version for i in infos if any(f.name == "flash_attn_varlen_func" for f in i.functions)]
    status = (f"Versions exporting `flash_attn_varlen_func`: {', '.join(f'v{v}' for v in attention)}."
              if attention else "No published version exports `flash_attn_varlen_func` yet: flash attention arrives in v2.")
    return {
        "repo_id": repo_id,
        "org": repo_id.split("/")[0],
        "name": repo_id.split("/")[-1],
        "license": license,
        "latest_version": str(latest.version),
        "latest_branch": latest.branch,
        "functions": _functions_section(latest),
        "layers": _layers_section(latest),
        "versions": _versions_section(infos),
        "variants": _variants_section(latest),
        "attention_status": status,
    }
