"""Random test targets that speak a real model's tool-call format: the model's own chat template
(llama.cpp vendors them in ``models/templates/``) and the special tokens that template and format use,
added to the SmolLM2 tokenizer of the random targets (``tokenizer_extra`` of ``make_test_target``).

llama-server ``--jinja`` recognises these formats on them exactly as on the real models: it renders
the same prompt, builds the same kind of grammar, marks the same preserved tokens and trigger tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

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
    # Qwen3-Coder XML calls (<function=NAME><parameter=KEY>): Qwen3.5 and Nemotron 3 think, Qwen3-Coder not
    ToolTarget("qwen35", "qwen3", "Qwen3.5-4B.jinja",
               (("<tool_call>", "user"), ("</tool_call>", "user"), ("<think>", "user"), ("</think>", "user"),
                ("<tool_response>", "user"), ("</tool_response>", "user")), None, "<|im_end|>", "<tool_call>"),
    # the same template on a hybrid Qwen3.5 target (Gated DeltaNet beside attention): calls under speculation
    ToolTarget("qwen35-hybrid", "qwen35", "Qwen3.5-4B.jinja",
               (("<tool_call>", "user"), ("</tool_call>", "user"), ("<think>", "user"), ("</think>", "user"),
                ("<tool_response>", "user"), ("</tool_response>", "user")), None, "<|im_end|>", "<tool_call>"),
    ToolTarget("qwen3coder", "qwen3", "Qwen3-Coder.jinja",
               (("<tool_call>", "user"), ("</tool_call>", "user"), ("<tool_response>", "user"),
                ("</tool_response>", "user")), None, "<|im_end|>", "<tool_call>"),
    ToolTarget("nemotron3", "qwen3", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
               (("<tool_call>", "user"), ("</tool_call>", "user"), ("<think>", "user"), ("</think>", "user"),
                ("<tool_response>", "user"), ("</tool_response>", "user")), None, "<|im_end|>", "<tool_call>"),
    # LFM2 / LFM2.5 Python-style calls: the list / call / response markers are control tokens of
    # Liquid's vocabulary, <think> / </think> (LFM2.5) user-defined
    ToolTarget("lfm2", "llama", "LFM2-8B-A1B.jinja",
               ("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
                "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>",
                ("<think>", "user"), ("</think>", "user")), "<|startoftext|>", "<|im_end|>", "<|tool_call_start|>"),
    ToolTarget("lfm25", "llama", "LFM2.5-8B-A1B.jinja",
               ("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
                "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>",
                ("<think>", "user"), ("</think>", "user")), "<|startoftext|>", "<|im_end|>", "<|tool_call_start|>"),
    # DeepSeek V3.2 / V4 DSML calls: the turn markers control tokens, ｜DSML｜ <think> </think>
    # user-defined (DeepSeek's vocabulary; llama.cpp preserves ｜DSML｜, <think>, </think>)
    ToolTarget("dsv32", "qwen3", "deepseek-ai-DeepSeek-V3.2.jinja",
               ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", ("<think>", "user"),
                ("</think>", "user"), ("｜DSML｜", "user")), "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜DSML｜function_calls>"),
    ToolTarget("dsv4", "qwen3", "deepseek-ai-DeepSeek-V4.jinja",
               ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", ("<think>", "user"),
                ("</think>", "user"), ("｜DSML｜", "user")), "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜DSML｜tool_calls>"),
    # DeepSeek V3.1: the turn and tool markers control tokens, <think> </think> user-defined
    ToolTarget("dsv31", "qwen3", "deepseek-ai-DeepSeek-V3.1.jinja",
               ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", ("<think>", "user"),
                ("</think>", "user"), "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
               "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>"),
)}


def templates_dir() -> Path:
    from pyllama_dspark.upstream.llama_server_build import vendored_llama_cpp

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


# ---- the requests the tool tests share ----------------------------------------------------------------
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                           "unit": {"type": "string", "enum": ["c", "f"]}},
          "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                            "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                                             "required": ["city"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def post(srv, path: str, body: dict):
    """POST ``body`` as JSON to a llama-server (``base_url``) or a serve process (``url``)."""
    from serve_helpers import SESSION

    url = srv.base_url if hasattr(srv, "base_url") else srv.url
    return SESSION.post(url + path, data=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=600)


def calls(msg: dict) -> list:
    """A message's tool calls as ``(name, arguments parsed)``."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []]


