"""The Transformer itself: every option runs, gradients are right, generation is consistent."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from trainwise.config import ModelConfig, TrainConfig
from trainwise.model import Transformer
from trainwise.model.layers import apply_rope, rope_tables
from trainwise.runtime.optim import build_optimizer, lr_at
from trainwise.runtime.parallelize import apply_activation_checkpointing


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


def batch(cfg, b=3, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]


@pytest.mark.parametrize("activation,norm,position", list(itertools.product(
    ["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu"], ["layernorm", "rmsnorm"], ["rope", "learned"])))
def test_every_option_runs_forward_and_backward(activation, norm, position):
    torch.manual_seed(0)
    cfg = tiny(activation=activation, norm=norm, position=position, bias=norm == "layernorm")
    model = Transformer(cfg)
    x, y = batch(cfg)
    logits = model(x)
    assert logits.shape == (3, 16, cfg.vocab_size)
    loss = model(x, y)
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.3  # near-uniform at init
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def reference_attention(attn, cfg: ModelConfig, x: torch.Tensor, qk_norm: bool | None = None) -> torch.Tensor:
    """Causal attention written out head by head from the module's own weights: q, k and v from its qkv
    matmul (nh, nkv, nkv heads, in that order), each q and k head RMS-normed when qk_norm, RoPE in its
    reference form, and query head h reading key/value head h // (nh / nkv) (GQA's sharing)."""
    T, nh, nkv, hd = x.shape[1], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = (t.unflatten(-1, (-1, hd)).transpose(1, 2)  # (B, heads, T, hd)
               for t in F.linear(x, attn.qkv.weight, attn.qkv.bias).split([nh * hd, nkv * hd, nkv * hd], -1))
    if cfg.qk_norm if qk_norm is None else qk_norm:
        q = F.rms_norm(q, (hd,), attn.q_norm.weight, cfg.norm_eps)
        k = F.rms_norm(k, (hd,), attn.k_norm.weight, cfg.norm_eps)
    cos, sin = rope_tables(hd, T, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    heads = []
    for h in range(nh):
        g = h // (nh // nkv)
        scores = (q[:, h] @ k[:, g].transpose(-1, -2)) * hd ** -0.5
        heads.append(scores.masked_fill(future, float("-inf")).softmax(-1) @ v[:, g])
    return attn.out(torch.cat(heads, dim=-1))


def check_kv_heads(model, cfg, x):
    """MQA (one key/value head for all four query heads) and MHA (one each): the qkv matmul makes nkv key
    and value heads, and each query head reads its group's (reference_attention; a model that kept the
    default two would have another qkv width and pair the heads otherwise)."""
    attn = model.blocks[0].attn
    assert attn.n_kv_heads == cfg.n_kv_heads
    assert attn.qkv.out_features == (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim


def check_qk_norm_and_qkv_bias(model, cfg, x):
    """Qwen's variants: biases on the q/k/v matmul only (not on the output projection), an RMSNorm on each
    q and k head whose weights count; without the norm the block computes something else."""
    attn = model.blocks[0].attn
    assert attn.qkv.bias is not None and attn.out.bias is None
    assert attn.q_norm is not None and attn.k_norm is not None
    with torch.no_grad():
        want = attn(x, rope_of(model, x))
        assert (want - reference_attention(attn, cfg, x, qk_norm=False)).abs().max() > 100 * TOL["atol"]


def check_untied_head(model, cfg, x):
    """An LM head of its own: logits are the final hidden states times the head's weights, not the token
    table's, and the two get different gradients."""
    assert model.lm_head.weight is not model.embed.weight
    assert model.lm_head.weight.grad is not None and model.embed.weight.grad is not None
    assert not torch.equal(model.lm_head.weight.grad, model.embed.weight.grad)
    ids, _ = batch(cfg)
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        torch.testing.assert_close(model(ids), hidden @ model.lm_head.weight.T)
        assert (model(ids) - hidden @ model.embed.weight.T).abs().max() > 1e-3


def check_dropout(model, cfg, x):
    """Dropout in training only: two training forwards draw different masks (the same seed, the same
    ones), attention's own dropout included; in eval the model is the same weights without dropout."""
    ids, _ = batch(cfg)
    model.train()
    torch.manual_seed(1)
    first = model(ids)
    torch.manual_seed(1)
    assert torch.equal(model(ids), first)
    assert not torch.equal(model(ids), first), "no dropout in training"
    attn, rope = model.blocks[0].attn, rope_of(model, x)
    assert not torch.equal(attn(x, rope), attn(x, rope)), "no dropout in attention"
    plain = Transformer(tiny()).eval()
    plain.load_state_dict(model.state_dict())
    model.eval()
    torch.testing.assert_close(model(ids), plain(ids))


def rope_of(model, x):
    return model.rope_cos[:x.shape[1]], model.rope_sin[:x.shape[1]]


TOL = dict(rtol=1e-5, atol=1e-6)
VARIANTS = {"mqa": (dict(n_kv_heads=1), check_kv_heads), "mha": (dict(n_kv_heads=4), check_kv_heads),
            "qk_norm_qkv_bias": (dict(qk_norm=True, qkv_bias=True), check_qk_norm_and_qkv_bias),
            "untied": (dict(tie_embeddings=False), check_untied_head), "dropout": (dict(dropout=0.1), check_dropout)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_variants(variant):
    """Each variant trains from a uniform start (loss near ln V, a finite non-zero gradient on every
    parameter), has the parameters the planner counts, stays causal, and its first block's attention is
    the head-by-head reference; then what the variant is for (VARIANTS' check)."""
    from trainwise.cost.params import params

    kw, check = VARIANTS[variant]
    torch.manual_seed(0)
    cfg = tiny(**kw)
    model = Transformer(cfg)
    ids, targets = batch(cfg)
    loss = model(ids, targets)
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - math.log(cfg.vocab_size)) < 0.3
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert sum(p.numel() for p in model.parameters()) == params(cfg).total

    model.eval()
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab_size
    with torch.no_grad():
        logits, after = model(ids), model(changed)
    torch.testing.assert_close(logits[:, :10], after[:, :10])  # the past does not see the future
    assert (logits[:, 10:] - after[:, 10:]).abs().max() > 1e-3  # and the comparison can tell

    # Init leaves biases at zero and norm weights at one, where a forward that skipped them would still
    # match the reference: draw them at random first.
    attn = model.blocks[0].attn
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "bias" in name or "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape))
    x = torch.randn(2, 12, cfg.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, rope_of(model, x)), reference_attention(attn, cfg, x), **TOL)
    check(model, cfg, x)


def test_parameter_count_matches_planner():
    from trainwise.cost.params import params

    for kw in [dict(), dict(activation="gelu", norm="layernorm", position="learned", bias=True),
               dict(tie_embeddings=False, qk_norm=True, qkv_bias=True)]:
        cfg = tiny(**kw)
        assert sum(p.numel() for p in Transformer(cfg).parameters()) == params(cfg).total


def test_causal_attention_ignores_the_future():
    torch.manual_seed(0)
    cfg = tiny()
    model = Transformer(cfg).eval()
    x, _ = batch(cfg)
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(x)[:, :10], model(changed)[:, :10])


