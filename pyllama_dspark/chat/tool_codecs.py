"""Tool-call formats whose calls are not one JSON object each, behind one interface.

Most formats (:mod:`.formats`: Hermes / Qwen, Llama 3.x, Mistral, generic) write each call as a
JSON object ``{"name": ..., "arguments": {...}}`` between fixed markers, and :mod:`.tool_grammar` /
:mod:`.parse` build and read them all.  A format whose calls look otherwise (Gemma 4's
``call:name{key:<|"|>value<|"|>}``, GPT-OSS's harmony channels with the name in the header) names a
*codec* (``ToolFormat.codec``): a module with

* ``grammar(fmt, tools, choice, parallel, think) -> Optional[ToolGrammar]``: as
  :func:`.tool_grammar.tool_grammar`;
* ``parse(text, fmt, names=None, *, partial=False, lstrip=True, calls=True) -> Reply``: as
  :func:`.parse.parse_reply` (``calls`` False: a ``tool_choice: "none"`` reply, reasoning and
  content only);
* ``adjust_messages(messages) -> messages`` (optional): the conversation as the format's template
  wants it, after :mod:`.tool_prompt`'s normalisation (GPT-OSS: ``reasoning_content`` -> ``thinking``);
* ``WANTS_TOOLS`` (optional, True): ``parse`` takes ``tools=`` (the request's tools), bound by
  :func:`parser` (Qwen3-Coder XML types each parameter's value by its schema);
* ``WANTS_PROMPT`` (optional, True): ``grammar`` and ``parse`` take ``prompt=`` (the prompt text),
  bound by :func:`grammar` / :func:`parser` (DeepSeek V3.1 reads the generation prompt's tail).

One implementation per format behind one interface, as llama.cpp's ``common/parsers/*.cpp``.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence

from pyllama_dspark.chat import deepseek31
from pyllama_dspark.chat import dsml
from pyllama_dspark.chat import gemma4
from pyllama_dspark.chat import harmony
from pyllama_dspark.chat import lfm2
from pyllama_dspark.chat import xml_calls
from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.tool_grammar import ToolGrammar, tool_grammar
from pyllama_dspark.chat.parse import Reply, parse_reply

__all__ = ["CODECS", "grammar", "parser", "adjust_messages", "adjust_prompt"]

CODECS: Dict[str, Any] = {"gemma4": gemma4, "gemma4_legacy": gemma4.LEGACY}
CODECS["harmony"] = harmony        # GPT-OSS
CODECS["lfm2"] = lfm2              # LFM2 / LFM2.5 Python-style calls
CODECS["xml_calls"] = xml_calls    # Qwen3-Coder XML (Qwen3.5, Qwen3-Coder, Nemotron 3)
CODECS["xml_calls_stepfun"] = xml_calls.STEPFUN    # ... StepFun 3.5 (its conversation trimmed)
CODECS["dsml"] = dsml             # DeepSeek V3.2 DSML
CODECS["dsml_v4"] = dsml.V4        # ... V4 (its block named tool_calls, tool results in call order)
CODECS["deepseek31"] = deepseek31  # DeepSeek V3.1 (llama.cpp's autoparser)


def _codec(fmt: Optional[ToolFormat]) -> Optional[ModuleType]:
    if fmt is None or not fmt.codec:
        return None
    return CODECS[fmt.codec]


def grammar(fmt: ToolFormat, tools: Sequence[dict], choice: Any, parallel: bool,
            think: bool = True, prompt: Optional[str] = None) -> Optional[ToolGrammar]:
    """The request's grammar in ``fmt`` (:func:`.tool_grammar.tool_grammar`'s contract); ``prompt``:
    the prompt, for a codec that reads it."""
    c = _codec(fmt)
    if c is not None and getattr(c, "WANTS_PROMPT", False):
        return c.grammar(fmt, tools, choice, parallel, think, prompt=prompt)
    return (c.grammar if c is not None else tool_grammar)(fmt, tools, choice, parallel, think)


def parser(fmt: Optional[ToolFormat], calls: bool = True, tools: Optional[Sequence[dict]] = None,
           prompt: Optional[str] = None) -> Callable[..., Reply]:
    """The reply parser of ``fmt`` (:func:`.parse.parse_reply`'s contract); ``calls`` False:
    the parser of a ``tool_choice: "none"`` reply (reasoning and content, no calls), as llama.cpp
    builds its parser without the tools there; ``tools``: the request's tools, bound for a codec
    that reads the parameters' types (``WANTS_TOOLS``: Qwen3-Coder XML); ``prompt``: the prompt,
    bound for a codec that reads it (``WANTS_PROMPT``)."""
    c = _codec(fmt)
    parse = c.parse if c is not None else parse_reply
    if tools is not None and getattr(c, "WANTS_TOOLS", False):
        parse = functools.partial(parse, tools=list(tools))
    if prompt is not None and getattr(c, "WANTS_PROMPT", False):
        parse = functools.partial(parse, prompt=prompt)
    return parse if calls else functools.partial(parse, calls=False)


def adjust_messages(fmt: Optional[ToolFormat]) -> Optional[Callable[[List[dict]], List[dict]]]:
    """The format's rewrite of the normalised conversation before rendering, or None."""
    c = _codec(fmt)
    return getattr(c, "adjust_messages", None) if c is not None else None


def adjust_prompt(fmt: Optional[ToolFormat]) -> Optional[Callable[[str], str]]:
    """The format's fix-up of the rendered prompt (llama.cpp's, after the template), or None."""
    c = _codec(fmt)
    return getattr(c, "adjust_prompt", None) if c is not None else None
