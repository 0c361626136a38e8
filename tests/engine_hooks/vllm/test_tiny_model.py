"""``python -m engine_hooks.vllm.tiny_model DIR``: the tool that builds the tiny test model (no typer: the
engine's package loads no command-line library)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine_hooks.vllm.tiny_model import main
from tests.support import ROOT


def test_the_tiny_model_tool_refuses_sizes_it_cannot_build_with_exit_2(tmp_path: Path, capsys):
    assert main([str(tmp_path / "m"), "--hidden", "130", "--heads", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hidden (130) must be a positive multiple of heads (4)")
    assert not (tmp_path / "m").exists()


def test_the_tiny_model_tool_lists_its_options():
    r = subprocess.run(
        [sys.executable, "-m", "engine_hooks.vllm.tiny_model", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    for option in ("directory", "--hidden", "--layers", "--heads", "--vocab", "--max-pos", "--seed"):
        assert option in r.stdout


def test_the_tiny_model_tool_builds_the_model_asked_for_and_prints_its_directory(tmp_path: Path):
    pytest.importorskip("transformers", reason="the vllm extra builds the model")
    out = tmp_path / "tiny"
    sizes = ["--hidden", "64", "--layers", "1", "--heads", "2", "--vocab", "400", "--max-pos", "256"]
    r = subprocess.run(
        [sys.executable, "-m", "engine_hooks.vllm.tiny_model", str(out), *sizes],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (64, 1, 2)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (400, 256)
