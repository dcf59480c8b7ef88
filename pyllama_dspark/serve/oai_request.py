"""Request bodies (as llama-server accepts them) -> a checked :class:`GenRequest`.

Pure Python, no HTTP: the server calls :func:`parse_request` on the decoded JSON body and turns a
:class:`RequestError` into an HTTP error with an OpenAI-style body.  Unknown fields are ignored
(llama-server ignores them too); a known field of the wrong type or out of range is an error.

Kinds: ``"chat"`` (``/v1/chat/completions``), ``"completion"`` (``/v1/completions``) and
``"native"`` (llama-server's own ``/completion``).  Fields: ``messages`` (chat) / ``prompt`` (a
string, token ids, a one-element list of strings, and on native a mix of text and ids),
``n_predict`` (aliases ``max_completion_tokens``, ``max_tokens``, looked up in that order as
llama-server does; -1 = until the context is full), ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``,
``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``, ``stop``
(string or list), ``stream``, ``stream_options.include_usage``, ``ignore_eos``, ``n`` (must be 1),
``model`` (echoed only), ``cache_prompt`` (default true), ``return_tokens``, ``id_slot`` (checked,
then ignored: the pool picks the slot), ``speculative.n_max`` (this request's draft block, 0: no
draft), ``timings_per_token`` and ``dspark_trace`` (streaming: per chunk, the timings so far and
what was drafted and accepted; docs/serve.md);

* constraints: ``grammar`` (GBNF text), ``json_schema`` (an object; ``{}`` = any object), and on
  chat ``response_format`` (``{"type": "text" | "json_object" [, "schema"] | "json_schema",
  "json_schema": {"schema"}}``) -- llama-server's precedence: on chat ``json_schema`` together
  with ``grammar`` is an error and a schema (from either field) wins over ``grammar``; on the
  completion endpoints ``grammar`` wins and ``response_format`` is not read (llama-server reads it
  on chat only).  :func:`grammar_text` turns the result into GBNF;
* probabilities: chat ``logprobs`` (boolean) + ``top_logprobs`` (default 20; without ``logprobs``
  an error), completion ``logprobs`` = N (an alias of ``n_probs``), ``n_probs``,
  ``post_sampling_probs``;
* ``logit_bias``: ``{"id": bias}`` (OpenAI; a key that is not a number is text, and every token
  of it gets the bias), ``[[id, bias], ["text", bias]]``; ``false`` as the bias bans the token.
  Ids outside the vocabulary are dropped (:func:`resolve_logit_bias`), as llama-server drops them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from pyllama_dspark.serve.oai_errors import RequestError, _is, _typename
from pyllama_dspark.serve.oai_messages import ROLES, parse_messages
from pyllama_dspark.serve.oai_tools import ToolFields, parse_tool_fields

__all__ = ["RequestError", "GenRequest", "ROLES", "parse_request", "parse_json_body", "grammar_text", "check_grammar",
           "resolve_logit_bias", "tokenize_mixed", "_bool", "_is", "_typename"]


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json_body(raw: bytes) -> Any:
    """A request body decoded as llama-server's JSON parser accepts it: UTF-8 (a leading BOM
    skipped), no string holding a lone UTF-16 surrogate (``"\\ud800"``: Python's json accepts it,
    nothing downstream can encode it), nesting Python's parser can hold; else RequestError (400)."""
    if not raw.strip():
        raise RequestError("the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")   # strict: also refuses a surrogate encoded as UTF-8
    except UnicodeDecodeError as e:
        raise RequestError(f"invalid JSON in the request body: not UTF-8 ({e})") from e
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        body = json.loads(text)
    except RecursionError:
        raise RequestError("invalid JSON in the request body: nested too deeply") from None
    except ValueError as e:
        raise RequestError(f"invalid JSON in the request body: {e}") from e
    if _SURROGATE_ESCAPE.search(text):   # the only way a lone surrogate gets in
        stack = [body]
        while stack:
            v = stack.pop()
            if isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
            elif isinstance(v, str) and _LONE_SURROGATE.search(v):
                raise RequestError("invalid JSON in the request body: a string holds a lone UTF-16 surrogate "
                                   "(\\ud800-\\udfff)")
    return body


# sampling fields and their checks: (python types, lower bound, upper bound)
_NUM = (int, float)
_SAMPLING_FIELDS = {
    "temperature": (_NUM, 0.0, None),
    "top_k": ((int,), None, None),
    "top_p": (_NUM, 0.0, 1.0),
    "min_p": (_NUM, 0.0, 1.0),
    "seed": ((int,), None, None),
    "repeat_penalty": (_NUM, 0.0, None),
    "presence_penalty": (_NUM, None, None),
    "frequency_penalty": (_NUM, None, None),
    "repeat_last_n": ((int,), 0, None),         # llama-server's name of penalty_last_n (hard limit >= 0)
}
_SAMPLING_NAMES = {"repeat_last_n": "penalty_last_n"}
N_PROBS_CHAT_DEFAULT = 20                       # llama-server's top_logprobs when only logprobs is set

