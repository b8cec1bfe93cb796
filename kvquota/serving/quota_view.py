"""Admission calls without the rows the device would surely refuse.

A refused admission row costs the device as much as an accepted one (its prompt is hashed and
looked up before the quota check), and a tenant cut far below its holdings is tried again at
every step that frees one of its sequences (`Parking`), each time with all its queue heads.
`admit_batch` keeps the scheduler's rows and their order, but sends to the device only the
rows whose refusal is not certain; the others get, on the host, the refusal and reason
`core.admission._decide` would give. A row is certain to be refused, in `_decide`'s order, when

  its prompt's n tokens > token_quota - used_tokens          -> over token quota, else
  the blocks it must allocate, at least `least` of them,
  need more units than byte_quota - charged                  -> growing past a cut (the
                                                                grow-no-admit flag) or over
                                                                byte quota,

with `least` the blocks of its prompt that the prefix cache did not hold at its last try
(`AdmitReport.missing_blocks`; 1 before any try: at most (n - 1) // P full blocks can hit).
Earlier rows of the same tenant that go to the device may be accepted and raise its use, which
keeps a refusal certain but may turn over byte quota into over token quota: a row is refused
over bytes on the host only if its tokens fit even after all of them. The one case where a row
called certain might have been accepted: the prefix cache gained the row's blocks since its
last try (another request wrote the same prefix), so it now misses fewer than `least`.

`QuotaView` keeps the tenants' quotas and use on the host, exact while no op ran since it was
read: the scheduler marks it stale on each facade call (`changed`), refreshes the use from each
executor step's readback (`stepped`), and it re-reads the state only when a batch is checked
while stale, so a pure decode step still makes one sync.
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from kvquota.codes import REFUSED_BYTE_QUOTA, REFUSED_GROWING, REFUSED_TOKEN_QUOTA
from kvquota.sentinel import INVALID
from kvquota.serving.executors import bucket

QUOTA_OPS = ("register_tenant", "set_quota", "apply_plan")  # ops that may change quotas or flags
FREEING_OPS = ("free", "preempt")  # ops that free sequences (args[0]: their slots)
QUOTA_REFUSALS = (REFUSED_TOKEN_QUOTA, REFUSED_BYTE_QUOTA, REFUSED_GROWING)


class QuotaView:
    """Per tenant (host NumPy, None where stale): token_quota, byte_quota (units), growing,
    used_tokens and the device units charged; `least`: each refused request's missing blocks at
    its last try (a request refused for good keeps its entry; it is never a row again)."""

    def __init__(self, config):
        self.block_units = config.pool_units[0]
        self.device_units = np.asarray([u if dev else 0 for u, dev in
                                        zip(config.pool_units, config.device_pools)], np.int64)
        self.quotas = self.usage = None
        self.least = {}

    def changed(self, op: str):
        """A facade call ran: the use is stale, and the quotas too after `QUOTA_OPS`."""
        self.usage = None
        if op in QUOTA_OPS:
            self.quotas = None

    def stepped(self, charged, used_tokens):
        """The executor step's readback: charged blocks i32[T, POOLS], used tokens i32[T]."""
        self.usage = self._usage(charged, used_tokens)

    def _usage(self, charged, used_tokens):
        units = (np.asarray(charged, np.int64) * self.device_units[None, :]).sum(axis=1)
        return np.asarray(used_tokens, np.int64), units

    def read(self, state) -> int:
        """Re-read what is stale from `state`; returns the device reads made (0 or 1)."""
        t, want = state.tenants, {}
        if self.quotas is None:
            want["quotas"] = (t.token_quota, t.byte_quota, t.growing)
        if self.usage is None:
            want["usage"] = (t.charged_blocks, t.used_tokens)
        if not want:
            return 0
        got = jax.device_get(want)
        if "quotas" in got:
            token, byte, growing = got["quotas"]
            self.quotas = (np.asarray(token, np.int64), np.asarray(byte, np.int64),
                           np.asarray(growing, bool))
        if "usage" in got:
            self.usage = self._usage(*got["usage"])
        return 1

    def room(self, state) -> tuple[np.ndarray, np.ndarray, int]:
        """(token room i64[T], device-unit room i64[T], device reads made): what each tenant
        may still take; a growing tenant's appends go past its byte quota (no unit limit)."""
        reads = self.read(state)
        (token_quota, byte_quota, growing), (used, charged) = self.quotas, self.usage
        units = np.where(growing, np.iinfo(np.int64).max, byte_quota - charged)
        return token_quota - used, units, reads

    def sure_refusals(self, rows) -> dict:
        """{row index: reason} for the Scheduler rows the device refuses for sure (module
        docstring); rows are requests in batch order."""
        (token_quota, byte_quota, growing), (used, charged) = self.quotas, self.usage
        out, sent = {}, collections.Counter()  # tokens of each tenant's rows sent so far
        for i, r in enumerate(rows):
            t, n = r.tenant, len(r.context)
            room = token_quota[t] - used[t]
            if n > room:
                out[i] = REFUSED_TOKEN_QUOTA
            elif n <= room - sent[t] and \
                    self.least.get(r, 1) * self.block_units > byte_quota[t] - charged[t]:
                out[i] = REFUSED_GROWING if growing[t] else REFUSED_BYTE_QUOTA
            else:
                sent[t] += n
        return out


