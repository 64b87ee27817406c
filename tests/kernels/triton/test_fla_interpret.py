"""fla-core 0.6's own KDA Triton kernels, run by the Triton interpreter on CPU, vs kernels/kda.py.

On a GPU the Triton backend runs KDA through fla-core (kernels/triton/kda_fla.py maps our arguments onto
``chunk_kda``, ``fused_recurrent_kda_fwd`` and ``causal_conv1d`` / ``causal_conv1d_update``). The
interpreter runs third-party kernels too, so this checks that whole path end to end before a GPU
exists: through our wrapper, on K3-like inputs (head dim 128, the bounded gate g in (-5, 0),
sequences not a multiple of the 64-token chunk, varlen batches with an empty sequence, states in and
out, strided q/k/v views as the KDA layer passes them), in fp32 against the PyTorch forms of
kernels/kda.py and the per-token oracle in kernels/reference/k3.py. It also runs the fla options the
wrapper does not use yet but K3 serving may: the bounded "safe gate" (``safe_gate=True``,
``lower_bound=-5``, gate computed in the kernel from ``A_log``/``dt_bias``) and the recurrent
kernel's speculative-decoding mode (``ssm_state_indices`` [N, T] + ``num_accepted_tokens``).

Same plumbing as ``test_fused_small_ops``: the cases run once in a child process with
``TRITON_INTERPRET=1`` set before triton is imported. What fla 0.6 needs from the interpreter
(triton 3.9.0), and the test-only workarounds the child applies before running a case
(``_interpreter_workarounds``); none of them changes what a kernel computes:

- Multi-config ``@triton.autotune`` (fla's ``fla_cache_autotune`` subclasses triton's
  ``Autotuner``) benchmarks every config through ``driver.active``, and a GPU-less process has no
  driver: ``RuntimeError: 0 active drivers``. Workaround: ``Autotuner.prune_configs`` keeps one
  config, the one with the largest tile product (fewest interpreted programs).
- ``fla/ops/common/chunk_delta_h.py`` ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64`` calls
  ``i_t.to(tl.int64)`` on the induction variable of a plain ``for i_t in range(NT)``. Compiled
  Triton makes that variable a tensor; the interpreter runs Python's ``range`` and hands out an
  ``int``: ``AttributeError: 'int' object has no attribute 'to'``. Workaround: the interpreter's
  AST rewrite (``triton.runtime.interpreter.ASTTransformer``) gets a ``visit_For`` that wraps the
  variable of ``range``/``tl.range`` loops in ``to_tensor`` (``static_range`` stays an int, as
  compiled).
- ``fla/ops/utils/op.py`` binds ``gather = tl.gather`` at import. The interpreter patches the
  builtins as attributes of ``triton.language`` only when a kernel runs, so the alias keeps the
  unpatched builtin and the safe-gate kernel ``chunk_kda_fwd_kernel_intra_sub_chunk`` fails with
  "Did you forget to add @triton.jit ?". Workaround: ``fla.ops.kda.chunk_intra.gather`` becomes a
  ``@triton.jit`` function that calls ``tl.gather``.

With those, everything below runs. Not covered here: bf16 inputs (the interpreter's bf16 ``tl.dot``
multiplies raw bits, triton issue #11584), fp32 TF32 dots and the config fla's autotuner picks on a
real GPU, and the backward kernels (inference does not use them).

Speed (CPU seconds on a 2-core VM shared with other jobs, triton 3.9): importing fla (it pulls in
all of ``fla.ops`` and torch's inductor) ~10 s; the wrapper's chunk case ~9 s, of which fla's default
intra-chunk kernel (``chunk_kda_fwd_kernel_intra_token_parallel``: one program per token, each with a
20-step binary search over ``cu_seqlens``) takes ~6 s; the same sizes through the safe-gate kernel
(``chunk_kda_fwd_kernel_intra_sub_chunk``) ~0.9 s; decode and conv cases 0.3-2 s. The two slow cases
(``-m slow``: 230 rows of 4 heads, fp16 inputs) take ~40 s and ~10 s.
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import time

import pytest
import torch

from tests.helpers.interpret import case_registry, child_main, needs_triton, run_interpreted

CASES, case = case_registry()
SLOW_CASES, slow_case = case_registry()

# fp32 end to end; fla works in a different order (WY form in sub-chunks, exp2 of log2 decays), so
# not bit-equal. Measured errors are ~1e-7 on outputs of size ~0.1-1.
TOL = 2e-5
LOWER_BOUND = -5.0  # K3's linear_attn_config.gate_lower_bound


def _interpreter_workarounds(gather) -> None:
    """Let fla 0.6 run under the triton 3.9 interpreter (see the module docstring); ``gather`` is
    the jit stand-in for fla's ``tl.gather`` alias. Child only."""
    import ast

    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def tile(config) -> int:
        size = 1
        for value in config.kwargs.values():
            size *= value if isinstance(value, int) else 1
        return size

    Autotuner.prune_configs = lambda self, kwargs: [max(prune(self, kwargs), key=tile)]

    def visit_for(self, node):
        node = self.generic_visit(node)
        fn = node.iter.func if isinstance(node.iter, ast.Call) else None
        is_range = (isinstance(fn, ast.Name) and fn.id == "range") or (
            isinstance(fn, ast.Attribute) and fn.attr == "range"
        )
        if is_range and isinstance(node.target, ast.Name):
            name = node.target.id
            wrap = ast.Call(
                func=ast.Attribute(
                    value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor", ctx=ast.Load()
                ),
                args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)],
                keywords=[],
            )
            node.body.insert(0, ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=wrap))
        return node

    interpreter.ASTTransformer.visit_For = visit_for

    import fla.ops.kda.chunk_intra

    fla.ops.kda.chunk_intra.gather = gather


