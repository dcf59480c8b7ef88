"""The layers of the hybrid random-weight targets (attention mixed with a recurrent state), for
:func:`pyllama_dspark.gguf.target_writer.plan_test_target`: which layers are recurrent, and the
hyper-parameters and per-layer tensors the loader of the vendored llama.cpp reads for each
architecture (``src/models/<arch>.cpp``: ``load_arch_hparams`` / ``load_arch_tensors``), with weights
whose recurrences stay numerically sane.

* ``lfm2`` (LFM2): short-convolution layers (``shortconv.{in_proj, conv, out_proj}``, kernel
  ``shortconv.l_cache`` = 3) and GQA attention layers with q/k norms; a layer is attention where its
  ``attention.head_count_kv`` entry is non-zero (the converter writes it so from ``layer_types``);
  every layer has a SwiGLU FFN; the final norm is named ``token_embd_norm``.
* ``qwen35`` (Qwen3.5 dense), ``qwen35moe`` (Qwen3.5 MoE), ``qwen3next`` (Qwen3-Next): Gated
  DeltaNet layers (``attn_qkv``, ``attn_gate``, ``ssm_conv1d``, ``ssm_{a, norm, out}``,
  ``ssm_dt.bias``; ``ssm_{alpha, beta}``, or Qwen3-Next's fused ``ssm_ba``) and gated full attention
  (``attn_q`` holds query and output gate) with partial RoPE (Qwen3.5: interleaved M-RoPE,
  ``rope.dimension_sections``); the recurrent layers are listed in ``attention.recurrent_layers``
  (beside ``full_attention_interval``); ``post_attention_norm`` normalises the FFN input.  The MoE
  ones: routed experts (softmax router, deterministic per token as in the writer's MoE targets:
  reserved embedding dimensions) plus a shared expert behind a sigmoid gate (``ffn_*_shexp``).
* ``nemotron_h`` (Nemotron-H): Mamba-2 layers (``ssm_in``, ``ssm_conv1d`` + bias, ``ssm_dt.bias``,
  ``ssm_a``, ``ssm_d``, grouped ``ssm_norm``, ``ssm_out``), attention layers without RoPE and
  squared-ReLU MLP layers, one kind per layer: attention where ``attention.head_count_kv`` is
  non-zero, MLP where ``feed_forward_length`` is, Mamba-2 where both are zero.

Recurrent states: the Gated DeltaNet decay per head is ``exp(softplus(alpha + dt_bias) * ssm_a)``,
with ``ssm_a = -exp(A_log)`` (stored so, as the converter stores it) drawn in [-1, -0.05] and
``dt_bias`` 0, so the state keeps a few tokens (released checkpoints: ``A`` in (0, 16), ``dt_bias``
1); q and k are L2-normalised in the graph and beta is a sigmoid, so the delta rule contracts.
Mamba-2 as its reference initialisation: ``A`` in -[1, 16], ``dt`` = softplus(x + dt_bias) with
``dt_bias`` the inverse softplus of a log-uniform dt in [0.001, 0.1], ``D`` 1, conv bias 0.
Convolution kernels ~ N(0, 1/kernel), always F32 (ggml's CPU ssm_conv reads F32 kernels only, and
the converters write them so); norms 1; matrices ~ N(0, 1/fan_in) as in the writer.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import numpy as np

__all__ = ["HYBRID_TARGET_ARCHS", "LAYER_PATTERN", "layer_kinds", "add_hybrid"]

#: the repeating layer pattern of each arch ("attn", "recr", "mlp"); one attention layer at least
LAYER_PATTERN: Dict[str, Tuple[str, ...]] = {
    "lfm2": ("recr", "recr", "attn"),          # LFM2-350M starts conv conv attn conv conv attn ...
    "qwen35": ("recr", "recr", "attn"),        # real: every 4th layer attention (2 of each kind in 6 here)
    "qwen35moe": ("recr", "recr", "attn"),
    "qwen3next": ("recr", "recr", "attn"),
    "nemotron_h": ("recr", "attn", "mlp"),     # M * - ("M-M-M-M*-..." in Nemotron-H-8B)
}
#: --arch values planned here (their ArchSpec has hybrid=True)
HYBRID_TARGET_ARCHS = tuple(LAYER_PATTERN)
LFM2_L_CACHE = 3            # LFM2's conv_L_cache
GDN_CONV_KERNEL = 4         # Qwen3-Next / Qwen3.5 linear_conv_kernel_dim
MAMBA_CONV_KERNEL = 4       # Nemotron-H conv_kernel
MAMBA_D_STATE = 16          # Nemotron-H: 128
MAMBA_GROUPS = 2            # Nemotron-H: 8
MAMBA_HEAD_DIM = 32         # Nemotron-H: 64 (d_inner = 2 n_embd = heads x head_dim)


#: Nemotron-H's ``hybrid_override_pattern`` letters
PATTERN_LETTERS = {"M": "recr", "*": "attn", "-": "mlp"}


def layer_kinds(arch: str, n_layer: int, attn_interval: int = 0, pattern: str = "") -> List[str]:
    """``"attn"`` / ``"recr"`` / ``"mlp"`` per layer: :data:`LAYER_PATTERN` repeated, or with
    ``attn_interval`` one attention layer after every ``attn_interval - 1`` recurrent ones, or a
    ``hybrid_override_pattern`` string (``M`` Mamba-2, ``*`` attention, ``-`` MLP) repeated (an attention
    layer at least: the last recurrent one is made attention when the pattern gave none)."""
    if arch not in LAYER_PATTERN:
        raise ValueError(f"{arch!r} is not a hybrid target arch ({', '.join(HYBRID_TARGET_ARCHS)})")
    if pattern and set(pattern) - set(PATTERN_LETTERS):
        raise ValueError(f"layer pattern {pattern!r}: only {''.join(PATTERN_LETTERS)}")
    pat = (tuple(PATTERN_LETTERS[c] for c in pattern) if pattern else
           ("recr",) * (attn_interval - 1) + ("attn",) if attn_interval else LAYER_PATTERN[arch])
    kinds = [pat[il % len(pat)] for il in range(n_layer)]
    if "attn" not in kinds:
        kinds[max(il for il, k in enumerate(kinds) if k == "recr")] = "attn"
    return kinds


def add_hybrid(arch: str, kv: Callable, plan: list, put: Callable, weight: Callable,
               no_write: Callable, rng: np.random.Generator, res: np.ndarray, wenc: str, *, n_vocab: int,
               n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int, n_ff: int, n_expert: int,
               n_ff_exp: int, router_gain: float, gdn: Tuple[int, int, int] = (), attn_interval: int = 0,
               mamba: Tuple[int, int, int] = (), pattern: str = "") -> None:
    """Add the hybrid ``arch``'s hyper-parameters to the metadata (through the writer's ``kv``, which
    overwrites its scalar keys where the arch wants per-layer arrays) and its per-layer tensors to
    ``plan`` (through the writer's ``put`` / ``weight``; ``no_write`` zeroes the rows of an output
    projection that would write into the MoE routing dimensions ``res``).  ValueError on shapes the
    loader or the graph would refuse.  ``gdn``: Gated DeltaNet (key heads, value heads, head size) when
    they are not the attention's (KV heads, query heads, head size); ``attn_interval``: see
    :func:`layer_kinds` (``full_attention_interval``); ``mamba``: Mamba-2 (head size, state size, groups)
    instead of the small defaults; ``pattern``: Nemotron-H's ``hybrid_override_pattern``."""
    if n_layer < 2:
        raise ValueError(f"n_layer must be >= 2 for {arch} (recurrent and attention layers), got {n_layer}")
    kinds = layer_kinds(arch, n_layer, attn_interval, pattern)
    vt = _vt()
    a = arch
    out_w = no_write if res.size else None     # output projections of the MoE targets keep off `res`
    if arch == "lfm2":
        if n_head * head_dim != n_embd:
            raise ValueError(f"lfm2 needs n_head * head_dim == n_embd (its q / output projections are square), "
                             f"got {n_head} * {head_dim} != {n_embd}")
        kv(f"{a}.attention.head_count_kv", [n_head_kv if k == "attn" else 0 for k in kinds], vt.ARRAY, vt.INT32)
        kv(f"{a}.shortconv.l_cache", LFM2_L_CACHE)
        kv(f"{a}.vocab_size", int(n_vocab))
        kv(f"{a}.rope.freq_base", 1000000.0)
        kv(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
        # LFM2's final norm carries an embedding norm's name (llama-arch.cpp: LLM_TENSOR_OUTPUT_NORM_LFM2)
        i = next(i for i, t in enumerate(plan) if t.name == "output_norm.weight")
        plan[i] = plan[i]._replace(name="token_embd_norm.weight")
        for il, kind in enumerate(kinds):
            p = f"blk.{il}."
            put(p + "attn_norm.weight", (n_embd,), _ones(n_embd))
            if kind == "attn":
                _attention(p, put, weight, n_embd, n_head, n_head_kv, head_dim, q_rows=n_head * head_dim, norms=True)
            else:
                # in_proj -> (b, c, x); y = c * conv(b * x): each ~N(0, 1) for an RMS-normed input
                weight(p + "shortconv.in_proj.weight", (3 * n_embd, n_embd), n_embd)
                weight(p + "shortconv.conv.weight", (n_embd, LFM2_L_CACHE), LFM2_L_CACHE, enc="f32")
                weight(p + "shortconv.out_proj.weight", (n_embd, n_embd), n_embd)
            put(p + "ffn_norm.weight", (n_embd,), _ones(n_embd))
            _ffn(p, weight, n_embd, n_ff, gate=True)
        return
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        if n_head % n_head_kv:
            raise ValueError(f"{arch}: n_head {n_head} must be a multiple of n_head_kv {n_head_kv}")
        # Gated DeltaNet heads, unless `gdn` gives them (the --size shapes): as many key heads as KV
        # heads, value heads as query heads, both of head_dim (Qwen3.5-9B: 16 key / 32 value heads of 128)
        n_k, n_v, d_state = gdn or (n_head_kv, n_head, head_dim)
        n_rot = max(2, head_dim // 4)              # partial_rotary_factor 0.25
        kv(f"{a}.rope.dimension_count", n_rot)
        if arch != "qwen3next":                   # interleaved M-RoPE: [t, h, w] pairs as [11, 11, 10] of 32
            s = n_rot // 2
            h, w = s * 11 // 32, s * 10 // 32
            kv(f"{a}.rope.dimension_sections", [s - h - w, h, w, 0], vt.ARRAY, vt.INT32)
        kv(f"{a}.rope.freq_base", 10000000.0)
        kv(f"{a}.full_attention_interval", attn_interval or len(LAYER_PATTERN[arch]))
        kv(f"{a}.attention.recurrent_layers", [k == "recr" for k in kinds], vt.ARRAY, vt.BOOL)
        kv(f"{a}.ssm.conv_kernel", GDN_CONV_KERNEL)
        kv(f"{a}.ssm.state_size", d_state)
        kv(f"{a}.ssm.group_count", n_k)
        kv(f"{a}.ssm.time_step_rank", n_v)
        kv(f"{a}.ssm.inner_size", d_state * n_v)
        moe = arch != "qwen35"
        if moe:
            kv(f"{a}.expert_shared_feed_forward_length", int(n_ff_exp))
        for il, kind in enumerate(kinds):
            p = f"blk.{il}."
            put(p + "attn_norm.weight", (n_embd,), _ones(n_embd))
            put(p + "post_attention_norm.weight", (n_embd,), _ones(n_embd))
            if kind == "attn":
                _attention(p, put, weight, n_embd, n_head, n_head_kv, head_dim, q_rows=2 * n_head * head_dim,
                           norms=True, out_w=out_w)
            else:
                _gated_delta_net(p, put, weight, rng, n_embd, d_state, n_k, n_v, fused_ba=arch == "qwen3next",
                                 out_w=out_w)
            if moe:
                _moe(p, put, weight, no_write, rng, res, wenc, n_embd, n_expert, n_ff_exp, router_gain)
            else:
                _ffn(p, weight, n_embd, n_ff, gate=True)
        return
    if arch == "nemotron_h":
        d_inner = 2 * n_embd
        m_hd, d_st, n_grp = mamba or (MAMBA_HEAD_DIM, MAMBA_D_STATE, MAMBA_GROUPS)
        if d_inner % m_hd or d_inner % n_grp:
            raise ValueError(f"nemotron_h: d_inner 2 * n_embd = {d_inner} must be a multiple of the Mamba-2 head "
                             f"size {m_hd} and group count {n_grp}")
        n_ssm_head = d_inner // m_hd
        kv(f"{a}.attention.head_count_kv", [n_head_kv if k == "attn" else 0 for k in kinds], vt.ARRAY, vt.INT32)
        kv(f"{a}.feed_forward_length", [n_ff if k == "mlp" else 0 for k in kinds], vt.ARRAY, vt.INT32)
        kv(f"{a}.attention.layer_norm_epsilon", 1e-5)
        kv(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
        kv(f"{a}.ssm.conv_kernel", MAMBA_CONV_KERNEL)
        kv(f"{a}.ssm.state_size", d_st)
        kv(f"{a}.ssm.group_count", n_grp)
        kv(f"{a}.ssm.time_step_rank", n_ssm_head)
        kv(f"{a}.ssm.inner_size", d_inner)
        for il, kind in enumerate(kinds):
            p = f"blk.{il}."
            put(p + "attn_norm.weight", (n_embd,), _ones(n_embd))
            if kind == "attn":
                _attention(p, put, weight, n_embd, n_head, n_head_kv, head_dim, q_rows=n_head * head_dim, norms=False)
            elif kind == "mlp":
                _ffn(p, weight, n_embd, n_ff, gate=False)
            else:
                _mamba2(p, put, weight, rng, n_embd, d_inner, n_ssm_head, d_st, n_grp)
        return
    raise ValueError(f"{arch!r} is not a hybrid target arch ({', '.join(HYBRID_TARGET_ARCHS)})")


def _vt():
    import gguf

    return gguf.GGUFValueType


def _ones(n: int) -> Callable[[], np.ndarray]:
    return lambda: np.ones((n,), dtype=np.float32)


def _ffn(p: str, weight, n_embd: int, n_ff: int, gate: bool) -> None:
    """SwiGLU (``gate``) or Nemotron-H's squared-ReLU MLP (up / down only)."""
    if gate:
        weight(p + "ffn_gate.weight", (n_ff, n_embd), n_embd)
    weight(p + "ffn_up.weight", (n_ff, n_embd), n_embd)
    weight(p + "ffn_down.weight", (n_embd, n_ff), n_ff)


def _attention(p: str, put, weight, n_embd: int, n_head: int, n_head_kv: int, hd: int, *, q_rows: int,
               norms: bool, out_w=None) -> None:
    """GQA projections (``q_rows``: Qwen3-Next / Qwen3.5 put query and output gate per head in
    ``attn_q``), optional q / k RMS norms."""
    weight(p + "attn_q.weight", (q_rows, n_embd), n_embd)
    weight(p + "attn_k.weight", (n_head_kv * hd, n_embd), n_embd)
    weight(p + "attn_v.weight", (n_head_kv * hd, n_embd), n_embd)
    weight(p + "attn_output.weight", (n_embd, n_head * hd), n_head * hd, out_w)
    if norms:
        put(p + "attn_q_norm.weight", (hd,), _ones(hd))
        put(p + "attn_k_norm.weight", (hd,), _ones(hd))


def _gated_delta_net(p: str, put, weight, rng, n_embd: int, d_state: int, n_k: int, n_v: int, *, fused_ba: bool,
                     out_w=None) -> None:
    """Gated DeltaNet: [q | k | v] projection (its causal conv) and the z gate, decay (alpha) and
    beta projections (Qwen3-Next: one ``ssm_ba``), gated RMS norm, output projection."""
    f32 = np.float32
    key_dim, value_dim = d_state * n_k, d_state * n_v
    conv_dim = 2 * key_dim + value_dim
    weight(p + "attn_qkv.weight", (conv_dim, n_embd), n_embd)
    weight(p + "attn_gate.weight", (value_dim, n_embd), n_embd)
    weight(p + "ssm_conv1d.weight", (conv_dim, GDN_CONV_KERNEL), GDN_CONV_KERNEL, enc="f32")
    put(p + "ssm_dt.bias", (n_v,), lambda: np.zeros((n_v,), dtype=f32))
    put(p + "ssm_a", (n_v,), lambda: -rng.uniform(0.05, 1.0, size=n_v).astype(f32))
    if fused_ba:
        weight(p + "ssm_ba.weight", (2 * n_v, n_embd), n_embd)
    else:
        weight(p + "ssm_beta.weight", (n_v, n_embd), n_embd)
        weight(p + "ssm_alpha.weight", (n_v, n_embd), n_embd)
    put(p + "ssm_norm.weight", (d_state,), _ones(d_state))
    weight(p + "ssm_out.weight", (n_embd, value_dim), value_dim, out_w)


def _moe(p: str, put, weight, no_write, rng, res: np.ndarray, wenc: str, n_embd: int, n_expert: int, n_ff_exp: int,
         router_gain: float) -> None:
    """Routed experts (router row e reads reserved dimension ``res[e]`` only: the writer's
    deterministic routing) and a sigmoid-gated shared expert; no expert writes into ``res``."""
    f32 = np.float32

    def router() -> np.ndarray:
        r = np.zeros((n_expert, n_embd), dtype=f32)
        r[np.arange(n_expert), res] = f32(router_gain)
        return r

    put(p + "ffn_gate_inp.weight", (n_expert, n_embd), router, wenc)
    weight(p + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), n_embd)
    weight(p + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), n_embd)
    weight(p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff_exp), n_ff_exp, no_write)
    put(p + "ffn_gate_inp_shexp.weight", (n_embd,),
        lambda: rng.standard_normal(n_embd, dtype=f32) * f32(1.0 / np.sqrt(n_embd)))
    weight(p + "ffn_gate_shexp.weight", (n_ff_exp, n_embd), n_embd)
    weight(p + "ffn_up_shexp.weight", (n_ff_exp, n_embd), n_embd)
    weight(p + "ffn_down_shexp.weight", (n_embd, n_ff_exp), n_ff_exp, no_write)


