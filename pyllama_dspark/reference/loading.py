"""Loading the draft's weights (and, where the draft lacks them, the target's token embedding and
lm_head, mirroring llama.cpp's ``ctx_other``) into a
:class:`~pyllama_dspark.reference.model.DraftReference`, and building its
:class:`~pyllama_dspark.reference.config.DraftConfig`."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from pyllama_dspark.reference.config import DraftConfig, read_hparams
from pyllama_dspark.reference.gguf_tensors import tensor_scalar

__all__ = ["WeightLoading"]


class WeightLoading:
    """Mixin of :class:`~pyllama_dspark.reference.model.DraftReference`: ``_load`` reads
    ``self.draft`` (and ``self.target``, a GGUFFile or None) into ``cfg``, ``tok_embd``, ``head`` /
    ``head_s``, ``d2t``, ``fc`` / ``fc_s``, ``enc_norm``, ``out_norm``, ``rope_freqs``, ``layers``
    (one dict of tensors per layer), ``w1``, ``w2`` / ``w2_s``, ``conf_w`` / ``conf_b``."""

    def _load(self, causal: Optional[bool]) -> None:
        d = self.draft
        hp = read_hparams(d, causal)
        n_embd, n_layer, target_layers = hp["n_embd"], hp["n_layer"], hp["target_layers"]

        # --- shared embeddings / lm_head (ctx_other) ------------------------------------------
        if d.has("token_embd.weight"):
            self.tok_embd = d.get("token_embd.weight")
        else:
            if self.target is None:
                raise ValueError("draft has no token_embd.weight: pass the target GGUF")
            self.tok_embd = self.target.get("token_embd.weight")
        if d.has("output.weight"):
            self.head, self.head_s = d.get("output.weight"), d.opt("output.scale")
        elif d.has("token_embd.weight"):
            # the draft's tok_embd duplicated as its own head (llama_model_dflash::load_arch_tensors)
            self.head, self.head_s = d.get("token_embd.weight"), None
        else:
            if self.target is None:
                raise ValueError("draft has no lm_head: pass the target GGUF")
            t = self.target
            if t.has("output.weight"):
                self.head, self.head_s = t.get("output.weight"), t.opt("output.scale")
            else:  # tied embeddings: the target's loader duplicates token_embd as its output
                self.head, self.head_s = t.get("token_embd.weight"), None

        self.d2t = d.get("d2t").data.astype(np.int64).reshape(-1) if d.has("d2t") else None
        n_vocab_draft = int(self.head.data.shape[0])
        if self.d2t is not None:
            if self.d2t.size != n_vocab_draft:
                raise ValueError("d2t size != lm_head rows")
            toks = d.field("tokenizer.ggml.tokens", None)
            n_vocab = len(toks) if toks is not None else int(self.tok_embd.data.shape[0])
        else:
            n_vocab = n_vocab_draft

        # --- encoder ---------------------------------------------------------------------------
        self.fc = d.get("fc.weight")
        self.fc_s = tensor_scalar(d.opt("fc.scale"))
        self.enc_norm = d.get("enc.output_norm.weight").data.astype(np.float64)
        self.out_norm = d.get("output_norm.weight").data.astype(np.float64)
        if self.fc.data.shape != (n_embd, len(target_layers) * n_embd):
            raise ValueError(f"fc.weight shape {self.fc.data.shape} does not match "
                             f"{len(target_layers)} target layers x n_embd {n_embd}")
        rf = d.opt("rope_freqs.weight")
        self.rope_freqs = None if rf is None else rf.data.astype(np.float64).reshape(-1)

        # --- layers ----------------------------------------------------------------------------
        self.layers: List[Dict[str, Any]] = []
        for i in range(n_layer):
            p = f"blk.{i}."
            L: Dict[str, Any] = {
                "attn_norm": d.get(p + "attn_norm.weight").data.astype(np.float64),
                "wq": d.get(p + "attn_q.weight"),
                "wk": d.get(p + "attn_k.weight"),
                "wv": d.opt(p + "attn_v.weight"),
                "wo": d.get(p + "attn_output.weight"),
                "q_norm": d.get(p + "attn_q_norm.weight").data.astype(np.float64),
                "k_norm": d.get(p + "attn_k_norm.weight").data.astype(np.float64),
                "ffn_norm": d.get(p + "ffn_norm.weight").data.astype(np.float64),
                "gate": d.get(p + "ffn_gate.weight"),
                "up": d.get(p + "ffn_up.weight"),
                "down": d.get(p + "ffn_down.weight"),
            }
            for nm, tn in (("attn_post_norm", "post_attention_norm.weight"),
                           ("ffn_post_norm", "post_ffw_norm.weight")):
                t = d.opt(p + tn)
                L[nm] = None if t is None else t.data.astype(np.float64)
            L["out_scale"] = tensor_scalar(d.opt(p + "layer_output_scale.weight"))
            s = d.opt(p + "attn_sinks.weight")
            L["sinks"] = None if s is None else s.data.astype(np.float64).reshape(-1)
            for nm, tn in (("wq_s", "attn_q"), ("wk_s", "attn_k"), ("wv_s", "attn_v"),
                           ("wo_s", "attn_output"), ("gate_s", "ffn_gate"),
                           ("up_s", "ffn_up"), ("down_s", "ffn_down")):
                L[nm] = tensor_scalar(d.opt(p + tn + ".scale"))
            self.layers.append(L)

        # --- DSpark heads ----------------------------------------------------------------------
        self.w1 = d.opt("markov_w1.weight")      # numpy [n_vocab, rank]
        self.w2 = d.opt("markov_w2.weight")      # numpy [n_vocab_draft, rank]
        self.w2_s = tensor_scalar(d.opt("markov_w2.scale"))
        self.conf_w = d.opt("conf_proj.weight")  # numpy [1, n_embd + rank]
        cb = d.opt("conf_proj.bias")
        self.conf_b = None if cb is None else float(cb.data.reshape(-1)[0])
        rank = 0
        if self.w1 is not None:
            if self.w2 is None:
                raise ValueError("markov_w1 without markov_w2")
            rank = int(self.w1.data.shape[1])
            if self.w1.data.shape[0] != n_vocab or self.w2.data.shape != (n_vocab_draft, rank):
                raise ValueError("markov weight shapes do not match the vocabulary")
            if self.conf_w is not None and self.conf_w.data.reshape(-1).size != n_embd + rank:
                raise ValueError("conf_proj.weight must have n_embd + rank inputs")

        self.cfg = DraftConfig(**hp, n_vocab=n_vocab, n_vocab_draft=n_vocab_draft, markov_rank=rank)
        if self.tok_embd.data.shape[1] != n_embd or self.head.data.shape[1] != n_embd:
            raise ValueError("shared embedding / lm_head width != draft n_embd")
