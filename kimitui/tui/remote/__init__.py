"""The TUI attached to an OpenAI-compatible server (``kimitui --base-url URL``): its bridge, the
chat stream client, and the server's Prometheus metrics read into the throughput panel."""