class Parking:
    """The tenants whose queued requests an admission skips, each until something may make room.

    * Refused over a quota (tokens, bytes, growing): until a quota change or a reclaim
      (`QUOTA_OPS`), a free or preemption of one of its own sequences, or a new request among
      its queue heads. Nothing else lowers its use. (A prefix that another tenant of its group
      writes meanwhile can lower a row's need, since a hit on a held block is not charged; the
      next of those retries finds it.) Retrying at anyone's free, as before, let a cut tenant's
      refused backlog, the oldest heads, fill most of each admission's rows at every step,
      ahead of the other tenants' newer requests.
    * Refused for the pool or the sequence slots: until anyone's free.
    * An append refused: parked the same way, after the preemption that made room for the
      tenant's running requests. That room is for them to grow into; a request re-admitted into
      it would be preempted again at the next block boundary. (vLLM's v0 scheduler likewise
      swaps nothing in at a step that preempted.)

    The scheduler parks the oldest suspended request's refused restore in a second one: only the
    same ops can make its room (and any event ends that park: what is hopeless depends on them).
    """

    def __init__(self):
        self.on_quota = {}  # tenant -> parked on its own quota (False: on the pool or slots)

    def tenants(self) -> set:
        return set(self.on_quota)

    def refused(self, tenant: int, reason: int):
        """A row of `tenant` was refused for `reason` (a pool refusal outweighs a quota one)."""
        self.on_quota[tenant] = self.on_quota.get(tenant, True) and reason in QUOTA_REFUSALS

    def release(self, tenant: int):
        self.on_quota.pop(tenant, None)

    def clear(self):
        self.on_quota.clear()

    def arrived(self, tenant: int, among_heads: bool):
        """A request of `tenant` was queued; among the heads an admission tries, it may fit."""
        if among_heads:
            self.release(tenant)

    def op(self, name: str, args, seq_tenant):
        """A facade call `name(state, *args)` ran; seq_tenant: each slot's tenant (the host
        mirror's, before the call)."""
        if name in QUOTA_OPS:
            self.clear()
        elif name in FREEING_OPS:
            freed = set(np.asarray(seq_tenant)[np.asarray(args[0], np.int64)].tolist())
            self.on_quota = {t: q for t, q in self.on_quota.items() if q and t not in freed}


def admit_batch(sched, rows) -> list:
    """(reason, sequence slot, cached tokens) for each of a Scheduler's admission rows, in
    order: the sure refusals from the view without a device call, the rest from one admit call
    (padded to 4..max_admit rows and a power of two of tokens), its report read back. A row the
    device refused leaves its missing blocks for its next try; an admitted one drops them (a
    preempted request comes back with another context)."""
    view = sched.quota
    sched.syncs += view.read(sched.state)
    sure = view.sure_refusals(rows)
    at = [i for i in range(len(rows)) if i not in sure]  # the call's rows
    out = {i: (reason, INVALID, 0) for i, reason in sure.items()}
    if at:
        b = bucket(len(at), sched.max_admit, floor=4)
        ten, lens = np.full(b, INVALID, np.int32), np.zeros(b, np.int32)
        tok = np.zeros((b, bucket(max(len(rows[i].context) for i in at),
                                  sched.config.max_tokens_per_seq)), np.int32)
        for j, i in enumerate(at):
            r = rows[i]
            ten[j], lens[j], tok[j, : len(r.context)] = r.tenant, len(r.context), r.context_ids()
        rep = sched._read(sched._op("admit", ten, tok, lens))
        for j, i in enumerate(at):
            out[i] = (int(rep.reason[j]), int(rep.seq_id[j]), int(rep.cached_tokens[j]))
            if rep.admitted[j]:
                view.least.pop(rows[i], None)
            else:
                view.least[rows[i]] = int(rep.missing_blocks[j])
    return [out[i] for i in range(len(rows))]
