"""Branching a served state: one prefill, many what-ifs.

The quality experiments prefill a context once, then try one lossy means after another on the
same cache and teacher-force the same continuation on each result. Two helpers make that cheap
and safe:

* `branch(state)`: a copy of the state in fresh buffers. Every operation on the branch may then
  donate (serving-loop speed: no page copy per step) while the original stays live. Running the
  branch's operations with `donate=False` instead is not the same: each forward would copy the
  pages again, and an output leaf that jax hands back as the input buffer (an unmodified pool)
  would be deleted under the original by the next donating call.
* `extend(engine, seq_ids, tokens)`: teacher forcing of known tokens onto live sequences (after a
  compression or an eviction): slots reserved by the allocator, K/V written and logits returned
  chunk by chunk, with a hook before each chunk (a streaming cache policy).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvquota.codes import SEQ_RUNNING
from kvquota.errors import (
    ContextTooLongError,
    DuplicateIdError,
    InputShapeError,
    PoolFullError,
    QuotaExceededError,
    SequenceTooLongError,
    TokenIdError,
    UnknownSequenceError,
)
from kvquota.sentinel import INVALID
from kvquota.serving.engine import PagedEngine, _paged_forward


def branch(state):
    """A copy of `state` (every leaf in a new buffer of the same sharding and memory kind)."""

    def copy(leaf):
        if isinstance(leaf, jax.Array):
            return jax.device_put(leaf, leaf.sharding, may_alias=False)
        return np.array(leaf, copy=True)

    return jax.tree_util.tree_map(copy, state)


def _check_rows(engine: PagedEngine, seq_ids, tokens, lengths):
    """(seq_ids i32[B], tokens i32[B, T], lengths i32[B]) checked on the host: real rows
    running and distinct, tokens in the vocabulary, every row's new length within its table,
    the model's context and pool 0's free blocks. Raises before any device work."""
    sc, state = engine.state_config, engine.state
    ids = np.asarray(seq_ids)
    toks = np.asarray(tokens)
    if ids.ndim != 1 or toks.ndim != 2 or toks.shape[0] != ids.shape[0] or ids.size == 0:
        raise InputShapeError(f"seq_ids must be [B] and tokens [B, T] with B >= 1, got "
                              f"{ids.shape} and {toks.shape}")
    if not (np.issubdtype(ids.dtype, np.integer) and np.issubdtype(toks.dtype, np.integer)):
        raise InputShapeError("seq_ids and tokens must be integer arrays")
    lens = np.full(ids.shape, toks.shape[1]) if lengths is None else np.asarray(lengths)
    if lens.shape != ids.shape or not np.issubdtype(lens.dtype, np.integer) \
            or (lens < 0).any() or (lens > toks.shape[1]).any():
        raise InputShapeError(f"lengths must be [B] integers in [0, {toks.shape[1]}]")
    real = ids != INVALID
    lens = np.where(real, lens, 0)
    rid = ids[real]
    if ((rid < 0) | (rid >= sc.max_seqs)).any():
        raise UnknownSequenceError(f"extend: a sequence id is outside [0, {sc.max_seqs})")
    if len(np.unique(rid)) != len(rid):
        raise DuplicateIdError("extend: a sequence appears twice in one call")
    status = np.asarray(state.seqs.seq_status)[rid]
    if (status != SEQ_RUNNING).any():
        raise UnknownSequenceError(f"extend: sequence {int(rid[status != SEQ_RUNNING][0])} "
                                   "is not running")
    cols = np.arange(toks.shape[1])[None, :]
    used = toks[cols < lens[:, None]]
    if ((used < 0) | (used >= sc.model.vocab_size)).any():
        raise TokenIdError(f"token ids must be in [0, {sc.model.vocab_size})")
    have = np.asarray(state.seqs.seq_lens)[np.maximum(ids, 0)]
    if (np.where(real, have + lens, 0) > sc.max_tokens_per_seq).any():
        raise SequenceTooLongError(f"extend: a sequence would pass its table's "
                                   f"{sc.max_tokens_per_seq} tokens")
    pos = np.asarray(state.seqs.positions)[np.maximum(ids, 0)]
    if (np.where(real, pos + lens, 0) > sc.model.max_context).any():
        raise ContextTooLongError(f"extend: a sequence would pass {sc.model.name}'s context "
                                  f"of {sc.model.max_context} tokens")
    p = sc.block_size
    need = np.where(real, -(-(have + lens) // p) - -(-have // p), 0).sum()
    room = int(np.asarray(state.free.free_count)[0])
    if need > room:
        raise PoolFullError(f"extend: {int(need)} new blocks needed, pool 0 has {room} free")
    return ids.astype(np.int32), toks.astype(np.int32), lens.astype(np.int32)


def extend(engine: PagedEngine, seq_ids, tokens, *, lengths=None,
           chunk_size: Optional[int] = None, last_only: bool = False,
           before_chunk: Optional[Callable[[PagedEngine, np.ndarray], None]] = None):
    """Teacher-force `tokens` i32[B, T] onto the running sequences `seq_ids` i32[B] (INVALID
    rows are padding): row b takes its first `lengths[b]` tokens (default all T), at its next
    cache index and logical position (they differ after an eviction).

    Chunk by chunk (`chunk_size`, default the engine's): `before_chunk(engine, rows)` runs first
    (rows: the ids still taking tokens, INVALID elsewhere), then `Allocator.append` reserves the
    chunk's slots (donated) and the model writes their K/V and attends (donated). Every chunk
    has the same width, so the model compiles once. Input is checked before any device work
    (typed errors, state untouched); an allocator refusal mid-way (a tenant's quota) raises
    QuotaExceededError with the slots reserved so far kept.

    An engine with `record_attention=True` records each chunk's attention mass into the state,
    as its prefill does.

    Returns the logits of each chunk, f32[B, chunk, V] jax arrays on the device; chunk c covers
    tokens [c * chunk, (c + 1) * chunk) of each row (past a row's length: padding). With
    `last_only`, only the chunk's last column's, f32[B, V] (the output head, a fifth of a
    small model's FLOPs, runs once a row: for callers that only write the K/V).
    """
    ids, toks, lens = _check_rows(engine, seq_ids, tokens, lengths)
    width = engine.chunk_size if chunk_size is None else int(chunk_size)
    if width < 1:
        raise InputShapeError(f"chunk_size must be >= 1, got {width}")
    b = ids.size
    out = []
    for at in range(0, int(lens.max()), width):
        live = lens > at
        rows = np.where(live, ids, INVALID).astype(np.int32)
        if before_chunk is not None:
            before_chunk(engine, rows)
        at_rows = np.maximum(ids, 0)
        start = np.where(live, np.asarray(engine.state.seqs.seq_lens)[at_rows], 0)
        pos = np.where(live, np.asarray(engine.state.seqs.positions)[at_rows], 0)
        num_new = np.clip(lens - at, 0, width).astype(np.int32)
        for j in range(int(num_new.max())):
            step = np.where(num_new > j, ids, INVALID).astype(np.int32)
            engine.state, rep = engine.allocator.append(
                engine.state, step, np.where(num_new > j, toks[:, min(at + j, toks.shape[1] - 1)],
                                             0).astype(np.int32), donate=True)
            refused = (step >= 0) & ~np.asarray(rep.appended)
            if refused.any():
                reason = rep.reasons()[int(np.flatnonzero(refused)[0])]
                raise QuotaExceededError(f"extend: the allocator refused a slot ({reason})")
        chunk = np.zeros((b, width), np.int32)
        cols = at + np.arange(width)
        chunk[:, :] = toks[:, np.minimum(cols, toks.shape[1] - 1)]
        positions = (pos[:, None] + np.arange(width)[None, :]).astype(np.int32)
        engine.state, logits = _paged_forward(
            engine.model, engine.params, engine.state, jnp.asarray(rows), jnp.asarray(chunk),
            jnp.asarray(start, jnp.int32), jnp.asarray(num_new), jnp.asarray(positions),
            last_only=last_only, pool_starts=engine.pool_starts,
            record=engine._record_prefill)[:2]
        out.append(logits)
    return out
