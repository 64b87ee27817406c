"""`kimitui plan`: output rows, JSON, exit codes; run in-process through argparse."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kimitui.commands import plan as plan_cmd

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
K26 = str(CONFIGS / "kimi_k26.json")


def run_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kimitui")
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_k26_on_six_gpus_fits(capsys):
    assert run_plan(["--config", K26, "--gpus", "6"]) == 0
    out = capsys.readouterr().out
    assert "6 GPU x 288.00 GiB; max_model_len 262,144 x 1 seq" in out
    table = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert [row[:3] for row in table] == [
        ["0", "11", "27307"],
        ["1", "11", "27307"],
        ["2", "11", "27307"],
        ["3", "11", "27307"],
        ["4", "10", "27306"],
        ["5", "10", "27306"],
    ]
    assert all(row[4] == "3840" for row in table)  # 384 x 60 experts / 6 GPUs
    assert "layers 1-60: 384 on GPU, 0 on CPU" in out
    assert "fits: yes" in out
    assert "largest context that fits: 262,144 tokens (model limit" in out


def test_k26_on_four_140gb_gpus(capsys, tmp_path):
    assert run_plan(["--model", str(_model_dir(tmp_path)), "--gpus", "4", "--gpu-memory-gb", "140"]) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and " on CPU" in out and "host RAM: 0 experts" not in out

    assert run_plan(["--config", K26, "--gpus", "4", "--gpu-memory-gb", "140", "--cpu-offload", "none"]) == 1
    cap = capsys.readouterr()
    assert "fits: NO" in cap.out
    assert "short by" in cap.err and "GiB" in cap.err and len(cap.err.strip().splitlines()) == 1

    assert run_plan(["--config", K26, "--gpus", "4", "--gpu-memory-gb", "140", "--cpu-offload", "200"]) == 0
    assert "layers 1-60: 184 on GPU, 200 on CPU" in capsys.readouterr().out


def test_json_output(capsys):
    assert (
        run_plan(
            [
                "--config",
                K26,
                "--gpus",
                "4",
                "--gpu-memory-gb",
                "140",
                "--max-model-len",
                "32768",
                "--max-num-seqs",
                "8",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["num_devices"] == 4 and data["max_num_seqs"] == 8
    assert len(data["devices"]) == 4 and data["host"]["num_experts"] > 0
    assert data["devices"][0]["kv_bytes"] == 8 * 32768 * 576 * 61 * 2
    assert len(data["expert_device"]) == 61 and len(data["expert_device"][1]) == 384
    assert data["max_model_len_that_fits"] > 32768


def test_routing_stats_flag(capsys, tmp_path):
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({str(layer): [layer + e for e in range(384)] for layer in range(1, 61)}))
    assert (
        run_plan(["--config", K26, "--gpus", "4", "--gpu-memory-gb", "140", "--routing-stats", str(stats), "--json"])
        == 0
    )
    row = json.loads(capsys.readouterr().out)["expert_device"][7]
    assert row[383] >= 0 and row[0] == -1  # counts grow with the id: the highest ids are hottest


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--config", "/nonexistent/config.json", "--gpus", "4"], "/nonexistent/config.json"),
        (["--config", "UNKNOWN", "--gpus", "4"], "model_type 'llama'"),
        (["--config", K26, "--gpus", "0"], "--gpus"),
        (["--config", K26, "--gpus", "4", "--routing-stats", "/nonexistent/stats.json"], "stats.json"),
        (["--config", K26, "--gpus", "4", "--cpu-offload", "999"], "cpu_offload"),
        (["--config", K26, "--gpus", "4", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["--config", K26, "--gpus", "4", "--reserve-gb", "-1"], "--reserve-gb"),
    ],
)
def test_bad_input_exits_2(capsys, tmp_path, argv, needle):
    if "UNKNOWN" in argv:
        bad = tmp_path / "config.json"
        bad.write_text(json.dumps({"model_type": "llama"}))
        argv = [str(bad) if a == "UNKNOWN" else a for a in argv]
    assert run_plan(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_reserve_follows_the_step_flags_and_reserve_gb_overrides(capsys):
    def reserve(*flags: str) -> tuple[int, str]:
        assert run_plan(["--config", K26, "--gpus", "6", "--max-model-len", "32768", *flags]) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("reserve per GPU"))
        table = [row.split() for row in out.splitlines() if row[:4].strip().isdigit()]
        assert {row[8] for row in table} == {line.split()[3]}  # the table's reserve column is the line's
        return float(line.split()[3]), line

    default, line = reserve()
    assert "2,048-token" in line and "max_num_batched_tokens 2,048, max_num_seqs 1" in line
    big, line = reserve("--max-num-batched-tokens", "16384", "--max-num-seqs", "64")
    assert big > default and "16,384" in line and "max_num_seqs 64" in line
    given, line = reserve("--max-num-batched-tokens", "16384", "--reserve-gb", "2.5")
    assert given == 2.5 and line == "reserve per GPU 2.50 GiB (given)"
    assert run_plan(["--config", K26, "--gpus", "6", "--max-num-batched-tokens", "8192", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["reserve"]
    assert data["max_num_batched_tokens"] == 8192 and data["given"] is False and data["bytes"] > 0


def test_argparse_rejects_bad_flags():
    with pytest.raises(SystemExit) as e:
        run_plan(["--config", K26, "--gpus", "4", "--cpu-offload", "sometimes"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        run_plan(["--config", K26])  # --gpus is required


def test_module_runs_without_textual():
    code = (
        "import sys; from kimitui.commands import plan; "
        f"rc = plan.main(['--config', {K26!r}, '--gpus', '6']); "
        "assert 'textual' not in sys.modules; sys.exit(rc)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "fits: yes" in res.stdout


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "Kimi-K2.6"
    d.mkdir()
    (d / "config.json").write_text((CONFIGS / "kimi_k26.json").read_text())
    return d


def test_k3_tells_the_four_and_six_gpu_stories(capsys):
    k3 = str(Path(K26).with_name("kimi_k3.json"))
    assert run_plan(["--config", k3, "--gpus", "6"]) == 0
    six = capsys.readouterr().out.splitlines()
    assert six[0].startswith("fits on 6 x 288.00 GiB GPUs: all 896 routed experts of every MoE layer on GPU; room for")
    assert any(line.startswith("kimi_k3: 2.779T params") for line in six)  # named by its file
    assert run_plan(["--config", k3, "--gpus", "4"]) == 0  # fits, with CPU experts
    four = capsys.readouterr().out.splitlines()
    assert four[0].startswith("weights do not fit on 4 x 288.00 GiB GPUs")
    assert four[1].startswith("294-295 of 896 routed experts per MoE layer live in host RAM")
    assert "the CPUs compute them" in four[1]
    assert any(line.startswith("fits: yes, with 27") and "experts computed by the CPUs" in line for line in four)
