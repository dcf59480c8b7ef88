"""The "Use a released drafter" page (docs/released.md), its commands run as a user runs them, on a
checkpoint shaped like ``deepseek-ai/dspark_qwen3_8b_block7``.

The checkpoint has random weights and the published form (this machine cannot download the real one):
the config keys the DeepSeek DSpark checkpoints carry (``DSparkDraftModel``, ``model_type`` qwen3,
``block_size`` 7, a nested ``dflash_config`` with ``projector_type`` dspark, ``markov_rank`` 256,
``markov_head_type`` vanilla, the confidence head with the Markov feature, ``mask_token_id`` 151669 and
``target_layer_ids`` [1, 9, 17, 25, 33], as public training and serving code quotes them for the 8B
drafter), five draft layers with Qwen3-8B's attention geometry (32 query heads, 8 KV heads, head size
128), the 151,936-token vocabulary, BF16 weights, and the checkpoint's tensor names. Only the hidden
width is cut (128, and the FFN with it) so that CI can run it. The target is a random 36-layer Qwen3
(Qwen3-8B's depth) written by ``make-test-target``, under the file name the page uses.

The commands are read from the page's fenced blocks (``convert``, ``inspect``, ``run``, ``crosscheck``)
and run in a shell in a folder holding those names, with none of the suite's switches.  References:
llama.cpp's own converter on the same checkpoint (the same GGUF), and ``crosscheck``'s own references
(plain greedy decoding, llama-server's DSpark driver, the numpy draft graph).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from first_run import user_env
from pyllama_dspark.gguf.reader import field_value, read_gguf
from pyllama_dspark.gguf.target_writer import make_test_target
from pyllama_dspark.paths import cache_dir

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "released.md"
CK_NAME, TARGET_NAME, DRAFT_NAME = "dspark_qwen3_8b_block7", "Qwen3-8B-Q4_K_M.gguf", "dspark_qwen3_8b_block7.gguf"

N_EMBD = 128           # the one cut dimension (Qwen3-8B: 4096)
N_FF = 384             # 12288 / 32, as the width
N_LAYER_TARGET = 36    # Qwen3-8B's depth
PUBLISHED = {
    "architectures": ["DSparkDraftModel"],
    "model_type": "qwen3",
    "dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_size": N_EMBD,
    "intermediate_size": N_FF,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "layer_types": ["full_attention"] * 5,
    "num_target_layers": N_LAYER_TARGET,
    "vocab_size": 151936,
    "block_size": 7,
    "dflash_config": {
        "projector_type": "dspark",
        "attention_mode": "gqa",
        "markov_rank": 256,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "mask_token_id": 151669,
        "target_layer_ids": [1, 9, 17, 25, 33],
    },
}


def _tensors(cfg):
    """The checkpoint's tensor names and shapes (HF layout: [out, in])."""
    d, ff, v, r = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["dflash_config"]["markov_rank"]
    q, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_in = len(cfg["dflash_config"]["target_layer_ids"])
    out = {"fc.weight": (d, n_in * d), "hidden_norm.weight": (d,), "norm.weight": (d,),
           "markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r),
           "confidence_head.proj.weight": (1, d + r), "confidence_head.proj.bias": (1,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (q * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
                    p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, q * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                    p + "mlp.down_proj.weight": (d, ff)})
    return out


def write_checkpoint(out: Path, cfg=PUBLISHED, seed=0) -> Path:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    st = {}
    for name, shape in _tensors(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / np.sqrt(shape[-1])
        st[name] = t.to(torch.bfloat16)
    out.mkdir(parents=True)
    save_file(st, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def page_commands(page: Path = PAGE):
    """The page's ``pyllama-dspark`` command lines (continuations joined), by subcommand."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
    out = {}
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split())
            if line.startswith("pyllama-dspark "):
                out.setdefault(line.split()[1], []).append(line)
    return out


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    work = tmp_path_factory.mktemp("released")
    write_checkpoint(work / CK_NAME)
    make_test_target(str(work / TARGET_NAME), "qwen3", n_layer=N_LAYER_TARGET, n_embd=N_EMBD)
    return work


def _shell(line, work, timeout=900):
    # as a user: the console script on PATH, none of the suite's switches (the llama-server build cache
    # is kept, as a user who built it once keeps it)
    env = user_env(cache_dir())
    p = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{line}\nexit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


def test_the_page_names_the_commands_it_documents():
    cmds = page_commands()
    for sub in ("convert", "inspect", "run", "crosscheck"):
        assert cmds.get(sub), f"docs/released.md has no `pyllama-dspark {sub}` command"
    assert all(CK_NAME in c and TARGET_NAME in c for c in cmds["convert"])


def test_convert_inspect_run_crosscheck_as_the_page_says(user_folder):
    cmds = page_commands()
    _shell(cmds["convert"][0], user_folder)
    draft = user_folder / DRAFT_NAME
    r = read_gguf(str(draft))
    assert list(field_value(r, "dflash.target_layers")) == [i + 1 for i in PUBLISHED["dflash_config"]["target_layer_ids"]]
    assert field_value(r, "dflash.block_count") == 5
    assert field_value(r, "tokenizer.ggml.mask_token_id") == 151669
    names = {t.name: t for t in r.tensors}
    assert tuple(names["markov_w1.weight"].shape) == (256, 151936)
    assert names["blk.0.attn_q.weight"].tensor_type.name == "BF16"     # --outtype auto keeps BF16

    out = _shell(cmds["inspect"][0], user_folder)
    assert "pair:               compatible" in out and "rank 256" in out, out

    for line in cmds["run"]:
        # the page's prompts, 8 tokens each so that CI stays short
        _shell(line.replace("-n 256", "-n 8") + (" -n 8" if "-n " not in line else ""), user_folder)

    out = _shell(cmds["crosscheck"][0] + " -n 32", user_folder)
    assert "llama-server" in out, out


def test_convert_equals_llama_cpp_converter(user_folder, tmp_path):
    """llama.cpp's converter on the same checkpoint gives the same GGUF: every key but the names it
    derives from the folder, every tensor bit for bit, fc.weight aside (ours stays F32, as in
    test_interop)."""
    from test_interop import _reference, assert_matches_reference, build_hf_target
    from pyllama_dspark.interop.convert import convert_checkpoint

    hf = build_hf_target(str(user_folder / TARGET_NAME), tmp_path / "hf-target")
    ref = _reference(user_folder / CK_NAME, hf, tmp_path / "ref.gguf", "bf16")
    ours = convert_checkpoint(str(user_folder / CK_NAME), str(user_folder / TARGET_NAME), str(tmp_path / "ours.gguf"),
                              outtype="bf16")
    *_, differ = assert_matches_reference(ours, str(ref), "bf16")
    assert differ == {"fc.weight"}          # BF16 in the checkpoint: llama.cpp keeps it, ours is F32
