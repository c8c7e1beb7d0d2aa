"""Parameter formulas against hand-worked counts."""

from trainwise.config import ModelConfig
from trainwise.cost.params import linear_params, mha_params, mlp_params, params
from trainwise.presets import get_preset


def test_linear_and_mlp_hand_worked():
    assert linear_params(768, 3072, bias=True) == 768 * 3072 + 3072  # GPT-2 c_fc: 2,362,368
    assert mlp_params(4096, 14336, gated=True, bias=False) == 3 * 4096 * 14336  # Llama-3-8B: 176,160,768
    assert mlp_params(768, 3072, gated=False, bias=True) == 4_722_432


def test_gqa_attention_hand_worked():
    # Llama-3-8B: q 4096x4096, k,v 4096x1024, o 4096x4096 = 41,943,040
    cfg = get_preset("llama-3-8b")
    assert mha_params(cfg) == 2 * 4096 * 4096 + 2 * 4096 * 1024 == 41_943_040


def test_trainwise_small_by_hand():
    # V=4096, H=256, L=4, nh=4, nkv=2, hd=64 (q 256, kv 128), F=ceil(8*256/3/64)*64=704, SwiGLU, RMSNorm, tied.
    emb = 4096 * 256
    attn = 256 * 256 + 2 * 256 * 128 + 256 * 256
    mlp = 3 * 256 * 704
    layer = attn + mlp + 2 * 256
    c = params(ModelConfig())
    assert c.total == emb + 4 * layer + 256 == 4_000_000
    assert c.embedding == emb and c.non_embedding == c.total - emb and c.active == c.total


def test_gpt2_small_by_hand():
    # Radford et al. 2019 "124M": 50257*768 + 1024*768 + 12*(12*768^2 + 13*768) + 2*768 = 124,439,808
    assert params(get_preset("gpt2")).total == 50257 * 768 + 1024 * 768 + 12 * (12 * 768**2 + 13 * 768) + 2 * 768


def test_moe_active_counts_top_k():
    cfg = ModelConfig(n_experts=8, top_k=2, n_shared_experts=1, first_dense_layers=1, tie_embeddings=False)
    c = params(cfg)
    expert = 3 * 256 * cfg.expert_ffn_hidden
    assert c.total - c.active == 3 * (8 - 2) * expert  # 3 MoE layers, 6 unused experts each
    untied = params(ModelConfig(tie_embeddings=False)).total - params(ModelConfig()).total
    assert untied == 4096 * 256
