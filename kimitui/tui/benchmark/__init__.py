"""The benchmark feature without Textual widgets: the form's presets and checks (setup), the job on
its worker thread (job), saved runs (store), table text (format)."""
