"""The package's layout is its architecture: layers from the bottom up, each module importing only
from its own layer or the ones below, and no import cycles (lazy imports inside functions count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pyllama_dspark

PKG = Path(pyllama_dspark.__file__).resolve().parent
# README "Architecture": the layers, bottom up (same rank: side by side, never importing each other)
RANK = {"errors": 0, "gguf": 1, "paths": 2, "prompts": 2, "llama": 2, "interop": 2, "reference": 2,
        "speculative": 3, "chat": 3, "drafts": 3, "upstream": 3, "decode": 4,
        "integrations": 5, "serve": 5, "measure": 5, "training": 5, "cli": 6, "__init__": 7}
#: the drafting loop: what the chat formats never import (docs/architecture.md)
DRAFTING = ("speculative", "decode")
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


def test_the_chat_room_knows_nothing_of_the_drafting_loop():
    """Chat formats (templates, tool-call codecs, reply parsers) use the grammar (llama/) but nothing of
    the drafter, verify, schedule or policy; and the algorithm imports no chat format."""
    bad = []
    for mod, path in _modules():
        for other in set(_imports(path, mod)):
            if _layer(mod) == "chat" and _layer(other) in DRAFTING:
                bad.append(f"{mod} imports {other}")
            if _layer(mod) in DRAFTING and _layer(other) == "chat" and other != "pyllama_dspark.chat.prompt":
                bad.append(f"{mod} imports {other}")
    assert not bad, "\n".join(sorted(bad))


def test_importing_the_algorithm_loads_no_chat_format():
    """Every module of speculative/ imported in a fresh interpreter: no chat module comes with it."""
    import subprocess
    import sys

    mods = [m for m, _ in _modules() if _layer(m) == "speculative"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('pyllama_dspark.chat', 'pyllama_dspark.serve'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_draft_spec_is_read_in_one_module():
    """The -md names (random[:TYPE], oracle:P[:TYPE]) are compared against in drafts/spec.py only:
    every other module is handed a parsed DraftSpec.  (A proposer called "oracle" or a click default
    "random" is a name, not a reading: only comparisons and prefix tests count.)"""
    names = ("random", "random-dspark", "random-dflash", "oracle")

    def named(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and (
            node.value in names or node.value.startswith(tuple(n + ":" for n in names)))

    found = []
    for mod, path in _modules():
        if mod == "pyllama_dspark.drafts.spec":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(named(x) for x in [node.left, *node.comparators]):
                found.append(f"{mod}:{node.lineno}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("startswith", "endswith", "partition", "split")
                  and any(named(a) for a in node.args)):
                found.append(f"{mod}:{node.lineno}")
    assert not found, "\n".join(found)
