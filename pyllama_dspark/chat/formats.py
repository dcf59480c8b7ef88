"""Which tool-call format a chat template speaks, found the way llama.cpp's ``common/chat.cpp``
finds it: by the template's own rendering, not by its name.

llama-server (``--jinja``) probes a template's capabilities by rendering it (``common/jinja/caps.cpp``:
is the tool list used, are an assistant message's ``tool_calls`` rendered, as objects or as strings,
more than one of them) and then either picks a specialised handler from markers in the template's
source (GPT-OSS ``<|channel|>``, Gemma 4 ``<|tool_call>call:``, Qwen3-Coder ``<function=``, ...) or
runs its differential "autoparser", which renders a tool call and reads the markers around it.  We do
the same with Jinja2 (:func:`probe_caps`, :func:`detect_format`): a probe conversation with one call
``tool1({"arg": "value"})`` is rendered and the rendering decides the format.

Formats built here (:data:`FORMATS`):

* ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call
  (Qwen 2.5 / QwQ / Qwen3, Hermes 2 Pro / 3, and every template that renders calls so); Qwen3's
  ``<think>`` block is reasoning;
* ``llama3``: the whole reply is ``{"name": ..., "parameters": {...}}`` (Llama 3.1 / 3.2 / 3.3);
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "<9 alphanumerics>"}, ...]``
  (Mistral Nemo, Mistral 7B v0.3);
* ``generic``: a template with no tool syntax of its own (SmolLM2): the tools are described in a
  system message we add and the reply is asked for in the ``hermes`` form;
* ``harmony``: GPT-OSS's channels, ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``
  (:mod:`.harmony`), one call per reply, the analysis channel as reasoning;
* ``xml``: Qwen3-Coder XML, ``<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>``
  (:mod:`.xml_calls`: Qwen3.5 / 3.6, Qwen3-Coder, Nemotron 3 Nano), a ``<think>`` block as reasoning
  where the template has one;
* ``lfm2`` / ``lfm25``: LFM2 / LFM2.5, ``<|tool_call_start|>[NAME(key="value", n=1)]<|tool_call_end|>``
  (:mod:`.lfm2`), Python-style calls, several in one list, a ``<think>`` block as reasoning where the
  template has one;
* ``dsml`` / ``dsml4``: DeepSeek V3.2 / V4, ``<｜DSML｜function_calls>`` (V4 ``tool_calls``) around
  ``<｜DSML｜invoke name="NAME">`` and ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>``
  (:mod:`.dsml`), a ``<think>`` block as reasoning;
* ``deepseek31``: DeepSeek V3.1, ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>``
  (:mod:`.deepseek31`), a ``<think>`` block as reasoning.

Every other template that renders tools is refused with :class:`UnsupportedToolFormat`, whose
message names the format (never a silent fallback to plain text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["ToolFormat", "TemplateCaps", "UnsupportedToolFormat", "FORMATS", "SUPPORTED", "probe_caps",
           "detect_format"]


class UnsupportedToolFormat(ValueError):
    """The template has a tool-call format this project does not build (the message says which)."""


@dataclass(frozen=True)
class ToolFormat:
    name: str
    label: str                          # for messages and docs
    call_open: str                      # text before one call's JSON object
    call_close: str                     # text after it
    call_sep: str                       # between two calls (hermes: "\n")
    args_key: str                       # "arguments" | "parameters"
    section_open: str = ""              # mistral: "[TOOL_CALLS]" before the JSON array of calls
    array: bool = False                 # the calls are one JSON array (mistral)
    id_key: Optional[str] = None        # the model writes the call's id (mistral: "id")
    id_pattern: Optional[str] = None    # ... matching this JSON-schema pattern
    trigger: str = ""                   # auto: the text that starts the calls (lazy grammar)
    trigger_at_start: bool = False      # ... only at the start of the reply (llama3)
    think: Optional[Tuple[str, str]] = None   # reasoning block tags (a template that has them)
    system_tools: bool = False          # generic: we describe the tools in a system message
    codec: str = ""                     # calls that are not one JSON object each (Gemma 4, GPT-OSS):
                                        # the module of :mod:`.tool_codecs` that builds and parses them
    markers: Tuple[str, ...] = ()       # more text the reply shows though it is control tokens

    @property
    def first_marker(self) -> str:
        """The text a reply's calls start with (parsing: content before it)."""
        return self.section_open or self.call_open


_HERMES = ToolFormat("hermes", "Hermes / Qwen <tool_call> JSON", "<tool_call>\n", "\n</tool_call>", "\n",
                     "arguments", trigger="<tool_call>\n")
