"""The built-in demo checkpoint and the text-in, text-out API on top of it."""

from __future__ import annotations

import filecmp
import json

import pytest

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.config import ModelConfig
from kimitui.engine.demo import ensure_demo_checkpoint, write_demo_checkpoint
from kimitui.engine.engine import PromptError


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(max_model_len=512, max_num_seqs=4)


def test_demo_is_deterministic_and_k2_shaped(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_demo_checkpoint(a)
    write_demo_checkpoint(b)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"config.json", "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json"} <= set(names)
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors
    cfg = ModelConfig.from_pretrained(a)
    assert cfg.model_type == "kimi_k2" and cfg.is_demo and cfg.quantization is None
    index = json.loads((a / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # sharded like a real checkpoint
    tok_cfg = json.loads((a / "tokenizer_config.json").read_text())
    assert tok_cfg["added_tokens_decoder"][str(cfg.vocab_size - 256 + 2)]["content"] == "<|im_end|>"


def test_demo_is_created_on_first_use_in_the_cache_dir():
    path = ensure_demo_checkpoint()
    assert path.is_dir() and "kimitui" in str(path)
    assert ensure_demo_checkpoint() == path  # second call reuses it


def test_generate_text_on_the_demo(demo_llm):
    out = demo_llm.generate("Hello", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    comp = out.outputs[0]
    assert len(comp.token_ids) == 8 and comp.finish_reason == "length"
    tok = demo_llm.get_tokenizer()
    assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)
    assert out.prompt == "Hello" and out.prompt_token_ids == tok.encode("Hello")


def test_stop_string_truncates_and_reports_stop(demo_llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = demo_llm.generate("The quick brown fox", params)[0].outputs[0].text
    assert len(free) > 6
    stop = free[3:6]
    out = demo_llm.generate(
        "The quick brown fox", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    )[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == free[: free.find(stop)]


def test_chat_renders_kimi_format_and_stops_at_im_end(demo_llm):
    out = demo_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    tok = demo_llm.get_tokenizer()
    prompt_text = tok.decode(out.prompt_token_ids)
    assert prompt_text.startswith("<|im_system|>system<|im_middle|>")
    assert prompt_text.endswith("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert len(out.outputs[0].token_ids) == 4


def test_bad_prompts_are_clear_errors(demo_llm):
    with pytest.raises(PromptError, match="empty"):
        demo_llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(PromptError, match="outside the vocabulary"):
        demo_llm.generate([[10**9]], SamplingParams(max_tokens=2))
    with pytest.raises(PromptError, match="max_model_len=512"):
        demo_llm.generate([[5] * 600], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # the engine is still healthy and every block is free
    bm = demo_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert demo_llm.generate("ok", SamplingParams(max_tokens=1))[0].finished


def test_text_prompt_without_tokenizer_is_a_clear_error(tmp_path):
    from tests.helpers.checkpoints import write_hf_checkpoint

    write_hf_checkpoint(tmp_path, num_hidden_layers=1)
    llm = LLM(str(tmp_path), max_model_len=64, max_num_seqs=1)
    with pytest.raises(PromptError, match="no tokenizer files"):
        llm.generate("hello")
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_chat_keeps_only_reply_tags_among_special_tokens(demo_llm):
    from kimitui.engine.text.k2 import chat_reply_special_ids
    from kimitui.engine.text.tokenizer import IncrementalDetokenizer

    tok = demo_llm.get_tokenizer()
    keep = chat_reply_special_ids(tok)
    think, reserved = tok.token_to_id("<think>"), max(tok.special_ids)
    assert think in keep and reserved not in keep
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True, keep_special_ids=keep)
    hello = tok.encode("hello")
    text = detok.add([think, *hello, reserved]) + detok.flush()
    assert text == "<think>hello"
