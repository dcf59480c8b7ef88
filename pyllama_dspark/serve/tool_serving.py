"""Tool calls on ``/v1/chat/completions``: a request with tools -> its prompt and grammar
(:func:`tool_prompt`), and its reply -> ``message.tool_calls`` / streaming ``delta.tool_calls``
(:class:`ToolReply`), as llama-server ``--jinja`` answers them.

The prompt, the grammar and the parse are :mod:`pyllama_dspark.chat.tool_request`'s (shared with
the ``DSpark`` class).  Here: the errors as HTTP errors (a template whose tool format is not built:
400 naming it; a tool schema the converter cannot do: 400), the reply's text from its tokens (the
format's control tokens rendered, as llama-server renders its "preserved tokens"), and llama-server's
``finish_reason``: "tool_calls" when the reply ended by itself and holds calls, "length" when it was
cut (its calls then carry the arguments written so far, as llama-server's lenient parse gives them).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from pyllama_dspark.decode.cycle import Done
from pyllama_dspark.serve.oai_errors import RequestError
from pyllama_dspark.chat.tool_prompt import tool_chat_for
from pyllama_dspark.chat.parse import Reply, ReplyText, message_json
from pyllama_dspark.chat.tool_request import ToolPlan, ToolSchemaError, UnsupportedToolFormat, plan_tools

__all__ = ["tool_prompt", "ToolReply", "render_prompt"]


def render_prompt(target, req) -> ToolPlan:
    """The :class:`ToolPlan` of a chat request with tool fields; RequestError (400)."""
    tf = req.tools
    try:
        return plan_tools(tool_chat_for(target), req.messages, tf.tools, tf.choice, tf.parallel, tf.template_kwargs)
    except UnsupportedToolFormat as e:
        raise RequestError(f"tools cannot be honoured: {e}", param="tools") from None
    except ToolSchemaError as e:
        raise RequestError(f"tools: {e}", param="tools") from None
    except ValueError as e:
        raise RequestError(f"cannot apply the chat template: {e}", param="messages") from None


def tool_prompt(pool, req) -> Tuple[ToolPlan, List[int], Any]:
    """(plan, prompt token ids, the decoder's grammar: GBNF text, a LazyGrammar the caller closes, or
    None) of a chat request with tool fields; RequestError."""
    target = pool.front.target
    plan = render_prompt(target, req)
    tokens = target.tokenize(plan.prompt, add_special=not plan.added_special, parse_special=True)
    if not tokens:
        raise RequestError("the prompt is empty after tokenization", param="messages")
    if len(tokens) >= pool.n_ctx:
        raise RequestError(f"request ({len(tokens)} tokens) exceeds the available context size ({pool.n_ctx} "
                           "tokens), try increasing it", type="exceed_context_size_error")
    try:
        grammar = plan.compile(target)
    except ValueError as e:   # GrammarError: the tools' grammar does not compile (a converter bug)
        raise RequestError(f"tools: the grammar of these tools is refused by llama.cpp: {e}", param="tools") from None
    return plan, tokens, grammar


class ToolReply:
    """The reply of one request with tools, token by token (streaming) or at its end."""

    def __init__(self, plan: ToolPlan, target, stop: Sequence[str] = ()):
        self.plan = plan
        self.text = ReplyText(target.token_to_piece, target.is_eog, plan.special_ids(target), stop)
        self.differ = plan.differ()

    def deltas(self, tokens) -> List[dict]:
        """The ``delta`` objects of newly emitted tokens (content, reasoning, tool calls)."""
        text = self.text.push(tokens)
        if self.differ is None:
            return []
        return self.differ.update(text)[1]

    def finish(self, done: Done, streamed: bool) -> Tuple[Optional[Reply], List[dict], str]:
        """(the parsed reply (None without parsing), the last deltas when streaming, finish_reason)."""
        if self.differ is None:
            return None, [], done.finish_reason
        if not streamed:
            self.text.push(done.tokens)
        text = self.text.finish()
        reply, deltas = self.differ.finish(text, cut=done.finish_reason == "length")
        reason = "tool_calls" if reply.calls and done.finish_reason == "stop" else done.finish_reason
        return reply, deltas if streamed else [], reason

    @staticmethod
    def message(reply: Reply) -> dict:
        return message_json(reply)
