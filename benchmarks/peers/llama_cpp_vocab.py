"""Run llama.cpp's ``convert_hf_to_gguf.py`` on a kimitui benchmark checkpoint, vocabulary included.

llama.cpp's Kimi converters (DeepSeek-V3 / Kimi K2 and Kimi K3) read the vocabulary through
``AutoTokenizer.from_pretrained(..., trust_remote_code=True)``, i.e. Moonshot's
``tokenization_kimi.py``, which a random-weight checkpoint does not ship. This launcher replaces
only that method: it reads the checkpoint's own ``tiktoken.model`` and ``tokenizer_config.json`` and
writes the GGUF vocabulary exactly as the converters' ``kimi-k2`` branch does (byte-level tokens,
merges recovered from the ranks, specials as CONTROL tokens); without tokenizer files it writes
placeholder tokens (both engines are then driven by token ids). The weights, the tensor layout and
every hyper-parameter go through the converter unchanged.

    <llama.cpp venv python> benchmarks/peers/llama_cpp_vocab.py LLAMA_CPP_DIR [convert_hf_to_gguf.py args...]

It runs in llama.cpp's converter environment (gguf, torch, transformers), never in kimitui's.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path


def read_ranks(directory: Path) -> dict[bytes, int]:
    path = directory / "tiktoken.model"
    if not path.is_file():
        return {}
    ranks = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        token, rank = line.split()
        try:
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError as e:
            raise SystemExit(f"{path}:{n}: not a tiktoken line ({e})")
    return ranks


def read_specials(directory: Path) -> dict[str, int]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    decoder = json.loads(path.read_text()).get("added_tokens_decoder", {})
    return {v["content"]: int(k) for k, v in decoder.items()}


def main() -> int:
    llama_dir = Path(sys.argv[1]).resolve()
    sys.argv = [str(llama_dir / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    sys.path.insert(0, str(llama_dir))
    sys.path.insert(1, str(llama_dir / "gguf-py"))
    import gguf
    from conversion.deepseek import DeepseekV2Model
    from conversion.kimi_linear import KimiLinearModel
    from conversion.qwen import QwenModel

    def set_vocab(self) -> None:
        d = Path(self.dir_model)
        ranks, specials = read_ranks(d), read_specials(d)
        vocab_size = self.hparams["vocab_size"]
        tokens: list[str] = []
        types: list[int] = []
        merges: list[str] = []
        if ranks:
            vocab = {}
            for token, rank in ranks.items():
                vocab[QwenModel.token_bytes_to_string(token)] = rank
                if len(token) == 1:
                    continue
                merged = QwenModel.bpe(ranks, token, max_rank=rank)
                if len(merged) == 2:
                    merges.append(" ".join(map(QwenModel.token_bytes_to_string, merged)))
            reverse = {i: t for t, i in {**vocab, **specials}.items()}
            control = set(specials.values())
            for i in range(vocab_size):
                if i not in reverse:
                    tokens.append(f"[PAD{i}]")
                    types.append(gguf.TokenType.UNUSED)
                else:
                    tokens.append(reverse[i])
                    types.append(gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL)
            pre = "kimi-k2"
        else:
            tokens = [f"<t{i}>" for i in range(vocab_size)]
            types = [gguf.TokenType.NORMAL] * vocab_size
            pre = "default"
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre(pre)
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_types(types)
        self.gguf_writer.add_token_merges(merges)
        gguf.SpecialVocab(d, load_merges=False).add_to_gguf(self.gguf_writer)
        # K3's text config names its turn terminator; K2's checkpoint config names its own
        text = self.hparams
        for key, add in (
            ("bos_token_id", self.gguf_writer.add_bos_token_id),
            ("eos_token_id", self.gguf_writer.add_eos_token_id),
        ):
            value = text.get(key)
            if isinstance(value, list):
                value = value[0]
            if isinstance(value, int) and 0 <= value < vocab_size:
                add(value)
        self.gguf_writer.add_add_bos_token(False)

    DeepseekV2Model.set_vocab = set_vocab
    KimiLinearModel.set_vocab = set_vocab
    import runpy

    runpy.run_path(str(llama_dir / "convert_hf_to_gguf.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
