"""kt-kernel (KTransformers' CPU MoE, PyPI ``kt-kernel``) on the same packed experts, for
benchmarks/cpu_experts.py. Imported only when ``kt_kernel`` imports.

kt-kernel reads experts from a safetensors checkpoint through its own loader, so ``prepare`` writes
the benchmark's weights in the layout each of its methods reads (RAWINT4: compressed-tensors
``weight_packed`` / ``weight_scale`` / ``weight_shape``, the same bits as ours; MXFP4: the
DeepSeek-V4 ``ffn.experts.{i}.w1`` names) into a temporary folder. Running it on a CPU-only torch
needs three work-arounds, all outside its package: ``pin_memory`` dropped (its buffers ask for
pinned memory, which needs a GPU), ``KT_FORCE_SYNC_SUBMIT=1`` (no CUDA stream callbacks), and the
tensors its loader returns kept alive (its AVX2 backends keep raw pointers to them).

Which kernels run: kt-kernel loads one of its extension builds (``_kt_kernel_ext_<variant>``) from
the CPU flags in /proc/cpuinfo (``amx`` needs amx_tile, amx_int8, amx_bf16 and AVX-512
VNNI/VBMI/BF16; ``KT_KERNEL_CPU_VARIANT`` overrides it), then picks a backend class per method at
load time: RAWINT4 -> ``AMXInt4_KGroup_MOE`` (C++ ``AMX_K2_MOE_TP``; ``KT_RAWINT4_BACKEND=amx_blocked``
gives its blocked-tile variant ``AMXInt4_KGroupBlocked_MOE``, ``avx2`` / ``avxvnni`` the others),
MXFP4 -> ``AMXFP4_KGroup_MOE`` (``AMX_FP4_MOE_TP``; ``KT_MXFP4_BACKEND=avx2`` the AVX2 one). Both
take the checkpoint's own group-32 values, so the same bits as ours. Its ``AMXINT4`` / ``AMXINT8``
methods instead requantise bf16 weights into kt's own per-row format (other values than the
checkpoint's), so they are not the same experts and are not run here.
"""

from __future__ import annotations

import os
import tempfile

import torch

os.environ.setdefault("KT_FORCE_SYNC_SUBMIT", "1")

import kt_kernel  # noqa: E402  (after the environment variable it reads)


def _drop_pin_memory() -> None:
    # Patched in this benchmark process only: kt-kernel's buffers ask for pinned host memory.
    for name in ("zeros", "empty", "full", "ones"):
        fn = getattr(torch, name)
        if getattr(fn, "_kt_unpinned", False):
            continue

        def unpinned(*a, _fn=fn, **k):
            k.pop("pin_memory", None)
            return _fn(*a, **k)

        unpinned._kt_unpinned = True
        setattr(torch, name, unpinned)
    torch.Tensor.pin_memory = lambda self, *a, **k: self


def _write(fmt: str, w: dict[str, torch.Tensor], inter: int, folder: str) -> None:
    from safetensors.torch import save_file

    out = {}
    for e in range(w["w13"].shape[0]):
        mats = {
            "gate": (w["w13"][e, :inter], w["w13_scale"][e, :inter]),
            "up": (w["w13"][e, inter:], w["w13_scale"][e, inter:]),
            "down": (w["w2"][e], w["w2_scale"][e]),
        }
        for proj, (packed, scale) in mats.items():
            if fmt == "int4":
                base = f"model.layers.0.mlp.experts.{e}.{proj}_proj"
                out[f"{base}.weight_packed"] = packed.contiguous()
                out[f"{base}.weight_scale"] = scale.contiguous()
                out[f"{base}.weight_shape"] = torch.tensor([packed.shape[0], packed.shape[1] * 8], dtype=torch.int32)
            else:
                base = f"model.layers.0.ffn.experts.{e}.{dict(gate='w1', up='w3', down='w2')[proj]}"
                out[f"{base}.weight"] = packed.contiguous().view(torch.int8)
                out[f"{base}.scale"] = scale.contiguous().view(torch.float8_e8m0fnu)
    save_file(out, os.path.join(folder, "model.safetensors"))


BACKEND_ENV = {"int4": "KT_RAWINT4_BACKEND", "mxfp4": "KT_MXFP4_BACKEND"}


def backends(fmt: str, spec: str) -> list[str]:
    """The kt backends to time for ``fmt`` from a ``--kt-backends`` value: ``auto`` is kt's own
    choice; ``best`` every AMX backend this build has for the format (the row then takes the
    fastest); otherwise a comma list of values of kt's ``KT_RAWINT4_BACKEND`` / ``KT_MXFP4_BACKEND``."""
    if spec == "best":
        names = ("amx", "amx_blocked") if fmt == "int4" else ("amx",)
        if kt_kernel.__cpu_variant__ != "amx":  # its avx512 builds: kt's own choice is the one
            return ["auto"]
        return list(names)
    return [b.strip() for b in spec.split(",") if b.strip()]


def prepare(fmt: str, w: dict[str, torch.Tensor], hidden: int, inter: int, args, backend: str = "auto"):
    """A callable ``run(x bf16 [T, D], ids [T, k], weights [T, k]) -> [T, D]`` over kt-kernel's MoE
    holding ``w``, or None (with the reason printed) when it cannot run here. ``backend``: a value of
    kt's backend environment variable for the format, ``auto`` for kt's own choice. ``run.backend``
    names the class kt built (``<variant>/<class>``)."""
    _drop_pin_memory()
    env = BACKEND_ENV[fmt]
    saved = os.environ.pop(env, None)
    if backend != "auto":
        os.environ[env] = backend
    folder = tempfile.mkdtemp(prefix="kt-experts-")
    try:
        _write(fmt, w, inter, folder)
        from kt_kernel.utils.amx import NativeMoEWrapper

        NativeMoEWrapper.force_release_loader()  # its loader is a singleton bound to one folder
        wrapper = kt_kernel.KTMoEWrapper(
            layer_idx=0,
            num_experts=w["w13"].shape[0],
            num_experts_per_tok=args.top_k,
            hidden_size=hidden,
            moe_intermediate_size=inter,
            gpu_experts_mask=None,
            cpuinfer_threads=args.threads,
            threadpool_count=1,
            weight_path=folder,
            chunked_prefill_size=max(512, max(int(b) for b in args.batches.split(","))),
            method="RAWINT4" if fmt == "int4" else "MXFP4",
        )
        keep = []  # what its loader returns: its backends hold raw pointers into these, it drops them
        load = wrapper.loader.load_experts
        wrapper.loader.load_experts = lambda *a, **k: keep.append(load(*a, **k)) or keep[-1]
        wrapper.load_weights(torch.arange(w["w13"].shape[0]))
    except Exception as exc:
        print(
            f"kt-kernel {fmt} {backend}: not run ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        )
        return None
    finally:
        os.environ.pop(env, None)
        if saved is not None:
            os.environ[env] = saved

    def run(x, ids, weights):
        assert keep
        return wrapper.forward(x.bfloat16().contiguous(), ids.long().contiguous(), weights.float().contiguous(), None)

    run.backend = f"{kt_kernel.__cpu_variant__}/{type(wrapper.moe).__name__}"
    return run


def variant() -> str:
    return f"kt-kernel {getattr(kt_kernel, '__version__', '?')} ({kt_kernel.__cpu_variant__})"
