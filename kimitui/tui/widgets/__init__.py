"""kimitui's widgets: chat pane and the three live panels (throughput, hardware, model)."""