_LLAMA3 = ToolFormat("llama3", "Llama 3.x JSON", "", "", "", "parameters", trigger='{"name"',
                     trigger_at_start=True)
_MISTRAL = ToolFormat("mistral", "Mistral [TOOL_CALLS] JSON array", "", "", ", ", "arguments",
                      section_open="[TOOL_CALLS]", array=True, id_key="id", id_pattern="^[a-zA-Z0-9]{9}$",
                      trigger="[TOOL_CALLS]")
_GENERIC = ToolFormat("generic", "generic (tools described in a system message, <tool_call> JSON replies)",
                      "<tool_call>\n", "\n</tool_call>", "\n", "arguments", trigger="<tool_call>",
                      system_tools=True)
# Gemma 4: call:name{key:<|"|>value<|"|>} (:mod:`.gemma4`); a template without llama.cpp's
# "OpenAI Chat Completions" branch wants tool results folded into the assistant turn (gemma4_legacy)
_GEMMA4 = ToolFormat("gemma4", "Gemma 4 <|tool_call>call:name{...}", "<|tool_call>", "<tool_call|>", "", "arguments",
                     trigger="<|tool_call>", think=("<|channel>thought", "<channel|>"), codec="gemma4",
                     markers=("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|turn>", '<|"|>'))
FORMATS: Dict[str, ToolFormat] = {f.name: f for f in (_HERMES, _LLAMA3, _MISTRAL, _GENERIC, _GEMMA4)}
SUPPORTED = "Hermes / Qwen <tool_call> JSON (Qwen 2.5, QwQ, Qwen3, Hermes 2 Pro / 3), Llama 3.x JSON, " \
            "Mistral [TOOL_CALLS] JSON (Nemo, 7B v0.3), Gemma 4, GPT-OSS (harmony), and templates with no tool syntax (generic form)"

# GPT-OSS: harmony channels, the call's name in a header and its arguments after <|message|>
# (:mod:`.harmony`); the analysis channel is reasoning
_HARMONY = ToolFormat("harmony", "GPT-OSS harmony channels", "", "", "", "arguments",
                      think=("<|channel|>analysis<|message|>", "<|end|>"), codec="harmony",
                      markers=("<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>"))
FORMATS[_HARMONY.name] = _HARMONY

# Qwen3-Coder XML: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n... (:mod:`.xml_calls`);
# a template with <think> (Qwen3.5, Nemotron 3) reasons first, Qwen3-Coder may leave out the first <tool_call>
_XML = ToolFormat("xml", "Qwen3-Coder XML <function=NAME><parameter=KEY>", "<tool_call>\n", "</tool_call>", "",
                  "arguments", trigger="<tool_call>", codec="xml_calls")
FORMATS[_XML.name] = _XML
SUPPORTED = SUPPORTED.replace(", and templates", ", Qwen3-Coder XML (Qwen3.5 / 3.6, Qwen3-Coder, Nemotron 3 Nano), "
                                                "and templates")

# LFM2 / LFM2.5: <|tool_call_start|>[name(key="value", n=1), ...]<|tool_call_end|>, Python-style calls
# (:mod:`.lfm2`); LFM2's template lists the tools between <|tool_list_start|> / <|tool_list_end|>, LFM2.5's
# as plain "List of tools: [" (chat.cpp tells them apart so); a <think> block as reasoning where the
# template has one
_LFM2 = ToolFormat("lfm2", "LFM2 <|tool_call_start|>[name(key=value)]", "<|tool_call_start|>", "<|tool_call_end|>",
                   "", "arguments", trigger="<|tool_call_start|>", codec="lfm2",
                   markers=("<think>", "</think>", "<|tool_list_start|>", "<|tool_list_end|>"))
_LFM25 = ToolFormat(**{**_LFM2.__dict__, "name": "lfm25", "label": "LFM2.5 <|tool_call_start|>[name(key=value)]",
                       "markers": ("<think>", "</think>")})
FORMATS.update({_LFM2.name: _LFM2, _LFM25.name: _LFM25})
SUPPORTED = SUPPORTED.replace(", and templates", ", LFM2 / LFM2.5 Python-style calls, and templates")

# DeepSeek V3.2 / V4 DSML: <｜DSML｜function_calls> (V4: tool_calls) around <｜DSML｜invoke name="NAME"> and
# <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter> (:mod:`.dsml`); <think> reasoning
_DSML = ToolFormat("dsml", "DeepSeek V3.2 DSML <｜DSML｜function_calls>", "<｜DSML｜function_calls>",
                   "</｜DSML｜function_calls>", "", "arguments", trigger="<｜DSML｜function_calls>",
                   think=("<think>", "</think>"), codec="dsml")
