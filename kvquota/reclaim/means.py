"""The reclaim means: one small class each, in one registry.

A means answers four questions, which the planner and `apply_plan` ask of every means alike:

* `usable(planner)`: may the step run at all (eviction allowed, compression's host gate)?
* `candidates(planner)`: the victim rows it may take, in the policy's victim order;
* `take(planner, row)`: apply it to one row in the plan's host model (`HostModel`), so the plan
  states exact bytes; False (model unchanged) when the row cannot be taken;
* `apply(config, state, plan, step, donate)`: the validated op that does it for real.

A step covers the rows taken in one facade call (`batched`), or one row (eviction, whose core
judges own blocks per call). Drops settle their rows as one batch (`settle`), so the plan
re-simulates the step as the call apply_plan will make. Adding a means is one class and one
`register` line; a policy then lists it by name.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvquota.codes import (
    FATE_COMPRESSED,
    FATE_EVICTED,
    FATE_PREEMPTED,
    FATE_RELEASED,
    FATE_SUSPENDED,
    FATE_UNTOUCHED,
    SEQ_IDLE,
    SEQ_RUNNING,
)
from kvquota.core import compress, evict, lifecycle, release, tiers


class Means:
    """One way of taking a tenant's KV back; subclasses set the class attributes and override
    the hooks they need."""

    name: ClassVar[str]
    fate: ClassVar[int]  # what a taken sequence does next (kvquota.codes FATE_*)
    batched: ClassVar[bool] = True  # one facade call for the step's rows (False: one per row)
    settles_from_start: ClassVar[bool] = False  # `settle` redoes the step from its start model

    def usable(self, planner) -> bool:
        return True

    def candidates(self, planner) -> list[int]:
        """Untouched RUNNING or IDLE victim rows."""
        return planner.untouched((SEQ_RUNNING, SEQ_IDLE))

    def take(self, planner, row: int) -> bool:
        raise NotImplementedError

    def settle(self, planner, rows: list[int], start) -> None:
        """Bring the model to what the step's one call does to `rows` (most means: nothing);
        `start` is a copy of the model before the step when `settles_from_start`."""

    def apply(self, config, state, plan, step, donate):
        """(state, report) of the validated op (`kvquota.core`) that carries out `step`."""
        raise NotImplementedError

    def archives(self, report) -> tuple:
        """(seq, tenant, token ids, position) of each sequence the op archived (drops only)."""
        return ()


class _Drop(Means):
    """Drop the rows' KV (one reference per table entry), archived for a replay by recompute."""

    fate = FATE_PREEMPTED
    settles_from_start = True

    def take(self, planner, row):
        planner.m.drop([row], victims=planner.victims)
        return True

    def settle(self, planner, rows, start):
        # Blocks the rows share settle differently when dropped together (heirs, last refs).
        planner.m = start
        planner.m.drop(rows, victims=planner.victims)

    def apply(self, config, state, plan, step, donate):
        return lifecycle.preempt(config, state, np.asarray(step.seqs, np.int32), donate=donate)

    def archives(self, report):
        return tuple(report.archives())


class DropIdle(_Drop):
    """IDLE sessions of inactive tenants (none running, or lease over at `now`): KV dropped."""

    name = "drop_idle"

    def candidates(self, planner):
        seqs = planner.view.seqs
        inactive = inactive_tenants(seqs, planner.view.tenants.lease_expiry, planner.victims,
                                    planner.now)
        return [r for r in planner.untouched((SEQ_IDLE,)) if seqs.seq_tenant[r] in inactive]


def inactive_tenants(seqs, lease_expiry, victims, now) -> set[int]:
    """The victims with no RUNNING sequence, or whose lease ended by `now` (None: no clock)."""
    running = set(seqs.seq_tenant[seqs.seq_status == SEQ_RUNNING].tolist())
    return {t for t in victims if t not in running
            or (now is not None and lease_expiry[t] <= now)}


class Preempt(_Drop):
    """RUNNING or IDLE sequences dropped whole (a compressed one too); replayed by recompute."""

    name = "preempt"

    def candidates(self, planner):
        return planner.untouched((SEQ_RUNNING, SEQ_IDLE), fates=(FATE_UNTOUCHED, FATE_COMPRESSED))


class _Offload(Means):
    """The rows' own pool-0 blocks moved to the host pool (suspended until restored)."""

    fate = FATE_SUSPENDED
    statuses: ClassVar[tuple[int, ...]]

    def candidates(self, planner):
        return planner.untouched(self.statuses)

    def take(self, planner, row):
        c, m = planner.c, planner.m
        if c.host_pool is None:
            return False
        pos = m.own(row, 0)
        if len(pos) > m.free[c.host_pool]:
            planner.host_short = True  # opens the compression gate
            return False
        planner.moved[row] = len(pos)
        m.move(row, pos, c.host_pool)
        return True

    def apply(self, config, state, plan, step, donate):
        return tiers.offload(config, state, np.asarray(step.seqs, np.int32), donate=donate)


