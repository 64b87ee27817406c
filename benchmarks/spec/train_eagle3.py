"""Train tiny MLA EAGLE-3 and EAGLE-3.1 drafters on a tiny Kimi K2 target's own greedy outputs (CPU,
a few minutes), and write the pair in the published layouts:

- ``<out>/target``: a DeepSeek-V3-shaped K2 checkpoint (6 layers, bf16) written by transformers;
- ``<out>/eagle3-mla``: ``Eagle3DeepseekV2ForCausalLM`` as TorchSpec exports
  lightseekorg/kimi-k2.6-eagle3-mla: ``fc``, ``layers.0.*`` (MLA names), ``norm``, ``lm_head``,
  no ``embed_tokens`` (shared with the target);
- ``<out>/eagle3.1-mla``: the same plus ``fc_norm.<i>`` and ``fc_norm`` / ``norm_output`` in config.json
  (lightseekorg/kimi-k2.6-eagle3.1-mla).

Taps: ``eagle_aux_hidden_state_layer_ids`` [1, 3, 5] read as layer inputs (vLLM's convention), like
the public [1, 29, 57] of a 61-layer K2. The trainer is the plain-PyTorch TorchSpec-style drafter of
tests/helpers/spec/eagle3_mla_torchspec.py (training-time test over ``--ttt`` steps, soft targets = the
target's next-token distribution). It prints teacher-forced accuracy per step and the greedy
acceptance that drafter measures on held-out prompts.

    OMP_NUM_THREADS=1 python -m benchmarks.spec.train_eagle3 --out tests/fixtures/eagle3_mla_pair

(about 4 minutes on a contended 2-core machine; one thread avoids spinning against other work).
A drafter this small memorises its target's continuations: on the training prompts the greedy
acceptance is ~98%, on fresh random prompts ~20% (the tiny random target has no structure to learn
beyond them). The tests read the training prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

TAPS = [1, 3, 5]
LAYERS = 6
SEED = 11


def drafter_config(target: dict, v31: bool, taps=TAPS) -> dict:
    from tests.helpers.checkpoints import BASE
    from tests.helpers.spec.eagle3_mla_checkpoint import mla_config

    # the drafter's rope as the target's (transformers 5 writes it as rope_parameters)
    target = {**target, "rope_theta": BASE["rope_theta"], "rope_scaling": BASE["rope_scaling"]}
    c = mla_config(
        target,
        aux_layer_ids=tuple(taps),
        v31=v31,
        heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        nope=16,
        rope=8,
        v_head_dim=16,
        intermediate_size=128,
        torch_dtype="float32",
    )
    return c


def make_target(out: Path):
    from transformers import DeepseekV3ForCausalLM

    from tests.helpers.checkpoints import hf_model

    hf = hf_model(SEED, num_hidden_layers=LAYERS, bias_std=0.5)
    with torch.no_grad():  # a sharper, more context-dependent target than the default init
        for name, p in hf.named_parameters():
            if name.endswith(("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight")):
                p.mul_(3.0)
    hf.to(torch.bfloat16).save_pretrained(str(out))
    return DeepseekV3ForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager").eval()


def prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 2) for _ in range(rng.choice((6, 10, 14)))] for _ in range(n)]


@torch.no_grad()
def greedy(hf, ps: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations, prompts of one length batched together (no padding)."""
    out: list[list[int] | None] = [None] * len(ps)
    for length in sorted({len(p) for p in ps}):
        idx = [i for i, p in enumerate(ps) if len(p) == length]
        for a in range(0, len(idx), 64):
            part = idx[a : a + 64]
            g = hf.generate(torch.tensor([ps[i] for i in part]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            for i, row in zip(part, g[:, length:].tolist()):
                out[i] = row
    return out


def dataset(hf, ps, conts):
    """Per sequence: all hidden states [L + 1, T, D], tokens [T], next-token probs [T, V]."""
    from tests.helpers.spec.eagle3_mla_torchspec import hf_all_states

    seqs = [p + c for p, c in zip(ps, conts)]
    data = []
    for length in sorted({len(q) for q in seqs}):  # one batched pass per length
        group = torch.tensor([q for q in seqs if len(q) == length])
        outs = []
        hooks = [
            layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
            for layer in hf.model.layers
        ]
        try:
            with torch.no_grad():
                first = hf.model.embed_tokens(group)
                logits = hf(group).logits.float()
        finally:
            for h in hooks:
                h.remove()
        states = torch.stack([first.float()] + [o.float() for o in outs], 1)  # [B, L + 1, T, D]
        for b in range(group.shape[0]):
            data.append((states[b], group[b], logits[b].softmax(-1)))
    return data


def batches(data, taps, size, rng):
    idx = list(range(len(data)))
    rng.shuffle(idx)
    for a in range(0, len(idx), size):
        group = [data[i] for i in idx[a : a + size]]
        S = min(len(g[1]) for g in group)  # crop to the shortest (sequences differ by prompt length)
        aux = torch.stack([torch.cat([g[0][k, :S] for k in taps], -1) for g in group])
        yield aux, torch.stack([g[1][:S] for g in group]), torch.stack([g[2][:S] for g in group])


def train(c: dict, embed: torch.Tensor, data, taps, steps: int, ttt: int, lr: float, seed: int, log=print):
    from tests.helpers.spec.eagle3_mla_torchspec import MLADrafter, ttt_loss

    torch.manual_seed(seed)
    d = MLADrafter(c)
    with torch.no_grad():
        d.embed_tokens.weight.copy_(embed)
    d.embed_tokens.weight.requires_grad_(False)  # frozen: the target's, shared at serving time
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    it, step, t0 = None, 0, time.monotonic()
    while step < steps:
        for aux, tok, probs in batches(data, taps, 32, rng):
            loss, acc = ttt_loss(d, aux, tok, probs, ttt)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0 or step == steps:
                log(
                    f"  step {step}: loss {loss.item():.3f}, teacher-forced accuracy per step "
                    f"{' '.join(f'{a:.2f}' for a in acc)} ({time.monotonic() - t0:.0f} s)"
                )
            if step >= steps:
                break
    return d.eval()


def write_drafter(d, c: dict, path: Path, layout: str = "torchspec") -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(d.export(layout), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c, indent=2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures/eagle3_mla_pair")
    ap.add_argument("--train-prompts", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-prompts", type=int, default=12)
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from tests.helpers.spec.eagle3_mla_torchspec import MLADrafter, greedy_acceptance

    out = Path(a.out)
    t0 = time.monotonic()
    if (out / "target" / "config.json").exists():  # keep the target (and the data made from it)
        from transformers import DeepseekV3ForCausalLM

        hf = DeepseekV3ForCausalLM.from_pretrained(
            str(out / "target"), dtype=torch.float32, attn_implementation="eager"
        ).eval()
    else:
        hf = make_target(out / "target")
    target = json.loads((out / "target" / "config.json").read_text())
    vocab = target["vocab_size"]
    train_p = prompts(a.train_prompts, 1, vocab)
    cache = out / f"data-{a.train_prompts}-{a.new_tokens}.pt"  # not part of the pair: regenerated if absent
    if cache.exists():
        data = torch.load(cache)
    else:
        conts = greedy(hf, train_p, a.new_tokens)
        data = dataset(hf, train_p, conts)
        torch.save(data, cache)
    print(f"target: {LAYERS} layers, {len(data)} training sequences ({time.monotonic() - t0:.0f} s)", flush=True)
    embed = hf.model.embed_tokens.weight.detach().float()
    eval_p = prompts(a.eval_prompts, 2, vocab)
    eval_c = greedy(hf, eval_p, 32)
    from tests.helpers.spec.eagle3_mla_torchspec import hf_all_states

    for name, v31 in (("eagle3-mla", False), ("eagle3.1-mla", True)):
        c = drafter_config(target, v31)
        print(f"{name}: training", flush=True)
        d = train(c, embed, data, TAPS, a.steps, a.ttt, a.lr, seed=3 + v31)
        write_drafter(d, c, out / name)
        d = MLADrafter.load(out / name, embed)
        for taps in (TAPS, [t + 1 for t in TAPS]):
            drafted, acc, per = greedy_acceptance(
                d, lambda ids: torch.cat([hf_all_states(hf, ids)[k] for k in taps], -1), eval_p, eval_c, 3
            )
            print(
                f"  taps {taps}: acceptance {acc / drafted:.3f} ({acc}/{drafted}), per position "
                f"{[round(x / (drafted / 3), 2) for x in per]}"
            )
    print(f"done in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
