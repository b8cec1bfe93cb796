r"""The quality cost of every lossy reclaim means, against the bytes it really frees.

    python -m experiments.quality --json                          # the default sweep
    python -m experiments.quality --preset=quick --text_file=F    # any text of >= 500 tokens
    python -m experiments.quality --model=qwen2.5-0.5b --model_dir=DIR   # a Qwen2 checkpoint

Protocol (the clean one of the KV-compression literature, as kvpress runs it): the documents'
contexts (C tokens each) are prefilled once into one paged state, one sequence and one tenant
per document (so the ledger gives each document's bytes), in chunks of one block; the last W
tokens (the window) also run as decode steps on a copy of the state, and the attention those
steps gave each cached token (the kernels' mass output) is recorded into the prefilled state:
what H2O, SnapKV and TOVA score. Every condition then starts from a copy of that same state
(`kq.serving.branch`: one copy, after which every op donates), applies one means at one budget
to all documents at once,
and teacher-forces the next T tokens (`kq.serving.extend`, one block per chunk); its next-token
distributions are compared with those of the untouched cache on the same tokens. The untouched
cache is also run as a condition (`none`): its differences must be exactly 0. Quantizers also
run "streaming": compressing as the cache fills, before each block attends (the context is
prefilled again for them, through the same code path as the shared prefill).

Methods: fp8, int8, int4, kivi2, kivi4 (every full block outside the W-token full-precision
window compressed; one row each, `budget_fraction` = cache bytes kept), streamingllm, h2o,
snapkv, tova, knorm, random (token eviction to `budget` x C kept tokens, the window always
kept, each layer and KV head choosing its own tokens, as the papers and kvpress do) and tiered (the reclaim planner's tiered order under a byte-quota cut of each document's
tenant to `budget` x its bytes; a preempted document is recomputed on resume: lossless).

Metrics per document: delta_ppl = ppl_modified - ppl_full, delta_ppl_rel = delta / ppl_full (a
fraction), KL(full || modified) of the next-token distributions (mean, p90, p99 over the T - 1
predicted tokens), top-1 agreement, and the fraction of the full cache's attention over the first
MASS_STEPS = 32 continuation tokens (decode-step mass, every layer and KV head) that fell on the
tokens a method removed from that head (`removed_mass`) or compressed (`compressed_mass`).
Retrieval probes run on a second state: a pass key hidden at several depths of pydoc filler and
asked for at the end, and a multi-turn chat whose first turn states a fact asked for in the
last; a probe is retrieved when every answer token is the modified model's top-1, and
`answer_kept` is the share of (layer, KV head) pairs still holding every token of the answer
where the context states it. Bytes freed are each tenant's device bytes in the
ledger before minus after the means; means carry 95 % bootstrap intervals over documents.

Output: a run directory (experiments/runs.py) with config.json, points.jsonl (one object per
document or probe x method x budget), metrics.json (per method x budget, no timings: a rerun
with the same seed is byte-identical), quality.csv, pareto.png, retrieval_depth.png,
kl_distributions.png (drawn from those files only) and timing.json. --out_dir also copies
them, with command.txt, to a results directory. Flags are checked before the weights load.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import kvquota as kq
from configs import quality as qc
from experiments import cli, runs

FLAGS = flags.FLAGS
EXPERIMENT = "quality"
MODULE = "experiments.quality"
MiB = 1 << 20
KL_EDGES = np.linspace(-9.0, 2.0, 45)  # log10 KL bins of the distributions (0 and below: first)
OUTPUT_FLAGS = ("runs_dir", "overwrite", "out", "out_dir", "json")  # where results go, not what
PLOTS = ("pareto.png", "retrieval_depth.png", "kl_distributions.png")
CSV_NAME = "quality.csv"
VARIANTS = ("control", "oneshot", "global", "streaming")  # the order of tables and plots
MASS_STEPS = 32  # continuation tokens whose full-cache attention prices what a method removed
branch, extend = kq.serving.branch, kq.serving.extend


# ---- data: documents and probes ---------------------------------------------------------------


@dataclasses.dataclass
class Item:
    """One row of a state: a document or a probe.

    scored: bool[len(continuation) - 1]: prediction j (made at continuation position j) of
    continuation[j + 1] counts. For a probe, the answer's tokens.
    """

    kind: str  # "text", "passkey" or "chat"
    index: int
    context: list
    continuation: list
    scored: np.ndarray
    depth: float | None = None
    answer: str | None = None
    needle: tuple = ()  # context indices of the answer's tokens (probes)


def pydoc_text() -> str:
    """The standard library's pydoc topics (~465K characters of English prose), in key order."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def documents(ids, preset: qc.QualityPreset, source: str) -> list[Item]:
    """Up to num_docs windows of C + T tokens, evenly spaced over the text, not overlapping."""
    c, t = preset.context_tokens, preset.continuation_tokens
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
        out.append(Item("text", i, doc[:c], doc[c:], np.ones(t - 1, bool)))
    return out


