"""The chunked cross-entropy equals F.cross_entropy (loss and gradients), and the planner's memory and
FLOP formulas describe it: tracked peak within 10%, counted FLOPs within 1%."""

import pytest
import torch
import torch.nn.functional as F

from trainwise.config import ModelConfig, TrainConfig
from trainwise.cost.flops import flops_per_token_train
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import Machine, Run
from trainwise.errors import TrainwiseError
from trainwise.measure.flopcount import count_train_step
from trainwise.measure.memtrack import track_train_step
from trainwise.model import Transformer
from trainwise.model.loss import chunked_cross_entropy
from trainwise.planner.plan import plan_run
from trainwise.runtime.optim import build_optimizer
from trainwise.runtime.step import TrainingStep, random_batches

CPU = torch.device("cpu")


def inputs(n=37, h=16, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (0.5 * torch.randn(v, h, generator=g)).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def grads(loss_fn, hidden, weight, targets):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, targets)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def plain(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.T).float(), targets)


@pytest.mark.parametrize("chunk", [1, 8, 10, 37, 1000])  # 37 % 8 != 0; 1000 > N
def test_loss_and_grads_equal_plain_fp32(chunk):
    h, w, t = inputs()
    want = grads(plain, h, w, t)
    got = grads(lambda *a: chunked_cross_entropy(*a, chunk), h, w, t)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_tied_weight_gradient_accumulates():
    """Weight used by an embedding lookup and by the loss, as with tie_embeddings: both gradients add."""
    _, w, t = inputs()
    ids = torch.randint(0, w.shape[0], (37,), generator=torch.Generator().manual_seed(1))

    def tied(loss_fn):
        w.grad = None
        hidden = torch.tanh(F.embedding(ids, w))
        loss_fn(hidden, w, t).backward()
        return w.grad.clone()

    torch.testing.assert_close(tied(lambda *a: chunked_cross_entropy(*a, 8)), tied(plain), rtol=1e-5, atol=1e-6)


def test_bf16_autocast_close_to_plain():
    h, w, t = inputs(n=64, h=32, v=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(h, w, t, 16)
        ref = F.cross_entropy(F.linear(h, w).float(), t)  # the model's plain path under autocast
    assert loss.dtype == torch.float32
    loss.backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32
    got_h, got_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-3)
    torch.testing.assert_close(got_h, h.grad, rtol=0.05, atol=2e-3)
    torch.testing.assert_close(got_w, w.grad, rtol=0.05, atol=2e-3)


def test_bad_chunk_is_rejected():
    with pytest.raises(ValueError):
        chunked_cross_entropy(*inputs(), 0)
    with pytest.raises(TrainwiseError):
        ModelConfig(loss_chunk_tokens=-1)


def small(chunk: int, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                       loss_chunk_tokens=chunk, **kw)


@pytest.mark.parametrize("tie", [True, False])
def test_transformer_step_matches_plain(tie):
    """One AdamW step of the same model with plain and chunked loss: same loss, same new weights."""
    batches = random_batches(512, 2, 32, 1, CPU)
    out = {}
    for chunk in (0, 24):  # 64 tokens: chunks of 24, 24, 16
        torch.manual_seed(0)
        model = Transformer(small(chunk, tie_embeddings=tie))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = TrainingStep(model, opt, CPU, "fp32")(batches).loss
        after = model(*batches[0]).detach()
        out[chunk] = (loss, after, [p.detach().clone() for p in model.parameters()])
    assert out[24][0].item() == pytest.approx(out[0][0].item(), abs=1e-5)
    assert out[24][1].item() == pytest.approx(out[0][1].item(), abs=1e-5)
    for a, b in zip(out[24][2], out[0][2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tracked_peak_matches_planner(precision):
    cfg = small(16)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = build_optimizer(model, TrainConfig())
    batches = random_batches(cfg.vocab_size, 2, 32, 1, CPU)
    TrainingStep(model, opt, CPU, precision)(batches)
    tracked = track_train_step(TrainingStep(model, opt, CPU, precision), batches)
    recipe = get_recipe("fp32" if precision == "fp32" else "amp")
    plan = plan_run(Run(cfg, micro_batch=2, seq_len=32, recipe=recipe, tokens=1, machine=Machine(peak_flops=1e12)))
    assert tracked.activations == pytest.approx(plan.activations_bytes, rel=0.01)
    assert tracked.peak_bytes == pytest.approx(plan.peak_bytes, rel=0.10)


def test_large_vocab_peak_matches_planner_and_drops():
    """Where the logits dominate (V = 4096, 2048 tokens) the chunked peak is a quarter of the plain one,
    and the planner follows both."""
    peaks = {}
    for chunk in (0, 64):
        cfg = ModelConfig(vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                          loss_chunk_tokens=chunk)
        torch.manual_seed(0)
        model = Transformer(cfg)
        opt = build_optimizer(model, TrainConfig())
        batches = random_batches(cfg.vocab_size, 64, 32, 1, CPU)
        TrainingStep(model, opt, CPU, "fp32")(batches)
        tracked = track_train_step(TrainingStep(model, opt, CPU, "fp32"), batches)
        plan = plan_run(Run(cfg, micro_batch=64, seq_len=32, recipe=get_recipe("fp32"), tokens=1,
                            machine=Machine(peak_flops=1e12)))
        assert tracked.peak_bytes == pytest.approx(plan.peak_bytes, rel=0.10)
        peaks[chunk] = tracked.peak_bytes
    assert peaks[64] < 0.5 * peaks[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_counted_flops_include_the_head_recompute(precision, checkpointing):
    from trainwise.runtime.parallelize import apply_activation_checkpointing

    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                      loss_chunk_tokens=7)
    torch.manual_seed(0)
    model = Transformer(cfg)
    if checkpointing != "none":
        apply_activation_checkpointing(model, checkpointing)
    batches = random_batches(cfg.vocab_size, 2, 16, 2, CPU)
    counted = count_train_step(TrainingStep(model, None, CPU, precision), batches)
    tokens = 2 * 16 * 2
    assert counted.total == pytest.approx(flops_per_token_train(cfg, 16, recompute=checkpointing) * tokens, rel=0.01)
    model_flops = flops_per_token_train(cfg, 16) * tokens  # MFU keeps 6HV for the head
    assert counted.total - model_flops >= 2 * 32 * 300 * tokens
