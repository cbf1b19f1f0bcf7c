"""No import cycle among the project's modules.

Every ``import`` statement in ``onnx_qat``, ``tf_bridge`` and ``tools`` counts, including the
ones inside functions (a lazy import still ties the two modules together): the modules must
form a directed acyclic graph, so that a module never imports, directly or through others, a
module that imports it back.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("onnx_qat", "tf_bridge", "tools")


def module_files() -> Dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, level: int, name: str) -> str:
    if not level:
        return name
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, known: Set[str]) -> Set[str]:
    """The project modules ``module`` imports anywhere in its file (top level or in functions).

    ``from package import name`` counts as importing ``package.name`` when that is a module,
    else ``package``; a module importing its own package (``from . import __version__``) is
    left out: the package's ``__init__`` runs first whatever the module imports.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module or "")
            names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                found.add(name)
    return found


def import_graph() -> Dict[str, Set[str]]:
    files = module_files()
    known = set(files)
    return {module: imports_of(module, path, known) for module, path in files.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One cycle as a list of modules (first == last), or [] when the graph has none."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(module: str) -> List[str]:
        state[module] = 1
        path.append(module)
        for other in sorted(graph.get(module, ())):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state:
                cycle = visit(other)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return []

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return []


def test_walker_sees_lazy_imports_and_finds_a_cycle():
    graph = import_graph()
    assert "onnx_qat.io.models" in graph["onnx_qat.rewrite"]  # imported inside a function there
    assert "onnx_qat.accuracy.mixed" in graph["onnx_qat.quantize"]  # the mixed-precision dispatch, lazily
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_project_modules():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


# --------------------------------------------------------------------------- allowed directions
#: The stage each module belongs to: the package under ``onnx_qat`` (or the root module), except two
#: finer groups: the targets are data every stage may read; the format passes (the weight roundings AWQ
#: and GPTQ, the FP16/BF16 float parts) run the model, so they sit above placement and runtime although
#: they live with the formats; rule 6's choice is shared by placement and check.
_GROUPS = {"onnx_qat.insertion.targets": "targets", "onnx_qat.formats.awq": "passes",
           "onnx_qat.formats.gptq": "passes", "onnx_qat.formats.float_parts": "passes",
           "onnx_qat.formats.float_cast": "passes", "onnx_qat.placement.residual": "residual"}
_LOW = {"errors", "io", "graph", "formats", "config", "scales", "targets", "residual"}
#: stage -> the stages it may import (docs/architecture.md shows the same picture).
ALLOWED = {
    "onnx_qat": {"errors"},  # the package's __init__: lazy attributes only
    "errors": set(),
    "io": {"errors"},
    "graph": {"errors", "io"},
    "formats": {"errors"},
    "targets": {"errors", "formats"},
    "residual": set(),  # rule 6's choice, which placement, check and the Keras cases share
    "config": {"errors", "formats"},
    "scales": {"errors", "io", "formats"},
    "runtime": {"errors", "io", "graph"},
    "placement": {"errors", "io", "graph", "formats", "config", "targets", "residual"},
    "insertion": {"errors", "io", "graph", "formats", "config", "scales", "targets", "placement"},
    "passes": {"errors", "io", "graph", "formats", "config", "scales", "runtime", "placement", "check"},
    "check": {"errors", "io", "graph", "formats", "targets", "residual"},
    "rewrite": _LOW | {"placement", "insertion", "passes", "runtime", "calibration"},
    "calibration": _LOW | {"runtime", "placement", "insertion"},
    "accuracy": _LOW | {"runtime", "placement", "insertion", "passes", "calibration", "rewrite"},
    "quantize": _LOW | {"placement", "calibration", "accuracy", "rewrite", "passes", "runtime"},
    "argtypes": set(),
    "deploy": _LOW | {"argtypes", "runtime", "check", "passes"},
}


def _group(module: str) -> str:
    if module in _GROUPS:
        return _GROUPS[module]
    parts = module.split(".")
    return parts[1] if parts[0] == "onnx_qat" and len(parts) > 1 else parts[0]


def test_stages_import_only_the_stages_below_them():
    """Each stage imports only what :data:`ALLOWED` lists (the CLI, ``__main__``, ``tf_bridge`` and
    ``tools`` sit on top and may import any stage); ``onnx_qat`` never imports ``tf_bridge`` or ``tools``."""
    wrong = []
    for module, imported in sorted(import_graph().items()):
        group = _group(module)
        for other in sorted(imported):
            target = _group(other)
            if target == group:
                continue
            if module.startswith("onnx_qat") and target in ("tf_bridge", "tools"):
                wrong.append(f"{module} -> {other}")
            elif group in ALLOWED and target not in ALLOWED[group]:
                wrong.append(f"{module} -> {other} ({group} may import {sorted(ALLOWED[group])})")
    assert wrong == []


def test_every_stage_has_a_rule_and_a_docstring_saying_what_it_owns():
    top = {"cli", "__main__"}
    groups = {_group(m) for m in module_files() if m.startswith("onnx_qat")}
    assert groups - top <= set(ALLOWED), sorted(groups - top - set(ALLOWED))
    for package in sorted(p for p in (ROOT / "onnx_qat").iterdir() if (p / "__init__.py").is_file()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        assert "Owns" in doc and "May import" in doc, package.name
