"""KL against float32 with llama.cpp's definitions (tools/perplexity/perplexity.cpp): our float32
log-probs written as a ``--kl-divergence-base`` file, and the same sums in numpy for our own paths."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_kl_base(path: Path, sequences: list[list[int]], logprobs, vocab: int) -> None:
    """llama.cpp's ``--kl-divergence-base`` file: "_logits_", n_ctx, n_vocab, n_chunk, the tokens,
    then per sequence and scored position (the second half) the row as llama.cpp stores it: scale
    and min log-prob (two floats), then uint16 steps above the min over a 16-nat range."""
    import numpy as np

    n_ctx = len(sequences[0])
    nv = 2 * ((vocab + 1) // 2) + 4
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([n_ctx], dtype=np.uint32).tobytes())
        f.write(np.array([vocab, len(sequences)], dtype=np.int32).tobytes())
        f.write(np.array(sequences, dtype=np.int32).tobytes())
        for rows in logprobs:  # [positions, vocab] log-probs (= logits up to a constant)
            rows = rows.astype(np.float32)
            mx = rows.max(axis=1, keepdims=True)
            mn = np.maximum(rows.min(axis=1, keepdims=True), mx - 16)
            lse = np.log(np.exp((rows - mx).astype(np.float64)).sum(axis=1, keepdims=True)).astype(np.float32)
            min_lp = (mn - mx - lse)[:, 0]
            scale = ((mx - mn) / 65535.0)[:, 0].astype(np.float32)
            out = np.zeros((rows.shape[0], nv), dtype=np.uint16)
            inv = np.where(scale > 0, 1 / np.where(scale > 0, scale, 1), 0)[:, None]
            q = np.clip(np.where(rows > mn, np.rint(inv * (rows - mn)), 0), 0, 65535).astype(np.uint16)
            out[:, 4 : 4 + vocab] = q
            head = np.stack([scale, min_lp.astype(np.float32)], axis=1).view(np.uint16)
            out[:, :4] = head
            f.write(out.tobytes())


def kl_against_base(base: Path, logprobs) -> dict:
    """Mean KL(base || tested) and the share of positions with the same top token, as
    llama-perplexity sums them (base probabilities below e^-16 skipped)."""
    import numpy as np

    raw = base.read_bytes()
    n_ctx = int(np.frombuffer(raw, np.uint32, 1, 8)[0])
    vocab, n_chunk = (int(x) for x in np.frombuffer(raw, np.int32, 2, 12))
    nv = 2 * ((vocab + 1) // 2) + 4
    first = n_ctx // 2
    per = n_ctx - 1 - first
    at = 20 + 4 * n_ctx * n_chunk
    kls, same = [], 0
    for c in range(n_chunk):
        rows = np.frombuffer(raw, np.uint16, per * nv, at + 2 * per * nv * c).reshape(per, nv)
        head = rows[:, :4].copy().view(np.float32)
        scale, min_lp = head[:, 0:1], head[:, 1:2]
        p_log = scale * rows[:, 4 : 4 + vocab].astype(np.float32) + min_lp
        q = logprobs[c].astype(np.float64)
        q = (
            q
            - np.log(np.exp(q - q.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True))
            - q.max(axis=1, keepdims=True)
        )
        keep = p_log > -16
        terms = np.where(keep, np.exp(p_log) * (p_log - q), 0.0)
        kls.extend(terms.sum(axis=1).tolist())
        same += int((p_log.argmax(axis=1) == q.argmax(axis=1)).sum())
    return {"kl": float(np.mean(kls)), "same_top": same / len(kls)}