def test_gradient_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    cfg = tiny()
    model = Transformer(cfg)
    x, y = batch(cfg, b=8)
    model(x, y).backward()
    big = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    k = 4
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        (model(xs, ys) / k).backward()
    for g_big, p in zip(big, model.parameters()):
        torch.testing.assert_close(p.grad, g_big, rtol=1e-5, atol=1e-6)


def wrapped_copy_has_the_same_gradients(wrap, rtol: float, atol: float):
    """A tiny model and a copy that `wrap` changed in place: the same state-dict keys and the same
    gradients on one batch. Returns (plain, wrapped, x)."""
    torch.manual_seed(0)
    cfg = tiny()
    plain, wrapped = Transformer(cfg), Transformer(cfg)
    wrapped.load_state_dict(plain.state_dict())
    wrap(wrapped)
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    x, y = batch(cfg)
    plain(x, y).backward()
    wrapped(x, y).backward()
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=atol)
    return plain, wrapped, x


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    wrapped_copy_has_the_same_gradients(lambda m: apply_activation_checkpointing(m, mode), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_one_optimizer_step_lowers_the_loss(optimizer):
    torch.manual_seed(0)
    cfg = tiny()
    model = Transformer(cfg)
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer, lr=1e-2 if optimizer == "adamw" else 0.5))
    x, y = batch(cfg)
    before = model(x, y)
    before.backward()
    opt.step()
    with torch.no_grad():
        after = model(x, y)
    assert after.item() < before.item() - 1e-3


