"""The one-call recurrence of a speculative verify step (kernels/kda.py ``recurrent_kda_spec``,
fla-core's spec-decoding layout) against plain decode steps taken one position at a time."""

import torch

from kimitui.kernels import kda


def test_spec_recurrence_equals_position_by_position_decodes():
    torch.manual_seed(0)
    H, K, V, lens = 2, 16, 8, [3, 1, 4]
    slots = [6, 1, 3]
    indices = torch.tensor([[7, 8, 6, 6], [1, 1, 1, 1], [9, 10, 11, 3]])
    R = sum(lens)
    q, k, v = torch.randn(R, H, K), torch.randn(R, H, K), torch.randn(R, H, V)
    g, beta = -torch.rand(R, H, K), torch.rand(R, H)
    pool = torch.randn(12, H, K, V)
    want_pool = pool.clone()
    got = kda.recurrent_kda_spec(q, k, v, g, beta, pool, indices, lens, 0.25)
    # the oracle: sequence n's rows one at a time on its own slot, the state copied out after each
    want = torch.empty_like(got)
    start = 0
    for n, length in enumerate(lens):
        for t in range(length):
            r = start + t
            s = torch.tensor([slots[n]])
            want[r] = kda.recurrent_kda(
                q[r : r + 1], k[r : r + 1], v[r : r + 1], g[r : r + 1], beta[r : r + 1], want_pool, s, 0.25
            )[0]
            if t < length - 1:
                want_pool[indices[n, t]] = want_pool[slots[n]]
        start += length
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(pool, want_pool)
    assert not torch.equal(pool[[7, 8, 9, 10, 11]], torch.zeros_like(pool[[7, 8, 9, 10, 11]]))