def _mamba2(p: str, put, weight, rng, n_embd: int, d_inner: int, n_head: int, d_state: int = MAMBA_D_STATE,
            groups: int = MAMBA_GROUPS) -> None:
    """Mamba-2 mixer: in_proj -> [z | x B C | dt], causal conv (+ bias) over x B C, selective scan
    with per-head A / D / dt bias, z-gated grouped RMS norm, out_proj."""
    f32 = np.float32
    conv_ch = d_inner + 2 * groups * d_state
    weight(p + "ssm_in.weight", (2 * d_inner + 2 * groups * d_state + n_head, n_embd), n_embd)
    weight(p + "ssm_conv1d.weight", (conv_ch, MAMBA_CONV_KERNEL), MAMBA_CONV_KERNEL, enc="f32")
    put(p + "ssm_conv1d.bias", (conv_ch,), lambda: np.zeros((conv_ch,), dtype=f32))

    def dt_bias() -> np.ndarray:   # inverse softplus of dt ~ log-uniform [0.001, 0.1]
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=n_head))
        return (dt + np.log(-np.expm1(-dt))).astype(f32)

    put(p + "ssm_dt.bias", (n_head,), dt_bias)
    put(p + "ssm_a", (n_head, 1), lambda: -rng.uniform(1.0, 16.0, size=(n_head, 1)).astype(f32))
    put(p + "ssm_d", (n_head, 1), lambda: np.ones((n_head, 1), dtype=f32))
    put(p + "ssm_norm.weight", (groups, d_inner // groups), lambda: np.ones((groups, d_inner // groups), dtype=f32))
    weight(p + "ssm_out.weight", (n_embd, d_inner), d_inner)
