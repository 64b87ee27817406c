"""Gated (SwiGLU, or Kimi K3's SiTU) MoE over packed INT4 / MXFP4 experts on the CPU
(``cpu_quant_moe*.cpp``), built on first use.

Host experts of real checkpoints are packed: INT4 (K2.5, K2.6; compressed-tensors pack-quantized)
and MXFP4 (K3). A decode step reads each touched expert once, so the speed limit is memory
bandwidth; dequantising a whole expert per call (the PyTorch reference) or torch's int4 GEMM reach a
small fraction of it. These kernels read the packed bytes and scales in place, dequantise in vector
registers and accumulate in float32; prefill-sized batches dequantise a tile once and reuse it for
all of an expert's tokens. One call computes a layer's experts for all tokens of a step.

The instruction set path is chosen once per process: the widest this CPU supports (AVX-512,
AVX2 + FMA, portable), or a narrower one named by ``KIMITUI_CPU_ISA`` (``avx512``, ``avx2``,
``scalar``; tests use it). ``isa()`` names the choice for ``kimitui info``. Like
``kernels.cpu_few_rows``, the extension is compiled by ``torch.utils.cpp_extension.load`` into
``TORCH_EXTENSIONS_DIR``; without a compiler, or with ``KIMITUI_CPU_KERNELS=0``, ``available()`` is
False and callers keep the PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from kernels._build import load_extension

log = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "cpu_quant_moe.cpp", _DIR / "cpu_quant_moe_isa.cpp"]
_HEADERS = [_DIR / "cpu_quant_moe_common.h", _DIR / "cpu_quant_moe_kernels.h"]
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}
ENV_ISA = "KIMITUI_CPU_ISA"


def _build_tag() -> str:
    # torch rebuilds when a source changes, not a header: the headers' text is part of the name, as is
    # the source path (two checkouts must not rebuild each other's copy).
    key = str(_SOURCES[0].resolve()).encode() + b"".join(h.read_bytes() for h in _HEADERS)
    return hashlib.sha1(key).hexdigest()[:10]


@functools.cache
def _module():
    if os.environ.get("KIMITUI_CPU_KERNELS", "1").lower() in ("0", "false", "off"):
        return None
    return load_extension(
        f"kimitui_cpu_quant_moe_{_build_tag()}",
        _SOURCES,
        # no -march: each path carries its own target pragma, the portable one runs anywhere;
        # no implicit a * b + c fusing, so the register and tiled paths round alike
        ["-O3", "-ffp-contract=off", "-fopenmp"],
        log,
        "CPU quantised MoE kernels",
    )


def available() -> bool:
    """True when the extension is built (building it on the first call)."""
    return _module() is not None


@functools.cache
def _isa_code() -> int:
    # Read once: the path must not change under a running model.
    best = _module().best_isa()
    wanted = os.environ.get(ENV_ISA, "").strip().lower()
    if not wanted:
        return best
    if wanted not in ISA_CODES:
        raise ValueError(f"{ENV_ISA}={wanted!r}: expected one of {', '.join(ISA_CODES)}")
    if ISA_CODES[wanted] > best:
        raise ValueError(f"{ENV_ISA}={wanted}: this CPU supports at most {_module().isa_name(best)}")
    return ISA_CODES[wanted]


def isa() -> str:
    """The instruction set path the kernels run here: "avx512", "avx2+fma", "scalar", or
    "unavailable" when the extension does not build."""
    return _module().isa_name(_isa_code()) if available() else "unavailable"


def planned_isa() -> str:
    """The path ``isa()`` will report, from /proc/cpuinfo and ``KIMITUI_CPU_ISA``, without building
    the extension (for ``kimitui info``): "avx512", "avx2+fma" or "scalar"."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        flags = []
    best = 2 if "avx512f" in flags else 1 if {"avx2", "fma"} <= set(flags) else 0
    wanted = ISA_CODES.get(os.environ.get(ENV_ISA, "").strip().lower(), best)
    return {2: "avx512", 1: "avx2+fma", 0: "scalar"}[min(best, wanted)]


def supported_isas() -> list[str]:
    """Every path this CPU can run, narrowest first (``KIMITUI_CPU_ISA`` values)."""
    best = _module().best_isa()
    return [name for name, code in ISA_CODES.items() if code <= best]


