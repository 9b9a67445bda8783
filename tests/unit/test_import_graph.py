"""The import graph of the `rapidtrain` package: no cycle, and no module imports from a layer above its own.

Every `import` and `from ... import` counts, function-local (lazy) ones too: a lazy import still ties the two
modules together, it only hides the tie from the reader. Imports under `if TYPE_CHECKING:` never run and do
not count. The package a module lives in is imported before it by Python itself, so that implicit edge is not
counted either (a package's `__init__` re-exporting its modules is not a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rapidtrain"

# The layers, lowest first: a module may import from its own layer and the layers below, never from one above.
# A layer is a set of folders of rapidtrain/; the modules directly in rapidtrain/ are the entry points (the top layer).
# docs/architecture.md states the same table in words.
LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("foundation", ("core",), "small utilities that know nothing of the rest of rapidtrain"),
    ("components", ("models", "data", "optim", "checkpoint"),
     "models (LoRA included), data, tokenizers, optimizers, the checkpoint format: building blocks set up by their "
     "own settings dataclasses"),
    ("config", ("config",), "the flags resolved once into refusals and the Plan: no process group, device or model"),
    ("parallel", ("parallel",), "applies the plan to a model: mesh, transforms, wrappers, runners"),
    ("train", ("train",), "start-up and compose, the loop and its templates, reporting, tracking, profiling"),
    ("tasks", ("tasks",), "fine-tuning tasks over Hugging Face models, run by the Finetuner"),
    ("facades", ("compat",), "Megatron's and Rapidformer's user-facing APIs"),
    ("entry points", ("",), "what users run or import: commands, entry scripts, the public API"),
)


def folders_on_disk(package: Path = PACKAGE) -> set[str]:
    return {d.name for d in package.iterdir() if d.is_dir() and (d / "__init__.py").exists()}


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    files = {}
    for file in sorted(package.rglob("*.py")):
        parts = file.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = file
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(imported name, line) for each import that runs, descending into functions but not TYPE_CHECKING blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from ((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)
        yield from _imports(node)


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module → {imported rapidtrain module: first line importing it}. `from a import b` is an edge to the module
    a.b when there is one, else to a (b is a name defined in a)."""
    files = module_files(package)
    graph: dict[str, dict[str, int]] = {}
    for name, file in files.items():
        edges = graph.setdefault(name, {})
        for target, line in _imports(ast.parse(file.read_text(), str(file))):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges[target] = min(line, edges.get(target, line))
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the folder holding `module`; the package itself and the modules directly in it are entry
    points. None when no layer names the folder."""
    parts = module.split(".")
    folder = parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""
    for position, (_, folders, _) in enumerate(LAYERS):
        if folder in folders:
            return position
    return None


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            low, high = layer_of(module), layer_of(target)
            if low is not None and high is not None and high > low:
                found.append(f"{module} (layer {LAYERS[low][0]!r}) imports {target} (layer {LAYERS[high][0]!r}) "
                             f"at line {line}")
    return found


def test_every_folder_is_a_layer():
    placed = {folder for _, folders, _ in LAYERS for folder in folders}
    assert folders_on_disk() <= placed, f"folders in no layer (add them to LAYERS in {__file__}): " \
        f"{sorted(folders_on_disk() - placed)}"
    unplaced = [name for name in module_files() if layer_of(name) is None]
    assert not unplaced, f"modules in no layer: {unplaced}"


def test_no_import_cycle():
    graph = import_graph()
    problems = []
    for component in cycles(graph):
        ties = [f"    {a} imports {b} at line {graph[a][b]}" for a in component for b in component if b in graph[a]]
        problems.append("cycle " + " ↔ ".join(component) + ":\n" + "\n".join(ties))
    assert not problems, "\n".join(problems)


def test_no_import_from_a_layer_above():
    found = upward_imports(import_graph())
    assert not found, "imports from a layer above:\n  " + "\n  ".join(found)


def test_the_checks_see_a_cycle_and_an_upward_import():
    # The checks themselves: a made-up graph with one cycle and one upward import is caught.
    graph = {"rapidtrain.config.plan": {"rapidtrain.parallel.mesh": 3},
             "rapidtrain.parallel.mesh": {"rapidtrain.config.plan": 7}, "rapidtrain.core.errors": {}}
    assert cycles(graph) == [["rapidtrain.config.plan", "rapidtrain.parallel.mesh"]]
    assert upward_imports(graph) == ["rapidtrain.config.plan (layer 'config') imports rapidtrain.parallel.mesh "
                                     "(layer 'parallel') at line 3"]


def test_lazy_imports_count_and_type_checking_ones_do_not(tmp_path):
    package = tmp_path / "rapidtrain"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rapidtrain.c\n"
                                  "def f():\n    from rapidtrain import b\n")
    (package / "b.py").write_text("")
    (package / "c.py").write_text("")
    assert import_graph(package)["rapidtrain.a"] == {"rapidtrain.b": 5}
