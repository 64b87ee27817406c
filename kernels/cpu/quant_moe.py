"""Gated (SwiGLU, or Kimi K3's SiTU) MoE over packed INT4 / MXFP4 experts on the CPU
(``cpu_quant_moe*.cpp``), built on first use.

Host experts of real checkpoints are packed: INT4 (K2.5, K2.6; compressed-tensors pack-quantized)
and MXFP4 (K3). A decode step reads each touched expert once, so the speed limit is memory
bandwidth. The experts are converted once, at load (``prepare``), into tiles of 16 output rows that
each thread streams front to back (``kernels.cpu_quant_moe_layout``: the same nibbles and scales,
reordered, never a dequantised copy); the kernels decode the 4-bit codes in vector registers, sum
code x activation per 32-column group in float32 and scale the group's sum. One call computes a
layer's experts for all tokens of a step; every token routed to an expert is computed from the same
tile while it is in cache.

The instruction set path is chosen once per process: the widest this CPU supports (AMX-BF16 tiles
where the CPU has them and Linux grants the tile state, AVX-512 with BF16, AVX-512, AVX2 + FMA,
portable), or a narrower one named by ``KIMITUI_CPU_ISA`` (``amx_bf16``, ``avx512bf16``, ``avx512``,
``avx2``, ``scalar``; tests use it). On ``avx512bf16`` and ``amx_bf16`` bf16 activations are
multiplied as bf16 (vdpbf16ps, or one TDPBF16PS per 32-column group of 16 tokens x 16 rows; the
products are exact) and the phase-2 input is rounded to bf16 as a bf16 model computes it; everywhere
else activations are float32. ``amx_bf16`` takes float32 activations on the AVX-512 path, and runs
bf16 ones on tiles at every batch size: its group sums differ from vdpbf16ps's in the last bits
(TDPBF16PS does not round after each addition), so one path for all batches keeps a token's bits
independent of its batch. ``isa()`` names the choice for
``kimitui info``.

W4A8 (``KIMITUI_CPU_W4A8``): the experts' products can instead quantise the activations to int8 per
32 columns (as llama.cpp's Q8_0) and sum code x activation with int8 dot-product instructions
(``cpu_quant_moe_w4a8.cpp``; its maths in ``kernels.cpu.quant_moe_w4a8``): AVX-512 VNNI or AVX-VNNI
(vpdpbusd), else a portable loop. ``auto`` (the default) takes it for bf16 activations where the CPU
has an int8 dot product (one vpdpbusd multiplies 4 codes per lane where vdpbf16ps multiplies 2, and
no code table lookup is needed for INT4): a bf16 model already rounds its activations to 8
significant bits, while float32 and fp16 runs (references, the KL base) keep the float products.
``0`` keeps the float path everywhere, ``1`` takes the int8 one for every dtype, and ``avx512vnni`` /
``avxvnni`` / ``scalar`` name a path. Its KL cost against float32 is in benchmarks/README.md
(``benchmarks/vs_llama_cpp.py``'s KL table). Like ``kernels.cpu_few_rows``, the extension is compiled
when the package is installed (one portable
build, ``kernels/cpu/build.py``); without a compiler, or with
``KIMITUI_CPU_KERNELS=0``, ``available()`` is False and callers keep the PyTorch path.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import quant_moe_layout as layout
from kimitui.kernels.cpu.build import QUANT_MOE, cpu_flags, load_extension

log = logging.getLogger(__name__)

# KIMITUI_CPU_ISA values by code (the C++ best_isa()), narrowest first, and the names isa() prints.
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3, "amx_bf16": 4}
ISA_NAMES = {0: "scalar", 1: "avx2+fma", 2: "avx512", 3: "avx512bf16", 4: "amx_bf16"}
ENV_ISA = "KIMITUI_CPU_ISA"
# KIMITUI_CPU_W4A8 path names by code (the C++ best_q8_isa()), and the names w4a8() prints.
W4A8_CODES = {"scalar": 0, "avxvnni": 1, "avx512vnni": 2}
W4A8_NAMES = {0: "int8-scalar", 1: "avx_vnni", 2: "avx512_vnni"}
ENV_W4A8 = "KIMITUI_CPU_W4A8"
_OFF, _ON = ("0", "false", "off", "no"), ("1", "true", "on", "yes")


@functools.cache
def _module():
    if os.environ.get("KIMITUI_CPU_KERNELS", "1").lower() in ("0", "false", "off"):
        return None
    module = load_extension(QUANT_MOE, log, "CPU quantised MoE kernels")
    # a thread calling both extensions runs one thread team (kernels/cpu/csrc/cpu_team.h): the few-row kernels'
    # (when they build)
    if module is not None and cpu_few_rows.available():
        module.use_team(cpu_few_rows.team_capsule())
        cpu_few_rows.use_packed_experts(module.experts_capsules())  # for its packed_ffn_block
    return module


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
        raise ValueError(f"{ENV_ISA}={wanted}: this CPU supports at most {ISA_NAMES[best]}")
    return ISA_CODES[wanted]


def isa() -> str:
    """The instruction set path the kernels run here (an ``ISA_NAMES`` value), or "unavailable" when
    the extension does not build."""
    return ISA_NAMES[_isa_code()] if available() else "unavailable"


def planned_isa() -> str:
    """The path ``isa()`` will report, from /proc/cpuinfo and ``KIMITUI_CPU_ISA``, without building
    the extension (for ``kimitui info``). On an AMX CPU whose kernel refuses the tile permission the
    extension falls back to avx512bf16 where this still says amx_bf16."""
    flags = cpu_flags()
    best = (
        4
        if {"avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"} <= flags
        else 3
        if {"avx512f", "avx512bw", "avx512_bf16"} <= flags
        else 2
        if "avx512f" in flags
        else 1
        if {"avx2", "fma"} <= flags
        else 0
    )
    wanted = ISA_CODES.get(os.environ.get(ENV_ISA, "").strip().lower(), best)
    return ISA_NAMES[min(best, wanted)]


def _w4a8_choice(value: str, best: int) -> tuple[int | None, bool]:
    """KIMITUI_CPU_W4A8's value -> (the int8 path's code or None for the float products, whether only bf16
    activations take it); best: the CPU's widest path."""
    value = value.strip().lower()
    if value in ("", "auto"):
        # where an int8 dot-product instruction exists, for bf16 activations: a bf16 model already rounds
        # them to 8 significant bits; float32 and fp16 ones are kept for runs that ask for precision
        return (best if best > 0 else None), True
    if value in _OFF:
        return None, False
    if value in _ON:
        return best, False
    if value not in W4A8_CODES:
        raise ValueError(f"{ENV_W4A8}={value!r}: expected auto, 0, 1 or one of {', '.join(W4A8_CODES)}")
    if W4A8_CODES[value] > best:
        raise ValueError(f"{ENV_W4A8}={value}: this CPU supports at most {W4A8_NAMES[best]}")
    return W4A8_CODES[value], False


