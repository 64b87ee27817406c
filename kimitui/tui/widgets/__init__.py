"""kimitui's widgets, by feature (bench/, chat/, hardware/) beside the model, throughput and evaluation views."""
