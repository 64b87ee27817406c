"""Mixture of experts: sigmoid noaux_tc router, routed experts (expert parallel, some optionally in
host RAM computed by the CPU), shared experts (tensor parallel).

The routed experts' gated activation (SiLU, or Kimi K3's SiTU) comes from the config and goes to
whichever backend op computes a stack (the device's fused MoE, the host's CPU kernels): every path
runs the model's own activation, or the model is refused at load."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from kimitui.engine.config import ModelConfig
from kimitui.engine.layers.activation import GatedActivation
from kimitui.engine.layers.linear import linear_format, quantized_params, values_per_element
from kimitui.engine.layers.mlp import MLP
from kimitui.engine.layers.router import Router
from kimitui.engine.loader.source import TensorSource
from kimitui.engine.offload.cpu_experts import CpuExpertExecutor
from kimitui.engine.parallel.state import SINGLE, ParallelState, split_sizes
from kimitui.kernels.backend import REFERENCE, Backend, count_routing


class ExpertStack(nn.Module):
    """Stacked weights of ``num`` experts in one format (gate and up fused as w13, gate rows first)."""

    ops: Backend = REFERENCE  # the backend of the device the stack lives on, set when the model is loaded

    def __init__(
        self,
        config: ModelConfig,
        fmt: str,
        num: int,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.fmt, self.quant, self.num = fmt, config.quantization, num
        act = GatedActivation.from_config(config)
        # what the backend ops take: None for SiLU (their default, SwiGLU), else the activation
        self.activation = None if act.is_silu else act
        d, i = config.hidden_size, config.moe_intermediate_size
        if fmt == "fp8" and i % self.quant.weight_block_size[0]:
            # gate and up are stacked into w13; their scale blocks only line up on block boundaries
            raise ValueError(
                f"FP8 experts need moe_intermediate_size ({i}) divisible by the weight block "
                f"({self.quant.weight_block_size[0]})"
            )
        with torch.device(device) if device is not None else contextlib.nullcontext():
            for proj, (n, k) in (("w13", (2 * i, d)), ("w2", (d, i))):
                for name, t in quantized_params(fmt, n, k, self.quant, (num,), dtype).items():
                    p = nn.Parameter(t, requires_grad=False)
                    p.values_per_element = values_per_element(fmt, name)
                    self.register_parameter(f"{proj}_{name}", p)

    def load(self, index: int, proj: str, suffix: str, tensor: torch.Tensor) -> str | None:
        """Copy one checkpoint tensor into slot ``index``; returns an error string on mismatch."""
        param = getattr(self, f"{'w2' if proj == 'down_proj' else 'w13'}_{suffix}", None)
        if param is None:
            return f"unexpected tensor kind '{suffix}' for {self.fmt} experts"
        dst = param.data[index]
        if proj != "down_proj":
            half = dst.shape[0] // 2
            dst = dst[:half] if proj == "gate_proj" else dst[half:]
        if tuple(dst.shape) != tuple(tensor.shape):
            return f"shape {list(tensor.shape)} != expected {list(dst.shape)}"
        dst.copy_(tensor)
        return None

    def prepack_for_cpu(self, dtype: torch.dtype) -> bool:
        """INT4 / MXFP4 experts: convert them once to the layout the backend's expert kernels read (the CPU's
        tiles; else, INT4 only, torch's CPU int4 GEMM for activations of ``dtype``) and drop the checkpoint
        layout. False where the backend has no such layout for them (``Backend.prepare_quant_experts``,
        ``Backend.prepack_int4_experts``)."""
        if self.fmt not in ("int4", "mxfp4") or self.num == 0:
            return False
        # the backend's own layout (Backend.prepare_quant_experts) replaces the checkpoint's
        tiles = self.ops.prepare_quant_experts(
            self.fmt,
            self.w13_weight_packed,
            self.w13_weight_scale,
            self.w2_weight_packed,
            self.w2_weight_scale,
            self.quant.group_size,
        )
        if tiles is not None:
            self.tiled_fmt, self.inter = self.fmt, self.w13_weight_packed.shape[1] // 2
            self.register_buffer("w13_tiles", tiles[0], persistent=False)
            self.register_buffer("w2_tiles", tiles[1], persistent=False)
            self._drop_checkpoint_layout("tiles")
            return True
        if self.fmt != "int4":
            return False
        packed = self.ops.prepack_int4_experts(
            self.w13_weight_packed,
            self.w13_weight_scale,
            self.w2_weight_packed,
            self.w2_weight_scale,
            self.quant.group_size,
            dtype,
        )
        if packed is None:
            return False
        for name, t in zip(("w13_int4pack", "w13_scales_zeros", "w2_int4pack", "w2_scales_zeros"), packed):
            self.register_buffer(name, t, persistent=False)
        self._drop_checkpoint_layout("int4pack")
        return True

    def _drop_checkpoint_layout(self, fmt: str) -> None:
        for name in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"):
            getattr(self, name).data = torch.empty(0, dtype=getattr(self, name).dtype)
        self.fmt = fmt

    def param_dtype(self, proj: str, suffix: str) -> torch.dtype | None:
        p = getattr(self, f"{'w2' if proj == 'down_proj' else 'w13'}_{suffix}", None)
        return None if p is None else p.dtype

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x [T, D], ids [T, k] in 0..num (num: computed elsewhere, adds nothing), weights [T, k] in x.dtype
        act = self.activation
        if self.fmt == "dense":
            return self.ops.moe_experts(x, ids, weights, self.w13_weight, self.w2_weight, activation=act)
        if self.fmt == "tiles":
            return self.ops.moe_experts_tiled(
                x, ids, weights, self.tiled_fmt, self.w13_tiles, self.w2_tiles, self.inter, activation=act
            )
        if self.fmt == "int4pack":
            return self.ops.moe_experts_int4pack_cpu(
                x,
                ids,
                weights,
                self.w13_int4pack,
                self.w13_scales_zeros,
                self.w2_int4pack,
                self.w2_scales_zeros,
                self.quant.group_size,
                activation=act,
            )
        if self.fmt == "int4":
            return self.ops.moe_experts_w4a16(
                x,
                ids,
                weights,
                self.w13_weight_packed,
                self.w13_weight_scale,
                self.w2_weight_packed,
                self.w2_weight_scale,
                self.quant.group_size,
                activation=act,
            )
        if self.fmt == "mxfp4":
            return self.ops.moe_experts_mxfp4(
                x,
                ids,
                weights,
                self.w13_weight_packed,
                self.w13_weight_scale,
                self.w2_weight_packed,
                self.w2_weight_scale,
                activation=act,
            )
        return self.ops.moe_experts_fp8(
            x,
            ids,
            weights,
            self.w13_weight,
            self.w13_weight_scale_inv,
            self.w2_weight,
            self.w2_weight_scale_inv,
            self.quant.weight_block_size,
            activation=act,
        )

    def run_subset(
        self, expert_map: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The contribution of this stack's experts only; ``expert_map`` [E] gives each global
        expert's slot in the stack or -1. -> [T, D]

        Pairs routed to experts held elsewhere get the id ``self.num``, which every MoE kernel reads
        as "adds nothing": no nonzero(), so no host sync on a device.
        """
        local = expert_map[topk_ids]  # [T, k]
        ids = torch.where(local >= 0, local, torch.full_like(local, self.num))
        return self(x, ids, weights)

    def check_activation(self) -> None:
        """Refuse (at load) a backend whose expert ops do not compute this stack's activation."""
        kind = "silu" if self.activation is None else self.activation.kind
        if kind not in self.ops.expert_activations:
            supported = ", ".join(self.ops.expert_activations)
            raise ValueError(
                f"the {self.ops.name} backend's MoE kernels compute {supported}, not the experts' activation {kind!r}"
            )


