"""`kimitui bench` end to end on the demo checkpoint: in-process, a sweep, Ctrl-C, bad input,
and (once kimitui.server lands) the same workload over HTTP against `kimitui serve`'s app."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kimitui.cli import main
from tests.helpers.http_server import serving

VLLM_LINES = (
    "Successful requests:",
    "Benchmark duration (s):",
    "Total input tokens:",
    "Total generated tokens:",
    "Mean TTFT (ms):",
    "Mean TPOT (ms):",
    "Mean ITL (ms):",
)
VLLM_KEYS = (
    "date",
    "backend",
    "model_id",
    "num_prompts",
    "request_rate",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
)
OUR_KEYS = (
    "num_gpus",
    "tput_per_gpu",
    "avg_gpu_power_w",
    "avg_cpu_power_w",
    "energy_j",
    "tokens_per_kwh",
    "joules_per_output_token",
    "cost_per_mtok",
    "telemetry_backends",
)
WORKLOAD = [
    "--random-input-len",
    "64",
    "--random-output-len",
    "16",
    "--num-prompts",
    "8",
    "--max-concurrency",
    "4",
    "--ignore-eos",
]
GPU_POWER = {"nvml", "amdsmi"}
CPU_POWER = {"rapl", "amd_energy"}


@pytest.fixture(scope="session")
def demo_checkpoint() -> Path:
    # conftest points XDG_CACHE_HOME at a per-session temp dir: written once, reused by every test.
    from kimitui.engine.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


def _bench(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(["bench", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _saved(result_dir: Path) -> dict:
    files = sorted(result_dir.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def _check_energy_consistent(result: dict) -> None:
    # Never invent power: a figure appears exactly when a power backend was available.
    available = {b["name"] for b in result["telemetry_backends"] if b["available"]}
    gpu, cpu = available & GPU_POWER, available & CPU_POWER
    for key, source in (("avg_gpu_power_w", gpu), ("avg_cpu_power_w", cpu)):
        if source:
            assert isinstance(result[key], (int, float)), (key, result[key])
        else:
            assert result[key] is None, (key, result[key])
    if gpu or cpu:
        assert isinstance(result["energy_j"], (int, float)) and result["energy_j"] >= 0
    else:
        for key in ("energy_j", "tokens_per_kwh", "joules_per_output_token", "electricity_cost_per_mtok"):
            assert result[key] is None, (key, result[key])


def test_bench_in_process_prints_vllm_block_and_saves_json(demo_checkpoint, tmp_path, capsys):
    rc, out, err = _bench([*WORKLOAD, "--save-result", "--result-dir", str(tmp_path)], capsys)
    assert rc == 0, err
    for line in VLLM_LINES:
        assert line in out, line
    assert "Efficiency and Cost" in out
    assert "Successful requests:                     8" in out

    result = _saved(tmp_path)
    assert result["completed"] == 8 and result["failed"] == 0
    # Range ratio 0 samples 64 tokens per prompt; like vLLM, the decode/re-encode round trip may
    # leave a few more or fewer (the random demo vocabulary merges across token boundaries) and
    # the run notes the drift.
    drift = re.search(r"left (\d+) (more|fewer) prompt tokens", result["notes"] or "")
    expected = 8 * 64 + (0 if drift is None else int(drift[1]) * (1 if drift[2] == "more" else -1))
    assert result["total_input_tokens"] == expected, result["notes"]
    assert result["total_output_tokens"] == 8 * 16
    assert result["max_concurrency"] == 4 and result["backend"] == "kimitui"
    for key in VLLM_KEYS + OUR_KEYS:
        assert key in result, key
    # the demo runs where the engine puts it: on a machine without a GPU that is the CPU, and the
    # header says so instead of dividing by a GPU that is not there
    import torch

    if torch.cuda.is_available():
        assert result["num_gpus"] == 1
        assert result["tput_per_gpu"] == pytest.approx(result["total_token_throughput"])
    else:
        assert result["num_gpus"] == 0 and result["tput_per_gpu"] is None
        assert re.search(r"^GPUs:\s+0 \(CPU only\)\s*$", out, re.M)
        assert re.search(r"^Total tok/s per GPU:\s+n/a\s*$", out, re.M)
    _check_energy_consistent(result)


def test_bench_sweep_prints_frontier_and_ladder(demo_checkpoint, tmp_path, capsys):
    argv = [
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
        "--num-prompts",
        "4",
        "--sweep-concurrency",
        "1,2",
        "--save-result",
        "--result-dir",
        str(tmp_path),
    ]
    rc, out, err = _bench(argv, capsys)
    assert rc == 0, err
    assert out.count("Serving Benchmark Result") == 2
    assert "Throughput vs interactivity frontier" in out
    assert "Throughput at interactivity targets" in out
    import torch

    per = "GPU" if torch.cuda.is_available() else "host"  # no GPU: the whole machine's tok/s
    for target in (30, 50, 75, 100, 150, 200):
        assert f"tok/s/{per} at {target} tok/s/user:" in out
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(names) == 3 and any("-sweep-" in n for n in names), names
    sweep = json.loads(next(tmp_path.glob("*-sweep-*.json")).read_text())
    assert [p["max_concurrency"] for p in sweep["points"]] == [1, 2]
    assert set(sweep["ladder"]) == {"30", "50", "75", "100", "150", "200"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-prompts", "0"], "--num-prompts"),
        (["--sweep-concurrency", "1,x"], "--sweep-concurrency"),
        (["--telemetry-interval", "0"], "--telemetry-interval"),
        (["--model", "/no/such/checkpoint"], "does not exist"),
        (["--tokenizer", "/no/such/dir"], "--tokenizer"),
        (["--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", "/no/such/dir"], "does not exist"),
        (["--base-url", "localhost:8000"], "--base-url"),
    ],
)
def test_bench_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    rc, out, err = _bench(argv, capsys)
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_engine_flags_before_the_subcommand_are_kept(capsys):
    rc = main(["--model", "/no/such/checkpoint", "bench", "--num-prompts", "1"])
    assert rc == 2 and "/no/such/checkpoint" in capsys.readouterr().err


def _pump_stderr(proc: subprocess.Popen) -> tuple["queue.Queue[str]", threading.Thread]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stderr:
            lines.put(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return lines, thread


def test_ctrl_c_cancels_cleanly_with_exit_130(demo_checkpoint, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "kimitui.cli",
        "bench",
        "--random-input-len",
        "32",
        "--random-output-len",
        "512",
        "--num-prompts",
        "64",
        "--max-concurrency",
        "2",
        "--save-result",
        "--result-dir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        lines, pump = _pump_stderr(proc)
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while not any("prompts against" in s for s in seen):
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        time.sleep(1.0)  # let some requests run so the abort path is exercised
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)  # the output is a few KiB: the stdout pipe cannot fill up
        out = proc.stdout.read()
        pump.join(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
    while not lines.empty():
        seen.append(lines.get_nowait())
    err = "".join(seen)
    assert proc.returncode == 130, err
    assert "cancelling" in err
    assert "Successful requests:" in out
    result = _saved(tmp_path)
    assert result["cancelled"] is True and result["completed"] < 64


def test_bench_over_http_matches_in_process_token_counts(demo_checkpoint, tmp_path, capsys):
    pytest.importorskip("kimitui.server.app")
    pytest.importorskip("uvicorn")
    from kimitui.engine import AsyncLLM, EngineArgs

    with serving(AsyncLLM(engine_args=EngineArgs(model=None)), "kimitui-demo") as port:
        http_dir, local_dir = tmp_path / "http", tmp_path / "local"
        # No --model: like vLLM, the first id of /v1/models is benchmarked.
        rc, out, err = _bench(
            [*WORKLOAD, "--base-url", f"http://127.0.0.1:{port}", "--save-result", "--result-dir", str(http_dir)],
            capsys,
        )
        assert rc == 0, err
        assert "Successful requests:                     8" in out and "HTTP client: kimitui" in err
        aio_dir = tmp_path / "aiohttp"
        rc, out, err = _bench(
            [*WORKLOAD, "--base-url", f"http://127.0.0.1:{port}", "--http-client", "aiohttp", "--save-result"]
            + ["--result-dir", str(aio_dir)],
            capsys,
        )
        assert rc == 0, err
        assert "HTTP client: aiohttp" in err
        rc, _, err = _bench([*WORKLOAD, "--save-result", "--result-dir", str(local_dir)], capsys)
        assert rc == 0, err
    http, aio, local = _saved(http_dir), _saved(aio_dir), _saved(local_dir)
    assert http["backend"] == "openai" and http["model_id"] == "kimitui-demo"
    assert (http["http_client"], aio["http_client"], local["http_client"]) == ("kimitui", "aiohttp", None)
    assert http["completed"] == aio["completed"] == local["completed"] == 8
    assert http["total_input_tokens"] == aio["total_input_tokens"] == local["total_input_tokens"]
    assert http["total_output_tokens"] == aio["total_output_tokens"] == local["total_output_tokens"] == 8 * 16
