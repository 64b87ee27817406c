"""Train a tiny DSpark drafter on a tiny Kimi K3 target's own greedy outputs (CPU, a minute or two).

The target is a random-weight K3-shaped checkpoint (tests/helpers/k3_checkpoint.py: KDA + NoPE MLA,
latent MoE, attention residuals, unquantised, vocabulary 256). Its greedy continuations of seeded
random prompts are the data. The drafter is the plain-PyTorch DSpark of tests/helpers/dspark_reference.py
in lightseekorg/kimi-k3-dspark's layout (``fc_norm``, the ``attn_res`` stream, its own
``embed_tokens`` copied from the target, the target's LM head shared): its taps come from the naive
float64 K3 forward, and it is trained as speculators' DSpark trainer does it, teacher-forced on
anchored blocks: slot k of the block anchored at position a scores the target's greedy token after
position a + k (cross-entropy, the Markov bias fed the target's previous greedy token) and the
confidence head learns whether that slot's argmax is right (binary cross-entropy).

    python benchmarks/train_dspark_tiny.py --out tests/fixtures/dspark_tiny [--steps 400] [--k 7]

Writes ``OUT/target`` (the K3 checkpoint), ``OUT/drafter`` (config.json + model.safetensors) and
prints the teacher-forced per-slot accuracy on held-out sequences.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.helpers.dspark_checkpoint import dspark_config, write_dspark_checkpoint  # noqa: E402
from tests.helpers.dspark_reference import RefDSpark, target_taps  # noqa: E402
from tests.helpers.k3_checkpoint import write_k3_checkpoint  # noqa: E402
from tests.helpers.k3_reference import K3Reference  # noqa: E402

TARGET_KW = dict(num_layers=5, kda_layers=(1, 2, 4), full_attn_layers=(3, 5), quantized=False,
                 attn_res_block_size=2)
TAPS = [0, 2, 3]  # layer outputs, DSpark's convention (the real drafters tap 5 of 93)


def prompts(n: int, seed: int, lo: int = 6, hi: int = 20, vocab: int = 250) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


def greedy_continue(ref: K3Reference, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(ref.logprobs(seq)[-1].argmax()))
    return seq


def build_target(out: Path, seed: int) -> tuple[K3Reference, dict]:
    target_dir = out / "target"
    text = write_k3_checkpoint(target_dir, seed=seed, shards=1, **TARGET_KW)
    config = json.loads((target_dir / "config.json").read_text())
    return K3Reference(config, text), config


def examples(ref, seqs, layer_ids, stream):
    data = []
    for s in seqs:
        taps, logits = target_taps(ref, s, layer_ids, stream)
        data.append((torch.tensor(s), [t.float() for t in taps], logits.argmax(-1)))
    return data


def block_loss(model: RefDSpark, ids, taps, greedy, k: int, anchors: torch.Tensor | None = None):
    """(CE + confidence BCE, per-slot accuracy [k]) over every block that fits in the sequence."""
    t = ids.shape[0]
    if anchors is None:
        anchors = torch.arange(1, t - k)  # slot k of anchor a scores greedy[a + k]; a + k <= t - 2
    feats = model.features(taps)
    hidden = model.blocks(feats, ids, anchors, k)  # [A, k, H]
    labels = greedy[anchors[:, None] + torch.arange(k)[None]]  # [A, k]
    prev = torch.cat((ids[anchors][:, None], labels[:, :-1]), dim=1)
    logits, conf = model.step_logits(hidden, prev)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    right = (logits.argmax(-1) == labels).float()
    bce = F.binary_cross_entropy_with_logits(conf, right)
    return ce + 0.2 * bce, right.mean(0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--train-seqs", type=int, default=48)
    ap.add_argument("--gen", type=int, default=40, help="greedy tokens per training sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    ref, target_cfg = build_target(args.out, args.seed)
    text = target_cfg["text_config"]
    cfg = dspark_config(text, "lightseek", target_layer_ids=TAPS, heads=2, markov_rank=8, layers=2, yarn=False)
    seqs = [greedy_continue(ref, p, args.gen) for p in prompts(args.train_seqs + 8, args.seed + 1)]
    data = examples(ref, seqs, TAPS, cfg["aux_hidden_stream"])
    train, held = data[:args.train_seqs], data[args.train_seqs:]
    print(f"data: {len(train)} + {len(held)} sequences of ~{len(seqs[0])} tokens in {time.perf_counter() - t0:.1f} s")
    embed, head = ref.w("model.embed_tokens.weight").float(), ref.w("lm_head.weight").float()
    model = RefDSpark(cfg, embed, head, own_embedding=True)
    model.embed_tokens.weight.requires_grad_(False)  # frozen, as the target's (the exporter copies it)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    for step in range(args.steps):
        ids, taps, greedy = train[step % len(train)]
        loss, _ = block_loss(model, ids, taps, greedy, args.k)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            with torch.no_grad():
                acc = torch.stack([block_loss(model, *h, args.k)[1] for h in held]).mean(0)
            print(f"step {step:4d} loss {loss.item():.3f} held-out slot accuracy "
                  + " ".join(f"{a:.2f}" for a in acc.tolist()))
    tensors = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    write_dspark_checkpoint(args.out / "drafter", cfg, tensors)
    print(f"wrote {args.out / 'drafter'} ({sum(v.numel() for v in tensors.values())} parameters) "
          f"in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
