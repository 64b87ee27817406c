"""kimitui's OpenAI-compatible server in a thread of the test process, for clients under test."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serving(llm, model_name: str) -> Iterator[int]:
    """Serve ``llm`` (an ``AsyncLLM``) as ``model_name`` on 127.0.0.1; yields the port. The socket is
    bound before the server starts (no free-port race); on exit the server stops and ``llm`` is shut
    down."""
    import uvicorn

    from kimitui.server.app import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # so asyncio sets TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(llm, model_name), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        llm.shutdown()
        sock.close()