def test_no_weight_decay_on_norms_biases_and_embeddings():
    cfg = tiny(bias=True, norm="layernorm", position="learned")
    model = Transformer(cfg)
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    for name, p in model.named_parameters():
        expect = p.ndim == 2 and "embed" not in name
        assert (id(p) in decayed) == expect, name


def test_adamw_is_fused_on_cpu_and_cuda():
    opt = build_optimizer(Transformer(tiny()), TrainConfig())
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    if torch.cuda.is_available():
        opt = build_optimizer(Transformer(tiny()).cuda(), TrainConfig())
        assert opt.defaults["fused"] is True and not opt.defaults["foreach"]


@pytest.mark.parametrize("kernel", ["foreach", "fused"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_step_is_skipped_when_the_gradient_is_not_finite(optimizer, kernel):
    """Both paths of step_if_finite: the host check (foreach, e.g. parameters on other devices) and the
    on-device found_inf flag of the fused kernels (trainwise's optimizer on CPU and CUDA)."""
    from trainwise.runtime.optim import param_groups, step_if_finite

    torch.manual_seed(0)
    cfg = tiny()
    model = Transformer(cfg)
    cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    extra = {"momentum": 0.9} if optimizer == "sgd" else {}
    opt = cls(param_groups(model, 0.1), lr=1e-2, **{kernel: True}, **extra)
    x, y = batch(cfg)
    model(x, y).backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert step_if_finite(opt, torch.tensor(1.0)).item() == 0.0  # a finite norm: a normal step
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    states = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    model(x, y).backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    assert step_if_finite(opt, torch.tensor(float("nan"))).item() == 1.0
    for k, v in model.state_dict().items():  # weights, moments and step counts untouched
        assert torch.equal(v, before[k]), k
    for old, new in zip(states, opt.state.values()):
        for k in old:
            assert torch.equal(old[k], new[k]), k
    assert not hasattr(opt, "found_inf")


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # halfway through the cosine: (1 + 0.1) / 2
    assert lr_at(110, cfg) == pytest.approx(0.1)


def test_two_layer_model_overfits_a_tiny_text():
    from trainwise.tokenizer import Tokenizer

    text = "the quick brown fox jumps over the lazy dog. " * 4
    tok = Tokenizer.train([text], vocab_size=300)
    ids = torch.tensor([tok.encode(text)])
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4, max_seq_len=ids.shape[1])
    model = Transformer(cfg)
    opt = build_optimizer(model, TrainConfig(lr=3e-3, weight_decay=0.0))
    x, y = ids[:, :-1], ids[:, 1:]
    for _ in range(150):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    prompt = ids[:, :3]
    out = model.generate(prompt, ids.shape[1] - 3, temperature=0)
    assert tok.decode(out[0].tolist()) == text


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_kv_cache_generation_equals_full_recompute(position):
    torch.manual_seed(0)
    cfg = tiny(position=position)
    model = Transformer(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 5))
    cached = model.generate(prompt, 20, temperature=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(20):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ids)


def test_generation_past_the_window_keeps_going():
    torch.manual_seed(0)
    cfg = tiny(max_seq_len=16)
    model = Transformer(cfg)
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 40, temperature=1.0, top_k=5, top_p=0.9,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 41)


def test_top_k_and_top_p_filter():
    from trainwise.model.transformer import sample_next

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, 2, 1.0, g).item() for _ in range(200)}
    assert draws == {2, 3}
    # probabilities ~ [0.03, 0.09, 0.24, 0.64]: top_p 0.5 keeps only the largest
    draws = {sample_next(logits, 1.0, 0, 0.5, g).item() for _ in range(100)}
    assert draws == {3}


