"""`kimitui eval recall`: the scorer on canned replies, the haystack's depths and lengths, the
command end to end on both demo models (random weights score ~0: the harness is under test), and
the same run against a live `kimitui serve` through --base-url."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from kimitui.commands import eval_recall
from kimitui.eval.haystack import build_haystack, make_needles
from kimitui.eval.recall import AMBIGUOUS, FOUND, MISSING, WRONG, check_lengths, parse_context_lengths, score_reply
from tests.helpers.http_server import serving

CODE, OTHER = "7XKQ-42QM", "ABCD-EFGH"


@pytest.mark.parametrize(
    "reply,verdict",
    [
        ("7XKQ-42QM", FOUND),
        ("The access code for the amber falcon is 7XKQ-42QM.", FOUND),
        ("**7XKQ-42QM**", FOUND),
        ("`7XKQ-42QM`\n", FOUND),
        ("", MISSING),
        ("I could not find it.", MISSING),
        ("7xkq-42qm", MISSING),  # exact match: case counts
        ("7XKQ-42QMZ", MISSING),  # a longer code is another code
        ("A7XKQ-42QM", MISSING),
        ("7XKQ-42QM-9", MISSING),
        ("7XKQ-42Q", MISSING),
        ("7XKQ 42QM", MISSING),
        ("ABCD-EFGH", WRONG),
        ("It is ABCD-EFGH, not anything else.", WRONG),
        ("7XKQ-42QM or ABCD-EFGH", AMBIGUOUS),  # listing every code earns nothing
        ("7XKQ-42QM 7XKQ-42QM", FOUND),
    ],
)
def test_scorer_on_canned_replies(reply, verdict):
    assert score_reply(reply, CODE, [CODE, OTHER, "ZZZZ-2222"]) == verdict


def test_context_length_parsing_and_limit():
    assert parse_context_lengths("256, 4k,32K") == [256, 4096, 32768]
    for bad in ("", "12x", "0", "-5", "1,,2"):
        with pytest.raises(ValueError, match="--context-lengths"):
            parse_context_lengths(bad)
    check_lengths([1000], 1024, 24)
    with pytest.raises(ValueError, match="max_model_len is 1024 tokens, so prompts can have at most 1000"):
        check_lengths([1001], 1024, 24)


class _WordTokenizer:
    """One token per whitespace-separated word: lengths and depths are then easy to check by hand."""

    @staticmethod
    def count(text: str) -> int:
        return len(text.split())

    @staticmethod
    def encode_messages(messages):
        return ["<u>", *messages[0]["content"].split(), "<a>"]


def test_haystack_fits_the_length_and_plants_codes_at_their_depths():
    needles = make_needles([0.0, 0.5, 1.0], 2, seed=3)
    assert len({n.code for n in needles}) == len({n.key for n in needles}) == 6
    tok = _WordTokenizer()
    hay = build_haystack(2000, needles, tok.encode_messages, tok.count, seed=3)
    assert all(1950 <= len(p) <= 2000 for p in hay.prompts), [len(p) for p in hay.prompts]
    doc_words = hay.doc.split()
    for n in needles:
        assert hay.doc.count(n.code) == 1 and hay.doc.count(f"the {n.key} is") == 1
        at = doc_words.index(n.code + ".") / len(doc_words)
        assert abs(at - n.depth) < 0.03, (n.depth, at)
    # the same seed builds the same document; another seed another one
    assert build_haystack(2000, needles, tok.encode_messages, tok.count, seed=3).doc == hay.doc
    assert build_haystack(2000, needles, tok.encode_messages, tok.count, seed=4).doc != hay.doc
    with pytest.raises(ValueError, match="too short for 6 codes"):
        build_haystack(60, needles, tok.encode_messages, tok.count, seed=3)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kimitui eval")
    eval_recall.add_parser(p.add_subparsers(dest="eval_command"))
    return p.parse_args(["recall", *argv])


@pytest.mark.parametrize(
    "model,chat_format", [("demo", "kimi-k2"), pytest.param("demo-k3", "xtml", marks=pytest.mark.slow)]
)  # K3 on a CPU: ~25-75 s
def test_recall_end_to_end_on_the_demo_models(model, chat_format, tmp_path, capsys):
    out_file = tmp_path / "recall.json"
    args = _parse(
        [
            "--model",
            model,
            "--context-lengths",
            "320,640",
            "--depths",
            "0,0.5,1",
            "--codes-per-depth",
            "1",
            "--max-tokens",
            "8",
            "--json",
            str(out_file),
        ]
    )
    assert eval_recall.run(args) == 0
    out, err = capsys.readouterr()
    assert "Long-context recall" in out and "d=0.5" in out
    result = json.loads(out_file.read_text())
    assert chat_format in result["target"]
    assert [r["context_length"] for r in result["results"]] == [320, 640]
    for r in result["results"]:
        assert 0.8 * r["context_length"] <= r["prompt_tokens_min"] <= r["prompt_tokens_max"] <= r["context_length"]
        assert [d["depth"] for d in r["depths"]] == [0.0, 0.5, 1.0]
        assert all(d["total"] == 1 and 0 <= d["found"] <= 1 for d in r["depths"])
        assert sum(r["verdicts"].values()) == r["total"] == 3
        assert all(
            i["verdict"] == score_reply(i["reply"], i["code"], [j["code"] for j in r["items"]]) for i in r["items"]
        )
    assert result["total"] == 6 and 0.0 <= result["recall"] <= 1.0
    assert result["max_model_len"] == 32768


def test_recall_names_the_limit_above_the_model_maximum(capsys):
    args = _parse(["--model", "demo", "--max-model-len", "512", "--context-lengths", "256,1024"])
    assert eval_recall.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "context length 1024 is above this model's maximum: max_model_len is 512" in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--context-lengths", "12q"], "--context-lengths: expected numbers"),
        (["--context-lengths", "256", "--depths", "0,1.5"], "--depths"),
        (["--context-lengths", "256", "--codes-per-depth", "0"], "--codes-per-depth must be >= 1"),
        (["--context-lengths", "256", "--base-url", "ftp://x"], "--base-url must start with http"),
        (["--context-lengths", "256", "--tokenizer", "/nonexistent"], "--tokenizer is for --base-url"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert eval_recall.run(_parse(argv)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") <= 3, err


def test_unreachable_server_exits_1(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    assert eval_recall.run(_parse(["--context-lengths", "256", "--base-url", f"http://127.0.0.1:{port}"])) == 1
    assert "could not list models" in capsys.readouterr().err


@pytest.mark.slow  # a server, then the same run in-process: ~40-100 s on two CPU cores
def test_recall_against_a_live_server_matches_in_process_prompts(tmp_path, capsys):
    pytest.importorskip("kimitui.server.app")
    pytest.importorskip("uvicorn")
    from kimitui.engine import AsyncLLM, EngineArgs

    common = ["--context-lengths", "256,512", "--depths", "0,1", "--codes-per-depth", "1", "--max-tokens", "6"]
    with serving(AsyncLLM(engine_args=EngineArgs(model="demo-k3", max_model_len=1024)), "demo-k3") as port:
        http_file = tmp_path / "http.json"
        rc = eval_recall.run(_parse([*common, "--base-url", f"http://127.0.0.1:{port}/v1", "--json", str(http_file)]))
        assert rc == 0, capsys.readouterr().err
        too_long = eval_recall.run(_parse(["--context-lengths", "1020", "--base-url", f"http://127.0.0.1:{port}"]))
        assert too_long == 2 and "max_model_len is 1024" in capsys.readouterr().err
    local_file = tmp_path / "local.json"
    assert eval_recall.run(_parse([*common, "--model", "demo-k3", "--json", str(local_file)])) == 0
    http, local = json.loads(http_file.read_text()), json.loads(local_file.read_text())
    assert "model demo-k3" in http["target"] and http["max_model_len"] == 1024
    # The server rendered the same K3 chat format the haystack was sized with: the prompt token
    # counts it reports are the in-process prompts' lengths, question for question.
    for h, l in zip(http["results"], local["results"]):
        assert [i["prompt_tokens"] for i in h["items"]] == [i["prompt_tokens"] for i in l["items"]]
        assert [i["code"] for i in h["items"]] == [i["code"] for i in l["items"]]
        assert [d["depth"] for d in h["depths"]] == [0.0, 1.0]
