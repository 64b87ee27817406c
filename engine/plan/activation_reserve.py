"""Activation reserve: the device memory an engine step needs on top of weights and caches, per GPU.

Derived from the engine's own code path, tensor by tensor, for the rank with the most heads
(uneven splits): for each decoder layer the tensors that stay live across it (the residual stream;
Kimi K3's attention-residual block snapshots) plus the largest transient of one sublayer (MLA, KDA,
the MoE, the dense MLP or an attention-residual mix), then the logits and the sampler. The step
shapes the scheduler can make with ``max_num_batched_tokens`` and ``max_num_seqs`` are each
estimated and the worst is kept:

- one prefill chunk of ``max_num_batched_tokens`` tokens starting a sequence;
- the same chunk over a long cached context (MLA then goes through ``kv_b_proj`` in
  ``PREFILL_SLICE``-token slices with an fp32 [H, n, slice] score buffer, engine/layers/mla.py);
- as many prefills as fit (``max_num_seqs`` short prompts: KDA copies every sequence's fp32 state);
- a decode step of ``max_num_seqs`` rows, which with CUDA/HIP graphs also stays allocated in the
  graphs' memory pool (engine/runner/graphs.py), so it is added to the prefill peak, not maxed.

Assumptions (the GPU kernels, not the CPU reference paths): fused MoE as kernels/triton/fused_moe.py
allocates it (all T*k (token, expert) pairs on every rank, [T*k, I] hidden and fp32 [T*k, D]
output; K3's SiTU is computed in the same GEMM epilogue as SiLU); MLA prefill attention through a flash/efficient SDPA kernel (no
[H, n, L] scores); quantised linears write only their output. Logits cover the sampled rows only
(one per sequence): ``prompt_logprobs`` requests add [rows, vocab] fp32 and are not covered.

The margin: the caching allocator rounds blocks (2 MiB segments above 1 MiB) and a freed block
is reused only by a request that fits it, so a step's tensors need more than their sum; PyTorch's
allocator typically wastes a few percent. We keep 10 % of the activation peak for that plus a fixed
512 MiB for what is not a tensor of the step (cuBLAS/hipBLASLt workspaces, NCCL/RCCL buffers, the
Triton launcher): vLLM's profile run likewise measures the peak and leaves the rest to its
utilisation fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kimitui.engine.config import ModelConfig
from kimitui.engine.layers.linear import linear_format, split_unit
from kimitui.engine.layers.mla import PREFILL_SLICE
from kimitui.engine.parallel.state import split_sizes
from kimitui.engine.plan.param_count import compute_dtype
from kimitui.engine.units import GiB, cdiv

WORKSPACE_BYTES = 512 << 20
FRAGMENTATION = 0.10
F32, I64 = 4, 8


@dataclass(frozen=True)
class StepShape:
    """One step the scheduler can make: ``tokens`` rows in all, ``decodes`` of them one-token decodes,
    the rest split over ``prefill_seqs`` chunks whose sequences have ``context`` tokens cached after
    the step (chunk included); ``sampled`` rows get logits."""

    tokens: int
    decodes: int = 0
    prefill_seqs: int = 0
    context: int = 0
    sampled: int = 1
    name: str = ""


@dataclass(frozen=True)
class StepPeak:
    """Peak bytes of one step and the parts live at the peak of its forward pass."""

    shape: StepShape
    forward: int  # peak of the decoder stack
    logits: int  # peak of lm_head + sampler (the forward's transients are gone)
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return max(self.forward, self.logits)


@dataclass(frozen=True)
class ActivationReserve:
    """What the planner keeps back per GPU, and what it is made of."""

    total: int
    step: StepPeak  # the worst step (prefill shapes and the decode step without graphs)
    graph_pool: int  # decode step kept by the CUDA/HIP graph pool (0 when graphs are off)
    margin: int
    max_num_batched_tokens: int
    max_num_seqs: int

    def to_dict(self) -> dict:
        return {
            "bytes": self.total,
            "given": False,
            "worst_step": self.step.shape.name,
            "step_bytes": self.step.total,
            "step_parts": dict(self.step.parts),
            "decode_graph_pool_bytes": self.graph_pool,
            "margin_bytes": self.margin,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
        }

    def line(self) -> str:
        """One line: the reserve and what it is made of."""

        def g(b: int) -> str:
            return f"{b / GiB:.2f}"

        parts = ", ".join(
            f"{k} {g(v)}" for k, v in sorted(self.step.parts.items(), key=lambda kv: -kv[1]) if v >= GiB // 100
        )
        pool = f" + decode graphs {g(self.graph_pool)} ({self.max_num_seqs} seqs)" if self.graph_pool else ""
        return (
            f"reserve per GPU {g(self.total)} GiB = {self.step.shape.name} {g(self.step.total)} ({parts})"
            f"{pool} + margin {g(self.margin)} (10% + 0.5 GiB workspace); "
            f"max_num_batched_tokens {self.max_num_batched_tokens:,}, max_num_seqs {self.max_num_seqs}"
        )


class _Dims:
    """The per-rank sizes of the rank with the most heads (splits are uneven)."""

    def __init__(self, c: ModelConfig, tp: int):
        top = lambda n: max(split_sizes(n, tp)) if n else 0  # noqa: E731
        self.b, self.tp = compute_dtype(c).itemsize, tp
        self.D, self.V, self.Vr = c.hidden_size, c.vocab_size, top(c.vocab_size)
        self.H = top(c.num_attention_heads)
        self.nope, self.rope, self.v, self.r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.qk = self.nope + self.rope
        self.ql = c.q_lora_rank or 0
        self.gate = c.mla_use_output_gate
        self.k, self.E, self.I = c.num_experts_per_tok, c.n_routed_experts, c.moe_intermediate_size
        self.De = c.routed_expert_hidden_size or c.hidden_size  # width the routed experts see
        self.Is = self._mlp_split(c, "model.layers.1.mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)
        self.Id = self._mlp_split(c, "model.layers.0.mlp", c.intermediate_size)
        self.silu = c.hidden_act == "silu"
        la = c.linear_attn
        self.Hk, self.hd = (top(la.num_heads), la.head_dim) if la else (0, 0)
        self.full_gate = bool(la and la.use_full_rank_gate)
        n = c.num_hidden_layers
        self.kinds = {
            ("kda" if c.is_kda_layer(i) else "mla", "moe" if c.is_moe_layer(i) else "dense") for i in range(n)
        }
        bs = c.attn_res_block_size
        self.blocks = cdiv(n, bs) if bs else 0  # snapshots taken at layers 0, bs, 2 bs, ...

    def _mlp_split(self, c: ModelConfig, prefix: str, inter: int) -> int:
        # engine/layers/mlp.py splits the intermediate dim on whole FP8 blocks / INT4 groups
        if not inter or self.tp == 1:
            return inter
        q = c.quantization
        unit = max(split_unit(linear_format(q, f"{prefix}.{n}"), q) for n in ("gate_proj", "down_proj"))
        return max(split_sizes(inter, self.tp, unit))


def _act(d: _Dims, rows: int, width: int) -> int:
    """act(gate) * up of [rows, width] halves: SiLU in the dtype; SiTU in fp32 (engine/layers/activation.py)."""
    if d.silu:
        return 2 * rows * width * d.b
    return rows * width * (4 * F32 + d.b)


def _mlp(d: _Dims, t: int, inter: int) -> int:
    # fused gate_up [T, 2I'], the activation, down_proj's [T, D]
    return t * 2 * inter * d.b + _act(d, t, inter) + t * d.D * d.b


def _router(d: _Dims, t: int) -> int:
    # x.float() [T, D], fp32 logits / scores / choice / masked over E experts, top-k ids and weights
    return t * d.D * F32 + 4 * t * d.E * F32 + t * d.k * (I64 + F32)


def _experts(d: _Dims, t: int) -> int:
    pairs = t * d.k
    align = pairs * 6 * I64  # moe_align_block_size's sort keys, order, ranks, destinations
    # kernels/triton/fused_moe.py (SiLU or SiTU in its GEMM epilogue): [T*k, I] hidden, fp32 [T*k, D] output,
    # its fp32 k-sum
    return align + pairs * d.I * d.b + pairs * d.De * F32 + t * d.De * (F32 + d.b)


def _moe(d: _Dims, t: int) -> int:
    latent = t * d.De * d.b * 2 if d.De != d.D else 0  # down_proj's z, the normed sum
    subset = 2 * t * d.De * d.b if d.tp > 1 else 0  # partial sums when experts are split over ranks
    routed = max(_router(d, t), _experts(d, t)) + subset
    shared = _mlp(d, t, d.Is) if d.Is else 0
    return latent + t * d.k * (I64 + F32) + t * d.De * d.b + max(routed, shared)


def _mla_prefill(d: _Dims, n: int, ctx: int) -> int:
    """Attention of one chunk of ``n`` queries over ``ctx`` cached tokens (engine/layers/mla.py)."""
    width = max(d.qk, d.v)
    if ctx <= PREFILL_SLICE:
        # gathered latent, kv_b_proj's [L, H, nope + v], padded q/k/v and the kernel's output
        return (
            ctx * (d.r + d.rope) * d.b
            + ctx * d.H * (d.nope + d.v) * d.b
            + 2 * n * d.H * width * d.b
            + 2 * ctx * d.H * width * d.b
        )
    s = PREFILL_SLICE
    # Per slice: its fp32 scores [H, n, S] and fp32 keys/values; the loop frees a slice before the
    # next one is made, so one slice is live at a time.
    kept = s * (d.H * n * F32 + d.H * (d.nope + d.v) * F32)
    made = s * (d.r + d.rope) * d.b + s * d.H * (d.nope + d.v) * d.b + s * d.H * d.qk * F32 + n * s
    return (
        n * d.H * d.qk * (F32 + d.b)  # fp32 queries (and the cat they come from)
        + kept
        + made
        + 3 * d.H * n * d.v * F32
        + 2 * d.H * n * F32
    )  # pv, acc (old and new), running max / sum


def _mla(d: _Dims, shape: StepShape) -> int:
    t = shape.tokens
    base = t * (d.ql + d.r + d.rope) * d.b + t * d.H * d.qk * d.b  # the input projections, q
    base += t * d.H * d.rope * d.b + t * (d.r + d.rope) * d.b  # roped q_pe, the normed latent written
    base += t * d.H * d.v * d.b  # the output rows
    attn = 0
    if shape.decodes:
        bsz = shape.decodes
        # kernels/triton/mla_decode.py sizes its split-K partial sums [B, splits, H, r] fp32 so that
        # B * splits * ceil(H / 16) programs are about 256: at most (256 + B * ceil(H/16)) x 16 heads
        programs = 256 + bsz * cdiv(d.H, 16)
        attn = 3 * bsz * d.H * (d.r + d.rope) * d.b + programs * 16 * (d.r + 2) * F32 + 2 * bsz * d.H * d.v * d.b
    if shape.prefill_seqs:
        n = cdiv(t - shape.decodes, shape.prefill_seqs)
        attn = max(attn, _mla_prefill(d, n, max(shape.context, n)))
    gate = 3 * t * d.H * d.v * d.b if d.gate else 0  # g_proj's output, its sigmoid, the product
    return base + max(attn, gate) + t * d.D * d.b


def _kda(d: _Dims, shape: StepShape) -> int:
    t, P = shape.tokens, d.Hk * d.hd
    proj = t * (3 * P + d.hd + d.Hk + (P if d.full_gate else d.hd)) * d.b
    gates = t * P * (d.b + 3 * F32) + t * d.Hk * F32  # f_b_proj's output, fp32 a and g, beta
    o = t * P * d.b
    # a prefill's state: gathered from its slot (then masked: the gather is freed as the product is
    # made) and the final one, two live at once (engine/layers/kda.py _prefill; decodes update in place)
    state = 2 * shape.prefill_seqs * d.Hk * d.hd * d.hd * F32
    conv = t * 3 * P * d.b + t * P * 3 * d.b  # the conv's output, the contiguous q/k/v the kernels read
    chunks = cdiv(t, 64) * d.Hk * d.hd * d.hd * F32 + t * d.Hk * 2 * d.hd * F32  # chunked delta rule
    recur = state + conv + (chunks if shape.prefill_seqs else 0)
    norm = t * P * (5 * F32 + d.b)  # the gated RMSNorm in fp32
    return proj + gates + o + max(recur, norm) + t * d.D * d.b


def _mix(d: _Dims, t: int) -> int:
    # attn_res_mix: stack of blocks + x, its fp32 copy, the normed copy, the fp32 mix
    return (d.blocks + 1) * t * d.D * (d.b + 2 * F32) + t * d.D * F32 if d.blocks else 0


def _logits(d: _Dims, t: int, rows: int) -> int:
    # lm_head's vocab shard, fp32, gathered to the full vocabulary; then the sampler: temperature
    # scaled copy, sort values and int64 order, top-k / top-p masked copies, cumulative softmax,
    # scatter back, probabilities, noise (engine/sampling/sampler.py)
    head = rows * d.Vr * (d.b + F32) + (rows * d.Vr * F32 + 2 * rows * d.V * F32 if d.tp > 1 else 0)
    sampler = rows * d.V * (5 * F32 + I64 + 1)
    return t * d.D * d.b + head + sampler


def step_peak(config: ModelConfig, tp: int, shape: StepShape) -> StepPeak:
    """Peak activation bytes of one step of ``shape`` on the rank with the most heads of ``tp``."""
    d = _Dims(config, tp)
    t = shape.tokens
    # the residual, the normed input, the sublayer output, their sum (or the attn-res mix output)
    stream = 4 * t * d.D * d.b + d.blocks * t * d.D * d.b
    if d.blocks:  # the fused mix + norm (kernels/backend.py attn_res_mix_norm) keeps the running sum and
        stream += t * d.D * (d.b + F32)  # the fp32 input of the norm alive beside the stream
    attention = max((_kda(d, shape) if a == "kda" else _mla(d, shape)) for a, _ in d.kinds)
    ffn = max((_moe(d, t) if f == "moe" else _mlp(d, t, d.Id)) for _, f in d.kinds)
    embed = 2 * t * d.D * d.b if tp > 1 else 0
    parts = {"stream": stream, "attention": attention, "ffn": ffn, "attn-res mix": _mix(d, t), "embedding": embed}
    forward = stream + max(attention, ffn, parts["attn-res mix"], embed)
    return StepPeak(shape, forward, _logits(d, t, min(shape.sampled, t)), parts)


def step_shapes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[StepShape]:
    """The worst steps the scheduler can make (engine/scheduler/scheduler.py caps a step at
    max(max_num_batched_tokens, max_num_seqs) rows and max_num_seqs sequences)."""
    t = max(max_num_batched_tokens, max_num_seqs)
    long = max(t, min(max_model_len, max(2 * PREFILL_SLICE, t + PREFILL_SLICE)))
    shapes = [
        StepShape(t, 0, 1, t, 1, f"{t:,}-token prefill chunk"),
        StepShape(t, 0, max_num_seqs, cdiv(t, max_num_seqs), max_num_seqs, f"{max_num_seqs} prefills"),
    ]
    if long > t:
        shapes.append(StepShape(t, 0, 1, long, 1, f"{t:,}-token chunk at {long:,} context"))
    return shapes


def activation_reserve(
    config: ModelConfig,
    tp: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int | None = None,
    graphs: bool = True,
) -> ActivationReserve:
    """Per-GPU reserve for ``tp`` ranks: the worst step, the decode graphs' pool, the margin."""
    for name, v in (("tp", tp), ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    model_len = max_model_len or config.max_position_embeddings
    decode = step_peak(
        config, tp, StepShape(max_num_seqs, max_num_seqs, 0, 0, max_num_seqs, f"decode of {max_num_seqs}")
    )
    worst = max(
        [step_peak(config, tp, s) for s in step_shapes(max_num_batched_tokens, max_num_seqs, model_len)] + [decode],
        key=lambda p: p.total,
    )
    pool = decode.forward if graphs else 0
    margin = int(FRAGMENTATION * (worst.total + pool)) + WORKSPACE_BYTES
    return ActivationReserve(worst.total + pool + margin, worst, pool, margin, max_num_batched_tokens, max_num_seqs)
