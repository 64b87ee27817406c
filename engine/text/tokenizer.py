"""Tokenizer: Hugging Face ``tokenizer.json`` or Kimi's ``tiktoken.model``; incremental detokenizer.

Kimi ships tiktoken BPE ranks plus remote code. We convert the ranks once into a byte-level BPE
for the Rust ``tokenizers`` library (same conversion as transformers' ``TikTokenConverter``) and
cache the result in the user's cache dir, so no remote code runs and encoding stays in Rust.
"""

from __future__ import annotations

import base64
import codecs
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from kimitui.engine.paths import cache_root

# Kimi's split pattern exactly as in Moonshot's tokenization_kimi.py (same in K2, K2.5, K2.6, K3
# on huggingface.co/moonshotai). It relies on
# character-class intersection (`&&`), which fancy-regex (tiktoken) and Python's `regex` (V1)
# understand but many other engines do not.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# The same language without `&&`: "a letter of these classes that is not Han" becomes a negative
# lookahead on a single character. Works in Oniguruma (HF tokenizers), fancy-regex, `regex`, JS.
# Equivalence with KIMI_PAT_STR is proven by tests/engine/text/test_tokenizer.py against tiktoken.
_UPPERISH = r"(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])"
_LOWERISH = r"(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])"
KIMI_PAT_STR_ONIG = KIMI_PAT_STR.replace(r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", _UPPERISH).replace(
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", _LOWERISH
)

NUM_RESERVED_SPECIAL_TOKENS = 256
# Bump when the conversion below changes so stale cache files are not reused.
_CONVERTER_VERSION = "kimitui-tiktoken-bpe-1"


class TokenizerError(RuntimeError):
    """Tokenizer files missing or unusable; the message is one line naming the directory."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def token_bytes_to_string(b: bytes) -> str:
    """A token's bytes as the printable string HF byte-level vocabularies use."""
    enc = bytes_to_unicode()
    return "".join(enc[x] for x in b)


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken ranks file: one ``base64(token_bytes) rank`` per line."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError as e:
            raise TokenizerError(f"{path}:{line_no}: expected 'base64 rank', got {line[:40]!r}") from e
    return ranks


def kimi_special_tokens(tokenizer_config: dict, num_base_tokens: int) -> dict[int, str]:
    """Special-token id -> content, as Moonshot's tokenization_kimi.py builds it."""
    named = {
        int(i): (v["content"] if isinstance(v, dict) else str(v))
        for i, v in tokenizer_config.get("added_tokens_decoder", {}).items()
    }
    ids = range(num_base_tokens, num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS)
    out = {i: named.get(i, f"<|reserved_token_{i}|>") for i in ids}
    out.update({i: c for i, c in named.items() if i not in out})  # ids outside the usual block
    return dict(sorted(out.items()))


