"""The MLA decode tile per architecture (``kernels.mla_decode.mla_decode_launch_params``).

Plain CPU tests: the choice for H200 (sm_90), MI300X (gfx942) and MI355X (gfx950), from architecture
names and from device-property objects shaped like ``torch.cuda.get_device_properties``'s, without a
GPU. (tests/kernels/triton/test_compile_targets.py compiles the chosen tiles and checks the compiler's own
shared memory and spill figures.) Under TRITON_INTERPRET=1 (a child process): the kernel with each
architecture's tile matches the PyTorch reference.
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import types

import pytest
import torch

from tests.helpers.interpret import case_registry, child_main, close, needs_triton, run_interpreted

CASES, case = case_registry()
ARCHS = ("sm_90", "gfx942", "gfx950")


def _paged(lens, width, block_size=16):
    pool = torch.randperm(sum(-(-n // block_size) for n in lens) + 2).tolist()
    tables = [[pool.pop() for _ in range(-(-n // block_size))] for n in lens]
    blocks = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (blocks - len(t)) for t in tables], dtype=torch.int32)
    cache = torch.randn((max(max(t) for t in tables) + 1) * block_size, width)
    return cache, table, torch.tensor(lens, dtype=torch.int32)


@case
def each_architecture_tile_matches_reference():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.mla_decode import MLALaunchParams, mla_decode, mla_decode_launch_params

    heads, r, rope = 40, 64, 16  # 40 heads: partial head blocks for every tile below
    lens = [1, 37, 150]
    cache, table, ctx = _paged(lens, r + rope)
    q = torch.randn(len(lens), heads, r + rope)
    want = ref.mla_decode_reference(q, cache, table, ctx, max(lens), 16, r, 0.125)
    tiles = {arch: mla_decode_launch_params(arch, heads, r, rope, torch.float16) for arch in ARCHS}
    # and the tiles chosen at Kimi K2's shape (64 heads, r 512): H200 32 x 32, MI300X/MI355X 64 x 16
    tiles["k2_h200"] = MLALaunchParams("sm_90", 32, 32, 8, 2, 0, 0)
    tiles["k2_mi3xx"] = MLALaunchParams("gfx942", 64, 16, 4, 1, 0, 0)
    notes = []
    for name, params in tiles.items():
        close(mla_decode(q, cache, table, ctx, max(lens), 16, r, 0.125, params=params), want, 1e-4)
        got = mla_decode(q.half(), cache.half(), table, ctx, 512, 16, r, 0.125, params=params)  # a graph's bound
        assert got.dtype == torch.float16 and got.shape == (3, heads, r)
        close(got, want, 2e-2)
        notes.append(f"{name} {params.block_h}x{params.block_n}")
    return ", ".join(notes)


if __name__ == "__main__":
    child_main(CASES)


# --- pytest side ------------------------------------------------------------------------------

pytestmark = needs_triton


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("tests.kernels.triton.test_mla_decode_params")


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    print(result)
    assert result.startswith("ok"), result


# Device properties as torch reports them (fields of torch.cuda.get_device_properties); the MI355X
# one reports 64 KB of shared memory per block, as some ROCm releases do for gfx950.
H200 = types.SimpleNamespace(
    name="NVIDIA H200",
    major=9,
    minor=0,
    shared_memory_per_block=49152,
    shared_memory_per_block_optin=232448,
    regs_per_multiprocessor=65536,
    warp_size=32,
    multi_processor_count=132,
)
MI300X = types.SimpleNamespace(
    name="AMD Instinct MI300X",
    major=9,
    minor=4,
    gcnArchName="gfx942:sramecc+:xnack-",
    shared_memory_per_block=65536,
    warp_size=64,
    multi_processor_count=304,
)
MI355X = types.SimpleNamespace(
    name="AMD Instinct MI355X",
    major=9,
    minor=5,
    gcnArchName="gfx950:sramecc+:xnack-",
    shared_memory_per_block=65536,
    warp_size=64,
    multi_processor_count=256,
)
RTX_3090 = types.SimpleNamespace(
    name="NVIDIA GeForce RTX 3090",
    major=8,
    minor=6,
    shared_memory_per_block_optin=101376,
    regs_per_multiprocessor=65536,
    warp_size=32,
)


def test_limits_from_names_and_properties():
    from kimitui.kernels.triton.mla_decode import gpu_limits

    assert gpu_limits("sm_90").shared_bytes == gpu_limits(H200).shared_bytes == 232448
    assert gpu_limits("gfx942").shared_bytes == gpu_limits(MI300X).shared_bytes == 64 * 1024
    assert gpu_limits("gfx950").shared_bytes == gpu_limits(MI355X).shared_bytes == 160 * 1024  # not the 64 KB reported
    assert gpu_limits("gfx942:sramecc+:xnack-").arch == "gfx942" and gpu_limits(MI300X).warp_size == 64
    assert gpu_limits(RTX_3090).shared_bytes == 101376 and gpu_limits(RTX_3090).arch == "sm_86"
    odd = types.SimpleNamespace(gcnArchName="gfx1100", shared_memory_per_block=65536, warp_size=32)
    assert gpu_limits(odd).shared_bytes == 65536 and gpu_limits(odd).warp_size == 32


# Kimi K2: 64 heads on one GPU, 16 per rank at tensor parallel 4, 8 at 8; K3: 96 heads.
@pytest.mark.parametrize(
    "device, heads, want",
    [
        (H200, 64, (32, 32, 8, 2)),
        (H200, 8, (16, 32, 8, 2)),
        (H200, 96, (32, 32, 8, 2)),
        (MI300X, 64, (64, 16, 4, 1)),
        (MI300X, 16, (16, 32, 4, 1)),
        (MI300X, 96, (64, 16, 4, 1)),
        (MI355X, 64, (64, 16, 4, 2)),
        (MI355X, 16, (16, 32, 4, 2)),
        (MI355X, 96, (64, 16, 4, 2)),
    ],
)
def test_kimi_tiles(device, heads, want):
    from kimitui.kernels.triton.mla_decode import mla_decode_launch_params

    params = mla_decode_launch_params(device, heads, 512, 64, torch.bfloat16)
    assert (params.block_h, params.block_n, params.num_warps, params.num_stages) == want, params
    assert params.fits
    assert params == mla_decode_launch_params(params.arch, heads, 512, 64, torch.bfloat16)  # name == properties


def test_the_latent_cache_is_read_fewer_times():
    from kimitui.kernels.triton.mla_decode import mla_decode_launch_params

    reads = {
        d.name: mla_decode_launch_params(d, 64, 512, 64, torch.bfloat16).head_blocks(64) for d in (H200, MI300X, MI355X)
    }
    # the fixed 16-head tile read K2's cache 4 times per sequence on every GPU
    assert reads == {"NVIDIA H200": 2, "AMD Instinct MI300X": 1, "AMD Instinct MI355X": 1}


@pytest.mark.parametrize("device", [H200, MI300X, MI355X, RTX_3090])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads, r, rope", [(64, 512, 64), (16, 512, 64), (20, 256, 32), (128, 128, 0)])
def test_every_choice_is_within_the_estimates(device, dtype, heads, r, rope):
    from kimitui.kernels.triton.mla_decode import _estimate, gpu_limits, mla_decode_launch_params

    limits = gpu_limits(device)
    params = mla_decode_launch_params(device, heads, r, rope, dtype)
    assert params.block_h >= 16 and params.block_h & (params.block_h - 1) == 0
    if params.fits:
        cap = min(limits.max_regs_per_thread, limits.regs_per_program // (params.num_warps * limits.warp_size))
        assert params.shared_bytes <= limits.shared_bytes and params.regs_per_thread <= cap, (params, limits)
    else:  # only fp32 at r = 512 on MI3xx and a 99 KB part: the smallest tile
        assert dtype == torch.float32 and r == 512 and (params.block_h, params.block_n) == (16, 16), params
        assert limits.backend == "hip" or limits.shared_bytes < 128 * 1024
    # the old fixed tile (16 heads x 64 tokens, 4 warps) is over the MI300X register estimate
    old_shared, old_regs = _estimate(gpu_limits("gfx942"), 16, 64, 4, 2, 512, 64, 2)
    assert old_regs > 512 and old_shared > 64 * 1024


def test_partial_sums_stay_within_the_reserved_bound():
    # engine/plan/activation_reserve.py reserves (256 + B * ceil(H / 16)) x 16 head rows of fp32
    # partial sums for the decode; bigger head blocks must not take more splits' worth of memory.
    from kimitui.kernels.triton.mla_decode import _num_splits, mla_decode_launch_params

    for device in (H200, MI300X, MI355X):
        for heads in (8, 16, 64, 96):
            params = mla_decode_launch_params(device, heads, 512, 64, torch.bfloat16)
            for batch in (1, 3, 16, 64, 256):
                for context in (1, 100, 4096, 131072):
                    blocks = params.head_blocks(heads)
                    splits = _num_splits(batch, blocks, context, params.block_n, params.block_h)
                    assert batch * splits * heads <= (256 + batch * -(-heads // 16)) * 16, (params, batch, context)


def test_bad_input_is_one_clear_line():
    from kimitui.kernels.triton.mla_decode import gpu_limits, mla_decode_launch_params

    for call, match in [
        (lambda: gpu_limits("tpu_v5"), "unknown GPU architecture 'tpu_v5'"),
        (lambda: gpu_limits(types.SimpleNamespace(name="x")), "without a compute capability or gcnArchName"),
        (lambda: mla_decode_launch_params("sm_90", 0, 512, 64, torch.bfloat16), r"num_heads \(0\)"),
        (lambda: mla_decode_launch_params("sm_90", 8, 512, 64, torch.int8), "dtype must be fp16/bf16/fp32"),
    ]:
        with pytest.raises(ValueError, match=match) as info:
            call()
        assert "\n" not in str(info.value)
