"""A telemetry backend that reads other machines: ``kimitui agent`` (or NVIDIA DCGM exporter)
endpoints given by ``--telemetry-url`` (one per node). The TUI then shows the GPUs where the model runs, and
with several URLs their sum: the node or cluster total.

One scrape per URL per sampler tick, with a short timeout: a node that does not answer costs
its own rows only (kept listed as n/a), never the others' or the tick.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from kimitui.telemetry.backend import Backend
from kimitui.telemetry.exposition import NodeReading, combine, parse
from kimitui.telemetry.sample import CpuPower, GpuSample, HostStats

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0


def metrics_url(url: str) -> str:
    """``http://node:9410`` and ``http://node:9410/metrics`` both name the agent's metrics."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--telemetry-url must start with http:// or https://, got {url!r}")
    return url if urlsplit(url).path else url + "/metrics"


class RemoteTelemetry(Backend):
    name = "remote"

    def __init__(self, urls: list[str], token: str | None = None, timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        super().__init__()
        if not urls:
            raise ValueError("RemoteTelemetry needs at least one --telemetry-url")
        self.urls = [metrics_url(u) for u in urls]
        self.token = token
        self.timeout_s = timeout_s
        self._last: dict[str, list[NodeReading]] = {}  # url -> last good reading (its rows stay listed)
        self.errors: dict[str, str] = {}
        self._http = None
        self.available = True

    @property
    def detail(self) -> str:
        bad = f"; failing: {'; '.join(f'{u}: {e}' for u, e in self.errors.items())}" if self.errors else ""
        return f"{len(self.urls)} endpoint(s): {', '.join(self.urls)}{bad}"

    def _client(self):
        import httpx

        if self._http is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._http = httpx.Client(timeout=self.timeout_s, headers=headers)
        return self._http

    def scrape(self, url: str) -> list[NodeReading]:
        import httpx

        try:
            resp = self._client().get(url)
        except httpx.HTTPError as e:
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}")
        return parse(resp.text, default_node=urlsplit(url).netloc)

    def read(self) -> list:
        """GPUs of every node, then CPU power and host numbers summed over the nodes."""
        readings: list[NodeReading] = []
        for url in self.urls:
            try:
                nodes = self.scrape(url)
            except (RuntimeError, ValueError) as e:
                if self.errors.get(url) != str(e):
                    log.warning("telemetry %s failed, showing n/a: %s", url, e)
                self.errors[url] = str(e)
                nodes = [_blank(r) for r in self._last.get(url, [])]
            else:
                self.errors.pop(url, None)
                self._last[url] = nodes
            readings.extend(nodes)
        gpus, cpu, host = combine(readings, label_nodes=len(readings) > 1)
        return [gpus, cpu, host]

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


def _blank(r: NodeReading) -> NodeReading:
    return NodeReading(r.node, [GpuSample(g.index, g.name, g.vendor) for g in r.gpus], CpuPower(), HostStats())
