"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

from kimitui.server import create_app, BackgroundServer
server = BackgroundServer(port=0).start(create_app(llm))   # server.url
"""

from kimitui.server.app import create_app
from kimitui.server.transport.background import BackgroundServer

__all__ = ["create_app", "BackgroundServer"]