@dataclass
class GenRequest:
    kind: str                                   # "chat" | "completion" | "native"
    messages: Optional[List[Dict[str, Any]]] = None
    tools: Optional[ToolFields] = None          # chat: tools / tool_choice / ... (None: none given)
    prompt: Optional[Union[str, List[Union[int, str]]]] = None   # text, token ids, or a mix of both
    max_tokens: int = -1                        # -1: until EOS / the context is full
    stop: List[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    model: Optional[str] = None
    sampling: Dict[str, Any] = field(default_factory=dict)   # only the fields the client sent
    grammar: Optional[str] = None               # GBNF the client sent (used when json_schema is None)
    json_schema: Optional[dict] = None          # the effective JSON schema (json_schema / response_format)
    logit_bias: List[Tuple[Union[int, str], float]] = field(default_factory=list)   # (id or text, bias)
    n_probs: int = 0                            # > 0: probabilities of the top n_probs tokens per token
    post_sampling_probs: bool = False
    cache_prompt: bool = True
    return_tokens: bool = False                 # native: the generated ids in "tokens"
    id_slot: int = -1                           # accepted, ignored (the pool picks the slot)
    n_max: Optional[int] = None                 # "speculative.n_max": this request's draft block (0: no draft)
    timings_per_token: bool = False             # streaming: every chunk carries the timings so far
    trace: bool = False                         # "dspark_trace": every streamed chunk says what was drafted


def _int_field(body: dict, name: str) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is(v, int):
        raise RequestError(f"'{name}' must be an integer, got {_typename(v)}", param=name)
    return v


def _prompt(body: dict, mixed: bool = False) -> Union[str, List[Union[int, str]]]:
    p = body.get("prompt")
    if p is None:
        raise RequestError("'prompt' is required", param="prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list):
        if not p:
            raise RequestError("'prompt' must not be empty", param="prompt")
        if all(_is(t, int) for t in p):
            return list(p)
        if len(p) == 1 and isinstance(p[0], str):
            return p[0]
        if all(isinstance(t, str) for t in p):
            raise RequestError("several prompts in one request are not supported; send one prompt per request",
                               param="prompt")
        if mixed and all(isinstance(t, str) or _is(t, int) for t in p):
            return list(p)     # llama-server's mixed prompt: text pieces and token ids, in order
        raise RequestError("'prompt' must be a string or an array of token ids", param="prompt")
    raise RequestError(f"'prompt' must be a string or an array of token ids, got {_typename(p)}", param="prompt")


def _stop(body: dict) -> List[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        return [s] if s else []
    if isinstance(s, list) and all(isinstance(x, str) for x in s):
        return [x for x in s if x]
    raise RequestError("'stop' must be a string or an array of strings", param="stop")


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be a boolean, got {_typename(v)}", param=name)
    return v


def _schema(v: Any, name: str) -> dict:
    if not isinstance(v, dict):
        raise RequestError(f"'{name}' must be a JSON schema object, got {_typename(v)}", param=name)
    return v


def _constraints(body: dict, req: GenRequest) -> None:
    """``grammar`` / ``json_schema`` / (chat) ``response_format`` -> req.grammar, req.json_schema."""
    g = body.get("grammar")
    if g is not None and not isinstance(g, str):
        raise RequestError(f"'grammar' must be a string (GBNF), got {_typename(g)}", param="grammar")
    schema = body.get("json_schema")
    if schema is not None:
        schema = _schema(schema, "json_schema")
    if req.kind == "chat":
        if schema is not None and g:
            raise RequestError("Cannot use both json_schema and grammar", param="grammar")
        rf = body.get("response_format")
        if rf is not None:
            if not isinstance(rf, dict):
                raise RequestError(f"'response_format' must be an object, got {_typename(rf)}",
                                   param="response_format")
            rtype = rf.get("type") or ""
            if not isinstance(rtype, str):
                raise RequestError("'response_format.type' must be a string", param="response_format")
            if rtype == "json_object":
                if "schema" in rf or not schema:
                    schema = _schema(rf.get("schema") or {}, "response_format.schema")
            elif rtype == "json_schema":
                wrapper = _schema(rf.get("json_schema") or {}, "response_format.json_schema")
                schema = _schema(wrapper.get("schema") or {}, "response_format.json_schema.schema")
            elif rtype not in ("", "text"):
                raise RequestError('response_format type must be one of "text" or "json_object", but got: '
                                   + rtype, param="response_format")
    elif g is not None:
        schema = None          # /completion: "grammar" wins over "json_schema" (server-schema.cpp)
    if schema is not None and not schema:
        schema = {"type": "object"}   # an empty schema means any object
    req.json_schema = schema
    req.grammar = g or None


def _speculation(body: dict, req: GenRequest) -> None:
    """``speculative.n_max`` (llama-server's name, a flat key: >= 0, 0 = no draft for this request;
    clamped to the server's draft block), ``timings_per_token`` and ``dspark_trace``."""
    n = _int_field(body, "speculative.n_max")
    if n is not None and n < 0:
        raise RequestError(f"'speculative.n_max' must be >= 0, got {n}", param="speculative.n_max")
    req.n_max = n
    req.timings_per_token = _bool(body, "timings_per_token")
    req.trace = _bool(body, "dspark_trace")


def _probs(body: dict, req: GenRequest) -> None:
    """chat ``logprobs`` + ``top_logprobs``; ``n_probs`` (alias ``logprobs`` off chat); ``post_sampling_probs``."""
    n = None
    if req.kind == "chat":
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise RequestError(f"'logprobs' must be a boolean, got {_typename(lp)}", param="logprobs")
        if lp:
            n = _int_field(body, "top_logprobs")
            n = N_PROBS_CHAT_DEFAULT if n is None else n
            if n < 0:
                raise RequestError(f"'top_logprobs' must be >= 0, got {n}", param="top_logprobs")
        elif body.get("top_logprobs") is not None:
            raise RequestError("top_logprobs requires logprobs to be set to true", param="top_logprobs")
        if n is None:
            n = _int_field(body, "n_probs")
    else:
        for name in ("n_probs", "logprobs"):
            v = body.get(name)
            if v is None:
                continue
            n = int(v) if isinstance(v, bool) else _int_field(body, name)   # llama-server reads true as 1
            break
    req.n_probs = max(0, n or 0)
    req.post_sampling_probs = _bool(body, "post_sampling_probs")


_INT_KEY = re.compile(r"\s*[+-]?\d+")   # what strtol reads whole: a token id, else text to tokenize


def _float(v) -> Optional[float]:
    """``v`` (an int or a float) as a float; None for an int too large for one (10**400)."""
    try:
        return float(v)
    except OverflowError:
        return None


def _bias_value(v: Any, where: str) -> float:
    if v is False:
        return float("-inf")
    if not _is(v, (int, float)):
        raise RequestError(f"logit_bias{where}: the bias must be a number, or false to ban the token, "
                           f"got {_typename(v)}", param="logit_bias")
    f = _float(v)
    if f is None or not math.isfinite(f):
        raise RequestError(f"logit_bias{where}: the bias must be finite (false bans the token)", param="logit_bias")
    return f


def _logit_bias(body: dict) -> List[Tuple[Union[int, str], float]]:
    lb = body.get("logit_bias")
    if lb is None:
        return []
    out: List[Tuple[Union[int, str], float]] = []
    if isinstance(lb, dict):
        for k, v in lb.items():
            out.append((int(k) if _INT_KEY.fullmatch(k) else k, _bias_value(v, f"[{k!r}]")))
    elif isinstance(lb, list):
        for i, el in enumerate(lb):
            if not isinstance(el, list) or len(el) != 2:
                raise RequestError(f"logit_bias[{i}] must be a [token, bias] pair", param="logit_bias")
            tok, v = el
            if not (_is(tok, int) or isinstance(tok, str)):
                raise RequestError(f"logit_bias[{i}][0] must be a token id or a string, got {_typename(tok)}",
                                   param="logit_bias")
            out.append((tok, _bias_value(v, f"[{i}]")))
    else:
        raise RequestError(f"'logit_bias' must be an object or an array of [token, bias] pairs, got {_typename(lb)}",
                           param="logit_bias")
    return out


def resolve_logit_bias(entries: Sequence[Tuple[Union[int, str], float]], tokenize: Callable[[str], List[int]],
                       n_vocab: int) -> Optional[Dict[int, float]]:
    """token id -> bias: text keys become their tokens (``tokenize``: no BOS, no special parsing,
    as llama-server's ``common_tokenize(vocab, text, false)``), ids outside ``0..n_vocab-1`` are
    dropped; biases given twice for one token add up (llama.cpp applies each entry).  None: empty."""
    out: Dict[int, float] = {}
    for key, bias in entries:
        for t in ([key] if isinstance(key, int) else tokenize(key)):
            if 0 <= t < n_vocab:
                out[t] = out.get(t, 0.0) + bias
    return out or None


def tokenize_mixed(prompt: Union[str, Sequence[Union[int, str]]], tokenize: Callable[[str, bool], List[int]],
                   add_special: bool) -> List[int]:
    """llama-server's ``tokenize_mixed``: text pieces tokenized (``add_special`` only for a text
    piece that comes first), token ids kept as they are.  ``tokenize(text, add_special)``."""
    if isinstance(prompt, str):
        return list(tokenize(prompt, add_special))
    out: List[int] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.extend(tokenize(p, add_special and i == 0))
        else:
            out.append(int(p))
    return out


def grammar_text(req: GenRequest) -> Optional[str]:
    """The GBNF a request constrains its output with (its JSON schema converted), or None."""
    if req.json_schema is not None:
        from pyllama_dspark.llama import grammar as gmod

        if req.json_schema == {"type": "object"}:
            return gmod.JSON_OBJECT_GBNF
        try:
            return gmod.schema_to_gbnf(req.json_schema)
        except (ValueError, TypeError, KeyError, RecursionError) as e:   # GrammarError is a ValueError
            raise RequestError(f'"json_schema": {e}', param="json_schema") from e
    return req.grammar or None


def check_grammar(gbnf: str, target: Any) -> None:
    """Compile ``gbnf`` against the target's vocabulary once (RequestError with llama.cpp's parser
    message when it does not compile), then free it: the engine compiles its own per request."""
    from pyllama_dspark.llama.grammar import Grammar

    try:
        g = Grammar.compile(gbnf, target)
    except ValueError as e:   # GrammarError
        raise RequestError(f"Failed to initialize samplers: {e}", param="grammar") from e
    g.close()


def parse_request(body: Any, kind: str) -> GenRequest:
    """Check a decoded JSON body for ``kind`` = "chat", "completion" or "native"; raise RequestError."""
    if kind not in ("chat", "completion", "native"):
        raise ValueError(f"kind must be 'chat', 'completion' or 'native', got {kind!r}")
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_typename(body)}")
    req = GenRequest(kind=kind)
    if kind == "chat":
        req.messages = parse_messages(body)
        req.tools = parse_tool_fields(body, req.messages)
    else:
        req.prompt = _prompt(body, mixed=kind == "native")
    if kind == "completion":
        if body.get("echo"):
            raise RequestError("Only no echo is supported", param="echo")
        for name in ("best_of", "suffix"):
            if name in body:
                raise RequestError(f"Unsupported param: {name}", param=name)

    # llama-server's lookup order: n_predict, then its aliases
    n_given = [k for k in ("n_predict", "max_completion_tokens", "max_tokens") if body.get(k) is not None]
    if n_given:
        n = _int_field(body, n_given[0])
        if n < -1 or n == 0:
            raise RequestError(f"'{n_given[0]}' must be >= 1 (or -1 for no limit), got {n}", param=n_given[0])
        req.max_tokens = n

    n_choices = _int_field(body, "n")
    if n_choices is not None and n_choices != 1:
        raise RequestError("only n = 1 is supported", param="n")

    req.stop = _stop(body)
    req.stream = _bool(body, "stream")
    req.ignore_eos = _bool(body, "ignore_eos")
    req.cache_prompt = _bool(body, "cache_prompt", True)
    req.return_tokens = _bool(body, "return_tokens")
    id_slot = _int_field(body, "id_slot")
    req.id_slot = -1 if id_slot is None else id_slot
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError("'stream_options' must be an object", param="stream_options")
        req.include_usage = _bool(so, "include_usage")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {_typename(model)}", param="model")
    req.model = model

    for name, (types, lo, hi) in _SAMPLING_FIELDS.items():
        v = body.get(name)
        if v is None:
            continue
        if types == (int,):
            v = _int_field(body, name)
        elif not _is(v, types):
            raise RequestError(f"'{name}' must be a number, got {_typename(v)}", param=name)
        if _float(v) is None:   # the sampler's checks convert to float: OverflowError, a 500
            raise RequestError(f"'{name}' is too large: {str(v)[:24]}...", param=name)
        if v != v:  # NaN
            raise RequestError(f"'{name}' must not be NaN", param=name)
        if lo is not None and v < lo:
            raise RequestError(f"'{name}' must be >= {lo}, got {v}", param=name)
        if hi is not None and v > hi:
            raise RequestError(f"'{name}' must be <= {hi}, got {v}", param=name)
        req.sampling[_SAMPLING_NAMES.get(name, name)] = v

    _speculation(body, req)
    _constraints(body, req)
    _probs(body, req)
    req.logit_bias = _logit_bias(body)
    return req
