"""TOVA step by step (Oren et al., 2024) on the paged state against a float64 NumPy reference of
the paper's rule: after each token, once the cache passes the budget, every layer drops the token
its current query attends to least, the layer's heads averaged. The kept original positions per
(layer, KV head) must match exactly, and the logits of every step within the oracle's tolerance
(they depend on every earlier choice)."""

import jax
import numpy as np
import pytest

import kvquota as kq
from kvquota import errors as E
from kvquota import model as M
from kvquota.serving.stepwise import StepwiseEviction, stepwise_state_config
from tests.model.test_numpy_oracle import check, from_params, rms_norm, rope, silu

CFG = kq.get_model_config("tiny-qwen")  # 2 layers, 4 query / 2 KV heads, head_dim 16
PARAMS = M.init_params(CFG, seed=21, scale=0.2)
TOKENS = [int(t) for t in np.random.default_rng(4).integers(0, CFG.vocab_size, 22)]
BUDGET, P = 10, 4


@pytest.fixture(autouse=True)
def _f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def tova_reference(tokens, budget, stride):
    """Token by token in float64: each layer's cache holds (original position, K, V); after a
    token, a cache of budget + stride tokens or more keeps the `budget` its query attended to
    most (mean over the layer's query heads; ties keep the later token). Returns the logits
    [T, V] and each layer's kept positions."""
    w = from_params(CFG, PARAMS)
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    d, hq, hkv = CFG.head_dim, CFG.num_q_heads, CFG.num_kv_heads
    caches = [{"pos": np.zeros(0, int), "k": np.zeros((0, hkv, d)), "v": np.zeros((0, hkv, d))}
              for _ in w["layers"]]
    logits = []
    for t, tok in enumerate(tokens):
        h = f(w["embed"])[[tok]]
        scores = []
        for lw, c in zip(w["layers"], caches):
            x = rms_norm(h, f(lw["attn_norm"]), CFG.rms_eps)
            qkv = {n: (x @ f(lw[n]).T + (f(lw[n + "_bias"]) if CFG.qkv_bias else 0)).reshape(
                1, -1, d) for n in ("q", "k", "v")}
            q = rope(qkv["q"], np.array([t]), CFG.rope_theta, "half")[0]  # [Hq, D]
            c["k"] = np.concatenate([c["k"], rope(qkv["k"], np.array([t]), CFG.rope_theta,
                                                  "half")])
            c["v"] = np.concatenate([c["v"], qkv["v"]])
            c["pos"] = np.append(c["pos"], t)
            kv = np.arange(hq) // (hq // hkv)
            s = np.einsum("hd,nhd->hn", q, c["k"][:, kv]) / np.sqrt(d)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)  # [Hq, n]
            out = np.einsum("hn,nhd->hd", p, c["v"][:, kv]).reshape(1, hq * d)
            h = h + out @ f(lw["o"]).T
            x = rms_norm(h, f(lw["mlp_norm"]), CFG.rms_eps)
            h = h + (silu(x @ f(lw["gate"]).T) * (x @ f(lw["up"]).T)) @ f(lw["down"]).T
            scores.append(p.mean(0))  # TOVA: the layer's heads averaged
        h = rms_norm(h, f(w["final_norm"]), CFG.rms_eps)
        head = f(w["embed"]) if w["lm_head"] is None else f(w["lm_head"])
        logits.append((h @ head.T)[0])
        for c, score in zip(caches, scores):
            n = len(c["pos"])
            if n >= budget + stride:
                order = np.lexsort((-np.arange(n), -score))  # score, then index, descending
                keep = np.sort(order[:budget])
                c.update(pos=c["pos"][keep], k=c["k"][keep], v=c["v"][keep])
    return np.stack(logits), [c["pos"] for c in caches]


@pytest.mark.parametrize("stride,track", [(1, True), (3, True), (1, False)])
def test_stepwise_tova_keeps_what_the_papers_rule_keeps(stride, track):
    want_logits, want_kept = tova_reference(TOKENS, BUDGET, stride)
    sc = stepwise_state_config(CFG, 1, BUDGET, stride, block_size=P)
    eng = kq.PagedEngine(CFG, PARAMS, sc, chunk_size=8, record_attention=True)
    eng.register_tenant(0, token_quota=10**6, byte_quota=eng.max_byte_quota)
    report, chunks = eng.admit([0], [TOKENS[:BUDGET]], last_only=False)
    got = [np.concatenate([np.asarray(c)[0] for c in chunks])[:BUDGET]]
    driver = StepwiseEviction(eng, report.seq_id[:1].astype(np.int32), budget_tokens=BUDGET,
                              stride=stride, track_positions=track)
    for t in range(BUDGET, len(TOKENS)):
        got.append(driver.step(np.array([TOKENS[t]], np.int32)))
        eng.allocator.check(eng.state)
        assert BUDGET <= int(eng.state.seqs.seq_lens[report.seq_id[0]]) < BUDGET + stride
    # 12 steps: stride 1 evicts after each; stride 3 after steps 3, 6, 9, 12 (cache back at 10).
    assert driver.evictions == (len(TOKENS) - BUDGET) // stride
    check(np.concatenate(got), want_logits, f"stride {stride} logits")
    if not track:  # the same evictions, nothing recorded
        assert driver.positions is None
        return
    for layer, kept in enumerate(want_kept):
        for head in range(CFG.num_kv_heads):
            assert driver.positions[0, layer, head, :BUDGET].tolist() == kept.tolist(), (
                layer, head)
            assert (driver.positions[0, layer, head, BUDGET:] == -1).all()
    # The rule really chose: both layers dropped tokens other than simply the oldest ones.
    assert all(kept.tolist() != list(range(len(TOKENS) - BUDGET, len(TOKENS)))
               for kept in want_kept)


