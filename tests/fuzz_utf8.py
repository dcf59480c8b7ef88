"""Text decoding as llama-server does it, for the UTF-8 fuzz tests.

llama-server keeps the generated text as bytes (``slot.generated_text``) and writes it into JSON
with ``dump(..., error_handler_t::replace)`` (``safe_json_to_str`` -> ``common_json::dump_safe``):
nlohmann's serializer runs Bjoern Hoehrmann's UTF-8 DFA and, at a rejected byte, writes one
U+FFFD for what it had of the sequence and reads the rejected byte again (unless it started the
sequence); an unfinished sequence at the end becomes one U+FFFD.  :func:`nlohmann_replace` is a
line-by-line port (vendor/nlohmann/json.hpp ``dump_escaped`` / ``decode``); the tests check it
equals Python's ``bytes.decode("utf-8", "replace")`` (both follow Unicode's "maximal subpart"
practice), which is what our engine's incremental decoder produces.

While streaming, llama-server holds the text back while its end is an unfinished sequence
(``validate_utf8``, :func:`validate_utf8`, ported from tools/server/server-common.cpp) and -- a
difference we do not copy -- never sends such a tail when the generation ends there (the final
stream event has empty ``content``); non-streaming, the tail is in ``content`` as U+FFFD.  Our
server sends the same text both ways.  Stop strings: llama-server matches them against the raw
bytes (a stop string holding U+FFFD never matches an invalid byte); ours match the decoded text.
"""

from __future__ import annotations

import codecs
from typing import Dict, Optional, Sequence, Tuple

_UTF8D = [
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  # 00..1F
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  # 20..3F
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  # 40..5F
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  # 60..7F
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9,  # 80..9F
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,  # A0..BF
    8, 8, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,  # C0..DF
    0xA, 0x3, 0x3, 0x3, 0x3, 0x3, 0x3, 0x3, 0x3, 0x3, 0x3, 0x3, 0x3, 0x4, 0x3, 0x3,  # E0..EF
    0xB, 0x6, 0x6, 0x6, 0x5, 0x8, 0x8, 0x8, 0x8, 0x8, 0x8, 0x8, 0x8, 0x8, 0x8, 0x8,  # F0..FF
    0x0, 0x1, 0x2, 0x3, 0x5, 0x8, 0x7, 0x1, 0x1, 0x1, 0x4, 0x6, 0x1, 0x1, 0x1, 0x1,  # s0..s0
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1,  # s1..s2
    1, 2, 1, 1, 1, 1, 1, 2, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1,  # s3..s4
    1, 2, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 1, 3, 1, 1, 1, 1, 1, 1,  # s5..s6
    1, 3, 1, 1, 1, 1, 1, 3, 1, 3, 1, 1, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  # s7..s8
]
ACCEPT, REJECT = 0, 1
FFFD = "\ufffd".encode()


def nlohmann_replace(s: bytes) -> str:
    """What nlohmann::json's dump with error_handler_t::replace (ensure_ascii off) writes for
    ``s``, decoded."""
    out = bytearray()
    state, last_accept, undumped = ACCEPT, 0, 0
    i = 0
    while i < len(s):
        byte = s[i]
        state = _UTF8D[256 + state * 16 + _UTF8D[byte]]
        if state == ACCEPT:
            out.append(byte)
            last_accept = len(out)
            undumped = 0
        elif state == REJECT:
            if undumped > 0:
                i -= 1                      # read the byte again: fine on its own, not after what came
            del out[last_accept:]
            out += FFFD
            last_accept = len(out)
            undumped = 0
            state = ACCEPT
        else:
            out.append(byte)
            undumped += 1
        i += 1
    if state != ACCEPT:
        del out[last_accept:]
        out += FFFD
    return out.decode("utf-8")


def validate_utf8(text: bytes) -> int:
    """llama-server's ``validate_utf8``: the length without an unfinished sequence at the end."""
    n = len(text)
    for i in range(1, min(4, n) + 1):
        c = text[n - i]
        if c & 0xE0 == 0xC0 and i < 2 or c & 0xF0 == 0xE0 and i < 3 or c & 0xF8 == 0xF0 and i < 4:
            return n - i
    return n


def partial_tokens(target, limit: Optional[int] = None) -> Dict[int, bytes]:
    """Tokens of ``target`` whose piece (as generation emits it) is not valid UTF-8 on its own."""
    out: Dict[int, bytes] = {}
    for t in range(target.n_vocab):
        p = bytes(target.token_to_piece(t))
        try:
            p.decode("utf-8")
        except UnicodeDecodeError:
            out[t] = p
            if limit and len(out) >= limit:
                break
    return out


