"""Sparse Mixture-of-Experts: equals its dense block in the degenerate case, routes gradients, balances,
drops by capacity, rejects bad configs, and agrees with the planner's parameter and FLOP counts."""

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainwise.config import ModelConfig, RunConfig, apply_overrides
from trainwise.cost.flops import flops_per_token_train
from trainwise.cost.params import params
from trainwise.errors import TrainwiseError
from trainwise.measure.flopcount import flop_counter
from trainwise.model import Transformer
from trainwise.model.layers import MLP
from trainwise.model.moe import MoE, load_balancing_loss, router_z_loss
from trainwise.presets import get_preset
from trainwise.runtime.parallelize import apply_activation_checkpointing

DISPATCH = [None, False]  # MoE.grouped_mm: None = torch._grouped_mm where usable, False = loop over experts


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, n_experts=4,
                top_k=2, expert_ffn_hidden=48)
    base.update(kw)
    return ModelConfig(**base)


def set_dispatch(model: torch.nn.Module, grouped_mm) -> None:
    for m in model.modules():
        if isinstance(m, MoE):
            m.grouped_mm = grouped_mm


@pytest.mark.parametrize("grouped_mm", DISPATCH)
@pytest.mark.parametrize("kw", [dict(), dict(renormalize_top_k=False), dict(router_gating="sigmoid"),
                                dict(activation="gelu", bias=True), dict(activation="geglu", bias=True)])
def test_all_experts_identical_and_uniform_router_equals_dense(kw, grouped_mm):
    """top_k == n_experts, zero router weights (uniform weights 1/E), each expert a copy of a dense MLP:
    the weighted sum of E identical outputs is the dense MLP's output."""
    torch.manual_seed(0)
    cfg = tiny(top_k=4, **kw)
    dense = MLP(cfg, hidden=cfg.expert_ffn_hidden)
    moe = MoE(cfg)
    moe.grouped_mm = grouped_mm
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.experts_fc.weight.copy_(dense.fc.weight.T.expand_as(moe.experts_fc.weight))
        moe.experts_proj.weight.copy_(dense.proj.weight.T.expand_as(moe.experts_proj.weight))
        if cfg.bias:
            moe.experts_fc.bias.copy_(dense.fc.bias.expand_as(moe.experts_fc.bias))
            moe.experts_proj.bias.copy_(dense.proj.bias.expand_as(moe.experts_proj.bias))
    x = torch.randn(3, 16, cfg.d_model)
    torch.testing.assert_close(moe(x), dense(x), rtol=1e-5, atol=1e-6)
    assert moe.last_expert_counts.tolist() == [48] * 4 and moe.last_dropped == 0


@pytest.mark.parametrize("grouped_mm", DISPATCH)
@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_gradients_reach_router_and_exactly_the_selected_experts(gating, grouped_mm):
    torch.manual_seed(0)
    cfg = tiny(n_experts=8, top_k=2, n_shared_experts=1, router_gating=gating, aux_loss_coef=0.0)
    moe = MoE(cfg)
    moe.grouped_mm = grouped_mm
    x = torch.randn(1, 3, cfg.d_model)  # 3 tokens x top-2: at least 2 of the 8 experts get no token
    moe(x).square().sum().backward()  # the output alone: the router learns through the combine weights
    counts = moe.last_expert_counts
    assert (counts == 0).any() and (counts > 0).any()
    assert moe.router.weight.grad.abs().sum() > 0
    for grad in (moe.experts_fc.weight.grad, moe.experts_proj.weight.grad):
        per_expert = grad.abs().flatten(1).sum(dim=1)
        assert ((per_expert > 0) == (counts > 0)).all(), (per_expert, counts)
    assert all(p.grad.abs().sum() > 0 for p in moe.shared.parameters())


def test_aux_loss_reaches_the_router_and_is_counted_in_training_only():
    torch.manual_seed(0)
    cfg = tiny(aux_loss_coef=0.5, z_loss_coef=0.1)
    moe = MoE(cfg)
    x = torch.randn(2, 8, cfg.d_model)
    moe(x)
    logits = moe.router_logits(x.reshape(-1, cfg.d_model))
    probs = logits.softmax(-1)
    expected = 0.5 * load_balancing_loss(probs, moe.last_expert_counts, 2) + 0.1 * router_z_loss(logits)
    torch.testing.assert_close(moe.last_aux_loss, expected)
    moe.last_aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    moe.eval()
    moe(x)
    assert moe.last_aux_loss == 0.0  # validation loss stays pure cross-entropy


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=50), min_size=2, max_size=16).filter(lambda c: sum(c) > 0))
def test_balancing_loss_is_minimised_by_a_uniform_assignment(counts):
    """Router probabilities that follow the load (P = f): E sum f_i^2 >= 1 (Cauchy-Schwarz), with
    equality only for the uniform assignment."""
    counts = torch.tensor(counts)
    E, N = len(counts), int(counts.sum())
    fraction = counts.double() / N
    loss = load_balancing_loss(fraction.expand(N, E), counts, top_k=1)
    uniform = load_balancing_loss(torch.full((N * E, E), 1 / E, dtype=torch.double),
                                  torch.full((E,), N), top_k=1)
    assert uniform.item() == pytest.approx(1.0)
    assert loss.item() >= uniform.item() - 1e-9
    if len(set(counts.tolist())) > 1:
        assert loss.item() > 1.0 + 1e-9


