"""Saved runs: every finished run listed newest first; tick two or more to compare them side by side."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import SelectionList, Static

from kimitui.paths import bench_runs_dir
from kimitui.tui.benchmark.store import SavedRun, list_runs
from kimitui.tui.widgets.bench.tables import ComparisonTable


class SavedRuns(Vertical):
    DEFAULT_CSS = """
    SavedRuns { height: 1fr; }
    SavedRuns #bench-saved-list { height: auto; max-height: 12; }
    SavedRuns #bench-saved-hint { color: $text-muted; height: auto; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.runs: list[SavedRun] = []

    def compose(self) -> ComposeResult:
        yield Static("", id="bench-saved-hint", markup=False)
        yield SelectionList[str](id="bench-saved-list")
        yield ComparisonTable(id="bench-compare")

    def on_mount(self) -> None:
        self.reload()

    def reload(self) -> None:
        """Re-read the directory, keeping what was ticked."""
        lst = self.query_one(SelectionList)
        ticked = set(lst.selected)
        self.runs = list_runs()
        lst.clear_options()
        lst.add_options([(r.title, str(r.path), str(r.path) in ticked) for r in self.runs])
        where = bench_runs_dir()
        self.query_one("#bench-saved-hint", Static).update(
            f"{len(self.runs)} saved run(s) in {where}. Space ticks a run; tick two or more to compare."
            if self.runs
            else f"No saved runs yet in {where}: every finished run is saved there."
        )
        self._compare()

    def select(self, *paths: str) -> None:
        lst = self.query_one(SelectionList)
        for p in paths:
            lst.select(p)
        self._compare()

    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged) -> None:
        self._compare()

    def _compare(self) -> None:
        ticked = set(self.query_one(SelectionList).selected)
        # Oldest first, so columns read left to right in the order the runs happened.
        chosen = [r.result for r in reversed(self.runs) if str(r.path) in ticked]
        self.query_one(ComparisonTable).show(chosen)
