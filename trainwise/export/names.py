"""The tensors every Llama-style family on the Hub names alike (llama, mistral, qwen2, qwen3, mixtral,
qwen3_moe, deepseek_v3, gpt_oss): the embedding, the final norm, an untied LM head and each layer's two
norms, both ways. What differs per family (attention, MLP, experts) is each family's own."""

from __future__ import annotations

from trainwise.config import ModelConfig

# trainwise's name -> the Hub's: the model's ends, then a layer's (under blocks.{i}. / model.layers.{i}.)
ENDS = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
LAYER = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight"}


def _pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    ends = [(tw, hf) for tw, hf in ENDS.items() if tw != "lm_head.weight" or not cfg.tie_embeddings]
    return ends + [(f"blocks.{i}.{tw}", f"model.layers.{i}.{hf}") for i in range(cfg.n_layers)
                   for tw, hf in LAYER.items()]


def shared_to_hf(cfg: ModelConfig, s: dict) -> dict:
    """The shared tensors of a trainwise state dict under the Hub's names (a tied LM head left out)."""
    return {hf: s[tw] for tw, hf in _pairs(cfg)}


def shared_from_hf(cfg: ModelConfig, t: dict, take) -> dict:
    """The shared tensors of Hub-layout tensors under trainwise's names; take(t, key) reads a tensor or says
    which is missing."""
    return {tw: take(t, hf) for tw, hf in _pairs(cfg)}
