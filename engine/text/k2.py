"""Kimi chat format: messages -> prompt text / ids, and model replies -> reasoning, content, tool calls.

Shapes follow the chat_template in tokenizer_config.json of moonshotai/Kimi-K2-Instruct (and the
K2-Thinking / K2.6 thinking variants) on huggingface.co.
Messages are OpenAI-style dicts: ``{"role", "content", "reasoning_content"?, "tool_calls"?}``.
Kimi K3's format (XTML) is engine/text/xtml/render.py; engine/text/chat_format.py picks one per checkpoint.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
IM_END = "<|im_end|>"
TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN, TOOL_CALL_ARG, TOOL_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
_HEADERS = {
    "system": "<|im_system|>system<|im_middle|>",
    "user": "<|im_user|>user<|im_middle|>",
    "assistant": "<|im_assistant|>assistant<|im_middle|>",
    "tool": "<|im_system|>tool<|im_middle|>",
}
# Inserted after the first character of special-token text found in user-provided strings, so
# that text can never become a control token; removed again before encoding (U+FDD0 is a Unicode
# noncharacter, so real text does not contain it).
_MARK = "\ufdd0"


class ChatError(ValueError):
    """Messages that cannot be rendered (unknown role, unsupported content part...)."""


@dataclass(frozen=True)
class ToolCall:
    id: str  # as the model wrote it, e.g. "functions.get_weather:0"
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ParsedReply:
    reasoning: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class StreamDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# Rendering


def render_messages(
    messages: list[dict],
    tokenizer=None,
    *,
    thinking: bool | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    default_system: str | None = DEFAULT_SYSTEM_PROMPT,
    template: str | None = None,
    preserve_reasoning: bool = False,
    use_checkpoint_template: bool = True,
) -> str:
    """Prompt text for ``messages``.

    ``template`` (Jinja) wins; else the tokenizer's checkpoint template when it has one and
    ``use_checkpoint_template``; else the built-in Kimi K2 renderer. ``thinking``: None renders
    K2-Instruct style, True opens ``<think>`` in the generation prompt, False closes it at once.
    """
    tools = deep_sort(tools) if tools else None
    if template is None and use_checkpoint_template and tokenizer is not None:
        template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        kwargs: dict[str, Any] = {"default_system": default_system, "preserve_reasoning": preserve_reasoning}
        if thinking is not None:
            kwargs["thinking"] = thinking
        return render_with_template(
            template, messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )

    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    out: list[str] = []
    if tools:
        out.append(f"<|im_system|>tool_declare<|im_middle|>{_tojson(tools)}{IM_END}")
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in _HEADERS:
            raise ChatError(f"unknown message role: {role!r} (expected one of {', '.join(_HEADERS)})")
        if i == 0 and role != "system" and default_system:
            out.append(f"{_HEADERS['system']}{default_system}{IM_END}")
        out.append(_HEADERS[role])
        if role == "assistant" and thinking is not None:
            reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
            if not preserve_reasoning and i < last_user:
                reasoning = ""  # K2-Thinking drops reasoning of finished turns
            out.append(f"{THINK_OPEN}{reasoning}{THINK_CLOSE}")
        out.append(content_text(m.get("content")))
        if role == "assistant" and m.get("tool_calls"):
            out.append(TOOL_CALLS_BEGIN)
            for j, call in enumerate(m["tool_calls"]):
                fn = call["function"]
                call_id = call.get("id") or f"functions.{fn['name']}:{j}"
                args = fn["arguments"] if isinstance(fn["arguments"], str) else _tojson(fn["arguments"])
                out.append(f"{TOOL_CALL_BEGIN}{call_id}{TOOL_CALL_ARG}{args}{TOOL_CALL_END}")
            out.append(TOOL_CALLS_END)
        out.append(IM_END)
    if add_generation_prompt:
        out.append(_HEADERS["assistant"])
        if thinking is not None:
            out.append(THINK_OPEN if thinking else THINK_OPEN + THINK_CLOSE)
    return "".join(out)


def render_with_template(
    template_str: str,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Render a checkpoint's Jinja ``chat_template`` in a sandbox (transformers-compatible)."""
    return _compile(template_str).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
    )


