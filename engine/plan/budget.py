"""The numbers that decide whether a placement fits: per-GPU capacity against weights, KV cache,
linear-attention state and the activation reserve, and how many routed experts must stay on the GPUs
under a ``cpu_offload`` policy (``planner.plan_placement`` and its context-length search share them)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """The numbers that decide feasibility, shared by the plan and the context-length search."""

    capacity: int
    non_expert: tuple[int, ...]
    reserve: int
    kv_per_token: int
    max_num_seqs: int
    block_size: int
    expert_bytes: int
    num_moe_layers: int
    n_experts: int
    policy: str | int
    host_capacity: int | None
    state_per_seq: tuple[int, ...] = ()  # per device: KDA state bytes of one sequence on that rank
    states_per_seq: int = 1  # 1 + num_speculative_tokens with speculative decoding (scratch states)
    drafter_kv_per_token: int = 0  # an EAGLE-3 / DSpark drafter's KV, on the first GPU only

    def state(self, d: int) -> int:
        return self.max_num_seqs * self.state_per_seq[d] * self.states_per_seq if self.state_per_seq else 0

    def fixed(self, kv: int) -> list[int]:
        """Per device: everything but the routed experts."""
        drafter_kv = kv * self.drafter_kv_per_token // self.kv_per_token if self.kv_per_token else 0
        return [
            ne + kv + self.state(d) + self.reserve + (drafter_kv if d == 0 else 0)
            for d, ne in enumerate(self.non_expert)
        ]

    def kv_bytes(self, model_len: int) -> int:
        # Each sequence holds whole blocks. With tensor-parallel MLA the latent is not split by head,
        # so every rank caches all tokens: KV is replicated, not divided, across GPUs.
        return self.max_num_seqs * math.ceil(model_len / self.block_size) * self.block_size * self.kv_per_token

    def slots(self, kv: int) -> list[int]:
        free = [self.capacity - f for f in self.fixed(kv)]
        return [max(0, f // self.expert_bytes) if self.expert_bytes else 0 for f in free]

    def gpu_experts_needed(self) -> int:
        total = self.num_moe_layers * self.n_experts
        if self.policy == "none":
            return total
        if self.policy == "auto":
            if self.host_capacity is None:
                return 0
            return total - min(total, self.host_capacity // max(1, self.expert_bytes))
        return self.num_moe_layers * (self.n_experts - self.policy)

    def fits(self, kv: int) -> bool:
        if any(f > self.capacity for f in self.fixed(kv)):
            return False
        if isinstance(self.policy, int) and self.host_capacity is not None:
            if self.policy * self.num_moe_layers * self.expert_bytes > self.host_capacity:
                return False
        return sum(self.slots(kv)) >= self.gpu_experts_needed()

    def max_len_by_memory(self) -> int:
        per_block = self.max_num_seqs * self.block_size * self.kv_per_token
        if not self.fits(0):
            return 0
        lo = 0  # blocks per sequence known to fit
        hi = (self.capacity - min(self.non_expert) - self.reserve) // per_block + 1  # known not to fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(self.kv_bytes(mid * self.block_size)) else (lo, mid)
        return lo * self.block_size


def parse_policy(cpu_offload: str | int, n_experts: int) -> str | int:
    if cpu_offload in ("auto", "none"):
        return cpu_offload
    try:
        n = int(cpu_offload)
    except (TypeError, ValueError):
        raise ValueError(f"cpu_offload must be 'auto', 'none' or an integer, got {cpu_offload!r}") from None
    if not 0 <= n <= n_experts:
        raise ValueError(f"cpu_offload={n}: must be between 0 and n_routed_experts ({n_experts})")
    return n
