"""Telemetry samples as Prometheus metrics (``kimitui agent``) and back (``--telemetry-url``, which
also reads NVIDIA's DCGM exporter and AMD's device-metrics-exporter).

Written and read with ``prometheus_client`` (its collector types and its text parser), so any
Prometheus can scrape an agent too. Names follow Prometheus' conventions: base units (watts,
joules, bytes, celsius), ``_total`` on counters. Every GPU row carries ``gpu`` (its index on the
node), ``name`` and ``vendor``; every row carries ``node`` (the agent's host name).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kimitui.telemetry.sample import CpuPower, GpuSample, HostStats

PREFIX = "kimitui_"
# GpuSample field -> (metric name, kind, help)
GPU_FIELDS = {
    "power_w": ("gpu_power_watts", "gauge", "GPU (socket) power draw."),
    "power_cap_w": ("gpu_power_cap_watts", "gauge", "GPU power limit."),
    "energy_j": ("gpu_energy_joules", "counter", "GPU energy counter since the driver loaded."),
    "util_pct": ("gpu_utilization_percent", "gauge", "GPU compute (gfx) activity."),
    "mem_util_pct": ("gpu_memory_utilization_percent", "gauge", "GPU memory controller activity."),
    "mem_used_bytes": ("gpu_memory_used_bytes", "gauge", "GPU memory in use."),
    "mem_total_bytes": ("gpu_memory_total_bytes", "gauge", "GPU memory size."),
    "temp_c": ("gpu_temperature_celsius", "gauge", "GPU hotspot (else edge) temperature."),
}
HOST_FIELDS = {
    "cpu_power_w": ("cpu_power_watts", "gauge", "CPU package power (RAPL or amd_energy)."),
    "cpu_energy_j": ("cpu_energy_joules", "counter", "CPU package energy since the agent started."),
    "cpu_util_pct": ("cpu_utilization_percent", "gauge", "CPU utilisation over the last interval."),
    "ram_used_bytes": ("memory_used_bytes", "gauge", "Host RAM in use."),
    "ram_total_bytes": ("memory_total_bytes", "gauge", "Host RAM size."),
}


class SampleCollector:
    """A ``prometheus_client`` collector over a function returning the latest Sample (or None)."""

    def __init__(self, latest, node: str) -> None:
        self.latest = latest
        self.node = node

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sample = self.latest()
        if sample is None:
            return
        kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
        for attr, (name, kind, help_) in GPU_FIELDS.items():
            family = kinds[kind](PREFIX + name, help_, labels=["node", "gpu", "name", "vendor"])
            for g in sample.gpus:
                value = getattr(g, attr)
                if value is not None:
                    family.add_metric([self.node, str(g.index), g.name, g.vendor], float(value))
            yield family
        for attr, (name, kind, help_) in HOST_FIELDS.items():
            family = kinds[kind](PREFIX + name, help_, labels=["node"])
            value = getattr(sample, attr)
            if value is not None:
                family.add_metric([self.node], float(value))
            yield family


def render(latest, node: str) -> bytes:
    """The exposition text of the latest sample."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SampleCollector(latest, node))
    return generate_latest(registry)


@dataclass
class NodeReading:
    """One scraped node: its GPUs, CPU package power and host numbers."""

    node: str
    gpus: list[GpuSample] = field(default_factory=list)
    cpu: CpuPower = field(default_factory=CpuPower)
    host: HostStats = field(default_factory=HostStats)


