"""Public paths of the model and serving API that no other default test reached: the engine on
the Pallas backend (interpreted on CPU) against the reference backend, `dense_attention_reference`
against a float64 NumPy attention, `sample_tokens` with top_k > 1, `PagedEngine(state=...)` and
`PagedEngine.ledger()`.

Float tolerances come from one per-dtype table (as in test_engine.py) and are never loosened.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import get_model_config
from kernels.paged_attention import dense_attention_reference
from kvquota import errors
from kvquota import model as M
from kvquota import serving as E
from kvquota.state import StateConfig

ATOL = {"float32": 1e-4}  # logits, one backend or cache vs another (test_engine.py's)
# dense_attention_reference vs float64 NumPy: outputs are convex combinations of O(1) values and
# lse is a log of a sum of < 10 exponentials, each computed in f32 (2^-24 relative): 1e-5 leaves
# a 10x margin over the ~1e-6 measured.
ATTN_ATOL = {"float32": 1e-5}


@pytest.fixture(autouse=True)
def _f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _prompts(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def _engine(config, params, backend="auto", state=None, num_blocks=24):
    sc = StateConfig(model=config, num_blocks=num_blocks, block_size=4, max_seqs=4,
                     max_blocks_per_seq=8, num_tenants=2, kv_format="f32")
    eng = E.PagedEngine(config, params, sc, chunk_size=8, backend=backend, state=state)
    return eng


def _registered(config, params, backend="auto"):
    eng = _engine(config, params, backend)
    for t in range(2):
        eng.register_tenant(t, token_quota=1000, byte_quota=eng.max_byte_quota, share_group=1)
    s = eng.state  # unwritten pages are NaN: a read of a slot it should not see shows
    p0 = s.pages[0]
    eng.state = s.replace(pages=(p0.replace(k=jnp.full_like(p0.k, jnp.nan),
                                            v=jnp.full_like(p0.v, jnp.nan)),) + s.pages[1:])
    return eng


# ---- the Pallas backend ---------------------------------------------------------------------
def test_pallas_backend_matches_reference_backend():
    """Chunked prefill (two rows, 6 and 11 tokens: a partial and a crossing chunk over blocks
    of 4) and two decode steps, through the Pallas kernels interpreted on CPU, give the
    reference backend's logits and the same greedy tokens."""
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=31, scale=0.1)
    prompts = _prompts(config.vocab_size, [6, 11], seed=32)
    out = {}
    for backend in ("reference", "pallas"):
        eng = _registered(config, params, backend)
        report, chunks = eng.admit([0, 1], prompts, last_only=False)
        assert report.admitted.all()
        logits = [np.concatenate([np.asarray(c) for c in chunks], axis=1)]
        ids = report.seq_id.astype(np.int32)
        last = np.stack([logits[0][b, n - 1] for b, n in enumerate([6, 11])])
        for _ in range(2):
            rep, step = eng.decode(ids, last.argmax(-1).astype(np.int32))
            assert rep.appended.all()
            last = np.asarray(step)
            logits.append(last)
        eng.allocator.check(eng.state)
        out[backend] = logits
    for b, n in enumerate([6, 11]):
        got, want = out["pallas"][0][b, :n], out["reference"][0][b, :n]
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL["float32"])
    for got, want in zip(out["pallas"][1:], out["reference"][1:]):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL["float32"])
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


