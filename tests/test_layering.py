"""The layering of DESIGN.md, enforced: a layer imports only layers below it, no module of warmlink
imports another module's private names, no import cycle runs through warmlink, and importing
warmlink loads no optional or heavy library.

The rules read every ``import`` statement of ``src/warmlink``, at module level or inside a
function alike (a lazy import still ties the two modules together):

- **Edges.** ``import a.b.c`` and ``from a.b.c import name`` depend on ``a.b.c``; ``from a.b
  import c`` depends on ``a.b.c`` when that is a module, else on ``a.b``. A package's
  ``__init__`` counts as the package's module; the parent packages Python imports implicitly on
  the way are not edges.
- **Private names.** A ``_``-prefixed name is private to the module that defines it: ``from
  warmlink.x.y import _name`` fails unless ``warmlink.x.y._name`` is a module. (Dunder names
  such as ``__version__`` are not private.)
- **Private modules.** A ``_``-prefixed module is internal to the package that holds it: any
  module of that package or of its subpackages may import it (``warmlink.ep.low_latency._runtime``
  imports ``warmlink.ep.low_latency._layout``; every module may import ``warmlink._env``). A module of another
  package may not, except for the entries of ``CROSS_PACKAGE``, each with its reason.
- **Cycles.** The graph of those edges between warmlink's modules has no cycle.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "warmlink"

# Lower number = lower layer. Top-level private modules (errors, _env, _dtypes, _cuda) are the base.
LAYERS = {"pool": 1, "transport": 2, "rendezvous": 3, "refit": 4, "ep": 4, "bench": 5, "cli": 6, "integrations": 6}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 and parts[0] == "warmlink" else 0


def _modules() -> dict[str, pathlib.Path]:
    """Every module of warmlink by dotted name (a package by its own name)."""
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


def _edges(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[tuple[str, str]]:
    """``(imported module, name or "")`` of each import of warmlink in ``path`` (see the module docstring)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "warmlink"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package (level 1) or above it
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base.split(".")[0] != "warmlink":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, "") if sub in modules else (base, alias.name))
    return out


def _private_module_owner(imported: str) -> str | None:
    """The package that holds the first ``_``-prefixed module on the way to ``imported``, or None."""
    parts = imported.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


# Private modules imported across packages, each (importer, imported): why a fix would be worse.
CROSS_PACKAGE: dict[tuple[str, str], str] = {
    ("warmlink.cli.doctor", "warmlink.transport._nixl_agent"): "doctor says whether NIXL is installed where the nixl "
    "backend looks for it: one finder, which a public name would put in transport's API for one diagnostic",
    ("warmlink.cli.doctor", "warmlink.transport._nixl_probe"): "doctor runs the nixl backend's own load probe; a "
    "public probe would widen transport's API for one diagnostic",
    ("warmlink.cli.demo", "warmlink.refit._demo_model"): "the demo's toy model is demo scaffolding kept beside "
    "refit, not part of refit's API",
}


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    violations = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for imported, name in _edges(module, path, modules):
            if name.startswith("_") and not name.startswith("__"):
                violations.append(f"{module}: from {imported} import {name} (private to {imported})")
            owner = _private_module_owner(imported)
            inside = owner is None or package == owner or package.startswith(owner + ".")
            if not inside and (module, imported) not in CROSS_PACKAGE:
                violations.append(f"{module}: imports {imported} (internal to {owner})")
    assert not violations, "private names imported from other modules:\n" + "\n".join(sorted(set(violations)))


def test_cross_package_entries_are_still_needed():
    modules = _modules()
    used = {(module, imported) for module, path in modules.items() for imported, _ in _edges(module, path, modules)}
    assert set(CROSS_PACKAGE) <= used, f"stale CROSS_PACKAGE entries: {sorted(set(CROSS_PACKAGE) - used)}"


def test_no_import_cycles():
    modules = _modules()
    graph = {m: sorted({i for i, _ in _edges(m, p, modules) if i in modules and i != m}) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components, recursive (the graph is small)
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, "import cycles among:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {m for m in found if m.startswith("warmlink")}


def test_no_layer_imports_a_layer_above_it():
    violations = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        own = _layer(module)
        for imported in _imports(path):
            if _layer(imported) > own:
                violations.append(f"{module} (layer {own}) imports {imported} (layer {_layer(imported)})")
    assert not violations, "layering violations:\n" + "\n".join(sorted(violations))


# ep's folders, lowest first (ep/__init__ says what each holds): a folder imports only folders below it.
EP_FOLDERS = {"kernels": 1, "wire": 2, "paths": 3, "protocol": 4, "low_latency": 5, "api": 6, "deep_ep": 7}


def _ep_folder(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["warmlink", "ep"] or len(parts) < 3:
        return None
    return EP_FOLDERS.get(parts[2])


def test_every_ep_module_lives_in_a_folder_with_a_rank():
    loose = [m for m in _modules() if m.startswith("warmlink.ep.") and _ep_folder(m) is None]
    assert not loose, f"ep modules outside ep's folders (give them a folder in EP_FOLDERS): {sorted(loose)}"


def test_no_ep_folder_imports_a_folder_above_it():
    modules = _modules()
    violations = []
    for module, path in modules.items():
        own = _ep_folder(module)
        if own is None:
            continue
        for imported, _ in _edges(module, path, modules):
            theirs = _ep_folder(imported)
            if imported == "warmlink.ep" and own < EP_FOLDERS["deep_ep"]:
                violations.append(f"{module} imports warmlink.ep itself (only deep_ep, on top, may)")
            elif theirs is not None and theirs > own:
                violations.append(f"{module} imports {imported}, a folder above it")
    assert not violations, "ep folder order broken:\n" + "\n".join(sorted(violations))


def test_ep_files_stay_under_400_lines_or_say_why():
    long = []
    for path in (*(SRC / "ep").rglob("*.py"), *(SRC / "ep").rglob("*.cu"), *(SRC / "ep").rglob("*.cpp")):
        lines = path.read_text().splitlines()
        if len(lines) > 400 and not any("Over 400 lines:" in line for line in lines[:40]):
            long.append(f"{path.relative_to(SRC)} ({len(lines)} lines)")
    assert not long, "ep files over 400 lines with no 'Over 400 lines:' reason near the top: " + ", ".join(long)


def test_import_warmlink_is_cheap_and_lazy():
    code = (
        "import sys, warmlink, warmlink.pool, warmlink.transport, warmlink.rendezvous, warmlink.refit.manifest;"
        "heavy = [m for m in ('torch.distributed', 'cuda.bindings', 'transformers', 'nixl', 'nixl_cu13', 'ray', 'matplotlib', 'rich') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"import warmlink loaded {out.stdout.strip()}"


def test_public_names_are_listed():
    import warmlink
    import warmlink.pool
    import warmlink.refit

    for mod in (warmlink, warmlink.pool, warmlink.refit):
        for name in mod.__all__:
            assert hasattr(mod, name), f"{mod.__name__}.__all__ lists {name!r}, which does not exist"
