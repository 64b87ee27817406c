"""Speculative decoding on the CPU: decode tok/s with and without each proposer, in one process.

Random-weight models rarely repeat themselves, so the mechanism is measured on a model whose greedy
continuation is known: a Kimi K2-shaped (DeepSeek-V3) checkpoint whose embeddings and LM head are
arranged so that each token's successor is fixed (``succ``: a permutation made of cycles of
``--cycle`` tokens), every other weight small and random. The residual stream then stays close to
the input token's embedding, the LM head row of ``succ(t)`` is that embedding, and greedy decoding
walks the cycle. The step still reads every weight: mostly dense layers sized so one decode step
reads hundreds of MB, as a real model's decode is memory-bound.

Workloads, each at batch 1, 4 and 16:
- ``repeat`` ("code edit": the answer repeats the prompt): the prompt walks a cycle twice, so prompt
  lookup finds the continuation at once;
- ``random``: random prompt tokens; the continuation still walks a cycle, so drafts appear once the
  output has gone round it.
Models: ``successor`` (dense, the arranged one), ``random`` (same shapes, all weights random: drafts
are rejected, which prices the verification's extra rows), and ``moe`` (every layer MoE, 64 experts
top-8, arranged like ``successor``): verifying ``1 + k`` tokens reads the union of their experts.

The ``wrong`` proposer drafts random tokens, nearly always rejected: it prices what failed
speculation costs (random-weight models often loop, so prompt lookup can succeed even on them).

For each (model, workload, batch) the baseline (no speculation) and every proposer run alternately,
``--repeats`` times, the median kept; printed: decode tok/s, speedup over the baseline, acceptance rate, mean
acceptance length. The engine is built once per model with ``num_speculative_tokens`` set; the
baseline runs it with the proposer removed, which is the plain decode path.

    python benchmarks/spec/decode.py [--models successor,random,moe] [--batches 1,4,16] [--k 4]
        [--hidden 1024] [--inter 4096] [--layers 8] [--vocab 4096] [--tokens 64] [--repeats 2]
        [--threads 2] [--backoff on|off] [--json FILE] [--keep DIR]

``--backoff off`` drafts the full length every step (``speculative_config`` ``"backoff": false``);
on (the default) each request's draft length follows its recent acceptance (engine/spec_decode/backoff.py).
"""
# ruff: noqa: I001 (import order matters here: the engine sets OpenMP's wait policy before torch loads)

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# the engine before torch: it sets OpenMP's wait policy, which libgomp reads when torch loads it
from kimitui.engine import LLM, SamplingParams  # noqa: E402

import torch  # noqa: E402


def hf_config(args, moe: bool):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        moe_intermediate_size=args.hidden // 4 if moe else 256,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=512,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=64 if moe else 8,
        num_experts_per_tok=8 if moe else 2,
        n_shared_experts=1,
        first_k_dense_replace=0 if moe else args.layers - 1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )


def successor(vocab: int, cycle: int, seed: int = 0) -> list[int]:
    """A permutation of the token ids made of cycles of ``cycle`` tokens (ids 0..2 left fixed, unused)."""
    ids = list(range(3, vocab))
    random.Random(seed).shuffle(ids)
    succ = list(range(vocab))
    for c in range(0, len(ids) - cycle + 1, cycle):
        ring = ids[c : c + cycle]
        for a, b in zip(ring, ring[1:] + ring[:1]):
            succ[a] = b
    return succ


