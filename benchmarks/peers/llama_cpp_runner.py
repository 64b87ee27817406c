"""llama.cpp's tools as the side-by-side benchmarks run them: convert a checkpoint to GGUF with its own
``convert_hf_to_gguf.py``, quantize the experts, ``llama-batched-bench`` for speed and
``llama-perplexity --kl-divergence`` for KL."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Llama:
    def __init__(self, folder: Path, python: str | None):
        self.folder = folder
        self.bin = folder / "build" / "bin"
        self.python = python or str(Path(os.path.abspath(folder)).parent / "venv" / "bin" / "python")
        need = ["llama-batched-bench", "llama-quantize", "llama-perplexity"]  # llama-server: --no-serve skips it
        missing = [b for b in need if not (self.bin / b).is_file()]
        if missing or not (folder / "convert_hf_to_gguf.py").is_file():
            raise SystemExit(
                f"{folder}: no llama.cpp build ({', '.join(missing) or 'convert_hf_to_gguf.py'} "
                "missing); the build recipe is at the top of this script"
            )
        if not Path(self.python).is_file():
            raise SystemExit(f"--llama-python {self.python}: no such Python (llama.cpp's converter venv)")

    def run(self, args: list[str], log: Path, timeout: float = 3600) -> str:
        # stdout (llama.cpp's LOG(): results) and stderr (its timestamped log) in two files: sharing one
        # file, the block-buffered stdout lost its last lines
        err = log.with_name(log.name + ".err")
        with open(log, "w") as f, open(err, "w") as g:
            p = subprocess.run(args, stdout=f, stderr=g, timeout=timeout, cwd=str(self.folder))
        text = log.read_text(errors="replace") + err.read_text(errors="replace")
        if p.returncode:
            tail = "".join(text.splitlines(keepends=True)[-25:])
            raise SystemExit(f"{args[0]} exited {p.returncode}; last lines of {log}:\n{tail}")
        return text

    def convert(self, ckpt: Path, out: Path, outtype: str, log: Path) -> None:
        if out.is_file():
            return
        tmp = out.with_name(out.name + ".partial")
        self.run(
            [
                self.python,
                str(ROOT / "benchmarks" / "peers" / "llama_cpp_vocab.py"),
                str(self.folder),
                str(ckpt),
                "--outfile",
                str(tmp),
                "--outtype",
                outtype,
            ],
            log,
        )
        tmp.rename(out)

    def quantize_experts(self, src: Path, out: Path, kind: str, threads: int, log: Path) -> None:
        if out.is_file():
            return
        tmp = out.with_name(out.name + ".partial")
        # the routed experts to ``kind``, everything else kept bf16 (with BF16 as the target type
        # llama-quantize copies every tensor as it is, overrides included; hence the inverse form)
        keep = ["attn=bf16", "shexp=bf16", "ffn_(gate|up|down)\\.weight=bf16", f"exps={kind}"]
        self.run(
            [
                str(self.bin / "llama-quantize"),
                *[a for k in keep for a in ("--tensor-type", k)],
                "--output-tensor-type",
                "bf16",
                "--token-embedding-type",
                "bf16",
                str(src),
                str(tmp),
                kind.upper(),
                str(threads),
            ],
            log,
        )
        text = log.read_text(errors="replace")
        if not re.search(rf"_exps\.weight.*{kind}", text):
            raise SystemExit(f"llama-quantize left the experts unquantized; see {log}")
        tmp.rename(out)

    def batched_bench(self, gguf: Path, n: int, input_len: int, output_len: int, threads: int, log: Path) -> dict:
        ctx = n * (input_len + output_len) + 16
        for _ in range(3):  # the result line can be lost at exit on a busy machine (see ``kl``): run again
            text = self.run(
                [
                    str(self.bin / "llama-batched-bench"),
                    "-m",
                    str(gguf),
                    "-c",
                    str(ctx),
                    "-b",
                    "2048",
                    "-ub",
                    "512",
                    "-npp",
                    str(input_len),
                    "-ntg",
                    str(output_len - 1),
                    "-npl",
                    str(n),
                    "-t",
                    str(threads),
                    "-tb",
                    str(threads),
                    "--output-format",
                    "jsonl",
                ],
                log,
            )
            rows = [json.loads(line) for line in text.splitlines() if line.startswith('{"n_kv_max"')]
            if rows:
                break
        else:
            raise SystemExit(f"llama-batched-bench printed no result line in 3 runs; see {log}")
        r = rows[-1]
        return {"ttft": r["t_pp"], "full": r["t"], "decode": r["t_tg"], "flash_attn": r["flash_attn"]}

    def kl(self, gguf: Path, base: Path, n_ctx: int, n_chunk: int, threads: int, log: Path) -> dict:
        # llama.cpp's logger is a thread that the process does not drain at exit (llama.cpp issue
        # 22142): on a busy machine the last lines, the statistics included, can be lost. The last
        # chunk's line carries the same running means; failing both, run again.
        for _ in range(3):
            text = self.run(
                [
                    str(self.bin / "llama-perplexity"),
                    "-m",
                    str(gguf),
                    "--kl-divergence-base",
                    str(base),
                    "--kl-divergence",
                    "-c",
                    str(n_ctx),
                    "-b",
                    str(n_ctx),
                    "-t",
                    str(threads),
                    "-tb",
                    str(threads),
                ],
                log,
            )
            mean = re.search(r"Mean\s+KLD:\s+([-0-9.eE+]+)", text)
            top = re.search(r"Same top p:\s+([0-9.]+)", text)
            if mean:
                return {"kl": float(mean[1]), "same_top": float(top[1]) / 100 if top else float("nan")}
            last = re.search(
                rf"^\s*{n_chunk}\s+\S+ ±\s+\S+\s+\S+ ±\s+\S+\s+(\S+) ±\s+\S+\s+\S+ ±\s+\S+ %\s+(\S+) ±", text, re.M
            )
            if last:
                return {"kl": float(last[1]), "same_top": float(last[2]) / 100}
        raise SystemExit(f"llama-perplexity printed no KL statistics in 3 runs; see {log}")
