"""Compatibility shim: module-level kernel entry points that forward to a default backend.

Layers hold a ``kernels.backend.Backend`` in their ``ops`` attribute (set by the model when it is
loaded) and call ``self.ops.linear(...)``; this module keeps code written against the older
``dispatch.linear(...)`` form running while it is converted. Each call forwards to the backend
``select_backend`` picks for its first tensor's device type, with the settings read from the
environment the first time that device type is seen (then fixed for the process, as a model's own
backend is fixed at load). New code should not import it.
"""

from __future__ import annotations

import functools

import torch

from kernels.backend import Backend, select_backend  # noqa: F401  (re-exported)
from kernels.settings import KernelSettings


@functools.cache
def backend_for(device_type: str) -> Backend:
    """The default backend for tensors on ``device_type`` (float32 on a CPU), chosen once."""
    return select_backend(torch.device(device_type), torch.float32, KernelSettings.from_env())


def _ops(x) -> Backend:
    return backend_for(x.device.type)


def linear(x, w):
    return _ops(x).linear(x, w)


def linear_fp8_block(x, w, scale_inv, block=(128, 128)):
    return _ops(x).linear_fp8_block(x, w, scale_inv, block)


def linear_w4a16(x, packed, scale, k, group_size=32):
    return _ops(x).linear_w4a16(x, packed, scale, k, group_size)


def linear_mxfp4(x, packed, scale):
    return _ops(x).linear_mxfp4(x, packed, scale)


def rms_norm(x, weight, eps=1e-6):
    return _ops(x).rms_norm(x, weight, eps)


def moe_route(x, weight, bias, top_k, n_group=1, topk_group=1, scoring_func="sigmoid", norm_topk_prob=True,
              scaling=1.0):
    return _ops(x).moe_route(x, weight, bias, top_k, n_group, topk_group, scoring_func, norm_topk_prob, scaling)


def moe_experts(x, topk_ids, topk_weights, w13, w2):
    return _ops(x).moe_experts(x, topk_ids, topk_weights, w13, w2)


def moe_experts_w4a16(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32):
    return _ops(x).moe_experts_w4a16(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                     group_size)


def moe_experts_int4pack_cpu(x, topk_ids, topk_weights, w13, w13_sz, w2, w2_sz, group_size):
    return _ops(x).moe_experts_int4pack_cpu(x, topk_ids, topk_weights, w13, w13_sz, w2, w2_sz, group_size)


def moe_experts_mxfp4(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale):
    return _ops(x).moe_experts_mxfp4(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)


def moe_experts_fp8(x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, block=(128, 128)):
    return _ops(x).moe_experts_fp8(x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, block)


def mla_decode(q, cache, block_tables, context_lens, max_context_len, block_size, kv_lora_rank, scale):
    return _ops(q).mla_decode(q, cache, block_tables, context_lens, max_context_len, block_size, kv_lora_rank,
                              scale)


def kda_chunk(q, k, v, g, beta, initial_state, cu_seqlens, scale):
    return _ops(q).kda_chunk(q, k, v, g, beta, initial_state, cu_seqlens, scale)


def kda_recurrent(q, k, v, g, beta, state, slots, scale):
    return _ops(q).kda_recurrent(q, k, v, g, beta, state, slots, scale)


def causal_conv1d(x, weight, history, cu_seqlens=None):
    return _ops(x).causal_conv1d(x, weight, history, cu_seqlens)