@functools.cache
def _w4a8_env() -> str:
    # Read once: the numerics must not change under a running model.
    return os.environ.get(ENV_W4A8, "")


def _describe(choice: tuple[int | None, bool]) -> str:
    code, bf16_only = choice
    return "off" if code is None else W4A8_NAMES[code] + (" (bf16 activations)" if bf16_only else "")


def w4a8(value: str | None = None) -> str:
    """What a ``KIMITUI_CPU_W4A8`` value (default: the environment's) does here: "off", or the int8 path
    (a ``W4A8_NAMES`` value), "(bf16 activations)" added where only those take it."""
    if not available():
        return "off"
    return _describe(_w4a8_choice(_w4a8_env() if value is None else value, _module().best_q8_isa()))


def planned_w4a8() -> str:
    """What ``w4a8()`` will report, from /proc/cpuinfo and ``KIMITUI_CPU_W4A8``, without building (for
    ``kimitui info``)."""
    flags = cpu_flags()
    best = 2 if {"avx512f", "avx512bw", "avx512_vnni"} <= flags else 1 if {"avx2", "avx_vnni"} <= flags else 0
    try:
        return _describe(_w4a8_choice(os.environ.get(ENV_W4A8, ""), best))
    except ValueError as e:
        return f"invalid ({e})"


