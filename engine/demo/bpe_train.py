"""Train a small byte-level BPE and write it in Kimi's tokenizer format (for the demo checkpoint).

Training uses the Rust ``tokenizers`` BpeTrainer with Kimi's split pattern; the learned merges
are then renumbered as tiktoken ranks (bytes 0..255 first, then one rank per merge in merge
order), so the two parts of every token rank below it. tests/engine/demo/test_bpe_train.py checks
that tiktoken's own merge loop rebuilds every token of the demo vocabulary.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from kimitui.engine.text.tokenizer import KIMI_PAT_STR_ONIG, NUM_RESERVED_SPECIAL_TOKENS, bytes_to_unicode

# Kimi K2's named special tokens as offsets from num_base_tokens (tokenization_kimi.py and
# tokenizer_config.json of moonshotai/Kimi-K2-Instruct); every other
# slot of the 256-token block is `<|reserved_token_{id}|>`.
KIMI_SPECIAL_TOKEN_OFFSETS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}

_DATA = Path(__file__).with_name("data")  # shipped beside this module (package data)

# Real Kimi lists these as `additional_special_tokens` in tokenizer_config.json.
_ADDITIONAL_SPECIAL = [
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|im_middle|>",
]


def demo_corpus() -> str:
    """The multilingual text shipped in engine/demo/data for training the demo tokenizer."""
    return (_DATA / "demo_corpus.txt").read_text(encoding="utf-8")


def k2_chat_template() -> str:
    """Our Jinja equivalent of Kimi K2-Instruct's chat template (engine/demo/data)."""
    path = _DATA / "kimi_k2_chat_template.jinja"
    return path.read_text(encoding="utf-8")


def train_ranks(text: str, num_base_tokens: int = 4096) -> dict[bytes, int]:
    """Learn ``num_base_tokens`` byte-level BPE tokens from ``text``; returns tiktoken ranks.

    Deterministic: the same text gives the same ranks. Raises ValueError when the text is too
    small to yield that many tokens.
    """
    if num_base_tokens < 256:
        raise ValueError(f"num_base_tokens must be at least 256 (one per byte), got {num_base_tokens}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PAT_STR_ONIG), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=num_base_tokens,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_lines(text), trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]

    dec = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in merges:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        token = bytes(dec[c] for c in left + right)
        if token not in ranks:  # a string reached by two merge paths keeps its first rank
            ranks[token] = len(ranks)
        if len(ranks) == num_base_tokens:
            break
    if len(ranks) < num_base_tokens:
        raise ValueError(f"training text too small: learned {len(ranks)} tokens, wanted {num_base_tokens}")
    return ranks


def _lines(text: str, chunk: int = 4096):
    # Newline-aligned chunks let the trainer count in parallel; a blank-line run cut at a chunk
    # edge only shifts whitespace statistics a little, and the chunking itself is deterministic.
    start = 0
    while start < len(text):
        end = text.find("\n", start + chunk)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def kimi_special_tokens_for(num_base_tokens: int) -> dict[int, str]:
    """id -> content for the 256-token special block, Kimi K2 layout."""
    ids = range(num_base_tokens, num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS)
    return {i: KIMI_SPECIAL_TOKEN_OFFSETS.get(i - num_base_tokens, f"<|reserved_token_{i}|>") for i in ids}


def write_kimi_tokenizer_files(
    directory: str | os.PathLike,
    ranks: dict[bytes, int],
    *,
    model_max_length: int = 131072,
    chat_template: str | None = None,
) -> None:
    """Write ``tiktoken.model`` and ``tokenizer_config.json`` shaped like Kimi K2's."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    num_base = len(ranks)
    if sorted(ranks.values()) != list(range(num_base)):
        raise ValueError("ranks must be dense 0..n-1")
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(tok).decode()} {r}\n" for tok, r in by_rank]
    (d / "tiktoken.model").write_text("".join(lines), encoding="ascii")

    specials = kimi_special_tokens_for(num_base)
    config = {
        "added_tokens_decoder": {
            str(i): {
                "content": c,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, c in specials.items()
        },
        "additional_special_tokens": _ADDITIONAL_SPECIAL,
        "bos_token": "[BOS]",
        "chat_template": k2_chat_template() if chat_template is None else chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": model_max_length,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (d / "tokenizer_config.json").write_text(text, encoding="utf-8")
