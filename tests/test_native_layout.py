"""The native shim's layout (native/), as test_layout.py checks the package's: one concern a file,
each file in a layer, and uses that go down the layers only, so the files never call each other in
a circle (dspark_shim.cpp and dspark_sampler.cpp once did).

A use is seen twice.  In the sources: a file that includes an internal header uses the .cpp that
defines what the header declares.  In the objects, where a C++ compiler is at hand: each .cpp is
compiled alone (-O0) and every symbol an object leaves undefined is resolved to the object that
defines it, so a forward declaration that bypasses the headers cannot hide a use.  Both graphs must
point down RANK and have no cycle; the checks are run once on a planted circle to show they fail.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parent.parent / "native"
# The layers, bottom up (same rank: side by side, never using each other).  Header comments name
# each file's concern; CMakeLists.txt lists the same order.
RANK = {"dspark_status.cpp": 0, "dspark_simd.cpp": 0,
        "dspark_scan.cpp": 1, "dspark_result.cpp": 1,
        "dspark_chain.cpp": 2, "dspark_markov.cpp": 2, "dspark_shim.cpp": 2}
# Internal headers whose definitions live in a .cpp of another name (dspark_X.h is dspark_X.cpp's);
# None: the public C ABI, whose entry points no native file may call (the object check sees that).
OWNER = {"dspark_internal.h": "dspark_status.cpp", "dspark_shim.h": None}
MAX_LINES = 500
# Known debts, each at most its current size (split it, then drop it from here).
OVERSIZE = {"dspark_markov.cpp": 678}


def _includes(path: Path) -> list[str]:
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M)


def _owner(native: Path, header: str) -> str | None:
    if header in OWNER:
        return OWNER[header]
    cpp = Path(header).with_suffix(".cpp").name
    assert (native / cpp).exists(), f"{header}: no {cpp} defines it (add it to OWNER)"
    return cpp


def include_graph(native: Path) -> dict[str, set[str]]:
    """.cpp -> the .cpp files whose headers it includes, directly or through other headers."""
    graph = {}
    for cpp in sorted(native.glob("*.cpp")):
        seen, todo = set(), list(_includes(cpp))
        while todo:
            h = todo.pop()
            if h in seen or not (native / h).exists():   # llama.h, ggml.h: not ours
                continue
            seen.add(h)
            todo += _includes(native / h)
        graph[cpp.name] = {o for h in seen if (o := _owner(native, h)) and o != cpp.name}
    return graph


def _llama_include() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if not spec or not spec.submodule_search_locations:
        return None
    inc = Path(list(spec.submodule_search_locations)[0]).parent / "include"
    return inc if (inc / "llama.h").exists() else None


def _cxx() -> list[str] | None:
    """The C++ compiler ($CXX, else c++ / g++), None when there is none or no nm to read its objects."""
    if not shutil.which("nm"):
        return None
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    cxx = shutil.which("c++") or shutil.which("g++")
    return [cxx] if cxx else None


def _nm(obj: Path, *flags: str, kinds: str | None = None) -> set[str]:
    """The symbols nm lists for obj (those of a type in kinds, when given)."""
    out = subprocess.run(["nm", *flags, str(obj)], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return {r[-1] for r in rows if kinds is None or (len(r) == 3 and r[1] in kinds)}


def symbol_graph(native: Path, build: Path, include: Path | None) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(.cpp -> the .cpp files defining the symbols its object leaves undefined, .cpp -> its strong
    global symbols), from each .cpp compiled alone."""
    cxx = _cxx()
    srcs = sorted(native.glob("*.cpp"))

    def compile_one(src: Path) -> Path:
        obj = build / (src.name + ".o")
        cmd = [*cxx, "-std=gnu++17", "-O0", "-g0", "-fPIC", "-fvisibility=hidden", "-w", f"-I{native}",
               "-c", str(src), "-o", str(obj)] + ([f"-I{include}"] if include else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{src.name} does not compile alone:\n{r.stderr[-4000:]}"
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        objs = dict(zip((s.name for s in srcs), pool.map(compile_one, srcs)))
    # strong definitions only (T, D, B, R): weak / unique ones (inline functions, templates) are
    # emitted by every object that uses them and mean no use of another file
    defined = {n: _nm(o, "-g", "--defined-only", kinds="TDBR") for n, o in objs.items()}
    where = {sym: n for n, syms in defined.items() for sym in syms}
    graph = {n: {where[s] for s in _nm(o, "--undefined-only") if s in where and where[s] != n} for n, o in objs.items()}
    return graph, defined


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, stack, found = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for o in sorted(graph.get(m, ())):
            if state.get(o) == 1:
                found.append(stack[stack.index(o):] + [o])
            elif o not in state:
                visit(o)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (rank {RANK[a]}) uses {b} (rank {RANK[b]})"
                  for a, bs in graph.items() for b in bs if RANK[b] >= RANK[a])


