"""Result tables: one run's metrics (vLLM's, then ours), and saved runs side by side."""

from __future__ import annotations

from typing import Any

from textual.widgets import DataTable

from kimitui.tui.benchmark.format import column_title, comparison_rows, result_rows


class ResultTable(DataTable):
    """One column per run: a single result, or every point of a sweep."""

    DEFAULT_CSS = "ResultTable { height: 1fr; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(zebra_stripes=True, cursor_type="row", **kwargs)

    def show(self, results: list[dict[str, Any]]) -> None:
        self.clear(columns=True)
        if not results:
            return
        if len(results) == 1:
            self.add_columns("metric", column_title(results[0]))
            self.add_rows(result_rows(results[0]))
        else:
            self.add_columns("metric", *(column_title(r) for r in results))
            self.add_rows(comparison_rows(results))

    def cell_text(self) -> str:
        """Everything the table holds as plain text (tests and copy-paste read this)."""
        lines = ["  ".join(str(c.label) for c in self.columns.values())]
        lines += ["  ".join(str(v) for v in self.get_row_at(i)) for i in range(self.row_count)]
        return "\n".join(lines)


class ComparisonTable(ResultTable):
    """Saved runs chosen in the list, one column each."""

    def show(self, results: list[dict[str, Any]]) -> None:
        self.clear(columns=True)
        if len(results) < 2:
            return
        titles = [column_title(r) for r in results]
        # Two runs with the same label still get distinguishable headers.
        seen: dict[str, int] = {}
        for i, t in enumerate(titles):
            seen[t] = seen.get(t, 0) + 1
            if seen[t] > 1:
                titles[i] = f"{t} #{seen[t]}"
        self.add_columns("metric", *titles)
        self.add_rows(comparison_rows(results))
