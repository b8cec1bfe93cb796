"""Admission calls and quota waits: a request refused for its tenant's quota is tried again only
once its tenant has room for the least it can need.

A refused admission row costs the device as much as an accepted one (its prompt is hashed and
looked up before the quota check), and a tenant cut far below its holdings used to be tried at
every step that freed anything, each time with all its queue heads. Now each quota-refused row
leaves a lower bound of its need: its prompt's tokens (against token_quota - used_tokens) and
the blocks of its prompt the prefix cache did not hold (`AdmitReport.missing_blocks`, in units
against byte_quota - charged). Until the tenant's room covers both, the row would be refused
again for sure unless the cache gains its blocks meanwhile (another request writes the same
prefix), so it is not tried. Once it does, it is tried as before; if it must also revive cold
hits it has no room for, it is refused again and waits again. This is the check a host-side
scheduler makes before it schedules a request (vLLM's `can_allocate`), with the bound as of the
last try instead of a host copy of the cache.

`QuotaView` keeps the tenants' quotas and use on the host, exact while no op ran since it was
read: the scheduler marks it stale on each facade call (`changed`), refreshes the use from each
executor step's readback (`stepped`), and it re-reads the state only when a waiting request is
checked while stale, so a pure decode step still makes one sync.
"""

from __future__ import annotations

import jax
import numpy as np

from kvquota.codes import REFUSED_BYTE_QUOTA, REFUSED_GROWING, REFUSED_TOKEN_QUOTA
from kvquota.serving.executors import bucket

QUOTA_OPS = ("register_tenant", "set_quota", "apply_plan")  # ops that may change quotas or flags
QUOTA_REFUSALS = (REFUSED_TOKEN_QUOTA, REFUSED_BYTE_QUOTA, REFUSED_GROWING)


class QuotaView:
    """Per tenant (host NumPy, None where stale): token_quota, byte_quota (units), used_tokens
    and device units charged; `needs`: each waiting request's (tokens, units) it needs at least."""

    def __init__(self, config):
        self.block_units = config.pool_units[0]
        self.device_units = np.asarray([u if dev else 0 for u, dev in
                                        zip(config.pool_units, config.device_pools)], np.int64)
        self.quotas = self.usage = None
        self.needs = {}

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
            want["quotas"] = (t.token_quota, t.byte_quota)
        if self.usage is None:
            want["usage"] = (t.charged_blocks, t.used_tokens)
        if not want:
            return 0
        got = jax.device_get(want)
        if "quotas" in got:
            self.quotas = tuple(np.asarray(q, np.int64) for q in got["quotas"])
        if "usage" in got:
            self.usage = self._usage(*got["usage"])
        return 1

    def waits(self, sched, r, holders) -> bool:
        """Is request r waiting for room its tenant does not have yet? Not while its tenant is
        not in `holders` (holds nothing that will be freed): then r is tried, and refused again
        the scheduler can find it hopeless and refuse it for good, as before the waits."""
        need = self.needs.get(r)
        if need is None or r.tenant not in holders:
            return False
        sched.syncs += self.read(sched.state)
        (token_quota, byte_quota), (used, charged), t = self.quotas, self.usage, r.tenant
        return need[0] > token_quota[t] - used[t] or need[1] > byte_quota[t] - charged[t]

    def outcome(self, r, reason: int, missing_blocks: int):
        """After an admit call: a queued request refused for quota waits for room for its
        tokens and its missing blocks."""
        if reason in QUOTA_REFUSALS and r.status == "queued":
            self.needs[r] = (len(r.context), missing_blocks * self.block_units)
        else:
            self.needs.pop(r, None)


def device_holders(live, idle_sessions, but=None) -> set:
    """Tenants with something on the device that will be freed: running or prefilling requests
    (other than `but`) and IDLE session turns; suspended requests sit on host."""
    return {o.tenant for o in (*live, *idle_sessions)
            if o is not but and getattr(o, "status", "") != "suspended"}


def admit_call(sched, rows):
    """One admit call for a Scheduler's rows (padded to 4..max_admit rows and a power of two of
    tokens), its report read back."""
    b = bucket(len(rows), sched.max_admit, floor=4)
    ten, lens = np.full(b, -1, np.int32), np.zeros(b, np.int32)
    tok = np.zeros((b, bucket(max(len(r.context) for r in rows),
                              sched.config.max_tokens_per_seq)), np.int32)
    for j, r in enumerate(rows):
        ten[j], lens[j], tok[j, : len(r.context)] = r.tenant, len(r.context), r.context
    return sched._read(sched._op("admit", ten, tok, lens))
