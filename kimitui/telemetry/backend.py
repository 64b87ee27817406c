"""The shape every telemetry backend shares, and the value checks they all need."""

from __future__ import annotations

import logging
from typing import Any, Callable

from kimitui.telemetry.sample import BackendStatus

log = logging.getLogger(__name__)

# Drivers mark "unsupported" with all-ones of the field's width; amdsmi's Python layer turns most
# of them into "N/A", but struct drift between ROCm releases lets some through as numbers.
_SENTINELS = frozenset({0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})


def number(value: Any) -> float | None:
    """The value as a float, or None for "N/A", None, booleans, NaN and all-ones sentinels."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value in _SENTINELS or value != value:
        return None
    return float(value)


class Backend:
    """Base for telemetry backends.

    A backend decides in its constructor whether it can work: ``available`` is then fixed and
    ``error`` says why not. ``read()`` is called from the sampler thread only; ``close()``
    releases the library and is safe to call twice.
    """

    name: str = "backend"

    def __init__(self) -> None:
        self.available = False
        self.error: str | None = None
        # Calls that failed at least once: logged the first time only, since an unsupported
        # reading fails identically every tick.
        self._failed_calls: set[str] = set()

    def read(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass

    @property
    def detail(self) -> str:
        """One line on what the backend sees (devices, domains) when available."""
        return ""

    def status(self) -> BackendStatus:
        """Availability and detail (or the reason it is unavailable) for ``kimitui info``."""
        if not self.available:
            return BackendStatus(self.name, False, self.error or "unavailable")
        detail = self.detail
        if self._failed_calls:
            detail += f"; unsupported: {', '.join(sorted(self._failed_calls))}"
        return BackendStatus(self.name, True, detail)

    def _unavailable(self, reason: str) -> None:
        self.available = False
        self.error = reason
        # Not a warning: most machines lack some backends; `kimitui info` shows the reason.
        log.debug("telemetry backend %s unavailable: %s", self.name, reason)

    def _call(self, label: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one library call; a failure costs that reading only, never the whole device."""
        try:
            return fn(*args)
        except Exception as exc:  # library errors of every flavour, see the vendor modules
            if label not in self._failed_calls:
                self._failed_calls.add(label)
                log.debug("%s: %s failed: %r", self.name, label, exc)
            return None


class GpuBackend(Backend):
    """Shared shape of the GPU backends: one library handle per GPU, one ``GpuSample`` each.

    Subclasses open their library, hand the handles to ``_adopt``, and provide ``_device_name``,
    ``_read_gpu`` and ``close``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._handles: list[Any] = []
        self._names: list[str] = []

    def _adopt(self, handles: list[Any], none_found: str) -> None:
        if not handles:
            self.close()
            self._unavailable(none_found)
            return
        self._handles = list(handles)
        self._names = [self._device_name(i, h) for i, h in enumerate(self._handles)]
        self.available = True

    @property
    def detail(self) -> str:
        kinds = sorted(set(self._names))
        return f"{len(self._handles)} GPU(s): {', '.join(kinds)}"

    def read(self) -> tuple:
        """One ``GpuSample`` per GPU, in the library's handle order."""
        return tuple(self._read_gpu(i, h) for i, h in enumerate(self._handles))

    def _device_name(self, index: int, handle: Any) -> str:
        raise NotImplementedError

    def _read_gpu(self, index: int, handle: Any):
        raise NotImplementedError
