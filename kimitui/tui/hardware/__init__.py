"""The hardware panel's data: history rings of telemetry samples for the graphs."""
