"""The FastAPI application: wiring, plus the routes too small for a file of their own."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route

from kimitui.engine import AsyncLLM
from kimitui.server import chat, completions, tokenization
from kimitui.server.auth import check_api_key
from kimitui.server.errors import exception_response, install_error_handlers
from kimitui.server.metrics import CONTENT_TYPE
from kimitui.server.state import DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_READ_TIMEOUT_S, ServerState, server_state
from kimitui.server.transport.guard import RequestGuard


def create_app(
    llm: AsyncLLM,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    request_read_timeout: float | None = DEFAULT_REQUEST_READ_TIMEOUT_S,
    allowed_hosts: frozenset[str] | None = None,
) -> FastAPI:
    """An OpenAI-compatible app over ``llm`` (which the caller owns and shuts down).

    ``api_key`` set: every route that does work (/v1, and the tokenizer routes, which can be
    made to tokenize 16 MB at a time) needs ``Authorization: Bearer <api_key>``; /health and
    /metrics stay open, as in vLLM. ``request_read_timeout``: seconds a client has to send a
    request's head and its body (None: no limit). ``allowed_hosts``: Host header values served
    (None: any).
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if request_read_timeout is not None and request_read_timeout <= 0:
        raise ValueError(f"request_read_timeout must be > 0 seconds, got {request_read_timeout}")
    app = FastAPI(title="kimitui", docs_url=None, redoc_url=None, openapi_url=None)
    state = ServerState(
        llm, served_model_name or llm.config.name, api_key or None, max_body_bytes, request_read_timeout, allowed_hosts
    )
    app.state.server = state
    install_error_handlers(app)
    generation = {
        "/v1/completions": _with_api_key(completions.create_completion),
        "/v1/chat/completions": _with_api_key(chat.create_chat_completion),
    }
    app.add_middleware(GenerationRoutes, routes=generation)  # the innermost: inside every other middleware
    app.add_middleware(RequestGuard, state=state)
    # Also routes, for what reads the routing table (and other methods on these paths get a 405).
    app.router.routes[:0] = [Route(path, endpoint, methods=["POST"]) for path, endpoint in generation.items()]
    authed = APIRouter(dependencies=[Depends(check_api_key)])
    authed.add_api_route("/v1/models", list_models, methods=["GET"])
    authed.include_router(tokenization.router)  # vLLM's /tokenize, /detokenize, /tokenizer_info
    app.include_router(authed)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app


class GenerationRoutes:
    """Pure ASGI middleware serving POST on the generation routes itself, with the app's JSON errors
    (errors.exception_response), and everything else through the app. Starlette's exception layer,
    FastAPI's exit stack, the router and the route's request wrapper cost a streamed request about
    0.1 ms of its TTFT here, and these handlers take nothing but the request (body.py reads and
    checks their bodies)."""

    def __init__(self, app, routes: dict):
        self.app, self.routes = app, routes

    async def __call__(self, scope, receive, send) -> None:
        endpoint = self.routes.get(scope.get("path")) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as e:  # noqa: BLE001 - answered as the app's exception handlers answer
            response = exception_response(request, e)
        await response(scope, receive, send)


def _with_api_key(endpoint):
    """``endpoint`` behind ``check_api_key``, for a route outside the authed router."""

    async def checked(request: Request) -> Response:
        await check_api_key(request)
        return await endpoint(request)

    return functools.wraps(endpoint)(checked)


async def list_models(request: Request) -> dict:
    s = server_state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": s.served_model_name,
                "object": "model",
                "created": s.created,
                "owned_by": "kimitui",
                "root": str(s.llm.engine.model_dir),
                "parent": None,
                "max_model_len": s.max_model_len,
            }
        ],
    }


async def health(request: Request) -> Response:
    # A dead engine loop means no request can ever finish.
    if not getattr(server_state(request).llm, "is_alive", True):
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    s = server_state(request)
    return Response(s.metrics.render(s.llm.stats()), media_type=CONTENT_TYPE)
