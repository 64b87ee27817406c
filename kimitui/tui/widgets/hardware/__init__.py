"""The hardware panel: compact rows and history graphs."""