_DSML4 = ToolFormat(**{**_DSML.__dict__, "name": "dsml4", "label": "DeepSeek V4 DSML <｜DSML｜tool_calls>",
                       "call_open": "<｜DSML｜tool_calls>", "call_close": "</｜DSML｜tool_calls>",
                       "trigger": "<｜DSML｜tool_calls>", "codec": "dsml_v4"})
FORMATS.update({_DSML.name: _DSML, _DSML4.name: _DSML4})
SUPPORTED = SUPPORTED.replace(", and templates", ", DeepSeek V3.2 / V4 DSML, and templates")

# DeepSeek V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
# (:mod:`.deepseek31`, llama.cpp's autoparser); <think> reasoning; the template renders no tool list
_DS31 = ToolFormat("deepseek31", "DeepSeek V3.1 <｜tool▁calls▁begin｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                   "", "arguments", trigger="<｜tool▁calls▁begin｜>", think=("<think>", "</think>"), codec="deepseek31",
                   markers=("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"))
FORMATS[_DS31.name] = _DS31
SUPPORTED = SUPPORTED.replace(", and templates", ", DeepSeek V3.1, and templates")

# markers of formats llama.cpp handles that we do not build (source markers, as chat.cpp's
# common_chat_try_specialized_template looks for them): (needles that must all be present, name)
_UNSUPPORTED: List[Tuple[Tuple[str, ...], str]] = [
    (("[TOOL_CALLS]", "[ARGS]"), "Mistral [TOOL_CALLS]name[ARGS] (Magistral / Devstral / Mistral Small 3.2)"),
    (("<|tool_calls_section_begin|>",), "Kimi K2"),
    ((">>>all",), "Functionary v3.2"),
    (("<arg_key>",), "GLM / Ling tagged arguments"),
    (("<|START_ACTION|>",), "Command R / Cohere"),
    (("<atem:function_calls>",), "Muse Glimmer"),
    (("<｜tool▁calls▁begin｜>",), "DeepSeek R1 <｜tool▁calls▁begin｜>function<｜tool▁sep｜>NAME ```json"),
]

_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "tool1", "description": "Tool description",
    "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
                   "required": ["arg"]}}}]


def _probe_messages(args, n_calls: int = 1) -> list:
    calls = [{"id": f"call0000{i + 1}", "type": "function", "function": {"name": "tool1", "arguments": args}}
             for i in range(n_calls)]
    return [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]


@dataclass(frozen=True)
class TemplateCaps:
    """What a template does with tools (llama.cpp's ``jinja::caps``, probed by rendering)."""
    supports_tools: bool = False            # the tool list reaches the prompt
    supports_tool_calls: bool = False       # an assistant message's tool_calls are rendered
    supports_object_arguments: bool = False  # ... with arguments as an object
    supports_parallel_tool_calls: bool = False
    supports_system_role: bool = True
    call_rendering: str = ""                # the probe's rendering of tool1({"arg": "value"})


Render = Callable[..., str]   # render(messages, tools=None) -> prompt text (raises on template errors)


def _try(render: Render, messages, tools=None) -> Optional[str]:
    try:
        return render(messages, tools=tools)
    except Exception:   # a template's raise_exception, or one that cannot take the probe
        return None


def probe_caps(render: Render) -> TemplateCaps:
    """Render probe conversations (those of llama.cpp's ``caps_get``) and read what came through."""
    base = _try(render, [{"role": "user", "content": "User message"}]) or ""
    sysr = _try(render, [{"role": "system", "content": "SYSTEM_MARKER"}, {"role": "user", "content": "User message"}])
    with_tools = _try(render, [{"role": "user", "content": "User message"}], tools=_PROBE_TOOLS)
    supports_tools = with_tools is not None and "tool1" in with_tools and "tool1" not in base
    obj = _try(render, _probe_messages({"arg": "value"}), tools=_PROBE_TOOLS)
    s = _try(render, _probe_messages('{"arg": "value"}'), tools=_PROBE_TOOLS)
    # an object rendered as JSON, or in a syntax of the template's own (Gemma 4: arg:<|"|>value<|"|>)
    # (a Python dict's repr is not; LFM2.5's name(arg='value') is)
    supports_obj = obj is not None and "{'arg': 'value'}" not in obj and \
        ('"value"' in obj or (obj != s and "value" in obj))
    rendered = obj if supports_obj else s
    n_tools = (with_tools or "").count("tool1")
    calls = rendered is not None and rendered.count("tool1") > n_tools
    parallel = False
    if calls:
        two = _try(render, _probe_messages({"arg": "value"} if supports_obj else '{"arg": "value"}', 2),
                   tools=_PROBE_TOOLS)
        parallel = two is not None and two.count("tool1") > rendered.count("tool1")
    return TemplateCaps(supports_tools=supports_tools, supports_tool_calls=calls,
                        supports_object_arguments=supports_obj, supports_parallel_tool_calls=parallel,
                        supports_system_role=sysr is not None and "SYSTEM_MARKER" in sysr,
                        call_rendering=rendered or "")


