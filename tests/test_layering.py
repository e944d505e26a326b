"""The layering of DESIGN.md, enforced: a layer imports only layers below it, and importing
warmlink loads no optional or heavy library."""

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
