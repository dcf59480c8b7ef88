"""Numpy reference of llama.cpp's DFlash / DSpark draft graph (for ``crosscheck`` and the tests).

This re-implements, from the GGUF files alone, what ``src/models/dflash.cpp`` (the non-DSV4
``graph<false>`` decoder and ``build_dspark_markov_head``) computes for one sequence, so that the
numbers llama.cpp returns for a draft can be checked independently:

* **injection** (an embedding batch on the draft context): ``g = RMSNorm(fc · features)`` with
  ``enc.output_norm``; per layer ``K = k_norm(W_k g)`` roped at the row's position and
  ``V = W_v g`` are written to the KV cache.  There is *no* ``attn_norm`` on this path: the
  encoder norm is the only one.
* **block** (a token batch): token embeddings (the target's ``token_embd`` unless the draft has its
  own) pass through Qwen3-style layers: ``attn_norm`` → Q/K/V → q/k RMS norms → RoPE (NeoX
  pairing, see below) → the block's own K/V are *written to the cache* and the queries attend,
  with llama.cpp's KV mask, to every cell of the sequence: all injected context plus all block
  rows (non-causal unless ``dflash.attention.causal`` says otherwise) → ``W_o`` → residual →
  ``ffn_norm`` → SwiGLU → residual.  Then ``output_norm`` gives the hidden state ``h`` (this is
  ``res->t_embd``: it feeds both the lm_head and the confidence head), the lm_head gives ``U``.
* **Markov head** (DSpark drafts, i.e. ``markov_w1.weight`` present): left to right over the
  block, ``logits_i = U_i + W2·W1[prev_i]`` with ``prev`` = the anchor (the block's first token)
  for the first prediction slot and the *argmax of the previous biased row* afterwards; the
  confidence is ``sigmoid(conf_proj · [h_i ; W1[prev_i]] + b)``.  With
  ``dflash.sample_from_anchor = false`` slot 0 is a bonus slot: its logits pass through unbiased
  and its confidence is ``sigmoid(U_0[0])`` (llama.cpp pads it with the first logit; it is never
  read).  A block longer than ``dflash.block_size`` skips the head entirely (logits = U, no
  confidence), exactly like llama.cpp.

Numerics.  Activations are float64 throughout; weights are kept as float32 arrays, which hold the
dequantized GGUF values exactly (every ggml type dequantizes to float32), and are promoted to
float64 inside each product.  The reference's own rounding (~1e-16 relative) is therefore
negligible, and any difference to llama.cpp is llama.cpp's rounding.  With
``emulate_ggml=True`` the reference additionally applies the deterministic roundings ggml's CPU
backend performs (see :class:`~.model.DraftReference`), which removes the dominant error terms
and lets a comparison use tight tolerances.

Not covered (the constructor raises ``NotImplementedError``): DeepSeek-V4 DSpark drafts
(hyper-connections), DFlash2 (conv/selector), sliding-window drafts, LongRoPE, multi-section
M-RoPE that differs from NeoX.

Modules, bottom up:

* ``ggml_rounding``: ggml-cpu's activation / F16 / BF16 roundings (``emulate_ggml=True``);
* ``gguf_tensors``: dequantize-on-demand GGUF access, the shared target cache;
* ``config``: :class:`~.config.DraftConfig`, the hyper-parameters resolved from the metadata;
* ``loading``: the draft's (and the shared target's) weights;
* ``ops``: mat-mul, RMS norm, RoPE, feed-forward;
* ``attention``: attention over the KV cells, with ggml's flash-attention roundings;
* ``kv_store``: injection of target features, rollback, the stored K / V;
* ``error_bounds``: rigorous bounds of llama.cpp's deviation from the same hidden rows;
* ``model``: :class:`~.model.DraftReference` (built from the mixins above: block decode, Markov /
  confidence heads) and :class:`~.model.RefBlock`.
"""
