"""Which of the node's GPUs the engine uses, and in which order, for the GPU telemetry backends.

The vendor libraries (amdsmi, NVML) list every GPU of the node, while the engine sees only those
its runtime's ``*_VISIBLE_DEVICES`` leave, renumbered, and uses the first ``--gpus`` of them.
Summing all of them would report e.g. twice the power of a ``--gpus 4`` run on an 8-GPU node.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)


def visible_tokens(variable: str) -> list[str] | None:
    """The comma-separated entries of ``variable``; None when it is unset (every GPU is visible).

    An empty value hides every GPU, as CUDA and HIP treat it.
    """
    value = os.environ.get(variable)
    if value is None:
        return None
    return [token.strip() for token in value.split(",") if token.strip()]


def select(
    tokens: list[str] | None,
    devices: Sequence[Any],
    variable: str,
    uuid_of: Callable[[Any], str | None] = lambda device: None,
) -> list[Any]:
    """The entries of ``devices`` that ``tokens`` name, in the tokens' order.

    An entry is an index into ``devices`` or a UUID prefix (``GPU-...``, as CUDA and ROCr accept a
    unique prefix). An index out of range, an unknown or ambiguous UUID is dropped with a warning
    naming ``variable``: the telemetry then undercounts rather than stopping the TUI.
    """
    if tokens is None:
        return list(devices)
    chosen: list[Any] = []
    for token in tokens:
        device = _resolve(token, devices, uuid_of)
        if isinstance(device, str):
            log.warning("%s=%s: %s; telemetry leaves it out", variable, ",".join(tokens), device)
        elif any(device is seen for seen in chosen):
            log.warning("%s lists %r twice; telemetry counts it once", variable, token)
        else:
            chosen.append(device)
    return chosen


def _resolve(token: str, devices: Sequence[Any], uuid_of: Callable[[Any], str | None]) -> Any:
    """The device ``token`` names, or a string saying why none."""
    if token.lstrip("-").isdigit():
        index = int(token)
        if 0 <= index < len(devices):
            return devices[index]
        return f"index {index} is out of range ({len(devices)} GPU(s) there)"
    prefix = token.lower()
    matches = [d for d in devices if (uuid_of(d) or "").lower().startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    return f"{'no' if not matches else 'more than one'} GPU has a UUID starting {token!r}"


def first(devices: list[Any], gpus: int | None, what: str) -> list[Any]:
    """The first ``gpus`` devices (the ones ``--gpus N`` runs on); all of them when None."""
    if gpus is None:
        return devices
    if gpus > len(devices):
        log.warning("telemetry asked for %d GPU(s) but %s shows %d", gpus, what, len(devices))
    return devices[: max(gpus, 0)]


def engine_pci_bus_ids() -> list[tuple[int, int, int]] | None:
    """(domain, bus, device) of each GPU torch has opened, in torch's order; None if unknown.

    Only when torch is already imported and its CUDA/HIP runtime already initialised: this must
    not initialise the runtime itself (that costs seconds and memory on every GPU).
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return None
        ids = []
        for index in range(cuda.device_count()):
            props = cuda.get_device_properties(index)
            # pci_domain_id is 0 on every single-segment node; some torch builds lack it.
            domain = int(getattr(props, "pci_domain_id", 0) or 0)
            ids.append((domain, int(props.pci_bus_id), int(props.pci_device_id)))
        return ids
    except Exception as exc:  # torch before the pci_* properties: AttributeError
        log.debug("torch PCI bus ids unavailable: %r", exc)
        return None
