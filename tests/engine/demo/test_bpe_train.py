"""Demo BPE training: deterministic, tiktoken-consistent ranks, files in Kimi's exact shape."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import time

import pytest

from kimitui.engine.demo.bpe_train import (
    KIMI_SPECIAL_TOKEN_OFFSETS,
    demo_corpus,
    k2_chat_template,
    train_ranks,
    write_kimi_tokenizer_files,
)
from kimitui.engine.text.tokenizer import KIMI_PAT_STR, load_tiktoken_ranks

NUM_BASE = 4096


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    start = time.perf_counter()
    r = train_ranks(demo_corpus(), NUM_BASE)
    # Budget is < 3 s; the margin keeps a busy 2-core machine from failing the suite.
    assert time.perf_counter() - start < 8
    return r


def _digest(ranks: dict[bytes, int]) -> str:
    return hashlib.sha256(repr(sorted(ranks.items(), key=lambda kv: kv[1])).encode()).hexdigest()


def test_ranks_dense_and_bytes_first(ranks):
    assert len(ranks) == NUM_BASE
    assert sorted(ranks.values()) == list(range(NUM_BASE))
    assert all(ranks[bytes([b])] == b for b in range(256))


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    # tiktoken's byte_pair_merge restricted to ranks below max_rank.
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return parts
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def test_every_token_reachable_by_lower_ranked_merges(ranks):
    # llama.cpp's check: BPE over a token's own bytes with only lower ranks ends in exactly two
    # parts, so tiktoken can build every token inside a longer piece, not only as a whole piece.
    for token, rank in ranks.items():
        if len(token) > 1:
            assert len(_bpe(ranks, token, rank)) == 2, (token, rank)


def test_encodings_match_tiktoken_on_held_out_text(ranks):
    tiktoken = pytest.importorskip("tiktoken")
    from tokenizers import Tokenizer as HF

    from kimitui.engine.text.tokenizer import KIMI_PAT_STR_ONIG, tiktoken_to_hf_json

    enc = tiktoken.Encoding("demo", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    hf = HF.from_str(tiktoken_to_hf_json(ranks, KIMI_PAT_STR_ONIG, {}))
    texts = [
        "The quick brown fox's tail; they'LL see.",
        "模型正在学习新的算法，结果非常好。",
        "東京の天気を調べています。",
        "for (int i = 0; i < 10; ++i) { sum += a[i]; }",
        "2025-01-31 12:00:00 | $1,234.56 | 99.9%",
        "   \n\n\t  spaced   out  \n",
    ]
    corpus = demo_corpus()
    texts += [corpus[i : i + 300] for i in range(0, len(corpus), 3001)]
    for text in texts:
        ids = enc.encode_ordinary(text)
        assert hf.encode(text, add_special_tokens=False).ids == ids, text
        # Compression sanity: a trained vocab, not bytes.
        assert len(ids) < len(text.encode()) or len(text) < 8


def test_training_is_deterministic(ranks, tmp_path):
    assert _digest(train_ranks(demo_corpus(), NUM_BASE)) == _digest(ranks)
    # A fresh process (new hash seeds, thread scheduling) learns the same ranks.
    code = (
        "import hashlib; from kimitui.engine.demo.bpe_train import demo_corpus, train_ranks; "
        "r = train_ranks(demo_corpus(), 4096); "
        "print(hashlib.sha256(repr(sorted(r.items(), key=lambda kv: kv[1])).encode()).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _digest(ranks)


def test_files_deterministic(ranks, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_kimi_tokenizer_files(a, ranks)
    write_kimi_tokenizer_files(b, train_ranks(demo_corpus(), NUM_BASE))
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_tiktoken_model_format(ranks, tmp_path):
    write_kimi_tokenizer_files(tmp_path, ranks)
    lines = (tmp_path / "tiktoken.model").read_text(encoding="ascii").splitlines()
    assert len(lines) == NUM_BASE
    for rank, line in enumerate(lines):
        token, r = line.split(" ")
        assert int(r) == rank and ranks[base64.b64decode(token)] == rank
    assert load_tiktoken_ranks(tmp_path / "tiktoken.model") == ranks
    tiktoken_load = pytest.importorskip("tiktoken.load")
    assert tiktoken_load.load_tiktoken_bpe(str(tmp_path / "tiktoken.model")) == ranks


def test_tokenizer_config_shape(ranks, tmp_path):
    write_kimi_tokenizer_files(tmp_path, ranks, model_max_length=4096)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "TikTokenTokenizer"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == (
        "[BOS]",
        "[EOS]",
        "[PAD]",
        "[UNK]",
    )
    assert cfg["model_max_length"] == 4096
    assert cfg["chat_template"] == k2_chat_template()
    added = cfg["added_tokens_decoder"]
    assert sorted(map(int, added)) == list(range(NUM_BASE, NUM_BASE + 256))
    assert all(v["special"] and not v["normalized"] for v in added.values())
    expected_k2 = {
        163584: "[BOS]",
        163585: "[EOS]",
        163586: "<|im_end|>",
        163587: "<|im_user|>",
        163588: "<|im_assistant|>",
        163590: "<|start_header_id|>",
        163591: "<|end_header_id|>",
        163593: "[EOT]",
        163594: "<|im_system|>",
        163595: "<|tool_calls_section_begin|>",
        163596: "<|tool_calls_section_end|>",
        163597: "<|tool_call_begin|>",
        163598: "<|tool_call_argument_begin|>",
        163599: "<|tool_call_end|>",
        163601: "<|im_middle|>",
        163602: "<|media_begin|>",
        163603: "<|media_content|>",
        163604: "<|media_end|>",
        163605: "<|media_pad|>",
        163606: "<think>",
        163607: "</think>",
        163838: "[UNK]",
        163839: "[PAD]",
    }
    assert {163584 + off: name for off, name in KIMI_SPECIAL_TOKEN_OFFSETS.items()} == expected_k2
    for real_id, name in expected_k2.items():
        assert added[str(real_id - 163584 + NUM_BASE)]["content"] == name
    assert added[str(NUM_BASE + 5)]["content"] == f"<|reserved_token_{NUM_BASE + 5}|>"


def test_small_vocab_and_errors():
    small = train_ranks(demo_corpus()[:20000], 512)
    assert len(small) == 512
    with pytest.raises(ValueError, match="too small"):
        train_ranks("tiny text", 4096)
    with pytest.raises(ValueError):
        train_ranks(demo_corpus(), 100)
