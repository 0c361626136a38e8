"""Stand-ins, in a Hugging Face hub cache, for the checkpoints vLLM's scheduler tests name.

Those tests build a ``ModelConfig`` for ``facebook/opt-125m`` (and a few others) and never load a
weight: only the config files matter. With no hub to reach here, each named repository gets a cache
entry (``hub/models--<org>--<name>/snapshots/<commit>``) holding its ``config.json`` written by
transformers' own config class with the released checkpoint's values, so that vLLM under
``HF_HUB_OFFLINE=1`` resolves the same names to the same shapes as in vLLM's CI.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _opt_125m() -> Any:
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=50272,
        hidden_size=768,
        num_hidden_layers=12,
        ffn_dim=3072,
        max_position_embeddings=2048,
        num_attention_heads=12,
        word_embed_proj_dim=768,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        architectures=["OPTForCausalLM"],
        dtype="float16",
    )


def _llava_15_7b() -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=1024,
        image_size=336,
        intermediate_size=4096,
        num_attention_heads=16,
        num_hidden_layers=24,
        patch_size=14,
        projection_dim=768,
    )
    text = LlamaConfig(
        vocab_size=32064,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        architectures=["LlamaForCausalLM"],
        dtype="float16",
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=32000,
        pad_token_id=32001,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
        architectures=["LlavaForConditionalGeneration"],
        dtype="float16",
    )


def _qwen3_06b() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        max_window_layers=28,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        architectures=["Qwen3ForCausalLM"],
        dtype="bfloat16",
    )


def _qwen3_next_80b() -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(  # the class defaults are this checkpoint's, but spelled out
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=512,
        num_experts_per_tok=10,
        bos_token_id=151643,
        eos_token_id=151645,
        architectures=["Qwen3NextForCausalLM"],
        dtype="bfloat16",
    )


STANDINS: dict[str, Callable[[], Any]] = {
    "facebook/opt-125m": _opt_125m,
    "llava-hf/llava-1.5-7b-hf": _llava_15_7b,
    "Qwen/Qwen3-0.6B": _qwen3_06b,
    "Qwen/Qwen3-Next-80B-A3B-Instruct": _qwen3_next_80b,
}


def write_hub_cache(hub: Path) -> Path:
    """Write every stand-in under ``hub`` (the folder ``HF_HUB_CACHE`` names); returns ``hub``."""
    for repo, config in STANDINS.items():
        entry = hub / ("models--" + repo.replace("/", "--"))
        commit = hashlib.sha1(repo.encode()).hexdigest()  # a fixed, made-up revision
        snapshot = entry / "snapshots" / commit
        if not (snapshot / "config.json").is_file():
            config().save_pretrained(snapshot)
        (entry / "refs").mkdir(parents=True, exist_ok=True)
        (entry / "refs" / "main").write_text(commit)
    return hub