def _renders(rendering: str, fmt: ToolFormat) -> bool:
    """Whether the probe's call is rendered in ``fmt`` somewhere (JSON compared as JSON, keys in
    any order; the tool list and a template's own examples come before it)."""
    marker = fmt.first_marker or '{"name"'
    start = rendering.find(marker)
    while start >= 0:
        if _call_at(rendering, start + (len(marker) if fmt.first_marker else 0), fmt):
            return True
        start = rendering.find(marker, start + 1)
    return False


def _call_at(rendering: str, pos: int, fmt: ToolFormat) -> bool:
    try:
        val, end = json.JSONDecoder().raw_decode(rendering, pos)
    except ValueError:
        return False
    calls = val if fmt.array else [val]
    if not isinstance(calls, list) or not calls:
        return False
    c = calls[0]
    if not (isinstance(c, dict) and c.get("name") == "tool1"
            and c.get(fmt.args_key) in ({"arg": "value"}, '{"arg": "value"}')):
        return False
    return not fmt.call_close or rendering.startswith(fmt.call_close, end)


def detect_format(source: str, caps: TemplateCaps) -> ToolFormat:
    """The :class:`ToolFormat` of a template (its source and :func:`probe_caps`), ``generic`` when
    it has no tool syntax; :class:`UnsupportedToolFormat` for a tool format not built here."""
    if "<|channel|>" in source:             # chat.cpp's test for GPT-OSS
        return _HARMONY
    if "'<|tool_call>call:'" in source:     # chat.cpp's test
        legacy = "{#- OpenAI Chat Completions:" not in source
        return ToolFormat(**{**_GEMMA4.__dict__, "codec": "gemma4_legacy"}) if legacy else _GEMMA4
    if all(n in source for n in ("<tool_call>", "<function=", "<parameter=")) \
            and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in source:     # chat.cpp's test
        fmt = ToolFormat(**{**_XML.__dict__, "think": ("<think>", "</think>")}) if "<think>" in source else _XML
        if "You have access to the following functions in JSONSchema format" in source:   # StepFun (chat.cpp)
            fmt = ToolFormat(**{**fmt.__dict__, "codec": "xml_calls_stepfun"})
        return fmt
    lfm2 = "<|tool_list_start|>" in source and "<|tool_list_end|>" in source     # chat.cpp's tests
    if lfm2 or ("List of tools: [" in source and "<|tool_list_start|>" not in source):
        fmt = _LFM2 if lfm2 else _LFM25
        return ToolFormat(**{**fmt.__dict__, "think": ("<think>", "</think>")}) if "<think>" in source else fmt
    if "dsml_token" in source and "DSML" in source and ("function_calls" in source or "tool_calls" in source):
        return _DSML if "function_calls" in source else _DSML4     # chat.cpp's tests (V4: no function_calls)
    if "<｜tool▁calls▁begin｜>" in source and "<｜tool▁call▁begin｜>tool1<｜tool▁sep｜>" in caps.call_rendering:
        return _DS31                        # V3.1 renders the probe's call so (R1: function<｜tool▁sep｜>tool1)
    for needles, name in _UNSUPPORTED:
        if all(n in source for n in needles):
            raise UnsupportedToolFormat(f"this model's chat template uses the {name} tool-call format, which "
                                        f"pyllama-dspark does not support; supported: {SUPPORTED}")
    if not caps.supports_tools and not caps.supports_tool_calls:
        return _GENERIC
    rendering = caps.call_rendering
    for fmt in (_HERMES, _MISTRAL, _LLAMA3):
        if rendering and _renders(rendering, fmt):
            if fmt is _HERMES and "<think>" in source and "</think>" in source:
                return ToolFormat(**{**fmt.__dict__, "think": ("<think>", "</think>")})
            return fmt
    raise UnsupportedToolFormat("this model's chat template renders tools, but its tool-call format is not one "
                                f"pyllama-dspark supports ({SUPPORTED}); its rendering of a call: "
                                f"{rendering[-200:]!r}")
