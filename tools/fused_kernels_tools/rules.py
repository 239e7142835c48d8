"""Static (AST) rules for the Python files of a variant.

- torch.library registrations name their op through `add_op_namespace_prefix(...)` (the Nix
  torch-ops-check rule, applied to every call and decorator, not only top-level ones, whether the function
  was imported or assigned to a name);
- imports are relative for the package itself, otherwise stdlib, torch, triton or a declared
  python-depends; triton only inside `_kernels/` (so the torch-cpu variant, which has no `_kernels/`,
  never imports it); `importlib.import_module("x")` and `__import__("x")` of a literal name count as imports;
- no `triton.autotune`: it benchmarks on first call on a GPU; ship tuned configs as data instead.
"""

from __future__ import annotations

import ast
import sys

# torch.library functions whose first argument is an op name (or an op object).
OP_NAME_FUNCTIONS = frozenset({
    "custom_op", "triton_op", "register_kernel", "register_fake", "register_autograd", "register_vmap",
    "register_torch_dispatch", "register_autocast", "define", "impl", "impl_abstract",
})
OP_NAME_KEYWORDS = ("qualname", "op", "name", "op_name")
PREFIX_FUNCTION = "add_op_namespace_prefix"
NAMESPACE_CONSTANT = "_OPS_NAME"
# Top-level names that would import the package (or its parts) absolutely instead of relatively.
SELF_IMPORTS_EXTRA = ("kernels_src", "_kernels", "torch_ext")
BASE_ALLOWED = frozenset(sys.stdlib_module_names) | {"torch"}


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """`a.b.c` with the leftmost name resolved through the module's imports; None for other shapes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _is_torch_library_path(qualname: str) -> bool:
    """torch.library itself or anything in it (or in torch._library)."""
    return qualname == "torch.library" or qualname.startswith(("torch.library.", "torch._library"))


def _is_torch_library(qualname: str | None, names: frozenset[str]) -> str | None:
    """The function name if `qualname` is one of `names` in torch.library (or torch._library.*)."""
    if not qualname:
        return None
    module, _, func = qualname.rpartition(".")
    if func in names and _is_torch_library_path(module):
        return func
    return None


def _has_string_literal(node: ast.expr) -> bool:
    return any(isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str))
               for n in ast.walk(node))


def _is_call_to(node: ast.expr, func: str) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == func)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == func)
    )


def _first_argument(call: ast.Call, keywords: tuple[str, ...]) -> ast.expr | None:
    if call.args:
        return call.args[0]
    return next((k.value for k in call.keywords if k.arg in keywords), None)


class _Module:
    """What the rules need to know about one file: import aliases and every assignment by name."""

    def __init__(self, tree: ast.Module):
        self.aliases: dict[str, str] = {}
        self.assignments: dict[str, list[ast.expr]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    if a.name == "*" and node.module == "torch.library":
                        for func in OP_NAME_FUNCTIONS | {"Library"}:
                            self.aliases[func] = f"torch.library.{func}"
                    elif a.name != "*":
                        self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        self.assignments.setdefault(target.id, []).append(node.value)
        self._alias_assignments()

    def _alias_assignments(self) -> None:
        """`register = torch.library.custom_op` (or `lib = torch.library`) makes `register` an alias as much as
        an import would: without this, `@register("myns::op")` escapes the registration rule."""
        resolved: set[str] = set()
        changed = True
        while changed:  # a chain (`a = torch.library; b = a.custom_op`) resolves one link per pass
            changed = False
            for name, values in self.assignments.items():
                if name in resolved:
                    continue
                for value in values:
                    qualname = _dotted(value, self.aliases) if isinstance(value, (ast.Name, ast.Attribute)) else None
                    if qualname and _is_torch_library_path(qualname):
                        self.aliases[name] = qualname
                        resolved.add(name)
                        changed = True
                        break


def _op_name_problem(arg: ast.expr, module: _Module) -> str | None:
    if _is_call_to(arg, PREFIX_FUNCTION):
        return None
    if isinstance(arg, ast.Name):
        values = module.assignments.get(arg.id, [])
        if any(_is_call_to(v, PREFIX_FUNCTION) for v in values):
            return None
        if any(_has_string_literal(v) for v in values):
            return f"{arg.id!r} holds a literal op name"
        return None  # an op object (CustomOpDef, OpOverload) or a parameter: not decidable statically
    if isinstance(arg, ast.Attribute):
        return None  # e.g. ops.rms_norm.default: an op object in our own namespace
    if _has_string_literal(arg):
        return f"literal op name {ast.unparse(arg)}"
    return f"op name {ast.unparse(arg)} is not built by {PREFIX_FUNCTION}()"


def _namespace_problem(arg: ast.expr | None, module: _Module) -> str | None:
    def is_namespace(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == NAMESPACE_CONSTANT) or (
            isinstance(node, ast.Attribute) and node.attr == NAMESPACE_CONSTANT)

    if arg is None or is_namespace(arg):
        return None
    if isinstance(arg, ast.Name) and any(is_namespace(v) for v in module.assignments.get(arg.id, [])):
        return None
    return f"Library namespace {ast.unparse(arg)} is not {NAMESPACE_CONSTANT} from ._ops"


def check_registrations(tree: ast.Module, module: _Module) -> list[tuple[int, str]]:
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        qualname = _dotted(node.func, module.aliases)
        func = _is_torch_library(qualname, OP_NAME_FUNCTIONS)
        if func:
            arg = _first_argument(node, OP_NAME_KEYWORDS)
            problem = _op_name_problem(arg, module) if arg is not None else None
        elif _is_torch_library(qualname, frozenset({"Library"})):
            problem = _namespace_problem(_first_argument(node, ("ns",)), module)
            func = "Library"
        else:
            continue
        if problem:
            problems.append((node.lineno, f"torch.library.{func}: {problem}; register ops through "
                                          f"{PREFIX_FUNCTION}(...) from ._ops so each build has its own namespace"))
    return problems


def _dynamic_import(node: ast.Call, module: _Module) -> str | None:
    """The module that `importlib.import_module("x")` or `__import__("x")` imports, when it is a literal
    absolute name: the same import as `import x`, so the same rules apply (relative names are fine)."""
    qualname = _dotted(node.func, module.aliases)
    if qualname not in ("importlib.import_module", "__import__") or not node.args:
        return None
    name = node.args[0]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)) or name.value.startswith("."):
        return None
    level = node.args[4] if len(node.args) > 4 else next((k.value for k in node.keywords if k.arg == "level"), None)
    if qualname == "__import__" and level is not None and not (isinstance(level, ast.Constant) and level.value == 0):
        return None  # __import__(name, ..., level=1): relative
    return name.value


def check_imports(tree: ast.Module, *, rel_path: str, python_name: str, extra_allowed: frozenset[str],
                  module: _Module | None = None) -> list[tuple[int, str]]:
    """Import rules for the file at `rel_path` (relative to the variant directory)."""
    module = module or _Module(tree)
    problems = []
    parts = rel_path.split("/")
    package_depth = len(parts) - 1  # packages enclosing this module inside the variant, minus the root
    in_kernels = parts[0] == "_kernels"
    self_names = {python_name, *SELF_IMPORTS_EXTRA}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            if node.level > package_depth + 1:
                problems.append((node.lineno, f"relative import {'.' * node.level}{node.module or ''} goes above the package root"))
            continue
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        elif isinstance(node, ast.Call) and (dynamic := _dynamic_import(node, module)) is not None:
            modules = [dynamic]
        else:
            continue
        for name in modules:
            top = name.split(".")[0]
            if top in self_names:
                problems.append((node.lineno, f"absolute self-import of {name!r}; import the package's own modules relatively (from . import ...)"))
            elif top == "triton":
                if not in_kernels:
                    problems.append((node.lineno, f"imports {name!r} outside _kernels/; Triton code belongs in kernels_src/ (the torch-cpu variant must not import triton)"))
            elif top not in BASE_ALLOWED and top not in extra_allowed:
                problems.append((node.lineno, f"imports {name!r}, which is not the stdlib, torch, triton or a declared python-depends"))
    return problems


def check_autotune(tree: ast.Module, module: _Module) -> list[tuple[int, str]]:
    problems = []
    for node in ast.walk(tree):
        found = None
        if isinstance(node, ast.Attribute):
            qualname = _dotted(node, module.aliases) or ""
            if qualname.startswith("triton.") and qualname.rpartition(".")[2] in ("autotune", "Autotuner"):
                found = qualname
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "triton":
            if any(a.name in ("autotune", "Autotuner") for a in node.names):
                found = f"{node.module}.autotune"
        if found:
            problems.append((node.lineno, f"uses {found}: autotuning runs on a GPU at first call and breaks the GPU-less"
                                          " import check; ship tuned launch configs in configs/*.json"))
    return problems


def check_python_source(text: str, *, rel_path: str, python_name: str,
                        extra_allowed: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """All rules for one file; returns (line, message) pairs."""
    try:
        tree = ast.parse(text, filename=rel_path)
    except SyntaxError as e:
        return [(e.lineno or 0, f"syntax error: {e.msg}")]
    module = _Module(tree)
    problems = (check_registrations(tree, module)
                + check_imports(tree, rel_path=rel_path, python_name=python_name, extra_allowed=extra_allowed,
                                 module=module)
                + check_autotune(tree, module))
    return sorted(set(problems))
