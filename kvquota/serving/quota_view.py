"""Admission calls without the rows the device would surely refuse.

A refused admission row costs the device as much as an accepted one (its prompt is hashed and
looked up before the quota check), and a tenant cut far below its holdings is tried again at
every step that frees one of its sequences (`waiting.Parking`), each time with all its queue heads.
The scheduler's admission call (`Scheduler._admission_call`) keeps its rows and their order,
but sends to the device only the rows whose refusal is not certain (`QuotaView.sure_refusals`);
the others get, on the host, the refusal and reason
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

QUOTA_OPS = ("register_tenant", "set_quota", "apply_plan")  # ops that may change quotas or flags
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