# ---- dense_attention_reference ----------------------------------------------------------------
def _numpy_attention(q, k, v, q_pos, kv_len, scale):
    """float64 causal GQA: query row (b, t) at position q_pos[b, t] sees keys s <= q_pos and
    s < kv_len[b]; a row that sees nothing (q_pos -1: padding) has output 0 and lse -inf."""
    b, t, hq, d = q.shape
    group = hq // k.shape[2]
    out = np.zeros((b, t, hq, d))
    lse = np.full((b, t, hq), -np.inf)
    for i in range(b):
        for j in range(t):
            seen = [s for s in range(k.shape[1]) if s <= q_pos[i, j] and s < kv_len[i]]
            if not seen:
                continue
            for h in range(hq):
                logits = scale * np.array([q[i, j, h] @ k[i, s, h // group] for s in seen])
                top = logits.max()
                w = np.exp(logits - top)
                lse[i, j, h] = top + np.log(w.sum())
                out[i, j, h] = (w / w.sum()) @ v[i, seen, h // group]
    return out, lse


@pytest.mark.parametrize("sm_scale", [None, 0.3])
def test_dense_attention_reference_matches_numpy(sm_scale):
    rng = np.random.default_rng(7)
    b, t, hq, hkv, d, s = 2, 5, 6, 2, 8, 9
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    # Row 0: a chunk at positions 4..8 of 9 cached tokens. Row 1: 6 cached tokens, chunk at
    # 3..5, then two padding rows (-1). Keys past kv_len hold NaN: they must never be read.
    q_pos = np.array([[4, 5, 6, 7, 8], [3, 4, 5, -1, -1]], np.int32)
    kv_len = np.array([9, 6], np.int32)
    k[1, 6:], v[1, 6:] = np.nan, np.nan
    out, lse = dense_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                         jnp.asarray(q_pos), jnp.asarray(kv_len), sm_scale=sm_scale)
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    want_out, want_lse = _numpy_attention(q.astype(np.float64), k.astype(np.float64),
                                          v.astype(np.float64), q_pos, kv_len, scale)
    assert out.shape == (b, t, hq, d) and lse.shape == (b, t, hq) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=0, atol=ATTN_ATOL["float32"])
    real = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[real], want_lse[real], rtol=0,
                               atol=ATTN_ATOL["float32"])
    assert (np.asarray(lse)[~real] == -np.inf).all() and (np.asarray(out)[1, 3:] == 0).all()


# ---- sample_tokens with top_k -----------------------------------------------------------------
def test_sample_tokens_top_k_samples_only_the_top_k():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((3, 50)).astype(np.float32) * 3  # distinct values: no ties
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    draws = np.stack([np.asarray(E.sample_tokens(jnp.asarray(logits), jax.random.key(i),
                                                 temperature=2.0, top_k=3)) for i in range(300)])
    assert draws.dtype == np.int32 and draws.shape == (300, 3)
    for row in range(3):
        assert set(draws[:, row].tolist()) == set(top3[row].tolist())  # all of them, nothing else
    # Seeded: the same key gives the same tokens; top_k=1 is greedy at any temperature.
    again = np.asarray(E.sample_tokens(jnp.asarray(logits), jax.random.key(5), temperature=2.0,
                                       top_k=3))
    np.testing.assert_array_equal(again, draws[5])
    greedy = E.sample_tokens(jnp.asarray(logits), jax.random.key(0), temperature=50.0, top_k=1)
    np.testing.assert_array_equal(np.asarray(greedy), logits.argmax(-1))


def test_generate_with_top_k_stays_in_the_top_k_of_the_model():
    """Each token generated with top_k=2 is one of the 2 most likely under the model's own
    teacher-forced logits (scored afterwards on the dense engine), and the run is seeded."""
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=33, scale=0.1)
    dense = E.DenseEngine(config, params, capacity=48, chunk_size=16)
    prompt = _prompts(config.vocab_size, [7], seed=34)[0]
    how = E.Sampling(temperature=1.0, top_k=2, seed=4)
    out = dense.generate([prompt], 10, sampling=how)[0].tokens
    assert out == dense.generate([prompt], 10, sampling=how)[0].tokens
    scored = dense.score(prompt + out, return_logits=True)
    for i, tok in enumerate(out):
        row = scored.logits[len(prompt) - 1 + i]
        assert tok in np.argsort(-row)[:2].tolist(), (i, tok)
    greedy = dense.generate([prompt], 10)[0].tokens
    assert out != greedy  # it did sample: with 10 steps at temperature 1, a difference shows


# ---- PagedEngine(state=...) and PagedEngine.ledger() --------------------------------------------
def test_paged_engine_serves_from_a_given_state():
    """A second engine takes over the first one's state: the cached system prompt is a prefix
    hit there, and the logits after the hit equal a recomputation from scratch."""
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=35, scale=0.1)
    system, q1, q2 = _prompts(config.vocab_size, [12, 5, 6], seed=36)
    first = _registered(config, params)
    first.generate([system + q1], 3, tenants=[0], release=False)  # stays cached
    handed = first.state
    second = _engine(config, params, state=handed)
    assert second.state is handed
    report, chunks = second.admit([1], [system + q2], last_only=False)  # group 1: t1 shares
    second.allocator.check(second.state)
    assert report.cached_tokens[0] == 12
    fresh = _registered(config, params)
    rf, ref = fresh.admit([1], [system + q2], last_only=False)
    assert rf.cached_tokens[0] == 0
    n = len(system + q2)
    got = np.concatenate([np.asarray(c)[0] for c in chunks])[: n - 12]
    want = np.concatenate([np.asarray(c)[0] for c in ref])[12:n]
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL["float32"])


def test_paged_engine_given_another_configs_state_refuses_it():
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=0)
    other = StateConfig(model=config, num_blocks=12, block_size=4, max_seqs=4,
                        max_blocks_per_seq=8, num_tenants=2, kv_format="f32")
    from kvquota.allocator import Allocator

    eng = _engine(config, params, state=Allocator(other).init())
    with pytest.raises(errors.StateMismatchError):
        eng.register_tenant(0, token_quota=10, byte_quota=eng.max_byte_quota)
    with pytest.raises(errors.StateMismatchError):
        eng.ledger()


def test_paged_engine_ledger():
    """The engine's ledger is the allocator's on its current state, in exact bytes."""
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=37, scale=0.1)
    eng = _registered(config, params)
    block = eng.state_config.pool_bytes[0]
    led = eng.ledger()
    assert np.asarray(led.used_tokens).tolist() == [0, 0]
    assert np.asarray(led.free_blocks)[0] == 24
    prompts = _prompts(config.vocab_size, [9, 4], seed=38)
    eng.generate(prompts, 3, tenants=[0, 1], release=False)  # 9 + 2 and 4 + 2 tokens kept
    led = eng.ledger()
    assert np.asarray(led.used_tokens).tolist() == [11, 6]
    assert led.charged_bytes.tolist() == [3 * block, 2 * block]  # ceil(11/4), ceil(6/4)
    assert int(np.asarray(led.free_blocks)[0]) == 24 - 5
    assert led.summary(0)[0]["fragmentation_tokens"] == 3 * 4 - 11
    want = eng.allocator.ledger(eng.state)
    for a, b in zip(jax.tree_util.tree_leaves(led), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    eng.free(np.flatnonzero(np.asarray(eng.state.seqs.seq_status) != 0))
    assert np.asarray(eng.ledger().used_tokens).tolist() == [0, 0]
    eng.allocator.check(eng.state)
