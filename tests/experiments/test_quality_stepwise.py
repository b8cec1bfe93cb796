"""The quality study's `tova` row is TOVA step by step (`kq.StepwiseEviction`): on a tiny model,
what each (layer, KV head) holds when the context ends and the continuation's logits equal
`kq.score_stepwise` on the same row (the library's driver, itself checked against a NumPy
reference of the paper's rule), a row shorter by less than a block included; at stride 1 and
at a larger stride."""

import dataclasses

import jax
import numpy as np
import pytest

import kvquota as kq
from configs import quality as qc
from experiments import quality as q

CFG = kq.get_model_config("tiny-qwen")  # 2 layers, 2 KV heads
PARAMS = kq.init_params(CFG, seed=21, scale=0.2)
C, T, SHORT = 48, 12, 3  # context, continuation; the last row's context is SHORT tokens shorter


@pytest.fixture(autouse=True)
def _f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _items():
    rng = np.random.default_rng(7)
    out = []
    for i, c in enumerate((C, C, C - SHORT)):
        ids = [int(t) for t in rng.integers(0, CFG.vocab_size, c + T)]
        out.append(q.Item("text", i, ids[:c], ids[c:], np.ones(T - 1, bool), source="rand"))
    return out


def _bench(stride):
    preset = dataclasses.replace(qc.get_quality_preset("tiny"), tova_stride=stride)
    items = _items()
    bench = q.Bench(CFG, PARAMS, items, preset, C, C, q.table_width(items, preset))
    bench.prefill()
    return bench, items


def _kept_positions(positions, width):
    """bool[L, Hkv, width] from a driver's original positions (-1: an empty slot)."""
    kept = np.zeros(positions.shape[:-1] + (width + 1,), bool)
    np.put_along_axis(kept, np.where(positions >= 0, positions, width), True, axis=-1)
    return kept[..., :width]


@pytest.mark.parametrize("stride", [1, 4])
def test_the_study_row_keeps_and_predicts_what_score_stepwise_does(stride):
    bench, items = _bench(stride)
    budget = bench._keep_tokens(0.5)
    kept = bench._stepwise_context("tova", 0.5)
    width = bench.width  # the study's cache indices (the stepwise rows run on a narrow engine)
    logits = np.concatenate([np.asarray(x) for x in
                             bench._stepwise_continuation("tova", 0.5)], axis=1)
    for r, it in enumerate(items):
        # The context alone: what each (layer, head) holds when it ends.
        _, driver = kq.score_stepwise(CFG, PARAMS, [it.context], budget_tokens=budget,
                                      stride=stride, block_size=bench.preset.block_size)
        want = _kept_positions(driver.positions[0], width)
        np.testing.assert_array_equal(kept[r], want)
        assert (kept[r].sum(-1) == budget + (len(it.context) - budget) % stride).all()
        # Context and continuation: the continuation's predictions, step by step.
        (result,), _ = kq.score_stepwise(CFG, PARAMS, [it.context + it.continuation],
                                         budget_tokens=budget, stride=stride,
                                         block_size=bench.preset.block_size, return_logits=True)
        np.testing.assert_allclose(logits[r, :T], result.logits[len(it.context):], atol=2e-5,
                                   rtol=0)


def test_the_study_reports_tova_stepwise_and_its_one_shot_variant():
    bench, items = _bench(2)
    rows = {(m, v): bench.run(q.Condition(m, v, 0.5))
            for m, v in (("tova", "stepwise"), ("tova-oneshot", "oneshot"))}
    step = rows["tova", "stepwise"]
    assert all(p["variant"] == "stepwise" and p["stride"] == 2 for p in step)
    assert all("stride" not in p for p in rows["tova-oneshot", "oneshot"])
    assert all(p["budget_tokens"] == bench._keep_tokens(0.5) for p in step)
    assert all(p["kl_mean"] > 0 and p["removed_mass"] > 0 for p in step)
    conds = q.conditions(qc.get_quality_preset("tiny"), probes=False)
    assert {c.variant for c in conds if c.method == "tova"} == {"stepwise"}  # no global row
    assert {c.variant for c in conds if c.method == "tova-oneshot"} == {"oneshot"}
    assert qc.evict_policy("tova-oneshot") == ("tova", {})


@pytest.mark.parametrize("stride", [0, -1, 1.5, True, 13])  # tiny: 12 tokens past 0.75
def test_a_bad_stride_is_refused(stride):
    with pytest.raises(qc.UnknownPresetError, match="tova_stride"):
        dataclasses.replace(qc.get_quality_preset("tiny"), tova_stride=stride)