def _scale(K: int) -> float:
    """Not fla's default (K ** -0.5), so a scale the wrapper failed to pass would show."""
    return 0.7 * K**-0.5


def _close(got, want, what, tol=TOL):
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    return err


def _qkv_views(T, H, K, V, dtype=torch.float32):
    """q, k, v as the KDA layer hands them over: [T, H, D] views into one [T, 2HK + HV] conv output."""
    y = torch.randn(T, 2 * H * K + H * V, dtype=dtype)
    q, k, v = y.split([H * K, H * K, H * V], dim=-1)
    return q.view(T, H, K), k.view(T, H, K), v.view(T, H, V)


def _gates(T, H, K):
    """K3's bounded log-decay: lower_bound * sigmoid(.), in (-5, 0), with values near both ends."""
    return LOWER_BOUND * torch.sigmoid(3 * torch.randn(T, H, K)), torch.rand(T, H)


def _chunk_through_wrapper(cu, H, K, V, dtype=torch.float32):
    from kimitui.kernels import kda
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton import kda_fla

    cu_seqlens = torch.tensor(cu)
    T, N = cu[-1], len(cu) - 1
    q, k, v = _qkv_views(T, H, K, V, dtype)
    assert not q.is_contiguous()
    g, beta = _gates(T, H, K)
    h0 = torch.randn(N, H, K, V)
    scale = _scale(K)
    start = time.process_time()
    o, final = kda_fla.chunk_kda(q, k, v, g, beta, h0, cu_seqlens, scale)
    spent = time.process_time() - start
    assert o.shape == (T, H, V) and o.dtype == dtype and final.shape == (N, H, K, V) and final.dtype == torch.float32
    want_o, want_final = kda.chunk_kda(q, k, v, g, beta, h0, cu_seqlens, scale)
    # fp16 inputs: fla keeps its intermediates (w, u, the per-chunk states) in the input dtype.
    tol = TOL if dtype == torch.float32 else 2e-3
    errs = [
        _close(o, want_o, "o vs kda.chunk_kda", tol),
        _close(final, want_final, "final state vs kda.chunk_kda", tol),
    ]
    oracle_o, oracle_final = ref.kda_recurrence_reference(q, k, v, g, beta, h0, cu_seqlens, scale)
    errs += [_close(o, oracle_o, "o vs per-token oracle", tol), _close(final, oracle_final, "final vs oracle", tol)]
    return f"max err {max(errs):.1e}, fla {spent:.1f} s cpu"


# --- through kernels/triton/kda_fla.py (what the GPU path calls) --------------------------------------


@case
def chunk_kda_wrapper_varlen_uneven_k128():
    # K = V = 128 (K3's head dim); 67 rows = a full 64-token chunk and a 3-row tail; an empty
    # sequence (its state passes through); a sequence shorter than one chunk. Initial states in.
    return _chunk_through_wrapper([0, 67, 67, 70], H=2, K=128, V=128)


