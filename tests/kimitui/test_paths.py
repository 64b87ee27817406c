"""kimitui/paths.py: every XDG directory of the app in one place, following the environment."""

from pathlib import Path

from kimitui import paths
from kimitui.bench import cost
from kimitui.themes import user_dir
from kimitui.tui import user_settings
from kimitui.tui.benchmark import store as bench_store
from kimitui.tui.evaluation import store as eval_store


def test_each_directory_follows_its_variable(tmp_path, monkeypatch):
    for var in ("CONFIG", "DATA", "STATE"):
        monkeypatch.setenv(f"XDG_{var}_HOME", str(tmp_path / var.lower()))
    assert paths.settings_file() == tmp_path / "config" / "kimitui" / "settings.toml"
    assert paths.user_themes_dir() == user_dir() == tmp_path / "config" / "kimitui" / "themes"
    assert paths.bench_runs_dir() == tmp_path / "data" / "kimitui" / "bench"
    assert paths.eval_results_dir() == tmp_path / "data" / "kimitui" / "eval"
    assert paths.tui_log_file() == tmp_path / "state" / "kimitui" / "tui.log"


def test_unset_empty_or_relative_values_fall_back_to_the_home_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", "")
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # the XDG spec: relative paths are invalid
    assert paths.config_dir() == tmp_path / ".config" / "kimitui"
    assert paths.data_dir() == tmp_path / ".local" / "share" / "kimitui"
    assert paths.state_dir() == tmp_path / ".local" / "state" / "kimitui"


def test_the_stores_and_settings_readers_use_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    settings = paths.settings_file()
    settings.parent.mkdir(parents=True)
    settings.write_text('[cost]\nusd_per_kwh = 0.25\n[ui]\ntheme = "x"\n')
    assert cost.load_cost_settings().usd_per_kwh == 0.25
    assert user_settings.read_settings()["ui"]["theme"] == "x"
    saved = eval_store.save_result({"kind": "recall", "date": "20260101-000000", "results": []})
    assert saved.parent == paths.eval_results_dir()
    run = {"date": "20260101-000000", "completed": 1, "duration": 1.0, "backend": "openai", "model_id": "m"}
    assert bench_store.save_run(dict(run)).parent == paths.bench_runs_dir()


def test_unique_path_numbers_a_taken_name(tmp_path: Path):
    assert paths.unique_path(tmp_path, "a.json") == tmp_path / "a.json"
    (tmp_path / "a.json").write_text("{}")
    assert paths.unique_path(tmp_path, "a.json") == tmp_path / "a-2.json"
    (tmp_path / "a-2.json").write_text("{}")
    assert paths.unique_path(tmp_path, "a.json") == tmp_path / "a-3.json"
