"""URLs and headers every client of an OpenAI-compatible server shares (the benchmark clients, the
TUI's remote bridge, the /metrics readers)."""

from __future__ import annotations

import os


def server_root(base_url: str) -> str:
    """The server's root URL: ``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1``
    all name the same server (vLLM's ``--base-url`` takes the root, OpenAI clients take ``/v1``);
    routes are then ``root + "/v1/..."`` and ``root + "/metrics"``."""
    root = base_url.strip().rstrip("/")
    return root.removesuffix("/v1").rstrip("/")


def request_headers(api_key: str | None, request_id: str | None = None) -> dict[str, str]:
    """JSON content type; ``Authorization: Bearer`` with ``api_key`` or ``$OPENAI_API_KEY`` (as the
    openai SDK reads it); ``x-request-id`` when given (vLLM and kimitui serve echo it)."""
    headers = {"Content-Type": "application/json"}
    key = api_key or os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if request_id:
        headers["x-request-id"] = request_id
    return headers
