"""The benchmark screen's widgets: form, progress, result tables, frontier, saved runs."""
