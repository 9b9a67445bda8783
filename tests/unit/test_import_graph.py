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
# A module belongs to the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("foundation", ("rapidtrain.errors", "rapidtrain.metrics", "rapidtrain.peak_flops", "rapidtrain.cpu_allocator",
                    "rapidtrain.shutdown", "rapidtrain.slurm", "rapidtrain.partitioning"),
     "small utilities and tables that know nothing of the rest of rapidtrain"),
    ("components", ("rapidtrain.models", "rapidtrain.data", "rapidtrain.optim", "rapidtrain.tasks.lora",
                    "rapidtrain.tasks.metrics", "rapidtrain.checkpoint", "rapidtrain.save_folder"),
     "models, data, tokenizers, optimizers, the checkpoint format: building blocks set up by their own settings "
     "dataclasses"),
    ("flags", ("rapidtrain.arguments", "rapidtrain.compat.flags"),
     "the command line: declared flags and Megatron's/Rapidformer's meanings of them"),
    ("resolution", ("rapidtrain.rules", "rapidtrain.plan"),
     "resolution of the flags into refusals and the Plan: no process group, device or model is touched"),
    ("parallel", ("rapidtrain.parallel",), "applies the plan to a model: mesh, transforms, wrappers, runners"),
    ("run", ("rapidtrain.engine", "rapidtrain.own_loop", "rapidtrain.tracking", "rapidtrain.profiling",
             "rapidtrain.checkpoint_reader"),
     "the engine: distributed start-up, composing model and runner, the step decision, logging back-ends"),
    ("trainers", ("rapidtrain.trainers",), "the training loop and its templates (PreTrainer, Finetuner, Trainer)"),
    ("tasks", ("rapidtrain.tasks",), "fine-tuning tasks over Hugging Face models, run by the Finetuner"),
    ("entry points", ("rapidtrain", "rapidtrain.compat", "rapidtrain.pretrain", "rapidtrain.finetune",
                      "rapidtrain.cli", "rapidtrain.rapidformer", "rapidtrain.training", "rapidtrain.generation",
                      "rapidtrain.user_script"),
     "what users run or import: commands, entry scripts, the public and the Megatron/Rapidformer APIs"),
)


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
    """Index in LAYERS of the longest prefix naming `module`; None when no layer names it."""
    best: tuple[int, int] | None = None
    for position, (_, prefixes, _) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), position)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            low, high = layer_of(module), layer_of(target)
            if low is not None and high is not None and high > low:
                found.append(f"{module} (layer {LAYERS[low][0]!r}) imports {target} (layer {LAYERS[high][0]!r}) "
                             f"at line {line}")
    return found


def test_every_module_has_a_layer():
    unplaced = [name for name in module_files() if layer_of(name) is None]
    assert not unplaced, f"modules in no layer (add them to LAYERS in {__file__}): {unplaced}"


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
    graph = {"rapidtrain.plan": {"rapidtrain.parallel.mesh": 3},
             "rapidtrain.parallel.mesh": {"rapidtrain.plan": 7}, "rapidtrain.errors": {}}
    assert cycles(graph) == [["rapidtrain.parallel.mesh", "rapidtrain.plan"]]
    assert upward_imports(graph) == ["rapidtrain.plan (layer 'resolution') imports rapidtrain.parallel.mesh "
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
