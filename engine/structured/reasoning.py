"""Where a thinking reply's reasoning ends: the constraint starts after that.

The marker is text (``</think>`` for Kimi K2, ``<|close|>think<|sep|>`` for K3, several tokens
in K3), so it is found in the bytes of the generated tokens, as the reply parsers find it in
the text (engine/text/k2.py, engine/text/xtml/reply.py); a marker split across tokens is found too.
"""

from __future__ import annotations

from typing import Callable


class ReasoningGate:
    """Open once the generated tokens have spelled ``marker``; ``feed`` one token at a time."""

    __slots__ = ("marker", "_bytes", "_tail", "open")

    def __init__(self, marker: str, token_bytes: Callable[[int], bytes]):
        self.marker = marker.encode("utf-8")
        self._bytes = token_bytes
        self._tail = b""  # the last len(marker) - 1 bytes, so a marker across tokens is seen
        self.open = False

    def feed(self, token: int) -> bool:
        """Take one generated token; True when this token completed the marker."""
        if self.open:
            return False
        buf = self._tail + self._bytes(token)
        if self.marker in buf:
            self.open = True
            self._tail = b""
            return True
        self._tail = buf[-(len(self.marker) - 1) :] if len(self.marker) > 1 else b""
        return False

    def copy(self) -> "ReasoningGate":
        g = ReasoningGate.__new__(ReasoningGate)
        g.marker, g._bytes, g._tail, g.open = self.marker, self._bytes, self._tail, self.open
        return g
