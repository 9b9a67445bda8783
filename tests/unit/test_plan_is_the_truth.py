"""Nothing after the plan reads the argparse namespace: outside the modules that build the plan, the entry points
and the Megatron/Rapidformer APIs for user scripts, no code reads `args.X`, `self.args`, `engine.args` or calls
`get_args()`. Components are handed their part of the plan instead (DESIGN.md, issue 12)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rapidtrain"

# Modules that may read the namespace: they build the plan (arguments, rules, plan), are entry points, or are the
# Megatron/Rapidformer APIs handed to user scripts (get_args(), mpu, Rapidformer's names).
ALLOWED_MODULES = {
    "config/arguments.py", "config/rules.py", "config/plan.py", "config/meanings.py", "config/saved_checkpoint.py",
    "config/settings.py", "config/resolve.py", "config/memory.py", "config/engines.py",
    "config/flag_surface.py", "config/surface_meanings.py",
    "cli.py", "pretrain.py", "pretrain_gpt.py", "pretrain_bert.py", "finetune.py",
    "rapidformer.py",
}
ALLOWED_PACKAGES = {"compat", "config"}  # config/ resolves the flags: reading them is its job

# (module, function) → why it must read a namespace. Keep this list short; each entry needs a reason.
ALLOWED_FUNCTIONS = {
    ("train/engine.py", "Engine.__init__"):
        "the Engine constructor parses the flags, checks the rules and builds the plan (only up to `self.plan = ...`: "
        "see UP_TO)",
    ("train/engine.py", "Engine._megatron_args"):
        "writes what Megatron's args carry (rank, world size, padded vocabulary) into get_args() for user scripts; "
        "reads nothing back",
    ("train/trainer.py", "Trainer.__init__"):
        "Rapidformer's Trainer exposes self.args (= get_args()) to the user's subclass",
    # Helpers of plan building: called only while the plan is resolved (test_plan_helpers_are_called_only_...).
    **{("models/hf_config.py", name): "reads --pretrained-model-name-or-path's config.json while the plan is built"
       for name in ("trains_builtin_model", "initialises_builtin", "pretrained_vocab_size", "apply_pretrained_defaults",
                    "pretrained_conflicts", "unsupported_reason", "fine_tuned_config", "finetune_conflicts",
                    "is_megatron_checkpoint")},
    **{("config/partitioning.py", name): "the partitioning switches' table, read by the flags, the rules and the plan"
       for name in ("chosen_partitioning", "zero_stage")},
    ("config/saved_checkpoint.py", "saved_model_config"):
        "reads the flags a checkpoint was saved with (not this run's) to rebuild an old checkpoint's model",
    ("train/generation/loading.py", "load_for_generation"):
        "`rapidtrain generate` has no plan: it reads its own options and the flags the checkpoint was saved with",
    ("train/generation/loading.py", "_builtin_tokenizer"):
        "`rapidtrain generate` has no plan: the tokenizer comes from the flags the checkpoint was saved with",
}

# Where the plan-building helpers above may be used: the modules that build the plan, and the reader of a
# checkpoint's saved flags (an older checkpoint's model is rebuilt from them).
PLAN_HELPER_MODULES = {"models/hf_config.py", "config/partitioning.py"}
PLAN_HELPER_USERS = PLAN_HELPER_MODULES | {"config/saved_checkpoint.py"}

# An allowed function whose reads must all come before the statement that assigns this target.
UP_TO = {("train/engine.py", "Engine.__init__"): "self.plan"}

NAMESPACE_NAMES = {"args"}  # the conventional name of the namespace
NAMESPACE_HOLDERS = {"self", "engine", "trainer"}  # `self.args`, `engine.args`, `self.engine.args`
NAMESPACE_TYPES = {"Namespace", "argparse.Namespace", "Args"}  # a parameter annotated so is a namespace


def _is_namespace_annotation(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation).strip("'\"")
    return any(part.strip() in NAMESPACE_TYPES for part in text.split("|"))


def _holds_namespace(node: ast.expr) -> bool:
    """`self.args`, `engine.args`, `self.engine.args`, `trainer.engine.args`."""
    if not (isinstance(node, ast.Attribute) and node.attr == "args"):
        return False
    base = node.value
    return (isinstance(base, ast.Name) and base.id in NAMESPACE_HOLDERS) or \
        (isinstance(base, ast.Attribute) and base.attr in NAMESPACE_HOLDERS - {"self"})


class NamespaceReads(ast.NodeVisitor):
    """Collects (line, function, text) of every read of the namespace in one module."""

    def __init__(self, typing_get_args: bool) -> None:
        self.typing_get_args = typing_get_args  # `from typing import get_args` is not rapidtrain's
        self.scope: list[str] = []
        self.namespaces: list[set[str]] = [set(NAMESPACE_NAMES)]
        self.reads: list[tuple[int, str, str]] = []

    def _record(self, node: ast.AST, text: str) -> None:
        self.reads.append((node.lineno, ".".join(self.scope) or "<module>", text))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        typed = {p.arg for p in params if _is_namespace_annotation(p.annotation)}
        self.scope.append(node.name)
        self.namespaces.append(self.namespaces[-1] | typed)
        self.generic_visit(node)
        self.namespaces.pop()
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        value = node.value
        if isinstance(value, ast.Name) and value.id in self.namespaces[-1] and isinstance(node.ctx, ast.Load):
            self._record(node, ast.unparse(node))
        elif _holds_namespace(value) or (_holds_namespace(node) and isinstance(node.ctx, ast.Load)):
            self._record(node, ast.unparse(node))  # `self.args.lr` (even `self.args.lr = ...`), `self.args`
            return  # `self.args.lr` is one read, not two
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "get_args" and not self.typing_get_args:
            self._record(node, "get_args()")
        elif isinstance(func, ast.Attribute) and func.attr == "get_args" and ast.unparse(func.value) != "typing":
            self._record(node, ast.unparse(node))
        elif isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "vars") and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in self.namespaces[-1]:
            self._record(node, ast.unparse(node)[:60])
        self.generic_visit(node)


def namespace_reads(path: Path) -> list[tuple[int, str, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_get_args = any(isinstance(n, ast.ImportFrom) and n.module == "typing"
                          and any(a.name == "get_args" for a in n.names) for n in ast.walk(tree))
    visitor = NamespaceReads(typing_get_args)
    visitor.visit(tree)
    return visitor.reads


def checked_modules() -> list[Path]:
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if str(relative) in ALLOWED_MODULES or relative.parts[0] in ALLOWED_PACKAGES:
            continue
        modules.append(path)
    return modules


def assignment_line(path: Path, function: str, target: str) -> int:
    """The line of the first statement in `function` ("Class.method") that assigns `target`."""
    node: ast.AST = ast.parse(path.read_text())
    for name in function.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    for statement in ast.walk(node):
        targets = statement.targets if isinstance(statement, ast.Assign) else \
            [statement.target] if isinstance(statement, ast.AnnAssign) else []
        if any(ast.unparse(t) == target for t in targets):
            return statement.lineno
    raise AssertionError(f"{path.name}: {function} no longer assigns {target}: update UP_TO")


def _allowed(relative: str, function: str, line: int) -> bool:
    """A read inside an allowed function (before its UP_TO statement, if it has one), or a function nested in one."""
    for key in ALLOWED_FUNCTIONS:
        if (relative, function) == key or (relative == key[0] and function.startswith(key[1] + ".")):
            return key not in UP_TO or line <= assignment_line(PACKAGE / relative, key[1], UP_TO[key])
    return False


def test_nothing_after_the_plan_reads_the_namespace():
    offending = []
    for path in checked_modules():
        relative = str(path.relative_to(PACKAGE))
        for line, function, text in namespace_reads(path):
            if not _allowed(relative, function, line):
                offending.append(f"rapidtrain/{relative}:{line} ({function}): {text}")
    assert not offending, ("these read the argparse namespace after the plan is built; give the component a plan "
                           "field instead (or, if it truly must, add it to ALLOWED_FUNCTIONS with a reason):\n"
                           + "\n".join(offending))


def test_the_allow_list_names_functions_that_exist_and_read_the_namespace():
    """A stale entry would silently widen the exception: each must still name a function that reads it."""
    for (relative, function), reason in ALLOWED_FUNCTIONS.items():
        assert reason, f"{relative}:{function} has no reason"
        reads = [f for _, f, _ in namespace_reads(PACKAGE / relative)]
        assert any(f == function or f.startswith(function + ".") for f in reads), \
            f"ALLOWED_FUNCTIONS names {relative}:{function}, which no longer reads the namespace: remove the entry"


def test_the_check_catches_each_kind_of_read(tmp_path):
    """The visitor finds the reads it is meant to find (and not a recorded call's `.args` or typing's get_args)."""
    source = tmp_path / "module.py"
    source.write_text(
        "import argparse\n"
        "from rapidtrain import get_args\n"
        "def f(args):\n    return args.lr\n"
        "def g(options: argparse.Namespace):\n    return getattr(options, 'seed')\n"
        "class C:\n    def h(self):\n        return self.args.seed, self.engine.args.lr, get_args()\n"
        "def call_args(call):\n    return call.args[0]\n"
        "def write(args):\n    args.rank = 0\n")
    found = {(function, text) for _, function, text in namespace_reads(source)}
    assert found == {("f", "args.lr"), ("g", "getattr(options, 'seed')"), ("C.h", "self.args.seed"),
                     ("C.h", "self.engine.args.lr"), ("C.h", "get_args()")}
    typed = tmp_path / "typed.py"
    typed.write_text("from typing import get_args\nNAMES = get_args(int)\n")
    assert namespace_reads(typed) == []


def test_plan_helpers_are_called_only_while_the_plan_is_built():
    """The hf_config and partitioning helpers that read the namespace are allowed because only plan building
    calls them: a use anywhere else (a trainer, a runner) would be a read after the plan in disguise."""
    helpers = {name for module, name in ALLOWED_FUNCTIONS if module in PLAN_HELPER_MODULES}
    users = []
    for path in checked_modules():
        relative = str(path.relative_to(PACKAGE))
        if relative in PLAN_HELPER_USERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else \
                [node.attr] if isinstance(node, ast.Attribute) else [node.id] if isinstance(node, ast.Name) else []
            users += [f"rapidtrain/{relative}:{node.lineno}: {name}" for name in names if name in helpers]
    assert not users, "plan-building helpers used after the plan (hand the component a plan field):\n" + \
        "\n".join(users)