def encode_chat(messages: list[dict], tokenizer, **render_kwargs: Any) -> list[int]:
    """Prompt ids. Structural tokens are encoded by id; special-token text inside message
    content or tools stays plain text. Takes the keyword arguments of ``render_messages``."""
    specials = tokenizer.special_tokens
    pattern = _special_regex(frozenset(specials))
    messages = _defang(messages, pattern)
    if render_kwargs.get("tools"):
        render_kwargs["tools"] = _defang(render_kwargs["tools"], pattern)
    text = render_messages(messages, tokenizer, **render_kwargs)
    ids: list[int] = []
    pos = 0
    for match in pattern.finditer(text) if pattern else ():
        if match.start() > pos:
            ids += tokenizer.encode(text[pos : match.start()].replace(_MARK, ""))
        ids.append(specials[match.group()])
        pos = match.end()
    if pos < len(text):
        ids += tokenizer.encode(text[pos:].replace(_MARK, ""))
    return ids


def chat_reply_special_ids(tokenizer) -> list[int]:
    """Special tokens a reply parser needs to see (thinking and tool-call tags); generate with
    ``SamplingParams(skip_special_tokens=True, keep_special_token_ids=...)`` so other special
    tokens (reserved slots, end markers) never reach the text."""
    tags = (THINK_OPEN, THINK_CLOSE, *_SECTION_BEGINS, *_SECTION_ENDS, TOOL_CALL_BEGIN, TOOL_CALL_ARG, TOOL_CALL_END)
    ids = [tokenizer.token_to_id(t) for t in dict.fromkeys(tags)]
    return [i for i in ids if i is not None and i in tokenizer.special_ids]


def chat_stop_token_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn: ``<|im_end|>`` first, then the tokenizer's EOS ids."""
    ids = [i for i in [tokenizer.token_to_id(IM_END)] if i is not None and i in tokenizer.special_ids]
    for i in tokenizer.eos_token_ids:
        if i not in ids:
            ids.append(i)
    return ids


def content_text(content: Any, where: str | None = None, error: type[ValueError] = ChatError) -> str:
    """A message's ``content`` (None, a string, or a list of ``{"type": "text"}`` parts) as one string.
    Other parts raise ``error``, prefixed with ``where`` (e.g. ``messages[2].content``) when given;
    the K3 renderer (``engine.xtml``) passes its own error class."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            prefix = f"{where}: " if where else ""
            raise error(f"{prefix}content part of type {kind!r} is not supported (text only)")
        parts.append(part["text"])
    return "".join(parts)


def _tojson(
    obj: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same defaults as transformers' chat-template `tojson` (jinja2's own escapes <, >, &, ').
    return json.dumps(obj, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def deep_sort(obj: Any) -> Any:
    """``obj`` with every dict's keys sorted, recursively. Kimi's apply_chat_template
    (tokenization_kimi.py) deep-sorts the keys of ``tools`` before rendering; K3's renderer does too."""
    if isinstance(obj, dict):
        return {k: deep_sort(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


def _compile(template_str: str):

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template_str)


@lru_cache(maxsize=8)
def _special_regex(specials: frozenset[str]) -> re.Pattern | None:
    if not specials:
        return None
    # Longest first so a token that is a prefix of another never wins.
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=lambda s: (-len(s), s))))


def _defang(obj: Any, pattern: re.Pattern | None) -> Any:
    if pattern is None:
        return obj
    if isinstance(obj, str):
        return pattern.sub(lambda m: m.group()[0] + _MARK + m.group()[1:], obj)
    if isinstance(obj, dict):
        return {k: _defang(v, pattern) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_defang(v, pattern) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------
# Parsing replies

_TOOL_CALL_RE = re.compile(
    re.escape(TOOL_CALL_BEGIN)
    + r"\s*(?P<id>.*?)\s*"
    + re.escape(TOOL_CALL_ARG)
    + r"(?P<args>.*?)"
    + re.escape(TOOL_CALL_END),
    re.DOTALL,
)
# Some K2 builds emit the singular section tag; vLLM's kimi_k2 parser accepts both.
_SECTION_BEGINS = (TOOL_CALLS_BEGIN, "<|tool_call_section_begin|>")
_SECTION_ENDS = (TOOL_CALLS_END, "<|tool_call_section_end|>")


def parse_reply(text: str, *, started_in_thinking: bool = False) -> ParsedReply:
    """Split a complete reply into reasoning, content and tool calls.

    ``started_in_thinking``: the prompt already ended with ``<think>`` (thinking generation
    prompt), so the reply begins inside the reasoning block.
    """
    parser = ReplyStreamParser(started_in_thinking=started_in_thinking)
    parser.feed(text)
    parser.finish()
    return parser.result()


def _tool_call(raw_id: str, args: str) -> ToolCall:
    # "functions.get_weather:0" -> name "get_weather"
    name = raw_id[len("functions.") :] if raw_id.startswith("functions.") else raw_id
    name = name.rsplit(":", 1)[0] if ":" in name else name
    return ToolCall(id=raw_id, name=name, arguments_json=args.strip())


def _held_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``buf`` that could still grow into one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buf)), best, -1):
            if buf.endswith(marker[:n]):
                best = n
                break
    return best


