"""A tiny random-weight Llama and a locally trained BPE tokenizer, for running real vLLM offline.

No weights can be downloaded where chunkledger is tested, so tests, benchmarks and the demo build a
model here: a ``transformers`` Llama with random weights (seeded, so the same arguments give the same
files) and a byte-level BPE tokenizer trained with ``tokenizers`` on a generated word corpus. It
answers with nonsense, but vLLM schedules, chunks, caches and preempts it exactly like a real model.

    python -m engine_hooks.vllm.tiny_model /tmp/tiny-llama          # prints the directory
    python -m engine_hooks.vllm.tiny_model /tmp/m --hidden 512 --layers 4

``vllm_env(dir)`` gives the environment vLLM needs to run offline and keep its sockets and caches
inside ``dir`` (merge it into ``os.environ`` before importing vLLM, or pass it to a subprocess).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

_TEXT = (
    "the a of and to in is was for on that with as by at from it this be are or an not which have "
    "has had were but one all their there been if more when will would who so no out up into than "
    "them can only other new some could time these two may then first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three engine token "
    "prefill decode chunk budget ledger request cache block queue step batch latency"
)
_WORDS = tuple(_TEXT.split())
_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
_MARKER = "chunkledger_tiny_model.json"


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 24))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        out.append(" ".join(words) + rng.choice([".", "!", "?", ",", ";", ":"]))
    return out


def _build_tokenizer(path: Path, vocab: int, max_pos: int, seed: int) -> int:
    """Train a byte-level BPE on the generated corpus and save it as a fast tokenizer; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_pos,
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return int(tok.get_vocab_size())


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    vocab: int = 1400,
    max_pos: int = 32768,
    seed: int = 0,
) -> str:
    """Write a random-weight Llama and its BPE tokenizer into ``path``; returns the path as a string.

    ``hidden`` must be a multiple of ``heads``; ``vocab`` is the model's vocabulary (the tokenizer is
    trained up to that size); ``max_pos`` is ``max_position_embeddings`` (RoPE, so it costs nothing).
    Deterministic: the same arguments give the same files. A directory already built with the same
    arguments is reused as it is (a marker file records them).
    """
    if hidden <= 0 or layers <= 0 or heads <= 0 or hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a positive multiple of heads ({heads}); layers >= 1")
    if vocab < 300:
        raise ValueError(f"vocab must be at least 300 (256 byte tokens, specials, merges), got {vocab}")
    if max_pos < 128:
        raise ValueError(f"max_pos must be at least 128, got {max_pos}")
    out = Path(path)
    spec = {
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "vocab": vocab,
        "max_pos": max_pos,
        "seed": seed,
        "version": 1,
    }
    marker = out / _MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == spec:
                return str(out)
        except (OSError, ValueError):
            pass
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _build_tokenizer(out, vocab, max_pos, seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_pos,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        # Llama's default init draws weights with std 0.02; scale the embedding up a little so the
        # logits are not flat (a flat distribution makes greedy decoding pick the same token).
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(out), safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return str(out)


def vllm_env(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Environment for running vLLM offline with its sockets, temp files and caches under ``directory``.

    Sets VLLM_RPC_BASE_PATH, TMPDIR, VLLM_CACHE_ROOT (sub-folders of ``directory``, created here),
    VLLM_NO_USAGE_STATS=1 and HF_HUB_OFFLINE=1 (plus TRANSFORMERS_OFFLINE=1). Apply it before vLLM is
    imported (``os.environ.update(vllm_env(d))``) or pass ``{**os.environ, **vllm_env(d)}`` to a
    subprocess.
    """
    base = Path(directory)
    env = {
        "VLLM_RPC_BASE_PATH": str(base / "rpc"),
        "TMPDIR": str(base / "tmp"),
        "VLLM_CACHE_ROOT": str(base / "cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    for key in ("VLLM_RPC_BASE_PATH", "TMPDIR", "VLLM_CACHE_ROOT"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    return env


def main(argv: list[str] | None = None) -> int:  # python -m engine_hooks.vllm.tiny_model DIR
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m engine_hooks.vllm.tiny_model",
        description="Build a tiny random-weight Llama with a local BPE tokenizer; prints its directory.",
    )
    ap.add_argument("directory", help="where to write the model and tokenizer")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (default: 128)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    ap.add_argument("--vocab", type=int, default=1400, help="vocabulary size (default: 1400)")
    ap.add_argument("--max-pos", type=int, default=32768, help="max_position_embeddings (default: 32768)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights and corpus (default: 0)")
    ns = ap.parse_args(argv)
    try:
        directory = build_tiny_model(
            ns.directory,
            hidden=ns.hidden,
            layers=ns.layers,
            heads=ns.heads,
            vocab=ns.vocab,
            max_pos=ns.max_pos,
            seed=ns.seed,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["build_tiny_model", "vllm_env"]
