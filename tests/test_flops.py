"""FLOP formulas: 6ND (Kaplan et al. 2020), per-layer matmul counts (hand-worked), recompute."""

import pytest

from trainwise.config import ModelConfig
from trainwise.cost.flops import (
    attention_core_flops,
    flops_per_token_train,
    forward_flops_per_token,
    matmul_flops,
    six_nd,
)
from trainwise.cost.params import params
from trainwise.presets import get_preset


def test_six_nd_worked_example():
    assert six_nd(1e9, 1e10) == 6e19  # docs/ARCHITECTURE.md, "The worked example"


def test_matmul():
    assert matmul_flops(2, 3, 4) == 48


def test_gpt3_175b_per_token_published():
    # Kaplan et al. 2020 table 1 / Narayanan et al. 2021 eq. 3: forward = 24 L H^2 (1 + T/(6H)) + 2 V H per
    # token (plain 4H MLP, MHA); GPT-3 175B (L=96, H=12288, T=2048, V=50257) -> 3 x that per token trained.
    cfg = ModelConfig(vocab_size=50257, d_model=12288, n_layers=96, n_heads=96, n_kv_heads=0, activation="gelu",
                      position="learned", norm="layernorm", bias=True, max_seq_len=2048)
    L, H, T, V = 96, 12288, 2048, 50257
    expected = 3 * (24 * L * H**2 * (1 + T / (6 * H)) + 2 * V * H)
    assert flops_per_token_train(cfg, T) == pytest.approx(expected, rel=1e-12)


def test_dense_close_to_6n_plus_attention():
    cfg = get_preset("llama-3-8b")
    n = params(cfg)
    attn = 3 * 32 * 4 * 4096 * 32 * 128  # 3 x L x 4 T nh hd
    # 6 x matmul weights: non-embedding params (the LM head counts, the embedding lookup does not) minus
    # the (2L+1) RMSNorm weights, whose O(H) work is not counted
    norms = (2 * 32 + 1) * 4096
    assert flops_per_token_train(cfg, 4096) == 6 * (n.non_embedding - norms) + attn


def test_moe_uses_active():
    cfg = get_preset("mixtral-8x7b")
    n = params(cfg)
    # active non-embedding 6N plus router 6*H*E per layer plus attention core
    norms = (2 * 32 + 1) * 4096
    expected = 6 * (n.active - n.embedding - norms) + 3 * 32 * (4 * 4096 * 32 * 128)
    assert flops_per_token_train(cfg, 4096) == expected
    assert flops_per_token_train(cfg, 4096) < 6 * n.total


def test_causal_halving_and_recompute():
    cfg = ModelConfig()
    fwd = forward_flops_per_token(cfg, 256)
    assert attention_core_flops(cfg, 256, causal_halving=True) * 2 == attention_core_flops(cfg, 256)
    base = flops_per_token_train(cfg, 256)
    # full: blocks again, no LM head, and not each MLP's down projection 2FH (torch's checkpoint stops
    # recomputing once every saved tensor is back; that last matmul saves none)
    down = cfg.n_layers * 2 * cfg.ffn_hidden * cfg.d_model
    assert flops_per_token_train(cfg, 256, recompute=True) == base + fwd.blocks - down
    assert flops_per_token_train(cfg, 256, recompute="selective") == base + fwd.attention_core
    assert fwd.embedding == 0
    assert flops_per_token_train(cfg, 256, causal_halving=True) == base - 3 * fwd.attention_core / 2
