"""Which rows a step runs, and the steps of a scheduling pass (`kvquota.serving.passes`): the
decode rows, the prefill chunks under the token budget, built into the executors' padded
host batches (`executors.build_batch`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvquota.sentinel import INVALID
from kvquota.serving.executors import HostMirror, StepBatch, build_batch


def step_rows(executor, live):
    """(decode requests: the running ones, oldest first, up to max_batch; prefilling requests,
    oldest admission first): one pass over the live requests (hundreds)."""
    dec, prefilling, waiting = [], [], []
    for r in live:
        rows = dec if r.status == "running" else prefilling if r.status == "prefill" else waiting
        rows.append(r)
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


def compose_step(executor, live, token_budget: int, mirror: HostMirror, host_bytes: int = 0):
    """(StepBatch or None, decode requests, [(prefill request, chunk length)]) for this step:
    every running request decodes one token; the rest of the token budget goes to prefill
    chunks (`step_rows`, `take_chunks`)."""
    dec, prefilling = step_rows(executor, live)
    left = {r: len(r.context) - r.prefilled for r in prefilling}
    pre = take_chunks(executor, prefilling, left, token_budget - len(dec))
    if not dec and not pre:
        return None, dec, pre
    return build_batch(executor, dec, pre, mirror, host_bytes), dec, pre


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
                 steps: int, limit: int):
    """(PassBatch or None, decode requests, their token counts i32[rows], [[(prefill request,
    chunk length)] per step]) for a pass of `steps` steps, at most `limit` of them with rows.
    The decode rows are `compose_step`'s; each decodes min(limit, what it may still generate:
    max_new_tokens, the table, the context) tokens, one if it has stop ids (the pass cannot see
    a stop token). Each step's chunks (`take_chunks`) come from what the earlier steps left,
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
    first, pres = build_batch(executor, dec, pres[0], mirror, host_bytes), pres[:k]
    bd, bp = len(first.dec_seq), len(first.pre_seq)
    b = PassBatch(first, np.zeros(bd, np.int32), np.full((steps, bp), INVALID, np.int32),
                  np.zeros((steps, bp, 2), np.int32), np.zeros((steps, bp), np.int32),
                  np.zeros((steps, bp, mirror.pools.shape[1]), np.int32), k)
    b.dec_count[: len(dec)] = counts
    for j, pre in enumerate(pres):
        for i, (r, n) in enumerate(pre):
            b.pre_seq[j, i], b.pre_num[j, i], b.pre_key[j, i] = r.seq, n, (r.id, len(r.tokens))
            b.pre_pools[j, i] = mirror.pools[r.seq]
    return b, dec, counts, pres
