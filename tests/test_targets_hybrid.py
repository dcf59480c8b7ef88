"""The hybrid random-weight targets (``pyllama_dspark.gguf.target_hybrid``): attention mixed with a
recurrent state (LFM2 short convolutions, Qwen3.5 / Qwen3-Next Gated DeltaNet, Nemotron-H Mamba-2).

Per architecture, at the default depth and a 4096-token vocabulary: llama.cpp loads the file and
reports it hybrid, the layer pattern in the metadata has both kinds at least twice, the recurrence
parameters are sane (decays negative), greedy decoding through llama-cpp-python's ``Llama`` is finite
and deterministic, ``make_test_draft --target`` makes a draft the pairing check accepts (or, for a
hybrid DSpark cannot draft on yet, refuses with the --no-draft advice), and the MoE ones route by
clear margins."""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark.gguf.target_archs import ARCH_SPECS
from pyllama_dspark.gguf.target_hybrid import HYBRID_TARGET_ARCHS, layer_kinds
from pyllama_dspark.gguf.target_writer import make_test_target, plan_test_target

N_VOCAB = 4096
N_GEN = 16


@pytest.fixture(scope="module", params=HYBRID_TARGET_ARCHS)
def hybrid(request, tmp_path_factory):
    from llama_cpp import Llama

    arch = request.param
    d = tmp_path_factory.mktemp(f"hybrid-{arch}")
    target = make_test_target(d / "target.gguf", arch, n_vocab=N_VOCAB, seed=3, vocab_type="f32")
    llm = Llama(model_path=str(target), n_ctx=256, n_batch=64, n_threads=1, n_threads_batch=1, logits_all=True,
                verbose=False)
    yield arch, str(target), d, llm
    llm.close()


def test_the_hybrid_archs_are_target_archs():
    for arch in HYBRID_TARGET_ARCHS:
        spec = ARCH_SPECS[arch]
        assert spec.hybrid and spec.layer_inputs and not spec.swa, spec
        kinds = layer_kinds(arch, spec.n_layer)
        assert kinds.count("attn") >= 2 and kinds.count("recr") >= 2, (arch, kinds)
    assert {a for a, s in ARCH_SPECS.items() if s.hybrid} == set(HYBRID_TARGET_ARCHS)


def test_llama_cpp_loads_it_as_a_hybrid(hybrid):
    import llama_cpp

    arch, _, _, llm = hybrid
    assert llama_cpp.llama_model_is_hybrid(llm.model), arch
    assert not llama_cpp.llama_model_is_recurrent(llm.model), arch
    assert llm.n_vocab() == N_VOCAB and llm.tokenize(b"hi", add_bos=False)


def test_the_metadata_marks_the_layer_kinds(hybrid):
    from pyllama_dspark.gguf.reader import field_value, read_gguf

    arch, target, _, _ = hybrid
    r = read_gguf(target, use_cache=False)
    a = field_value(r, "general.architecture")
    kinds = layer_kinds(arch, ARCH_SPECS[arch].n_layer)
    names = {t.name for t in r.tensors}
    if arch in ("lfm2", "nemotron_h"):     # attention: head_count_kv > 0 (nemotron_h MLP: feed_forward_length > 0)
        assert [k > 0 for k in field_value(r, f"{a}.attention.head_count_kv")] == [k == "attn" for k in kinds]
    else:
        assert field_value(r, f"{a}.attention.recurrent_layers") == [k == "recr" for k in kinds]
    if arch == "nemotron_h":
        assert [k > 0 for k in field_value(r, f"{a}.feed_forward_length")] == [k == "mlp" for k in kinds]
    assert ("token_embd_norm.weight" in names) == (arch == "lfm2") != ("output_norm.weight" in names)
    for il, kind in enumerate(kinds):
        assert (f"blk.{il}.attn_k.weight" in names) == (kind == "attn"), (arch, il)
    for t in r.tensors:
        if t.name.endswith(".ssm_a"):     # state decay exp(dt * A) < 1
            assert (np.asarray(t.data) < 0).all(), t.name


def test_greedy_decoding_is_finite_and_deterministic(hybrid):
    arch, _, _, llm = hybrid
    runs = []
    for _ in range(2):
        llm.reset()
        out = llm.create_completion("hello", max_tokens=N_GEN, temperature=0.0)
        scores = np.array(llm.scores[: llm.n_tokens])
        assert out["usage"]["completion_tokens"] == N_GEN, arch
        assert np.isfinite(scores).all(), arch
        assert 0.5 < float(scores.std(axis=1).min()) and float(np.abs(scores).max()) < 50, arch
        runs.append((out["choices"][0]["text"], scores))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_make_test_draft_pairs_with_it(hybrid):
    from pyllama_dspark.gguf import layer_inputs
    from pyllama_dspark.gguf.info import read_draft_info, validate_pair
    from pyllama_dspark.gguf.target_info import read_target_info
    from pyllama_dspark.gguf.testing import make_test_draft

    arch, target, d, _ = hybrid
    draft = make_test_draft(target, d / "draft.gguf", kind="dspark", seed=5)
    t = read_target_info(target, use_cache=False)
    assert t.arch == ARCH_SPECS[arch].gguf_arch and t.n_layer == ARCH_SPECS[arch].n_layer
    d = read_draft_info(draft, use_cache=False)
    assert t.arch in layer_inputs.DRAFTING_HYBRID_ARCHS
    validate_pair(d, t)   # raises on a mismatch


@pytest.mark.parametrize("arch", HYBRID_TARGET_ARCHS)
def test_plans_refuse_what_the_loader_would(arch):
    with pytest.raises(ValueError, match="n_layer"):
        plan_test_target(arch, n_layer=1, n_vocab=N_VOCAB)
    gguf_arch, meta, plan = plan_test_target(arch, n_vocab=N_VOCAB, n_layer=2)
    assert gguf_arch == ARCH_SPECS[arch].gguf_arch and any(t.name.startswith("blk.1.") for t in plan)


def test_lfm2_needs_square_attention():
    with pytest.raises(ValueError, match="n_head \\* head_dim"):
        plan_test_target("lfm2", n_vocab=N_VOCAB, head_dim=16)


@pytest.mark.parametrize("arch", [a for a in HYBRID_TARGET_ARCHS if ARCH_SPECS[a].moe])
def test_moe_hybrids_route_by_clear_margins(arch, tmp_path):
    from pyllama_dspark.gguf.router_margins import router_margins

    target = make_test_target(tmp_path / "t.gguf", arch, n_vocab=N_VOCAB, seed=3, vocab_type="f32")
    margins = router_margins(target, list(range(100, 132)), n_threads=1)
    assert sorted(margins) == list(range(ARCH_SPECS[arch].n_layer))
    assert min(float(m.min()) for m in margins.values()) > 2.0, margins
