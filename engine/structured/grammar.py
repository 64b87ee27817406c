"""Compiling constraints into grammars, with llguidance.

Why llguidance (1.9) rather than xgrammar (0.2); both are maintained and used by vLLM and SGLang:
- CPU: llguidance computes each mask on the CPU in Rust with no ahead-of-time work per grammar
  (its lexer is built lazily, so a new JSON schema costs about a millisecond), while xgrammar
  compiles a per-grammar token-mask cache first (hundreds of milliseconds to seconds for a 160k
  vocabulary and a large schema). Requests here bring a new schema or tool list each time.
- Speed per step: both compute a mask in well under a millisecond for JSON; llguidance also
  fills a whole batch in parallel (``LLExecutor``) and handles speculative drafts (rollback).
- Dependencies and licence: llguidance is one MIT-licensed abi3 wheel (manylinux x86_64 and
  aarch64) with no Python dependencies; xgrammar (Apache-2.0) pulls in apache-tvm-ffi and
  transformers. Both licences suit this Apache-2.0 project.
- Special tokens: llguidance's Lark dialect names tokens by id (``<[163588]>``), which the Kimi
  tool-call and XTML grammars need (a marker must be its token, not the same text spelled out).

The package is optional (the ``structured`` extra); without it a constrained request gets a
one-line error saying what to install. Compiled grammars are cached per tokenizer, keyed by the
constraint; each request gets a copy of the cached matcher (cheap: the lexer is shared).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict

from kimitui.engine.structured.params import StructuredOutputs

try:
    import llguidance
except ImportError:  # the `structured` extra is not installed
    llguidance = None

_CACHE_SIZE = 256  # compiled grammars kept per tokenizer


class GrammarError(ValueError):
    """A constraint that cannot be compiled (bad schema or grammar), or no grammar library."""


def require_llguidance():
    if llguidance is None:
        raise GrammarError(
            "structured outputs (response_format, tool_choice 'required') need the llguidance "
            "package: pip install 'kimitui[structured]'"
        )
    return llguidance


def token_bytes_of(tokenizer):
    """``id -> bytes`` for the tokenizer's ids (special tokens as their text)."""
    table = getattr(tokenizer, "_token_bytes", None)
    if table is not None:
        n = len(table)
        return lambda t: table[t] if 0 <= t < n else b""
    return lambda t: tokenizer.decode([t]).encode("utf-8")


class _Wrapper:
    """What ``llguidance.TokenizerWrapper`` reads: every token's bytes, the special ids, an encoder."""

    def __init__(self, tokenizer, n_vocab: int, eos_id: int):
        to_bytes = token_bytes_of(tokenizer)
        self.tokens = [to_bytes(i) for i in range(n_vocab)]
        self.eos_token_id = eos_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(t for t in getattr(tokenizer, "special_ids", ()) if t < n_vocab)
        self._tokenizer = tokenizer

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


class GrammarCompiler:
    """The llguidance tokenizer of one tokenizer and vocabulary width, and its compiled grammars.

    ``eos_id``: the end token the grammars know (llguidance allows it once a grammar is complete);
    each request maps it onto its own stop ids (engine.structured.matcher). Thread-safe: the
    server validates constraints while the engine thread compiles them.
    """

    def __init__(self, tokenizer, vocab_size: int):
        llg = require_llguidance()
        self.vocab_size = max(vocab_size, len(tokenizer))
        eos = list(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.eos_id = eos[0] if eos else self.vocab_size - 1
        self.lltokenizer = llg.LLTokenizer(
            llg.TokenizerWrapper(_Wrapper(tokenizer, self.vocab_size, self.eos_id)),
            n_vocab=self.vocab_size,
            eos_token=self.eos_id,
        )
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def grammar_text(self, spec: StructuredOutputs) -> str:
        """llguidance's serialized grammar for ``spec``."""
        llg = require_llguidance()
        options = {"whitespace_flexible": spec.any_whitespace}
        try:
            if spec.grammar is not None:
                return llg.LLMatcher.grammar_from_lark(spec.grammar)
            schema = '{"type": "object"}' if spec.json_object else closed_schema_text(spec.json)
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {_one_line(e)}") from None

    def compile(self, spec: StructuredOutputs):
        """The cached pristine matcher of ``spec`` (compiled on first use); raises GrammarError."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        llg = require_llguidance()
        text = self.grammar_text(spec)
        err = llg.LLMatcher.validate_grammar(text, self.lltokenizer)
        if err:
            raise GrammarError(f"invalid {_kind(spec)}: {_one_line(err)}")
        matcher = llg.LLMatcher(self.lltokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {_kind(spec)}: {_one_line(matcher.get_error())}")
        with self._lock:
            self._cache[spec.key] = matcher
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, spec: StructuredOutputs):
        """A fresh matcher for one request (a copy of the cached one)."""
        return self.compile(spec).deep_copy()

    def __len__(self) -> int:
        return len(self._cache)


_compilers: "weakref.WeakKeyDictionary[object, dict[int, GrammarCompiler]]" = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int) -> GrammarCompiler:
    """The shared compiler of ``tokenizer`` (building the llguidance tokenizer takes about a second
    for a 160k vocabulary, so it is made once per tokenizer and vocabulary width)."""
    with _compilers_lock:
        per = _compilers.setdefault(tokenizer, {})
        comp = per.get(vocab_size)
        if comp is None:
            comp = per[vocab_size] = GrammarCompiler(tokenizer, vocab_size)
        return comp


def check(spec: StructuredOutputs, tokenizer, vocab_size: int) -> None:
    """Compile ``spec`` (cached) or raise GrammarError with a one-line message."""
    if tokenizer is None:
        raise GrammarError("structured outputs need the checkpoint's tokenizer files")
    compiler_for(tokenizer, vocab_size).compile(spec)


def _kind(spec: StructuredOutputs) -> str:
    return "grammar" if spec.grammar is not None else "JSON schema"


def _one_line(e) -> str:
    text = str(e).strip()
    return " ".join(text.split("\n")[0].split()) if text else type(e).__name__


def json_schema_text(schema: dict, any_whitespace: bool = False) -> str:
    """A JSON schema to embed in a Lark grammar (``%json ...``), with the whitespace option set."""
    schema = close_objects(schema)
    guidance = dict(schema.get("x-guidance") or {})
    guidance.setdefault("whitespace_flexible", any_whitespace)
    return json.dumps({**schema, "x-guidance": guidance}, ensure_ascii=False)


def close_objects(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and says nothing about extra ones, as vLLM's default (xgrammar's ``strict_mode``)
    and OpenAI's strict structured outputs treat them. JSON Schema's own default allows any extra
    key, and a model that wanders off then writes keys of unbounded length until max_tokens. A
    schema that asks for extra keys (``additionalProperties: true`` or a schema) keeps them."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else close_objects(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def closed_schema_text(text: str) -> str:
    """``close_objects`` of a schema given as JSON text (returned as is when it does not parse: the
    compiler then names the problem)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(close_objects(schema), ensure_ascii=False)