def tiktoken_to_hf_json(ranks: dict[bytes, int], pattern: str, specials: dict[int, str]) -> str:
    """Serialized HF tokenizer.json equivalent to ``tiktoken.Encoding(pattern, ranks, specials)``.

    ``pattern`` must be Oniguruma-compatible (use KIMI_PAT_STR_ONIG for Kimi).
    """

    vocab = {token_bytes_to_string(b): r for b, r in ranks.items()}
    # Merges as in transformers' TikTokenConverter: every split (l, r) of a token whose parts are
    # tokens, ordered by the token's rank, then by (rank[l], rank[r]). HF BPE then always applies
    # the merge that yields the lowest-ranked token, exactly like tiktoken's byte_pair_merge.
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            rl, rr = ranks.get(left), ranks.get(right)
            if rl is not None and rr is not None:
                merges.append((rank, rl, rr, left, right))
    merges.sort(key=lambda m: m[:3])
    bpe = BPE(
        vocab=vocab,
        merges=[(token_bytes_to_string(m[3]), token_bytes_to_string(m[4])) for m in merges],
        fuse_unk=False,
        ignore_merges=True,  # tiktoken returns a whole piece that is itself a token unchanged
    )
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    data = json.loads(tok.to_str())
    # Written directly (not via add_special_tokens) so every special keeps its exact id even when
    # its text happens to equal a byte-level vocab entry.
    data["added_tokens"] = [
        {
            "id": i,
            "content": c,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, c in sorted(specials.items())
    ]
    return json.dumps(data, ensure_ascii=False)


def tokenizer_cache_dir() -> Path:
    return cache_root() / "tokenizers"


def _cache_path(model_path: Path, specials: dict[int, str]) -> Path:
    # Keyed by everything the conversion depends on, so an edited file never hits a stale entry.
    h = hashlib.sha256(model_path.read_bytes())
    h.update(KIMI_PAT_STR_ONIG.encode())
    h.update(json.dumps(specials, sort_keys=True).encode())
    h.update(_CONVERTER_VERSION.encode())
    return tokenizer_cache_dir() / f"{h.hexdigest()}.json"


def _converted_tiktoken(model_path: Path, specials: dict[int, str], use_cache: bool = True) -> str:
    cached = _cache_path(model_path, specials)
    if use_cache and cached.is_file():
        try:
            return cached.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            pass
    text = tiktoken_to_hf_json(load_tiktoken_ranks(model_path), KIMI_PAT_STR_ONIG, specials)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, cached)  # atomic: concurrent processes never read half a file
    except OSError:
        pass  # read-only cache: still usable, just converted again next time
    return text


def _token_content(v) -> str | None:
    if v is None:
        return None
    return v.get("content") if isinstance(v, dict) else str(v)


