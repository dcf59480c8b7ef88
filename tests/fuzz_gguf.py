"""GGUF mutation fuzzing: the byte layout of a GGUF file (every field's offset), mutations of it
(headers, metadata types / lengths / counts / values, tensor infos, truncation at every section
boundary), hypothesis strategies drawing them, and :func:`run_cases`, which runs a batch of cases
in ONE subprocess (:mod:`fuzz_gguf_runner`), each case in a forked child so that a llama.cpp abort
kills only that child.

A case is JSON: ``{"id", "kind": "target" | "draft", "base": the file mutated, "target", "draft"
(the good partner), "mode": "speculator" | "nodraft" | "inspect" | "run", "ops": [op, ...]}``
(``speculator``: ``Speculator(target, draft)`` and 6 tokens, past the first into draft blocks;
``nodraft``: the target alone; ``inspect`` / ``run -n 6``: the CLI in the child); an op is
``["u8" | "u32" | "u64" | "f32", offset, value]``, ``["bytes", offset, hex]``, ``["truncate", n]``
or ``["insert", offset, hex]``.  Outcomes (:func:`is_failure`): ``ok`` (loaded and decoded one
token), ``error`` (a :class:`~pyllama_dspark.errors.DSparkError`, or a CLI exit 1 / 2 with one
``Error:`` line), anything else -- another exception type, a traceback, a signal, a timeout -- is a
failure.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "fuzz_gguf_runner.py")

# GGUF value types: fixed sizes (8 STRING and 9 ARRAY are variable)
VT_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
VT_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
U32_EVIL = [0, 1, 2, 3, 5, 8, 9, 12, 13, 31, 39, 40, 41, 100, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
U64_EVIL = [0, 1, 2, 255, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 32 + 1, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]
INT_EVIL = [0, 1, -1, 2, 3, 7, 1000, 2 ** 15, 2 ** 31 - 1, -2 ** 31, 2 ** 32 - 1, 2 ** 63 - 1, -2 ** 63]
FLOAT_EVIL = [0.0, -0.0, -1.0, 1e-45, 1e30, -1e30, float("inf"), float("-inf"), float("nan")]


# ---- layout -----------------------------------------------------------------------------------

class Layout:
    """Where everything is in a (well-formed, v3) GGUF file."""

    def __init__(self, data: bytes):
        self.size = len(data)
        self.kvs: List[dict] = []
        self.tensors: List[dict] = []
        p = 0

        def u32():
            nonlocal p
            v = struct.unpack_from("<I", data, p)[0]
            p += 4
            return v

        def u64():
            nonlocal p
            v = struct.unpack_from("<Q", data, p)[0]
            p += 8
            return v

        def string():
            nonlocal p
            at = p
            n = u64()
            s = data[p:p + n]
            p += n
            return at, s

        assert data[:4] == b"GGUF"
        p = 4
        self.version = u32()
        self.n_tensors = u64()
        self.n_kv = u64()
        self.header_end = p
        self.alignment = 32
        for _ in range(self.n_kv):
            kv = {"start": p}
            kv["key_at"], key = string()
            kv["key"] = key.decode("utf-8", "replace")
            kv["type_at"] = p
            vt = kv["vtype"] = u32()
            kv["value_at"] = p
            if vt == 8:
                kv["str_at"], s = string()
                kv["str_len"] = len(s)
            elif vt == 9:
                kv["atype_at"] = p
                at = kv["atype"] = u32()
                kv["count_at"] = p
                n = kv["count"] = u64()
                kv["elem_at"] = p
                if at == 8:
                    kv["elems"] = []
                    for i in range(n):
                        e_at, s = string()
                        if i < 8 or i == n - 1:
                            kv["elems"].append((e_at, len(s)))
                else:
                    p += VT_SIZE[at] * n
            else:
                if kv["key"] == "general.alignment":
                    self.alignment = struct.unpack_from(VT_FMT[vt], data, p)[0]
                p += VT_SIZE[vt]
            kv["end"] = p
            self.kvs.append(kv)
        self.kv_end = p
        for _ in range(self.n_tensors):
            t = {"start": p}
            t["name_at"], name = string()
            t["name"] = name.decode("utf-8", "replace")
            t["n_dims_at"] = p
            nd = t["n_dims"] = u32()
            t["dims_at"] = [p + 8 * i for i in range(nd)]
            t["dims"] = [u64() for _ in range(nd)]
            t["type_at"] = p
            t["ggml_type"] = u32()
            t["offset_at"] = p
            t["offset"] = u64()
            t["end"] = p
            self.tensors.append(t)
        self.tinfo_end = p
        a = self.alignment
        self.data_start = (p + a - 1) // a * a
        from pyllama_dspark.gguf.structure import GGML_TYPE_SIZES

        for t in self.tensors:
            blck, tsize = GGML_TYPE_SIZES[t["ggml_type"]]
            n = 1
            for d in t["dims"]:
                n *= d
            t["nbytes"] = n // blck * tsize
        self.data_end = max((self.data_start + t["offset"] + t["nbytes"] for t in self.tensors), default=p)

    def boundaries(self) -> List[int]:
        """Every section boundary: header end, each kv's start / value / end, each tensor info's
        end, tensor infos end, data start, each tensor's data start, middle and last byte -- every
        cut that loses something llama.cpp needs (not the padding after the last tensor)."""
        b = {4, 8, 16, self.header_end, self.kv_end, self.tinfo_end, self.data_start}
        for kv in self.kvs:
            b.update((kv["key_at"] + 8, kv["type_at"], kv["value_at"], kv["end"]))
        for t in self.tensors:
            b.update((t["n_dims_at"], t["type_at"], t["offset_at"], t["end"]))
            at = self.data_start + t["offset"]
            b.update((at, at + t["nbytes"] // 2, at + t["nbytes"] - 1))
        return sorted(x for x in b if 0 < x < min(self.size, self.data_end))


def layout_of(path: str) -> Layout:
    with open(path, "rb") as f:
        return Layout(f.read())


# ---- applying ops -----------------------------------------------------------------------------

def apply_ops(data: bytes, ops: Sequence[Sequence]) -> bytes:
    buf = bytearray(data)
    for op in ops:
        kind = op[0]
        if kind == "truncate":
            del buf[int(op[1]):]
        elif kind == "insert":
            buf[int(op[1]):int(op[1])] = bytes.fromhex(op[2])
        elif kind == "bytes":
            raw = bytes.fromhex(op[2])
            buf[int(op[1]):int(op[1]) + len(raw)] = raw
        else:
            fmt = {"u8": "<B", "u32": "<I", "u64": "<Q", "i32": "<i", "i64": "<q", "f32": "<f", "f64": "<d"}[kind]
            at = int(op[1])
            if at + struct.calcsize(fmt) <= len(buf):
                struct.pack_into(fmt, buf, at, op[2])
    return bytes(buf)


def _scalar_ops(kv: dict) -> List[list]:
    """Value mutations of one scalar kv, within its own type."""
    vt, at = kv["vtype"], kv["value_at"]
    if vt in (6, 12):
        return [["f32" if vt == 6 else "f64", at, v] for v in FLOAT_EVIL]
    if vt == 7:
        return [["u8", at, v] for v in (0, 1, 2, 255)]
    size = VT_SIZE[vt]
    signed = vt in (1, 3, 5, 11)
    lo, hi = (-(1 << (8 * size - 1)), (1 << (8 * size - 1)) - 1) if signed else (0, (1 << (8 * size)) - 1)
    fmt = {1: "u8", 2: "u8", 4: "u32", 8: "u64"}[size]
    out = []
    for v in INT_EVIL:
        if lo <= v <= hi:
            out.append(["bytes", at, struct.pack(VT_FMT[vt], v).hex()])
    out.append([fmt, at, (1 << (8 * size)) - 1])
    return out


def catalog(lay: Layout) -> Dict[str, List[list]]:
    """Every systematic mutation of one file, by family: ``{family: [ops, ...]}``."""
    c: Dict[str, List[list]] = {"header": [], "kv_type": [], "kv_len": [], "kv_value": [], "tensor": [],
                                "truncate": [], "insert": []}
    for magic in (b"GGUG", b"FUGG", b"\0\0\0\0", b"GGML", b"ggjt"):
        c["header"].append([["bytes", 0, magic.hex()]])
    for v in (0, 1, 2, 4, 0x03000000, 0xFFFFFFFF):
        c["header"].append([["u32", 4, v]])
    for at, n in ((8, lay.n_tensors), (16, lay.n_kv)):
        for v in sorted({0, n - 1, n + 1, n * 2, 2 ** 32 + n} | set(U64_EVIL[4:])):
            if v != n:
                c["header"].append([["u64", at, v]])
    for kv in lay.kvs:
        for v in (0, kv["end"] - kv["key_at"], 2 ** 63, 2 ** 64 - 1):
            c["kv_len"].append([["u64", kv["key_at"], v]])
        for v in list(range(13)) + [13, 0xFFFFFFFF]:
            if v != kv["vtype"]:
                c["kv_type"].append([["u32", kv["type_at"], v]])
        if kv["vtype"] == 8:
            n = kv["str_len"]
            for v in sorted({0, n - 1, n + 1, lay.size, 2 ** 32, 2 ** 63, 2 ** 64 - 1} - {n}):
                c["kv_len"].append([["u64", kv["str_at"], v]])
            if n:
                c["kv_value"].append(["bytes", kv["str_at"] + 8, "ff"])       # invalid UTF-8
                c["kv_value"].append(["bytes", kv["str_at"] + 8, "00"])
        elif kv["vtype"] == 9:
            for v in list(range(13)) + [13, 0xFFFFFFFF]:
                if v != kv["atype"]:
                    c["kv_type"].append([["u32", kv["atype_at"], v]])
            n = kv["count"]
            for v in sorted({0, 1, n - 1, n + 1, 2 * n, 2 ** 32, 2 ** 62, 2 ** 64 - 1} - {n}):
                c["kv_len"].append([["u64", kv["count_at"], v]])
            for e_at, e_len in kv.get("elems", [])[:3]:
                for v in (0, e_len + 1, 2 ** 64 - 1):
                    c["kv_len"].append([["u64", e_at, v]])
                if e_len:
                    c["kv_value"].append(["bytes", e_at + 8, "c3"])
            if kv["atype"] in VT_SIZE and n:
                sub = dict(kv, vtype=kv["atype"], value_at=kv["elem_at"])
                c["kv_value"] += _scalar_ops(sub)
                last = dict(sub, value_at=kv["elem_at"] + VT_SIZE[kv["atype"]] * (n - 1))
                c["kv_value"] += _scalar_ops(last)[:4]
        else:
            c["kv_value"] += _scalar_ops(kv)
    c["kv_value"] = [[op] for op in c["kv_value"]]
    for t in lay.tensors:
        for v in (0, t["end"] - t["name_at"], 2 ** 64 - 1):
            c["tensor"].append([["u64", t["name_at"], v]])
        for v in (0, 1, 3, 4, 5, 0xFFFFFFFF):
            if v != t["n_dims"]:
                c["tensor"].append([["u32", t["n_dims_at"], v]])
        for i, d_at in enumerate(t["dims_at"]):
            d = t["dims"][i]
            for v in sorted({0, 1, d + 1, 2 * d, 3, 2 ** 31, 2 ** 32, 2 ** 62, 2 ** 63, 2 ** 64 - 1} - {d}):
                c["tensor"].append([["u64", d_at, v]])
        for v in list(range(0, 42)) + [100, 0xFFFFFFFF]:
            if v != t["ggml_type"]:
                c["tensor"].append([["u32", t["type_at"], v]])
        o = t["offset"]
        for v in sorted({o + 1, o + 2, o + lay.alignment, o + 31, lay.size - lay.data_start,
                         lay.size, 2 ** 63, 2 ** 64 - 1, 2 ** 64 - lay.data_start} - {o}) + ([0] if o else [32]):
            c["tensor"].append([["u64", t["offset_at"], v]])
    for b in lay.boundaries():
        c["truncate"].append([["truncate", b]])
    # an inserted general.alignment kv (kv count + 1); the data keeps the default alignment
    key = b"general.alignment"
    for v in (0, 1, 3, 48, 2 ** 31):
        raw = struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, v)
        c["insert"].append([["u64", 16, lay.n_kv + 1], ["insert", lay.kv_end, raw.hex()]])
    return c


def all_ops(cat: Dict[str, List[list]]) -> List[list]:
    return [ops for fam in cat.values() for ops in fam]


def mutation_strategy(lay: Layout, cat: Optional[Dict[str, List[list]]] = None):
    """Hypothesis: one case's ops -- a catalog entry, random bytes at a random place (mostly in the
    metadata), a truncation anywhere, or two catalog entries together."""
    cat = cat or catalog(lay)
    entries = all_ops(cat)
    one = st.sampled_from(entries)
    meta_end = max(lay.data_start, 1)
    flip = st.builds(lambda at, raw: [["bytes", at, raw.hex()]],
                     st.one_of(st.integers(0, meta_end - 1), st.integers(0, lay.size - 1)),
                     st.binary(min_size=1, max_size=8))
    cut = st.integers(0, lay.size - 1).map(lambda n: [["truncate", n]])
    pair = st.tuples(one, one).map(lambda ab: ab[0] + ab[1])
    return st.one_of(one, one, flip, cut, pair)


# ---- running ----------------------------------------------------------------------------------

def run_cases(cases: List[dict], timeout_per_case: float = 60.0, jobs_timeout: Optional[float] = None) -> List[dict]:
    """Run ``cases`` in one subprocess (each in a forked child); one result dict per case:
    ``{"id", "outcome": "ok" | "error" | "exception" | "cli-bad" | "signal" | "timeout" | "lost",
    "detail"}``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-") as work:
        spec = os.path.join(work, "cases.json")
        with open(spec, "w") as f:
            json.dump({"cases": cases, "timeout": timeout_per_case, "work": work}, f)
        env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONPATH=os.pathsep.join(
            [os.path.dirname(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        limit = jobs_timeout or (120 + timeout_per_case * len(cases))
        p = subprocess.run([sys.executable, RUNNER, spec], capture_output=True, text=True, timeout=limit, env=env)
        got = {}
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                got[r["id"]] = r
        if p.returncode != 0:
            raise RuntimeError(f"the case runner itself died (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return [got.get(c["id"], {"id": c["id"], "outcome": "lost", "detail": "no result"}) for c in cases]


def is_failure(result: dict) -> bool:
    return result["outcome"] not in ("ok", "error")


def make_cases(prefix: str, kind: str, base: str, target: str, draft: str, ops_list: Sequence[list],
               modes: Sequence[str] = ("speculator", "inspect", "run")) -> List[dict]:
    return [{"id": f"{prefix}-{i}", "kind": kind, "base": base, "target": target, "draft": draft,
             "mode": modes[i % len(modes)], "ops": list(ops)} for i, ops in enumerate(ops_list)]
