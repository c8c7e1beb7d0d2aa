"""HF config.json -> ModelConfig: parameter counts equal transformers' num_parameters() on the meta device."""

import json

import pytest
import torch

from trainwise.cost.params import params
from trainwise.errors import TrainwiseError
from trainwise.hf_config import PUBLISHED, from_hf_dict, load_hf_config

transformers = pytest.importorskip("transformers")


def hf_count(d: dict, exclude_embeddings: bool = False) -> int:
    cfg = transformers.AutoConfig.for_model(**d)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.num_parameters(exclude_embeddings=exclude_embeddings)


def tiny(family: str) -> dict:
    """Small configs of each family, exercising the structural options (biases, GQA, MoE layout, MLA)."""
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)
    return {
        "llama": dict(model_type="llama", **base, tie_word_embeddings=True),
        "llama-bias": dict(model_type="llama", **base, attention_bias=True, mlp_bias=True),
        "mistral": dict(model_type="mistral", **base),
        "mixtral": dict(model_type="mixtral", **base, num_local_experts=4, num_experts_per_tok=2),
        "qwen2": dict(model_type="qwen2", **base),
        "qwen3": dict(model_type="qwen3", **base, head_dim=16),
        "qwen3_moe": dict(model_type="qwen3_moe", **base, head_dim=16, num_experts=6, num_experts_per_tok=2,
                          moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[]),
        "gpt2": dict(model_type="gpt2", vocab_size=1000, n_embd=64, n_layer=3, n_head=4, n_positions=96),
        "deepseek_v3": dict(model_type="deepseek_v3", **{**base, "num_key_value_heads": 8}, moe_intermediate_size=32,
                            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16, n_group=2, topk_group=1),
        "deepseek_v3-no-qlora": dict(model_type="deepseek_v3", **{**base, "num_key_value_heads": 8},
                                     moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                     n_shared_experts=2, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
                                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1),
    }[family]


FAMILIES = ["llama", "llama-bias", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gpt2", "deepseek_v3",
            "deepseek_v3-no-qlora"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_matches_transformers(family):
    d = tiny(family)
    count = params(from_hf_dict(d))
    assert count.total == hf_count(d)
    assert count.non_embedding == hf_count(d, exclude_embeddings=True)


def test_load_file_and_missing_field(tmp_path):
    d = dict(PUBLISHED["llama-3-8b"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    assert params(load_hf_config(path)).total == 8_030_261_248  # Meta's published 8.03B
    del d["hidden_size"]
    path.write_text(json.dumps(d))
    with pytest.raises(TrainwiseError, match="hidden_size"):
        load_hf_config(path)


def test_unsupported_and_malformed(tmp_path):
    with pytest.raises(TrainwiseError, match="not supported"):
        from_hf_dict({"model_type": "bert"})
    with pytest.raises(TrainwiseError, match="model_type"):
        from_hf_dict({"hidden_size": 8})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(TrainwiseError, match="JSON"):
        load_hf_config(bad)
    with pytest.raises(TrainwiseError, match="divide"):
        from_hf_dict(dict(tiny("llama"), hidden_size=60, num_attention_heads=8, head_dim=None))
