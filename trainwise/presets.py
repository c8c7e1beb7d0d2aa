"""Named model configurations: trainwise's own models and well-known published ones.

The published ones are checked parameter-for-parameter against Hugging Face `transformers`
(tests/test_presets.py). The default model is sized to train on the built-in corpus in a few minutes
on two CPU cores.
"""

from __future__ import annotations

import difflib

from trainwise.config import ModelConfig
from trainwise.errors import TrainwiseError
from trainwise.hf_config import published_presets

DEFAULT_MODEL = "trainwise-small"

PRESETS: dict[str, dict] = {
    # Llama-style: RMSNorm, RoPE, SwiGLU, GQA, no biases, tied embeddings (small vocab).
    # The defaults of ModelConfig are this model.
    "trainwise-small": dict(),
    # GPT-2-style: LayerNorm, learned positions, GELU, biases, tied embeddings.
    "trainwise-gpt2-small": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, activation="gelu_tanh",
                                 norm="layernorm", position="learned", tie_embeddings=True, bias=True,
                                 max_seq_len=256),
    # trainwise-small with every MLP replaced by 8 SwiGLU experts of half its width, top-2 routed:
    # the same active parameters per token (+ the 8H router per layer), 2.6x the total. Trains on the
    # built-in corpus in about the default model's wall time (benchmarks/bench_moe.py).
    "trainwise-moe-small": dict(n_experts=8, top_k=2, expert_ffn_hidden=352),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise TrainwiseError(
            f"unknown model preset '{name}'.{hint} Known presets: {', '.join(preset_names())}."
        )
    return ModelConfig(name=name, **PRESETS[name])


# The published models (GPT-2, Llama, Mistral, Qwen, DeepSeek) are kept as config.json dicts in
# trainwise/hf_config.py and converted once here.
for _name, _kw in published_presets().items():
    PRESETS.setdefault(_name, _kw)
