"""A kimitui or vLLM/SGLang server as seen by a client, without Textual: URLs and headers
(``http.py``), the chat stream and its think-tag split, and the server's /metrics read into
throughput figures. The TUI's remote bridge and ``kimitui bench`` both use it."""