@case
def recurrent_kda_wrapper_decode_slots():
    from kimitui.kernels import kda
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton import kda_fla

    # Four decode steps of three sequences living in slots 4, 0, 2 of a 5-slot pool (the other
    # slots must stay untouched), q/k/v as strided views, the bounded gate.
    H, K, V, N, steps = 2, 128, 128, 3, 4
    slots = torch.tensor([4, 0, 2])
    pool = torch.randn(5, H, K, V)
    before = pool.clone()
    pool_ours = pool.clone()
    outs, ins = [], []
    spent = 0.0
    for _ in range(steps):
        q, k, v = _qkv_views(N, H, K, V)
        g, beta = _gates(N, H, K)
        t0 = time.process_time()
        o = kda_fla.recurrent_kda(q, k, v, g, beta, pool, slots, _scale(K))
        spent += time.process_time() - t0
        want = kda.recurrent_kda(q, k, v, g, beta, pool_ours, slots, _scale(K))
        _close(o, want, "o vs kda.recurrent_kda")
        outs.append(o)
        ins.append((q, k, v, g, beta))
    _close(pool, pool_ours, "state pool vs kda.recurrent_kda")
    assert torch.equal(pool[[1, 3]], before[[1, 3]]), "slots outside `slots` changed"
    # The same tokens as N packed sequences of `steps` rows through the per-token oracle.
    packed = [torch.stack([step[j] for step in ins], 1).flatten(0, 1) for j in range(5)]
    o_ref, final_ref = ref.kda_recurrence_reference(*packed, before[slots], torch.arange(N + 1) * steps, _scale(K))
    err = _close(torch.stack(outs, 1).flatten(0, 1), o_ref, "o vs oracle")
    _close(pool[slots], final_ref, "states vs oracle")
    return f"max err {err:.1e}, fla {spent:.1f} s cpu for {steps} steps"


@case
def causal_conv1d_wrapper_prefill_and_decode():
    from kimitui.kernels import kda
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton import kda_fla

    # Channels as a strided slice of a wider row (the layer's qkv view), W = 4 (K3), fp32 weight;
    # sequence lengths 70 (crosses fla's 64-row conv tile), 0, 1 and 2 (shorter than W - 1: the
    # new history mixes old history and new rows), each continuing its own history.
    C, W = 96, 4
    cu = torch.tensor([0, 70, 70, 71, 73])
    T, N = 73, 4
    x = torch.randn(T, C + 5)[:, :C]
    w, hist = torch.randn(C, W), torch.randn(N, C, W - 1)
    hist_before = hist.clone()
    t0 = time.process_time()
    y, new_hist = kda_fla.causal_conv1d(x, w, hist, cu)
    spent = time.process_time() - t0
    want_y, want_hist = kda.causal_conv1d(x, w, hist, cu)
    assert torch.equal(hist, hist_before), "the wrapper wrote its input history"
    errs = [_close(y, want_y, "prefill y vs kda"), _close(new_hist, want_hist, "prefill history vs kda")]
    ref_y, ref_hist = ref.causal_conv1d_reference(x, w, hist, cu)
    errs += [_close(y, ref_y, "prefill y vs oracle"), _close(new_hist, ref_hist, "prefill history vs oracle")]
    # Decode: one row per sequence, continuing from the prefill's history.
    xd = torch.randn(N, C + 3)[:, 3:]
    y, hist2 = kda_fla.causal_conv1d(xd, w, new_hist)
    want_y, want_hist2 = kda.causal_conv1d(xd, w, want_hist)
    errs += [_close(y, want_y, "decode y vs kda"), _close(hist2, want_hist2, "decode history vs kda")]
    return f"max err {max(errs):.1e}, fla {spent:.1f} s cpu (prefill)"


# --- fla options for K3 that the wrapper does not use (yet) ------------------------------------


