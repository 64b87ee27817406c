"""A scripted OpenAI-compatible server for the remote TUI tests: /v1/models and a streaming
/v1/chat/completions, no /metrics (the case the issue asks for); each reply streams
``<think>`` text then an answer, slowly enough that a test can kill the server mid-reply."""

from __future__ import annotations

import asyncio
import json
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kimitui.server.transport.background import BackgroundServer

PIECES = ["<thi", "nk>looking ", "at it</think>", "Hello", " from", " the", " fake", " server."]


def fake_openai_app(delay_s: float = 0.02, slow_after: int | None = None) -> FastAPI:
    """``slow_after``: after that many pieces the stream stalls (so a test can stop the server)."""
    app = FastAPI()
    app.state.requests = []
    app.state.streaming = threading.Event()

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": "fake-model", "object": "model", "owned_by": "fake", "max_model_len": 2048}],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.requests.append(body)
        if body.get("max_tokens", 0) > 4096:
            return JSONResponse(
                {
                    "error": {
                        "message": f"max_tokens {body['max_tokens']} > 4096",
                        "type": "BadRequestError",
                        "code": 400,
                    }
                },
                status_code=400,
            )

        async def events():
            for i, piece in enumerate(PIECES):
                if slow_after is not None and i >= slow_after:
                    app.state.streaming.set()
                    await asyncio.sleep(3600)
                delta = {"content": piece}
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n"
                await asyncio.sleep(delay_s)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
            usage = {"prompt_tokens": 5, "completion_tokens": len(PIECES), "total_tokens": 5 + len(PIECES)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def serve(app: FastAPI, port: int = 0) -> BackgroundServer:
    return BackgroundServer("127.0.0.1", port).start(app)


def kill(server: BackgroundServer) -> None:
    """Stop at once, dropping open streams (a server that goes away mid-reply)."""
    server.server.should_exit = True
    server.server.force_exit = True
    server.stop(timeout=5)
