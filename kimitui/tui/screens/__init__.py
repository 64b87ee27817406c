"""kimitui's screens: load, main, settings, help, chat history, and the benchmark and evaluation
screens on one JobScreen base (job.py)."""
