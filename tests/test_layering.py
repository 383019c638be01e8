"""The layering of paratrain, stated once and enforced by parsing every import under src/ (ast; function-level
imports included, `if TYPE_CHECKING:` blocks excluded). docs/architecture.md draws it.

The rule: config, plan, hardware, cost and sim never import torch, directly or through any paratrain module
(paratrain.device, the one module naming devices, imports torch only inside the functions that need one);
launch does not import torch either; model imports nothing of paratrain but config, device and model; parallel
never imports train; train reaches the planner and the calibrator only through train/predict.py; and no two
paratrain modules import each other at module level (no cycles). Inside the planner, its physics modules
import one way, from the whole step down to the bytes per element (PLAN_ORDER).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
TORCH_FREE = ("paratrain.config", "paratrain.plan", "paratrain.hardware", "paratrain.cost", "paratrain.sim",
              "paratrain.launch", "paratrain.stragglers")
# The one module that names devices and backends imports torch inside the functions that need a device only;
# the torch-free parts call its string helpers (check_device_name, backend names), so only its module-level
# imports count.
LAZY_TORCH = {"paratrain.device"}
# Known violations in files owned by other work, each with its reason (reported to the lead; remove when fixed):
# (module of a torch-free part, the module through which it reaches torch).
ALLOWED: set[tuple[str, str]] = set()

# The planner's physics, lowest first (docs/architecture.md): each module imports only the plan modules before it,
# function-level imports included, so plan/step.py assembles the step from terms that never reach back up to it.
# The one exception, inside a function: Options.for_system reads a stack's defaults (plan/stacks.py).
PLAN_ORDER = ("numeric", "precision", "options", "collectives", "kernels", "layer", "stacks", "software", "stages", "pipeline", "memory",
              "data_parallel", "moe", "step")
PLAN_LAZY_UP = {("paratrain.plan.options", "paratrain.plan.stacks")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.AST, top_level_only: bool) -> set[str]:
    found: set[str] = set()

    def visit(node, depth):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            inner = depth + isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if top_level_only and inner:
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.add(child.module)
                found.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child, inner)

    visit(tree, 0)
    return found


@cache
def imports_of(module: str, top_level_only: bool = False) -> frozenset[str]:
    """paratrain modules (and their packages, whose __init__ runs first) and third-party top-level names."""
    tree = ast.parse(MODULES[module].read_text())
    out = set()
    for name in _imports(tree, top_level_only):
        if not name.startswith("paratrain"):
            out.add(name.split(".")[0])
            continue
        while name not in MODULES and "." in name:  # `from paratrain.x import y`: y is a name, not a module
            name = name.rsplit(".", 1)[0]
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))  # the packages above run too
    out.discard(module)
    return frozenset(out)


def reach(module: str) -> dict[str, str]:
    """Every paratrain module `module` imports, transitively: {module: the module that imports it}."""
    seen, todo = {module: ""}, [module]
    while todo:
        cur = todo.pop()
        for dep in imports_of(cur):
            if dep in MODULES and dep not in seen:
                seen[dep] = cur
                todo.append(dep)
    return seen


def _chain(seen: dict[str, str], end: str) -> str:
    path = [end]
    while seen[path[-1]]:
        path.append(seen[path[-1]])
    return " <- ".join(path)


def _in(module: str, parts) -> bool:
    return any(module == p or module.startswith(p + ".") for p in parts)


def test_torch_free_parts_never_import_torch():
    bad = []
    for module in sorted(m for m in MODULES if _in(m, TORCH_FREE)):
        seen = reach(module)
        for dep in seen:
            chain = _chain(seen, dep).split(" <- ")
            if any((module, step) in ALLOWED for step in chain):
                continue
            if "torch" in imports_of(dep, top_level_only=dep in LAZY_TORCH):
                bad.append(f"{module} imports torch through {_chain(seen, dep)}")
                break
    assert not bad, "\n".join(bad)


def test_model_imports_only_config_device_and_model():
    allowed = ("paratrain", "paratrain.model", "paratrain.config", "paratrain.device")
    bad = [f"{m} imports {d}" for m in MODULES if _in(m, ["paratrain.model"])
           for d in imports_of(m) if d.startswith("paratrain") and not _in(d, allowed[1:]) and d != "paratrain"]
    assert not bad, "\n".join(sorted(bad))


def test_parallel_never_imports_train():
    bad = [f"{m} imports {d}" for m in MODULES if _in(m, ["paratrain.parallel"])
           for d in imports_of(m) if _in(d, ["paratrain.train"])]
    assert not bad, "\n".join(sorted(bad))


def test_train_reaches_plan_and_calibrate_through_one_adapter():
    adapter = "paratrain.train.predict"
    bad = [f"{m} imports {d}" for m in MODULES if _in(m, ["paratrain.train"]) and m != adapter
           for d in imports_of(m) if _in(d, ["paratrain.plan", "paratrain.calibrate"])]
    assert not bad, "\n".join(sorted(bad))


def test_no_module_level_import_cycles():
    graph = {m: {d for d in imports_of(m, top_level_only=True) if d in MODULES} for m in MODULES}
    state: dict[str, int] = {}
    cycles = []

    def dfs(node, stack):
        state[node] = 1
        for dep in sorted(graph[node]):
            if dep in stack and not _in(node, [dep]):  # a package's __init__ importing its own modules is fine
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif state.get(dep) is None:
                dfs(dep, stack + [dep])
        state[node] = 2

    for m in sorted(MODULES):
        if state.get(m) is None:
            dfs(m, [m])
    assert not cycles, "\n".join(cycles)


def test_plan_physics_imports_point_down():
    order = [f"paratrain.plan.{m}" for m in PLAN_ORDER]
    assert set(order) <= set(MODULES), sorted(set(order) - set(MODULES))
    bad = []
    for i, module in enumerate(order):
        for dep in sorted(imports_of(module)):
            if not dep.startswith("paratrain.plan.") or dep in order[:i]:
                continue
            if (module, dep) in PLAN_LAZY_UP and dep not in imports_of(module, top_level_only=True):
                continue
            bad.append(f"{module} imports {dep}" + (" (it comes after it in PLAN_ORDER)" if dep in order else
                                                    " (not one of the planner's physics modules)"))
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_violation():
    """The parser is not vacuous: it finds torch behind the runtime and the planner behind the adapter."""
    assert "torch" in imports_of("paratrain.parallel.data")
    assert "paratrain.plan.api" in imports_of("paratrain.train.predict")
    assert "paratrain.config.layout" in reach("paratrain.config.schema")
    assert "paratrain.plan.moe" in imports_of("paratrain.plan.step", top_level_only=True)
    assert "paratrain.plan.stacks" in imports_of("paratrain.plan.options")