# The whole model under -m slow: its cold compile is 20-40 s of the suite, and tests/test_train.py trains the
# whole-model compile to the eager run's losses. Blocks compiled under torchrun: tests/test_tp_pp.py, -m slow.
@pytest.mark.parametrize("per_block", [pytest.param(False, marks=pytest.mark.slow), True], ids=["whole", "per_block"])
def test_compiled_model_keeps_keys_and_matches_eager(per_block):
    from trainwise.runtime.parallelize import apply_compile, remove_compile

    eager, compiled, x = wrapped_copy_has_the_same_gradients(lambda m: apply_compile(m, per_block=per_block),
                                                             rtol=1e-4, atol=1e-5)
    remove_compile(compiled)
    assert torch.equal(compiled.generate(x[:1, :3], 5, temperature=0), eager.generate(x[:1, :3], 5, temperature=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_explicit_attention_equals_sdpa(dtype, kv_heads):
    """The two-matmul causal attention used under compile on CPU is SDPA's causal attention."""
    from trainwise.model.attention import explicit_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(2, kv_heads, 9, 8, generator=g, dtype=dtype) for _ in range(2))
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=kv_heads != 4)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(explicit_attention(q, k, v).float(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", [None, "tanh"], ids=["swiglu", "geglu"])
def test_gated_unit_equals_autograd_bit_for_bit_and_saves_only_its_inputs(dtype, approximate):
    """GatedUnit: act(gate) * up with act(gate) computed again in backward; the output and both gradients are
    autograd's two nodes' bit for bit, and what it keeps for backward is gate and up only (autograd's two nodes
    keep act(gate) too)."""
    from trainwise.model.layers import GatedUnit, _gate_act

    g = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(8, 24, generator=g).to(dtype) for _ in range(3))
    results = []
    for fused in (True, False):
        a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = GatedUnit.apply(a, b, approximate) if fused else _gate_act(a, approximate) * b
        out.backward(grad)
        results.append((out, a.grad, b.grad, sum(saved)))
    (out, d_gate, d_up, kept), (ref, ref_gate, ref_up, ref_kept) = results
    assert torch.equal(out, ref) and torch.equal(d_gate, ref_gate) and torch.equal(d_up, ref_up)
    assert kept == 2 * gate.numel() and ref_kept == 3 * gate.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_the_reference_rope_forward_and_backward(dtype):
    """Rotary (one autograd node, half tables, (B, T, heads, hd) layout) is apply_rope, gradient included:
    fp32 to float rounding, bf16 (tables and arithmetic in bf16) to bf16 rounding."""
    from trainwise.model.layers import Rotary, apply_rope, rope_tables

    g = torch.Generator().manual_seed(0)
    B, T, heads, hd = 2, 12, 3, 8
    cos, sin = rope_tables(hd, T, 10000.0)
    x = torch.randn(B, T, heads, hd, generator=g).to(dtype).requires_grad_()
    grad_out = torch.randn(B, T, heads, hd, generator=g)
    got = Rotary.apply(x, cos[:, None, :hd // 2].to(dtype), sin[:, None, :hd // 2].to(dtype))
    (got.float() * grad_out).sum().backward()
    x_ref = x.detach().float().requires_grad_()
    want = apply_rope(x_ref.transpose(1, 2), cos, sin).transpose(1, 2)  # reference: (B, heads, T, hd)
    (want * grad_out).sum().backward()
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(x.grad.float(), x_ref.grad, **tol)


@pytest.mark.slow
def test_compiled_bf16_step_at_the_default_width_has_finite_gradients_equal_to_eager():
    """Regression: with the old RoPE form (cat of -x2, x1) a whole-model compile of the default block at
    T = 256 in bf16 gave NaN gradients on an AMX Xeon, so every step of the default run was skipped.
    One layer of the default model, B 2: the compiled gradients are finite and match eager's."""
    from trainwise.runtime.parallelize import apply_compile
    from trainwise.runtime.precision import autocast

    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=1)
    eager, compiled = Transformer(cfg), Transformer(cfg)
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled)
    x, y = batch(cfg, b=2, t=cfg.max_seq_len)
    for model in (eager, compiled):
        with autocast(torch.device("cpu"), "bf16"):
            loss = model(x, y)
        loss.backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.isfinite(b.grad).all(), name
        torch.testing.assert_close(b.grad, a.grad, rtol=5e-2, atol=2e-3, msg=name)
