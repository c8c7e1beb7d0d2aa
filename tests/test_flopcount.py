"""The FLOP counter sees every matmul/attention op of a real step and agrees with the planner within 1%."""

import pytest
import torch

from trainwise.config import ModelConfig
from trainwise.cost.flops import flops_per_token_train
from trainwise.measure.flopcount import count_train_step, uncounted_ops
from trainwise.model import Transformer
from trainwise.runtime.parallelize import apply_activation_checkpointing
from trainwise.runtime.step import TrainingStep, random_batches

CPU = torch.device("cpu")
OPTIONS = [("swiglu", "rmsnorm", "rope", False), ("gelu_tanh", "layernorm", "learned", True),
           ("relu", "rmsnorm", "learned", False), ("geglu", "layernorm", "rope", True),
           ("silu", "rmsnorm", "rope", False), ("gelu", "layernorm", "rope", False)]


def tiny(activation="swiglu", norm="rmsnorm", position="rope", bias=False, **kw) -> ModelConfig:
    kw = {"n_kv_heads": 2, **kw}
    return ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                       activation=activation, norm=norm, position=position, bias=bias, **kw)


@pytest.mark.parametrize("activation,norm,position,bias", OPTIONS)
@pytest.mark.parametrize("checkpointing", ["none", "selective", "op", "full"])
def test_counted_step_matches_planner(activation, norm, position, bias, checkpointing):
    cfg = tiny(activation, norm, position, bias)
    torch.manual_seed(0)
    model = Transformer(cfg)
    if checkpointing != "none":
        apply_activation_checkpointing(model, checkpointing)
    batches = random_batches(cfg.vocab_size, 2, 16, 2, CPU)  # grad accumulation K = 2
    counted = count_train_step(TrainingStep(model, torch.optim.AdamW(model.parameters(), foreach=True), CPU, "fp32"),
                               batches)
    predicted = flops_per_token_train(cfg, 16, recompute=checkpointing) * 2 * 16 * 2
    assert counted.total == pytest.approx(predicted, rel=0.01)
    assert counted.by_op["aten._scaled_dot_product_flash_attention_for_cpu"] > 0  # torch alone counts 0


def test_bf16_autocast_and_mha_count_the_same():
    cfg = tiny(n_kv_heads=4)
    torch.manual_seed(0)
    model = Transformer(cfg)
    batches = random_batches(cfg.vocab_size, 2, 16, 1, CPU)
    counted = count_train_step(TrainingStep(model, None, CPU, "bf16"), batches)
    assert counted.total == pytest.approx(flops_per_token_train(cfg, 16) * 32, rel=0.01)


def test_no_heavy_op_without_a_formula():
    cfg = tiny(qk_norm=True)
    torch.manual_seed(0)
    assert uncounted_ops(TrainingStep(Transformer(cfg), None, CPU, "fp32"), random_batches(300, 1, 16, 1, CPU)) == []
