r"""Our eviction policies against NVIDIA kvpress, on the same model and the same token ids.

    make crosscheck-kvpress                      # builds .venv-kvpress once, then runs this
    python -m experiments.crosscheck_kvpress --kvpress_python=.venv-kvpress/bin/python --json

Both sides read the same SmolLM2-135M GGUF (Q4_1 weights, dequantized to f32): we through
`kq.load_pretrained`, kvpress through HF transformers' `from_pretrained(dir, gguf_file=...)`.
The documents are windows of pydoc's topics (`pydoc_data.topics`) tokenized by OUR tokenizer;
kvpress receives those ids. For each method and budget (kept fraction of the C context tokens):

  * kvpress (`crosscheck/kvpress_side.py`, run in its own environment: torch is several GB):
    its press prunes each layer's cache at the end of the prefill; the kept positions per
    (layer, KV head) and the teacher-forced -log p of the next T tokens on the pruned cache;
  * ours: the context prefilled by `kq.PagedEngine` (the last W = 32 context tokens run as
    decode steps whose attention is recorded: SnapKV's observation window, TOVA's last query),
    `Allocator.keep_mask` and `Allocator.evict` per layer and KV head, then the same T tokens.

Each method is run with the settings that make it the rule kvpress implements (`METHODS`):
StreamingLLM 4 sinks; SnapKV window 32, kernel 7, pool "avg"; key norm and TOVA with no forced
window (kvpress keeps none; TOVA keeps the last token, the query that scores). Plain text
carries no question, so SnapKV with and without the question is one condition here. kvpress's
TOVA is one shot (the prompt's last query scores once), so it is compared with our one-shot
rule: the quality study's `tova-oneshot` (its `tova` evicts step by step, as the paper).

Reported per method and budget: the share of (document, layer, KV head) triples whose kept sets
are identical, the mean Jaccard index, the same against kvpress's scores ranked by our tie rule
(`topk_later_first`: so a difference from torch.topk's tie order shows apart from a difference
of scores), and the perplexity of each side with their relative difference (target: within
1 %). The full caches' perplexities are compared too (the two implementations of the model).

Output: a run directory (experiments/runs.py) with one point per document x method x budget and
metrics.json; --out writes the summary elsewhere (results/crosscheck/kvpress.json).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import tempfile

import numpy as np
from absl import flags

import kvquota as kq
from configs import quality as qc
from experiments import cli, quality, runs

FLAGS = flags.FLAGS
EXPERIMENT = "crosscheck_kvpress"
SIDE_SCRIPT = runs.REPO / "crosscheck" / "kvpress_side.py"
TARGET_PPL_REL = 0.01  # the bound on the perplexity difference


@dataclasses.dataclass(frozen=True)
class Method:
    """How our policy is run to be the rule of kvpress's press of the same name.

    recent: tokens our policy keeps whatever their score (kvpress: SnapKV's observation window,
      TOVA's last token, none for the others). options: the policy's other options.
    kvpress_tie: what decides kvpress's kept set among equal scores (torch.topk's order).
    study_method: the quality study's method (configs/quality.py) of our side's rule, one shot
      after the prompt as kvpress's presses are (None: the policy's own name).
    """

    recent: int
    options: tuple = ()
    kvpress_tie: str = "torch.topk's order among equal scores (unspecified by torch)"
    study_method: str | None = None


METHODS = {
    "streamingllm": Method(recent=0, options=(("sinks", 4),),
                           kvpress_tie="none: scores 1 for the 4 sinks and the recent tokens, 0 "
                                       "for exactly the pruned ones"),
    "snapkv": Method(recent=32, options=(("kernel", 7), ("pool", "avg"))),
    "knorm": Method(recent=0),
    "tova": Method(recent=1, study_method="tova-oneshot"),  # the study's "tova" is stepwise
}

OUR_TIE_RULE = "equal scores keep the later token (EvictionPolicy.keep_mask)"


def study_method(name: str) -> str:
    """The quality study's name of our side's method `name` (a key of METHODS)."""
    return METHODS[name].study_method or name


# ---- the comparison (NumPy only; tested without torch) -----------------------------------------


def topk_later_first(scores: np.ndarray, k: int) -> np.ndarray:
    """bool[..., C]: the k top-scored positions of each row of `scores` [..., C], equal scores
    keeping the later position (our tie rule)."""
    c = scores.shape[-1]
    index = np.broadcast_to(np.arange(c), scores.shape)
    order = np.lexsort((-index, -scores), axis=-1)[..., :k]
    kept = np.zeros(scores.shape, bool)
    np.put_along_axis(kept, order, True, axis=-1)
    return kept


def set_agreement(a: np.ndarray, b: np.ndarray) -> dict:
    """Kept sets a, b bool[..., C]: the share of rows (every axis but the last) where they are
    identical, the mean and the minimum Jaccard index |a & b| / |a | b| (1 for two empty
    sets)."""
    if a.shape != b.shape:
        raise ValueError(f"kept sets of different shapes {a.shape} and {b.shape}")
    inter = (a & b).sum(-1)
    union = (a | b).sum(-1)
    jaccard = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
    return {"exact": float(np.mean(np.all(a == b, axis=-1))),
            "jaccard_mean": float(np.mean(jaccard)), "jaccard_min": float(np.min(jaccard))}


def perplexity(nll: np.ndarray) -> np.ndarray:
    """Perplexity of each row of -log p [n, T - 1] (f64 mean)."""
    return np.exp(np.mean(np.asarray(nll, np.float64), axis=-1))


def compare(ours_kept, theirs_kept, theirs_scores, ours_nll, theirs_nll) -> dict:
    """One method at one budget: kept sets bool[n, L, Hkv, C] of both sides, kvpress's scores
    f32[n, L, Hkv, C], each side's -log p [n, T - 1]. Agreement with kvpress's kept sets, and
    with its scores ranked by our tie rule; perplexities and their relative difference (ours /
    kvpress - 1), per document and of the means."""
    k = int(theirs_kept[0, 0, 0].sum())
    if not (theirs_kept.sum(-1) == k).all() or not (ours_kept.sum(-1) == k).all():
        raise ValueError("every (document, layer, head) must keep the same number of tokens on "
                         f"both sides (kvpress keeps {k} in its first)")
    ours_ppl, theirs_ppl = perplexity(ours_nll), perplexity(theirs_nll)
    return {
        "kept_tokens": k,
        "agreement": set_agreement(ours_kept, theirs_kept),
        "agreement_by_scores": set_agreement(ours_kept, topk_later_first(theirs_scores, k)),
        "kvpress_ties_matter": bool(
            (topk_later_first(theirs_scores, k) != theirs_kept).any()),
        "ppl_ours": [float(x) for x in ours_ppl],
        "ppl_kvpress": [float(x) for x in theirs_ppl],
        "ppl_rel_diff": [float(x) for x in ours_ppl / theirs_ppl - 1.0],
        "ppl_rel_diff_of_means": float(ours_ppl.mean() / theirs_ppl.mean() - 1.0),
    }


def disagreement_detail(ours_kept, theirs_kept, theirs_scores, ours_scores=None,
                        max_items: int = 5) -> dict:
    """The (document, layer, head) triples whose kept sets differ: how many; whether in each
    kvpress scored the positions only we kept exactly as those only it kept (`all_ties`: a tie
    at the budget's edge, which each side's tie rule resolves); with our scores of the same
    rule (f32[n, L, Hkv, C], when given), whether each swap lies within the two sides' score
    difference in that head (`all_within_noise`: kvpress's gap between the swapped positions at
    most the largest |ours - kvpress| there, a near-tie that f32 rounding decides); and the
    first `max_items` with those positions and scores."""
    rows = list(zip(*np.nonzero(np.any(ours_kept != theirs_kept, axis=-1))))
    ties = noise = True
    first = []
    for doc, layer, head in rows:
        a, b = ours_kept[doc, layer, head], theirs_kept[doc, layer, head]
        s = theirs_scores[doc, layer, head]
        only_ours, only_theirs = np.flatnonzero(a & ~b), np.flatnonzero(b & ~a)
        gap = float(np.max(np.abs(np.sort(s[only_ours]) - np.sort(s[only_theirs]))))
        ties &= gap == 0.0
        item = {"doc": int(doc), "layer": int(layer), "head": int(head),
                "only_ours": only_ours.tolist(), "only_kvpress": only_theirs.tolist(),
                "kvpress_scores_only_ours": s[only_ours].tolist(),
                "kvpress_scores_only_kvpress": s[only_theirs].tolist(), "kvpress_gap": gap}
        if ours_scores is not None:
            o = ours_scores[doc, layer, head]
            item["score_noise"] = float(np.max(np.abs(o - s)))
            noise &= gap <= item["score_noise"]
        if len(first) < max_items:
            first.append(item)
    return {"count": len(rows), "all_ties": ties if rows else None,
            "all_within_noise": noise if rows and ours_scores is not None else None,
            "first": first}


def key_norms(state, seq_ids, context: int) -> np.ndarray:
    """f32[n, L, Hkv, C]: the L2 norm of each cached key (pool 0's pages through the block
    tables) of the first `context` tokens: knorm's statistic, read from our cache."""
    k = np.asarray(state.pages[0].k)  # [L, Hkv, blocks, block_size, D]
    p = k.shape[3]
    tables = np.asarray(state.seqs.block_tables)[seq_ids]
    i = np.arange(context)
    return np.stack([np.linalg.norm(k[:, :, t[i // p], i % p], axis=-1) for t in tables])


# ---- the two sides ------------------------------------------------------------------------------


def run_kvpress(python: str, request: dict, workdir: pathlib.Path) -> tuple[dict, dict]:
    """Runs crosscheck/kvpress_side.py in kvpress's environment; returns (its arrays, its
    record: versions, model, presses)."""
    req, out = workdir / "request.json", workdir / "kvpress.npz"
    req.write_text(json.dumps(request))
    proc = subprocess.run([python, str(SIDE_SCRIPT), f"--request={req}", f"--out={out}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"the kvpress side failed (exit {proc.returncode}): {tail}")
    with np.load(out) as data:
        arrays = {key: data[key] for key in data.files}
    return arrays, json.loads(out.with_suffix(".json").read_text())


def our_side(config: dict, docs: list, preset) -> tuple[dict, np.ndarray, np.ndarray]:
    """Our engine on the same documents: {condition key: (kept bool[n, L, Hkv, C], -log p
    [n, T - 1])}, the full cache's -log p [n, T - 1] and its key norms f32[n, L, Hkv, C]."""
    model_config, params = kq.load_pretrained(config["model"])
    c = preset.contexts[0]
    bench = quality.Bench(model_config, params, docs, preset, c, c,
                          quality.table_width(docs, preset))
    # Only the window's decode steps record attention: kvpress's SnapKV observes those 32
    # queries alone (a prefill that recorded too would add every other query's mass).
    bench.engine.record_attention = "decode"
    bench.prefill()
    t = preset.continuation_tokens
    eng, alloc = bench.engine, bench.alloc
    out = {}
    for name in config["methods"]:
        method = METHODS[name]
        options = dict(method.options, recent=method.recent)
        for budget in config["budgets"]:
            keep = int(round(budget * c))
            kept = np.asarray(alloc.keep_mask(bench.base, bench.seqs, policy=name,
                                              keep_tokens=keep, attention=bench.last_mass,
                                              **options))[..., :c]
            eng.state, eng.last_mass = kq.serving.branch(bench.base), bench.last_mass
            eng.state, _ = alloc.evict(eng.state, bench.seqs, policy=name, keep_tokens=keep,
                                       attention=bench.last_mass, donate=True, **options)
            alloc.check(eng.state)
            logits = kq.serving.extend(eng, bench.seqs, bench.cont, lengths=bench.cont_len)
            _, nll, _ = bench._host_metrics([quality._log_softmax(x) for x in logits])
            out[key(name, budget)] = (kept, nll[:, :t - 1])
    return out, bench.ref[1][:, :t - 1], key_norms(bench.base, bench.seqs, c)


def key(method: str, budget: float) -> str:
    """The condition's name on both sides ("<method>@<budget>")."""
    return f"{method}@{budget:g}"


# ---- the run ------------------------------------------------------------------------------------


def crosscheck_preset(config: dict) -> qc.QualityPreset:
    """The quality protocol's sizes for these documents (window W = 32, blocks of 16)."""
    return dataclasses.replace(
        qc.get_quality_preset("quick"), name="crosscheck", num_docs=config["num_docs"],
        min_docs=config["num_docs"], contexts=(config["context_tokens"],),
        continuation_tokens=config["continuation_tokens"], budgets=tuple(config["budgets"]),
        global_budgets=(), methods=tuple(config["methods"]),
        tova_stride=1)  # no stepwise method runs here


def measure(config: dict, add_point) -> dict:
    preset = crosscheck_preset(config)
    tok = kq.load_tokenizer(config["model"])
    c = config["context_tokens"]
    docs = quality.documents(tok.encode(quality.pydoc_text()), preset, "pydoc", c)
    request = {"gguf": str(kq.smollm2_gguf_path()), "context_tokens": c,
               "ids": [d.context + d.continuation for d in docs],
               "methods": config["methods"], "budgets": config["budgets"]}
    with tempfile.TemporaryDirectory() as tmp:
        theirs, record = run_kvpress(config["kvpress_python"], request, pathlib.Path(tmp))
    ours, ours_full, norms = our_side(config, docs, preset)
    full = {"ppl_ours": [float(x) for x in perplexity(ours_full)],
            "ppl_kvpress": [float(x) for x in perplexity(theirs["full/nll"])]}
    full["ppl_rel_diff"] = [o / k - 1.0 for o, k in zip(full["ppl_ours"], full["ppl_kvpress"])]
    results = {}
    for name in config["methods"]:
        for budget in config["budgets"]:
            k = key(name, budget)
            kept, nll = ours[k]
            row = compare(kept, theirs[f"{k}/kept"], theirs[f"{k}/scores"], nll,
                          theirs[f"{k}/nll"])
            row["differing"] = disagreement_detail(
                kept, theirs[f"{k}/kept"], theirs[f"{k}/scores"],
                -norms if name == "knorm" else None)  # the one score we read back
            row["within_target"] = abs(row["ppl_rel_diff_of_means"]) <= TARGET_PPL_REL
            results[k] = row
            for d in range(len(docs)):
                add_point({"method": name, "budget": budget, "doc": d,
                           **set_agreement(kept[d], theirs[f"{k}/kept"][d]),
                           "ppl_ours": row["ppl_ours"][d], "ppl_kvpress": row["ppl_kvpress"][d]})
    return {
        "results": results,
        "full_cache": full,
        "settings": {name: {"ours": {"policy": name, "recent": METHODS[name].recent,
                                     **dict(METHODS[name].options)},
                            "quality_study_method": study_method(name),
                            "kvpress": record["presses"].get(key(name, config["budgets"][0])),
                            "tie_rule_ours": OUR_TIE_RULE,
                            "tie_rule_kvpress": METHODS[name].kvpress_tie}
                     for name in config["methods"]},
        "kvpress_side": record,
        "documents": {"source": "pydoc_data.topics", "count": len(docs),
                      "context_tokens": c, "continuation_tokens": preset.continuation_tokens,
                      "tokenizer": "ours (kq.load_tokenizer)"},
        "snapkv_question": "plain text carries no question: SnapKV with and without it is "
                           "the same condition here",
    }


def define_flags():
    flags.DEFINE_string("kvpress_python", ".venv-kvpress/bin/python",
                        "The Python of kvpress's environment (`make crosscheck-kvpress` builds "
                        "it).")
    flags.DEFINE_integer("num_docs", 3, "Documents (windows of pydoc's topics).", lower_bound=1,
                         upper_bound=64)
    flags.DEFINE_integer("context_tokens", 512, "Context tokens C per document.",
                         lower_bound=64, upper_bound=8192)
    flags.DEFINE_integer("continuation_tokens", 96, "Tokens T teacher-forced after the context.",
                         lower_bound=2, upper_bound=1024)
    flags.DEFINE_list("methods", list(METHODS), f"Methods, of: {', '.join(METHODS)}.")
    flags.DEFINE_list("budgets", ["0.25", "0.5"], "Kept fractions of the context, in (0, 1).")
    runs.define_flags()

    def methods_ok(values):
        bad = [v for v in values or () if v not in METHODS]
        if bad or not values:
            raise flags.ValidationError(f"unknown methods {bad}; use some of: "
                                        f"{', '.join(METHODS)}")
        return True

    def budgets_ok(values):
        try:
            numbers = [float(v) for v in values]
        except ValueError:
            raise flags.ValidationError(f"--budgets must be numbers, got {values}") from None
        if not numbers or any(not 0 < b < 1 for b in numbers):
            raise flags.ValidationError(f"--budgets must be fractions in (0, 1), got {values}")
        return True

    flags.register_validator("methods", methods_ok)
    flags.register_validator("budgets", budgets_ok)


def main(argv):
    del argv
    python = pathlib.Path(FLAGS.kvpress_python)
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise cli.BadInput(f"--kvpress_python={python}: no such executable (`make "
                           "crosscheck-kvpress` builds .venv-kvpress)")
    config = {"model": "smollm2-135m", "num_docs": FLAGS.num_docs,
              "context_tokens": FLAGS.context_tokens,
              "continuation_tokens": FLAGS.continuation_tokens,
              "methods": list(FLAGS.methods), "budgets": [float(b) for b in FLAGS.budgets],
              "kvpress_python": str(python)}
    keep_min = min(config["budgets"]) * config["context_tokens"]
    if keep_min < METHODS["snapkv"].recent + 1:
        raise cli.BadInput(f"the smallest budget keeps {keep_min:g} tokens: SnapKV needs more "
                           f"than its {METHODS['snapkv'].recent}-token window")
    runs.execute(EXPERIMENT, config, lambda add_point: measure(config, add_point), seed=0,
                 describe=describe)


def describe(summary: dict) -> str:
    """One line per method x budget."""
    lines = [f"{'condition':<18}{'exact':>8}{'jaccard':>9}{'by scores':>11}{'ppl ours':>10}"
             f"{'ppl kvpress':>13}{'rel diff':>10}"]
    for name, r in summary["results"].items():
        lines.append(f"{name:<18}{r['agreement']['exact']:>8.3f}"
                     f"{r['agreement']['jaccard_mean']:>9.4f}"
                     f"{r['agreement_by_scores']['exact']:>11.3f}"
                     f"{np.mean(r['ppl_ours']):>10.3f}{np.mean(r['ppl_kvpress']):>13.3f}"
                     f"{r['ppl_rel_diff_of_means']:>10.5f}")
    f = summary["full_cache"]
    lines.append(f"{'full cache':<18}{'':>28}{np.mean(f['ppl_ours']):>10.3f}"
                 f"{np.mean(f['ppl_kvpress']):>13.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    cli.run(main, define_flags)
