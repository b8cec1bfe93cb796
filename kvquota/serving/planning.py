"""Which rows a scheduling pass of K steps runs (K = 1: a single step; K > 1: multi-step
scheduling on the cost model, `Scheduler(steps_per_pass=K)`): the decode rows and how many
tokens each may take, each step's prefill chunks under the token budget, built into the
executors' padded host batches (`executors.build_batch`, and `PassBatch` for K > 1)."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvquota.sentinel import INVALID
from kvquota.serving.executors import HostMirror, StepBatch, build_batch
from kvquota.serving.requests import RequestStatus


def step_rows(executor, live):
    """(decode requests: the running ones, oldest first, up to max_batch; prefilling requests,
    oldest admission first): one pass over the live requests (hundreds; the suspended ones run
    nothing)."""
    dec, prefilling = [], []
    for r in live:
        if r.status == RequestStatus.RUNNING:
            dec.append(r)
        elif r.status == RequestStatus.PREFILL:
            prefilling.append(r)
    return dec[: executor.max_batch], sorted(prefilling, key=lambda q: q.admitted)


def take_chunks(executor, prefilling, left: dict, budget: int) -> list:
    """[(request, chunk length)]: the prefilling requests (in order) whose context has `left`
    tokens to prefill (updated) take chunks of at most chunk_size, up to prefill_rows of them,
    while the budget lasts; at least one token (prefills always advance)."""
    budget, pre = max(budget, 1), []
    for r in prefilling:
        if len(pre) == executor.prefill_rows or budget < 1:
            break
        if left[r]:
            pre.append((r, min(left[r], executor.chunk_size, budget)))
            budget, left[r] = budget - pre[-1][1], left[r] - pre[-1][1]
    return pre


@dataclasses.dataclass
class PassBatch:
    """The rows of a pass of K steps, as host arrays.

    first: step 0's StepBatch; its decode rows are the pass's, row i decoding at steps
      j < dec_count[i] (i32[Bd]) unless refused.
    pre_seq/pre_key/pre_num: i32[K, Bp], i32[K, Bp, 2], i32[K, Bp]: each step's prefill rows, the
      key of the token each samples, the chunk's length (row 0 is `first`'s).
    pre_pools: i32[K, Bp, POOLS]: the prefill rows' table entries per pool (see StepBatch).
    steps: the steps that hold rows (the rest of the K are padding).
    """

    first: StepBatch
    dec_count: np.ndarray
    pre_seq: np.ndarray
    pre_key: np.ndarray
    pre_num: np.ndarray
    pre_pools: np.ndarray
    steps: int


def compose_pass(executor, live, token_budget: int, mirror: HostMirror, host_bytes: int,
                 limit: int):
    """(step 0's StepBatch or None when no row runs, decode requests, their token counts
    i32[rows], [[(prefill request, chunk length)] per step]) for a pass of at most `limit` steps
    with rows. The decode rows are every running request, oldest first (`step_rows`); each
    decodes min(limit, what it may still generate: max_new_tokens, the table, the context)
    tokens, one if it has stop ids (a pass cannot see a stop token), so at limit 1 every row
    decodes one token. Each step's chunks (`take_chunks`) come from what the earlier steps left,
    with that step's decode rows counted against the budget."""
    dec, prefilling = step_rows(executor, live)
    c = executor.state_config
    seqs = np.fromiter((r.seq for r in dec), np.int64, len(dec))
    room = np.minimum(c.max_tokens_per_seq - mirror.length[seqs],
                      c.model.max_context - mirror.position[seqs])
    counts = np.minimum(room, [1 if r.stop_ids else min(limit, r.max_new_tokens - len(r.tokens))
                               for r in dec]).astype(np.int32)
    left = {r: len(r.context) - r.prefilled for r in prefilling}
    pres = [take_chunks(executor, prefilling, left, token_budget - int((counts > j).sum()))
            for j in range(limit)]
    k = max(int(counts.max(initial=0)), max((j + 1 for j, p in enumerate(pres) if p), default=0))
    if not k:
        return None, dec, counts, []
    return build_batch(executor, dec, pres[0], mirror, host_bytes), dec, counts, pres[:k]


def pass_batch(first: StepBatch, counts, pres, mirror: HostMirror, steps: int) -> PassBatch:
    """The PassBatch of a pass of `steps` steps from `compose_pass`'s rows (step 0's batch
    `first`, the decode rows' counts, each step's chunks); the steps past len(pres) are
    padding. Needs a pool-counting mirror (the cost model's)."""
    bd, bp = len(first.dec_seq), len(first.pre_seq)
    b = PassBatch(first, np.zeros(bd, np.int32), np.full((steps, bp), INVALID, np.int32),
                  np.zeros((steps, bp, 2), np.int32), np.zeros((steps, bp), np.int32),
                  np.zeros((steps, bp, mirror.pools.shape[1]), np.int32), len(pres))
    b.dec_count[: len(counts)] = counts
    for j, pre in enumerate(pres):
        for i, (r, n) in enumerate(pre):
            b.pre_seq[j, i], b.pre_num[j, i], b.pre_key[j, i] = r.seq, n, (r.id, len(r.tokens))
            b.pre_pools[j, i] = mirror.pools[r.seq]
    return b
