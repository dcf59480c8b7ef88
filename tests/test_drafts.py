"""Random DFlash/DSpark drafts: they load and run in llama.cpp, and the metadata checks catch
every draft/target mismatch that would otherwise abort llama.cpp.

Everything here runs on the real target (SmolLM2-135M-Instruct Q4_1).  Only drafts that passed
``validate_pair`` are ever handed to llama.cpp: the broken ones would kill the test process.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from pyllama_dspark.gguf import info as gi
from pyllama_dspark.gguf import layer_inputs as gl
from pyllama_dspark.gguf import reader as gr
from pyllama_dspark.gguf import target_info as gt
from pyllama_dspark.errors import DraftMismatchError, ModelFileError, UnsupportedArchError
from pyllama_dspark.gguf.report import format_draft_info
from pyllama_dspark.gguf.testing import default_target_layers, make_test_draft, pick_mask_token_id

SMOLLM2_LAYERS = 30
SMOLLM2_EMBD = 576
SMOLLM2_VOCAB = 49152


def _small(target_path, path, overrides=None, **kw):
    """A small draft (1 layer, n_ff 64, rank 8): the metadata checks do not depend on the weights."""
    args = dict(n_layers=1, markov_rank=8)
    args.update(kw)
    ov = {"@n_ff": 64}
    ov.update(overrides or {})
    return make_test_draft(target_path, path, overrides=ov, **args)


_BROKEN = {
    "no_block_size": dict(overrides={"dflash.block_size": None}),
    "n_embd_512": dict(overrides={"@n_embd": 512}),
    "fc_f16": dict(fc_type="f16"),
}


@pytest.fixture(scope="module")
def broken_draft(target_path, tmp_path_factory):
    """broken_draft(name) -> path of a small broken draft from _BROKEN, written once per module."""
    made = {}
    base = tmp_path_factory.mktemp("broken")

    def get(name):
        if name not in made:
            made[name] = _small(target_path, base / f"{name}.gguf", **_BROKEN[name])
        return made[name]

    return get


# --------------------------------------------------------------------------------------------
# llama.cpp, low level
# --------------------------------------------------------------------------------------------

def _staging(name, argtypes, restype):
    """A staging C++ API function of libllama (src/llama-ext.h) by its mangled name."""
    import llama_cpp

    fn = getattr(llama_cpp.llama_cpp._lib, name)
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def run_draft_in_llama(target_path, draft_path, prompt=b"The capital of France is", anchor=None):
    """Load target + draft with llama-cpp-python's low-level bindings and run one DSpark cycle's
    draft side: capture the target's layer inputs while decoding ``prompt``, inject them into the
    draft, decode the block [anchor, mask x (B-1)] with every row flagged as output.

    Returns a dict with the ids llama.cpp loaded, the features, the B logits rows and the
    confidence rows (nextn output).
    """
    import llama_cpp as L

    vp, c_u32, c_bool = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool
    f32p = ctypes.POINTER(ctypes.c_float)
    set_layer_inp = _staging("_Z30llama_set_embeddings_layer_inpP13llama_contextjb", [vp, c_u32, c_bool], None)
    get_layer_inp = _staging("_Z30llama_get_embeddings_layer_inpP13llama_contextj", [vp, c_u32], f32p)
    set_nextn = _staging("_Z26llama_set_embeddings_nextnP13llama_contextbb", [vp, c_bool, c_bool], None)
    get_nextn = _staging("_Z26llama_get_embeddings_nextnP13llama_context", [vp], f32p)
    ids_ptr = _staging("_Z28llama_model_target_layer_idsPK11llama_model", [vp], ctypes.POINTER(ctypes.c_int32))
    ids_n = _staging("_Z30llama_model_target_layer_ids_nPK11llama_model", [vp], c_u32)

    info = gi.read_draft_info(draft_path)
    tinfo = gt.read_target_info(target_path)
    gi.validate_pair(info, tinfo)  # never hand llama.cpp a draft that would abort it

    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    tmodel = dmodel = tctx = dctx = batch = None
    out = {}
    try:
        tmodel = L.llama_model_load_from_file(os.fsencode(target_path), mparams)
        assert tmodel, "target failed to load"
        dmodel = L.llama_model_load_from_file(os.fsencode(draft_path), mparams)
        assert dmodel, "draft failed to load"
        n = ids_n(dmodel)
        out["llama_ids"] = [ids_ptr(dmodel)[i] for i in range(n)]
        out["has_encoder"] = bool(L.llama_model_has_encoder(dmodel))
        out["llama_mask"] = int(L.llama_vocab_mask(L.llama_model_get_vocab(dmodel)))

        def ctx_params():
            p = L.llama_context_default_params()
            p.n_ctx = p.n_batch = p.n_ubatch = 256
            p.n_threads = p.n_threads_batch = 1  # fewer threads than cores: robust on a busy machine (hazard 14)
            p.no_perf = True
            return p

        tctx = L.llama_init_from_model(tmodel, ctx_params())
        assert tctx, "target context"
        for lid in info.target_layer_ids:  # before the first target decode
            set_layer_inp(tctx, lid, True)

        vocab = L.llama_model_get_vocab(tmodel)
        toks = (L.llama_token * 128)()
        n_tok = L.llama_tokenize(vocab, prompt, len(prompt), toks, 128, False, True)
        assert n_tok > 1
        assert L.llama_decode(tctx, L.llama_batch_get_one(toks, n_tok)) == 0
        d_t = L.llama_model_n_embd(tmodel)
        feats = np.concatenate(
            [np.ctypeslib.as_array(get_layer_inp(tctx, lid), shape=(n_tok * d_t,)).reshape(n_tok, d_t).copy()
             for lid in info.target_layer_ids], axis=1)
        feats = np.ascontiguousarray(feats, dtype=np.float32)
        out["features"] = feats

        dparams = ctx_params()
        dparams.ctx_other = tctx  # shares tok_embd / lm_head of the target
        dctx = L.llama_init_from_model(dmodel, dparams)
        assert dctx, "draft context"
        L.llama_set_causal_attn(dctx, info.causal)
        set_nextn(dctx, True, True)

        batch = L.llama_batch_ext_init(dctx)
        for i in range(n_tok):
            row = L.llama_embd(feats[i].ctypes.data_as(f32p), 1, feats.shape[1])
            idx = L.llama_batch_ext_add_embd(batch, 0, row)
            assert idx == i
            assert L.llama_batch_ext_set_pos(batch, idx, (L.llama_pos * 4)(i, i, i, 0))
            assert L.llama_batch_ext_set_output_logits(batch, idx, False)
        out["inject_rc"] = L.llama_process(dctx, L.LLAMA_PROCESS_TYPE_DECODE, batch)

        B = info.block_size
        anchor = int(toks[n_tok - 1]) if anchor is None else anchor
        L.llama_batch_ext_clear(batch)
        for k in range(B):
            idx = L.llama_batch_ext_add_token(batch, 0, anchor if k == 0 else info.mask_token_id)
            assert idx == k
            p = n_tok + k
            assert L.llama_batch_ext_set_pos(batch, idx, (L.llama_pos * 4)(p, p, p, 0))
            assert L.llama_batch_ext_set_output_logits(batch, idx, True)  # every row (hazard 7)
        out["block_rc"] = L.llama_process(dctx, L.LLAMA_PROCESS_TYPE_DECODE, batch)

        n_vocab = L.llama_vocab_n_tokens(vocab)
        rows = []
        for k in range(B):
            ptr = L.llama_get_logits_ith(dctx, k)
            assert ptr, f"no logits for block row {k}"  # NULL would segfault (hazard 6)
            rows.append(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy())
        out["logits"] = np.stack(rows)
        d_d = L.llama_model_n_embd(dmodel)
        conf = get_nextn(dctx)
        out["conf"] = (np.ctypeslib.as_array(conf, shape=(B * d_d,)).reshape(B, d_d).copy()
                       if conf else None)
    finally:
        if batch is not None:
            L.llama_batch_ext_free(batch)
        if dctx:
            L.llama_free(dctx)
        if tctx:
            L.llama_free(tctx)
        if dmodel:
            L.llama_model_free(dmodel)
        if tmodel:
            L.llama_model_free(tmodel)
    return out


def _check_run(out, info):
    assert out["llama_ids"] == list(info.target_layer_ids), \
        "llama_model_target_layer_ids must return dflash.target_layers unchanged"
    assert out["has_encoder"]  # hazard 13
    assert out["llama_mask"] == info.mask_token_id
    feats = out["features"]
    assert feats.shape[1] == info.n_embd_inp_enc
    assert np.isfinite(feats).all() and np.abs(feats).max() > 1.0
    assert out["inject_rc"] == 0 and out["block_rc"] == 0
    logits = out["logits"]
    assert logits.shape == (info.block_size, info.n_vocab)
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 0.1).all(), "degenerate (flat) logits"


def test_dspark_draft_runs_in_llama_cpp(target_path, dspark_draft_path):
    info = gi.read_draft_info(dspark_draft_path)
    out = run_draft_in_llama(target_path, dspark_draft_path)
    _check_run(out, info)
    conf = out["conf"]
    assert conf is not None and conf.shape[0] == info.block_size
    c = conf[:, 0]
    assert np.isfinite(c).all() and ((c > 0) & (c < 1)).all(), c
    assert (conf == conf[:, :1]).all(), "confidence is broadcast over n_embd-wide rows"
    assert np.ptp(c) > 0, "confidence differs between block positions"


def test_dflash_draft_runs_in_llama_cpp(target_path, dflash_draft_path):
    info = gi.read_draft_info(dflash_draft_path)
    out = run_draft_in_llama(target_path, dflash_draft_path)
    _check_run(out, info)
    # without the Markov head the block rows come straight from the lm_head: rows differ
    assert not np.allclose(out["logits"][1], out["logits"][2])


@pytest.mark.parametrize("fc_type", ["bf16", "q8_0"])
def test_quantized_fc_draft_runs(target_path, tmp_path, fc_type):
    p = make_test_draft(target_path, tmp_path / f"fc-{fc_type}.gguf", kind="dspark", n_layers=1,
                        block_size=4, markov_rank=16, fc_type=fc_type, seed=3, overrides={"@n_ff": 256})
    info = gi.read_draft_info(p)
    assert info.fc_type == fc_type.upper() and not info.problems
    assert info.block_size == 4 and info.markov_rank == 16 and info.n_layer == 1
    _check_run(run_draft_in_llama(target_path, p), info)


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------

def test_read_target_info(target_path):
    t = gt.read_target_info(target_path)
    assert (t.arch, t.n_embd, t.n_layer, t.n_vocab) == ("llama", SMOLLM2_EMBD, SMOLLM2_LAYERS, SMOLLM2_VOCAB)
    assert t.supports_layer_inputs and not t.accepts_final_layer_id
    assert t.max_layer_id == SMOLLM2_LAYERS - 1 and list(t.valid_layer_ids) == list(range(30))
    assert t.tokenizer_model == "gpt2" and len(t.tokenizer_fingerprint) == 64
    assert (t.n_head, t.n_head_kv, t.head_dim, t.n_ff) == (9, 3, 64, 1536)


def test_read_dspark_draft_info(target_path, dspark_draft_path):
    d = gi.read_draft_info(dspark_draft_path)
    t = gt.read_target_info(target_path)
    assert d.arch == "dflash" and d.kind == "dspark"
    assert d.block_size == 7 and d.max_drafts == 7
    assert d.target_layers_raw == d.target_layer_ids == tuple(default_target_layers(SMOLLM2_LAYERS))
    assert d.target_layers_hf == tuple(i - 1 for i in d.target_layers_raw)
    assert all(1 <= i <= SMOLLM2_LAYERS - 2 for i in d.target_layer_ids) and len(d.target_layer_ids) == 5
    assert d.has_markov and d.markov_rank == 32 and d.has_confidence_head and d.has_conf_bias
    assert d.sample_from_anchor and d.sample_from_anchor_key is True
    assert not d.causal and d.causal_key is False
    assert d.mask_token_id == 16 == pick_mask_token_id(gr.read_gguf(target_path))
    assert (d.n_embd, d.n_layer, d.n_vocab, d.n_vocab_draft) == (SMOLLM2_EMBD, 2, SMOLLM2_VOCAB, SMOLLM2_VOCAB)
    assert d.fc_type == "F32" and d.fc_shape == (5 * SMOLLM2_EMBD, SMOLLM2_EMBD) and not d.fc_is_f16
    assert d.n_embd_inp_enc == 5 * SMOLLM2_EMBD
    assert d.rope_type == "neox" and d.rope_freq_base == t.rope_freq_base
    assert not d.has_own_lm_head and not d.has_d2t and not d.problems
    assert d.tokenizer_fingerprint == t.tokenizer_fingerprint
    # the whole tokenizer (merges, chat template, special ids) is copied from the target
    rd, rt = gr.read_gguf(dspark_draft_path), gr.read_gguf(target_path)
    for key in rt.fields:
        if key.startswith("tokenizer."):
            assert gr.field_value(rd, key) == gr.field_value(rt, key), key
    assert gi.validate_pair(d, t) == []


def test_read_dflash_draft_info(target_path, dflash_draft_path):
    d = gi.read_draft_info(dflash_draft_path)
    assert d.kind == "dflash" and not d.has_markov and d.markov_rank == 0
    assert not d.has_confidence_head and d.confidence_key is None
    assert d.sample_from_anchor and d.sample_from_anchor_key is None  # llama.cpp's default
    assert d.max_drafts == d.block_size - 1 == 6
    t = gt.read_target_info(target_path)
    assert d.target_layer_ids == tuple(default_target_layers(SMOLLM2_LAYERS)) and d.mask_token_id == 16
    assert (d.n_embd, d.n_layer, d.n_vocab, d.fc_type) == (SMOLLM2_EMBD, 2, SMOLLM2_VOCAB, "F32")
    assert d.tokenizer_fingerprint == t.tokenizer_fingerprint and d.rope_freq_base == t.rope_freq_base
    assert not d.problems
    assert gi.validate_pair(d, t) == []      # a sound pair: no warning at all


def test_default_target_layers_are_valid():
    for n_layer in range(1, 80):
        ids = default_target_layers(n_layer)
        assert ids and ids == sorted(set(ids))
        assert all(0 <= i <= n_layer - 1 for i in ids), (n_layer, ids)
    assert default_target_layers(36) == [2, 10, 18, 26, 34]  # = Qwen3-8B DFlash HF ids [1,9,17,25,33] + 1


def test_format_draft_info(target_path, dspark_draft_path, broken_draft):
    d, t = gi.read_draft_info(dspark_draft_path), gt.read_target_info(target_path)
    text = format_draft_info(d, t)
    assert "dspark" in text and "block_size:       7" in text and "rank 32" in text
    assert "[2, 9, 15, 22, 28]" in text and "compatible" in text and "INCOMPATIBLE" not in text
    assert "target:" not in format_draft_info(d)
    bad = gi.read_draft_info(broken_draft("fc_f16"))
    text = format_draft_info(bad, t)
    assert "PROBLEM" in text and "INCOMPATIBLE" in text and "F16" in text


# --------------------------------------------------------------------------------------------
# broken files and mismatches
# --------------------------------------------------------------------------------------------

def test_bad_files_raise_model_file_error(tmp_path, dspark_draft_path):
    with pytest.raises(ModelFileError, match="not found"):
        gr.read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ModelFileError, match="directory"):
        gi.read_draft_info(tmp_path)
    (tmp_path / "text.gguf").write_bytes(b"this is not a gguf file\n" * 4)
    with pytest.raises(ModelFileError, match="magic"):
        gt.read_target_info(tmp_path / "text.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty"):
        gr.read_gguf(tmp_path / "empty.gguf")

    size = os.path.getsize(dspark_draft_path)
    reader = gr.read_gguf(dspark_draft_path)
    last_end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    # cut inside the metadata, inside the tensor data, and inside the very last tensor
    for cut in (64, 300_000, size // 2, last_end - 2):
        p = tmp_path / f"trunc-{cut}.gguf"
        with open(dspark_draft_path, "rb") as src, open(p, "wb") as dst:
            dst.write(src.read(cut))
        with pytest.raises(ModelFileError, match="truncated"):
            gr.read_gguf(p)
    with pytest.raises(ModelFileError, match="truncated"):
        gi.read_draft_info(p)  # the info readers go through the same check


def test_target_is_not_a_draft(target_path):
    with pytest.raises(DraftMismatchError, match="'llama'.*'dflash'"):
        gi.read_draft_info(target_path)


def test_missing_block_size(broken_draft):
    p = broken_draft("no_block_size")
    with pytest.raises(DraftMismatchError, match="block_size"):
        gi.read_draft_info(p)


@pytest.mark.parametrize("key", ["dflash.target_layers", "tokenizer.ggml.mask_token_id"])
def test_missing_required_keys(target_path, tmp_path, key):
    p = _small(target_path, tmp_path / "nokey.gguf", {key: None})
    with pytest.raises(DraftMismatchError, match=key.split(".")[-1]):
        gi.read_draft_info(p)


def test_n_embd_mismatch(target_path, broken_draft):
    p = broken_draft("n_embd_512")
    d = gi.read_draft_info(p)
    assert d.n_embd == 512
    with pytest.raises(DraftMismatchError, match=r"n_embd 512.*n_embd 576"):
        gi.validate_pair(d, gt.read_target_info(target_path))


def test_vocab_size_mismatch(target_path, tmp_path):
    p = _small(target_path, tmp_path / "vocab.gguf", {"@n_vocab": 49000})
    d = gi.read_draft_info(p)
    assert d.n_vocab == 49000
    with pytest.raises(DraftMismatchError, match=r"vocabulary size 49000.*49152"):
        gi.validate_pair(d, gt.read_target_info(target_path))


def test_tokenizer_mismatch(target_path, tmp_path):
    p = _small(target_path, tmp_path / "tok.gguf", {"@perturb_token": 1000})
    d = gi.read_draft_info(p)
    t = gt.read_target_info(target_path)
    assert d.n_vocab == t.n_vocab and d.tokenizer_fingerprint != t.tokenizer_fingerprint
    with pytest.raises(DraftMismatchError, match="tokenizer"):
        gi.validate_pair(d, t)


@pytest.mark.parametrize("bad_id,pattern", [
    (SMOLLM2_LAYERS, r"id 30.*equals the target's n_layer 30"),          # hazard 1
    (SMOLLM2_LAYERS + 1, r"id 31.*out of range.*0\.\.29"),               # hazard 2
])
def test_layer_id_out_of_range(target_path, tmp_path, bad_id, pattern):
    p = _small(target_path, tmp_path / f"lid{bad_id}.gguf", target_layers=[2, 15, bad_id])
    d = gi.read_draft_info(p)
    assert d.target_layer_ids == (2, 15, bad_id)
    with pytest.raises(DraftMismatchError, match=pattern):
        gi.validate_pair(d, gt.read_target_info(target_path))


def test_last_layer_id_is_valid(target_path, tmp_path):
    p = _small(target_path, tmp_path / "lid29.gguf", target_layers=[0, SMOLLM2_LAYERS - 1])
    gi.validate_pair(gi.read_draft_info(p), gt.read_target_info(target_path))


def test_f16_fc_is_rejected(target_path, broken_draft):
    p = broken_draft("fc_f16")
    d = gi.read_draft_info(p)
    assert d.fc_type == "F16" and d.fc_is_f16 and any("F16" in x for x in d.problems)
    with pytest.raises(DraftMismatchError, match="F16"):
        gi.validate_pair(d, gt.read_target_info(target_path))


def test_half_markov_head_and_missing_confidence(target_path, tmp_path):
    p = _small(target_path, tmp_path / "now2.gguf", {"@drop_tensors": ["markov_w2.weight"]})
    with pytest.raises(DraftMismatchError, match="markov_w2"):
        gi.read_draft_info(p)
    # confidence metadata says yes but the tensor is missing: treated as no confidence head
    p = _small(target_path, tmp_path / "noconf.gguf",
               {"@drop_tensors": ["conf_proj.weight", "conf_proj.bias"]})
    d = gi.read_draft_info(p)
    assert d.confidence_key is True and not d.has_conf_tensor and not d.has_confidence_head
    warns = gi.validate_pair(d, gt.read_target_info(target_path))
    assert any("confidence" in w for w in warns)
    # and no confidence head at all
    d = gi.read_draft_info(_small(target_path, tmp_path / "noconf2.gguf", confidence=False))
    assert d.has_markov and not d.has_confidence_head and d.confidence_key is False


def _write_stub_target(path, arch, n_embd=576, n_layer=30, tokens=("a", "b", "c")):
    import gguf

    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", list(tokens))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_target_arch(target_path, dspark_draft_path, tmp_path):
    stub = _write_stub_target(tmp_path / "phi3.gguf", "phi3")
    with pytest.raises(UnsupportedArchError, match="phi3"):
        gt.read_target_info(stub)
    t = gt.read_target_info(stub, require_layer_inputs=False)
    assert not t.supports_layer_inputs and t.arch == "phi3"
    with pytest.raises(UnsupportedArchError, match="phi3"):
        gi.validate_pair(gi.read_draft_info(dspark_draft_path), t)
    # a draft is not a target either
    with pytest.raises(UnsupportedArchError, match="dflash"):
        gt.read_target_info(dspark_draft_path)
    # an arch that fills layer n_layer accepts that id
    ds = gt.read_target_info(_write_stub_target(tmp_path / "nh.gguf", "nemotron_h"))
    assert ds.accepts_final_layer_id and ds.max_layer_id == ds.n_layer == 30


def _derive_layer_input_archs(src):
    """From llama.cpp's own sources (``src`` = its src/ folder): {arch name: graph files} of the
    architectures whose graph stores ``t_layer_inp[il]``, and of those that also store
    ``t_layer_inp[n_layer]``.  Graph files -> model classes defining that graph (``X::graph``), plus
    the classes that reuse it (``using graph = X::graph`` in models/models.h) -> architectures
    (``llama_model_mapping``'s ``case LLM_ARCH_*: return new X``) -> names (``LLM_ARCH_NAMES``)."""
    import re

    models = src / "models"
    owners, final_files = {}, set()
    for f in sorted(models.glob("*.cpp")):
        text = f.read_text()
        if re.search(r"t_layer_inp\[il\]\s*=", text):
            owners[f.name] = set(re.findall(r"\b(llama_model_\w+)::graph\b", text))
        if re.search(r"t_layer_inp\[n_layer\]\s*=", text):
            final_files.add(f.name)
    users, cur = {}, None
    for line in (models / "models.h").read_text().splitlines():
        m = re.match(r"\s*struct\s+(llama_model_\w+)\b", line)
        if m:
            cur = m.group(1)
        m = re.search(r"using\s+graph\s*=\s*(llama_model_\w+)::graph", line)
        if m and cur:
            users.setdefault(m.group(1), set()).add(cur)
    mapping = (src / "llama-model.cpp").read_text()
    body = mapping[mapping.index("llama_model_mapping("):]
    body = body[:body.index("\n}\n")]
    cls_arch, pending = {}, []
    for line in body.splitlines():
        m = re.match(r"\s*case\s+(LLM_ARCH_\w+)\s*:", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r"return\s+new\s+(llama_model_\w+)\s*\(", line)
        if m:
            for a in pending:
                cls_arch.setdefault(m.group(1), set()).add(a)
            pending = []
    names = dict(re.findall(r"\{\s*(LLM_ARCH_\w+)\s*,\s*\"([^\"]+)\"\s*\}", (src / "llama-arch.cpp").read_text()))

    def archs(fnames):
        out = {}
        for fn in fnames:
            for owner in owners.get(fn, ()):
                for cls in {owner} | users.get(owner, set()):
                    for a in cls_arch.get(cls, ()):
                        out.setdefault(names[a], set()).add(fn)
        return out

    return archs(owners), archs(final_files)


def test_layer_input_arch_table_matches_llama_cpp_sources():
    """The table of targets that can feed a draft, re-derived from the vendored llama.cpp sources
    (the llama-server build's copy): every architecture whose graph writes the layer inputs is in
    it, except the two left out on purpose, and nothing else is; the same for the final-layer
    table; and every ``file:line`` the table cites is such a store."""
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server
    from pyllama_dspark.upstream.llama_server_sdist import llama_server_cache_dir

    ensure_llama_server()     # also extracts llama.cpp's sources into the cache
    src = llama_server_cache_dir() / "src" / "src"
    assert (src / "models" / "models.h").is_file(), f"llama.cpp sources not found under {src}"
    derived, final = _derive_layer_input_archs(src)
    assert {"llama", "qwen3", "gemma4", "nemotron_h", "gpt-oss"} <= set(derived)   # the parser works
    on_purpose = {"qwen4exp", "llama-embed"}     # hyper-connection rows n_embd * hc wide; no KV cache
    assert on_purpose <= set(derived)
    assert set(derived) - on_purpose == gl.LAYER_INPUT_ARCHS
    assert set(final) == gl.FINAL_LAYER_INPUT_ARCHS <= gl.LAYER_INPUT_ARCHS
    for where, archs in gl._LAYER_INPUT_SOURCES.items():
        fname, line = where.split(":")
        text = (src / "models" / fname).read_text().splitlines()[int(line) - 1]
        assert "t_layer_inp[il]" in text, (where, text)
        assert all(fname in derived[a] for a in archs), where
    for arch in ("gpt2", "phi3", "qwen2", "gemma3", "dflash"):
        assert arch not in gl.LAYER_INPUT_ARCHS


# --------------------------------------------------------------------------------------------
# the guards are needed: what validate_pair rejects really aborts llama.cpp (in a subprocess)
# --------------------------------------------------------------------------------------------

_ABORT_SCRIPT = r"""
import ctypes, sys
import llama_cpp as L
target, case, draft = sys.argv[1], sys.argv[2], sys.argv[3]
L.llama_backend_init()
mp = L.llama_model_default_params()
tm = L.llama_model_load_from_file(target.encode(), mp)
cp = L.llama_context_default_params()
cp.n_ctx = cp.n_batch = cp.n_ubatch = 64
cp.n_threads = cp.n_threads_batch = 1
tc = L.llama_init_from_model(tm, cp)
if case.startswith("layer"):
    f = getattr(L.llama_cpp._lib, "_Z30llama_set_embeddings_layer_inpP13llama_contextjb")
    f.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool]
    f.restype = None
    f(tc, int(case[5:]), True)
    toks = (L.llama_token * 2)(1, 2)
    print("decode rc", L.llama_decode(tc, L.llama_batch_get_one(toks, 2)), flush=True)
else:
    dm = L.llama_model_load_from_file(draft.encode(), mp)
    print("draft model loaded", bool(dm), flush=True)
    dp = L.llama_context_default_params()
    dp.n_ctx = dp.n_batch = dp.n_ubatch = 64
    dp.ctx_other = tc
    print("draft context", bool(L.llama_init_from_model(dm, dp)), flush=True)
print("SURVIVED", flush=True)
"""


@pytest.mark.parametrize("case", ["layer_eq_n_layer", "layer_gt_n_layer", "no_block_size", "n_embd_512"])
def test_rejected_pairs_abort_llama_cpp(target_path, broken_draft, case):
    import signal
    import subprocess
    import sys

    draft = "-"
    if case == "layer_eq_n_layer":
        arg, expect = f"layer{SMOLLM2_LAYERS}", "layer input tensor is null"            # hazard 1
    elif case == "layer_gt_n_layer":
        arg, expect = f"layer{SMOLLM2_LAYERS + 1}", "lid <= model.hparams.n_layer()"    # hazard 2
    elif case == "no_block_size":
        arg, expect = "draft", "dflash.block_size"                                        # hazard 4
        draft = broken_draft("no_block_size")
        with pytest.raises(DraftMismatchError):
            gi.read_draft_info(draft)
    else:
        arg, expect = "draft", "GGML_ASSERT"                                              # hazard 5
        draft = broken_draft("n_embd_512")
        with pytest.raises(DraftMismatchError):
            gi.validate_pair(gi.read_draft_info(draft), gt.read_target_info(target_path))
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    proc = subprocess.run([sys.executable, "-c", _ABORT_SCRIPT, target_path, arg, os.fspath(draft)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert "SURVIVED" not in proc.stdout
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert expect in proc.stderr