def test_every_native_file_is_in_a_layer():
    assert {p.name for p in NATIVE.glob("*.cpp")} == set(RANK)


def test_every_native_file_opens_with_its_concern():
    bare = [p.name for p in sorted(NATIVE.glob("*.[ch]*")) if not p.read_text().startswith("// ")]
    assert not bare, f"no header comment naming the file's concern: {bare}"


def test_no_native_file_is_huge():
    big = {p.name: n for p in sorted(NATIVE.glob("*.[ch]*"))
           if (n := len(p.read_text().splitlines())) > OVERSIZE.get(p.name, MAX_LINES)}
    assert not big, big


def test_includes_go_down_the_layers_without_a_cycle():
    graph = include_graph(NATIVE)
    assert not cycles(graph), cycles(graph)
    assert not upward(graph), "\n".join(upward(graph))


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    if not _cxx():
        pytest.skip("no C++ compiler / nm")
    include = _llama_include()
    if include is None:
        pytest.skip("llama-cpp-python's headers (site-packages/include/llama.h) not found")
    return symbol_graph(NATIVE, tmp_path_factory.mktemp("native_objs"), include)


def test_symbol_uses_go_down_the_layers_without_a_cycle(objects):
    graph, _ = objects
    assert not cycles(graph), cycles(graph)
    assert not upward(graph), "\n".join(upward(graph))
    # every use the objects show is declared through a header the user includes
    inc = include_graph(NATIVE)
    hidden = sorted(f"{a} uses {b} without including its header" for a, bs in graph.items() for b in bs - inc[a])
    assert not hidden, "\n".join(hidden)


def test_every_abi_function_is_defined_once(objects):
    _, defined = objects
    api = re.findall(r"^DSPARK_API\b[^(]*?\b(dspark_\w+)\s*\(", (NATIVE / "dspark_shim.h").read_text(), re.M)
    where = {f: [n for n, syms in defined.items() if f in syms] for f in api}
    assert len(api) > 30 and all(len(w) == 1 for w in where.values()), {f: w for f, w in where.items() if len(w) != 1}


def test_the_checks_see_a_planted_circle(tmp_path):
    """Two files that call each other, one of them through a forward declaration: the include check
    sees the header's use, the object check (where it runs) the hidden one, and both the circle."""
    (tmp_path / "a.h").write_text("// a\nint a();\n")
    (tmp_path / "a.cpp").write_text('// a\n#include "a.h"\nint b();\nint a() { return b(); }\n')
    (tmp_path / "b.cpp").write_text('// b\n#include "a.h"\nint b() { return a(); }\n')
    assert include_graph(tmp_path) == {"a.cpp": set(), "b.cpp": {"a.cpp"}}
    if not _cxx():
        return
    build = tmp_path / "objs"
    build.mkdir()
    graph, _ = symbol_graph(tmp_path, build, None)
    assert graph == {"a.cpp": {"b.cpp"}, "b.cpp": {"a.cpp"}}
    assert cycles(graph) == [["a.cpp", "b.cpp", "a.cpp"]]