class OffloadIdle(_Offload):
    name = "offload_idle"
    statuses = (SEQ_IDLE,)


class SuspendRunning(_Offload):
    name = "suspend_running"
    statuses = (SEQ_RUNNING,)


class Compress(Means):
    """Own cold full pool-0 blocks requantized into a compressed pool (lossy)."""

    name = "compress"
    fate = FATE_COMPRESSED

    def usable(self, planner):
        """Only once the host alarm rings or the host could not take a row (DESIGN.md §1.4),
        unless the policy ungates it."""
        c = planner.c
        if not c.compressed_pools:
            return False
        if not planner.policy.compress_gated or c.host_pool is None or planner.host_short:
            return True
        used = c.pool_sizes[c.host_pool] - planner.m.free[c.host_pool]
        return used >= c.host_watermark * c.pool_sizes[c.host_pool]

    def take(self, planner, row):
        c, m, pool = planner.c, planner.m, planner.compress_pool
        pos = m.own(row, 0)
        full = m.fill[m.table(row)[pos]] == c.block_size
        lens = planner.view.seqs.seq_lens[row]
        cold = (pos + 1) * c.block_size <= lens - planner.policy.compress_keep_recent
        pos = pos[full & cold]
        group = compress.group_blocks(c, pool)  # a KIVI key group: its blocks go together
        if group > 1:
            first, n = np.unique(pos // group, return_counts=True)
            pos = pos[np.isin(pos // group, first[n == group])]
        if not len(pos) or len(pos) > m.free[pool]:
            return False
        m.move(row, pos, pool)
        return True

    def apply(self, config, state, plan, step, donate):
        pol = plan.policy
        fmt = pol.compress_format or config.compressed_pools[0][0]
        return compress.compress(config, state, np.asarray(step.seqs, np.int32), kv_format=fmt,
                                 keep_recent=pol.compress_keep_recent, policy="coldest",
                                 donate=donate)


class Evict(Means):
    """Whole blocks of the least-scored tokens dropped for good (lossy; off unless allowed)."""

    name = "evict"
    fate = FATE_EVICTED
    batched = False  # the core judges own blocks per call

    def usable(self, planner):
        return planner.policy.allow_evict

    def take(self, planner, row):
        m = planner.m
        keep = planner.evict_masks.get(row)
        if keep is None:
            return False
        e = m.table(row)
        live = e >= 0
        ec = np.where(live, e, 0)
        dropped = live & ~keep
        if not dropped.any():
            return False
        first = int(np.argmax(dropped))
        own = (m.ref[ec] == 1) & (m.pin[ec] == 0) & (m.payer[ec] == m.ten[row])
        fresh = keep & live & (np.arange(len(e)) >= first) & ~own  # copies on write
        if fresh.sum() > m.free[0] or (fresh & (m.pool[ec] != 0)).any():
            return False
        m.copy_on_write(row, int(fresh.sum()))
        m.drop([], entries=[(row, np.flatnonzero(dropped | fresh))], victims=planner.victims)
        return True

    def apply(self, config, state, plan, step, donate):
        pol = plan.policy
        return evict.evict(config, state, np.asarray(step.seqs, np.int32),
                           policy=pol.evict_policy, keep_tokens=pol.evict_keep_tokens,
                           mode="block", donate=donate)


class Release(Means):
    """A lease expiry: every sequence of the tenant released, its pins dropped (not a policy
    step: the planner takes it for every lease expiry)."""

    name = "release"
    fate = FATE_RELEASED

    def settle(self, planner, rows, start):
        planner.m.drop(rows, unpin_tenant=planner.victims[0], victims=planner.victims)

    def apply(self, config, state, plan, step, donate):
        return release.release_tenant(config, state, plan.request.tenant, unpin=True,
                                      donate=donate)


# ---- the registry --------------------------------------------------------------------------
REGISTRY: dict[str, Means] = {}
RELEASE = Release()


def register(means: Means) -> Means:
    """Make `means` available to policies under `means.name` (listed by ReclaimPolicy.means)."""
    if not isinstance(means, Means) or means.name == RELEASE.name:
        raise TypeError(f"expected a Means other than {RELEASE.name!r}, got {means!r}")
    REGISTRY[means.name] = means
    return means


# The built-in means, in the tiered order of DESIGN.md §1.4.
for _means in (DropIdle(), OffloadIdle(), SuspendRunning(), Compress(), Preempt(), Evict()):
    register(_means)


def get_means(name: str) -> Means:
    """The registered means (or the lease expiry's release) called `name`."""
    return RELEASE if name == RELEASE.name else REGISTRY[name]
