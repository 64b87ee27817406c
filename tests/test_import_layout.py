"""The layout stays navigable: no import cycle between modules, no import hidden in a function body
of the engine or the kernels (except optional dependencies, named in a comment), and no folder so
full that a concept cannot be found by its folder (docs/architecture.md has the map)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.import_graph import ROOT, cycles, graph

SOURCE = (".py", ".cpp", ".h")


def test_no_import_cycle_between_modules():
    edges, _ = graph()
    assert cycles(edges) == []


def test_the_checker_sees_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


def test_engine_and_kernels_import_at_module_level():
    _, local = graph()
    hidden = [
        f"{i.module}:{i.line}: {i.text}"
        for i in local
        if i.module.startswith(("kimitui.engine", "kimitui.kernels")) and "optional" not in i.text
    ]
    assert hidden == [], (
        "imports inside functions (only optional dependencies, with a comment saying so):\n" + "\n".join(hidden)
    )


def _source_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.is_file() and p.suffix in SOURCE]


def test_engine_and_kernels_tops_hold_at_most_15_files():
    for top in ("engine", "kernels"):
        files = [p for p in (ROOT / top).iterdir() if p.is_file()]
        assert len(files) <= 15, (top, sorted(p.name for p in files))


def test_no_folder_holds_more_than_20_source_files():
    crowded = {}
    for top in ("engine", "kernels", "kimitui", "themes", "tests", "benchmarks"):
        for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
            if "__pycache__" in folder.parts:
                continue
            n = len(_source_files(folder))
            if n > 20:
                crowded[str(folder.relative_to(ROOT))] = n
    assert crowded == {}
