"""A mixture of sources ([[data.sources]] with weights): sampled in proportion, counted per source in
metrics.jsonl, saved in config.toml and reloaded from it."""

import json

import numpy as np
import pytest

from trainwise.config import DataConfig, RunConfig, apply_overrides, load_config
from trainwise.data.batches import BatchSampler, Mixture
from trainwise.data.corpus import prepare_data, unigram_loss
from trainwise.errors import TrainwiseError

EN = "The model learns to predict the next token, one step of gradient descent at a time. " * 60
ZH = "训练语言模型需要大量的文本数据，模型学习预测下一个词元。" * 60


@pytest.fixture(autouse=True)
def cache_in_tmp(isolated_cache):
    return isolated_cache


def test_sampler_draws_sources_in_proportion_and_resumes():
    a, b = np.arange(1000) % 7, np.arange(2000) % 5 + 100
    mix = Mixture([a, b], [3.0, 1.0], ["a", "b"])
    sampler = BatchSampler(mix, micro_batch=8, seq_len=4, seed=0)
    firsts = [sampler.next_batch()[0][:, 0] for _ in range(200)]
    from_b = sum(int((f >= 100).sum()) for f in firsts)
    assert abs(from_b / 1600 - 0.25) < 0.03
    counts = sampler.source_counts()
    assert counts == {"a": (1600 - from_b) * 4, "b": from_b * 4}
    state = json.loads(json.dumps(sampler.state_dict()))
    again = BatchSampler(mix, micro_batch=8, seq_len=4, seed=0)
    again.load_state_dict(state)
    assert again.source_counts() == counts
    assert all(np.array_equal(x, y) for x, y in zip(sampler.next_batch(), again.next_batch()))


def test_mixture_trains_logs_per_source_tokens_and_round_trips_its_config(tmp_path, tok):
    from trainwise.trainer.loop import train

    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "a.txt").write_text(EN, encoding="utf-8")
    (tmp_path / "zh").mkdir()
    (tmp_path / "zh" / "b").write_bytes(ZH.encode("gb18030"))
    cfg = apply_overrides(RunConfig(), [
        f"data.sources=[{{path = '{tmp_path / 'en'}', weight = 3, name = 'en'}}, "
        f"{{path = '{tmp_path / 'zh'}', weight = 1, name = 'zh'}}]",
        "tokenizer.vocab_size=300", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
        "train.seq_len=16", "train.micro_batch=4", "train.max_steps=6", "train.log_every=3", "train.eval_every=3",
        "train.eval_steps=2", "train.warmup_steps=0", "train.compile=false"])
    train(cfg, out=tmp_path / "run", quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]["source_tokens"]
    assert set(last) == {"en", "zh"} and sum(last.values()) == 6 * 4 * 16
    assert last["en"] > last["zh"] > 0
    assert load_config(tmp_path / "run" / "config.toml").data.sources == cfg.data.sources
    data = prepare_data(cfg.data, tok, seq_len=16)
    assert [s["name"] for s in data.sources] == ["en", "zh"] and np.isfinite(unigram_loss(data))


@pytest.mark.parametrize("sources, needle", [
    ([{"weight": 1}], "has no path"),
    ([{"path": "a", "weight": 0}], "weight = 0 must be a positive number"),
    ([{"path": "a", "wieght": 1}], "unknown key 'wieght'.*'weight'"),
    ([{"path": "a"}, {"path": "a"}], "names .* repeat"),
])
def test_bad_sources_are_named(sources, needle):
    with pytest.raises(TrainwiseError, match=needle):
        DataConfig(sources=sources).validate()
    with pytest.raises(TrainwiseError, match="both set"):
        DataConfig(paths=["x"], sources=[{"path": "a"}]).validate()
