"""Benchmarks of the HTTP server: reused connections, TTFT over HTTP against in process."""