class RoutedExperts(nn.Module):
    """One layer's routed experts as this rank holds them.

    Expert parallel: rank r computes the experts ``placement`` gives it (default: a contiguous,
    possibly uneven range). Experts placed in host RAM (-1) are computed by the CPU of the rank whose
    range holds them, overlapped with the device experts (submit, compute, sync). Checkpoint tensors
    ``experts.E.{gate,up,down}_proj.<suffix>`` (or transformers 5.x's all-expert ``gate_up_proj`` /
    ``down_proj``) land in the owning stack; see ``load_weight``.
    """

    param_class = "routed_experts"  # for the planner, see engine.registry

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        par: ParallelState = SINGLE,
        placement_row: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        n = config.n_routed_experts
        self.num_experts = n
        self.prefix = prefix
        self.top_k, self.act_dtype = config.num_experts_per_tok, dtype
        self.fmt = linear_format(config.quantization, f"{prefix}.0.gate_proj")
        self.shapes = {
            "gate_proj": [config.moe_intermediate_size, config.hidden_size],
            "up_proj": [config.moe_intermediate_size, config.hidden_size],
            "down_proj": [config.hidden_size, config.moe_intermediate_size],
        }
        ep_owner = [r for r, size in enumerate(split_sizes(n, par.world_size)) for _ in range(size)]
        row = placement_row if placement_row is not None else ep_owner
        on_device = [e for e in range(n) if row[e] == par.rank]
        on_host = [e for e in range(n) if row[e] == -1 and ep_owner[e] == par.rank]
        self.local = ExpertStack(config, self.fmt, len(on_device), dtype=dtype) if on_device else None
        self.host = ExpertStack(config, self.fmt, len(on_host), torch.device("cpu"), dtype) if on_host else None
        if self.host is not None:
            self.host.host_ram = True  # computed by the CPU whatever the model's device (its backend: the CPU's)
        self._slots = {e: ("local", i) for i, e in enumerate(on_device)}
        self._slots.update({e: ("host", i) for i, e in enumerate(on_host)})
        for stack, experts in ((self.local, on_device), (self.host, on_host)):
            if stack is not None:
                self._declare_sources(stack, experts)
        self.register_buffer("local_map", _expert_map(n, on_device), persistent=False)
        self.register_buffer("host_map", _expert_map(n, on_host, torch.device("cpu")), persistent=False)
        # tokens routed to each expert, summed over steps (for hottest-first placement next start)
        self.register_buffer("routing_counts", torch.zeros(n, dtype=torch.int64), persistent=False)
        # None: every row of a step counts. A decode graph sets an integer [max_num_seqs] buffer here
        # while it runs the model, 0 on its padding rows and everywhere during capture warm-ups, so
        # that only real tokens count (engine/runner/graphs.py); a replay reads its current values.
        self.count_rows: torch.Tensor | None = None
        self.register_buffer("one", torch.ones((), dtype=torch.int64), persistent=False)  # expanded, no fill per step
        self.whole_layer_local = len(on_device) == n
        # set by a piecewise decode graph while it captures (engine/runner/piecewise.py): where the host
        # join cuts the step, and the pinned staging the graphs' copies use (kept by the graph runner)
        self.graph_breaks = None
        self.graph_staging = None
        self.executor = None
        if self.host is not None:
            self.executor = CpuExpertExecutor(self.host, self.host_map)

    def post_load(self, dtype: torch.dtype) -> None:
        """Once the weights are in (and each stack has its backend): the backend must compute the
        experts' activation; INT4 / MXFP4 stacks take the layout their backend reads, where it has one
        (CPU-held ones: kernels.cpu_quant_moe tiles)."""
        for stack in (self.local, self.host):
            if stack is not None:
                stack.check_activation()
                stack.prepack_for_cpu(dtype)

    def slot(self, expert: int) -> tuple[ExpertStack, int] | None:
        """Where global ``expert`` lives on this rank, or None when another rank holds it."""
        where = self._slots.get(expert)
        if where is None:
            return None
        return (self.local if where[0] == "local" else self.host), where[1]

    def _declare_sources(self, stack: ExpertStack, experts: list[int]) -> None:
        # The checkpoint tensors each stacked parameter is made of, by shard id (expert, proj): the
        # loader checks that num_sources arrived and names the first missing one from sources()
        # (built only then: 384 experts x 60 layers of names would slow every meta-device build).
        for pname, p in stack.named_parameters():
            projs = ("down_proj",) if pname.startswith("w2_") else ("gate_proj", "up_proj")
            p.num_sources = len(experts) * len(projs)
            p.sources = functools.partial(_expert_sources, self.prefix, experts, projs, pname.split("_", 1)[1])

    def load_weight(self, name: str, shard_id: int | None, src: TensorSource) -> list[tuple[str, object]] | None:
        """Take ``experts.<shard_id>.<proj>.<suffix>`` (``name`` = "<proj>.<suffix>") or, with
        ``shard_id`` None, transformers 5.x's ``gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I].
        Returns the (parameter, shard id) pairs filled; experts another rank holds fill nothing."""
        if shard_id is None:
            return self._load_fused(name, src)
        proj, suffix = name.split(".", 1)
        if proj not in self.shapes:
            return None
        if shard_id >= self.num_experts:
            raise src.error(f"expert {shard_id} out of range (n_routed_experts={self.num_experts})")
        if suffix == "weight_shape":  # compressed-tensors' record of the logical [out, in]
            if src.read().tolist() != self.shapes[proj]:
                raise src.error(f"records shape {src.read().tolist()}, expected {self.shapes[proj]}")
            return []
        slot = self.slot(shard_id)
        if slot is None:
            return []
        stack, index = slot
        dtype = stack.param_dtype(proj, suffix)
        if dtype is None:
            raise src.error(f"unexpected tensor kind '{suffix}' for {self.fmt} experts")
        err = stack.load(index, proj, suffix, src.read(dtype))
        if err:
            raise src.error(err)
        return [(self._param_name(stack, proj, suffix), (shard_id, proj))]

    def _load_fused(self, name: str, src: TensorSource) -> list[tuple[str, object]] | None:
        if name not in ("gate_up_proj", "down_proj"):
            return None
        if src.shape[0] != self.num_experts:
            raise src.error(f"{src.shape[0]} experts, expected {self.num_experts}")
        full = None
        filled = []
        for e in range(self.num_experts):
            slot = self.slot(e)
            if slot is None:
                continue
            stack, index = slot
            if full is None:
                full = src.read(stack.param_dtype("down_proj", "weight"))
            # [E, D, I] down, or [E, 2I, D] gate rows then up rows
            parts = [("down_proj", full[e])] if name == "down_proj" else zip(("gate_proj", "up_proj"), full[e].chunk(2))
            for proj, t in parts:
                err = stack.load(index, proj, "weight", t)
                if err:
                    raise src.error(err)
                filled.append((self._param_name(stack, proj, "weight"), (e, proj)))
        return filled

    def _param_name(self, stack: ExpertStack, proj: str, suffix: str) -> str:
        return f"{'local' if stack is self.local else 'host'}.{'w2' if proj == 'down_proj' else 'w13'}_{suffix}"

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        counted: bool = False,
        before_join=None,
    ) -> torch.Tensor:
        """``counted``: the router already added this routing to ``routing_counts`` (in its launch).
        ``before_join``: called once, with no argument, after the device's own experts are enqueued and
        before waiting for the host experts' result: the caller's work that does not need it (the
        shared experts) then runs while the CPU computes, instead of after the join (issue 38)."""
        if not counted and self.count_rows is not None:
            count_routing(self.routing_counts, topk_ids, self.count_rows)
        elif not counted:  # index_add_ rather than bincount, which syncs with the host on a device
            flat = topk_ids.reshape(-1)
            self.routing_counts.index_add_(0, flat, self.one.expand(flat.shape[0]))
        # Weights the router gave in fp32 stay fp32: every expert kernel multiplies each expert's
        # output by its weight in fp32 and sums in fp32, as the reference MoE does (transformers'
        # Kimi Linear experts multiply the half-precision output by the fp32 weight; vLLM/SGLang fold it
        # into the fp32 accumulator). Rounding the weight to bf16 first costs up to 2^-9 relative per
        # expert. Routers told to round (``weights_dtype``) hand them over in x.dtype: no copy then.
        w = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.to(x.dtype)
        if self.whole_layer_local:
            y = self.local(x, topk_ids, w)
            if before_join is not None:
                before_join()
            return y
        if self.graph_breaks is not None and self.executor is not None:
            return self._forward_segmented(x, topk_ids, w, before_join)
        # host share first (a worker thread; on a device, one non-blocking copy to pinned memory), then
        # the device's own experts beside it, then the join: one non-blocking copy back
        pending = self.executor.submit(x, topk_ids, w) if self.executor is not None else None
        y = None
        if self.local is not None:
            timing = self.executor.timing if self.executor is not None else None
            with timing.device_span(x.device) if timing is not None else contextlib.nullcontext():
                y = self.local.run_subset(self.local_map, x, topk_ids, w)
        if before_join is not None:
            before_join()
        if pending is not None:
            return pending.add_to(y)
        return y if y is not None else torch.zeros_like(x)

    def reserve_graph_staging(self, staging, rows: int, device: torch.device) -> None:
        """Size the piecewise graphs' pinned staging for ``rows`` tokens of this layer's layout, before
        any capture (allocating page-locked memory is not allowed inside one)."""
        staging.reserve(rows, device, self.act_dtype, self.shapes["down_proj"][0], self.top_k)

    def _forward_segmented(self, x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor, before_join) -> torch.Tensor:
        """The host join inside a piecewise decode graph's capture (engine/runner/piecewise.py): the
        rows staged into the graphs' pinned block, cut A (the worker starts), the device's own
        experts and ``before_join`` (shared experts), cut B (the worker's result is in), the pinned
        output copied to the device and added. Every address here is fixed across replays."""
        breaks, staging = self.graph_breaks, self.graph_staging
        if staging is None:
            raise RuntimeError(f"{self.prefix}: a piecewise capture needs the graphs' host staging")
        # reserved and frozen before the capture (``reserve_graph_staging``): this only checks the layout
        staging.reserve(x.shape[0], x.device, x.dtype, x.shape[1], topk_ids.shape[1])
        job = self.executor.graph_job(x, topk_ids, w, staging)
        breaks.cut(job.start)
        y = self.local.run_subset(self.local_map, x, topk_ids, w) if self.local is not None else None
        if before_join is not None:
            before_join()
        breaks.cut(job.finish)
        out = staging.to_device(staging.output(x.shape[0], wait=False), x.device, record=False)
        return out if y is None else y.add_(out)


