"""Split streamed reply text into thinking and answer at ``<think>`` / ``</think>`` tags.

Servers without a reasoning parser send a thinking model's reasoning inline in ``content``. Tags
may arrive cut across chunks, so a tail that could still become a tag is held back until the
next chunk decides. Templates that open the thinking block in the prompt (DeepSeek-R1 style)
make the reply start inside it: a ``</think>`` before any ``<think>`` turns what came so far
into thinking.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self._thinking = False
        self._seen_tag = False
        self._pending = ""

    def feed(self, text: str) -> None:
        buf = self._pending + text
        self._pending = ""
        while buf:
            tag = CLOSE if self._thinking else OPEN
            i = buf.find(tag)
            if not self._thinking and not self._seen_tag:
                j = buf.find(CLOSE)
                if j != -1 and (i == -1 or j < i):  # the block was opened by the prompt
                    self.reasoning += self.content + buf[:j]
                    self.content = ""
                    buf = buf[j + len(CLOSE) :]
                    self._seen_tag = True
                    continue
            if i == -1:
                keep = _partial_tag_len(buf, (tag, CLOSE) if not self._seen_tag else (tag,))
                self._emit(buf[: len(buf) - keep])
                self._pending = buf[len(buf) - keep :]
                return
            self._emit(buf[:i])
            buf = buf[i + len(tag) :]
            self._thinking = not self._thinking
            self._seen_tag = True

    def finish(self) -> None:
        self._emit(self._pending)
        self._pending = ""

    def _emit(self, text: str) -> None:
        if self._thinking:
            self.reasoning += text
        else:
            self.content += text


def _partial_tag_len(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``buf`` that is the start of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), 0, -1):
            if buf.endswith(tag[:n]):
                best = max(best, n)
                break
    return best
