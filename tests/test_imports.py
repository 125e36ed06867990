"""The import graph of molt/ (DESIGN section 11): no cycle and no arrow across the walls, counting every
import, at the top of a file or inside a function (`if TYPE_CHECKING:` blocks excluded: they never run).

A module's room is its folder under molt/ (molt/trainer/actor.py: "trainer"), or its own name for
the files at the top (molt/train.py: "train")."""

import ast
from pathlib import Path

import pytest

MOLT = Path(__file__).resolve().parent.parent / "molt"

# The ways in: they assemble the rooms into a job, so they may import any room, and no room imports them.
WAYS_IN = {"train", "sft", "eval", "dry_run"}
# Leaves at the top that every room may use: they import nothing of Molt. `choices` holds the word sets
# that config and objectives both name (lower floors that may not import each other).
LEAVES = {"metrics", "console", "choices"}
# Which other rooms each room may import (besides the leaves). Lower floors first.
WALLS = {
    "objectives": set(),
    "trace": set(),
    "config": set(),
    "models": set(),
    "agents": {"trace"},
    "transport": {"trace", "agents"},
    "endpoint": {"trace", "agents"},
    "distributed": {"config", "models"},
    "refit": {"config", "models", "distributed"},
    "controller": {"config", "trace", "transport", "agents", "refit"},
    "rollout": {"config", "trace", "transport", "agents", "endpoint", "refit", "distributed", "models"},
    "trainer": {"config", "trace", "transport", "objectives", "refit", "distributed", "models"},
}


def module_name(path: Path) -> str:
    return ".".join(("molt", *path.relative_to(MOLT).with_suffix("").parts)).removesuffix(".__init__")


def room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "molt"


def is_package(module: str) -> bool:
    return (MOLT.parent / module.replace(".", "/") / "__init__.py").exists()


class Imports(ast.NodeVisitor):
    """Every `molt` module a file imports: (module, line, deferred)."""

    def __init__(self, module: str, package: bool):
        self.module, self.package = module, package
        self.found: list[tuple[str, int, bool]] = []
        self.depth = 0

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _nested(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _nested

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            parts = self.module.split(".")[: len(self.module.split(".")) - node.level + self.package]
            base = ".".join(parts + ([node.module] if node.module else []))
        self._add(base, node.lineno)
        for alias in node.names:  # `from molt.x import y` where y is a module
            if is_package(base) or (MOLT.parent / f"{base}.{alias.name}".replace(".", "/")).with_suffix(".py").exists():
                self._add(f"{base}.{alias.name}", node.lineno)

    def _add(self, name: str, line: int) -> None:
        if name == "molt" or not name.startswith("molt."):
            return
        if not (is_package(name) or (MOLT.parent / name.replace(".", "/")).with_suffix(".py").exists()):
            return  # a name inside a module, not a module
        self.found.append((name, line, self.depth > 0))


def import_graph() -> dict[str, list[tuple[str, int, bool]]]:
    graph = {}
    for path in sorted(MOLT.rglob("*.py")):
        module = module_name(path)
        visitor = Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        edges = []
        for target, line, deferred in visitor.found:
            edges.append((target, line, deferred))
            # Importing molt.a.b runs molt/a/__init__.py first (unless this module is inside molt.a).
            parent = target.rsplit(".", 1)[0]
            while parent != "molt" and not module.startswith(parent + ".") and module != parent:
                edges.append((parent, line, deferred))
                parent = parent.rsplit(".", 1)[0]
        graph[module] = [edge for edge in edges if edge[0] != module]
    return graph


GRAPH = import_graph()


def find_cycle(graph) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target, _, _ in graph.get(node, []):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walker_sees_every_kind_of_import():
    """A deferred import, a `from package import module` and an import under TYPE_CHECKING (skipped)."""
    source = ("from typing import TYPE_CHECKING\nfrom molt.trace import images\n"
              "if TYPE_CHECKING:\n    from molt.trainer.loop import Trainer\n"
              "def f():\n    from molt.config import ConfigError\n")
    visitor = Imports("molt.rollout.example", False)
    visitor.visit(ast.parse(source))
    assert ("molt.trace.images", 2, False) in visitor.found
    assert ("molt.config", 6, True) in visitor.found
    assert not any(name.startswith("molt.trainer") for name, _, _ in visitor.found)
    assert find_cycle({"a": [("b", 1, True)], "b": [("a", 2, False)]}) == ["a", "b", "a"]


def test_every_room_has_its_walls():
    rooms = {room(module) for module in GRAPH} - {"molt"}
    assert rooms == set(WALLS) | WAYS_IN | LEAVES


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_across_the_walls():
    wrong = []
    for module, edges in GRAPH.items():
        here = room(module)
        for target, line, _ in edges:
            there = room(target)
            if there == here or (there in LEAVES and here not in LEAVES) or here in WAYS_IN:
                continue
            allowed = set() if here in LEAVES else WALLS[here]
            if there not in allowed:
                wrong.append(f"{module}:{line} imports {target}: {here} may import only {sorted(allowed | LEAVES)}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaves_import_nothing_of_molt(leaf):
    assert GRAPH[f"molt.{leaf}"] == []


def test_deferred_imports_of_molt_only_in_the_ways_in():
    """A deferred import is for a heavy third-party module, never to hide a dependency between our own
    modules. The ways in are the exception: torchrun's ranks and the spawned processes they start
    (agent workers, vLLM's engine core) re-import the main module (as __mp_main__), so train, eval
    and sft import their torch- and vLLM-heavy rooms inside the functions that run a job, and the dry
    run and --help stay light."""
    deferred = [f"{module}:{line} imports {target}" for module, edges in GRAPH.items() if room(module) not in WAYS_IN
                for target, line, is_deferred in edges if is_deferred]
    assert not deferred, "\n".join(deferred)