def _expert_sources(prefix: str, experts: list[int], projs: tuple[str, ...], suffix: str) -> dict:
    return {(e, proj): f"{prefix}.{e}.{proj}.{suffix}" for e in experts for proj in projs}


def _expert_map(n: int, experts: list[int], device: torch.device | None = None) -> torch.Tensor:
    m = torch.full((n,), -1, dtype=torch.int64, device=device)
    if experts:
        m[torch.tensor(experts, device=device)] = torch.arange(len(experts), device=device)
    return m


class MoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        par: ParallelState = SINGLE,
        placement_row: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.parallel = par.is_parallel
        self.gate = Router(config)
        self.experts = RoutedExperts(config, f"{prefix}.experts", par, placement_row, dtype)
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = MLP(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                config.quantization,
                f"{prefix}.shared_experts",
                par,
                dtype,
                "shared_experts",
            )

    def forward(self, x: torch.Tensor, x32: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's partial sum (its experts + its shard of the shared experts); the caller reduces.
        ``x32``: None, or ``x.float()`` already made (the router computes in fp32)."""
        topk_ids, topk_weights = self.gate(
            x if x32 is None else x32, self.experts.routing_counts, x.dtype, self.experts.count_rows
        )
        shared = []  # the shared experts, enqueued before the host experts' join
        hook = (lambda: shared.append(self.shared_experts(x))) if self.shared_experts is not None else None
        y = self.experts(x, topk_ids, topk_weights, counted=True, before_join=hook)
        if shared:
            y = y.add_(shared[0])  # y is this call's own output: add in place
        return y
