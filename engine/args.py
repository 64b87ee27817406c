"""EngineArgs: every engine knob, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimitui.engine.spec_decode.config import SpeculativeConfig
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu.build import pending_builds
from kimitui.kernels.settings import KernelSettings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineArgs:
    """Settings shared by the offline API, the TUI, ``kimitui bench`` and ``kimitui serve``.

    ``model``: checkpoint directory, or None / "demo" for the built-in demo checkpoint.
    ``cpu_offload``: "auto", "none" or a number of routed experts per MoE layer kept in host RAM.
    ``enforce_eager``: run every step eagerly; otherwise decode-only steps on a cuda/rocm device with
    one rank replay a CUDA/HIP graph per batch-size bucket (engine/runner/graphs.py), every bucket
    captured at start-up unless ``lazy_graph_capture`` (then each on the first step that needs it).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    cpu_offload: str | int = "auto"
    gpu_memory_gb: float | None = None
    kv_cache_tokens: int | None = None  # cap the cache size (tests, small machines)
    routing_stats: str | None = None  # JSON of tokens per expert per layer from an earlier run
    seed: int = 0
    enforce_eager: bool = False  # vLLM's name: no CUDA/HIP graph capture of decode steps
    lazy_graph_capture: bool = False  # capture each decode graph bucket on first use, not at start-up
    numa: str = "auto"  # host experts per NUMA node: auto (split when >1 node) or off; engine.offload.numa
    # vLLM's dict (or its JSON): {"method": "ngram" | "suffix" | "eagle3", "num_speculative_tokens": k, ...};
    # parsed into engine.spec_decode.SpeculativeConfig (``speculative``). None: no speculation.
    speculative_config: dict | str | None = None
    # Hybrid (KDA) models: a prefix state snapshot every this many prompt tokens (a multiple of
    # block_size), besides those at a prompt's and a finished request's last full block.
    state_snapshot_interval: int = 512

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ValueError(f"gpu_memory_gb must be > 0, got {self.gpu_memory_gb}")
        off = self.cpu_offload
        if not (
            off in ("auto", "none") or (isinstance(off, int) and off >= 0) or (isinstance(off, str) and off.isdigit())
        ):
            raise ValueError(f"cpu_offload must be auto, none or a non-negative integer, got {off!r}")
        if self.state_snapshot_interval < self.block_size or self.state_snapshot_interval % self.block_size:
            raise ValueError(
                f"state_snapshot_interval must be a positive multiple of block_size ({self.block_size}), "
                f"got {self.state_snapshot_interval}"
            )
        if self.numa not in ("auto", "off"):
            raise ValueError(f"numa must be auto or off, got {self.numa!r}")
        self.speculative  # noqa: B018 (validates the dict now, not at load time)

    @property
    def speculative(self):
        """``speculative_config`` parsed (engine.spec_decode.SpeculativeConfig), or None."""
        return SpeculativeConfig.parse(self.speculative_config)

    def resolve_device(self) -> torch.device:
        """'auto' picks the GPU torch sees (CUDA or ROCm), else the CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but torch sees no CUDA/ROCm GPU")
        if dev.type == "cuda":
            # rank r runs on GPU base + r (engine.parallel.workers.rank_device): all of them must be visible
            base, visible = dev.index or 0, torch.cuda.device_count()
            if base + self.tensor_parallel_size > visible:
                raise ValueError(
                    f"device {self.device!r} with {self.tensor_parallel_size} GPU(s) needs GPUs {base}.."
                    f"{base + self.tensor_parallel_size - 1}, but torch sees {visible} (indices 0.."
                    f"{visible - 1}; CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES choose them)"
                )
        return dev

    def resolve_dtype(self, device: torch.device, checkpoint_dtype: str, config=None) -> torch.dtype:
        """'auto': the checkpoint's dtype on GPU; on CPU whichever of float32 and bf16 runs faster
        there (``cpu_auto_dtype``; ``config``: the checkpoint's ``ModelConfig``, when known)."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cpu":
            return cpu_auto_dtype(checkpoint_dtype, config)[0]
        return _DTYPES.get(checkpoint_dtype, torch.bfloat16)


# CPU flags (/proc/cpuinfo) with bf16 arithmetic in hardware: AVX-512 BF16 dot products, AMX tiles
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _bf16_blocks(config) -> bool:
    # the models whose decoder layers the C++ kernels run in bf16: DeepSeek-V3 / Kimi K2 shapes,
    # unquantised or with packed INT4 / MXFP4 experts (their kernels take bf16 activations, AMX tiles
    # where the CPU has them: a step 10-12% shorter than float32's, benchmarks/README.md "MXFP4
    # against INT4 end to end"); FP8 checkpoints and Kimi Linear's KDA layers and gated MLA stay float32
    quant = config.quantization
    return (
        (quant is None or quant.method in ("int4", "mxfp4"))
        and not config.layer_types
        and not config.mla_use_output_gate
        and not config.mla_use_nope
        and config.hidden_act == "silu"
        and not config.routed_expert_hidden_size
        and not config.attn_res_block_size
    )


def cpu_auto_dtype(
    checkpoint_dtype: str, config=None, flags: set[str] | None = None, kernels: bool | None = None
) -> tuple[torch.dtype, str]:
    """``--dtype auto`` on a CPU: (dtype, why). bf16 when the checkpoint is bf16 and DeepSeek-V3-shaped,
    unquantised or with packed INT4 / MXFP4 experts (``config``, an ``engine.config.ModelConfig``;
    None: not checked), the CPU has
    bf16 arithmetic (``avx512_bf16`` or ``amx_bf16``: oneDNN's bf16 products for prefill) or is
    AVX2-only (bf16 products there run in float32 on widened weights), and the C++ few-row kernels
    are built (they read bf16 weights in decode, half the bytes of float32: benchmarks/README.md
    measures bf16 decode faster than float32 on both); float32 otherwise (AVX-512 without bf16:
    oneDNN emulates bf16 products there, not measured). ``flags`` and ``kernels`` default to
    this machine's (``kernels``: the C++ extension is enabled and builds, compiling it on first use)."""
    if checkpoint_dtype != "bfloat16":
        return torch.float32, f"the checkpoint is {checkpoint_dtype}, not bfloat16"
    if config is not None and not _bf16_blocks(config):
        return torch.float32, "FP8 or non-DeepSeek-V3 layers: the bf16 C++ kernels do not cover them"
    flags = cpu_flags() if flags is None else flags
    have = [f for f in _BF16_FLAGS if f in flags]
    if not have and {"avx2", "fma"} <= flags and "avx512f" not in flags:
        # AVX2 only: no bf16 arithmetic, but the C++ kernels widen bf16 weights in registers and the
        # products that would be slow in bf16 there run in float32 (kernels/cpu/backend.py): decode
        # reads half the bytes, measured 1.0-1.5x float32 at 1-64 requests on an AVX2 EPYC
        have = ["avx2 (bf16 weights widened in the C++ kernels)"]
    if not have:
        return torch.float32, "this CPU has no bf16 arithmetic (avx512_bf16 / amx_bf16) and is not AVX2-only"
    if kernels is None:
        kernels = KernelSettings.from_env().cpu_kernels and cpu_few_rows.available()
    if not kernels:
        return torch.float32, "the C++ CPU kernels are off or do not build here"
    return torch.bfloat16, f"bf16 checkpoint, CPU with {' and '.join(have)}, C++ kernels built"


def pending_kernel_builds() -> list[str]:
    """The C++ CPU kernels this process would compile before its first step ("<name> (about N min)"
    each; none after an install), so a load screen can say so before the wait."""
    return pending_builds()