def write_checkpoint(path: Path, args, kind: str) -> list[int]:
    """Write the ``kind`` model (successor / random / moe); returns its successor map."""
    from transformers import DeepseekV3ForCausalLM

    from tests.helpers.checkpoints import rewrite_checkpoint

    cfg = hf_config(args, moe=kind == "moe")
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in DeepseekV3ForCausalLM(cfg).named_parameters()}
    g = torch.Generator().manual_seed(1)
    succ = successor(args.vocab, args.cycle)
    arranged = kind != "random"
    emb = torch.randn(args.vocab, args.hidden, generator=g)
    tensors = {}
    for name, shape in shapes.items():
        if name == "model.embed_tokens.weight":
            t = emb
        elif name == "lm_head.weight" and arranged:
            t = torch.empty(shape)
            t[torch.tensor(succ)] = emb  # row succ(t) = embedding of t
        elif "norm" in name:
            t = torch.ones(shape)
        elif "e_score_correction_bias" in name:
            t = torch.zeros(shape)
        else:  # small enough that the residual stream keeps the input embedding's direction
            t = torch.randn(shape, generator=g) * (0.004 if arranged else 0.02)
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):  # fused [E, ...]
            base, proj = name.rsplit(".", 1)
            for i in range(shape[0]):
                if proj == "gate_up_proj":
                    half = shape[1] // 2
                    tensors[f"{base}.{i}.gate_proj.weight"] = t[i, :half].to(torch.bfloat16)
                    tensors[f"{base}.{i}.up_proj.weight"] = t[i, half:].to(torch.bfloat16)
                else:
                    tensors[f"{base}.{i}.down_proj.weight"] = t[i].to(torch.bfloat16)
            continue
        tensors[name] = t.to(torch.float32 if "e_score_correction_bias" in name else torch.bfloat16)
    cfg.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    rewrite_checkpoint(path, tensors, config, shards=max(1, len(tensors) // 500))
    (path / "successor.json").write_text(json.dumps(succ))
    return succ


def prompts(workload: str, succ: list[int], n: int, cycle: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if workload == "repeat":
            t = rng.randrange(3, len(succ))
            while succ[t] == t:
                t = rng.randrange(3, len(succ))
            walk = [t]
            for _ in range(2 * cycle - 1):
                walk.append(succ[walk[-1]])
            out.append(walk)
        else:
            out.append([rng.randrange(3, len(succ)) for _ in range(2 * cycle)])
    return out


def decode_rate(outs) -> float:
    """Decode tokens per second over the batch: tokens after each request's first, over the time from
    the first first-token to the last finish."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    t0 = min(o.metrics.first_token_time for o in outs)
    t1 = max(o.metrics.finished_time for o in outs)
    return tokens / (t1 - t0)


class WrongDrafts:
    """Drafts k uniformly random tokens: nearly always rejected, so a step pays for k verification
    rows and gains nothing. What speculation costs where it fails (the ``wrong`` proposer)."""

    needs_hidden = False

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, seqs, max_drafts, hidden=None):
        return [[self.rng.randrange(3, self.vocab) for _ in range(k)] for k in max_drafts]

    def finish(self, seq_id):
        pass


def run_point(llm, proposer, batch_prompts, tokens: int, backoff=None):
    """``backoff``: the proposer's own DraftBackoff (each proposer as if in its own engine, its
    recent acceptance kept across repeats as a long-running server keeps it)."""
    eng = llm.engine
    eng.proposer = proposer
    if backoff is not None:
        eng.backoff = backoff
    before = eng.spec_stats.copy()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch_prompts], params)
    return decode_rate(outs), eng.spec_stats.since(before), [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (
        ("--hidden", 1024),
        ("--inter", 4096),
        ("--layers", 8),
        ("--vocab", 4096),
        ("--tokens", 64),
        ("--repeats", 2),
        ("--threads", 2),
        ("--k", 4),
        ("--cycle", 48),
    ):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--models", default="successor,random,moe")
    ap.add_argument("--workloads", default="repeat,random")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument(
        "--proposers",
        default="ngram,suffix,wrong",
        help="ngram, suffix, and wrong (random drafts: the cost of verification that always fails)",
    )
    ap.add_argument(
        "--backoff",
        choices=("on", "off"),
        default="on",
        help="the engine's per-request draft-length back-off (default on, as the engine)",
    )
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--keep", help="write (or reuse) the checkpoints under this directory")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kimitui.engine.spec_decode.config import SpeculativeConfig
    from kimitui.engine.spec_decode.select import make_proposer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        for kind in args.models.split(","):
            path = root / f"{kind}-{args.hidden}-{args.inter}-{args.layers}-{args.vocab}-{args.cycle}"
            if (path / "successor.json").exists():
                succ = json.loads((path / "successor.json").read_text())
            else:
                path.mkdir(parents=True, exist_ok=True)
                succ = write_checkpoint(path, args, kind)
            size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            spec = {
                "method": "ngram",
                "num_speculative_tokens": args.k,
                "prompt_lookup_min": 2,
                "prompt_lookup_max": 5,
                "backoff": args.backoff == "on",
            }
            llm = LLM(str(path), dtype="float32", max_model_len=512, max_num_seqs=16, speculative_config=spec)
            print(
                f"\n## model {kind}: {size / 1e9:.2f} GB bf16 on disk, {2 * size / 1e9:.2f} GB of float32 weights "
                f"(a dense model's decode step reads them all; an MoE step its routed experts' share), k={args.k}"
            )
            print(
                f"{'workload':8} {'batch':>5} {'proposer':8} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'mean len':>8}"
            )
            for workload in args.workloads.split(","):
                for batch in (int(b) for b in args.batches.split(",")):
                    ps = prompts(workload, succ, batch, args.cycle, seed=batch)
                    llm.generate([{"prompt_token_ids": ps[0][:8]}], SamplingParams(max_tokens=4))  # warm-up
                    names = ["none"] + args.proposers.split(",")
                    rates = {n: [] for n in names}
                    stats, tokens = {}, {}
                    from kimitui.engine.spec_decode.backoff import DraftBackoff

                    backoffs = {n: DraftBackoff.from_config(llm.engine.speculative) for n in names}
                    for _ in range(args.repeats):
                        for name in names:
                            if name == "none":
                                proposer = None
                            elif name == "wrong":
                                proposer = WrongDrafts(args.vocab)
                            else:
                                proposer = make_proposer(
                                    SpeculativeConfig.parse(
                                        {**spec, "method": name}
                                        if name != "suffix"
                                        else {
                                            "method": "suffix",
                                            "num_speculative_tokens": args.k,
                                            "backoff": args.backoff == "on",
                                        }
                                    )
                                )
                            rate, st, toks = run_point(llm, proposer, ps, args.tokens, backoffs[name])
                            rates[name].append(rate)
                            stats[name], tokens[name] = st, toks
                    best = {n: statistics.median(r) for n, r in rates.items()}  # medians of alternating runs
                    for name in names:
                        same = tokens[name] == tokens["none"]
                        st = stats[name]
                        rate = st.acceptance_rate
                        row = {
                            "model": kind,
                            "workload": workload,
                            "batch": batch,
                            "proposer": name,
                            "decode_tok_s": best[name],
                            "speedup": best[name] / best["none"],
                            "same_tokens": same,
                            **(st.as_json() if name != "none" else {}),
                        }
                        rows.append(row)
                        print(
                            f"{workload:8} {batch:5d} {name:8} {best[name]:8.1f} {row['speedup']:7.2f}x "
                            f"{'' if rate is None else f'{100 * rate:6.1f}%':>7} "
                            f"{'' if st.acceptance_length is None else f'{st.acceptance_length:8.2f}':>8}"
                            f"{'' if same else '  TOKENS DIFFER'}"
                        )
            llm.engine.shutdown()
            del llm
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
