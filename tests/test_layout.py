"""The package's layering, read from the source: imports only go down, no cycles.

Stages (sft, rl, eval, curate, bench, demo, aot) may import the shared core and the layers
below it; models/, data/, rewards/ and the shared core import no stage package.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "klear_jax"
STAGES = {"sft", "rl", "eval", "curate", "bench", "demo", "aot"}


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """{module: klear_jax modules it imports at module level or in functions}."""
    out = {}
    for path in ROOT.rglob("*.py"):
        mod, deps = _module(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("klear_jax"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("klear_jax"))
        out[mod] = deps
    known = set(out)
    return {m: {d for d in deps if d in known and d != m} for m, deps in out.items()}


def _top(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_lower_layers_import_no_stage():
    bad = [(m, d) for m, deps in _imports().items() if _top(m) not in STAGES
           for d in deps if _top(d) in STAGES]
    assert not bad, f"shared core / models / data / rewards import a stage: {bad}"


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in graph[m]:
            if d.startswith(m + "."):
                continue  # a package's __init__ re-exporting its own modules
            if state.get(d) == 1:
                pytest.fail(f"import cycle: {' -> '.join(path + [m, d])}")
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
