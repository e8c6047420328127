"""The layering docs/design.md promises, read off the source with ``ast``: the project's own
modules import each other without a cycle, and the libraries below the harness (model/,
evaluation/, data/) import neither the harness (pelab/) nor the training framework.

Every import counts: at module level and inside functions (a deferred import still ties the
two modules together). Scripts import their siblings as top-level modules (``from _common
import ...``, ``from benchkit.report import ...``), so scripts/ is also a root of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "data", "evaluation", "pelab", "scripts")
HARNESS = ("pelab", "lightning", "pytorch_lightning", "hydra", "omegaconf")
#: what each library below the harness may not import (top-level names): results reach W&B
#: through the harness (pelab.loggers.log_to_wandb)
FORBIDDEN = {"model": (*HARNESS, "wandb"), "evaluation": (*HARNESS, "wandb"), "data": (*HARNESS, "wandb")}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """{dotted name: file}; a scripts/ file also under the name scripts import it by."""
    modules = {"train": ROOT / "train.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[module_name(path, ROOT)] = path
            if package == "scripts" and path != ROOT / "scripts" / "__init__.py":
                modules.setdefault(module_name(path, ROOT / "scripts"), path)
    return modules


def imported_names(path: Path, name: str) -> list[tuple[str, int]]:
    """(absolute dotted name, line) of every import in the file, with ``from a import b`` as
    ``a.b`` (a module or a name in ``a``); relative imports resolved against ``name``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
            out.append((base, node.lineno))
    return out


def resolve(dotted: str, modules: dict[str, Path]) -> str | None:
    """The project module ``dotted`` names: itself, else the longest module prefix of it."""
    while dotted:
        if dotted in modules:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


def import_graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[str, int]]]]:
    """({module: the project modules it imports}, {module: every import as (dotted name, line)}),
    each file once, under its name from the repository root."""
    modules = project_modules()
    canonical = {path: module_name(path, ROOT) for path in modules.values()}
    graph: dict[str, set[str]] = {}
    raw: dict[str, list[tuple[str, int]]] = {}
    for path, name in canonical.items():
        raw[name] = imported_names(path, name)
        targets = {resolve(dotted, modules) for dotted, _ in raw[name]}
        graph[name] = {canonical[modules[t]] for t in targets if t is not None} - {name}
    return graph, raw


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_find_cycle_reports_the_cycle_and_none_without_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    source = tmp_path / "pkg" / "mod.py"
    source.parent.mkdir()
    source.write_text("import os\n\ndef f():\n    from .other import thing\n    import pkg.third\n")
    names = [n for n, _ in imported_names(source, "pkg.mod")]
    assert {"os", "pkg.other.thing", "pkg.other", "pkg.third"} <= set(names)
    modules = {"pkg.other": source, "pkg.third": source}
    assert resolve("pkg.other.thing", modules) == "pkg.other"


def test_no_import_cycle_among_project_modules():
    graph, _ = import_graph()
    assert len(graph) > 50, sorted(graph)  # the walk found the project
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert {"evaluation.sweep", "model.gpt"} <= graph["evaluation.extrapolation"]  # the edges are seen


def test_libraries_below_the_harness_do_not_import_it():
    _, raw = import_graph()
    bad: dict[tuple[str, int], str] = {}  # (module, line): the shortest forbidden name imported there
    for name, imports in sorted(raw.items()):
        forbidden = FORBIDDEN.get(name.split(".")[0], ())
        for dotted, line in imports:
            if dotted.split(".")[0] in forbidden:
                bad[name, line] = min(bad.get((name, line), dotted), dotted, key=len)
    assert not bad, "\n".join(f"{name}:{line} imports {dotted}" for (name, line), dotted in sorted(bad.items()))
    assert "pelab.probes" in raw and any(d.startswith("lightning") for d, _ in raw["pelab.probes"])
