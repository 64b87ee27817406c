"""The activation of a gated MLP (SiLU or Kimi K3's SiTU), as the layers use it.

Defined in ``kernels.activation``: the MoE kernels compute it in their epilogue and take it as an
argument, and kernels import no engine code.
"""

from kimitui.kernels.activation import SILU, GatedActivation, resolve, situ_and_mul

__all__ = ["SILU", "GatedActivation", "resolve", "situ_and_mul"]
