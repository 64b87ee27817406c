"""A float64 MoE oracle for the CPU MoE kernels' tests, pair by pair from the definitions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers.k3_reference import situ


def moe64(x, ids, weights, w13, w2, act=None) -> torch.Tensor:
    """y_t = sum_k w_tk * w2[e] @ act(gate_e x_t, up_e x_t) in float64. w13 [E, 2I, D] and w2 [E, D, I]
    already dequantised; ids outside [0, E) add nothing; ``act`` None for SiLU (SwiGLU), else a SiTU
    ``kernels.activation.GatedActivation``."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if 0 <= e < w13.shape[0]:
                gu = w13[e] @ x[t]
                g, u = gu[:inter], gu[inter:]
                h = F.silu(g) * u if act is None else situ(g, u, act.beta, act.linear_beta)
                out[t] += float(weights[t, s]) * (w2[e] @ h)
    return out
