"""The maths of the CPU's W4A8 expert products (``cpu_quant_moe_w4a8.cpp``) in PyTorch: its specification
and the tests' reference, the same integer sums and float32 roundings in the same order.

Activations are quantised per 32-column group as llama.cpp's Q8_0 quantises them (ggml-quants.c,
``quantize_row_q8_0``), with a float32 scale where Q8_0 stores fp16: amax = max |x|, d = amax / 127,
q = round-half-even(x * (127 / amax)). Weights keep their 4-bit codes and the checkpoint's scales:
INT4 codes -8..7 with bf16 group scales (compressed-tensors pack-quantized, any group size that is a
multiple of 32), E2M1 codes doubled to integers (-12..12, as llama.cpp's ``kvalues_mxfp4``) with
E8M0 scales. Per (token, row, 32-column group) the integer sum of code x q is exact; then, group after
group in float32, ``acc = acc + float(isum) * (w_scale * d)``; MXFP4 rows end times 0.5.

Against float32 this adds one rounding of each activation to 8 bits per group (the 4-bit weights are
the checkpoint's, unchanged): ``benchmarks/vs_llama_cpp.py`` and ``kimitui eval kl`` show its KL cost.
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int64)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (q [T, G, 32] int64 values in -127..127, d [T, G] float32), zero past K."""
    t, k = x.shape
    g = -(-k // GROUP)
    xp = torch.zeros(t, g * GROUP, dtype=torch.float32)
    xp[:, :k] = x.float()
    xg = xp.view(t, g, GROUP)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xg * inv[..., None]).to(torch.int64)
    return q, amax / torch.tensor(127.0)


def int_codes(fmt: str, packed: torch.Tensor, scale: torch.Tensor, k: int, group_size: int = 32):
    """Checkpoint-layout experts [..., N, *] -> (codes [..., N, G, 32] int64: INT4 -8..7, E2M1 doubled;
    scales [..., N, G] float32 per 32 columns: bf16 widened, or E8M0 2^(b - 127) with 0 -> 2^-127, 255 -> NaN)."""
    g = -(-k // GROUP)
    if fmt == "int4":
        b = packed.contiguous().view(torch.uint8)
        nib = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)[..., :k].to(torch.int64) - 8
        s = scale.float().repeat_interleave(group_size // GROUP, dim=-1)[..., :g]
    else:
        nib = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)[..., :k].long()
        nib = E2M1_DOUBLED[nib]
        e = scale.to(torch.int64)
        s = torch.pow(2.0, (e - 127).double()).float()
        s = torch.where(e == 0, torch.tensor(2.0**-127), s)
        s = torch.where(e == 255, torch.tensor(float("nan")), s)
    codes = torch.zeros(*nib.shape[:-1], g * GROUP, dtype=torch.int64)
    codes[..., :k] = nib
    return codes.view(*nib.shape[:-1], g, GROUP), s.contiguous()


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mxfp4: bool) -> torch.Tensor:
    """x [T, K] times codes [N, G, 32] with scales [N, G] (``int_codes``) -> [T, N] float32, W4A8."""
    q, d = quantize_q8(x)
    # exact: |sum| < 32 * 127 * 12 (float64 holds every integer below 2^53)
    isum = torch.einsum("tgc,ngc->tng", q.double(), codes.double()).float()
    acc = torch.zeros(x.shape[0], codes.shape[0], dtype=torch.float32)
    for g in range(codes.shape[1]):
        acc = acc + isum[:, :, g] * (scales[None, :, g] * d[:, g, None])
    return acc * 0.5 if mxfp4 else acc


def moe(x, ids, weights, fmt, w13, w13_scale, w2, w2_scale, group_size=32, act=None) -> torch.Tensor:
    """The W4A8 MoE (checkpoint-layout experts, as ``kernels.cpu.quant_moe.moe`` takes them) -> [T, D]
    float32: h = act(gate, up) in float32 (``act`` a ``kernels.activation.GatedActivation``, None:
    SiLU), quantised again for w2; each token adds weight x output of its experts in ascending id order."""
    d_model, inter = w2.shape[1], w13.shape[1] // 2
    c13, s13 = int_codes(fmt, w13, w13_scale, d_model, group_size)
    c2, s2 = int_codes(fmt, w2, w2_scale, inter, group_size)
    mx = fmt == "mxfp4"
    xf = x.float()
    out = torch.zeros(x.shape[0], d_model, dtype=torch.float32)
    for t in range(x.shape[0]):
        order = sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j]))  # stable: ties keep slot order
        for j in order:
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            gu = matmul(xf[t : t + 1], c13[e], s13[e], mx)
            g, u = gu[:, :inter], gu[:, inter:]
            h = g / (1 + torch.exp(-g)) * u if act is None else act(g, u).float()
            y = matmul(h, c2[e], s2[e], mx)
            out[t] = out[t] + y[0] * weights[t, j].float()
    return out
