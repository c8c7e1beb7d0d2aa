"""Multi-head latent attention (DeepSeek-V2/V3) as trainwise builds it: the parameters, FLOPs and saved
bytes the planner counts, the latent KV cache, DeepSeek-V3's routing (choice bias, groups, scaling), a
run on the built-in corpus that resumes bitwise and verifies, and `trainwise plan --model deepseek-v3`."""

import contextlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from trainwise.cli import main
from trainwise.config import ModelConfig, RunConfig, TrainConfig, apply_overrides
from trainwise.cost.flops import flops_per_token_train
from trainwise.cost.memory import kv_cache_bytes, mla_saved_bytes
from trainwise.cost.params import params
from trainwise.cost.recipe import get_recipe
from trainwise.errors import TrainwiseError
from trainwise.measure.flopcount import flop_counter
from trainwise.model import KVCache, Transformer
from trainwise.model.attention import LatentAttention
from trainwise.model.moe import MoE
from trainwise.runtime.parallelize import apply_activation_checkpointing
from trainwise.runtime.step import build_step, random_batches

# DeepSeek-V3's shape, shrunk: every MLA dimension distinct, so that a swapped one shows
MLA = dict(attention="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=8)
# DeepSeek-V3's MoE: a dense layer first, sigmoid routing with a choice bias, shared expert, groups, scaling
V3_MOE = dict(n_experts=8, top_k=2, expert_ffn_hidden=16, n_shared_experts=1, first_dense_layers=1,
              router_gating="sigmoid", router_bias=True, routed_scaling_factor=2.5, router_groups=4,
              router_group_top_k=2)


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=32), **MLA, **kw})


SHAPES = {"dense": dict(), "no q lora": dict(q_lora_rank=0), "v3 moe": V3_MOE, "bias": dict(bias=True)}


@pytest.mark.parametrize("kw", list(SHAPES.values()), ids=list(SHAPES))
def test_parameter_count_matches_planner(kw):
    model = Transformer(tiny(**kw))
    assert all(isinstance(b.attn, LatentAttention) for b in model.blocks)
    assert sum(p.numel() for p in model.parameters()) == params(model.cfg).total
    # the choice bias is a buffer (set by a rule, not by gradients), saved with the weights
    buffers = {n for n, _ in model.named_buffers() if n.endswith("expert_bias")}
    assert len(buffers) == (model.cfg.n_layers - 1 if kw is V3_MOE else 0)
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters(remove_duplicate=False)} | buffers


@pytest.mark.parametrize("kw", list(SHAPES.values()), ids=list(SHAPES))
def test_flop_counter_matches_planner(kw):
    torch.manual_seed(0)
    cfg = tiny(**kw)
    model = Transformer(cfg)
    B, T = 2, 32
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with flop_counter() as counter:
        model(x, x).backward()
    # the hardware count: v padded to the query's head dim for the flash kernel (mla_padding_flops_per_token)
    executed = flops_per_token_train(cfg, T, recompute="none")
    assert counter.get_total_flops() == pytest.approx(executed * B * T, rel=0.001)
    assert executed > flops_per_token_train(cfg, T)  # the model's FLOPs (MFU) leave the padding out


def saved_bytes(attn: torch.nn.Module, x: torch.Tensor, rope: tuple, precision: str) -> int:
    """Unique storages autograd saves in one forward of `attn`, parameters and RoPE tables excluded."""
    skip = {t.untyped_storage().data_ptr() for t in [*attn.parameters(), *rope]}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        attn(x, rope)
    return sum(seen.values())


