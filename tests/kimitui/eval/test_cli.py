"""`kimitui eval` wiring: `kl` always, `recall` when kimitui.commands.eval_recall imports, and
nothing breaks when it does not."""

from __future__ import annotations

import sys
import types

import pytest

from kimitui.cli import build_parser, main


def test_recall_registers_when_its_module_imports(monkeypatch):
    calls = []
    fake = types.ModuleType("kimitui.commands.eval_recall")
    fake.add_parser = lambda sub: sub.add_parser("recall").add_argument("--context-lengths")
    fake.run = lambda args: calls.append(args.context_lengths) or 0
    monkeypatch.setitem(sys.modules, "kimitui.commands.eval_recall", fake)
    assert main(["eval", "recall", "--context-lengths", "1000,2000"]) == 0
    assert calls == ["1000,2000"]


def test_without_recall_kl_still_parses(monkeypatch):
    monkeypatch.setitem(sys.modules, "kimitui.commands.eval_recall", None)  # import fails: ModuleNotFoundError
    args = build_parser().parse_args(["eval", "kl", "--dtype", "bfloat16", "--tensor-parallel-size", "2"])
    assert args.eval_command == "kl" and args.gpus == 2 and args.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "recall"])


def test_bad_kl_flags_get_one_line_errors(capsys, tmp_path):
    assert main(["eval", "kl", "--base", str(tmp_path / "none.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", "kl", "--base", "a", "--save-base", "b"]) == 2
    assert main(["eval", "kl", "--chunk", "0"]) == 2
    (tmp_path / "p.jsonl").write_text('{"nope": 1}\n')
    assert main(["eval", "kl", "--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert "expected an object with prompt_token_ids" in capsys.readouterr().err