def test_minimising_the_balancing_loss_spreads_a_collapsed_router():
    """From a router that sends every token to expert 0, a few steps on the balancing loss alone
    bring the load near uniform and the loss near its minimum 1."""
    torch.manual_seed(0)
    cfg = tiny(n_experts=4, top_k=1, aux_loss_coef=1.0)
    moe = MoE(cfg)
    x = torch.randn(1, 256, cfg.d_model) + 1.0
    with torch.no_grad():
        moe.router.weight[0] = 0.3  # every token's logit for expert 0 is about 0.3 * 32 larger
    moe(x)
    start = moe.last_expert_counts.clone()
    opt = torch.optim.Adam(moe.router.parameters(), lr=0.01)
    for _ in range(100):
        moe(x)
        opt.zero_grad()
        moe.last_aux_loss.backward()
        opt.step()
    moe(x)
    assert start.tolist() == [256, 0, 0, 0]
    assert moe.last_expert_counts.max() < 1.25 * 256 / 4, moe.last_expert_counts
    assert moe.last_aux_loss.item() < 1.05


def test_router_z_loss_of_uniform_logits():
    assert router_z_loss(torch.zeros(5, 8)).item() == pytest.approx(math.log(8) ** 2)


@pytest.mark.parametrize("grouped_mm", DISPATCH)
def test_capacity_drops_assignments_past_capacity_in_token_order(grouped_mm):
    torch.manual_seed(0)
    cfg = tiny(n_experts=4, top_k=1, dropless=False, capacity_factor=0.5)
    moe = MoE(cfg)
    moe.grouped_mm = grouped_mm
    x = torch.randn(1, 32, cfg.d_model)
    y = moe(x)
    capacity = math.ceil(0.5 * 32 * 1 / 4)  # 4 per expert, 16 of the 32 tokens at most
    counts = moe.last_expert_counts
    assert moe.last_dropped == int((counts - capacity).clamp(min=0).sum()) >= 16
    chosen = moe.router_logits(x[0]).argmax(-1)  # top-1 choice per token
    rank = torch.stack([(chosen[:t] == chosen[t]).sum() for t in range(32)])  # earlier tokens go first
    dropped = rank >= capacity
    assert int(dropped.sum()) == moe.last_dropped
    assert (y[0, dropped] == 0).all() and (y[0, ~dropped].abs().sum(-1) > 0).all()
    moe.dropless = True
    moe(x)
    assert moe.last_dropped == 0


def test_bad_moe_configs_raise_clear_errors():
    with pytest.raises(TrainwiseError, match="top_k = 5 must be between 1 and model.n_experts = 4"):
        ModelConfig(n_experts=4, top_k=5)
    with pytest.raises(TrainwiseError, match="top_k is set but model.n_experts = 0"):
        ModelConfig(n_experts=0, top_k=2)
    with pytest.raises(TrainwiseError, match="top_k = 0 must be between 1"):
        ModelConfig(n_experts=4, top_k=0)
    with pytest.raises(TrainwiseError, match="n_experts = -1 must not be negative"):
        ModelConfig(n_experts=-1)
    for factor in (0.0, -1.0):
        with pytest.raises(TrainwiseError, match="capacity_factor"):
            ModelConfig(n_experts=4, top_k=2, dropless=False, capacity_factor=factor)
    with pytest.raises(TrainwiseError, match="top_k = 9"):
        apply_overrides(RunConfig(), ["model.n_experts=8", "model.top_k=9"])