def _answer_tail(tok, head: str, answer: str):
    """(tokens of head + answer, bool mask of the answer's non-space tokens). The head's tokens
    must be a prefix (checked: a probe whose answer merges with its question is a bug)."""
    lead = tok.encode(head)
    full = tok.encode(head + answer)
    if full[:len(lead)] != lead:
        raise RuntimeError(f"probe tokenization: {head!r} is not a token prefix of its answer")
    mask = np.zeros(len(full), bool)
    mask[len(lead):] = [bool(tok.decode([x]).strip()) for x in full[len(lead):]]
    return full, mask


def _probe_item(kind, index, context, continuation, mask, **extra) -> Item:
    return Item(kind, index, [int(x) for x in context], [int(x) for x in continuation],
                mask[1:].copy(), **extra)


def passkey_probes(tok, filler, preset: qc.QualityPreset) -> list[Item]:
    """A 5-digit key in a sentence hidden at a depth of pydoc filler, asked for at the end (the
    question and the key are the continuation; the key's digits are scored)."""
    rng = np.random.default_rng(preset.seed)
    out = []
    for i in range(preset.passkey_probes):
        depth = preset.passkey_depths[i % len(preset.passkey_depths)]
        key = str(int(rng.integers(10000, 100000)))
        needle = tok.encode(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")
        room = preset.probe_context - len(needle)
        if room < preset.window + preset.block_size:
            raise cli.BadInput(f"probe_context {preset.probe_context} leaves {room} tokens of "
                               f"filler beside the pass key's {len(needle)}: too few")
        at = int(round(depth * room))
        start = (i * 997) % max(1, len(filler) - room)
        body = filler[start:start + room]
        context = body[:at] + needle + body[at:]
        cont, mask = _answer_tail(tok, "\nWhat is the pass key? The pass key is", f" {key}")
        digits = tuple(at + j for j, t in enumerate(needle) if tok.decode([t]).strip().isdigit())
        out.append(_probe_item("passkey", i, context, cont, mask, depth=depth, answer=key,
                               needle=digits))
    return out


# A fact stated in the first turn and asked for in the last: (statement, question, answer lead,
# answer). Fixed before any run; the full cache's accuracy is reported beside every method's.
FACTS = (
    ("My name is Sarah.", "What is my name?", "Your name is", " Sarah"),
    ("I live in Lisbon.", "Which city do I live in?", "You live in", " Lisbon"),
    ("My dog is called Biscuit.", "What is my dog called?", "Your dog is called", " Biscuit"),
    ("My favourite colour is purple.", "What is my favourite colour?",
     "Your favourite colour is", " purple"),
    ("I work as a pharmacist.", "What do I work as?", "You work as a", " pharmacist"),
    ("My sister is called Mira.", "What is my sister called?", "Your sister is called",
     " Mira"),
    ("I was born in Oslo.", "Where was I born?", "You were born in", " Oslo"),
    ("My car is a green Volvo.", "What car do I have?", "You have a green", " Volvo"),
    ("My cat is named Pepper.", "What is my cat named?", "Your cat is named", " Pepper"),
    ("I play the cello.", "Which instrument do I play?", "You play the", " cello"),
    ("My teacher was Mr Grant.", "Who was my teacher?", "Your teacher was Mr", " Grant"),
    ("I grew up in Dublin.", "Where did I grow up?", "You grew up in", " Dublin"),
)


def chat_probes(tok, filler, preset: qc.QualityPreset) -> list[Item]:
    """Multi-turn chats: a fact in the first user turn, a turn of pydoc text to summarise, then
    (after the means) the question and the assistant's answer, teacher-forced."""
    if tok.chat_template is None or not preset.chat_probes:
        return []
    out = []
    for i in range(preset.chat_probes):
        fact, question, lead, answer = FACTS[i % len(FACTS)]

        def turns(n):
            start = 5000 + 3001 * i
            text = tok.decode(filler[start % max(1, len(filler) - n):][:n])
            return [
                {"role": "user", "content": f"Hello! {fact} Please remember it."},
                {"role": "assistant", "content": "Nice to meet you! I will remember that."},
                {"role": "user", "content": "Here is some documentation:\n" + text},
                {"role": "assistant", "content": "Thank you. Ask me anything about it."}]

        def context_ids(n):
            return tok.encode(tok.apply_chat_template(turns(n), add_generation_prompt=False))

        n = preset.probe_context
        for _ in range(3):  # the filler's length, so the context is about probe_context tokens
            n = max(1, n - (len(context_ids(n)) - preset.probe_context))
        context = context_ids(n)
        if abs(len(context) - preset.probe_context) >= preset.block_size:
            raise cli.BadInput(f"probe_context {preset.probe_context} is too short for the "
                               f"chat probe's turns ({len(context)} tokens)")
        # The last turn as the template renders it after the others (no second system prompt).
        before = tok.apply_chat_template(turns(n), add_generation_prompt=False)
        whole = tok.apply_chat_template(turns(n) + [{"role": "user", "content": question}])
        if not whole.startswith(before):
            raise RuntimeError("the chat template renders earlier turns differently")
        head = whole[len(before):]
        cont, mask = _answer_tail(tok, head + lead, answer)
        word = [t for t, m in zip(cont, mask) if m]  # the answer's tokens, as stated in turn 1
        at = next((j for j in range(len(context) - len(word) + 1)
                   if context[j:j + len(word)] == word), None)
        needle = () if at is None else tuple(range(at, at + len(word)))
        out.append(_probe_item("chat", i, context, cont, mask, answer=answer.strip(),
                               needle=needle))
    return out


# ---- conditions ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Condition:
    """One method at one budget: variant "control" (none), "oneshot" (after the prefill; an
    eviction chooses per layer and KV head), "global" (an eviction choosing one set for the whole
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
    """The conditions of the text set (probes=False) or of the probe set."""
    out = [Condition(qc.CONTROL, "control")]
    for m in preset.methods:
        if m in qc.QUANT_METHODS:
            out.append(Condition(m, "oneshot"))
        elif m in qc.EVICT_METHODS:
            budgets = preset.probe_budgets if probes else preset.budgets
            out += [Condition(m, "oneshot", f) for f in budgets]
            if not probes:
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
                 nominal: int, width: int):
        self.items, self.preset, self.nominal = items, preset, nominal
        n, p = len(items), preset.block_size
        formats = [m for m in preset.methods if m in qc.QUANT_METHODS] or ["int8"]
        if "tiered" in preset.methods and "int8" not in formats:
            formats.append("int8")
        self.formats = formats
        sc = kq.StateConfig(model=model_config, num_blocks=n * width + n, block_size=p,
                            max_seqs=n, max_blocks_per_seq=width, num_tenants=n,
                            kv_format="f32",
                            compressed_pools=tuple((f, n * width) for f in formats))
        self.engine = kq.PagedEngine(model_config, params, sc, chunk_size=p,
                                     record_attention=True)
        for t in range(n):
            self.engine.register_tenant(t, token_quota=2**31 - 1,
                                        byte_quota=self.engine.max_byte_quota)
        self.empty = branch(self.engine.state)
        self.ctx_len = np.array([len(i.context) for i in items], np.int32)
        self.cont_len = np.array([len(i.continuation) for i in items], np.int32)
        self.cont = np.zeros((n, -(-int(self.cont_len.max()) // p) * p), np.int32)  # chunks
        for r, it in enumerate(items):
            self.cont[r, :len(it.continuation)] = it.continuation
        self.targets = np.zeros_like(self.cont)
        self.targets[:, :-1] = self.cont[:, 1:]
        self.seqs = None

    @property
    def alloc(self):
        return self.engine.allocator

    def device_bytes(self, state) -> np.ndarray:
        """int64[n]: device bytes charged to each row's tenant, from the ledger."""
        return np.asarray(self.alloc.ledger(state).device_bytes, np.int64)[:len(self.items)]

    def _body(self, lo, hi):
        """tokens i32[n, width] and lengths i32[n]: context[lo:len - hi] of each row."""
        out = np.zeros((len(self.items), int(self.ctx_len.max())), np.int32)
        for r, it in enumerate(self.items):
            part = it.context[lo:len(it.context) - hi]
            out[r, :len(part)] = part
        return out, (self.ctx_len - hi - lo).astype(np.int32)

    def context_phase(self, hook=None):
        """Prefill every context from an empty state, in block-sized chunks (the first block
        admitted, then `extend`), `hook(engine, rows)` before each chunk and once at the end
        (streaming compression). Leaves the state in the engine.

        Without a hook, the window's attention is observed too: on a copy of the state before
        the window, its W tokens run as decode steps that return the kernels' attention mass;
        their sum is recorded into the real state (`Allocator.record_attention`), which
        then holds what W decode steps would have recorded, and the window's K/V come from the
        same chunked path as a streaming run's (so a streaming run with nothing to compress is
        the shared prefill, bit for bit). Returns the last step's attention f32[n, L, Hkv,
        width] (per layer and KV head, as eviction scores it)."""
        eng, p, w = self.engine, self.preset.block_size, self.preset.window
        eng.state, eng.last_mass = branch(self.empty), None
        n = len(self.items)
        # last_only=False: the same compiled forward as every later chunk.
        report, _ = eng.admit(list(range(n)), [it.context[:p] for it in self.items],
                              last_only=False)
        if not np.asarray(report.admitted).all():
            raise RuntimeError(f"admission refused: {report.reasons()}")
        self.seqs = np.asarray(report.seq_id, np.int32)
        body, lens = self._body(p, w)
        extend(eng, self.seqs, body, lengths=lens, before_chunk=hook)
        observed = None if hook is not None else branch(eng.state)
        window = np.stack([np.asarray(it.context[-w:], np.int32) for it in self.items])
        extend(eng, self.seqs, window, before_chunk=hook)
        if hook is not None:  # what the continuation's first block will attend to
            hook(eng, self.seqs)
            return None
        main, eng.state = eng.state, observed
        m = eng.config
        total = np.zeros((n, m.num_layers, m.num_kv_heads, eng.state_config.max_tokens_per_seq),
                         np.float64)
        for j in range(w):
            rep, _ = eng.decode(self.seqs, window[:, j])
            if not np.asarray(rep.appended).all():
                raise RuntimeError(f"decode refused: {rep.reasons()}")
            total += np.asarray(eng.last_mass, np.float64)
        last = np.asarray(eng.last_mass)
        eng.state = main
        eng.state, _ = self.alloc.record_attention(eng.state, self.seqs, total.astype(np.float32),
                                                   donate=True)
        return last

    def prefill(self):
        """The shared prefill; then the reference continuation: its log-probabilities (kept on
        the device), nll and top-1, and (decode steps on another copy) the attention mass each
        cached token receives in each layer and KV head over the first MASS_STEPS continuation
        tokens, as a share of all of it (`future_mass` [n, L, Hkv, width])."""
        self.last_mass = self.context_phase()
        self.base = self.engine.state
        self._base_pages = None  # host copies of its pool-0 K/V (`_check_survivors`)
        self.alloc.check(self.base)
        self.base_bytes = self.device_bytes(self.base)
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
        w = self.preset.window

        def hook(eng, rows):
            eng.state, _ = eng.allocator.compress(eng.state, rows, kv_format=fmt,
                                                  keep_recent=w, donate=True)
        return hook

    def _keep_tokens(self, fraction) -> int:
        """Tokens kept at `fraction` of the set's nominal context (C, or the probes' context;
        the chats' differ from it by less than a block): one evict call for every row."""
        return max(int(round(fraction * self.nominal)), self.preset.window)

    def _evict(self, method, fraction, aggregate):
        """Token eviction of every row to its budget, each layer and KV head choosing its own
        tokens (`aggregate` "head") or one set for the whole model ("global"); returns
        bool[n, L, Hkv, width] kept (the policy's own mask, recomputed from the inputs `evict`
        read and checked against the state's pages)."""
        eng, w = self.engine, self.preset.window
        keep = self._keep_tokens(fraction)
        options = {"seed": self.preset.seed} if method == "random" else {}
        kept = self._keep_mask(method, keep, options, aggregate)
        eng.state, _ = self.alloc.evict(eng.state, self.seqs, policy=method, keep_tokens=keep,
                                        recent=min(w, keep), attention=self.last_mass,
                                        aggregate=aggregate, donate=True, **options)
        self._check_survivors(kept)
        return kept

    def _keep_mask(self, method, keep, options, aggregate):
        """The policy's keep mask of every row of the prefilled state, bool[n, L, Hkv, width]
        (`Allocator.keep_mask`: what evict with these arguments keeps)."""
        mask = self.alloc.keep_mask(self.base, self.seqs, policy=method, keep_tokens=keep,
                                    recent=min(self.preset.window, keep), aggregate=aggregate,
                                    attention=self.last_mass, **options)
        m = self.engine.state_config.model
        return np.broadcast_to(mask, (len(self.seqs), m.num_layers, m.num_kv_heads,
                                      mask.shape[-1]))

    def _check_survivors(self, kept):
        """In every layer and KV head the evicted state holds exactly the K and V of the context
        tokens the mask keeps for that head, in order."""
        p = self.preset.block_size
        if self._base_pages is None:  # the prefilled state's pages, read once for every method
            self._base_pages = [np.asarray(a) for a in (self.base.pages[0].k,
                                                         self.base.pages[0].v)]
        pages = self._base_pages
        now = [np.asarray(a) for a in (self.engine.state.pages[0].k,
                                        self.engine.state.pages[0].v)]
        tables = [np.asarray(st.seqs.block_tables)[self.seqs] for st in (self.base,
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

    def run(self, cond: Condition) -> list[dict]:
        """One condition on every row: the means, the ledger, the continuation, the metrics."""
        eng, n = self.engine, len(self.items)
        width = eng.state_config.max_tokens_per_seq
        m = eng.config
        removed = np.zeros((n, m.num_layers, m.num_kv_heads, width), bool)  # per head
        compressed = np.zeros((n, width), bool)
        fates = [None] * n
        hook = None
        if cond.variant == "streaming":
            hook = self._compress_hook(cond.method)
            self.context_phase(hook)
        else:
            eng.state, eng.last_mass = branch(self.base), self.last_mass
        if cond.method in qc.QUANT_METHODS:
            if cond.variant == "oneshot":
                self._compress_hook(cond.method)(eng, self.seqs)
            compressed = self._compressed()
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
        rows = np.where(live, self.seqs, kq.INVALID).astype(np.int32)
        if live.any():
            logits = extend(eng, rows, self.cont, lengths=np.where(live, self.cont_len, 0),
                            before_chunk=hook)
            kl, nll, top1 = self._host_metrics([_log_softmax(c) for c in logits])
        kept_tokens = np.where(live, np.asarray(eng.state.seqs.seq_lens)[self.seqs], 0)
        out = []
        for r, it in enumerate(self.items):
            if live[r]:
                row = (kl[r], nll[r], top1[r])
            else:
                row = (np.zeros_like(self.ref[0][r]), self.ref[1][r], self.ref[2][r])
            out.append(self._point(cond, r, it, row, after[r], removed[r], compressed[r],
                                   fates[r], int(kept_tokens[r]) if live[r] else None))
        return out

    def _point(self, cond, r, it, row, after, removed, compressed, fate, cached):
        """The record of one row under one condition."""
        kl, nll, top1 = row
        m = it.scored
        before = int(self.base_bytes[r])
        c = len(it.context)
        budget = {"control": 1.0, "streaming": None}.get(cond.variant, cond.budget)
        point = dict(kind=it.kind, item=it.index, method=cond.method, variant=cond.variant,
                     budget=cond.budget, bytes_before=before, bytes_after=int(after),
                     bytes_freed=before - int(after), budget_bytes=int(after),
                     budget_fraction=_r(budget if budget is not None else after / before),
                     byte_fraction_kept=_r(after / before), context_tokens=c,
                     cached_context_tokens=cached, fate=fate,
                     removed_mass=_r(self.future_mass[r][removed].sum()),
                     compressed_mass=_r(self.future_mass[r][..., compressed].sum()),
                     delta_ppl=None, delta_ppl_rel=None, kl_mean=None, kl_p90=None,
                     kl_p99=None, top1_agreement=None, retrieval_accuracy=None,
                     depth=it.depth, answer=it.answer)
        if cond.method in qc.EVICT_METHODS:
            point["budget_tokens"] = self._keep_tokens(cond.budget)
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
    """Per method x variant x budget: means over the documents with 95 % bootstrap intervals,
    bytes (means of the ledger's figures), retrieval over the probes; and the orderings the
    literature expects, each with the numbers it compared."""
    groups: dict[tuple, list] = {}
    for p in points:
        groups.setdefault((p["method"], p["variant"], p["budget"]), []).append(p)
    methods: dict[str, list] = {}
    for i, ((method, variant, budget), group) in enumerate(groups.items()):
        rng = np.random.default_rng([preset.seed, i])
        text = [p for p in group if p["kind"] == "text"]
        probes = [p for p in group if p["kind"] != "text"]
        row = dict(method=method, variant=variant, budget=budget, n_docs=len(text),
                   n_probes=len(probes))
        for key in ("budget_fraction", "budget_bytes", "bytes_before", "bytes_freed",
                    "byte_fraction_kept", "budget_tokens"):
            values = [p[key] for p in text if p.get(key) is not None]
            row[key] = _mean(values)
        for key in TEXT_METRICS:
            values = [p[key] for p in text]
            row[key] = _mean(values)
            row[f"{key}_ci"] = bootstrap(values, preset.bootstrap, rng) if values else None
        hits = [p["retrieval_accuracy"] for p in probes]
        row["retrieval_accuracy"] = _mean(hits)
        row["retrieval_accuracy_ci"] = bootstrap(hits, preset.bootstrap, rng) if hits else None
        for kind in ("passkey", "chat"):
            row[f"{kind}_accuracy"] = _mean([p["retrieval_accuracy"] for p in probes
                                            if p["kind"] == kind])
        row["answer_kept"] = _mean([p["answer_kept"] for p in probes if "answer_kept" in p])
        fates = [p["fate"] for p in group if p["fate"] is not None]
        if fates:
            row["fates"] = {name: fates.count(name) for name in sorted(set(fates))}
        methods.setdefault(method, []).append(row)
    control = [p for p in points if p["method"] == qc.CONTROL and p["kind"] == "text"]
    return {"methods": methods, "orderings": orderings(methods),
            "control_exact": bool(control) and all(
                p["delta_ppl"] == 0.0 and p["kl_mean"] == 0.0 and p["kl_p99"] == 0.0
                and p["top1_agreement"] == 1.0 and p["bytes_freed"] == 0 for p in control)}


def _nearest(rows, target=0.5):
    rows = [r for r in rows if r["budget"] is not None and r["variant"] == "oneshot"]
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
    for m in ("streamingllm", "h2o", "snapkv"):
        row = _nearest([x for x in methods.get(m, []) if x["retrieval_accuracy"] is not None])
        acc[m] = None if row is None else row["retrieval_accuracy"]
    out["attention_aware_retrieval_ge_streamingllm"] = {
        "holds": None if None in acc.values() else min(acc["h2o"], acc["snapkv"])
        >= acc["streamingllm"], "retrieval_accuracy": acc}
    return out


CSV_COLUMNS = ("method", "variant", "budget", "budget_fraction", "budget_tokens", "budget_bytes",
               "bytes_before", "bytes_freed", "byte_fraction_kept", "n_docs", "n_probes",
               *[k for m in TEXT_METRICS for k in (m, f"{m}_ci_low", f"{m}_ci_high")],
               "retrieval_accuracy", "retrieval_accuracy_ci_low", "retrieval_accuracy_ci_high",
               "passkey_accuracy", "chat_accuracy", "answer_kept")


def ordered(metrics: dict) -> list[dict]:
    """Every summary row: the control, then the methods in METHODS order, variants in VARIANTS
    order, budgets increasing (metrics.json sorts its keys; tables and plots do not)."""
    names = [qc.CONTROL, *qc.METHODS]
    rows = [r for rs in metrics["methods"].values() for r in rs]
    return sorted(rows, key=lambda r: (names.index(r["method"]) if r["method"] in names
                                       else len(names), r["method"], VARIANTS.index(r["variant"]),
                                       -1.0 if r["budget"] is None else r["budget"]))


def write_csv(metrics: dict, path: pathlib.Path) -> None:
    """One row per method x variant x budget of metrics.json."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for row in ordered(metrics):
            flat = dict(row)
            for key in (*TEXT_METRICS, "retrieval_accuracy"):
                ci = row.get(f"{key}_ci") or [None, None]
                flat[f"{key}_ci_low"], flat[f"{key}_ci_high"] = ci
            writer.writerow(["" if flat.get(c) is None else flat[c] for c in CSV_COLUMNS])


# ---- plots (from points.jsonl and metrics.json only) -------------------------------------------


def _label(row) -> str:
    return row["method"] if row["variant"] == "oneshot" else f"{row['method']} ({row['variant']})"


def method_colors(plt, metrics) -> dict:
    """One color per method, in metrics order (the same in every plot)."""
    names = [m for m in dict.fromkeys(r["method"] for r in ordered(metrics)) if m != qc.CONTROL]
    return {m: plt.cm.tab20(2 * i % 20 + (i >= 10)) for i, m in enumerate(names)}


def pareto_front(xy):
    """Indices of the points no other point beats: at least as many bytes freed and at most as
    much quality lost, better in one."""
    front = []
    for i, (x, y) in enumerate(xy):
        if not any((x2 >= x and y2 <= y) and (x2 > x or y2 < y) for x2, y2 in xy):
            front.append(i)
    return sorted(front, key=lambda i: xy[i][0])


def plot(points, metrics, out_dir) -> list[str]:
    """pareto.png, retrieval_depth.png, kl_distributions.png (and quality.csv, the table)."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    write_csv(metrics, out_dir / CSV_NAME)
    rows = [r for r in ordered(metrics)
            if r["method"] != qc.CONTROL and r["delta_ppl_rel"] is not None]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = method_colors(plt, metrics)
    markers = {"oneshot": "o", "global": "^", "streaming": "s"}
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.2))
    for ax, key, title in ((axes[0], "delta_ppl_rel", "relative perplexity increase"),
                           (axes[1], "kl_mean", "mean KL(full || modified), nats")):
        every = []
        for m in methods:
            for variant in markers:
                mine = [r for r in rows if r["method"] == m and r["variant"] == variant]
                if not mine:
                    continue
                xy = [(r["bytes_freed"] / MiB, r[key]) for r in mine]
                every += xy
                ax.scatter(*zip(*xy), color=colors[m], marker=markers[variant], s=24,
                           facecolors=colors[m] if variant == "oneshot" else "none",
                           label=_label(mine[0]))
                front = pareto_front(xy)
                ax.plot([xy[i][0] for i in front], [xy[i][1] for i in front],
                        color=colors[m], lw=1, ls="-" if variant == "oneshot" else ":")
        front = pareto_front(every)
        ax.plot([every[i][0] for i in front], [every[i][1] for i in front], "k--", lw=0.8,
                label="front of all methods")
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_xlabel("bytes freed per document (MiB, from the ledger)")
        ax.set_ylabel(key)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("quality lost vs bytes freed: means over documents; lines: each method's "
                 "Pareto front (hollow: streaming, triangles: one kept set for the whole model)")
    fig.tight_layout()
    fig.savefig(out_dir / "pareto.png", dpi=120)
    plt.close(fig)
    written.append("pareto.png")

    passkey = [p for p in points if p.get("kind") == "passkey"]
    if passkey:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        keys = list(dict.fromkeys((p["method"], p["variant"], p["budget"]) for p in passkey))
        depths = sorted({p["depth"] for p in passkey})
        for i, (method, variant, budget) in enumerate(keys):
            shift = 0.01 * (i - len(keys) / 2)  # overlapping lines stay visible
            acc = [shift + np.mean([p["retrieval_accuracy"] for p in passkey
                            if (p["method"], p["variant"], p["budget"]) == (method, variant,
                                                                            budget)
                            and p["depth"] == d]) for d in depths]
            label = method + ("" if budget is None else f" @{budget:g}")
            ax.plot(depths, acc, marker="o", lw=1, label=label, color=colors.get(method, "k"),
                    ls="-" if method in qc.QUANT_METHODS or method == qc.CONTROL else "--")
        ax.set_xlabel("depth of the pass key in the context")
        ax.set_ylabel("retrieval accuracy (lines offset by up to +-0.08)")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title("pass-key retrieval vs depth")
        fig.tight_layout()
        fig.savefig(out_dir / "retrieval_depth.png", dpi=120)
        plt.close(fig)
        written.append("retrieval_depth.png")

    text = [p for p in points if p.get("kind") == "text" and p["method"] != qc.CONTROL]
    if text:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        centers = (KL_EDGES[:-1] + KL_EDGES[1:]) / 2
        for name in dict.fromkeys(r["method"] for r in ordered(metrics)):
            rs = metrics["methods"][name]
            pick = [r for r in rs if r["variant"] == "oneshot"]
            row = _nearest(pick) or (pick[0] if pick else None)
            if row is None:
                continue
            hist = np.sum([p["kl_hist"] for p in text if p["method"] == name
                           and p["variant"] == "oneshot" and p["budget"] == row["budget"]],
                          axis=0)
            label = name + ("" if row["budget"] is None else f" @{row['budget']:g}")
            style = "-" if name in qc.QUANT_METHODS else ("--" if name in qc.EVICT_METHODS
                                                         else ":")
            ax.plot(centers, np.cumsum(hist) / max(1, hist.sum()), lw=1.2, label=label,
                    color=colors.get(name, "k"), ls=style)
        ax.set_xlabel("log10 KL(full || modified) per predicted token (nats; <= -9: 0)")
        ax.set_ylabel("fraction of tokens")
        ax.set_title("per-token KL, each method at the budget nearest 0.5")
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
    and the text (with its sha256, so the run key follows the text). Checks everything that can
    be checked before the weights load (cli.BadInput or a typed error)."""
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
    text = pydoc_text() if text_file is None else pathlib.Path(text_file).read_text("utf-8")
    if not text.strip():
        raise cli.BadInput(f"--text_file={text_file} is empty: nothing to score")
    config = dict(preset=dataclasses.asdict(preset), model=model,
                  model_dir=None if model_dir is None else str(pathlib.Path(model_dir).resolve()),
                  text_file=None if text_file is None else str(pathlib.Path(text_file).resolve()),
                  text_sha256=hashlib.sha256(text.encode()).hexdigest())
    docs, probes = load_items(config, kq.load_tokenizer(model, model_dir))  # enough text?
    config["documents"] = len(docs)
    return config


def _preset(config: dict) -> qc.QualityPreset:
    fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in config["preset"].items()}
    return qc.QualityPreset(**fields)


def load_items(config: dict, tok) -> tuple[list[Item], list[Item]]:
    """(documents, probes) of the run; cli.BadInput when the text gives too few documents."""
    preset = _preset(config)
    source = config["text_file"] or "pydoc_data.topics"
    text = pydoc_text() if config["text_file"] is None else \
        pathlib.Path(config["text_file"]).read_text("utf-8")
    docs = documents(tok.encode(text), preset, source)
    filler = tok.encode(pydoc_text()) if config["text_file"] is not None else None
    filler = filler if filler is not None else tok.encode(text)
    filler = filler[len(filler) // 2:]  # the probes' filler: pydoc's second half
    probes = passkey_probes(tok, filler, preset) + chat_probes(tok, filler, preset)
    return docs, probes


def measure(config: dict, add_point, progress: bool = True) -> tuple[dict, dict]:
    """Runs every condition on the documents and the probes. Returns (summary, timing)."""
    from tqdm import tqdm

    preset = _preset(config)
    tok = kq.load_tokenizer(config["model"], config["model_dir"])
    docs, probes = load_items(config, tok)
    timing = {"start": time.perf_counter()}
    model_config, params = kq.load_pretrained(config["model"], config["model_dir"])
    timing["load_s"] = time.perf_counter() - timing["start"]
    sets = [("text", docs, preset.context_tokens, conditions(preset, probes=False))]
    if probes:
        sets.append(("probes", probes, preset.probe_context, conditions(preset, probes=True)))
    total = sum(len(c) + 1 for *_, c in sets)
    # Sets of as many rows share one state config, so every jitted op compiles once for both.
    share = len({len(items) for _, items, *_ in sets}) == 1
    points, skipped = [], {}
    bar = tqdm(total=total, desc="quality", unit="run", file=sys.stderr, disable=not progress,
               mininterval=2.0)
    for name, items, nominal, conds in sets:
        t0 = time.perf_counter()
        bench = Bench(model_config, params, items, preset, nominal, table_width(
            [x for _, its, *_ in sets for x in its] if share else items, preset))
        bar.set_postfix_str(f"{name}: prefill")
        bench.prefill()
        bar.update()
        timing[f"{name}_prefill_s"] = time.perf_counter() - t0
        for cond in conds:
            bar.set_postfix_str(f"{name}: {cond.key}")
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
            timing[f"{name}:{cond.key}_s"] = time.perf_counter() - t1
            bar.update()
        del bench
    bar.close()
    summary = summarize(points, preset)
    summary["skipped"] = skipped
    summary["documents"] = len(docs)
    summary["probes"] = {"passkey": sum(p.kind == "passkey" for p in probes),
                         "chat": sum(p.kind == "chat" for p in probes)}
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
            out=None, out_dir=None, print_json: bool = False, progress: bool = True) -> dict:
    """The run directory of `config`: measured (unless already complete), metrics.json written
    without any timing (byte-identical on a rerun), the CSV, the plots, timing.json; --out and
    --out_dir copies. Returns the summary."""
    preset = _preset(config)
    run = runs.open_run(EXPERIMENT, MODULE, config, seed=preset.seed, root=runs_dir,
                        overwrite=overwrite)
    path = run.path
    if run.complete:
        cli.note(f"{path} already holds this run (git {str(run.config['git_commit'])[:10]}, "
                 f"{run.config['time_utc']}); showing it again: pass --overwrite to measure anew")
        summary = runs.read_metrics(path)
    else:
        measured, timing = measure(config, run.add_point, progress)
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
    """The table: one line per method x budget."""
    lines = [f"{'method':<24}{'budget':>8}{'MiB freed':>11}{'d_ppl':>10}{'d_ppl_rel':>11}"
             f"{'KL':>10}{'top1':>7}{'retr.':>7}"]

    def fmt(x, spec):
        return f"{x:{spec}}" if x is not None else "-".rjust(int(spec.split('.')[0]))

    for r in ordered(summary):
        lines.append(f"{_label(r):<24}{fmt(r['budget_fraction'], '8.3f')}"
                     f"{fmt(r['bytes_freed'] and r['bytes_freed'] / MiB, '11.2f')}"
                     f"{fmt(r['delta_ppl'], '10.4f')}{fmt(r['delta_ppl_rel'], '11.5f')}"
                     f"{fmt(r['kl_mean'], '10.5f')}{fmt(r['top1_agreement'], '7.3f')}"
                     f"{fmt(r['retrieval_accuracy'], '7.2f')}")
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
    flags.DEFINE_string("text_file", None, "UTF-8 text split into documents (default: "
                        "pydoc_data.topics). The probes' filler is always pydoc's.")
    flags.DEFINE_integer("num_docs", None, "Documents (default: the preset's).", lower_bound=1)
    flags.DEFINE_integer("context_tokens", None, "Context tokens C per document.",
                         lower_bound=2, upper_bound=32768)
    flags.DEFINE_integer("continuation_tokens", None, "Continuation tokens T per document.",
                         lower_bound=2, upper_bound=4096)
    flags.DEFINE_list("methods", None, f"Methods, of: {', '.join(qc.METHODS)}.")
    flags.DEFINE_list("budgets", None, "Eviction budgets: kept fractions of the context, in "
                      "(0, 1), increasing.")
    flags.DEFINE_integer("passkey_probes", None, "Pass-key probes.", lower_bound=0)
    flags.DEFINE_integer("chat_probes", None, "Chat probes.", lower_bound=0)
    flags.DEFINE_integer("seed", None, "Seed (bootstrap, random policy, pass keys).",
                         lower_bound=0)
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

    flags.register_validator("methods", methods_ok)
    flags.register_validator("budgets", budgets_ok)


def main(argv):
    del argv
    config = resolve(FLAGS.preset, model=FLAGS.model, model_dir=FLAGS.model_dir,
                     text_file=FLAGS.text_file, num_docs=FLAGS.num_docs,
                     context_tokens=FLAGS.context_tokens,
                     continuation_tokens=FLAGS.continuation_tokens,
                     methods=FLAGS.methods,
                     budgets=None if FLAGS.budgets is None else [float(b) for b in FLAGS.budgets],
                     passkey_probes=FLAGS.passkey_probes, chat_probes=FLAGS.chat_probes,
                     seed=FLAGS.seed)
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
