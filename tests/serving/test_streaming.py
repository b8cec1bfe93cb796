"""Cache policies while a sequence grows: lossless streaming equals ordinary scoring; compression
leaves exactly the recent window in full precision; eviction keeps the cache within its budget."""

import numpy as np
import pytest

import kvquota as kq
from kvquota import errors as E

CONFIG = kq.get_model_config("tiny-qwen")
PARAMS = kq.init_params(CONFIG, seed=5)
IDS = [int(x) for x in np.random.default_rng(0).integers(0, CONFIG.vocab_size, 70)]
P = 8


def test_lossless_streaming_equals_chunked_scoring():
    want = kq.score(CONFIG, PARAMS, IDS, block_size=P)
    got, held = kq.score_streaming(CONFIG, PARAMS, IDS, kq.CachePolicy(), block_size=P)
    # Same maths, other chunking: f32 summation order only (see tests/serving/test_engine.py).
    np.testing.assert_allclose(got.nll, want.nll, rtol=1e-5, atol=1e-5)
    assert held == {"f32": 9 * kq.KVLayout(CONFIG, kq.get_kv_format("f32"), P).bytes_per_block}


@pytest.mark.parametrize("fmt", ["int8", "kivi4", "fp8"])
def test_streaming_compression_leaves_the_recent_window_in_full_precision(fmt):
    policy = kq.CachePolicy(kv_format=fmt, keep_recent=16)
    got, held = kq.score_streaming(CONFIG, PARAMS, IDS, policy, block_size=P)
    want = kq.score(CONFIG, PARAMS, IDS, block_size=P)
    assert np.isfinite(got.nll).all() and not np.allclose(got.nll, want.nll)
    # The policy runs before each block attends: after the last block was written, the blocks
    # wholly older than the 16 newest tokens of the 64 cached then are compressed (6 of 8).
    full = kq.KVLayout(CONFIG, kq.get_kv_format("f32"), P).bytes_per_block
    comp = kq.KVLayout(CONFIG, kq.get_kv_format(fmt), P).bytes_per_block
    assert held == {"f32": 3 * full, fmt: 6 * comp}
    # Positions inside the first block never saw a compressed key.
    np.testing.assert_allclose(got.nll[:P - 1], want.nll[:P - 1], rtol=1e-5, atol=1e-5)


def test_streaming_eviction_stays_within_the_budget():
    policy = kq.CachePolicy(evict_policy="streamingllm", budget_tokens=24, keep_recent=8)
    got, held = kq.score_streaming(CONFIG, PARAMS, IDS, policy, block_size=P)
    full = kq.KVLayout(CONFIG, kq.get_kv_format("f32"), P).bytes_per_block
    assert np.isfinite(got.nll).all() and held["f32"] <= 4 * full  # 24 kept + the last block


def test_streaming_h2o_scores_the_recorded_mass():
    """H2O's heavy-hitter half reads the mass every query so far gave each token: with nothing
    recorded every score ties and H2O keeps the newest tokens, as "oldest" (evict the oldest)
    does; recorded, it keeps other tokens, so the scores differ."""
    scores = {}
    for name in ("h2o", "oldest"):
        policy = kq.CachePolicy(evict_policy=name, budget_tokens=24, keep_recent=4)
        scores[name] = kq.score_streaming(CONFIG, PARAMS, IDS, policy, block_size=P)[0].nll
    assert np.isfinite(scores["h2o"]).all()
    assert not np.allclose(scores["h2o"], scores["oldest"])


@pytest.mark.parametrize("kwargs", [
    dict(kv_format="bf16"), dict(keep_recent=-1), dict(evict_policy="h2o"),
    dict(budget_tokens=3), dict(kv_format="int8", evict_policy="h2o", budget_tokens=3),
])
def test_bad_policies_are_typed_errors(kwargs):
    with pytest.raises(E.InvalidArgumentError):
        kq.CachePolicy(**kwargs)


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_streaming_generation_evicts_with_recorded_attention(name):
    policy = kq.CachePolicy(evict_policy=name, budget_tokens=16, keep_recent=4)
    prompt = IDS[:24]
    outs, held = kq.generate_streaming(CONFIG, PARAMS, [prompt], 12, policy, block_size=P)
    assert len(outs[0].tokens) == 12
    full = kq.KVLayout(CONFIG, kq.get_kv_format("f32"), P).bytes_per_block
    assert held["f32"] <= 3 * full  # 16 kept tokens + the newest, never the whole 35