def test_zero_experts_means_dense():
    cfg = ModelConfig(n_experts=0, top_k=0)
    assert not cfg.is_moe and not any(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    assert not any(isinstance(m, MoE) for m in Transformer(tiny(n_experts=0, top_k=0)).modules())


@pytest.mark.parametrize("kw", [dict(), dict(n_shared_experts=2, first_dense_layers=1),
                                dict(bias=True, activation="gelu", norm="layernorm", n_shared_experts=2),
                                dict(router_bias=True, router_gating="sigmoid", moe_every=2, n_layers=3),
                                dict(tie_embeddings=False, n_experts=6, top_k=6)])
def test_parameter_count_matches_planner(kw):
    model = Transformer(tiny(**kw))
    assert sum(p.numel() for p in model.parameters()) == params(model.cfg).total
    # tied weights saved once; router_bias's choice bias is a buffer (set by a rule), saved beside them
    saved = {t.data_ptr(): t.numel() for name, t in model.state_dict().items() if not name.endswith("expert_bias")}
    assert sum(saved.values()) == params(model.cfg).total


@pytest.mark.parametrize("grouped_mm", DISPATCH)
@pytest.mark.parametrize("kw", [dict(), dict(n_shared_experts=1, first_dense_layers=1, router_gating="sigmoid"),
                                dict(activation="gelu", n_experts=8, top_k=3)])
def test_flop_counter_matches_planner(kw, grouped_mm):
    """The one FLOP counter's count of one forward+backward (dropless, grouped matmuls or the loop over
    experts) equals the planner's training FLOPs per token x tokens."""
    torch.manual_seed(0)
    cfg = tiny(**kw)
    model = Transformer(cfg)
    set_dispatch(model, grouped_mm)
    B, T = 2, 32
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with flop_counter() as counter:
        model(x, x).backward()
    assert counter.get_total_flops() == pytest.approx(flops_per_token_train(cfg, T) * B * T, rel=0.01)


def test_grouped_and_looped_dispatch_agree_in_bf16_autocast():
    torch.manual_seed(0)
    cfg = tiny(n_shared_experts=1, bias=True)
    moe = MoE(cfg)
    x = torch.randn(2, 16, cfg.d_model)
    outs = []
    for grouped_mm in DISPATCH:
        moe.grouped_mm = grouped_mm
        moe.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe(x)
        y.float().square().sum().backward()
        outs.append((y, moe.experts_fc.weight.grad.clone()))
    assert outs[0][0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=2e-2, atol=1e-3)


def test_padded_groups_place_each_row_in_its_experts_padded_group():
    """padded_groups: counts (3, 0, 17, 5) padded to 16 -> (16, 0, 32, 16), each grouped row at its place in
    its expert's padded group; pad_multiple: 1/64 of the rows, a multiple of 16, 16 at least."""
    from trainwise.model.moe import pad_multiple, padded_groups

    padded, rows = padded_groups(torch.tensor([3, 0, 17, 5]), 16)
    assert padded.tolist() == [16, 0, 32, 16]
    assert rows.tolist() == [0, 1, 2, *range(16, 33), *range(48, 53)]
    assert [pad_multiple(n) for n in (100, 1024, 2048, 4096, 5000)] == [16, 16, 32, 64, 80]


def test_padded_grouped_matmuls_equal_the_groups_as_routed(monkeypatch):
    """A CPU's bf16 grouped matmuls pad each expert's group with zero rows (moe.GROUP_SIZES): outputs and
    every gradient equal the unpadded call's, bias included; under a dispatch mode (the FLOP counter) the
    groups run as routed, so the counted FLOPs are the model's."""
    from trainwise.model import moe as moe_module

    torch.manual_seed(0)
    cfg = tiny(n_experts=8, top_k=2, bias=True, d_model=64, expert_ffn_hidden=64)
    layer = MoE(cfg)
    x = torch.randn(2, 24, cfg.d_model)
    assert moe_module.pads_groups("cpu", torch.bfloat16) and not moe_module.pads_groups("cpu", torch.float32)
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm",
                        lambda a, b, offs: calls.append(a.shape[0]) or grouped_mm(a, b, offs=offs))
    outs = []
    for pad in (True, False):
        monkeypatch.setattr(moe_module, "pads_groups", lambda device, dtype, pad=pad: pad)
        layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().sum().backward()
        outs.append([y, *(p.grad.clone() for p in (layer.experts_fc.weight, layer.experts_fc.bias,
                                                   layer.experts_proj.weight, layer.router.weight))])
    assert calls[0] > 2 * 24 * 2 and calls[0] % 16 == 0 and calls[-1] == 2 * 24 * 2  # padded, then as routed
    for padded, routed in zip(*outs):
        torch.testing.assert_close(padded, routed)
    monkeypatch.undo()

    def counted() -> int:
        with flop_counter() as counter, torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x).float().sum().backward()
        return counter.get_total_flops()

    as_counted = counted()
    monkeypatch.setattr(moe_module, "pads_groups", lambda device, dtype: True)
    padded = counted()
    monkeypatch.setattr(moe_module, "pads_groups", lambda device, dtype: False)
    assert as_counted == counted() < padded  # the counter sees the groups as routed, not the padding


