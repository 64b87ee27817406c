"""Tokenizer: Kimi tiktoken conversion equals tiktoken itself; streaming decode equals decode."""

from __future__ import annotations

import json
import os
import random
import unicodedata

import pytest

tiktoken = pytest.importorskip("tiktoken")

from tokenizers import Regex, pre_tokenizers  # noqa: E402

from kimitui.engine.demo.bpe_train import (  # noqa: E402
    demo_corpus,
    kimi_special_tokens_for,
    train_ranks,
    write_kimi_tokenizer_files,
)
from kimitui.engine.text.tokenizer import (  # noqa: E402
    KIMI_PAT_STR,
    KIMI_PAT_STR_ONIG,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
    tokenizer_cache_dir,
)

NUM_BASE = 4096

SAMPLES = [
    "Hello, world! This is a plain English sentence.",
    "I'LL be there; she's here, they'RE gone, we'Ve won, I'm ok, he'd go, don't, CAN'T.",
    "McDonald's iPhone XMLHttpRequest camelCase snake_case SCREAMING_CASE Ünïcödé",
    "你好，世界！我们正在测试中文分词。「引号」、顿号；问号？",
    "日本語の文章です。カタカナとひらがな、漢字が混ざっています。々〇〻",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "fn main() { let v: Vec<u32> = (0..10).map(|i| i * 2).collect(); }",
    "1234567890 3.14159 1,234,567.89 -42 +7 0xFF 1e-6 ٣٤٥ １２３",
    "Emoji: 🚀🎉🐍 ❤️ 👍🏽 🇯🇵 👨‍👩‍👧‍👦 family",
    "   leading spaces\t\ttabs\n\n\ntrailing   \r\n\r\nwindows\u00a0nbsp\u3000ideographic ",
    "\n\n\n    \n  x  \n",
    "mixed中文English日本語한국어Русский",
    "ǅungla ǈ ſ'ſ K'K 'S 'LL 'll 'Ll",
    "Prices: $3.50, €4,00, £5 — 50% off!!! ... ??? ---",
    "<|im_end|> [BOS] <think> </think> <|reserved_token_4200|> are just text here",
    "",
    " ",
    "a",
]

# Code-point ranges for random text: scripts, marks, CJK, emoji, spaces, digits of other scripts.
_RANGES = [
    (0x20, 0x7E),
    (0xA0, 0x24F),
    (0x300, 0x36F),
    (0x370, 0x3FF),
    (0x400, 0x4FF),
    (0x5D0, 0x5EA),
    (0x620, 0x669),
    (0x900, 0x97F),
    (0xE01, 0xE5B),
    (0x1100, 0x11FF),
    (0x2000, 0x206F),
    (0x2E80, 0x2EF3),
    (0x3000, 0x30FF),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3),
    (0xFF01, 0xFF65),
    (0x1F300, 0x1F64F),
    (0x20000, 0x2A6DF),
]
_SPACES = [" ", " ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u3000", "\x0b", "\x0c", "\u2028"]
_WORDS = ["'s", "'LL", "'ve", "'D", " the", "The", "ABC", "x", "中文", "123", "🚀", "é", "!"]


def _random_text(rng: random.Random, n: int) -> str:
    out = []
    while len(out) < n:
        k = rng.random()
        if k < 0.15:
            out.append(rng.choice(_SPACES))
        elif k < 0.3:
            out.append(rng.choice(_WORDS))
        else:
            lo, hi = rng.choice(_RANGES)
            c = chr(rng.randint(lo, hi))
            # Unassigned in Python's Unicode database: categories may differ between the Unicode
            # versions bundled in Oniguruma, Rust regex and `regex`; that is not what we test.
            if unicodedata.category(c) not in ("Cn", "Cs", "Co"):
                out.append(c)
    return "".join(out)


def _cases() -> list[str]:
    rng = random.Random(1234)
    cases = list(SAMPLES)
    cases += [_random_text(rng, rng.randint(1, 40)) for _ in range(250)]
    cases += [
        bytes(rng.randrange(256) for _ in range(rng.randint(1, 40))).decode("utf-8", "replace") for _ in range(100)
    ]
    corpus = demo_corpus()
    cases += [corpus[i : i + rng.randint(20, 400)] for i in range(0, len(corpus), len(corpus) // 60)]
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return train_ranks(demo_corpus(), NUM_BASE)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, ranks):
    d = tmp_path_factory.mktemp("kimi_tok")
    write_kimi_tokenizer_files(d, ranks)
    return d


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
        yield os.environ["XDG_CACHE_HOME"]


@pytest.fixture(scope="module")
def tok(kimi_dir, cache_home) -> Tokenizer:
    return Tokenizer.from_pretrained(kimi_dir)


@pytest.fixture(scope="module")
def tt(ranks):
    specials = {c: i for i, c in kimi_special_tokens_for(NUM_BASE).items()}
    return tiktoken.Encoding("kimi-demo", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def test_rewritten_pattern_splits_like_original():
    regex = pytest.importorskip("regex")
    original = regex.compile(KIMI_PAT_STR, flags=regex.V1)  # V1: `&&` means intersection
    rewritten = pre_tokenizers.Split(Regex(KIMI_PAT_STR_ONIG), behavior="isolated")
    assert "&&" not in KIMI_PAT_STR_ONIG
    for text in CASES:
        assert [p for p, _ in rewritten.pre_tokenize_str(text)] == original.findall(text), repr(text)


def test_han_is_script_not_script_extensions(tok, tt):
    # "、" and "ー" have Han only in Script_Extensions; both engines must keep them out of Han runs.
    for text in ["中、中", "中ー中", "漢字・かな"]:
        assert tok.encode(text) == tt.encode_ordinary(text)


def test_encode_equals_tiktoken(tok, tt):
    for text in CASES:
        assert tok.encode(text) == tt.encode_ordinary(text), repr(text)


def test_decode_roundtrip_and_equals_tiktoken(tok, tt):
    for text in CASES:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))]
        assert tok.decode(ids) == tt.decode(ids), ids


