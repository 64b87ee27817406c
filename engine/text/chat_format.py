"""One chat API over the checkpoint's chat format: Kimi K2's template or Kimi K3's XTML.

The format is decided by the tokenizer the checkpoint ships (K3's has the XTML markers
``<|open|>``, ``<|sep|>``, ``<|close|>`` and ``<|end_of_msg|>``), never by a flag, so the
library, the server and the TUI all call the same ``encode`` / ``reply_parser`` / stop ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kimitui.engine.text.k2 import ReplyStreamParser, chat_reply_special_ids, chat_stop_token_ids, encode_chat
from kimitui.engine.text.xtml.options import resolve_effort, response_format_type, tool_choice_name
from kimitui.engine.text.xtml.render import END_OF_MSG, MARKERS, build_segments, encode_segments
from kimitui.engine.text.xtml.reply import XtmlReplyParser

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatPrompt:
    """Prompt ids, and whether the prompt left the reply inside the thinking channel."""

    ids: list[int]
    started_in_thinking: bool
    note: str | None = None  # one line for the user (an option this format ignores)


class ChatFormat:
    """Messages -> prompt ids, and the stop ids and parser for the reply."""

    name = ""
    supports_thinking_effort = False

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(
        self,
        messages: list[dict],
        *,
        thinking: bool | None = None,
        tools: list[dict] | None = None,
        thinking_effort: str | None = None,
        preserve_thinking: bool | None = None,
        tool_choice: str | dict | None = None,
        response_format: dict | None = None,
        reasoning_effort: str | None = None,
    ) -> ChatPrompt:
        """Prompt ids. ``tool_choice`` / ``response_format`` / ``reasoning_effort`` are OpenAI's
        request fields; a format renders what its model was trained with and ignores the rest
        (``ChatPrompt.note`` says so). Bad values raise ``engine.xtml_options.OptionError``."""
        raise NotImplementedError

    def reply_parser(self, started_in_thinking: bool):
        """A fresh stream parser (``feed`` / ``finish`` / ``result``) for one reply."""
        raise NotImplementedError

    def stop_token_ids(self) -> list[int]:
        raise NotImplementedError

    def keep_special_ids(self) -> list[int]:
        """Special tokens the reply parser must see in the text (generate with skip_special_tokens)."""
        return []


class K2ChatFormat(ChatFormat):
    """Kimi K2.x: ``<|im_user|>``-style turns, ``<think>`` reasoning, K2 tool-call sections."""

    name = "kimi-k2"

    def encode(
        self,
        messages,
        *,
        thinking=None,
        tools=None,
        thinking_effort=None,
        preserve_thinking=None,
        tool_choice=None,
        response_format=None,
        reasoning_effort=None,
    ):
        # K2's chat template (tokenizer_config.json of moonshotai/Kimi-K2-*) has no thinking effort,
        # tool choice or response format: none of them changes the prompt. tool_choice "none"
        # leaves the tools out, as this server always did for K2; "required" or a named function
        # declares them as "auto" does (constrained decoding enforces the choice).
        tool_choice_name(tool_choice)  # validates, as for K3
        kind = response_format_type(response_format)
        options = (
            ("thinking_effort", thinking_effort),
            ("reasoning_effort", reasoning_effort),
            ("response_format", None if kind == "text" else kind),
        )
        ignored = [f"{k}={v!r}" for k, v in options if v is not None]
        note = None
        if ignored:
            note = (
                f"{', '.join(ignored)} not rendered: this checkpoint uses Kimi K2's chat format, "
                "which has no such option"
            )
            log.info(note)
        if tool_choice == "none":
            tools = None
        ids = encode_chat(
            messages, self.tokenizer, thinking=thinking, tools=tools, preserve_reasoning=bool(preserve_thinking)
        )
        think_id = self.tokenizer.token_to_id("<think>")
        return ChatPrompt(ids, bool(ids) and think_id is not None and ids[-1] == think_id, note)

    def reply_parser(self, started_in_thinking):
        return ReplyStreamParser(started_in_thinking=started_in_thinking)

    def stop_token_ids(self):
        return chat_stop_token_ids(self.tokenizer)

    def keep_special_ids(self):
        return chat_reply_special_ids(self.tokenizer)


class XtmlChatFormat(ChatFormat):
    """Kimi K3.x: XTML (engine/text/xtml/render.py); thinking on and effort ``max`` unless told otherwise.
    ``reasoning_effort`` maps onto thinking and its effort (engine/text/xtml/options.py)."""

    name = "xtml"
    supports_thinking_effort = True

    def encode(
        self,
        messages,
        *,
        thinking=None,
        tools=None,
        thinking_effort=None,
        preserve_thinking=None,
        tool_choice=None,
        response_format=None,
        reasoning_effort=None,
    ):
        thinking, effort = resolve_effort(thinking, thinking_effort, reasoning_effort)
        segments = build_segments(
            messages,
            tools=tools,
            thinking=thinking,
            thinking_effort=effort,
            preserve_thinking=True if preserve_thinking is None else preserve_thinking,
            tool_choice=tool_choice,
            response_format=response_format,
        )
        return ChatPrompt(encode_segments(segments, self.tokenizer), thinking)

    def reply_parser(self, started_in_thinking):
        return XtmlReplyParser(started_in_thinking=started_in_thinking)

    def stop_token_ids(self):
        # <|end_of_msg|> ends a K3 turn (generation_config's eos), then the tokenizer's EOS ids.
        return list(dict.fromkeys([self.tokenizer.token_to_id(END_OF_MSG), *self.tokenizer.eos_token_ids]))


def is_xtml_tokenizer(tokenizer) -> bool:
    return all(tokenizer.token_to_id(m) is not None for m in MARKERS)


def chat_format_for(tokenizer) -> ChatFormat:
    """The chat format of the checkpoint ``tokenizer`` belongs to."""
    return XtmlChatFormat(tokenizer) if is_xtml_tokenizer(tokenizer) else K2ChatFormat(tokenizer)