def test_activation_checkpointing_keeps_the_aux_loss_gradient():
    torch.manual_seed(0)
    cfg = tiny(aux_loss_coef=0.1, z_loss_coef=0.01)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    grads = []
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = Transformer(cfg)
        apply_activation_checkpointing(model, mode)
        model(x, x).backward()
        grads.append(model.blocks[0].mlp.router.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_moe_small_preset_matches_the_dense_default_in_active_parameters():
    moe, dense = params(get_preset("trainwise-moe-small")), params(get_preset("trainwise-small"))
    assert dense.total <= moe.active <= 1.01 * dense.total
    assert moe.total > 2 * dense.total


# ---------------------------------------------------------------------------------------------------
# Published MoE models: total and active counts equal transformers' modules

import transformers

MODEL_CARD_ACTIVE_B = {"mixtral-8x7b": 12.9, "qwen3-30b-a3b": 3.3, "qwen3-235b-a22b": 22, "deepseek-v3": 37}


def hf_total_and_active(name: str) -> tuple[int, int]:
    """transformers' num_parameters(), and that minus the routed experts a token does not use: each
    MoE layer's stacked expert tensors (mlp.experts.*) scaled by (E - k) / E."""
    from trainwise.hf_config import PUBLISHED

    hf_cfg = transformers.AutoConfig.for_model(**PUBLISHED[name])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    cfg = get_preset(name)
    unused = 0
    for pname, p in model.named_parameters():
        if ".mlp.experts." in pname:
            assert p.shape[0] == cfg.n_experts, pname
            unused += p.numel() // cfg.n_experts * (cfg.n_experts - cfg.top_k)
    total = model.num_parameters()
    return total, total - unused


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b",
                                  pytest.param("qwen3-235b-a22b", marks=pytest.mark.slow),
                                  pytest.param("deepseek-v3", marks=pytest.mark.slow)])
def test_published_moe_total_and_active_equal_transformers(name):
    total, active = hf_total_and_active(name)
    count = params(get_preset(name))
    assert (count.total, count.active) == (total, active)
    assert count.active / 1e9 == pytest.approx(MODEL_CARD_ACTIVE_B[name], rel=0.02)  # cards round (3.35 -> 3.3)


# ---------------------------------------------------------------------------------------------------
# Training for real

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32",
        "train.seq_len=32", "train.micro_batch=4", "tokenizer.vocab_size=300", "train.eval_every=0",
        "train.log_every=1", "train.warmup_steps=2", "train.sample_tokens=0", "train.precision=fp32",
        "train.checkpoint_every=0", "model.n_experts=4", "model.top_k=2", "model.expert_ffn_hidden=32",
        "model.n_shared_experts=1", "model.first_dense_layers=1"]


def test_training_a_tiny_moe_lowers_the_loss_and_logs_expert_counts(tmp_path, isolated_cache):
    from pydoc_data.topics import topics

    from trainwise.trainer.loop import train

    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n\n".join(topics[k] for k in sorted(topics))[:30_000], encoding="utf-8")
    cfg = apply_overrides(RunConfig(), TINY + [f"data.paths=['{corpus}']", "train.max_steps=15"])
    out = tmp_path / "run"
    train(cfg, out=out, quiet=True)
    rows = [json.loads(line) for line in Path(out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 15
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3])
    counts = rows[-1]["expert_tokens"]  # the trainer logs MoE.last_expert_counts by layer index
    assert list(counts) == ["1"]  # layer 0 is dense (first_dense_layers = 1)
    assert len(counts["1"]) == 4 and sum(counts["1"]) == 4 * 32 * 2  # micro_batch x seq_len x top_k


def test_training_with_a_capacity_limit_reports_dropped_assignments(tmp_path, corpus):
    from trainwise.trainer.loop import train

    # capacity factor 0.5: each expert takes at most half its even share, so some assignments drop
    cfg = apply_overrides(RunConfig(), TINY + [f"data.paths=['{corpus}']", "train.max_steps=3",
                                                "model.dropless=false", "model.capacity_factor=0.5"])
    out = tmp_path / "run"
    train(cfg, out=out, quiet=True)
    rows = [json.loads(line) for line in Path(out / "metrics.jsonl").read_text().splitlines()]
    dropped = rows[-1]["expert_dropped"]
    assert list(dropped) == ["1"] and dropped["1"] > 0
