"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info.

Shapes as vLLM serves them (vllm/entrypoints/serve/tokenize/protocol.py and serving.py), so
clients written for vLLM work unchanged; lm-evaluation-harness's ``tokenizer_backend=remote`` takes
its tokenizer from these. As in vLLM they sit beside /v1, not under it; unlike vLLM they need the
API key when the server has one (a /tokenize call can be 16 MB of text: work, like generation).

- /tokenize: ``{"prompt": str}`` or ``{"messages": [...]}`` (rendered in the checkpoint's chat
  format) -> ``{"count", "max_model_len", "tokens", "token_strs"}``. Special-token text in a prompt
  is read as the special token, as a Hugging Face tokenizer reads it (lm-eval finds the EOS id by
  tokenizing the EOS text). Kimi tokenizers add no BOS, so ``add_special_tokens`` adds nothing.
- /detokenize: ``{"tokens": [...]}`` -> ``{"prompt": str}``.
- /tokenizer_info: the checkpoint's tokenizer_config.json (file paths left out), its
  ``tokenizer_class`` and ``chat_template``, and the special tokens by name.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from kimitui.server.body import read_body
from kimitui.server.errors import bad_request
from kimitui.server.limits import check_prompt_chars_of
from kimitui.server.protocol import _Body
from kimitui.server.state import server_state
from kimitui.server.tools import check_tools

router = APIRouter()


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(...)


async def _open(request: Request, body: type[_Body], path: str):
    """(server state, the parsed body, the tokenizer) for a tokenizer endpoint; 4xx on a bad body,
    another model's name, or no tokenizer."""
    state = server_state(request)
    req = await read_body(request, body, state.max_body_bytes)
    state.check_model(req.model)
    return state, req, state.require_tokenizer(path)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    state, req, tok = await _open(request, TokenizeRequest, "/tokenize")
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt (text) or messages (a chat)", param="prompt")
    if req.prompt is not None:
        ids = await state.encode(req.prompt, allow_special=True)
    else:
        ids = await _chat_ids(state, req)
    out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


async def _chat_ids(state, req: TokenizeRequest) -> list[int]:
    from kimitui.engine.text.chat_format import chat_format_for
    from kimitui.server.chat import _template_options

    if req.continue_final_message:
        raise bad_request("continue_final_message is not supported", param="continue_final_message")
    if not req.add_generation_prompt:
        raise bad_request(
            "add_generation_prompt false is not supported: the chat formats end with the assistant's turn opened",
            param="add_generation_prompt",
        )
    check_tools(req.tools)
    fmt = chat_format_for(state.tokenizer)
    options = _template_options(req.chat_template_kwargs)
    size = sum(len(str(m.get("content", ""))) for m in req.messages)
    check_prompt_chars_of(state, size, "messages")
    try:
        prompt = await state.run_blocking(
            size, partial(fmt.encode, req.messages, tools=req.tools, **options), param="messages"
        )
    except Exception as e:  # noqa: BLE001 - the messages are at fault
        raise bad_request(f"cannot render the messages in the chat format: {e}", param="messages") from None
    return list(prompt.ids)


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    _, req, tok = await _open(request, DetokenizeRequest, "/detokenize")
    bad = next((t for t in req.tokens if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (size {tok.vocab_size})", param="tokens")
    return {"prompt": tok.decode(req.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    state = server_state(request)
    tok = state.require_tokenizer("/tokenizer_info")
    path = state.llm.engine.model_dir / "tokenizer_config.json"
    info: dict[str, Any] = {}
    if path.is_file():
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            info = {}
    for key in ("vocab_file", "merges_file", "auto_map"):  # file paths and remote code: not for clients
        info.pop(key, None)
    info = {k: _plain(v) for k, v in info.items()}
    names = {i: t for t, i in tok.special_tokens.items()}
    for key, tid in (
        ("bos_token", tok.bos_token_id),
        ("eos_token", tok.eos_token_ids[0] if tok.eos_token_ids else None),
        ("pad_token", tok.pad_token_id),
        ("unk_token", tok.unk_token_id),
    ):
        if info.get(key) is None:
            info[key] = names.get(tid) if tid is not None else None
    info["tokenizer_class"] = info.get("tokenizer_class") or type(tok).__name__
    if tok.chat_template:
        info["chat_template"] = tok.chat_template
    info.setdefault("model_max_length", state.max_model_len)
    return info


def _plain(value):
    """tokenizer_config values as JSON: an AddedToken-style dict becomes its content (as vLLM sends it)."""
    if isinstance(value, dict) and "content" in value and "__type" in value:
        return value["content"]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