def expected(pieces: Sequence[bytes], stops: Sequence[str] = ()) -> Tuple[str, Optional[str]]:
    """(text, stop word): the pieces decoded as llama-server decodes them; with stop strings, cut
    before the first one to show up as the pieces arrive one by one (the earliest of those visible
    after that piece; a sequence still unfinished is not text yet, so a stop string completed by
    the U+FFFD of the unfinished tail counts only at the end)."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    text = ""
    for i in range(len(pieces) + 1):
        text += dec.decode(pieces[i], final=False) if i < len(pieces) else dec.decode(b"", final=True)
        hits = sorted((text.find(s), s) for s in stops if s and text.find(s) >= 0)
        if hits:
            return text[:hits[0][0]], hits[0][1]
    return text, None


# ---- the properties (shared by tests/test_fuzz_utf8.py and bench/fuzz_long.py) ------------------

def _st():
    from hypothesis import strategies as st

    return st


def draw_tokens(data, vocab, max_size=12):
    st = _st()
    part, whole = vocab
    return data.draw(st.lists(st.sampled_from(sorted(part) + sorted(whole)), min_size=1, max_size=max_size),
                     label="tokens")


def draw_stops(data, text):
    st = _st()
    subs = st.builds(lambda i, n: text[i:i + n], st.integers(0, max(0, len(text) - 1)), st.integers(1, 3))
    one = st.one_of(subs, st.sampled_from(["\ufffd", "\ufffd\ufffd", "é", "\ufffdA"]), st.text(min_size=1, max_size=3))
    return [s for s in data.draw(st.lists(one, max_size=3), label="stop") if s]


def draw_bias(data, vocab):
    st = _st()
    part, _ = vocab
    ids = data.draw(st.lists(st.sampled_from(sorted(part)), min_size=1, max_size=4, unique=True), label="forced")
    return {t: float(data.draw(st.integers(8, 30), label="bias")) for t in ids}


def check_text_stream(vocab, data) -> None:
    """TextStream over any tokens, any flush points and stop strings: what it sends adds up to the
    tokens' bytes decoded as llama-server decodes them, cut before the first stop string, and it
    stops at the first token after which the stop string is visible."""
    import codecs

    from pyllama_dspark.decode.cycle import TextStream

    st = _st()
    part, whole = vocab
    pieces = {**part, **whole}
    toks = draw_tokens(data, vocab)
    stops = draw_stops(data, expected([pieces[t] for t in toks])[0])
    flush_at = data.draw(st.sets(st.integers(0, len(toks))), label="flush after")
    ts = TextStream(pieces, stops)
    sent, used = [], 0
    for i, t in enumerate(toks):
        ts.push(t)
        used += 1
        if ts.stopped:
            break
        if i in flush_at:
            sent.append(ts.flush())
    sent.append(ts.flush(final=True))
    want, word = expected([pieces[t] for t in toks[:used]], stops)
    assert "".join(sent) == ts.text == want
    assert ts.stop_word == word
    if word is not None and used < len(toks):
        before = codecs.getincrementaldecoder("utf-8")("replace").decode(b"".join(pieces[t] for t in toks[:used - 1]))
        assert not any(s in before for s in stops)


def check_engine(sp, vocab, data) -> None:
    """Speculator.generate / stream with tokens forced to partial UTF-8 (logit bias) after a prompt of
    such tokens, then again with stop strings taken from that output."""
    st = _st()
    piece = sp.target.token_to_piece
    prompt = [1] + draw_tokens(data, vocab, 8)
    bias = draw_bias(data, vocab)
    n = data.draw(st.integers(1, 8), label="max_tokens")
    done = sp.generate(prompt, n, logit_bias=bias)
    text, _ = expected([piece(t) for t in done.tokens])
    assert done.text == text
    stops = draw_stops(data, text)
    chunks, final = [], None
    for ev in sp.stream(prompt, n, stop=stops, logit_bias=bias):
        if hasattr(ev, "finish_reason"):
            final = ev
        else:
            chunks.append(ev.text)
    want, word = expected([piece(t) for t in final.tokens], stops)
    assert "".join(chunks) == final.text == want
    assert final.stop_word == word
    assert final.tokens == done.tokens[:len(final.tokens)]
    assert (final.finish_reason == "stop") if word else final.finish_reason == done.finish_reason


def check_server(srv, sp, vocab, data) -> None:
    """/completion (tokens returned), streaming and not, /v1/completions and /v1/chat/completions
    streaming and not: the text is the returned tokens decoded as llama-server decodes them, cut at
    the first stop string, the same streamed as not; /detokenize of the prompt likewise."""
    from serve_helpers import sse_json

    st = _st()
    piece = sp.target.token_to_piece
    prompt = [1] + draw_tokens(data, vocab, 8)
    bias = [[t, b] for t, b in draw_bias(data, vocab).items()]
    n = data.draw(st.integers(1, 6), label="n_predict")
    base = {"prompt": prompt, "n_predict": n, "logit_bias": bias, "temperature": 0, "return_tokens": True}
    r = srv.post("/completion", base)
    assert r.status_code == 200, r.text
    out = r.json()
    text, _ = expected([piece(t) for t in out["tokens"]])
    assert out["content"] == text
    assert out["prompt"] == expected([piece(t, True) for t in prompt])[0]
    assert srv.post("/detokenize", {"tokens": prompt}).json()["content"] == out["prompt"]

    stops = draw_stops(data, text)
    body = dict(base, stop=stops)
    one = srv.post("/completion", body).json()
    want, word = expected([piece(t) for t in one["tokens"]], stops)
    assert one["content"] == want and one["stopping_word"] == (word or "")
    ev = sse_json(srv.post("/completion", dict(body, stream=True), stream=True))
    assert "".join(e["content"] for e in ev) == want
    assert [t for e in ev for t in e["tokens"]] == one["tokens"]

    lb = {str(t): b for t, b in bias}
    oai = {"prompt": prompt, "max_tokens": n, "logit_bias": lb, "temperature": 0, "stop": stops}
    assert srv.post("/v1/completions", oai).json()["choices"][0]["text"] == want
    ev = sse_json(srv.post("/v1/completions", dict(oai, stream=True), stream=True))
    assert "".join(e["choices"][0]["text"] for e in ev if e != "[DONE]" and e.get("choices")) == want

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "temperature": 0, "logit_bias": lb,
            "stop": stops}
    c = srv.post("/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    ev = sse_json(srv.post("/v1/chat/completions", dict(chat, stream=True), stream=True))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in ev
                   if e != "[DONE]" and e.get("choices")) == c
    assert srv.proc.poll() is None
