"""`kimitui agent` and `--telemetry-url`: fake GPU backends served as Prometheus metrics by the
agent's HTTP server, read back by the RemoteTelemetry backend; several agents summed."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from kimitui.telemetry import Backend, CpuPower, GpuSample, HostStats, TelemetrySampler
from kimitui.telemetry.agent import AgentServer
from kimitui.telemetry.exposition import parse, render
from kimitui.telemetry.remote import RemoteTelemetry, metrics_url


class FakeNodeGpus(Backend):
    """Two MI355X-like GPUs whose power and energy move with every read."""

    name = "fakegpu"

    def __init__(self, base_w: float) -> None:
        super().__init__()
        self.available = True
        self.base_w = base_w
        self.reads = 0

    def read(self):
        self.reads += 1
        return tuple(
            GpuSample(
                i,
                "AMD Instinct MI355X",
                "amd",
                power_w=self.base_w + i,
                power_cap_w=1400.0,
                energy_j=1000.0 * self.reads + i,
                util_pct=87.0,
                mem_used_bytes=200 * 2**30,
                mem_total_bytes=288 * 2**30,
                temp_c=71.0,
            )
            for i in range(2)
        )


class FakeCpu(Backend):
    name = "fakecpu"

    def __init__(self, watts: float) -> None:
        super().__init__()
        self.available = True
        self.watts = watts

    def read(self):
        return CpuPower(power_w=self.watts, energy_j=self.watts * 10)


class FakeHost(Backend):
    name = "fakehost"

    def __init__(self) -> None:
        super().__init__()
        self.available = True

    def read(self):
        return HostStats(cpu_util_pct=40.0, ram_used_bytes=100 * 2**30, ram_total_bytes=1024 * 2**30)


@pytest.fixture
def agents():
    started = []

    def start(base_w: float, node: str, token: str | None = None) -> AgentServer:
        sampler = TelemetrySampler(interval_s=0.05, backends=[FakeNodeGpus(base_w), FakeCpu(300.0), FakeHost()])
        sampler.sample_now()
        server = AgentServer(sampler.latest, "127.0.0.1", 0, token=token, node=node).start()
        started.append((server, sampler))
        return server

    yield start
    for server, sampler in started:
        server.stop()
        sampler.stop()


def test_exposition_round_trip_keeps_every_reading():
    s = TelemetrySampler(interval_s=1, backends=[FakeNodeGpus(500.0), FakeCpu(250.0), FakeHost()]).sample_now()
    text = render(lambda: s, "gpu-node-1").decode()
    assert 'kimitui_gpu_power_watts{gpu="1",name="AMD Instinct MI355X",node="gpu-node-1",vendor="amd"} 501.0' in text
    assert "kimitui_gpu_energy_joules_total" in text and "kimitui_cpu_power_watts" in text
    (node,) = parse(text, default_node="x")
    assert node.node == "gpu-node-1"
    assert node.gpus == list(s.gpus)
    assert (node.cpu.power_w, node.cpu.energy_j) == (250.0, 2500.0)
    assert node.host.ram_total_bytes == 1024 * 2**30 and node.host.cpu_util_pct == 40.0


def test_parse_rejects_other_text():
    with pytest.raises(ValueError, match="no kimitui agent"):
        parse("# TYPE foo gauge\nfoo 1\n", "n")
    with pytest.raises(ValueError, match="not Prometheus text"):
        parse("{ this is json }", "n")


def test_agent_read_back_by_telemetry_url(agents):
    agent = agents(700.0, "node-a")
    assert httpx.get(agent.url + "/health").text == "ok\n"
    sampler = TelemetrySampler(interval_s=1, backends=[RemoteTelemetry([agent.url])])
    first = sampler.sample_now()
    assert [g.power_w for g in first.gpus] == [700.0, 701.0]
    assert [g.name for g in first.gpus] == ["AMD Instinct MI355X"] * 2  # one node: names unchanged
    assert first.gpus[0].power_cap_w == 1400.0 and first.gpus[0].mem_total_bytes == 288 * 2**30
    assert first.cpu_power_w == 300.0 and first.ram_total_bytes == 1024 * 2**30
    sampler.stop()


def test_several_agents_are_summed_and_named_by_node(agents):
    a, b = agents(500.0, "node-a"), agents(600.0, "node-b")
    sample = TelemetrySampler(interval_s=1, backends=[RemoteTelemetry([a.url, b.url + "/metrics"])]).sample_now()
    assert [g.index for g in sample.gpus] == [0, 1, 2, 3]
    assert [g.name for g in sample.gpus] == ["node-a/AMD Instinct MI355X"] * 2 + ["node-b/AMD Instinct MI355X"] * 2
    assert sum(g.power_w for g in sample.gpus) == 500 + 501 + 600 + 601
    assert sample.cpu_power_w == 600.0  # both nodes' CPU packages
    assert sample.ram_total_bytes == 2048 * 2**30


def test_token_is_required_and_a_dead_node_keeps_its_rows_as_na(agents):
    a = agents(500.0, "node-a", token="s3cret")
    assert httpx.get(a.url + "/metrics").status_code == 401
    assert httpx.get(a.url + "/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    remote = RemoteTelemetry([a.url], token="s3cret")
    sampler = TelemetrySampler(interval_s=1, backends=[remote])
    assert [g.power_w for g in sampler.sample_now().gpus] == [500.0, 501.0]
    a.stop()  # the node goes away: its GPUs stay listed, every reading n/a
    gone = sampler.sample_now()
    assert [(g.index, g.power_w) for g in gone.gpus] == [(0, None), (1, None)]
    assert a.url + "/metrics" in remote.errors
    assert "failing" in remote.status().detail


def test_bad_urls_are_one_line_errors():
    with pytest.raises(ValueError, match="must start with http"):
        metrics_url("node:9400")
    assert metrics_url("http://n:9400/") == "http://n:9400/metrics"
    assert metrics_url("http://n:9400/custom") == "http://n:9400/custom"


def test_agent_command_help_lists_its_flags():
    out = subprocess.run(
        [sys.executable, "-m", "kimitui.cli", "agent", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--host", "--port", "--token", "--interval"):
        assert flag in out.stdout


def test_dcgm_exporter_text_in_si_units():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "fixtures" / "dcgm_exporter.txt").read_text()
    (node,) = parse(text, default_node="x")
    assert node.node == "h200-node"
    g0, g1 = node.gpus
    assert (g0.index, g0.name, g0.vendor) == (0, "NVIDIA H200", "nvidia")
    assert (g0.power_w, g0.util_pct, g0.temp_c) == (512.25, 97.0, 54.0)
    assert g0.energy_j == pytest.approx(123456.789)  # mJ -> J
    assert g0.mem_used_bytes == 133120 * 2**20 and g0.mem_total_bytes == (133120 + 10240) * 2**20
    assert g1.power_w == 498.5 and node.cpu.power_w is None


def test_amd_device_metrics_exporter_text_in_si_units():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "fixtures" / "amd_device_metrics_exporter.txt").read_text()
    mi355, mi210 = parse(text, default_node="x")
    assert mi355.node == "mi355x-node" and mi210.node == "mi210-node"
    g0, g1 = mi355.gpus
    assert (g0.index, g0.name, g0.vendor) == (0, "AMD Instinct MI355X", "amd")
    # socket (package) power wins over gpu_power_usage; no power limit is exported
    assert (g0.power_w, g0.util_pct, g0.mem_util_pct, g0.temp_c, g0.power_cap_w) == (1187.5, 96.0, 64.0, 71.0, None)
    assert g0.energy_j == pytest.approx(9.876e6)  # uJ -> J
    assert g0.mem_used_bytes == 262144 * 2**20 and g0.mem_total_bytes == 294912 * 2**20
    assert (g1.power_w, g1.util_pct, g1.mem_used_bytes) == (1203.0, 91.0, None)
    (old,) = mi210.gpus
    assert (old.power_w, old.temp_c) == (300.0, 45.0)  # MI200: average package power, edge temperature
    # a deployment that prefixes the names reads the same
    prefixed = "\n".join(
        line.replace("gpu_", "amd_gpu_", 1) if line.startswith("gpu_") else line for line in text.splitlines()
    )
    assert [g.power_w for g in parse(prefixed, "x")[0].gpus] == [1187.5, 1203.0]
