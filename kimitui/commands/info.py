"""`kimitui info`: detected devices, telemetry backends (and why one is missing), versions.

Also the demo checkpoint's path and, with --model, where the experts would live. Plain text;
never imports textual."""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys

from kimitui.commands.engine_flags import cpu_offload_arg


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``info`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "info", help="detected devices, telemetry backends, versions", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="also show where this checkpoint's experts would live (config.json only)",
    )
    p.add_argument("--gpus", type=int, default=argparse.SUPPRESS, metavar="N", help="devices for the placement")
    p.add_argument("--cpu-offload", type=cpu_offload_arg, default=argparse.SUPPRESS, metavar="auto|none|N")
    p.add_argument("--gpu-memory-gb", type=float, default=argparse.SUPPRESS, metavar="G")
    p.add_argument("--numa", choices=["auto", "off"], default=argparse.SUPPRESS, help="policy to report")
    p.set_defaults(func=run)
    return p


def _version(module: str) -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(module)
        except PackageNotFoundError:
            return getattr(importlib.import_module(module), "__version__", "installed")
    except ImportError:
        return "not installed"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_lines() -> list[str]:
    import psutil
    import torch

    lines = []
    hip = getattr(torch.version, "hip", None)
    if torch.cuda.is_available():
        kind = f"ROCm (HIP {hip})" if hip else f"CUDA {torch.version.cuda}"
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"gpu {i}     {props.name}, {props.total_memory / 2**30:.0f} GiB  [{kind}]")
    else:
        build = f"ROCm build (HIP {hip})" if hip else ("CUDA build" if torch.version.cuda else "CPU-only build")
        lines.append(f"gpu       none visible to torch ({build})")
    physical = psutil.cpu_count(logical=False)
    lines.append(f"cpu       {cpu_model()}, {physical or '?'} cores / {os.cpu_count()} threads")
    from kimitui.kernels.cpu import (
        build as _build,
    )  # the instruction set the packed-expert CPU kernels use
    from kimitui.kernels.cpu import (
        quant_moe as cpu_quant_moe,
    )

    lines.append(f"cpu isa   {cpu_quant_moe.planned_isa()} (INT4 / MXFP4 experts on the CPU)")
    lines.append(f"cpu w4a8  {cpu_quant_moe.planned_w4a8()} (int8 activations for them: KIMITUI_CPU_W4A8)")
    lines.append(f"cpu build {_build.describe()}")
    lines.append(f"ram       {psutil.virtual_memory().total / 2**30:.1f} GiB")
    return lines


def version_lines() -> list[str]:
    import torch

    names = [("kimitui", _version("kimitui")), ("python", platform.python_version()), ("torch", torch.__version__)]
    names += [(m, _version(m)) for m in ("triton", "textual", "transformers", "amdsmi", "pynvml")]
    width = max(len(n) for n, _ in names)
    return [f"{n:<{width}}  {v}" for n, v in names]


def demo_lines() -> list[str]:
    from kimitui.engine.demo import demo_dir
    from kimitui.engine.demo.k3 import demo_k3_dir

    lines = []
    for name, path, seconds in (("demo", demo_dir(), 4), ("demo-k3", demo_k3_dir(), 10)):
        state = (
            "present"
            if (path / "model.safetensors.index.json").is_file()
            else f"not written yet: created on first use, about {seconds} s"
        )
        lines.append(f"{name:<8} {path}  ({state})")
    return lines


def numa_lines(args: argparse.Namespace, root: str | None = None) -> list[str]:
    """NUMA nodes (CPUs, memory) from sysfs and what --numa would do with host experts on them."""
    from kimitui.engine.offload.numa import SYSFS_NODES, NumaPolicy, read_topology

    try:
        topology = read_topology(root or SYSFS_NODES)
    except (OSError, ValueError) as e:
        return [f"n/a: {e}"]
    policy = NumaPolicy(getattr(args, "numa", "auto"))
    action = (
        f"host experts split over {len(topology.nodes)} nodes, computed by threads pinned per node"
        if policy.split(topology)
        else "one host-expert stack, unpinned threads"
    )
    return topology.summary_lines() + [f"policy    --numa {policy.mode}: {action}"]


def placement_lines(args: argparse.Namespace) -> list[str]:
    """The planner's placement for --model on --gpus devices (what the engine would build)."""
    from kimitui.engine.config import ConfigError, ModelConfig
    from kimitui.engine.plan.planner import PlacementError, plan_placement
    from kimitui.engine.plan.report import render

    gpus = getattr(args, "gpus", None) or 1
    memory = getattr(args, "gpu_memory_gb", None) or 288.0
    offload = getattr(args, "cpu_offload", "auto")
    try:
        from kimitui.engine.demo import DEMO_MODELS, demo_checkpoint

        config = ModelConfig.from_pretrained(demo_checkpoint(args.model) if args.model in DEMO_MODELS else args.model)
        plan = plan_placement(config, gpus, int(memory * 2**30), config.max_position_embeddings, 1, offload)
    except (ConfigError, PlacementError, ValueError) as e:
        return [f"n/a: {e}"]
    return render(plan)


def dtype_lines(args: argparse.Namespace) -> list[str]:
    """What ``--dtype auto`` picks on this CPU and why: for --model's checkpoint, else for a bf16 one
    (``engine.args.cpu_auto_dtype``; it may build the C++ CPU kernels once, as a first run would)."""
    from kimitui.engine.args import cpu_auto_dtype
    from kimitui.engine.config import ConfigError, ModelConfig

    config, checkpoint, what = None, "bfloat16", "an unquantised bf16 DeepSeek-V3 / K2 checkpoint"
    model = getattr(args, "model", None)
    if model:
        try:
            from kimitui.engine.demo import DEMO_MODELS, demo_checkpoint

            config = ModelConfig.from_pretrained(demo_checkpoint(model) if model in DEMO_MODELS else model)
        except (ConfigError, OSError, ValueError) as e:
            return [f"n/a: {e}"]
        checkpoint, what = config.torch_dtype, f"{model} ({config.torch_dtype})"
    dtype, why = cpu_auto_dtype(checkpoint, config)
    return [f"cpu auto  --dtype auto computes {str(dtype).removeprefix('torch.')} for {what}: {why}"]


def run(args: argparse.Namespace) -> int:
    """Print the report; always 0 (an unavailable backend is information, not an error)."""
    from kimitui.telemetry import describe_backends

    sections = [
        ("devices", device_lines() + dtype_lines(args)),
        ("telemetry backends", describe_backends()),
        ("numa", numa_lines(args)),
        ("versions", version_lines()),
        ("demo checkpoint", demo_lines()),
    ]
    if getattr(args, "model", None):
        sections.append(("expert placement", placement_lines(args)))
    for i, (title, lines) in enumerate(sections):
        print(("\n" if i else "") + title)
        for line in lines:
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace()))
