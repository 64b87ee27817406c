"""The activation of a gated MLP, ``act(gate) * up``: SiLU (SwiGLU, DeepSeek-V3 / Kimi Linear) or
SiTU (Kimi K3).

SiTU bounds both halves with scaled tanh so activations cannot blow up in low precision:

    gate' = beta * tanh(gate / beta) * sigmoid(gate)
    up'   = linear_beta * tanh(up / linear_beta)       (up unchanged when linear_beta is None)
    out   = gate' * up'

computed in fp32 and cast back (Kimi K3 tech report, arXiv:2607.24653; SGLang
``python/sglang/srt/models/kimi_k3.py``). It replaces ``silu(gate) * up`` at every gated MLP of K3:
the dense layer, the shared experts and the routed experts.

It lives with the kernels because they implement it: the fused MoE kernels (Triton, C++) take a
``GatedActivation`` (or None: SiLU) and compute it in their GEMM1 epilogue, and kernels import no
engine code. ``engine.layers.activation`` is where the layers take it from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GatedActivation:
    kind: str = "silu"  # "silu" or "situ"
    beta: float = 1.0  # SiTU: activation_situ_beta (Moonshot's code falls back to 1.0 when unset)
    linear_beta: float | None = None  # SiTU: activation_situ_linear_beta (None: up is not bounded)

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "situ"):
            raise ValueError(f"gated activation {self.kind!r} is not supported (supported: silu, situ)")
        if self.kind == "situ" and (self.beta <= 0 or (self.linear_beta is not None and self.linear_beta <= 0)):
            raise ValueError(f"SiTU betas must be positive, got beta={self.beta}, linear_beta={self.linear_beta}")

    @classmethod
    def from_config(cls, config) -> GatedActivation:
        """From a ModelConfig's hidden_act / situ_beta / situ_linear_beta."""
        if config.hidden_act == "situ":
            return cls("situ", config.situ_beta, config.situ_linear_beta)
        return cls(config.hidden_act)

    @property
    def is_silu(self) -> bool:
        return self.kind == "silu"

    @property
    def code(self) -> int:
        """The kernels' number for the kind: 0 SiLU, 1 SiTU (Triton's ACTIVATION, the C++ ``act``)."""
        return ACTIVATION_CODES[self.kind]

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` elementwise, in gate's dtype."""
        if self.kind == "silu":
            return F.silu(gate) * up
        return situ_and_mul(gate, up, self.beta, self.linear_beta)


ACTIVATION_CODES = {"silu": 0, "situ": 1}
SILU = GatedActivation()


def resolve(activation: GatedActivation | None) -> GatedActivation:
    """``activation``, or SiLU for None (the kernels' default: SwiGLU)."""
    return SILU if activation is None else activation


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    g, u = gate.float(), up.float()
    g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (g * u).to(gate.dtype)
