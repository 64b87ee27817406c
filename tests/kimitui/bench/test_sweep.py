import asyncio
import json

import pytest

from kimitui.bench.sweep import SweepPoint, format_ladder, frontier, ladder, parse_concurrency_list, point_from_result

POINTS = [
    SweepPoint(1, 120.0, 100.0),
    SweepPoint(2, 90.0, 180.0),
    SweepPoint(3, 50.0, 200.0),  # dominated by c=4 (60, 300)
    SweepPoint(4, 60.0, 300.0),
    SweepPoint(8, 40.0, 400.0),
    SweepPoint(16, 20.0, 450.0),
]


def test_frontier_drops_dominated_points():
    front = frontier(POINTS)
    assert [p.concurrency for p in front] == [16, 8, 4, 2, 1]


def test_ladder_interpolates_and_marks_unreached():
    values = ladder(frontier(POINTS))
    assert values[30] == pytest.approx(425.0)
    assert values[50] == pytest.approx(350.0)
    assert values[75] == pytest.approx(240.0)
    assert values[100] == pytest.approx(180 - 80 / 3)
    assert values[150] is None and values[200] is None
    table = format_ladder(values)
    assert "tok/s/GPU at 150 tok/s/user:" in table
    assert "{:<40} {:<10}".format("tok/s/GPU at 200 tok/s/user:", "-") in table.split("\n")


def test_ladder_below_frontier_and_single_point():
    assert ladder([SweepPoint(1, 60.0, 10.0)], (30, 60)) == {30: None, 60: 10.0}
    assert ladder([], (30,)) == {30: None}


def test_point_from_result_and_parsing():
    p = point_from_result({"median_tpot_ms": 20.0, "tput_per_gpu": 500.0, "max_concurrency": 8, "completed": 5})
    assert p == SweepPoint(8, 50.0, 500.0)
    assert point_from_result({"median_tpot_ms": 0.0, "tput_per_gpu": 1.0, "completed": 1}) is None
    # a run without GPUs has no per-GPU throughput: the frontier is the host's total tok/s
    cpu = point_from_result(
        {
            "median_tpot_ms": 20.0,
            "tput_per_gpu": None,
            "num_gpus": 0,
            "total_token_throughput": 120.0,
            "max_concurrency": 2,
            "completed": 5,
        }
    )
    assert cpu == SweepPoint(2, 50.0, 120.0)
    assert "tok/s/host at 30 tok/s/user:" in format_ladder(ladder([cpu]), per="host")
    assert parse_concurrency_list("1,2, 4,8") == (1, 2, 4, 8)
    with pytest.raises(ValueError):
        parse_concurrency_list("1,x")


def test_sweep_result_filename_is_the_file_asked_for(tmp_path, capsys):
    # `--sweep-concurrency 1,2 --result-filename runs/sweep.json` used to write the summary to
    # runs/sweep-sweep.json and the points to sweep-concurrency{N}.json outside runs/ (or
    # failed: runs/ did not exist).
    from kimitui.bench.clients import InProcessClient
    from kimitui.bench.runner import run_sweep
    from kimitui.commands.bench import _print_sweep
    from tests.kimitui.bench.test_runner import FakeEngine, Params, _config
    from tests.kimitui.bench_fakes import WordTokenizer

    client = InProcessClient(FakeEngine(), model="demo", sampling_params_cls=Params)
    cfg = _config(
        sweep_concurrency=(1, 2),
        num_warmups=0,
        num_prompts=4,
        save_result=True,
        result_dir=str(tmp_path),
        result_filename="runs/sweep.json",
    )
    sweep = asyncio.run(run_sweep(cfg, client, WordTokenizer()))
    _print_sweep(sweep, cfg)
    names = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.json"))
    assert names == ["runs/sweep-concurrency1.json", "runs/sweep-concurrency2.json", "runs/sweep.json"]
    saved = json.loads((tmp_path / "runs" / "sweep.json").read_text())
    assert [p["max_concurrency"] for p in saved["points"]] == [1, 2] and "frontier" in saved
    assert "saved " + str(tmp_path / "runs" / "sweep.json") in capsys.readouterr().err


def test_sweep_default_filename_names_the_sweep():
    from kimitui.bench.runner import sweep_result_filename

    sweep = {
        "points": [{"backend": "kimitui", "label": None, "model_id": "moonshotai/Kimi-K2.6", "date": "20260101-120000"}]
    }
    assert sweep_result_filename(sweep) == "kimitui-sweep-Kimi-K2.6-20260101-120000.json"
    assert sweep_result_filename(sweep, "mine.json") == "mine.json"
