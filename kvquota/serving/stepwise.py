"""Eviction step by step as a sequence grows past its budget: TOVA as its paper runs it.

TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): once the cache holds the budget,
every new token is decoded on the cache (its query attends over the kept tokens and itself),
then, in every layer, the token the current query attends to least (the layer's heads averaged)
is dropped, so the cache stays at the budget. Here each (layer, KV head) of the paged state is
compacted on its own (`Allocator.evict` in token mode with the per-head default); TOVA's score is
the same for every head of a layer, so a layer's heads keep the same tokens.

`StepwiseEviction.feed` teacher-forces known tokens with the same evictions in fewer forwards:
the tokens between two evictions go through the model as one chunk, and only the token an
eviction follows is a decode step (its attention is what the policy reads).

`stride` s > 1 is this project's cheaper variant, named in every result: the cache grows to
budget + s, then the s tokens the last query attends to least are dropped at once (s = 1 is the
paper). Any registered policy can be driven this way (H2O's accumulated mass, for one); TOVA
is the one its paper defines step by step.

Positions are kept, not re-indexed: keys are stored rotated at their original positions and each
new token is decoded at its own original position (`StepwiseEviction.positions` records, per
(layer, head), the original position of every cache slot).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from configs.models import ModelConfig
from kvquota.errors import InvalidArgumentError
from kvquota.policies import get_policy
from kvquota.sentinel import INVALID
from kvquota.serving.branching import extend
from kvquota.serving.engine import PagedEngine, ScoreResult, _token_logprobs, check_context
from kvquota.state import StateConfig


class StepwiseEviction:
    """Decode steps on `seq_ids` of `engine`, each followed, once a row's cache holds
    `budget_tokens + stride` tokens, by an eviction down to `budget_tokens` by `policy`.

    Args:
      engine: a PagedEngine that records attention (`record_attention=True`): the policy reads
        the step's attention (`engine.last_mass`).
      seq_ids: i32[B] running rows of the engine's state, as prefilled (no eviction before).
      budget_tokens: tokens every (layer, KV head) keeps after an eviction.
      policy: a registered eviction policy name ("tova": the paper's rule).
      stride: decode steps between evictions (1: the paper; s: s tokens dropped at once).
      recent: newest tokens never dropped (TOVA: 0, the new token competes too).
      track_positions: keep `positions` up to date (from each eviction's kept mask, a host
        sort per eviction).

    Attributes:
      positions: i32[B, L, Hkv, C]: the original position of the token in each cache slot of
        each (layer, KV head), -1 past the row's length (C = the state's max_tokens_per_seq);
        None without track_positions.
      evictions: evictions run so far.
    """

    def __init__(self, engine: PagedEngine, seq_ids, *, budget_tokens: int, policy: str = "tova",
                 stride: int = 1, recent: int = 0, track_positions: bool = True):
        for name, value, low in (("budget_tokens", budget_tokens, 1), ("stride", stride, 1),
                                 ("recent", recent, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidArgumentError(f"{name} must be an integer >= {low}, got {value!r}")
        if recent > budget_tokens:
            raise InvalidArgumentError(f"recent {recent} exceeds the budget {budget_tokens}")
        self.policy = get_policy(policy, recent=recent)  # unknown names: a typed error
        if not engine.records_attention:
            raise InvalidArgumentError("stepwise eviction reads each step's attention: build "
                                       "the engine with record_attention=True")
        sc = engine.state_config
        if budget_tokens + stride > sc.max_tokens_per_seq:
            raise InvalidArgumentError(
                f"budget {budget_tokens} + stride {stride} exceed the {sc.max_tokens_per_seq} "
                "tokens a sequence of this state holds")
        self.engine, self.budget, self.stride = engine, budget_tokens, stride
        self.seq_ids = np.asarray(seq_ids, np.int32)
        lens = self._lengths()
        m = sc.model
        c = sc.max_tokens_per_seq
        start = np.asarray(engine.state.seqs.positions)[np.maximum(self.seq_ids, 0)] - lens
        slots = np.arange(c)[None, :]
        pos = np.where(slots < lens[:, None], start[:, None] + slots, -1)  # [B, C]
        self.positions = np.broadcast_to(pos[:, None, None, :], (
            len(self.seq_ids), m.num_layers, m.num_kv_heads, c)).astype(np.int32).copy() \
            if track_positions else None
        self.evictions = 0

    def _lengths(self) -> np.ndarray:
        lens = np.asarray(self.engine.state.seqs.seq_lens)[np.maximum(self.seq_ids, 0)]
        return np.where(self.seq_ids >= 0, lens, 0).astype(np.int32)

    def step(self, tokens) -> np.ndarray:
        """Decodes one token per row (i32[B]), then evicts where due. Returns the step's logits
        f32[B, V] (the next token's distribution, computed before the eviction)."""
        eng = self.engine
        lens = self._lengths()
        at = np.maximum(self.seq_ids, 0)
        pos = np.asarray(eng.state.seqs.positions)[at]
        report, logits = eng.decode(self.seq_ids, np.asarray(tokens, np.int32))
        if not report.appended[self.seq_ids >= 0].all():
            raise RuntimeError(f"stepwise decode refused: {report.reasons()}")
        rows = np.flatnonzero(self.seq_ids >= 0)
        if self.positions is not None:
            self.positions[rows, :, :, lens[rows]] = pos[rows, None, None]
        due = np.where(self._lengths() >= self.budget + self.stride, self.seq_ids, INVALID)
        if (due >= 0).any():
            self._evict(due.astype(np.int32))
        return np.asarray(logits)

    def feed(self, tokens, *, return_logits: bool = True):
        """Teacher-forces tokens i32[B, S] (row b's S tokens in order), evicting exactly where S
        `step` calls would, with fewer forwards: the tokens between two evictions go through the
        model as one chunk (`extend`: the weights and the cache read once for them, not once a
        token), and only the token an eviction follows is a decode step (the policy reads its
        attention). Same kept tokens and, up to f32 rounding of the chunked forward, the same
        logits as `step` (tested). Returns f32[B, S, V] logits (None without return_logits)."""
        tokens = np.asarray(tokens, np.int32)
        live = self.seq_ids >= 0
        out, j, total = [], 0, tokens.shape[1]
        while j < total:
            # Steps until the first row is due: the step that takes it to budget + stride tokens.
            due = int(np.where(live, np.maximum(self.budget + self.stride - self._lengths(), 1),
                               total + 1).min())
            if due > total - j:  # no eviction in the rest: one chunk
                self._chunk(tokens[:, j:], out if return_logits else None)
                break
            if due > 1:
                self._chunk(tokens[:, j:j + due - 1], out if return_logits else None)
            logits = self.step(tokens[:, j + due - 1])
            if return_logits:
                out.append(logits[:, None])
            j += due
        if not return_logits:
            return None
        return np.concatenate(out, axis=1)

    def _chunk(self, tokens, out):
        """tokens i32[B, T] through the model at once (no row is due within them); their logits
        appended to `out` (a list, or None)."""
        eng, t = self.engine, tokens.shape[1]
        rows = np.flatnonzero(self.seq_ids >= 0)
        if self.positions is not None:
            lens = self._lengths()
            pos = np.asarray(eng.state.seqs.positions)[np.maximum(self.seq_ids, 0)]
            cols = lens[rows, None] + np.arange(t)[None, :]  # [R, T] slots written
            self.positions[rows[:, None], :, :, cols] = (pos[rows, None] + np.arange(t))[
                ..., None, None]
        # Exactly t columns: between evictions t is stride - 1 (one compile), and no logits
        # computed where none are read.
        chunks = extend(eng, self.seq_ids, tokens, chunk_size=min(t, eng.chunk_size),
                        last_only=out is None)
        if out is not None:
            out.append(np.concatenate([np.asarray(c) for c in chunks], axis=1)[:, :t])

    def _evict(self, due):
        eng, alloc = self.engine, self.engine.allocator
        eng.state, report = alloc.evict(eng.state, due, policy=self.policy,
                                        keep_tokens=self.budget, attention=eng.last_mass,
                                        donate=True)
        self.evictions += 1
        if self.positions is None:
            return
        keep = report.kept  # bool[B, L, Hkv, C]
        # Each (layer, head) packs its kept tokens in order: slot j holds its j-th kept token.
        order = np.argsort(~keep, axis=-1, kind="stable")
        packed = np.take_along_axis(self.positions, order, axis=-1)
        packed = np.where(np.take_along_axis(keep, order, axis=-1), packed, -1)
        self.positions = np.where((due >= 0)[:, None, None, None], packed, self.positions)


def stepwise_state_config(config: ModelConfig, rows: int, budget_tokens: int, stride: int, *,
                          block_size: int = 16, kv_format: str = "f32") -> StateConfig:
    """A state for `rows` sequences that never hold more than budget + stride tokens (the
    eviction's cost grows with the table's width, not with the text's length)."""
    per_seq = math.ceil((budget_tokens + stride) / block_size)
    return StateConfig(model=config, num_blocks=(per_seq + 1) * rows, block_size=block_size,
                       max_seqs=rows, max_blocks_per_seq=per_seq, num_tenants=1,
                       kv_format=kv_format)


def score_stepwise(config: ModelConfig, params, docs: Sequence[Sequence[int]], *,
                   budget_tokens: int, policy: str = "tova", stride: int = 1, recent: int = 0,
                   block_size: int = 16, kv_format: str = "f32", backend: str = "auto",
                   return_logits: bool = False, track_positions: bool = True
                   ) -> tuple[list[ScoreResult], StepwiseEviction]:
    """Teacher-forced scoring of equal-length `docs` with stepwise eviction: the first
    `budget_tokens` prefilled (nothing evicted), every later token fed on the evicted cache
    (`StepwiseEviction.feed`). Returns one ScoreResult per doc (nll of every position) and the
    driver (its `positions`: what each (layer, head) keeps at the end)."""
    ids = [[int(t) for t in d] for d in docs]
    if not ids or len({len(d) for d in ids}) != 1:
        raise InvalidArgumentError("score_stepwise needs one or more docs of equal length")
    n = len(ids[0])
    if n < 2 or budget_tokens >= n:
        raise InvalidArgumentError(f"docs of {n} tokens: the budget {budget_tokens} must be "
                                   "shorter (and a doc at least 2 tokens)")
    check_context(config, n, "scoring")
    sc = stepwise_state_config(config, len(ids), budget_tokens, stride, block_size=block_size,
                               kv_format=kv_format)
    engine = PagedEngine(config, params, sc, chunk_size=256, backend=backend,
                         record_attention=True)
    engine.register_tenant(0, token_quota=2**31 - 1, byte_quota=engine.max_byte_quota)
    report, chunks = engine.admit([0] * len(ids), [d[:budget_tokens] for d in ids],
                                  last_only=False)
    if not report.admitted.all():
        raise RuntimeError(f"scoring refused by the allocator: {report.reasons()}")
    driver = StepwiseEviction(engine, report.seq_id.astype(np.int32),
                              budget_tokens=budget_tokens, policy=policy, stride=stride,
                              recent=recent, track_positions=track_positions)
    tokens = np.asarray(ids, np.int32)
    targets = np.concatenate([tokens[:, 1:], np.zeros((len(ids), 1), np.int32)], axis=1)
    prefix = np.concatenate([np.asarray(c) for c in chunks], axis=1)[:, :budget_tokens]
    parts = [(prefix, targets[:, :budget_tokens]),  # the last logits give top1 only
             (driver.feed(tokens[:, budget_tokens:]), targets[:, budget_tokens:])]
    lps, top1s = zip(*(_token_logprobs(jnp.asarray(lg), jnp.asarray(tg)) for lg, tg in parts))
    lp, top1 = np.concatenate(lps, axis=1), np.concatenate(top1s, axis=1)  # [B, n]
    logits = np.concatenate([lg for lg, _ in parts], axis=1) if return_logits else None
    results = [ScoreResult(token_ids=ids[b], nll=-lp[b, : n - 1].astype(np.float64),
                           top1=top1[b], logits=None if logits is None else logits[b])
               for b in range(len(ids))]
    return results, driver