@pytest.mark.parametrize("kw", [dict(), dict(q_lora_rank=0)], ids=["q lora", "no q lora"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_saved_bytes_per_token_match_the_memory_model(kw, precision, checkpointing):
    """The per-token slope of what one latent attention saves (two token counts, so the per-parameter
    weight casts cancel) equals the memory model's mla_saved_bytes exactly."""
    torch.manual_seed(0)
    cfg = tiny(max_seq_len=256, **kw)
    model = Transformer(cfg)
    if checkpointing == "selective":
        apply_activation_checkpointing(model, "selective")
    attn = model.blocks[0].attn
    measured = []
    for n in (128, 256):
        rope = (model.rope_cos[:n], model.rope_sin[:n])
        x = torch.randn(1, n, cfg.d_model, requires_grad=True) * 1.0  # not a leaf, as the norm's output in a block
        measured.append(saved_bytes(attn, x, rope, precision))
    recipe = get_recipe("fp32" if precision == "fp32" else "amp")
    assert (measured[1] - measured[0]) / 128 == mla_saved_bytes(cfg, recipe, checkpointing)


def test_latent_cache_gives_the_logits_of_full_recompute():
    torch.manual_seed(0)
    cfg = tiny(**V3_MOE)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 20))
    cache = KVCache(cfg, 2, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        full = model(ids)
        steps = [model.lm_head(model.hidden_states(ids[:, :8], cache))]
        steps += [model.lm_head(model.hidden_states(ids[:, t:t + 1], cache)) for t in range(8, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    # the cache holds the latent and the rotated shared key: kv_lora_rank + qk_rope_head_dim per token
    layer = cache.layers[0]
    assert set(layer) == {"latent", "k_rope"}
    assert layer["latent"].shape == (2, cfg.max_seq_len, cfg.kv_lora_rank)
    assert layer["k_rope"].shape == (2, cfg.max_seq_len, 1, cfg.qk_rope_head_dim)
    held = sum(t.numel() * t.element_size() for lay in cache.layers for t in lay.values())
    assert held == kv_cache_bytes(cfg, 2, 4)
    greedy = model.generate(ids[:, :5], 20, temperature=0)
    with torch.no_grad():
        again = ids[:, :5]
        for _ in range(20):
            again = torch.cat([again, model(again)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, again)


def test_group_limited_routing_chooses_within_the_best_groups():
    torch.manual_seed(0)
    cfg = tiny(**V3_MOE)
    moe = MoE(cfg)
    tokens = torch.randn(64, cfg.d_model)
    _, weights, chosen = moe.route(moe.router_logits(tokens))
    per_group = cfg.n_experts // cfg.router_groups
    assert all(len(set((c // per_group).tolist())) <= cfg.router_group_top_k for c in chosen)
    # renormalised top-k weights, times the routed scaling factor
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), cfg.routed_scaling_factor))


def test_the_choice_bias_moves_toward_balance_after_each_step():
    torch.manual_seed(0)
    cfg = tiny(**V3_MOE)
    step = build_step(Transformer(cfg), TrainConfig(), torch.device("cpu"), "fp32")
    batches = random_batches(cfg.vocab_size, 2, 32, 2, torch.device("cpu"))
    moe = step.model.blocks[1].mlp
    loads = []
    original = moe.forward

    def counting(x):
        out = original(x)
        loads.append(moe.last_expert_counts.clone())
        return out

    moe.forward = counting
    step(batches)
    load = torch.stack(loads).sum(0).float()  # both micro-batches
    expected = cfg.router_bias_rate * torch.sign(load.mean() - load)
    assert torch.equal(moe.expert_bias, expected) and expected.abs().sum() > 0


def test_mla_configs_are_checked():
    with pytest.raises(TrainwiseError, match="kv_lora_rank"):
        tiny(kv_lora_rank=0)
    with pytest.raises(TrainwiseError, match="even qk_rope_head_dim"):
        tiny(qk_rope_head_dim=3)
    with pytest.raises(TrainwiseError, match="router_groups"):
        tiny(**{**V3_MOE, "router_groups": 3})


# ---------------------------------------------------------------------------------------------------
# a run of a small DeepSeek-V3-shaped model on the built-in corpus

RUN = ["model.d_model=32", "model.n_layers=3", "model.n_heads=4", "model.max_seq_len=32", "train.seq_len=32",
       "train.micro_batch=4", "tokenizer.vocab_size=300", "train.log_every=1", "train.warmup_steps=2",
       "train.sample_tokens=8", "train.precision=fp32", "train.eval_every=0", "train.checkpoint_every=3",
       "train.max_steps=6", *(f"model.{k}={v!r}".replace("'", '"') for k, v in {**MLA, **V3_MOE}.items())]


def test_a_small_v3_model_trains_resumes_bitwise_and_verifies(tmp_path, calibrated, monkeypatch):
    from trainwise.trainer import accounting as report
    from trainwise.trainer.loop import train

    monkeypatch.setattr(report, "PROBE_MIN_RUN_S", 0.0)
    cfg = apply_overrides(RunConfig(), RUN)
    assert cfg.data.paths == [] and cfg.model.attention == "mla"  # the built-in corpus
    run = tmp_path / "run"
    train(cfg, out=run, quiet=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
    v = json.loads((run / "verify.json").read_text())
    assert abs(v["flops_per_step"]["error"]) < 0.01
    assert abs(v["peak_memory_bytes"]["error"]) < 0.10
    assert v["step_time_s"]["predicted"] > 0
    weights = load_file(run / "checkpoints/step_00000006/model.safetensors")
    assert weights["blocks.1.mlp.expert_bias"].abs().sum() > 0  # balanced after each step, and saved

    shutil.rmtree(run / "checkpoints/step_00000006")  # lose the last checkpoint: steps 4-6 again
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    again = load_file(run / "checkpoints/step_00000006/model.safetensors")
    resumed = [json.loads(r)["loss"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert resumed == [r["loss"] for r in rows]
    assert all(torch.equal(weights[k], again[k]) for k in weights)


# cpu times V3's ~45 matmul shapes on this CPU: under -m slow; the operator model of MLA and MoE on
# this CPU is held by test_a_small_v3_model_trains_resumes_bitwise_and_verifies in the default suite
@pytest.mark.parametrize("device", ["h100-sxm", pytest.param("cpu", marks=pytest.mark.slow)])
def test_plan_deepseek_v3_prints_a_step_time_from_the_operator_model(device, calibrated, capsys):
    assert main(["plan", "--model", "deepseek-v3", "--tokens", "1e12", "--gpu", device, "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["model"]["params_total"] == 671_026_404_352  # transformers' count (tests/test_moe.py)
    assert j["time"]["step_seconds"] > 0 and j["time"]["source"] != "assumed MFU (--mfu)"
