"""The design's dependency rule, read from the source (imports inside functions included).

* ``storage`` and ``schedulers`` never import ``astraflow``;
* the components ``rollout``, ``dataflow`` and ``training`` never import each other, the
  ``runtime`` that places them, the composed run config (``astraflow.config``), the run's own
  sections (``astraflow.sections``) or the CLI: besides their own config section they share the
  contracts, the transport and modules that import no component (``storage``, ``workloads``,
  ``agents``, ``models``, ``batches`` ...);
* ``workloads`` is a leaf: it imports no component and no runtime; ``agents`` (the environment
  contract) is a leaf below it;
* ``sandbox`` (running model-written code) is a leaf: no component, runtime, run config,
  workload, agent or CLI;
* ``transport`` (with its ``lane`` and ``pending``) and ``contracts`` import no component and no
  runtime;
* no cycle between packages (``astraflow.<package>``, each top-level module of ``astraflow``,
  ``storage``, ``schedulers``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("rollout", "dataflow", "training")
# module prefixes each unit must never import
FORBIDDEN = {
    **{f"astraflow.{c}": [f"astraflow.{o}" for o in COMPONENTS if o != c]
       + ["astraflow.runtime", "astraflow.config", "astraflow.sections", "astraflow.cli"] for c in COMPONENTS},
    "astraflow.workloads": [f"astraflow.{c}" for c in COMPONENTS] + ["astraflow.runtime", "astraflow.config"],
    "astraflow.agents": [f"astraflow.{c}" for c in COMPONENTS] + ["astraflow.runtime", "astraflow.config",
                                                                   "astraflow.workloads"],
    "astraflow.sandbox": [f"astraflow.{c}" for c in COMPONENTS] + ["astraflow.runtime", "astraflow.config",
                                                                    "astraflow.workloads", "astraflow.agents",
                                                                    "astraflow.cli"],
    "astraflow.transport": [f"astraflow.{c}" for c in COMPONENTS] + ["astraflow.runtime"],
    "astraflow.lane": [f"astraflow.{c}" for c in COMPONENTS] + ["astraflow.runtime"],
    "astraflow.pending": [f"astraflow.{c}" for c in COMPONENTS] + ["astraflow.runtime"],
    "astraflow.contracts": [f"astraflow.{c}" for c in COMPONENTS] + ["astraflow.runtime"],
    "astraflow.batches": [f"astraflow.{c}" for c in COMPONENTS] + ["astraflow.runtime"],
    "storage": ["astraflow"],
    "schedulers": ["astraflow"],
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its AST, relative imports resolved."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # ``from pkg import module``
    return out


def unit_of(module: str) -> str | None:
    """The unit of the rule a module belongs to, or None for a module outside the project."""
    parts = module.split(".")
    if parts[0] in ("storage", "schedulers"):
        return parts[0]
    if parts[0] != "astraflow" or len(parts) < 2:
        return None
    return f"astraflow.{parts[1]}"


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def check(root: Path) -> tuple[list[str], list[list[str]]]:
    """(violations of FORBIDDEN, cycles between units) of the tree under ``root``."""
    violations: list[str] = []
    graph: dict[str, set[str]] = {}
    files = [f for top in ("astraflow", "storage", "schedulers") for f in sorted((root / top).rglob("*.py"))]
    known = {module_name(f, root) for f in files}
    for f in files:
        unit = unit_of(module_name(f, root))
        for mod in imported_modules(f, root):
            target = unit_of(mod)
            if target is None or target == unit:
                continue
            for bad in FORBIDDEN.get(unit, []):
                if _within(mod, bad):
                    violations.append(f"{f.relative_to(root)}: imports {mod}")
            if mod in known or any(k.startswith(mod + ".") for k in known):
                graph.setdefault(unit, set()).add(target)
    return sorted(set(violations)), _cycles(graph)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One representative path per cycle found by depth-first search."""
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [node, nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_the_source_tree_keeps_the_dependency_rule():
    violations, cycles = check(ROOT)
    assert not violations, "dependency rule broken:\n" + "\n".join(violations)
    assert not cycles, "package cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


CLEAN = {
    "astraflow/__init__.py": "",
    "astraflow/contracts.py": "import numpy\n",
    "astraflow/rollout/__init__.py": "",
    "astraflow/rollout/node.py": "from astraflow.contracts import X\nfrom astraflow.workloads.base import W\n",
    "astraflow/dataflow/__init__.py": "",
    "astraflow/dataflow/layer.py": "from . import rules\n",
    "astraflow/dataflow/rules.py": "",
    "astraflow/training/__init__.py": "",
    "astraflow/workloads/__init__.py": "",
    "astraflow/workloads/base.py": "",
    "astraflow/runtime/__init__.py": "",
    "astraflow/runtime/orchestrator.py": "from astraflow.rollout import node\nfrom astraflow.dataflow.layer import L\n",
    "storage/__init__.py": "",
    "schedulers/__init__.py": "",
}


def test_a_clean_tree_passes(tmp_path):
    assert check(_tree(tmp_path, CLEAN)) == ([], [])


@pytest.mark.parametrize("rel, text, needle", [
    # a lazy import inside a function counts
    ("astraflow/rollout/node.py", "def f():\n    from astraflow.dataflow.layer import L\n",
     "astraflow/rollout/node.py: imports astraflow.dataflow.layer"),
    ("astraflow/dataflow/layer.py", "from ..training import trainer\n", "imports astraflow.training"),
    ("astraflow/workloads/base.py", "import astraflow.rollout.engine\n", "imports astraflow.rollout.engine"),
    ("storage/__init__.py", "def f():\n    import astraflow.contracts\n", "storage/__init__.py: imports astraflow"),
    ("schedulers/__init__.py", "from astraflow import config\n", "imports astraflow"),
    ("astraflow/training/__init__.py", "from astraflow.runtime import orchestrator\n", "imports astraflow.runtime"),
    ("astraflow/training/__init__.py", "from astraflow.sections import RunConfig\n", "imports astraflow.sections"),
])
def test_each_broken_rule_is_reported(tmp_path, rel, text, needle):
    violations, _ = check(_tree(tmp_path, {**CLEAN, rel: text}))
    assert any(needle in v for v in violations), violations


def test_a_package_cycle_is_reported(tmp_path):
    # runtime -> rollout (allowed) and rollout.node -> astraflow.models -> runtime: a cycle
    tree = _tree(tmp_path, {**CLEAN, "astraflow/models.py": "import astraflow.runtime.orchestrator\n",
                            "astraflow/rollout/node.py": "import astraflow.models\n"})
    _, cycles = check(tree)
    assert cycles and {"astraflow.runtime", "astraflow.rollout", "astraflow.models"} <= set(cycles[0])
