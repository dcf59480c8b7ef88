"""Which target architectures can expose their layer inputs to a DFlash/DSpark draft, and which
layer-input ids are valid on them (file:line references: the llama.cpp tree named in
:mod:`pyllama_dspark.gguf.info`).

Valid ids: ``llama_context`` sizes the capture flags as ``n_layer() + 1``
(src/llama-context.cpp:126) and ``set_embeddings_layer_inp`` asserts ``lid <= n_layer()``
(src/llama-context.cpp:1240), so an id above ``n_layer`` aborts at once (hazard 2).  Id
``n_layer`` is accepted there, but the graph must then fill ``t_layer_inp[n_layer]`` or
``llm_graph_result::set_outputs`` asserts on the first decode (src/llama-graph.cpp:1384,
hazard 1); only the deepseek4, mimo2 and nemotron-h graphs do (src/models/deepseek4.cpp:1329,
src/models/mimo2.cpp:238, src/models/nemotron-h.cpp:238).

Which architectures
-------------------
Determined by reading the sources: ``extract_layer_inputs`` (src/llama-context.cpp:2278-2309)
copies ``res->get_layer_inp(il)`` for each enabled id and aborts when the tensor is missing, and
it asserts that one row is exactly ``n_embd`` floats (src/llama-context.cpp:2298).  The only
writers of ``res->t_layer_inp`` are graph builders in ``src/models/*.cpp`` (``grep t_layer_inp``;
no shared base builder writes it).  Mapping each of those graph classes back to its
architectures through ``llama_model_mapping`` (src/llama-model.cpp:45-348), the ``using graph =
...`` aliases in src/models/models.h and the arch names in src/llama-arch.cpp gives
:data:`LAYER_INPUT_ARCHS`.  Left out on purpose: ``qwen4exp`` (its layer input is the
hyper-connection stack, ``n_embd * hc`` wide, so the row-width assert fires,
src/models/qwen4exp.cpp:398 with hc > 1 required at :52) and ``llama-embed`` (an embedding model
without KV cache, never a generation target).  Every other architecture (gpt2, phi3, gemma3,
qwen2, mistral3, ...) leaves ``t_layer_inp`` empty and enabling capture aborts llama.cpp.
"""

from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["LAYER_INPUT_ARCHS", "FINAL_LAYER_INPUT_ARCHS", "HYBRID_ARCHS", "DRAFTING_HYBRID_ARCHS",
           "unsupported_arch_message", "unsupported_hybrid_message"]

#: Target architectures whose llama.cpp graph fills ``t_layer_inp[0..n_layer-1]`` with
#: ``n_embd``-wide rows (see the module docstring for how this was determined):
#: graph class (src/models/<file>.cpp:<line of the t_layer_inp store>) -> arch names.
_LAYER_INPUT_SOURCES: Dict[str, Tuple[str, ...]] = {
    "llama.cpp:127": ("llama",),
    "qwen3.cpp:72": ("qwen3",),
    "qwen3moe.cpp:81": ("qwen3moe",),
    "qwen3next.cpp:153": ("qwen3next",),
    "qwen35.cpp:156": ("qwen35",),
    "qwen35moe.cpp:179": ("qwen35moe",),
    "gemma4.cpp:196": ("gemma4",),
    "deepseek4.cpp:1240": ("deepseek4",),
    "mimo2.cpp:109": ("mimo2",),
    "nemotron-h.cpp:205": ("nemotron_h", "nemotron_h_moe"),  # models.h:1549 graph alias
    "hunyuan-vl.cpp:86": ("hunyuan_vl", "hunyuan-dense"),  # models.h:2111 graph alias
    "lfm2.cpp:252": ("lfm2", "lfm2moe"),  # models.h:2176 graph alias
    "openai-moe.cpp:76": ("gpt-oss",),
    "minimax-01.cpp:242": ("minimax-01",),
    "minimax-m2.cpp:63": ("minimax-m2",),
    "muse-glimmer.cpp:80": ("muse-glimmer",),
    "nanbeige.cpp:106": ("nanbeige",),
    "bailingmoe3.cpp:253": ("bailingmoe3",),
}

LAYER_INPUT_ARCHS: frozenset = frozenset(a for archs in _LAYER_INPUT_SOURCES.values() for a in archs)

#: Architectures whose graph also fills ``t_layer_inp[n_layer]`` (the last layer's output)
#: when it is enabled, so for them a target layer id equal to ``n_layer`` is valid.
FINAL_LAYER_INPUT_ARCHS: frozenset = frozenset({"deepseek4", "mimo2", "nemotron_h", "nemotron_h_moe"})


def unsupported_arch_message(arch: str, name: str) -> str:
    """Why a target of ``arch`` (file ``name``) cannot run a DFlash/DSpark draft."""
    return (f"{name}: target architecture {arch!r} cannot expose layer inputs to a DFlash/DSpark draft "
            f"(its llama.cpp graph does not fill them; enabling capture would abort). Supported: "
            f"{', '.join(sorted(LAYER_INPUT_ARCHS))}")


#: Architectures among :data:`LAYER_INPUT_ARCHS` whose memory also holds a recurrent state (Gated
#: DeltaNet, Mamba-2, short convolutions, lightning attention, DeepSeek-V4's compressed state): a
#: rejected draft tail is undone by llama.cpp's recurrent-state snapshots (``n_rs_seq``), which
#: ``llm_arch_supports_rs_rollback`` (src/llama-arch.cpp) grants to all of them but qwen3next and
#: minimax-01.
HYBRID_ARCHS: frozenset = frozenset({"qwen3next", "qwen35", "qwen35moe", "deepseek4", "nemotron_h",
                                     "nemotron_h_moe", "lfm2", "lfm2moe", "minimax-01", "bailingmoe3"})

#: The hybrids DSpark drafts on, tested losslessly on random targets of the arch (docs/targets.md):
#: snapshot rollback, and for qwen3next checkpoints of its state.  The other hybrids run without a draft.
DRAFTING_HYBRID_ARCHS: frozenset = frozenset({"qwen35", "qwen35moe", "nemotron_h", "lfm2", "qwen3next"})


def unsupported_hybrid_message(arch: str, name: str) -> str:
    """Why a hybrid target of ``arch`` (file ``name``) runs without a draft."""
    return (f"{name}: target architecture {arch!r} keeps a recurrent state that pyllama-dspark cannot yet roll "
            f"back after a rejected draft, so it runs without a draft only (--no-draft). Hybrids that draft: "
            f"{', '.join(sorted(DRAFTING_HYBRID_ARCHS))} (docs/targets.md)")
