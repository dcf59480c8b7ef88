"""Random test targets that speak a real model's tool-call format: the model's own chat template
(llama.cpp vendors them in ``models/templates/``) and the special tokens that template and format use,
added to the SmolLM2 tokenizer of the random targets (``tokenizer_extra`` of ``make_test_target``).

llama-server ``--jinja`` recognises these formats on them exactly as on the real models: it renders
the same prompt, builds the same kind of grammar, marks the same preserved tokens and trigger tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple, Union

from pyllama_dspark.gguf.target_writer import make_test_target

N_VOCAB = 49152 + 32      # SmolLM2's vocabulary and room for the special tokens


@dataclass(frozen=True)
class ToolTarget:
    name: str             # format under test
    arch: str
    template: str         # file in llama.cpp's models/templates
    special: Tuple[Union[str, Tuple[str, str]], ...]
    bos: Optional[str]
    eos: str
    start: str            # the token a tool-call reply starts with


TARGETS: Dict[str, ToolTarget] = {t.name: t for t in (
    ToolTarget("qwen3", "qwen3", "Qwen-Qwen3-0.6B.jinja",
               (("<tool_call>", "user"), ("</tool_call>", "user"), ("<think>", "user"), ("</think>", "user"),
                ("<tool_response>", "user"), ("</tool_response>", "user")), None, "<|im_end|>", "<tool_call>"),
    ToolTarget("llama3", "llama", "meta-llama-Llama-3.2-3B-Instruct.jinja",
               ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                "<|python_tag|>"), "<|begin_of_text|>", "<|eot_id|>", "{"),
    ToolTarget("mistral", "llama", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
               ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), "<s>", "</s>", "[TOOL_CALLS]"),
    ToolTarget("gptoss", "gpt-oss", "openai-gpt-oss-120b.jinja",
               ("<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                "<|message|>", "<|call|>"), "<|startoftext|>", "<|return|>", "<|channel|>"),
    ToolTarget("gemma4", "gemma4", "google-gemma-4-31B-it.jinja",
               ("<bos>", "<eos>", "<|turn>", "<turn|>", ("<|tool_call>", "user"), ("<tool_call|>", "user"),
                ('<|"|>', "user"), ("<|channel>", "user"), ("<channel|>", "user"), "<|tool>", "<tool|>",
                ("<|tool_response>", "user"), ("<tool_response|>", "user"), "<|think|>"),
               "<bos>", "<turn|>", "<|tool_call>"),
)}


def templates_dir() -> Path:
    from pyllama_dspark.tools.llama_server_build import vendored_llama_cpp

    return Path(vendored_llama_cpp()) / "models" / "templates"


def template_text(name: str) -> str:
    return (templates_dir() / name).read_text()


def build(kind: str, out_dir: Path, seed: int = 1) -> str:
    """The random target of ``kind`` (one of :data:`TARGETS`) in ``out_dir`` (written once)."""
    t = TARGETS[kind]
    path = Path(out_dir) / f"tools-{kind}-{seed}.gguf"
    if not path.exists():
        make_test_target(path, t.arch, n_vocab=N_VOCAB, seed=seed, vocab_type="f32",
                         tokenizer_extra=dict(special_tokens=list(t.special), chat_template=template_text(t.template),
                                              bos_token=t.bos, eos_token=t.eos))
    return str(path)


def whitespace_tokens(tokenize_piece, n_vocab: int) -> Sequence[int]:
    """Ids whose piece is only whitespace (a request's logit_bias may ban them)."""
    out = []
    for t in range(n_vocab):
        p = tokenize_piece(t)
        if p and not p.strip():
            out.append(t)
    return out
