"""The session's chats as plain data: what was said, in the shape ``encode_chat`` takes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class Turn:
    role: str  # "user" or "assistant"
    content: str
    reasoning: str = ""
    stats: str = ""  # the assistant's footer line (tokens, TTFT, TPOT, finish reason)


@dataclass
class Chat:
    id: int = 1
    turns: list[Turn] = field(default_factory=list)

    @property
    def title(self) -> str:
        first = next((t.content for t in self.turns if t.role == "user"), "")
        line = " ".join(first.split())
        return (line[:40] + "…") if len(line) > 40 else (line or "(empty chat)")

    def messages(self, system_prompt: str = "") -> list[dict]:
        """Chat-format messages; reasoning is kept so the renderer can decide what to drop."""
        out: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        for t in self.turns:
            m = {"role": t.role, "content": t.content}
            if t.role == "assistant" and t.reasoning:
                m["reasoning_content"] = t.reasoning
            out.append(m)
        return out


class ChatHistory:
    """Every chat of this session, newest last; ``current`` is the one on screen."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)  # per session, so chat numbers start at 1 every run
        self.chats: list[Chat] = [Chat(next(self._ids))]
        self.current: Chat = self.chats[0]

    def new(self) -> Chat:
        # An untouched chat is reused: pressing "new chat" twice should not litter the history.
        if self.current.turns:
            self.current = Chat(next(self._ids))
            self.chats.append(self.current)
        return self.current

    def select(self, chat_id: int) -> Chat:
        self.current = next(c for c in self.chats if c.id == chat_id)
        return self.current
