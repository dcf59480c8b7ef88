"""The small CLI commands end to end, each in a fresh process as a user runs them:

* ``inspect``: prints the draft's metadata (checked against the GGUF read with the ``gguf``
  library, not with our reader) and the pairing verdict; a mismatched pair or a file that is not a
  GGUF is a one-line error with exit status 1; given a target, what it is (read with ``gguf``) and
  what a draft must match, each stated bound held to by llama.cpp's own load of drafts at and past it;
* ``make-test-draft``: both kinds, with the size options, write GGUFs that llama.cpp loads and
  drafts with, the greedy output staying ``llama_cpp.Llama``'s; the seed makes the file;
* ``run -md random`` / ``random-dflash``: the random draft is written once into the cache
  (``PYLLAMA_DSPARK_CACHE``) and the output at ``--temp 0`` is Llama's greedy output.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from cli_runner import cli


_cli = cli


def _field(reader, key):
    return reader.fields[key].contents()


def _tensor_shapes(reader):
    return {t.name: [int(x) for x in t.shape] for t in reader.tensors}


@pytest.fixture(scope="module")
def made(target_path, tmp_path_factory):
    """make-test-draft, both kinds (non-default sizes for the DSpark one), plus a seed twin."""
    d = tmp_path_factory.mktemp("cli")
    out = {"dspark": d / "dspark.gguf", "dflash": d / "dflash.gguf", "twin": d / "twin.gguf",
           "other_seed": d / "seed2.gguf"}
    runs = [("dspark", ["--layers", "1", "--block-size", "5", "--markov-rank", "8", "--seed", "3"]),
            ("dflash", ["--kind", "dflash"]),
            ("twin", ["--layers", "1", "--block-size", "5", "--markov-rank", "8", "--seed", "3"]),
            ("other_seed", ["--layers", "1", "--block-size", "5", "--markov-rank", "8", "--seed", "4"])]
    for name, args in runs:
        p = _cli("make-test-draft", "--target", target_path, "-o", out[name], *args)
        assert p.returncode == 0, p.stderr[-2000:]
        assert f"wrote {out[name]}" in p.stdout
    return out


def test_make_test_draft_writes_what_was_asked(made, target_path):
    t = gguf.GGUFReader(target_path)
    n_embd, n_vocab = _field(t, "llama.embedding_length"), len(t.fields["tokenizer.ggml.tokens"].data)
    r = gguf.GGUFReader(str(made["dspark"]))
    assert _field(r, "general.architecture") == "dflash"
    assert _field(r, "dflash.block_size") == 5 and _field(r, "dflash.block_count") == 1
    assert _field(r, "dflash.embedding_length") == n_embd
    shapes = _tensor_shapes(r)
    assert sorted(shapes["markov_w1.weight"]) == sorted([n_vocab, 8])
    assert "conf_proj.weight" in shapes and "blk.1.attn_q.weight" not in shapes
    assert _field(r, "tokenizer.ggml.tokens") == _field(t, "tokenizer.ggml.tokens")
    f = gguf.GGUFReader(str(made["dflash"]))
    assert _field(f, "dflash.block_size") == 7 and _field(f, "dflash.block_count") == 2
    assert not any(k.startswith(("markov", "conf_proj")) for k in _tensor_shapes(f))
    # the seed decides the weights: the same seed writes the same file, another seed other weights
    assert made["twin"].read_bytes() == made["dspark"].read_bytes()
    other = gguf.GGUFReader(str(made["other_seed"]))
    fc = [next(np.array(t.data) for t in g.tensors if t.name == "fc.weight") for g in (r, other)]
    assert _tensor_shapes(other) == shapes and not np.array_equal(fc[0], fc[1])


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_made_drafts_load_and_draft_in_llama_cpp(made, kind, target_path, llama_refs):
    from pyllama_dspark.decode.api import Speculator

    prompt = llama_refs.llm.tokenize(b"The capital of France is", add_bos=True, special=True)
    with Speculator(target_path, str(made[kind]), n_ctx=512, n_threads=1) as sp:
        done = sp.generate(prompt, 12)
    assert done.stats.drafted > 0
    assert done.tokens == llama_refs.greedy(prompt, 12)


def test_inspect_prints_the_metadata_and_the_verdict(made, target_path):
    p = _cli("inspect", made["dspark"], "--target", target_path)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    r = gguf.GGUFReader(str(made["dspark"]))
    layers = _field(r, "dflash.target_layers")
    assert "dflash / dspark" in out and f"block_size:       {_field(r, 'dflash.block_size')}" in out
    assert str(list(layers)) in out and "rank 8" in out and "1 x (n_embd 576" in out
    assert "pair:               compatible" in out and out.rstrip().endswith("pairing: OK")
    # a DFlash draft, no target: the metadata only
    p = _cli("inspect", made["dflash"])
    assert p.returncode == 0 and "dflash / dflash" in p.stdout and "markov head:      none" in p.stdout
    assert "target:" not in p.stdout and "pairing" not in p.stdout


def test_inspect_fails_cleanly_on_a_mismatch(target_path, tmp_path):
    from pyllama_dspark.gguf.testing import make_test_draft

    bad = make_test_draft(target_path, tmp_path / "n512.gguf", n_layers=1, markov_rank=8,
                          overrides={"@n_embd": 512, "@n_ff": 64})
    p = _cli("inspect", bad, "--target", target_path)
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert "INCOMPATIBLE" in p.stdout and "n_embd" in p.stdout
    assert "Error:" in p.stderr and "n_embd" in p.stderr and "Traceback" not in p.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 20)
    p = _cli("inspect", junk)
    assert p.returncode == 1 and "Error:" in p.stderr and "GGUF" in p.stderr and "Traceback" not in p.stderr
    p = _cli("inspect", tmp_path / "missing.gguf")
    assert p.returncode == 1 and "not found" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("which, kind", [("random", "dspark"), ("random-dflash", "dflash")])
def test_run_with_a_random_draft_is_llama_greedy(which, kind, target_path, llama_refs, tmp_path):
    prompt_text = "The capital of France is"
    cache = tmp_path / "cache"
    args = ["run", "-m", target_path, "-md", which, "-p", prompt_text, "--raw", "-n", "16", "--temp", "0",
            "-t", "1", "-c", "512", "--json"]
    if "off" in _cli("run", "--help").stdout.split("--schedule", 1)[-1].split("\n", 1)[0]:
        args += ["--schedule", "off"]          # verify every drafted token (the fixed-block path)
    p = _cli(*args, env={"PYLLAMA_DSPARK_CACHE": str(cache)})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    prompt = llama_refs.llm.tokenize(prompt_text.encode(), add_bos=True, special=True)
    assert out["tokens"] == llama_refs.greedy(prompt, 16)
    assert out["stats"]["drafted"] > 0 and out["stats"]["n_prompt"] == len(prompt)
    written = list(cache.glob(f"random-{kind}-*.gguf"))
    assert len(written) == 1, list(cache.iterdir())
    from pyllama_dspark.gguf.info import read_draft_info

    assert read_draft_info(str(written[0])).kind == kind


def test_inspect_describes_a_target_and_what_a_draft_must_match(target_path, tmp_path):
    import re

    from pyllama_dspark.decode.api import Speculator
    from pyllama_dspark.gguf.testing import make_test_draft

    p = _cli("inspect", target_path)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    r = gguf.GGUFReader(target_path)
    n_layer, n_embd = int(_field(r, "llama.block_count")), int(_field(r, "llama.embedding_length"))
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    assert "arch:             llama (llama.cpp captures its layer inputs)" in out, out
    assert f"{n_layer} x (n_embd {n_embd}" in out and f"{n_vocab} tokens" in out, out
    assert "memory:           attention KV cache" in out
    hi = int(re.search(r"layer-input ids in 0\.\.(\d+)", out).group(1))
    assert f"hidden width:     n_embd {n_embd}" in out
    # the stated bound is the real one: llama.cpp drafts with a draft reading layer `hi`, and one
    # reading `hi + 1` is refused (a clear error, before llama.cpp could abort)
    ok = make_test_draft(target_path, tmp_path / "top.gguf", n_layers=1, target_layers=[0, hi])
    with Speculator(target_path, str(ok), n_ctx=256, n_threads=1) as sp:
        assert len(sp.generate("Hi", max_tokens=4).tokens) == 4
    past = make_test_draft(target_path, tmp_path / "past.gguf", n_layers=1, target_layers=[0, hi + 1])
    p = _cli("inspect", past, "--target", target_path)
    assert p.returncode == 1 and "INCOMPATIBLE" in p.stdout, (p.stdout, p.stderr)


def test_inspect_says_why_no_draft_runs_on_a_target(tmp_path):
    from pyllama_dspark.gguf.target_writer import make_test_target

    t = make_test_target(tmp_path / "g3.gguf", "gemma3")
    p = _cli("inspect", t)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "NO layer-input capture" in p.stdout and "none can run on this target" in p.stdout, p.stdout
    assert "a DFlash/DSpark draft for it must have" not in p.stdout