def parse(text: str, default_node: str) -> list[NodeReading]:
    """Readings per node from a ``kimitui agent``'s or an NVIDIA DCGM exporter's exposition text;
    ValueError (one line) on anything else."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except Exception as e:  # the parser raises several types on garbage
        raise ValueError(f"not Prometheus text: {type(e).__name__}: {e}") from None
    names = {s.name for s in samples}
    if any(n.startswith(PREFIX) for n in names):
        return _parse_agent(samples, default_node)
    if any(n.startswith("DCGM_FI_DEV_") for n in names):
        return _parse_dcgm(samples, default_node)
    if any(_dme_name(n) in _DME for n in names):
        return _parse_dme(samples, default_node)
    raise ValueError(
        "no kimitui agent (kimitui_gpu_*), DCGM exporter (DCGM_FI_DEV_*) or AMD device-metrics-exporter "
        "(gpu_package_power, gpu_gfx_activity, ...) metrics in the text"
    )


def _parse_agent(samples, default_node: str) -> list[NodeReading]:
    gpu_by_name = {
        PREFIX + n + ("_total" if kind == "counter" else ""): attr for attr, (n, kind, _) in GPU_FIELDS.items()
    }
    host_by_name = {
        PREFIX + n + ("_total" if kind == "counter" else ""): attr for attr, (n, kind, _) in HOST_FIELDS.items()
    }
    nodes: dict[str, dict] = {}
    for s in samples:
        node = s.labels.get("node", default_node)
        if s.name in gpu_by_name:
            entry = nodes.setdefault(node, {"gpus": {}, "host": {}})
            key = int(s.labels.get("gpu", 0))
            gpu = entry["gpus"].setdefault(
                key, {"name": s.labels.get("name", "GPU"), "vendor": s.labels.get("vendor", "")}
            )
            gpu[gpu_by_name[s.name]] = s.value
        elif s.name in host_by_name:
            nodes.setdefault(node, {"gpus": {}, "host": {}})["host"][host_by_name[s.name]] = s.value
    return [_reading(node, entry["gpus"], entry["host"]) for node, entry in nodes.items()]


# NVIDIA dcgm-exporter's default counters (etc/default-counters.csv): watts, percent, MiB,
# Celsius, millijoules; rows labelled gpu, modelName and Hostname.
_DCGM = {
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", 1.0),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("power_cap_w", 1.0),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("energy_j", 1e-3),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total": ("energy_j", 1e-3),
    "DCGM_FI_DEV_GPU_UTIL": ("util_pct", 1.0),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("mem_util_pct", 1.0),
    "DCGM_FI_DEV_FB_USED": ("mem_used_bytes", 2**20),
    "DCGM_FI_DEV_FB_FREE": ("_fb_free", 2**20),
    "DCGM_FI_DEV_FB_RESERVED": ("_fb_reserved", 2**20),
    "DCGM_FI_DEV_FB_TOTAL": ("mem_total_bytes", 2**20),
    "DCGM_FI_DEV_GPU_TEMP": ("temp_c", 1.0),
}


def _gpus_by_node(
    samples,
    default_node: str,
    field,
    host_label: str,
    gpu_label: str,
    model_label: str,
    default_model: str,
    vendor: str,
) -> dict[str, dict[int, dict]]:
    """An exporter's samples grouped as {node: {gpu index: {attribute: value}}}; ``field(sample)`` gives
    (attribute, scale) for a sample the panel shows, None for any other."""
    nodes: dict[str, dict] = {}
    for s in samples:
        field_scale = field(s)
        if field_scale is None:
            continue
        attr, scale = field_scale
        node = s.labels.get(host_label) or default_node
        gpu = nodes.setdefault(node, {}).setdefault(
            int(s.labels.get(gpu_label, 0)), {"name": s.labels.get(model_label) or default_model, "vendor": vendor}
        )
        gpu[attr] = s.value * scale
    return nodes


def _parse_dcgm(samples, default_node: str) -> list[NodeReading]:
    nodes = _gpus_by_node(
        samples, default_node, lambda s: _DCGM.get(s.name), "Hostname", "gpu", "modelName", "NVIDIA GPU", "nvidia"
    )
    for gpus in nodes.values():
        for gpu in gpus.values():
            free, reserved = gpu.pop("_fb_free", None), gpu.pop("_fb_reserved", 0.0)
            if "mem_total_bytes" not in gpu and free is not None and "mem_used_bytes" in gpu:
                gpu["mem_total_bytes"] = gpu["mem_used_bytes"] + free + reserved
    return [_reading(node, gpus, {}) for node, gpus in nodes.items()]


# AMD's device-metrics-exporter (github.com/ROCm/device-metrics-exporter, docs/configuration/metricslist.md):
# watts, percent, MB (amd-smi's MiB), Celsius, microjoules; rows labelled gpu_id, card_model and
# hostname; a deployment may prefix every name (commonly ``amd_``). Package (socket) power is MI300's
# and later's, average package power MI200's; no power limit is exported.
_DME = {
    "gpu_package_power": ("power_w", 1.0),
    "gpu_average_package_power": ("_power_avg", 1.0),
    "gpu_energy_consumed": ("energy_j", 1e-6),
    "gpu_gfx_activity": ("util_pct", 1.0),
    "gpu_umc_activity": ("mem_util_pct", 1.0),
    "gpu_used_vram": ("mem_used_bytes", 2**20),
    "gpu_total_vram": ("mem_total_bytes", 2**20),
    "gpu_junction_temperature": ("temp_c", 1.0),
    "gpu_edge_temperature": ("_temp_edge", 1.0),
}


def _dme_name(name: str) -> str:
    name = name[4:] if name.startswith("amd_") else name
    return name[:-6] if name.endswith("_total") else name  # a counter's sample name


def _parse_dme(samples, default_node: str) -> list[NodeReading]:
    def field(s):
        return _DME.get(_dme_name(s.name)) if "gpu_id" in s.labels else None

    nodes = _gpus_by_node(samples, default_node, field, "hostname", "gpu_id", "card_model", "AMD GPU", "amd")
    for gpus in nodes.values():
        for gpu in gpus.values():
            avg, edge = gpu.pop("_power_avg", None), gpu.pop("_temp_edge", None)
            gpu.setdefault("power_w", avg)
            gpu.setdefault("temp_c", edge)
            for key in ("power_w", "temp_c"):
                if gpu[key] is None:
                    del gpu[key]
    return [_reading(node, gpus, {}) for node, gpus in nodes.items()]


def _reading(node: str, gpus_by_index: dict, h: dict) -> NodeReading:
    gpus = []
    for index in sorted(gpus_by_index):
        fields = dict(gpus_by_index[index])
        for key in ("mem_used_bytes", "mem_total_bytes"):
            if key in fields:
                fields[key] = int(fields[key])
        gpus.append(GpuSample(index=index, **fields))
    ram = {k: int(h[k]) for k in ("ram_used_bytes", "ram_total_bytes") if k in h}
    return NodeReading(
        node,
        gpus,
        CpuPower(h.get("cpu_power_w"), h.get("cpu_energy_j")),
        HostStats(cpu_util_pct=h.get("cpu_util_pct"), **ram),
    )


def combine(readings: list[NodeReading], label_nodes: bool) -> tuple[tuple[GpuSample, ...], CpuPower, HostStats]:
    """Several nodes as one: GPUs listed one after another (renumbered, named ``node/name`` when
    ``label_nodes``), CPU power, energy and RAM summed over the nodes that report them, CPU
    utilisation averaged."""
    gpus: list[GpuSample] = []
    for r in readings:
        for g in r.gpus:
            name = f"{r.node}/{g.name}" if label_nodes else g.name
            gpus.append(
                GpuSample(
                    len(gpus),
                    name,
                    g.vendor,
                    g.power_w,
                    g.power_cap_w,
                    g.energy_j,
                    g.util_pct,
                    g.mem_util_pct,
                    g.mem_used_bytes,
                    g.mem_total_bytes,
                    g.temp_c,
                )
            )

    def total(values):
        values = [v for v in values if v is not None]
        return sum(values) if values else None

    cpu = CpuPower(total(r.cpu.power_w for r in readings), total(r.cpu.energy_j for r in readings))
    utils = [r.host.cpu_util_pct for r in readings if r.host.cpu_util_pct is not None]
    host = HostStats(
        cpu_util_pct=sum(utils) / len(utils) if utils else None,
        ram_used_bytes=total(r.host.ram_used_bytes for r in readings),
        ram_total_bytes=total(r.host.ram_total_bytes for r in readings),
    )
    return tuple(gpus), cpu, host