class StreamParserBase:
    """What the K2 (``ReplyStreamParser``) and K3 (``engine.xtml_reply.XtmlReplyParser``) reply
    parsers share: the text buffer, the totals so far and the feed/finish/result surface. A subclass
    implements ``_step``, which consumes ``self._buf`` from ``self._state`` and returns the delta."""

    def __init__(self, state: str):
        self._state = state
        self._buf = ""
        self._calls_seen = 0
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> StreamDelta:
        """Consume the next piece of reply text."""
        self._buf += text
        return self._step(final=False)

    def finish(self) -> StreamDelta:
        """End of reply: release held-back text (an unfinished tool call is dropped)."""
        return self._step(final=True)

    def result(self) -> ParsedReply:
        return ParsedReply(self.reasoning, self.content, list(self.tool_calls))

    def _step(self, final: bool) -> StreamDelta:
        raise NotImplementedError


class ReplyStreamParser(StreamParserBase):
    """Incremental ``parse_reply``: ``feed`` text deltas, get reasoning/content/tool-call deltas.

    Text that might be the start of a tag is held back until it is decided.
    """

    def __init__(self, started_in_thinking: bool = False):
        super().__init__("reasoning" if started_in_thinking else "start")

    def _step(self, final: bool) -> StreamDelta:
        reasoning, content, calls = [], [], []
        while True:
            buf, state = self._buf, self._state
            if state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buf, self._state = stripped[len(THINK_OPEN) :], "reasoning"
                elif THINK_OPEN.startswith(stripped) and not final:
                    break
                else:
                    self._state = "content"
            elif state == "reasoning":
                idx = buf.find(THINK_CLOSE)
                if idx >= 0:
                    reasoning.append(buf[:idx])
                    self._buf, self._state = buf[idx + len(THINK_CLOSE) :], "content"
                    continue
                keep = 0 if final else _held_suffix(buf, (THINK_CLOSE,))
                reasoning.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                break
            elif state == "content":
                hits = [(buf.find(m), m) for m in (*_SECTION_BEGINS, IM_END)]
                hits = [h for h in hits if h[0] >= 0]
                if hits:
                    idx, marker = min(hits)
                    content.append(buf[:idx])
                    self._buf = buf[idx + len(marker) :]
                    self._state = "done" if marker == IM_END else "tools"
                    continue
                keep = 0 if final else _held_suffix(buf, (*_SECTION_BEGINS, IM_END))
                content.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                break
            elif state == "tools":
                ends = [i for i in (buf.find(m) for m in _SECTION_ENDS) if i >= 0]
                section = buf[: min(ends)] if ends else buf
                found = list(_TOOL_CALL_RE.finditer(section))
                for m in found[self._calls_seen :]:
                    calls.append(_tool_call(m.group("id"), m.group("args")))
                self._calls_seen = len(found)
                if ends:
                    end = min(ends)
                    marker = next(m for m in _SECTION_ENDS if buf.startswith(m, end))
                    self._buf, self._state, self._calls_seen = buf[end + len(marker) :], "content", 0
                    continue
                if final:
                    self._buf = ""
                break
            else:  # "done": anything after <|im_end|> is not part of the reply
                self._buf = ""
                break
        delta = StreamDelta("".join(reasoning), "".join(content), calls)
        self.reasoning += delta.reasoning
        self.content += delta.content
        self.tool_calls += calls
        return delta