def _driven(stride, feed):
    """Two rows, one starting 3 tokens short of the budget (so their evictions fall on other
    steps), driven over 12 tokens by `feed` at once or by `step` token by token."""
    sc = stepwise_state_config(CFG, 2, BUDGET, stride, block_size=P)
    eng = kq.PagedEngine(CFG, PARAMS, sc, chunk_size=8, record_attention=True)
    eng.register_tenant(0, token_quota=10**6, byte_quota=eng.max_byte_quota)
    other = TOKENS[::-1]
    report, _ = eng.admit([0, 0], [TOKENS[:BUDGET], other[:BUDGET - 3]], last_only=False)
    driver = StepwiseEviction(eng, report.seq_id[:2].astype(np.int32), budget_tokens=BUDGET,
                              stride=stride)
    rest = np.array([TOKENS[BUDGET:], other[BUDGET - 3:len(TOKENS) - 3]], np.int32)
    if feed:
        logits = driver.feed(rest)
    else:
        logits = np.stack([driver.step(rest[:, j]) for j in range(rest.shape[1])], axis=1)
    eng.allocator.check(eng.state)
    return driver, logits, eng


@pytest.mark.parametrize("stride", [1, 3, 5])
def test_feed_keeps_what_step_does(stride):
    fed, fed_logits, eng = _driven(stride, feed=True)
    stepped, step_logits, _ = _driven(stride, feed=False)
    assert fed.evictions == stepped.evictions > 0
    np.testing.assert_array_equal(fed.positions, stepped.positions)
    check(fed_logits, step_logits, f"stride {stride}: fed against stepped logits")
    lens = np.asarray(eng.state.seqs.seq_lens)[fed.seq_ids]
    assert ((BUDGET <= lens) & (lens < BUDGET + stride)).all()
    # Row 0 is TOKENS: what the paper's rule keeps, and its logits.
    want_logits, want_kept = tova_reference(TOKENS, BUDGET, stride)
    check(fed_logits[0], want_logits[BUDGET:], f"stride {stride}: fed logits")
    for layer, kept in enumerate(want_kept):
        assert (fed.positions[0, layer, :, :len(kept)] == kept).all()


def test_score_stepwise_matches_the_driver_and_ordinary_scoring_before_the_budget():
    results, driver = kq.score_stepwise(CFG, PARAMS, [TOKENS, TOKENS[::-1]],
                                        budget_tokens=BUDGET, block_size=P, return_logits=True)
    full = kq.score(CFG, PARAMS, TOKENS, block_size=P)
    assert len(results) == 2 and results[0].nll.shape == full.nll.shape
    # Positions before the budget saw the whole cache (f32 chunking order only).
    np.testing.assert_allclose(results[0].nll[:BUDGET], full.nll[:BUDGET], rtol=1e-5,
                               atol=1e-5)
    want_logits, want_kept = tova_reference(TOKENS, BUDGET, 1)
    check(results[0].logits, want_logits, "score_stepwise logits")
    assert results[0].top1.tolist() == np.argmax(results[0].logits, -1).tolist()
    for layer, kept in enumerate(want_kept):
        assert (driver.positions[0, layer, :, :BUDGET] == kept).all()


def _engine(record=True):
    sc = stepwise_state_config(CFG, 1, BUDGET, 1, block_size=P)
    return kq.PagedEngine(CFG, PARAMS, sc, chunk_size=8, record_attention=record)


@pytest.mark.parametrize("kwargs,match", [
    (dict(budget_tokens=0), "budget_tokens"), (dict(budget_tokens=BUDGET, stride=0), "stride"),
    (dict(budget_tokens=BUDGET, recent=-1), "recent"),
    (dict(budget_tokens=BUDGET, recent=BUDGET + 1), "exceeds the budget"),
    (dict(budget_tokens=BUDGET, policy="tovaa"), "unknown eviction policy"),
    (dict(budget_tokens=BUDGET, stride=3), "exceed the 12 tokens"),
])
def test_bad_settings_are_typed_errors(kwargs, match):
    with pytest.raises(E.InvalidArgumentError, match=match):
        StepwiseEviction(_engine(), np.zeros(1, np.int32), **kwargs)


def test_an_engine_that_records_no_attention_is_refused():
    with pytest.raises(E.InvalidArgumentError, match="record_attention"):
        StepwiseEviction(_engine(record=False), np.zeros(1, np.int32), budget_tokens=BUDGET)
    with pytest.raises(E.InvalidArgumentError, match="equal length"):
        kq.score_stepwise(CFG, PARAMS, [TOKENS, TOKENS[:5]], budget_tokens=BUDGET)
