"""The kvpress cross-check without torch: its comparison logic on synthetic kept sets, and each
of our policies, run with the settings the cross-check gives it (`METHODS`), against a NumPy
transcription of the rule kvpress 0.5.5's press applies (its `score`, then `topk` of
int(C * (1 - compression_ratio)) per KV head), on random statistics with no ties."""

import jax.numpy as jnp
import numpy as np
import pytest

from configs import quality as qc
from experiments import crosscheck_kvpress as xc
from tests.experiments.common import run_cli
from kvquota.policies import TokenView, get_policy

L, HKV, GROUP, C = 2, 3, 3, 40  # SmolLM2's grouping: 3 query heads per KV head


# ---- the comparison ------------------------------------------------------------------------


def test_topk_later_first_breaks_ties_toward_the_later_position():
    scores = np.array([[1.0, 2.0, 2.0, 0.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    got = xc.topk_later_first(scores, 2)
    np.testing.assert_array_equal(got, [[0, 0, 1, 0, 1], [0, 0, 0, 1, 1]])


def test_topk_later_first_is_the_top_k_without_ties():
    scores = np.random.default_rng(0).random((4, 3, 17))
    got = xc.topk_later_first(scores, 5)
    want = np.zeros_like(got)
    np.put_along_axis(want, np.argsort(-scores, axis=-1)[..., :5], True, axis=-1)
    np.testing.assert_array_equal(got, want)


def test_set_agreement_counts_identical_rows_and_jaccard():
    a = np.array([[1, 1, 0, 0], [1, 0, 1, 0]], bool)
    b = np.array([[1, 1, 0, 0], [0, 1, 1, 0]], bool)  # row 1: 1 shared of 3
    got = xc.set_agreement(a, b)
    assert got == {"exact": 0.5, "jaccard_mean": pytest.approx((1 + 1 / 3) / 2),
                   "jaccard_min": pytest.approx(1 / 3)}
    with pytest.raises(ValueError, match="different shapes"):
        xc.set_agreement(a, b[:1])


def test_compare_reports_the_perplexity_difference_and_refuses_unequal_budgets():
    kept = np.zeros((2, L, HKV, 8), bool)
    kept[..., :4] = True
    scores = np.tile(np.arange(8, 0, -1, dtype=np.float32), (2, L, HKV, 1))
    ours = np.full((2, 5), np.log(2.02))
    theirs = np.full((2, 5), np.log(2.0))
    row = xc.compare(kept, kept, scores, ours, theirs)
    assert row["kept_tokens"] == 4 and row["agreement"]["exact"] == 1.0
    assert row["agreement_by_scores"]["exact"] == 1.0 and not row["kvpress_ties_matter"]
    np.testing.assert_allclose(row["ppl_rel_diff"], [0.01, 0.01], rtol=1e-12)
    assert row["ppl_rel_diff_of_means"] == pytest.approx(0.01, rel=1e-12)
    fewer = kept.copy()
    fewer[1, 0, 0, 0] = False
    with pytest.raises(ValueError, match="same number of tokens"):
        xc.compare(fewer, kept, scores, ours, theirs)


def test_compare_sees_kvpress_ties_resolved_another_way():
    """kvpress kept the earlier of two equal scores: ranked by our rule its scores keep the
    later one, which `kvpress_ties_matter` reports."""
    scores = np.array([5.0, 1.0, 1.0, 0.0], np.float32).reshape(1, 1, 1, 4)
    earlier = np.array([1, 1, 0, 0], bool).reshape(1, 1, 1, 4)
    nll = np.zeros((1, 3))
    row = xc.compare(earlier, earlier, scores, nll, nll)
    assert row["kvpress_ties_matter"] and row["agreement_by_scores"]["exact"] == 0.0
    later = xc.topk_later_first(scores, 2)
    assert xc.disagreement_detail(later, earlier, scores) == {
        "count": 1, "all_ties": True, "all_within_noise": None, "first": [
            {"doc": 0, "layer": 0, "head": 0, "only_ours": [2], "only_kvpress": [1],
             "kvpress_scores_only_ours": [1.0], "kvpress_scores_only_kvpress": [1.0],
             "kvpress_gap": 0.0}]}
    assert xc.disagreement_detail(earlier, earlier, scores) == {
        "count": 0, "all_ties": None, "all_within_noise": None, "first": []}


def test_disagreement_detail_tells_a_score_difference_from_a_tie():
    scores = np.array([5.0, 2.0, 1.0, 0.0], np.float32).reshape(1, 1, 1, 4)
    theirs = np.array([1, 1, 0, 0], bool).reshape(1, 1, 1, 4)
    ours = np.array([1, 0, 1, 0], bool).reshape(1, 1, 1, 4)
    got = xc.disagreement_detail(ours, theirs, scores)
    assert got["count"] == 1 and got["all_ties"] is False
    assert got["first"][0]["kvpress_gap"] == 1.0


@pytest.mark.parametrize("our_error, within", [(0.5, False), (1.0, True)])
def test_disagreement_detail_measures_a_near_tie_against_the_sides_score_difference(
        our_error, within):
    """kvpress's scores 2.0 and 1.0 at the swapped positions: a gap of 1, within the noise
    only when our scores differ from kvpress's by at least 1 somewhere in that head."""
    scores = np.array([5.0, 2.0, 1.0, 0.0], np.float32).reshape(1, 1, 1, 4)
    ours_scores = scores + np.array([0, 0, our_error, 0], np.float32)
    theirs = np.array([1, 1, 0, 0], bool).reshape(1, 1, 1, 4)
    ours = np.array([1, 0, 1, 0], bool).reshape(1, 1, 1, 4)
    got = xc.disagreement_detail(ours, theirs, scores, ours_scores)
    assert got["all_within_noise"] is within
    assert got["first"][0]["score_noise"] == our_error


# ---- our policies against kvpress's rules -----------------------------------------------------


def _kvpress_keep(scores, budget):
    """kvpress's ScorerPress.compress: the int(C * (1 - ratio)) top scores per (layer, head)."""
    k = int(C * (1 - (1 - budget)))
    return xc.topk_later_first(scores, k)  # no ties in these scores: the order does not matter


def _ours(name, view, budget):
    method = xc.METHODS[name]
    policy = get_policy(name, recent=method.recent, **dict(method.options))
    keep = jnp.asarray([int(round(budget * C))], jnp.int32)
    return np.asarray(policy.keep_mask(view, keep))[0]


def _view(mass=None, key_norm=None, last=None):
    zeros = jnp.zeros((1, L, HKV, C), jnp.float32)
    return TokenView(lengths=jnp.asarray([C], jnp.int32),
                     mass=zeros if mass is None else jnp.asarray(mass[None], jnp.float32),
                     key_norm=None if key_norm is None else jnp.asarray(key_norm[None]),
                     last_attention=None if last is None else jnp.asarray(last[None]))


def _attention(rng, queries):
    """Random causal softmax attention f64[L, H, queries, C] of the last `queries` positions."""
    logits = rng.normal(size=(L, HKV * GROUP, queries, C)) * 2
    mask = np.arange(C)[None, :] > (C - queries + np.arange(queries))[:, None]
    logits = np.where(mask, -np.inf, logits)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_streamingllm_keeps_kvpress_sinks_and_recent(budget):
    n_pruned = C - int(C * budget)
    scores = np.ones((L, HKV, C))
    scores[..., 4:4 + n_pruned] = 0
    k = int(C * budget)
    want = np.zeros((L, HKV, C), bool)
    want[..., :4] = True
    want[..., C - (k - 4):] = True
    assert (scores.astype(bool) == want).all()  # the rule, read as sets
    np.testing.assert_array_equal(_ours("streamingllm", _view(), budget), want)


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_knorm_keeps_kvpress_lowest_key_norms(budget):
    norm = np.random.default_rng(1).random((L, HKV, C)).astype(np.float32) + 0.5
    np.testing.assert_array_equal(_ours("knorm", _view(key_norm=norm), budget),
                                  _kvpress_keep(-norm, budget))


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_snapkv_avg_keeps_kvpress_window_scores(budget):
    """kvpress: the window's per-query-head attention averaged over the window's queries,
    avg_pool1d(kernel 7, padding 3, zeros counted) over the prefix, averaged over the group,
    the window padded with max + 1. Ours: the same attention summed over the window's queries
    and the group (the engine's recorded mass)."""
    w = xc.METHODS["snapkv"].recent
    attn = _attention(np.random.default_rng(2), w)  # [L, H, W, C]
    prefix = attn[..., :C - w].mean(-2)  # [L, H, C - W]
    padded = np.pad(prefix, [(0, 0), (0, 0), (3, 3)])
    pooled = np.stack([padded[..., i:i + 7].sum(-1) / 7 for i in range(C - w)], -1)
    scores = pooled.reshape(L, HKV, GROUP, C - w).mean(2)
    scores = np.concatenate([scores, np.full((L, HKV, w), scores.max() + 1)], -1)
    mass = attn.sum(-2).reshape(L, HKV, GROUP, C).sum(2)
    np.testing.assert_array_equal(_ours("snapkv", _view(mass=mass), budget),
                                  _kvpress_keep(scores, budget))


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_tova_keeps_kvpress_last_query_scores(budget):
    """kvpress: the last query's attention over the earlier keys averaged over all query heads,
    the same for every KV head, the last token padded with max + 1. Ours: the last step's
    attention per KV head (summed over its group), averaged over the KV heads; the last token
    kept as the recent window of 1."""
    attn = _attention(np.random.default_rng(3), 1)[:, :, 0]  # [L, H, C]
    scores = attn[..., :-1].mean(1, keepdims=True).repeat(HKV, 1)
    scores = np.concatenate([scores, np.full((L, HKV, 1), scores.max() + 1)], -1)
    last = attn.reshape(L, HKV, GROUP, C).sum(2)
    np.testing.assert_array_equal(_ours("tova", _view(last=last), budget),
                                  _kvpress_keep(scores, budget))


def test_each_rule_is_a_one_shot_method_of_the_quality_study_with_the_same_policy():
    """kvpress's presses prune once after the prompt: each is compared with the study's one-shot
    method of the same rule (TOVA: `tova-oneshot`; the study's `tova` evicts step by step)."""
    for name in xc.METHODS:
        study = xc.study_method(name)
        assert study in qc.EVICT_METHODS and study not in qc.STEPWISE, name
        assert qc.evict_policy(study)[0] == name
    assert xc.study_method("tova") == "tova-oneshot" and "tova" in qc.STEPWISE


def test_the_crosscheck_preset_is_a_valid_quality_preset():
    config = dict(num_docs=3, context_tokens=512, continuation_tokens=96, budgets=[0.25, 0.5],
                  methods=list(xc.METHODS))
    preset = xc.crosscheck_preset(config)
    assert preset.contexts == (512,) and preset.budgets == (0.25, 0.5)
    assert preset.continuation_tokens == 96 and preset.num_docs == preset.min_docs == 3


# ---- the command line ------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--kvpress_python=/no/such/python"], "no such executable"),
    (["--budgets=0.5,1.5"], "fractions in (0, 1)"),
    (["--methods=h2o"], "unknown methods ['h2o']"),
])
def test_bad_invocations_exit_2_with_one_line_before_any_work(args, message):
    proc = run_cli("crosscheck_kvpress", *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ---- our side on the real model (what kvpress is compared with) -------------------------------


def test_our_side_keeps_the_budget_per_head_and_scores_the_continuation():
    """`our_side` on one short pydoc document of SmolLM2 (the quality study's Bench and
    documents, as the cross-check calls them): each method keeps exactly round(budget x C)
    context tokens in every (layer, KV head), StreamingLLM its 4 sinks and newest tokens, and
    every -log p is finite; the key norms cover the context."""
    import kvquota as kq
    from experiments import quality

    config = dict(model="smollm2-135m", num_docs=1, context_tokens=64, continuation_tokens=16,
                  budgets=[0.5], methods=list(xc.METHODS))
    preset = xc.crosscheck_preset(config)
    tok = kq.load_tokenizer(config["model"])
    docs = quality.documents(tok.encode(quality.pydoc_text()), preset, "pydoc", 64)
    out, full_nll, norms = xc.our_side(config, docs, preset)
    assert sorted(out) == sorted(xc.key(m, 0.5) for m in xc.METHODS)
    for name, (kept, nll) in out.items():
        assert kept.shape[0] == 1 and kept.shape[-1] == 64, name
        assert (kept.sum(axis=-1) == 32).all(), name
        assert nll.shape == full_nll.shape == (1, 15) and np.isfinite(nll).all(), name
    sinks_recent = np.zeros(64, bool)
    sinks_recent[:4] = sinks_recent[-28:] = True
    assert (out[xc.key("streamingllm", 0.5)][0] == sinks_recent).all()
    assert norms.shape[0] == 1 and norms.shape[-1] == 64 and np.isfinite(norms).all()