class Tokenizer:
    """Encode/decode text for a checkpoint; wraps a Rust ``tokenizers.Tokenizer``."""

    def __init__(
        self,
        tokenizer_json: str,
        tokenizer_config: dict | None = None,
        chat_template: str | None = None,
        name_or_path: str = "",
    ):
        """Build from the text of a tokenizer.json; use ``from_pretrained`` for a checkpoint."""
        self.name_or_path = name_or_path
        self._hf = hf = HFTokenizer.from_str(tokenizer_json)
        # A second instance that treats special-token text as ordinary text, so encode() of user
        # text can never produce control tokens (flipping a flag per call would not be thread-safe).
        self._hf_plain = HFTokenizer.from_str(tokenizer_json)
        self._hf_plain.encode_special_tokens = True
        cfg = tokenizer_config or {}
        self.chat_template = chat_template
        added = hf.get_added_tokens_decoder()
        # Every added token of a converted tiktoken model is special to the Rust tokenizer, so plain
        # text never matches one. Those the checkpoint marks `"special": false` (K3's <|open|>,
        # <|close|>, <|sep|>) still decode as text when special tokens are skipped, as in HF.
        text_ids = {
            int(i)
            for i, v in cfg.get("added_tokens_decoder", {}).items()
            if isinstance(v, dict) and v.get("special") is False
        }
        self.special_tokens: dict[str, int] = {t.content: i for i, t in added.items() if t.special}
        self.special_ids: frozenset[int] = frozenset(self.special_tokens.values()) - text_ids
        self.vocab_size: int = max(hf.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        self.bos_token_id = self._config_token_id(cfg, "bos_token")
        eos = self._config_token_id(cfg, "eos_token")
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (eos,)
        self.pad_token_id = self._config_token_id(cfg, "pad_token")
        self.unk_token_id = self._config_token_id(cfg, "unk_token")
        self._token_bytes = self._byte_table(hf)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a checkpoint dir holding ``tokenizer.json`` or ``tiktoken.model`` +
        ``tokenizer_config.json``."""
        d = Path(path)
        cfg_path = d / "tokenizer_config.json"
        cfg: dict = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{cfg_path}: not valid JSON ({e})") from e
        template = cfg.get("chat_template")
        if isinstance(template, list):  # HF's named-template form: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if (d / "tokenizer.json").is_file():
            text = (d / "tokenizer.json").read_text(encoding="utf-8")
        elif (d / "tiktoken.model").is_file():
            if not cfg_path.is_file():
                raise TokenizerError(f"{d}: tiktoken.model needs tokenizer_config.json beside it")
            num_base = len(load_tiktoken_ranks(d / "tiktoken.model"))
            specials = kimi_special_tokens(cfg, num_base)
            text = _converted_tiktoken(d / "tiktoken.model", specials)
            try:
                return cls(text, cfg, template, str(d))
            except Exception:  # damaged cache entry (writes are atomic, so rare): rebuild once
                text = _converted_tiktoken(d / "tiktoken.model", specials, use_cache=False)
                return cls(text, cfg, template, str(d))
        else:
            raise TokenizerError(
                f"{d}: no tokenizer found (expected tokenizer.json, or tiktoken.model + tokenizer_config.json)"
            )
        try:
            return cls(text, cfg, template, str(d))
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{d / 'tokenizer.json'}: cannot load ({reason})") from e

    def _config_token_id(self, cfg: dict, key: str) -> int | None:
        content = _token_content(cfg.get(key))
        return None if content is None else self.token_to_id(content)

    def _byte_table(self, hf: HFTokenizer) -> list[bytes] | None:
        """Bytes of every id when the model is byte-level BPE (enables exact streaming decode)."""
        if not isinstance(hf.decoder, decoders.ByteLevel):
            return None
        dec = {c: b for b, c in bytes_to_unicode().items()}
        table = [b""] * self.vocab_size
        for tok, i in hf.get_vocab(with_added_tokens=False).items():
            try:
                table[i] = bytes(dec[c] for c in tok)
            except KeyError:
                return None
        for i, t in hf.get_added_tokens_decoder().items():
            table[i] = t.content.encode("utf-8")
        return table

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; special-token text stays plain text unless ``allow_special``."""
        hf = self._hf if allow_special else self._hf_plain
        return hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        hf = self._hf if allow_special else self._hf_plain
        return [e.ids for e in hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD."""
        ids = list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._hf.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._hf.id_to_token(i) for i in ids]

    def id_to_bytes(self, token_id: int) -> bytes | None:
        """Raw bytes of one token (byte-level tokenizers only, else None)."""
        table = self._token_bytes
        return None if table is None or not 0 <= token_id < len(table) else table[token_id]

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    ``add`` returns only newly completed text and never half a UTF-8 character; ``flush`` emits
    what is held back (with U+FFFD for an incomplete tail). The concatenated deltas equal
    ``tokenizer.decode(all_ids)``. ``prompt_ids`` only matters for tokenizers that are not
    byte-level (their decoders look at the previous tokens, e.g. for leading spaces).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = False,
        keep_special_ids: Iterable[int] = (),
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._bytes = tokenizer._token_bytes
        # ``keep_special_ids`` stay in the text even when special tokens are skipped (byte-level path)
        self._skip = tokenizer.special_ids - frozenset(keep_special_ids) if skip_special_tokens else frozenset()
        if self._bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            # Generic path (e.g. SentencePiece-style decoders whose output depends on context):
            # re-decode a short window and emit the growth, as vLLM does. The last few prompt
            # tokens give the first generated token its context (leading-space rules).
            self._ids = list(prompt_ids or [])[-6:]
            self._prefix_offset = 0
            self._read_offset = len(self._ids)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed new ids; return the text they completed."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if self._bytes is not None:
            table, skip, n = self._bytes, self._skip, len(self._bytes)
            # Ids beyond the tokenizer (a model vocab padded past it) decode to nothing, as in HF.
            delta = self._utf8.decode(b"".join(table[i] for i in ids if i < n and i not in skip))
        else:
            self._ids.extend(ids)
            delta = self._window_delta(final=False)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: emit held-back bytes (an incomplete character becomes U+FFFD)."""
        if self._bytes is not None:
            delta = self._utf8.decode(b"", final=True)
        else:
            delta = self._window_delta(final=True)
        self.text += delta
        return delta

    def _window_delta(self, final: bool) -> str:
        dec = self.tokenizer.decode
        prefix = dec(self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full = dec(self._ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]