def supports(fmt: str, k13: int, k2: int, group_size: int) -> bool:
    """Whether these kernels take ``fmt`` experts with input widths k13 (hidden) and k2 (expert width)."""
    if fmt == "int4":
        return group_size % 32 == 0
    return fmt == "mxfp4" and k13 % 32 == 0 and k2 % 32 == 0


def moe(x, topk_ids, topk_weights, fmt, w13, w13_scale, w2, w2_scale, group_size=32, isa_name=None, act="silu",
        beta=1.0, linear_beta=None):
    """Gated MoE over packed experts, as ``reference.moe_experts_reference_w4a16`` / ``_mxfp4``:
    x [T, D] (float32 or bf16), topk_ids [T, k] (ids outside [0, E) add nothing), topk_weights [T, k];
    INT4: w13 int32 [E, 2I, ceil(D/8)], w13_scale bf16 [E, 2I, ceil(D/g)], w2 [E, D, ceil(I/8)] + scales;
    MXFP4: w13 uint8 [E, 2I, D/2], w13_scale uint8 [E, 2I, D/32], w2 [E, D, I/2] + scales.
    -> [T, D] in x.dtype (float32 sums). ``isa_name`` forces a path (tests); default ``isa()``.
    ``act`` "silu" or "situ" with its ``beta`` / ``linear_beta`` (None: up unbounded), as
    ``kernels.activation.GatedActivation``; computed in float32."""
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"cpu_quant_moe: x {list(x.shape)}, topk_ids {list(topk_ids.shape)} and topk_weights "
                         f"{list(topk_weights.shape)} must be [T, D], [T, k], [T, k]")
    d, e, n13 = x.shape[1], w13.shape[0], w13.shape[1]
    inter = n13 // 2
    if fmt == "int4":
        if group_size % 32:
            raise ValueError(f"cpu_quant_moe: INT4 group size {group_size} is not a multiple of 32")
        want = {"w13": (torch.int32, [e, n13, -(-d // 8)]),
                "w13_scale": (torch.bfloat16, [e, n13, -(-d // group_size)]),
                "w2": (torch.int32, [e, d, -(-inter // 8)]),
                "w2_scale": (torch.bfloat16, [e, d, -(-inter // group_size)])}
    elif fmt == "mxfp4":
        if d % 32 or inter % 32:
            raise ValueError(f"cpu_quant_moe: MXFP4 needs hidden ({d}) and expert width ({inter}) multiples of 32")
        group_size = 32
        want = {"w13": (torch.uint8, [e, n13, d // 2]), "w13_scale": (torch.uint8, [e, n13, d // 32]),
                "w2": (torch.uint8, [e, d, inter // 2]), "w2_scale": (torch.uint8, [e, d, inter // 32])}
    else:
        raise ValueError(f"cpu_quant_moe: unknown expert format {fmt!r} (int4 or mxfp4)")
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        dtype, shape = want[name]
        if t.dtype != dtype or list(t.shape) != shape or t.device.type != "cpu":
            raise ValueError(f"cpu_quant_moe: {fmt} {name} is {t.dtype} {list(t.shape)} on {t.device}, expected "
                             f"{dtype} {shape} on the CPU")
        if not t.is_contiguous():
            raise ValueError(f"cpu_quant_moe: {fmt} {name} must be contiguous")
    if act not in ("silu", "situ") or (act == "situ" and (beta <= 0 or (linear_beta is not None and linear_beta <= 0))):
        raise ValueError(f"cpu_quant_moe: activation {act!r} (beta={beta}, linear_beta={linear_beta}) is not silu or "
                         "situ with positive betas")
    code = _isa_code() if isa_name is None else ISA_CODES.get(isa_name, -1)
    if not 0 <= code <= _module().best_isa():
        raise ValueError(f"cpu_quant_moe: instruction set {isa_name!r} is not one this CPU runs ({supported_isas()})")
    out = _module().moe(x.float().contiguous(), topk_ids.long().contiguous(), topk_weights.float().contiguous(),
                        w13, w13_scale, w2, w2_scale, fmt == "mxfp4", group_size, code, int(act == "situ"),
                        float(beta), 0.0 if linear_beta is None else float(linear_beta))
    return out.to(x.dtype)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("CPU quantised MoE kernels:", isa())
