"""The human-readable reports of ``pyllama-dspark inspect``: a draft and its fit to a target, or a
target and what a draft for it must match."""

from __future__ import annotations

import os
from typing import Optional

from pyllama_dspark.errors import DraftMismatchError
from pyllama_dspark.gguf.info import SOURCE_PREFIX, DraftInfo, validate_pair
from pyllama_dspark.gguf.layer_inputs import (DRAFTING_HYBRID_ARCHS, unsupported_arch_message,
                                             unsupported_hybrid_message)
from pyllama_dspark.gguf.reader import field_value, read_gguf
from pyllama_dspark.gguf.target_info import TargetInfo

__all__ = ["format_draft_info", "format_target_info"]


def _yn(v: Optional[bool]) -> str:
    return "absent" if v is None else ("true" if v else "false")


def _provenance_lines(path) -> list:
    """Where ``pyllama-dspark convert`` made the draft from (its ``pyllama_dspark.source.*`` keys)."""
    import json

    r = read_gguf(path)
    text = field_value(r, SOURCE_PREFIX + "config", None)
    outtype = field_value(r, SOURCE_PREFIX + "outtype", None)
    if text is None and outtype is None:
        return ["  source:           not recorded (not made by pyllama-dspark convert)"]
    lines = [f"  source:           pyllama-dspark convert, outtype {outtype}"]
    if text is not None:
        try:
            cfg = json.loads(text)
        except ValueError:
            cfg = {}
        if isinstance(cfg, dict):
            prov = cfg.get("pyllama_dspark")
            name = (prov.get("general_name") if isinstance(prov, dict) else None) or cfg.get("_name_or_path")
            lines.append(f"  source model:     {cfg.get('architectures')}" + (f" ({name})" if name else ""))
        lines.append("  source config.json:")
        lines += ["    " + line for line in text.rstrip("\n").splitlines()]
    return lines


def format_draft_info(draft_info: DraftInfo, target_info: Optional[TargetInfo] = None) -> str:
    """Human-readable report of a draft (and its fit to a target) for ``pyllama-dspark inspect``."""
    d = draft_info
    lines = [
        f"draft:              {d.path}",
        f"  arch / kind:      {d.arch} / {d.kind}" + ("  (DFlash2 selector)" if d.is_dflash2 else ""),
        f"  layers:           {d.n_layer} x (n_embd {d.n_embd}, heads {d.n_head}/{d.n_head_kv} kv, "
        f"head_dim {d.head_dim}, n_ff {d.n_ff})",
        f"  block_size:       {d.block_size}  (max drafts per block: {d.max_drafts})",
        f"  target_layers:    {list(d.target_layers_raw)} as stored = layer-input ids "
        f"(HF hidden-state ids {list(d.target_layers_hf)}); feature row {d.n_embd_inp_enc} floats",
        f"  sample_from_anchor: {d.sample_from_anchor} (key {_yn(d.sample_from_anchor_key)})",
        f"  causal attention: {d.causal} (key {_yn(d.causal_key)})",
        "  markov head:      " + (f"rank {d.markov_rank}" + (" + w2 scale" if d.has_markov_scale else "")
                                   if d.has_markov else "none"),
        f"  confidence head:  {d.has_confidence_head} (key {_yn(d.confidence_key)}, "
        f"conf_proj tensor {'present' if d.has_conf_tensor else 'absent'})",
        f"  mask token id:    {d.mask_token_id}",
        f"  vocabulary:       {d.n_vocab} tokens ({d.tokenizer_model}, fingerprint {d.tokenizer_fingerprint[:16]})"
        + (f"; reduced draft vocab {d.n_vocab_draft} via d2t" if d.has_d2t else ""),
        "  lm_head / embd:   " + ("own" if d.has_own_lm_head else "shared from the target (ctx_other)"),
        f"  fc.weight:        {d.fc_type} ne {list(d.fc_shape)}" + (" + scale" if d.has_fc_scale else ""),
        f"  rope:             {d.rope_type}, freq_base {d.rope_freq_base:g}"
        + (f", sections {list(d.rope_sections)}" if any(d.rope_sections) else ""),
    ]
    lines += _provenance_lines(d.path)
    for p in d.problems:
        lines.append(f"  PROBLEM: {p}")
    for n in d.notes:
        lines.append(f"  note: {n}")
    if target_info is not None:
        t = target_info
        lines += [
            f"target:             {t.path}",
            f"  arch:             {t.arch} ({'layer inputs supported' if t.supports_layer_inputs else 'NO layer-input capture'})",
            f"  n_layer / n_embd: {t.n_layer} / {t.n_embd}; valid layer ids 0..{t.max_layer_id}",
            f"  vocabulary:       {t.n_vocab} tokens ({t.tokenizer_model}, fingerprint {t.tokenizer_fingerprint[:16]})",
        ]
        try:
            warns = validate_pair(d, t)
        except DraftMismatchError as exc:  # includes UnsupportedArchError
            lines.append(f"pair:               INCOMPATIBLE: {exc}")
        else:
            lines.append("pair:               compatible")
            seen = set(d.notes)
            for w in warns:
                if w not in seen:
                    lines.append(f"  warning: {w}")
    return "\n".join(lines)


