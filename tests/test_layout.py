"""The package's layout is its architecture: layers from the bottom up, each module importing only
from its own layer or the ones below, and no import cycles (lazy imports inside functions count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pyllama_dspark

PKG = Path(pyllama_dspark.__file__).resolve().parent
# README "Architecture": the layers, bottom up (same rank: side by side, never importing each other)
RANK = {"errors": 0, "gguf": 1, "paths": 2, "prompts": 2, "llama": 2, "interop": 2, "speculative": 3, "decode": 4,
        "integrations": 5, "serve": 5, "tools": 5, "training": 5, "cli": 6, "__init__": 7}
MAX_LINES = 500


def _modules():
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), f


def _imports(path: Path, mod: str):
    """pyllama_dspark modules imported anywhere in the file (relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[: len(base) - node.level + 1]
                target = ".".join(up + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("pyllama_dspark"):
                continue
            for a in node.names:   # `from pkg import module` names a module
                yield f"{target}.{a.name}" if (PKG.parent / f"{target}.{a.name}".replace(".", "/")).exists() \
                    or (PKG.parent / (f"{target}.{a.name}".replace(".", "/") + ".py")).exists() else target
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("pyllama_dspark"):
                    yield a.name


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_belongs_to_a_layer():
    assert {_layer(m) for m, _ in _modules()} <= set(RANK)


def test_no_module_imports_from_a_higher_layer():
    bad = []
    for mod, path in _modules():
        for other in set(_imports(path, mod)):
            if _layer(other) != _layer(mod) and RANK[_layer(other)] >= RANK[_layer(mod)]:
                bad.append(f"{mod} ({_layer(mod)}) imports {other} ({_layer(other)})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    mods = dict(_modules())
    graph = {m: {o for o in _imports(p, m) if o in mods and o != m and not m.startswith(o + ".")}
             for m, p in mods.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for o in graph[m]:
            if state.get(o) == 1:
                cycles.append(stack[stack.index(o):] + [o])
            elif o not in state:
                visit(o)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_is_huge():
    big = [(m, n) for m, p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, big


def test_only_the_loop_calls_the_accept_rules():
    """One loop (README "Architecture"): the accept rules are called from decode.loop alone."""
    callers = set()
    for mod, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in ("greedy_accept", "speculative_accept") and mod != "pyllama_dspark.speculative.verify":
                    callers.add(mod)
    assert callers == {"pyllama_dspark.decode.loop"}, callers
