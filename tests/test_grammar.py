"""llama.cpp's grammar engine under our API (pyllama_dspark.llama.grammar).

References, none of them our grammar code on another path:
* the allowed tokens of a literal-alternatives grammar, computed in Python from the token pieces
  (a token is allowed iff its piece extends the text so far to a prefix of an alternative);
* ``llama_cpp.Llama.create_completion(grammar=LlamaGrammar...)`` at temperature 0: llama-cpp-python's
  own constrained greedy decoding, token for token, for GBNF and for a JSON schema (its output
  also validated with ``jsonschema``);
* JSON text we know to be valid up to a point (valid_prefix), and a fresh grammar fed token by
  token (GrammarCursor.state_after);
* every malformed grammar / schema raises GrammarError with llama.cpp's (or our) reason, in this
  process and in a subprocess that must exit 0 (llama.cpp aborts or segfaults on several of them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from greedy_ref import TEST_THREADS

from pyllama_dspark.llama.grammar import (JSON_OBJECT_GBNF, Grammar, GrammarCursor, GrammarError,
                                         schema_to_gbnf)

WORDS = ["yes", "no", "maybe", "café"]
WORDS_GBNF = 'root ::= "yes" | "no" | "maybe" | "café"'
TEXT_GBNF = 'root ::= "The answer is " ("yes" | "no") ", because " [a-z ]{1,40} "."'
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                         "city": {"enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"]}
VALID_JSON = '{"name": "Ann", "age": 41, "city": "Tokyo"}'

# (grammar text, root, a piece of the expected message): llama.cpp's parser text, or ours where
# llama.cpp would crash / hang / constrain nothing
BAD_GRAMMARS = [
    ('root ::= "abc', "root", "unexpected end of input"),                    # unterminated string
    ('root ::= [a-', "root", "unexpected end of input"),
    ('root ::= foo', "root", "Undefined rule identifier 'foo'"),
    ('x ::= "a"', "root", "grammar does not contain a 'root' symbol"),
    ('root ::= "a"', "start", "grammar does not contain a 'start' symbol"),
    ('root ::= root "a" | "b"', "root", "left recursion"),
    ('root ::= "a" | x\nx ::= y "b"\ny ::= x "c" | "d"', "root", "left recursion"),
    ('root := "a"', "root", "expecting ::= at"),
    ('root ::= "a" )', "root", "expecting newline or end"),
    ('root ::= "\\q"', "root", "unknown escape"),
    ('root ::= "a"{1000000}', "root", "number of repetitions exceeds sane defaults"),
    ('root ::= "a"{1,x}', "root", "expecting '}'"),
    ('\ufeffroot ::= "a"', "root", "expecting name at"),                     # odd unicode: a BOM
    ('   # only a comment\n', "root", "failed to parse grammar"),
    ('', "root", "empty grammar"),
    ('root ::= "a"\x00 junk', "root", "NUL character"),
    ('root ::= "\ud800"', "root", "cannot be encoded as UTF-8"),
    (b'root ::= "\xff"', "root", "not valid UTF-8"),
    ('root ::= "a"{5,2}', "root", "below the minimum"),                       # llama.cpp: runaway memory
    ('root ::= ' + '(' * 20000 + '"a"' + ')' * 20000, "root", "nests groups deeper"),   # segfault
    ("\n".join(f'r{i} ::= r{i + 1} "x"' for i in range(13000)) + '\nr13000 ::= "y"\nroot ::= r0',
     "root", "too large"),                                                     # segfault / memory
    ('root ::= "' + "a" * 3000 + '"{2000}', "root", "too large"),
    ('root ::= "a"', "", "root rule name"),
    (123, "root", "must be GBNF text"),
]
BAD_SCHEMAS = [
    (False, "admits no value"),
    (3, "must be an object"),
    ('{"type": "object"}', "must be an object"),
    ({"type": "strin"}, "invalid JSON schema"),
    ({"type": "string", "pattern": "("}, "invalid JSON schema"),
    ({"$ref": "https://example.com/schema.json"}, "Fetching remote schemas is not allowed"),
    ({"$ref": "#/definitions/missing"}, "unsupported JSON schema"),
    ({"type": "object", "properties": {"a": {"const": object()}}}, "unsupported JSON schema"),
]


def _pieces(target) -> list:
    return [target.token_to_piece(t, special=True) for t in range(target.n_vocab)]


def _ref_allowed(pieces, eog, done: bytes, words) -> np.ndarray:
    """Tokens whose piece extends ``done`` to a prefix of a word; EOG when ``done`` is a word."""
    ws = [w.encode() for w in words]
    ok = np.array([bool(p) and any(w.startswith(done + p) for w in ws) for p in pieces])
    ok[eog] = done in ws
    return ok


def hazard_failures(target) -> list:
    """Every bad grammar, schema and token: the failures (an empty list when all raised GrammarError
    with the expected reason and the grammar still works afterwards)."""
    bad = []
    for text, root, want in BAD_GRAMMARS:
        try:
            Grammar.compile(text, target, root=root).close()
            bad.append(f"no error for {str(text)[:40]!r}")
        except GrammarError as e:
            if want not in str(e):
                bad.append(f"{str(text)[:40]!r}: {want!r} not in {str(e)!r}")
    for schema, want in BAD_SCHEMAS:
        try:
            schema_to_gbnf(schema)
            bad.append(f"no error for schema {schema!r}")
        except GrammarError as e:
            if want not in str(e):
                bad.append(f"schema {schema!r}: {want!r} not in {str(e)!r}")
    eos = int(np.flatnonzero(target.eog_mask)[0])
    with Grammar.compile('root ::= "yes"', target) as g:
        no = target.tokenize("no", add_special=False)[0]
        for tok, want in [(no, "not allowed"), (eos, "end of generation"), (-1, "outside"),
                          (target.n_vocab, "outside")]:
            try:
                g.accept(tok)   # llama.cpp: std::runtime_error / GGML_ABORT / out_of_range = abort
                bad.append(f"accept({tok}) did not raise")
            except GrammarError as e:
                if want not in str(e):
                    bad.append(f"accept({tok}): {want!r} not in {str(e)!r}")
        for t in target.tokenize("yes", add_special=False):
            g.accept(t)
        if not g.done:
            bad.append("the grammar is not complete after 'yes'")
        g.accept(eos)            # allowed now: a no-op
    return bad


@pytest.fixture(scope="module")
def target(target_path):
    from pyllama_dspark.llama.handles import ContextSettings, Target

    with Target(target_path, ContextSettings(n_ctx=256, n_threads=TEST_THREADS)) as t:
        yield t


# ---- 1. the mask against the token pieces ------------------------------------------------------------
def test_mask_follows_token_pieces(target):
    pieces, eog = _pieces(target), target.eog_mask
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(target.n_vocab).astype(np.float32)
    for word in WORDS:
        g = Grammar.compile(WORDS_GBNF, target)
        done = b""
        while True:
            ref = _ref_allowed(pieces, eog, done, WORDS)
            probe = np.concatenate([np.flatnonzero(ref), np.flatnonzero(eog), rng.integers(0, target.n_vocab, 300)])
            got_one = [g.allows(int(t)) for t in probe]           # before any full apply: one token each
            assert got_one == [bool(ref[t]) for t in probe], f"allows() after {done!r}"
            before = logits.copy()
            m = g.mask(logits)
            assert m.dtype == np.float32 and np.array_equal(logits, before)
            bad = np.flatnonzero((m > -np.inf) != ref)
            assert not len(bad), f"after {done!r}: tokens {[(int(t), pieces[t]) for t in bad[:8]]} differ"
            assert np.array_equal(m[ref], logits[ref])
            assert g.done == (done == word.encode())
            rest = word.encode()[len(done):]
            if not rest:
                break
            # the longest piece that continues this word (multi-byte pieces included)
            tok = max((t for t in np.flatnonzero(ref) if rest.startswith(pieces[t])), key=lambda t: len(pieces[t]))
            g.accept(int(tok))
            done += pieces[tok]
        assert g.valid_prefix([int(np.flatnonzero(eog)[0])]) == 1
        g.close()
    # a partial UTF-8 byte: 'caf' then the first byte of 'é' alone
    first = [t for t in range(target.n_vocab) if pieces[t] == "é".encode()[:1]]
    if first:
        with Grammar.compile(WORDS_GBNF, target) as g:
            for t in target.tokenize("caf", add_special=False):
                g.accept(t)
            g.accept(first[0])
            assert np.array_equal(g.allowed(), _ref_allowed(pieces, eog, b"caf" + pieces[first[0]], WORDS))


# ---- 2. constrained greedy against llama-cpp-python ------------------------------------------------
def _llama_constrained(llm, prompt: str, gbnf: str, n: int):
    """(prompt ids, generated ids, text) of Llama.create_completion(grammar=...) at temperature 0."""
    from llama_cpp.llama_grammar import LlamaGrammar

    seen: dict = {"out": []}
    orig = llm.generate

    def spy(tokens, *a, **k):
        seen["prompt"] = [int(t) for t in tokens]
        for t in orig(tokens, *a, **k):
            seen["out"].append(int(t))
            yield t

    llm.generate = spy
    try:
        llm.reset()
        r = llm.create_completion(prompt, grammar=LlamaGrammar.from_string(gbnf), temperature=0.0, max_tokens=n)
    finally:
        del llm.generate
    return seen["prompt"], seen["out"], r["choices"][0]["text"]


def _our_constrained(llm, target, prompt_ids, gbnf: str, n: int):
    import llama_cpp

    out = []
    with Grammar.compile(gbnf, target) as g:
        llm.reset()
        llm.eval(prompt_ids)
        for _ in range(n):
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(target.n_vocab,))
            t = int(np.argmax(g.mask(row)))
            out.append(t)
            if target.eog_mask[t]:
                break
            g.accept(t)
            llm.eval([t])
        return out, g.done, g.allows(out[-1])


@pytest.mark.parametrize("kind", ["gbnf", "json_schema"])
def test_constrained_greedy_matches_llama_cpp_python(kind, target, llama_refs):
    import jsonschema

    if kind == "gbnf":
        prompt, gbnf, n = "Q: Is the sky blue? Answer in one sentence.\nA: ", TEXT_GBNF, 48
    else:
        prompt, gbnf, n = "A person described as JSON with name, age and city:\n", schema_to_gbnf(SCHEMA), 64
    llm = llama_refs.llm
    prompt_ids, ref, text = _llama_constrained(llm, prompt, gbnf, n)
    ours, done, eog_ok = _our_constrained(llm, target, prompt_ids, gbnf, n)
    assert ours == ref, f"ours {ours}\nref  {ref}"
    assert target.eog_mask[ours[-1]] and eog_ok, "the grammar should have completed within the budget"
    assert target.detokenize(ours[:-1]).decode() == text
    if kind == "gbnf":    # ends with a literal: complete, only EOG is left (the JSON one allows a space)
        assert done and text.startswith("The answer is ") and text.endswith(".")
    else:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_gbnf_and_schema_true(target):
    assert JSON_OBJECT_GBNF.lstrip().startswith("root") and "object" in JSON_OBJECT_GBNF
    for gbnf in (JSON_OBJECT_GBNF, schema_to_gbnf(True), schema_to_gbnf({})):
        with Grammar.compile(gbnf, target) as g:
            ids = target.tokenize('{"a": [1, "x"]}', add_special=False)
            assert g.valid_prefix(ids) == len(ids)
            assert g.valid_prefix(target.tokenize("[1]", add_special=False)) == 0


# ---- 3. malformed grammars and schemas -----------------------------------------------------------------
def test_bad_grammars_raise(target):
    assert hazard_failures(target) == []
    with Grammar.compile(WORDS_GBNF, target) as g:     # and compiling still works afterwards
        assert g.allows(target.tokenize("yes", add_special=False)[0])


def test_bad_grammars_in_subprocess(target_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    def limit_memory():   # a missing check then fails with std::bad_alloc instead of eating the machine
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    p = subprocess.run([sys.executable, os.path.abspath(__file__), target_path], capture_output=True, text=True,
                       timeout=120, cwd=root, env=env, preexec_fn=limit_memory)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert "HAZARDS OK" in p.stdout, p.stdout[-2000:]


def test_compile_messages_do_not_leak(target, capfd):
    with pytest.raises(GrammarError):
        Grammar.compile('root ::= "abc', target)
    out, err = capfd.readouterr()
    assert "error parsing grammar" not in err and "failed to parse grammar" not in err


# ---- 4. valid_prefix and GrammarCursor -------------------------------------------------------------
def _step_by_step(target, gbnf, tokens) -> Grammar:
    g = Grammar.compile(gbnf, target)
    for t in tokens:
        g.accept(t)
    return g


def test_valid_prefix(target):
    gbnf = schema_to_gbnf(SCHEMA)
    ids = target.tokenize(VALID_JSON, add_special=False)
    eos = int(np.flatnonzero(target.eog_mask)[0])
    at = target.tokenize("@", add_special=False)
    assert len(at) == 1
    with Grammar.compile(gbnf, target) as g:
        assert g.valid_prefix(ids) == len(ids)
        assert g.valid_prefix(ids + [eos, ids[0]]) == len(ids) + 1      # EOG counts and ends the run
        assert g.valid_prefix(ids[:-1] + [eos]) == len(ids) - 1
        assert g.valid_prefix([]) == 0
        n_checked = 0
        for k in range(len(ids)):
            text = target.detokenize(ids[:k]).decode()
            if text.count('"') % 2:      # inside a string '@' is fine
                continue
            assert g.valid_prefix(ids[:k] + at + ids[k + 1:]) == k, f"'@' at {k} after {text!r}"
            n_checked += 1
        assert n_checked >= 6
        # on a state part way through, self is unchanged
        for t in ids[:5]:
            g.accept(t)
        before = g.allowed().copy()
        assert g.valid_prefix(ids[5:]) == len(ids) - 5
        g._allowed = None
        assert np.array_equal(g.allowed(), before) and g.n_accepted == 5


def test_cursor_state_after(target):
    gbnf = schema_to_gbnf(SCHEMA)
    ids = target.tokenize(VALID_JSON, add_special=False)
    eos = int(np.flatnonzero(target.eog_mask)[0])
    committed, drafts = ids[:5], ids[5:12]
    cur = GrammarCursor(Grammar.compile(gbnf, target))
    cur.commit(committed)
    prev = None
    for i in range(len(drafts) + 1):
        s = cur.state_after(drafts[:i])
        with _step_by_step(target, gbnf, committed + drafts[:i]) as ref:
            assert np.array_equal(s.allowed(), ref.allowed()), f"state after {i} drafted tokens"
        if i >= 2:
            assert s is prev, "growing prefixes must advance one scratch state"
        prev = s
    # not an extension of the last prefix: a fresh clone of the committed state
    s = cur.state_after(drafts[:3])
    with _step_by_step(target, gbnf, committed + drafts[:3]) as ref:
        assert np.array_equal(s.allowed(), ref.allowed())
    with pytest.raises(GrammarError):
        cur.state_after(drafts[:2] + [target.tokenize("@", add_special=False)[0]])
    with pytest.raises(GrammarError):
        cur.state_after([eos, drafts[0]])
    # commit accepted drafts + a bonus token; EOG tokens are skipped
    cur.commit(drafts[:3] + [eos])
    cur.commit([drafts[3]])
    with _step_by_step(target, gbnf, committed + drafts[:4]) as ref:
        assert np.array_equal(cur.state_after(()).allowed(), ref.allowed())
        assert np.array_equal(cur.state_after(drafts[4:6]).allowed(), _advance(ref, drafts[4:6]))
    with pytest.raises(GrammarError):
        cur.commit(target.tokenize("@", add_special=False))
    with _step_by_step(target, gbnf, committed + drafts[:4]) as ref:      # a rejected commit changes nothing
        assert np.array_equal(cur.state_after(()).allowed(), ref.allowed())
    cur.close()
    cur.close()


def _advance(g: Grammar, tokens) -> np.ndarray:
    for t in tokens:
        g.accept(t)
    return g.allowed()


def test_clone_and_close(target):
    g = Grammar.compile(WORDS_GBNF, target)
    c = g.clone()
    c.accept(target.tokenize("no", add_special=False)[0])
    assert c.done and not g.done
    g.close()
    g.close()
    assert c.done      # the clone is independent
    from pyllama_dspark.errors import ClosedError
    with pytest.raises(ClosedError):
        g.allows(0)
    c.close()


if __name__ == "__main__":    # the subprocess of test_bad_grammars_in_subprocess
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pyllama_dspark.llama.handles import ContextSettings, Target

    with Target(sys.argv[1], ContextSettings(n_ctx=256, n_threads=1)) as t:
        failures = hazard_failures(t)
    print("\n".join(failures))
    print("HAZARDS OK" if not failures else f"{len(failures)} FAILURES")
    sys.exit(0)