def _memory(t: TargetInfo) -> str:
    if not t.hybrid:
        return "attention KV cache"
    if t.arch in DRAFTING_HYBRID_ARCHS:
        return ("hybrid: a recurrent state beside the attention cache; drafted with state snapshots or "
                "checkpoints (docs/targets.md)")
    return "hybrid: a recurrent state beside the attention cache; not drafted yet (docs/targets.md)"


def format_target_info(t: TargetInfo) -> str:
    """Human-readable report of a target GGUF for ``pyllama-dspark inspect``: what it is, whether a
    DFlash/DSpark draft can run on it, and what such a draft must match (:func:`validate_pair`)."""
    drafted = t.supports_layer_inputs and (not t.hybrid or t.arch in DRAFTING_HYBRID_ARCHS)
    lines = [
        f"target:             {t.path}",
        f"  arch:             {t.arch} (" + ("llama.cpp captures its layer inputs" if t.supports_layer_inputs
                                             else "NO layer-input capture in llama.cpp") + ")",
        f"  memory:           {_memory(t)}",
        f"  layers:           {t.n_layer} x (n_embd {t.n_embd}, heads {t.n_head}/{t.n_head_kv} kv, "
        f"head_dim {t.head_dim}, n_ff {t.n_ff})"
        + (f"; {t.n_layer_all - t.n_layer} MTP layer(s) not counted" if t.n_layer_all != t.n_layer else ""),
        f"  context (train):  {t.n_ctx_train}",
        f"  vocabulary:       {t.n_vocab} tokens ({t.tokenizer_model}/{t.tokenizer_pre}, "
        f"fingerprint {t.tokenizer_fingerprint[:16]}); bos {t.bos_token_id}, eos {t.eos_token_id}",
    ]
    if not drafted:
        why = (unsupported_arch_message if not t.supports_layer_inputs else unsupported_hybrid_message)(
            t.arch, os.path.basename(t.path))
        lines.append(f"drafts:             none can run on this target: {why}")
        return "\n".join(lines)
    lines += [
        "a DFlash/DSpark draft for it must have:",
        f"  hidden width:     n_embd {t.n_embd}",
        f"  tokenizer:        the target's: {t.n_vocab} tokens, fingerprint {t.tokenizer_fingerprint[:16]} "
        "(its lm_head may cover fewer, mapped by d2t)",
        f"  target_layers:    layer-input ids in 0..{t.max_layer_id}",
        "  fc.weight:        not F16 (its activations overflow on a CPU); F32, BF16 or Q8_0",
    ]
    return "\n".join(lines)
