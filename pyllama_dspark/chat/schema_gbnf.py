"""A tool's ``parameters`` schema as GBNF, for the formats whose arguments are not JSON: one walker
(:class:`SchemaWalker`) over the schema, the format's own syntax in a subclass (Gemma 4's dicts in
:mod:`.gemma4`, LFM2's Python-style values in :mod:`.lfm2_grammar`).

What it writes: ``$ref`` (local ones, each a rule of its own, so recursive schemas work), ``const`` and
``enum`` (the format's literals), ``anyOf`` / ``oneOf`` and type lists (alternatives), ``nullable``,
the JSON types, arrays (``minItems``; ``maxItems`` up to :data:`MAX_REPEAT`, above it not kept) and
objects (the properties in the format's order, the required ones present, the optional ones may be
left out).  A string's pattern / format / length are not kept (any string).  What it cannot say
(:data:`REFUSED`, a non-local ``$ref``, too deep a schema, an odd value) is a
:class:`~.tool_grammar.ToolSchemaError` naming the tool.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

from pyllama_dspark.chat.tool_grammar import ToolSchemaError

__all__ = ["SchemaWalker", "REFUSED", "MAX_REPEAT"]

# what the grammar cannot say
REFUSED = ("allOf", "not", "if", "then", "else", "patternProperties", "prefixItems", "dependentSchemas")
MAX_REPEAT = 64     # maxItems above this is not kept (GBNF repetitions expand into rules)
MAX_DEPTH = 32


class SchemaWalker:
    """JSON schema -> GBNF rules (``rules``, named ``t<tid>-<n>``) for one tool's values; a subclass
    gives the format's syntax in the class attributes and :meth:`literal` / :meth:`key`."""

    ANY = ""                        # the rule of any value
    ANY_DICT = ""                   # ... of any object
    NULL = ""                       # null (``nullable``)
    SIMPLE: Dict[str, str] = {}     # "string" / "number" / "integer" / "boolean" / "null" -> its rule
    END = ""                        # what follows an array's or object's closing bracket
    SEP = ""                        # between two members of an object

    def __init__(self, tool: str, root: Any, tid: int):
        self.tool, self.root, self.tid = tool, root, tid
        self.rules: List[str] = []
        self.refs: Dict[str, str] = {}
        self.n = 0

    @classmethod
    def for_tool(cls, tool: dict, tid: int) -> "SchemaWalker":
        """The walker of tool number ``tid`` (``root``: its parameters schema, an object)."""
        params = tool["function"].get("parameters")
        if params is None or params == {}:    # llama.cpp's common_chat_tool_parameters
            params = {"type": "object", "properties": {}}
        gen = cls(tool["function"]["name"], params, tid)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise gen.err("its parameters schema must be an object")
        return gen

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """A schema's odd values (jsonschema let them by) as :class:`ToolSchemaError` naming the tool."""
        try:
            yield
        except RecursionError:
            raise self.err("its parameters schema nests too deeply") from None
        except ToolSchemaError:
            raise
        except (TypeError, ValueError, AttributeError) as e:
            raise self.err(f"unsupported parameters schema: {e}") from None

    # ---- the format's syntax -------------------------------------------------------------------------
    def literal(self, v: Any) -> List[str]:
        """The GBNF alternatives of a JSON constant (``const`` / ``enum``)."""
        raise NotImplementedError

    def key(self, k: str) -> str:
        """The GBNF of an object's key ``k`` up to its value (its separator included)."""
        raise NotImplementedError

    def order(self, props: dict) -> List[str]:
        """An object's keys in the order they are written."""
        return list(props)

    # ---- the walk ------------------------------------------------------------------------------------
    @property
    def where(self) -> str:
        return f"tool {self.tool!r}"

    def err(self, msg: str) -> ToolSchemaError:
        return ToolSchemaError(f"{self.where}: {msg}")

    def _name(self) -> str:
        self.n += 1
        return f"t{self.tid}-{self.n}"

    def new(self, body: str) -> str:
        """A new rule ``body``; its name."""
        name = self._name()
        self.rules.append(f"{name} ::= {body}")
        return name

    def _closed(self, body: str) -> str:
        return f"({body}{self.END})" if self.END else body

    def value(self, s: Any, depth: int = 0, string_only: bool = False) -> str:
        """The GBNF of a value of schema ``s``; ``string_only``: no ``nullable`` null."""
        if depth > MAX_DEPTH:
            raise self.err("its parameters schema nests too deeply")
        if s is True or s == {}:
            return self.ANY
        if not isinstance(s, dict):
            raise self.err(f"unsupported schema {s!r}")
        for k in REFUSED:
            if k in s:
                raise self.err(f"unsupported parameters schema keyword {k!r}")
        alts = self._alts(s, depth)
        if s.get("nullable") is True and not string_only and self.NULL not in alts:
            alts.append(self.NULL)
        return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"

    def _alts(self, s: dict, depth: int) -> List[str]:
        if "$ref" in s:
            return [self._ref(s["$ref"], depth)]
        if "const" in s:
            return self.literal(s["const"])
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise self.err("an empty enum")
            return [a for v in s["enum"] for a in self.literal(v)]
        for k in ("anyOf", "oneOf"):
            if k in s:
                return [self.value(x, depth + 1) for x in s[k]]
        t = s.get("type")
        if isinstance(t, list):
            return [self.value({**s, "type": x}, depth + 1) for x in t]
        if t is None:
            t = "object" if "properties" in s else "array" if "items" in s else None
            if t is None:
                return [self.ANY]
        if t in self.SIMPLE:
            return [self.SIMPLE[t]]
        if t == "array":
            return [self.array(s, depth)]
        if t == "object":
            return [self.object(s, depth)]
        raise self.err(f"unsupported type {t!r}")

    def _ref(self, ref: Any, depth: int) -> str:
        if ref in self.refs:
            return self.refs[ref]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.err(f"unsupported $ref {ref!r} (only local ones)")
        node: Any = self.root
        for part in (ref[2:].split("/") if ref != "#" else ()):
            if not isinstance(node, dict) or part not in node:
                raise self.err(f"unresolved $ref {ref!r}")
            node = node[part]
        name = self._name()
        self.refs[ref] = name
        self.rules.append(f"{name} ::= {self.value(node, depth + 1)}")
        return name

    def array(self, s: dict, depth: int) -> str:
        item = self.value(s.get("items", True), depth + 1)
        lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
        hi = None if hi is None or int(hi) > MAX_REPEAT else int(hi)
        if lo > MAX_REPEAT:
            raise self.err(f"minItems above {MAX_REPEAT}")
        if hi is not None and hi < lo:
            raise self.err("maxItems < minItems")
        if hi == 0:
            return self._closed('"[" space "]"')
        more = f'("," space {item})' + (f"{{{max(lo - 1, 0)},}}" if hi is None else f"{{{max(lo - 1, 0)},{hi - 1}}}")
        if lo > 0:
            return self.new(f'"[" space {item} {more} space "]"{self.END}')
        return self.new(f'"[" space ("]" | {item} {more} space "]"){self.END}')

    def object(self, s: dict, depth: int) -> str:
        props = s.get("properties")
        if props is None:
            return self.ANY_DICT
        if not isinstance(props, dict):
            raise self.err("'properties' is not an object")
        req = set(s.get("required") or ())
        kvs = [(self.new(f"{self.key(k)} space {self.value(props[k], depth + 1)}"), k in req)
               for k in self.order(props)]
        inner = self.members(kvs, self.SEP, need=True)
        if inner is None:
            return self._closed('"{" space "}"')
        if any(r for _, r in kvs):
            return self.new(f'"{{" space {inner} space "}}"{self.END}')
        return self.new(f'"{{" space ("}}" | {inner} space "}}"){self.END}')

    def members(self, kvs: List[Tuple[str, bool]], sep: str, need: bool) -> Optional[str]:
        """A rule for the members ``kvs`` (rule, required?) in order, optional ones left out, ``sep``
        between two; ``need``: at least one.  None: nothing to write (no members)."""
        # seq(i, first, need): the members from i on (a rule, "" for none, None: impossible); first: none
        # written yet (no separator)
        memo: Dict[Tuple[int, bool, bool], Optional[str]] = {}

        def seq(i: int, first: bool, need_: bool) -> Optional[str]:
            if i == len(kvs):
                return None if need_ else ""
            key = (i, first, need_)
            if key not in memo:
                kv, required = kvs[i]
                this = " ".join(x for x in ("" if first else sep, kv, seq(i + 1, False, False)) if x)
                skip = None if required else seq(i + 1, first, need_)
                body = this if skip is None else (f"({this})?" if skip == "" else f"({this}) | {skip}")
                memo[key] = self.new(body)
            return memo[key]

        return seq(0, True, need) if kvs else None
