"""plan_reclaim: turn a request and a policy into an ordered, exact plan.

Greedy over the policy's means in order: each step takes the victims' eligible sequences in the
policy's victim order, one at a time, until the target is met (or all of them under
`take_all`), and is then re-simulated as the one batched call apply_plan will make, so its bytes
are those of that call. Every victim sequence ends with one fate. Progress is counted in the
unit the request asks for: device quota bytes released by the victims (quota cut, lease expiry)
or pool-0 bytes made allocatable (make room).

The plan reads only what the victims' blocks touch (`plan_view`: their rows, their possible
heirs' rows, the blocks those reference or the victims pay for), so its cost follows the
victims' size, not the pool's: at 2^20 blocks a tenant's tiered cut plans in milliseconds.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from kvquota.codes import (
    FATE_GROWING,
    FATE_PREEMPTED,
    FATE_SUSPENDED,
    FATE_UNTOUCHED,
    SEQ_FREE,
    SEQ_RUNNING,
)
from kvquota.reclaim.means import RELEASE, Means, get_means
from kvquota.reclaim.plan import PlanStep, SeqFate
from kvquota.reclaim.simulate import HostModel
from kvquota.sentinel import INVALID
from kvquota.validation import bucket, pad

# The per-block fields a plan reads (at the blocks of its view only).
BLOCK_FIELDS = ("ref_count", "pin_count", "payer", "payer_refs", "fill", "hashed")


@jax.jit
def _rows_of(tables, rows):
    """tables[rows] (rows padded with INVALID: those give INVALID)."""
    return jnp.where((rows >= 0)[:, None], tables[jnp.maximum(rows, 0)], INVALID)


@functools.partial(jax.jit, static_argnames="size")
def _charged_to(payer, tenants, *, size: int):
    """Ids of the blocks whose payer is in `tenants` (i32[K], padded with -2): i32[size],
    ascending, INVALID past the last."""
    hit = jnp.isin(payer, tenants)
    return jnp.nonzero(hit, size=size, fill_value=INVALID)[0].astype(jnp.int32)


@jax.jit
def _blocks_at(blocks, ids):
    """The per-block fields a plan reads, at `ids` (padded with INVALID: read as block 0)."""
    at = jnp.maximum(ids, 0)
    return {k: getattr(blocks, k)[at] for k in BLOCK_FIELDS}


def plan_view(config, state, victims_of) -> types.SimpleNamespace:
    """The metadata a plan reads, on the host. The sequence and tenant columns whole ([S], [T]);
    of the block tables only the *local rows* — the live rows of tenants sharing a victim's salt
    (the victims' rows and every possible heir of their blocks); of the per-block arrays only the
    blocks those rows reference or the victims pay for (pinned blocks held by no table too). A
    plan so reads O(the victims' blocks), not O(pool): the HostModel works in local block ids
    (`view.block_ids[i]` is local block i's id, `view.local_tables` the rows in local ids).

    `victims_of(small)` picks the victim tenants from the small columns (`small.tenants`)."""
    t, s = state.tenants, state.seqs
    got = jax.device_get(dict(
        seq_lens=s.seq_lens, seq_tenant=s.seq_tenant, seq_status=s.seq_status, birth=s.birth,
        registered=t.registered, byte_quota=t.byte_quota, lease_expiry=t.lease_expiry,
        salt=t.salt, charged_blocks=t.charged_blocks, pinned_blocks=t.pinned_blocks,
        free_count=state.free.free_count, version=state.meta.version))
    ns = types.SimpleNamespace
    view = ns(seqs=ns(**{k: got[k] for k in ("seq_lens", "seq_tenant", "seq_status", "birth")}),
              tenants=ns(**{k: got[k] for k in ("registered", "byte_quota", "lease_expiry",
                                                "salt", "charged_blocks", "pinned_blocks")}),
              free=ns(free_count=got["free_count"]),
              version=tuple(int(v) for v in got["version"]))
    victims = victims_of(view)
    ten, salt = view.seqs.seq_tenant, view.tenants.salt
    live = (view.seqs.seq_status != SEQ_FREE) & (ten >= 0)
    salts = salt[np.asarray(victims, np.int64)] if len(victims) else np.zeros(0, salt.dtype)
    rows = np.flatnonzero(live & np.isin(salt[np.maximum(ten, 0)], salts))
    tables = np.asarray(_rows_of(s.block_tables, pad(rows, bucket(len(rows)))))[:len(rows)]
    ids = _distinct(config, tables[tables >= 0])
    got = jax.device_get(_blocks_at(state.blocks, pad(ids, bucket(len(ids)))))
    # The victims may pay for blocks no local row references (pinned ones, or a share whose
    # referencers left without an heir): when the referenced blocks do not account for every
    # charged one, one pass over the payer column finds them all.
    charged = int(view.tenants.charged_blocks[victims].sum()) if len(victims) else 0
    if charged > int(np.isin(got["payer"][:len(ids)], victims).sum()):
        want = np.full(bucket(len(victims)), -2, np.int32)
        want[:len(victims)] = victims
        paid = np.asarray(_charged_to(state.blocks.payer, want, size=bucket(charged)))[:charged]
        ids = _distinct(config, np.concatenate([ids, paid]))
        got = jax.device_get(_blocks_at(state.blocks, pad(ids, bucket(len(ids)))))
    view.victims = list(victims)
    view.block_ids = ids
    view.blocks = ns(**{k: v[:len(ids)] for k, v in got.items()})
    view.rows = rows  # global row ids of the local rows
    view.slot = np.full(len(ten), -1, np.int64)
    view.slot[rows] = np.arange(len(rows))
    view.tables = tables  # [R, MB] global block ids
    view.local_tables = np.where(tables >= 0, _local_ids(config, ids, np.maximum(tables, 0)),
                                 INVALID)
    return view


def _few(config, n: int) -> bool:
    """Whether n ids are few for this pool: then sort them; else use pool-sized maps (a fresh
    pool-sized array costs its page faults, ~2 ms per MB here; sorting 2M entries cost 0.5 s)."""
    return 8 * n < config.total_blocks


def _distinct(config, ids) -> np.ndarray:
    """The distinct block ids of `ids`, ascending, i32."""
    if _few(config, len(ids)):
        return np.unique(ids).astype(np.int32)
    seen = np.zeros(config.total_blocks, bool)
    seen[ids] = True
    return np.flatnonzero(seen).astype(np.int32)


def _local_ids(config, ids, blocks) -> np.ndarray:
    """The position of each of `blocks` in the ascending `ids` (each one of them)."""
    if _few(config, blocks.size):
        return np.searchsorted(ids, blocks).astype(np.int32)
    local = np.zeros(config.total_blocks, np.int32)
    local[ids] = np.arange(len(ids), dtype=np.int32)
    return local[blocks]


def victim_rows(policy, seqs, victims) -> np.ndarray:
    """The victims' sequences (every status but free), in the policy's victim order: newest
    `birth` first, most `seq_lens` first, or lowest priority first; ties by sequence id."""
    rows = np.flatnonzero(np.isin(seqs.seq_tenant, victims) & (seqs.seq_status != SEQ_FREE))
    if policy.victim_order == "newest":
        key = -seqs.birth[rows].astype(np.int64)
    elif policy.victim_order == "largest":
        key = -seqs.seq_lens[rows].astype(np.int64)
    else:
        prio = dict(policy.priorities)
        key = np.array([prio.get(int(r), 0) for r in rows], np.int64)
    return rows[np.argsort(key, kind="stable")]


class Planner:
    """One plan: the model, the victims, the target, and the steps taken so far."""

    def __init__(self, config, view, capacity, request, policy, victims, target_units, now,
                 evict_masks):
        self.c, self.view, self.request, self.policy = config, view, request, policy
        self.m = HostModel(config, view)
        self.m.free[:] = capacity  # allocatable capacity (free stacks + cold blocks)
        self.victims = victims
        self.target = target_units
        self.now = now
        self.evict_masks = evict_masks  # row -> bool[MB] kept blocks (the policy's choice)
        s = view.seqs
        self.rows = [int(r) for r in victim_rows(policy, s, victims)]
        self.fate = {r: FATE_UNTOUCHED for r in self.rows}
        self.moved = {}  # row -> blocks moved to host
        self.steps: list[PlanStep] = []
        self.start_units = self.m.device_units(victims)
        self.start_free = self.m.pool0_free()
        self.host_short = False  # an offload found no room on the host (opens compression)
        self.compress_pool = None
        if config.compressed_pools:
            names = [n for n, _ in config.compressed_pools]
            self.compress_pool = 1 + names.index(policy.compress_format or names[0])
        self.recorded = self.m.meters()  # (charged, free) as the last recorded step left them


    def progress(self) -> int:
        """Units gained so far toward the target."""
        if self.request.kind == "make_room":
            return self.m.pool0_free() - self.start_free
        return self.start_units - self.m.device_units(self.victims)

    def done(self) -> bool:
        """Target met (take_all: every step takes all it can, unless nothing was asked)."""
        if self.target <= 0:
            return True
        return not self.policy.take_all and self.progress() >= self.target

    def untouched(self, statuses, fates=(FATE_UNTOUCHED,)) -> list[int]:
        """Victim rows, in victim order, in one of `statuses` whose fate is one of `fates`."""
        status = self.view.seqs.seq_status
        return [r for r in self.rows if self.fate[r] in fates and status[r] in statuses]

    # ---- one step --------------------------------------------------------------------------
    def run_step(self, means: Means):
        """Take rows for `means` until the target is met; record the step(s) apply will run."""
        if not means.usable(self):
            return
        rows = means.candidates(self)
        start = self.m.copy() if rows and means.settles_from_start else None
        taken = []
        for r in rows:
            if self.done():
                break
            if means.take(self, r):
                self.fate[r] = means.fate
                taken.append(r)
                if not means.batched:
                    self.add_step(means.name, [r])
        if taken and means.batched:
            means.settle(self, taken, start)
            self.add_step(means.name, taken)

    def add_step(self, means, rows):
        """Record a step from the model's change since the last one."""
        m, c = self.m, self.c
        before_charged, before_free = self.recorded
        units = np.asarray(c.pool_units, np.int64)
        dev = np.asarray(c.device_pools)
        vict = list(self.victims)
        quota = int(((before_charged[vict] - m.charged[vict]) * (units * dev)).sum())
        pool_gain = ((m.free - before_free) * units * dev).sum()
        host_units = 0 if c.host_pool is None else int(before_free[c.host_pool]
                                                       - m.free[c.host_pool]) * units[-1]
        delta = (before_charged[vict] - m.charged[vict]).sum(axis=0)
        per_seq = tuple((int(r), int(self.moved.get(r, 0))) for r in rows)
        self.steps.append(PlanStep(
            means=means, seqs=tuple(int(r) for r in rows), blocks=int(np.abs(delta[0])),
            quota_bytes=quota * c.unit_bytes, pool_bytes=int(pool_gain) * c.unit_bytes,
            pool0_bytes=int(m.free[0] - before_free[0]) * c.pool_bytes[0],
            host_bytes=max(int(host_units), 0) * c.unit_bytes, per_seq=per_seq))
        self.recorded = m.meters()

    # ---- the whole plan --------------------------------------------------------------------
    def plan(self) -> tuple:
        if self.request.kind == "lease_expiry":  # every row goes, whatever the target
            for r in self.rows:
                self.fate[r] = RELEASE.fate
            RELEASE.settle(self, list(self.rows), None)
            self.add_step(RELEASE.name, list(self.rows))
        elif self.policy.grow_no_admit:  # takes nothing; a quota cut's survivors grow
            for r in self.rows if self.request.kind == "quota_cut" else ():
                if self.view.seqs.seq_status[r] == SEQ_RUNNING:
                    self.fate[r] = FATE_GROWING
        else:
            for name in self.policy.means:
                if self.done():
                    break
                self.run_step(get_means(name))
        return self.steps, self.fates()

    def fates(self) -> tuple[SeqFate, ...]:
        c, s = self.c, self.view.seqs
        out = []
        for r in sorted(self.rows):
            f = self.fate[r]
            tokens = int(s.seq_lens[r])
            resume_tokens = resume_bytes = 0
            if f == FATE_PREEMPTED:
                table = self.view.local_tables[self.view.slot[r]]
                usable = max(tokens - 1, 0) // c.block_size  # the last token is recomputed
                blocks = table[:usable]
                ok = self.m.still_cached(blocks) if len(blocks) else np.zeros(0, bool)
                hits = int(np.argmin(ok)) if not ok.all() else len(ok)
                resume_tokens = tokens - hits * c.block_size
            elif f == FATE_SUSPENDED:
                resume_bytes = self.moved.get(r, 0) * c.pool_bytes[c.host_pool]
            out.append(SeqFate(seq=r, tenant=int(s.seq_tenant[r]), fate=f, tokens=tokens,
                               resume_tokens=resume_tokens, resume_bytes=resume_bytes,
                               resume_seconds=resume_bytes / c.host_bandwidth))
        return tuple(out)

    def held(self) -> tuple[int, int]:
        """(bytes pins hold, bytes others hold) of the victims after the plan, on device."""
        c, m = self.c, self.m
        dev_pool = np.asarray(c.device_pools)[m.pool]
        victim = np.isin(m.payer, self.victims) & dev_pool
        units = np.asarray(c.pool_units, np.int64)[m.pool]
        pinned = int((units * (victim & (m.pin > 0))).sum())
        own_refs = np.zeros(len(m.ref), np.int64)
        live = np.flatnonzero(m.alive & np.isin(m.ten, self.victims))
        ents = m.tables[m.slot[live]]  # every victim row is a local row
        np.add.at(own_refs, ents[ents >= 0], 1)
        shared = victim & (m.pin == 0) & (m.ref > own_refs)
        held_shared = int((units * shared).sum()) + m.inherited_by_others
        return pinned * c.unit_bytes, held_shared * c.unit_bytes