def supported_isas() -> list[str]:
    """Every path this CPU can run, narrowest first (``KIMITUI_CPU_ISA`` values)."""
    best = _module().best_isa()
    return [name for name, code in ISA_CODES.items() if code <= best]


def supports(fmt: str, k13: int, k2: int, group_size: int) -> bool:
    """Whether these kernels take ``fmt`` experts with input widths k13 (hidden) and k2 (expert width)."""
    if fmt == "int4":
        return group_size % 32 == 0
    return fmt == "mxfp4" and k13 % 32 == 0 and k2 % 32 == 0


@dataclass(frozen=True)
class TiledExperts:
    """A layer's experts in the kernels' tile layout (``prepare``): w13 [E, bytes] uint8 (gate tiles,
    then up tiles), w2 [E, bytes]; ``hidden`` and ``inter`` fix where each tile starts."""

    fmt: str
    hidden: int
    inter: int
    w13: torch.Tensor
    w2: torch.Tensor


def _check_checkpoint(fmt, d, w13, w13_scale, w2, w2_scale, group_size) -> int:
    """Validate checkpoint-layout experts (as ``moe`` documents them); -> the expert width I."""
    e, n13 = w13.shape[0], w13.shape[1]
    inter = n13 // 2
    if fmt == "int4":
        if group_size % 32:
            raise ValueError(f"cpu_quant_moe: INT4 group size {group_size} is not a multiple of 32")
        want = {
            "w13": (torch.int32, [e, n13, -(-d // 8)]),
            "w13_scale": (torch.bfloat16, [e, n13, -(-d // group_size)]),
            "w2": (torch.int32, [e, d, -(-inter // 8)]),
            "w2_scale": (torch.bfloat16, [e, d, -(-inter // group_size)]),
        }
    elif fmt == "mxfp4":
        if d % 32 or inter % 32:
            raise ValueError(f"cpu_quant_moe: MXFP4 needs hidden ({d}) and expert width ({inter}) multiples of 32")
        want = {
            "w13": (torch.uint8, [e, n13, d // 2]),
            "w13_scale": (torch.uint8, [e, n13, d // 32]),
            "w2": (torch.uint8, [e, d, inter // 2]),
            "w2_scale": (torch.uint8, [e, d, inter // 32]),
        }
    else:
        raise ValueError(f"cpu_quant_moe: unknown expert format {fmt!r} (int4 or mxfp4)")
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        dtype, shape = want[name]
        if t.dtype != dtype or list(t.shape) != shape or t.device.type != "cpu":
            raise ValueError(
                f"cpu_quant_moe: {fmt} {name} is {t.dtype} {list(t.shape)} on {t.device}, expected "
                f"{dtype} {shape} on the CPU"
            )
    return inter


def prepare(fmt, w13, w13_scale, w2, w2_scale, group_size=32) -> TiledExperts:
    """Checkpoint-layout experts (as ``moe`` takes them) -> the tile layout the kernels stream. A pure
    function of its inputs; the caller drops the checkpoint tensors to keep one copy in RAM."""
    d = w2.shape[1]
    inter = _check_checkpoint(fmt, d, w13, w13_scale, w2, w2_scale, group_size)
    g = group_size if fmt == "int4" else 32
    e, half = w13.shape[0], layout.matrix_bytes(fmt, inter, d)
    w13_tiles = torch.empty(e, 2 * half, dtype=torch.uint8)
    w2_tiles = torch.empty(e, layout.matrix_bytes(fmt, d, inter), dtype=torch.uint8)
    mod, ratio = _module(), g // 32

    def raw(t):  # bytes, in place: INT4 words and bf16 scales are little-endian in memory
        return t.contiguous().view(torch.uint8)

    # written in place, no temporaries (kernels.cpu_quant_moe_layout.repack is the same in PyTorch)
    mod.repack(raw(w13), raw(w13_scale), w13_tiles, 0, 0, inter, d, ratio, fmt == "mxfp4")
    mod.repack(raw(w13), raw(w13_scale), w13_tiles, half, inter, inter, d, ratio, fmt == "mxfp4")
    mod.repack(raw(w2), raw(w2_scale), w2_tiles, 0, 0, d, inter, ratio, fmt == "mxfp4")
    return TiledExperts(fmt, d, inter, w13_tiles, w2_tiles)


def unprepare(experts: TiledExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checkpoint layout back (w13, w13_scale, w2, w2_scale; INT4 with group size 32): for code that
    reads experts as the checkpoint stores them."""
    f, d, i = experts.fmt, experts.hidden, experts.inter
    half = layout.matrix_bytes(f, i, d)
    gate, up = layout.unpack(f, experts.w13[:, :half], i, d), layout.unpack(f, experts.w13[:, half:], i, d)
    w2, s2 = layout.unpack(f, experts.w2, d, i)
    return torch.cat((gate[0], up[0]), dim=1), torch.cat((gate[1], up[1]), dim=1), w2, s2


def moe(
    x,
    topk_ids,
    topk_weights,
    fmt,
    w13,
    w13_scale,
    w2,
    w2_scale,
    group_size=32,
    isa_name=None,
    act="silu",
    beta=1.0,
    linear_beta=None,
    w4a8=None,
):
    """Gated MoE over packed experts, as ``reference.moe_experts_reference_w4a16`` / ``_mxfp4``:
    x [T, D] (float32 or bf16), topk_ids [T, k] (ids outside [0, E) add nothing), topk_weights [T, k].
    w13 a ``TiledExperts`` (w13_scale, w2, w2_scale None), or the checkpoint layout, converted on
    every call (slow: load-time callers ``prepare`` once) --
    INT4: w13 int32 [E, 2I, ceil(D/8)], w13_scale bf16 [E, 2I, ceil(D/g)], w2 [E, D, ceil(I/8)] + scales;
    MXFP4: w13 uint8 [E, 2I, D/2], w13_scale uint8 [E, 2I, D/32], w2 [E, D, I/2] + scales.
    -> [T, D] in x.dtype (float32 sums). ``isa_name`` forces a path (tests); default ``isa()``.
    ``act`` "silu" or "situ" with its ``beta`` / ``linear_beta`` (None: up unbounded), as
    ``kernels.activation.GatedActivation``; computed in float32. ``w4a8``: a ``KIMITUI_CPU_W4A8`` value
    ("auto": bf16 activations on the widest int8 path, where the CPU has one; "0"; "1"; a ``W4A8_CODES``
    name), True / False for "1" / "0", or None for the process's (the float path when ``isa_name``
    names one); ``kernels.cpu.quant_moe_w4a8`` is the int8 path's maths."""
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"cpu_quant_moe: x {list(x.shape)}, topk_ids {list(topk_ids.shape)} and topk_weights "
            f"{list(topk_weights.shape)} must be [T, D], [T, k], [T, k]"
        )
    experts = w13 if isinstance(w13, TiledExperts) else prepare(fmt, w13, w13_scale, w2, w2_scale, group_size)
    if experts.fmt != fmt or experts.hidden != x.shape[1]:
        raise ValueError(
            f"cpu_quant_moe: {experts.fmt} experts of hidden size {experts.hidden} called as {fmt} "
            f"with x {list(x.shape)}"
        )
    f, d, i = fmt, experts.hidden, experts.inter
    want13, want2 = 2 * layout.matrix_bytes(f, i, d), layout.matrix_bytes(f, d, i)
    for name, t, n in (("w13", experts.w13, want13), ("w2", experts.w2, want2)):
        if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != n or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(
                f"cpu_quant_moe: tiled {name} is {t.dtype} {list(t.shape)} on {t.device}, expected "
                f"contiguous uint8 [E, {n}] on the CPU"
            )
    if experts.w2.shape[0] != experts.w13.shape[0]:
        raise ValueError(f"cpu_quant_moe: w13 has {experts.w13.shape[0]} experts, w2 {experts.w2.shape[0]}")
    if act not in ("silu", "situ") or (act == "situ" and (beta <= 0 or (linear_beta is not None and linear_beta <= 0))):
        raise ValueError(
            f"cpu_quant_moe: activation {act!r} (beta={beta}, linear_beta={linear_beta}) is not silu or "
            "situ with positive betas"
        )
    code = _isa_code() if isa_name is None else ISA_CODES.get(isa_name, -1)
    if not 0 <= code <= _module().best_isa():
        raise ValueError(f"cpu_quant_moe: instruction set {isa_name!r} is not one this CPU runs ({supported_isas()})")
    xin = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
    q8 = _w4a8_arg(w4a8, isa_name, x.dtype)
    kernel = _module().moe if q8 is None else _module().moe_w4a8
    out = kernel(
        xin.contiguous(),
        topk_ids.long().contiguous(),
        topk_weights.float().contiguous(),
        experts.w13,
        experts.w2,
        i,
        fmt == "mxfp4",
        code if q8 is None else q8,
        int(act == "situ"),
        float(beta),
        0.0 if linear_beta is None else float(linear_beta),
    )
    return out.to(x.dtype)


def _w4a8_arg(w4a8, isa_name, dtype: torch.dtype) -> int | None:
    """``moe``'s ``w4a8`` for activations of ``dtype`` -> the int8 path's code, or None (float products)."""
    if w4a8 is None:
        if isa_name is not None:
            return None
        w4a8 = _w4a8_env()
    value = {True: "1", False: "0"}.get(w4a8, w4a8) if isinstance(w4a8, bool) else str(w4a8)
    try:
        code, bf16_only = _w4a8_choice(value, _module().best_q8_isa())
    except ValueError as e:
        raise ValueError(f"cpu_quant_moe: int8 path {w4a8!r}: {e}") from None
    return None if bf16_only and dtype != torch.bfloat16 else code


def fused_path(dtype: torch.dtype) -> tuple[bool, int]:
    """``(w4a8, path)``: the products ``moe`` runs for activations of ``dtype`` by default (the process's
    ``KIMITUI_CPU_W4A8`` and instruction-set path), as the few-row extension's ``packed_ffn_block`` takes them."""
    q8 = _w4a8_arg(None, None, dtype)
    return (False, _isa_code()) if q8 is None else (True, q8)


def matmul_w4a8(x: torch.Tensor, tiles: torch.Tensor, n: int, fmt: str, path: str) -> torch.Tensor:
    """One tiled matrix's W4A8 product (tests): x [T, K] float32, tiles [1, matrix_bytes] of n rows."""
    return _module().matmul_w4a8(x.float().contiguous(), tiles, n, fmt == "mxfp4", W4A8_CODES[path])


def supported_w4a8() -> list[str]:
    """Every int8 path this CPU runs (``KIMITUI_CPU_W4A8`` names), narrowest first."""
    best = _module().best_q8_isa()
    return [name for name, code in W4A8_CODES.items() if code <= best]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("CPU quantised MoE kernels:", isa(), "| W4A8:", w4a8())