def test_special_tokens_never_from_plain_text(tok, tt):
    specials = list(tok.special_tokens)
    rng = random.Random(3)
    for _ in range(100):
        text = "".join(rng.choice(specials + ["a", " ", "中", "<|", "|>"]) for _ in range(8))
        assert not set(tok.encode(text)) & tok.special_ids
        assert tok.encode(text) == tt.encode_ordinary(text)
        assert tok.encode(text, allow_special=True) == tt.encode(text, allowed_special="all")
    assert tok.encode("<|im_end|>", allow_special=True) == [NUM_BASE + 2]


def test_kimi_special_layout(tok):
    assert tok.vocab_size == NUM_BASE + 256
    assert tok.special_ids == frozenset(range(NUM_BASE, NUM_BASE + 256))
    assert tok.token_to_id("[BOS]") == tok.bos_token_id == NUM_BASE
    assert tok.eos_token_ids == (NUM_BASE + 1,)
    assert tok.token_to_id("<|im_middle|>") == NUM_BASE + 17
    assert tok.id_to_token(NUM_BASE + 5) == f"<|reserved_token_{NUM_BASE + 5}|>"
    assert tok.convert_ids_to_tokens([NUM_BASE + 22, NUM_BASE + 23]) == ["<think>", "</think>"]
    assert tok.token_to_id("no such token") is None
    assert tok.chat_template and "<|im_middle|>" in tok.chat_template
    ids = tok.encode("hi", allow_special=False) + [NUM_BASE + 2]
    assert tok.decode(ids) == "hi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_conversion_cached_outside_checkpoint(kimi_dir, cache_home, tok):
    assert sorted(p.name for p in kimi_dir.iterdir()) == ["tiktoken.model", "tokenizer_config.json"]
    cached = list(tokenizer_cache_dir().glob("*.json"))
    assert len(cached) == 1 and len(cached[0].stem) == 64  # sha256 hex
    assert str(tokenizer_cache_dir()).startswith(cache_home)
    again = Tokenizer.from_pretrained(kimi_dir)  # from the cache this time
    assert again.encode(SAMPLES[1]) == tok.encode(SAMPLES[1])


def test_tokenizer_json_path(tmp_path, tok):
    cached = next(tokenizer_cache_dir().glob("*.json"))
    (tmp_path / "tokenizer.json").write_text(cached.read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    t = Tokenizer.from_pretrained(tmp_path)
    for text in SAMPLES:
        assert t.encode(text) == tok.encode(text)
    assert t.eos_token_ids == (NUM_BASE + 2,)
    assert t.bos_token_id is None and t.chat_template is None


def test_missing_files_error(tmp_path):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_pretrained(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg
    assert "tokenizer.json" in msg and "tiktoken.model" in msg and "tokenizer_config.json" in msg
    (tmp_path / "tiktoken.model").write_text("IQ== 0\n")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(tmp_path)


def _stream(tok, ids, rng, **kw) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tok, **kw)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return "".join(deltas), deltas


def test_incremental_detokenizer_equals_decode(tok):
    rng = random.Random(11)
    multibyte = [i for i in range(NUM_BASE) if tok.id_to_bytes(i)[:1] >= b"\x80"]
    assert len(multibyte) > 100
    for _ in range(300):
        pool = rng.choice([multibyte, range(NUM_BASE), range(tok.vocab_size + 3)])
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 25))]
        skip = rng.random() < 0.5
        text, _ = _stream(tok, ids, rng, skip_special_tokens=skip)
        assert text == tok.decode(ids, skip_special_tokens=skip), ids


def test_incremental_detokenizer_never_splits_characters(tok):
    rng = random.Random(5)
    for text in CASES:
        ids = tok.encode(text)
        out, deltas = _stream(tok, ids, rng)
        assert out == text
        if "\ufffd" not in text:
            assert all("\ufffd" not in d for d in deltas)


def test_incremental_detokenizer_generic_decoder(tmp_path):
    # A non-byte-level tokenizer (Metaspace) goes through the re-decoding window path.
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, trainers

    hf = HF(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator(
        SAMPLES * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    )
    (tmp_path / "tokenizer.json").write_text(hf.to_str())
    t = Tokenizer.from_pretrained(tmp_path)
    assert t.id_to_bytes(0) is None
    rng = random.Random(2)
    for text in SAMPLES[:6]:
        ids = t.encode(text)
        out, _ = _stream(t, ids, rng)
        assert out == t.decode(ids)