@case
def chunk_kda_safe_gate_in_kernel_k3():
    import fla.ops.kda

    from kimitui.engine.layers.kda import kda_gate
    from kimitui.kernels import kda

    # K3's gate computed inside fla: g = lower_bound * sigmoid(exp(A_log[h]) * (a + dt_bias)) with
    # safe_gate=True (the M=16 sub-chunk kernel fla enables for bounded gates). Ours computes the
    # gate in PyTorch (engine.layers.kda.kda_gate) and runs kernels/kda.py on it.
    H, K, V = 2, 128, 128
    cu = torch.tensor([0, 67, 70])
    T, N = 70, 2
    q, k, v = _qkv_views(T, H, K, V)
    a_raw, beta = torch.randn(T, H, K), torch.rand(T, H)
    A_log, dt_bias = torch.rand(H) * 2.7, torch.randn(H * K)  # exp(A_log) in (1, 15), like log U(1, 16)
    h0 = torch.randn(N, H, K, V)
    t0 = time.process_time()
    o, final = fla.ops.kda.chunk_kda(
        q[None],
        k[None],
        v[None],
        a_raw[None],
        beta[None],
        scale=_scale(K),
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        safe_gate=True,
        lower_bound=LOWER_BOUND,
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=cu,
    )
    spent = time.process_time() - t0
    g = kda_gate(a_raw + dt_bias.view(H, K), A_log, LOWER_BOUND)
    want_o, want_final = kda.chunk_kda(q, k, v, g, beta, h0, cu, _scale(K))
    errs = [_close(o[0], want_o, "o"), _close(final, want_final, "final state")]
    # The same safe-gate kernels with the gate precomputed (what the wrapper could pass for K3).
    o2, final2 = fla.ops.kda.chunk_kda(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        scale=_scale(K),
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        safe_gate=True,
        lower_bound=LOWER_BOUND,
        cu_seqlens=cu,
    )
    errs += [_close(o2[0], want_o, "o, precomputed gate"), _close(final2, want_final, "final, precomputed gate")]
    return f"max err {max(errs):.1e}, fla {spent:.1f} s cpu"


@case
def fused_recurrent_kda_gate_in_kernel_k3():
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from kimitui.engine.layers.kda import kda_gate
    from kimitui.kernels import kda

    # Decode with K3's bounded gate and beta's sigmoid inside fla's recurrent kernel.
    H, K, V, N = 2, 128, 128, 3
    q, k, v = (t.contiguous() for t in _qkv_views(N, H, K, V))
    a_raw, b_logit = torch.randn(N, H, K), torch.randn(N, H)
    A_log, dt_bias = torch.rand(H) * 2.7, torch.randn(H * K)
    pool, slots = torch.randn(4, H, K, V), torch.tensor([3, 1, 0])
    pool_ours = pool.clone()
    o, _ = fused_recurrent_kda_fwd(
        q[:, None],
        k[:, None],
        v[:, None],
        a_raw[:, None],
        b_logit[:, None],
        A_log=A_log,
        dt_bias=dt_bias,
        initial_state=pool,
        scale=_scale(K),
        inplace_final_state=True,
        ssm_state_indices=slots.int(),
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        lower_bound=LOWER_BOUND,
    )
    g = kda_gate(a_raw + dt_bias.view(H, K), A_log, LOWER_BOUND)
    want = kda.recurrent_kda(q, k, v, g, torch.sigmoid(b_logit), pool_ours, slots, _scale(K))
    return f"max err {max(_close(o[:, 0], want, 'o'), _close(pool, pool_ours, 'state pool')):.1e}"


@case
def fused_recurrent_kda_spec_decode_semantics():
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from kimitui.kernels import reference as ref

    # Speculative decoding (verify pass): sequence n feeds T_n = 1 + drafts tokens. With
    # ssm_state_indices [N, max T] int32 (contiguous rows) and num_accepted_tokens [N] int32, the
    # state read at the start is pool row indices[n, num_accepted_tokens[n] - 1] (the slot holding
    # the state after the last token accepted in the previous step) and the state after token t is
    # written in place to pool row indices[n, t]; no other row is touched. Both layouts: batched
    # [N, T, ...] and varlen ([1, sum T_n, ...] with cu_seqlens, rows of indices padded).
    H, K, V = 2, 32, 32
    notes = []
    for layout, lens in (("batched", [3, 3]), ("varlen", [3, 1])):
        N, total = len(lens), sum(lens)
        pool = torch.randn(8, H, K, V)
        before = pool.clone()
        indices = torch.tensor([[1, 4, 6], [0, 3, 5]], dtype=torch.int32)
        accepted = torch.tensor([2, 3], dtype=torch.int32)  # seq 0 reads row 4, seq 1 row 5
        q, k, v = torch.randn(total, H, K), torch.randn(total, H, K), torch.randn(total, H, V)
        g, beta = LOWER_BOUND * torch.sigmoid(torch.randn(total, H, K)), torch.rand(total, H)
        if layout == "batched":
            args = [t.view(N, lens[0], *t.shape[1:]) for t in (q, k, v, g, beta)]
            cu = None
        else:
            args = [t[None] for t in (q, k, v, g, beta)]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        o, _ = fused_recurrent_kda_fwd(
            *args,
            initial_state=pool,
            scale=_scale(K),
            inplace_final_state=True,
            ssm_state_indices=indices,
            num_accepted_tokens=accepted,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu,
        )
        o = o.reshape(total, H, V)
        errs, bos, written = [], 0, set()
        for n, length in enumerate(lens):
            start = before[indices[n, accepted[n] - 1].long()][None]
            for t in range(length):  # the state after t + 1 tokens
                rows = slice(bos, bos + t + 1)
                o_ref, s_ref = ref.kda_recurrence_reference(
                    q[rows], k[rows], v[rows], g[rows], beta[rows], start, torch.tensor([0, t + 1]), _scale(K)
                )
                errs.append(_close(pool[indices[n, t].long()], s_ref[0], f"{layout}: seq {n} state after token {t}"))
                written.add(int(indices[n, t]))
            errs.append(_close(o[bos : bos + length], o_ref, f"{layout}: seq {n} outputs"))
            bos += length
        others = [r for r in range(8) if r not in written]
        assert torch.equal(pool[others], before[others]), f"{layout}: rows outside the written slots changed"
        notes.append(f"{layout} max err {max(errs):.1e}")
    return ", ".join(notes)