def strip_ids(msg: dict) -> dict:
    """A copy of ``msg`` without its tool calls' ids (each side makes up its own)."""
    msg = json.loads(json.dumps(msg))
    for c in msg.get("tool_calls") or []:
        c.pop("id", None)
    return msg


def token_of(target, text: str) -> int:
    """The one token ``text`` is in ``target``'s vocabulary (asserted: a marker that is a special token)."""
    ids = target.tokenize(text, False, True)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def planned(target, choice, tools, messages=USER, parallel=False, kw=None):
    """(the tool plan of a chat request, its prompt's tokens) as serve builds them for ``target``."""
    from pyllama_dspark.chat.tool_prompt import tool_chat_for
    from pyllama_dspark.chat.tool_request import check_tool_choice, check_tools, plan_tools

    tools = check_tools(tools)
    plan = plan_tools(tool_chat_for(target), messages, tools, check_tool_choice(choice, tools), parallel, kw)
    return plan, target.tokenize(plan.prompt, add_special=not plan.added_special, parse_special=True)


# ---- what a stream adds up to -------------------------------------------------------------------------
def merge_deltas(deltas: Iterable[dict], tool_calls: bool = True) -> dict:
    """What chat-completion deltas add up to: ``content`` and ``reasoning_content`` concatenated, and
    ``tool_calls`` by index, ``{index: {"id": the first delta's, "name", "arguments": concatenated}}``
    in the order the indices first came.  ``tool_calls=False``: asserts no delta carries any."""
    out: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for d in deltas:
        assert tool_calls or "tool_calls" not in d, d
        out["content"] += d.get("content") or ""
        out["reasoning_content"] += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls", []):
            c = out["tool_calls"].setdefault(tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""})
            c["name"] += tc.get("function", {}).get("name", "")
            c["arguments"] += tc.get("function", {}).get("arguments", "")
    return out


def merge_chunks(chunks: Iterable[dict], tool_calls: bool = True) -> dict:
    """:func:`merge_deltas` of streamed chunks (``choices[0]``), with their last ``finish_reason``."""
    finish = None
    deltas = []
    for ev in chunks:
        ch = ev["choices"][0]
        finish = ch["finish_reason"] or finish
        deltas.append(ch["delta"])
    return {**merge_deltas(deltas, tool_calls), "finish_reason": finish}


def streamed_text(chunks: Iterable[dict]) -> dict:
    """The content and reasoning_content of streamed chunks that carry no tool call (asserted)."""
    m = merge_chunks(chunks, tool_calls=False)
    return {"content": m["content"], "reasoning_content": m["reasoning_content"]}


def message_text(msg: dict) -> dict:
    """A message's content and reasoning_content, as :func:`streamed_text` gives them."""
    return {"content": msg["content"], "reasoning_content": msg.get("reasoning_content", "")}


def check_streamed_call(events: list, full: dict, reasoning: bool = False) -> dict:
    """A tool call's SSE ``events`` (ending in ``[DONE]``) reassemble to ``full`` (the same request's
    ``choices[0]`` unstreamed): its finish_reason ``tool_calls``, content (and, with ``reasoning``, its
    reasoning_content), the calls' names and arguments, every call with an id.  Returns the calls by index."""
    assert events[-1] == "[DONE]", events[-1]
    got = merge_chunks(events[:-1])
    merged = got["tool_calls"]
    assert got["finish_reason"] == full["finish_reason"] == "tool_calls", (got["finish_reason"], full)
    assert got["content"] == full["message"]["content"], (got, full)
    if reasoning:
        assert got["reasoning_content"] == full["message"].get("reasoning_content", ""), (got, full)
    mine = [(c["name"], c["arguments"]) for c in merged.values()]
    assert mine == [(c["function"]["name"], c["function"]["arguments"]) for c in full["message"]["tool_calls"]], \
        (mine, full)
    assert all(c["id"] for c in merged.values()), merged
    return merged