@case
def recurrent_kda_spec_wrapper_verify_step():
    from kimitui.kernels import kda

    # A verify step as the KDA layer runs it on a GPU: three sequences of 3, 1 and 4 rows (drafts
    from kimitui.kernels.triton import kda_fla

    # + 1), slots 6, 1, 3 of a 12-row pool whose rows 7..11 are scratch; each sequence starts from its
    # own slot and keeps the state after every position (scratch rows, its slot last).
    H, K, V, lens = 2, 64, 64, [3, 1, 4]
    indices = torch.tensor([[7, 8, 6, 6], [1, 1, 1, 1], [9, 10, 11, 3]])
    pool = torch.randn(12, H, K, V)
    before = pool.clone()
    pool_ours = pool.clone()
    q, k, v = _qkv_views(sum(lens), H, K, V)
    g, beta = _gates(sum(lens), H, K)
    o = kda_fla.recurrent_kda_spec(q, k, v, g, beta, pool, indices, lens, _scale(K))
    want = kda.recurrent_kda_spec(q, k, v, g, beta, pool_ours, indices, lens, _scale(K))
    err = max(_close(o, want, "o vs kda.recurrent_kda_spec"), _close(pool, pool_ours, "pool vs kda.recurrent_kda_spec"))
    untouched = [0, 2, 4, 5]
    assert torch.equal(pool[untouched], before[untouched]), "rows outside the layout changed"
    return f"max err {err:.1e}"


# --- larger K3-like cases (slow under the interpreter) -----------------------------------------


@slow_case
def chunk_kda_wrapper_k3_heads_long_varlen():
    # Several chunks per sequence (100 = 64 + 36, 129 = 2 x 64 + 1), a 1-row sequence, 4 heads of 128.
    return _chunk_through_wrapper([0, 100, 101, 230], H=4, K=128, V=128)


@slow_case
def chunk_kda_wrapper_fp16_inputs():
    # q/k/v in half precision (the interpreter's bf16 dot is broken; fp16 dots are exact), gate,
    # beta and states fp32 as the layer passes them; o comes back in q's dtype.
    return _chunk_through_wrapper([0, 3, 70], H=2, K=64, V=64, dtype=torch.float16)


if __name__ == "__main__":
    import triton
    import triton.language as tl

    @triton.jit
    def _gather(src, index, axis: tl.constexpr):
        # At module level: the interpreter patches the triton.language it finds in the globals.
        return tl.gather(src, index, axis)

    _interpreter_workarounds(_gather)
    child_main({**CASES, **SLOW_CASES})


# --- pytest side ------------------------------------------------------------------------------

pytestmark = [
    needs_triton,
    pytest.mark.skipif(__import__("importlib.util").util.find_spec("fla") is None, reason="fla-core is not installed"),
]

MODULE = "tests.kernels.triton.test_fla_interpret"


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted(MODULE, *CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fla_kernel_matches_kda(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    print(result)
    assert result.startswith("ok"), result


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_CASES))
def test_fla_kernel_matches_kda_large(name):
    result = run_interpreted(MODULE, name).get(name, "case did not run")
    print(result)
    assert result.startswith("ok"), result
