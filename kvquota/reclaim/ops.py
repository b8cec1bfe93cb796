"""The reclaim verbs of the facade: session lifecycle (idle, resume, preempt), plan_reclaim,
apply_plan and rebalance. A mixin of `kvquota.allocator.Allocator`.

plan_reclaim reads the state's metadata once to the host and plans there (kvquota.reclaim.planner);
apply_plan runs each step through the validating facade ops and measures what each step really
returned from the state itself (charges and allocatable capacity before and after), so the
report's bytes are observed, not copied from the plan — tests hold them equal.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from kvquota import core
from kvquota.codes import FATE_PREEMPTED, SEQ_IDLE, SEQ_PREEMPTED, SEQ_RUNNING
from kvquota.errors import (
    InvalidArgumentError,
    PlanMismatchError,
    QuotaValueError,
    TierError,
)
from kvquota.policies import get_policy
from kvquota.reclaim.plan import (
    REQUEST_KINDS,
    PlanStep,
    ReclaimPlan,
    ReclaimReport,
    ReclaimRequest,
    SeqArchive,
    get_reclaim_policy,
)
from kvquota.reclaim.means import get_means
from kvquota.reclaim.planner import Planner, fingerprint, host_view
from kvquota.sentinel import INVALID
from kvquota.validation import bucket, int_scalar, pad

class ReclaimOps:
    """Lifecycle, plan / apply and rebalance; `self.config`, the validation helpers and `_run`
    (core.run on this config) come from the Allocator."""

    # ---- session lifecycle -------------------------------------------------------------------
    def set_idle(self, state, seq_ids, *, donate=False):
        """RUNNING -> IDLE: a multi-turn session between turns keeps its KV, appends refused."""
        self._check_state(state)
        ids, _ = self._batch(state, seq_ids, "set_idle", (SEQ_RUNNING,))
        return self._run("set_status", state, ids, np.int8(SEQ_IDLE), donate=donate)

    def resume(self, state, seq_ids, *, donate=False):
        """IDLE -> RUNNING: the session's next turn (append its tokens as usual)."""
        self._check_state(state)
        ids, _ = self._batch(state, seq_ids, "resume", (SEQ_IDLE,))
        return self._run("set_status", state, ids, np.int8(SEQ_RUNNING), donate=donate)

    def preempt(self, state, seq_ids, *, donate=False):
        """Drop running or idle sequences' KV (one reference per table entry, as `free`), archive
        their token ids and positions in the report, and hold each slot as PREEMPTED (tenant
        kept, counted in its `preemptions`) until `rebalance` recycles it."""
        self._check_state(state)
        ids, real = self._batch(state, seq_ids, "preempt", (SEQ_RUNNING, SEQ_IDLE))
        ten = np.asarray(state.seqs.seq_tenant)[real]
        heirs = self._heir_rows(state, np.asarray(state.tenants.salt)[ten], real)
        return self._run("preempt", state, pad(real, bucket(len(real))), heirs, donate=donate)

    def rebalance(self, state, *, seq_ids=None, cold_blocks: int = 0, donate=False) -> tuple:
        """Make returned capacity allocatable: recycle PREEMPTED slots (`seq_ids`, default all)
        into free slots, and drop up to `cold_blocks` cold cached blocks from the prefix cache,
        least recently used first (they are already free capacity; dropping them only forgets
        their content). Reports what it moved. (The block-level means never leave partly
        filled blocks except each sequence's tail, so there is nothing to compact.)"""
        self._check_state(state)
        cold = int_scalar("cold_blocks", cold_blocks, InvalidArgumentError)
        if cold < 0:
            raise InvalidArgumentError(f"cold_blocks must be >= 0, got {cold}")
        status = np.asarray(state.seqs.seq_status)
        if seq_ids is None:
            rows = np.flatnonzero(status == SEQ_PREEMPTED).astype(np.int32)
        else:
            rows, _ = self._batch(state, seq_ids, "rebalance", (SEQ_PREEMPTED,))
            rows = rows[rows != INVALID]
        moved = dict(recycled_slots=int(len(rows)), cold_blocks_dropped=0)
        if len(rows):
            state, _ = self._run("recycle", state, pad(rows, bucket(len(rows))), donate=donate)
            donate = True
        if cold:
            state, rep = self.drop_cold(state, cold, donate=donate)
            moved["cold_blocks_dropped"] = int(rep.dropped_blocks)
        return state, moved

    # ---- plan --------------------------------------------------------------------------------
    def _capacity(self, state) -> np.ndarray:
        """Allocatable blocks per pool (free stacks, plus pool 0's cold cached blocks)."""
        return np.asarray(core.allocatable(self.config, state, xp=np)).astype(np.int64)

    def plan_reclaim(self, state, request: ReclaimRequest, policy="tiered", *,
                     now: Optional[int] = None) -> ReclaimPlan:
        """Plan a reclaim without changing the state: ordered steps with their exact bytes,
        every affected sequence's fate and resume cost, the shortfall. `now` (a step) marks
        tenants whose lease ended as inactive for the drop_idle means."""
        self._check_state(state)
        c = self.config
        pol = get_reclaim_policy(policy)
        if not isinstance(request, ReclaimRequest) or request.kind not in REQUEST_KINDS:
            raise InvalidArgumentError(f"request must be a ReclaimRequest of kind "
                                       f"{'/'.join(REQUEST_KINDS)}, got {request!r}")
        t = self._tenant(state, request.tenant)
        if pol.compress_format is not None and pol.compress_format not in dict(c.compressed_pools):
            raise TierError(f"policy {pol.name!r} compresses into {pol.compress_format!r}: this "
                            f"config has no such pool")
        host = host_view(state)
        capacity = self._capacity(state)
        dev_units = np.asarray([u if d else 0 for u, d in zip(c.pool_units, c.device_pools)])
        if request.kind == "make_room":
            need = int_scalar("bytes_needed", request.bytes_needed, QuotaValueError)
            if need < 0:
                raise QuotaValueError(f"bytes_needed must be >= 0, got {need}")
            victims = [int(v) for v in np.flatnonzero(host.tenants.registered) if v != t]
            target = max(0, -(-need // c.pool_bytes[0]) - int(capacity[0]))  # pool-0 blocks
            unit = c.pool_bytes[0]
        else:
            victims, unit = [t], c.unit_bytes
            charged = int((host.tenants.charged_blocks[t] * dev_units).sum())
            if request.kind == "quota_cut":
                new_units = self._quota_units(request.byte_quota)
                target = max(0, charged - new_units)
            else:
                target = charged
        masks = self._evict_masks(state, host, victims, pol) if (
            pol.allow_evict and "evict" in pol.means) else {}
        planner = Planner(c, host, capacity, request, pol, victims, target, now, masks)
        steps, fates = planner.plan()
        pinned, shared = planner.held()
        gained = planner.progress() if request.kind != "lease_expiry" else target
        return ReclaimPlan(request=request, policy=pol, target_bytes=target * unit,
                           steps=tuple(steps), fates=fates,
                           shortfall_bytes=max(0, target - gained) * unit,
                           pinned_bytes_held=pinned, shared_bytes_held=shared,
                           fingerprint=fingerprint(host, capacity))

    def _evict_masks(self, state, host, victims, pol) -> dict:
        """row -> bool[MB]: the whole blocks the eviction policy keeps (as the facade chooses)."""
        c = self.config
        s = host.seqs
        rows = np.flatnonzero(np.isin(s.seq_tenant, victims)
                              & np.isin(s.seq_status, (SEQ_RUNNING, SEQ_IDLE))).astype(np.int32)
        if not len(rows):
            return {}
        scorer = get_policy(pol.evict_policy)
        if "last_attention" in scorer.needs:
            raise InvalidArgumentError(f"eviction policy {pol.evict_policy!r} needs the last "
                                       "step's attention, which a reclaim plan does not have")
        tables = s.block_tables[rows]
        view = self._token_view(state, rows, tables, scorer, None)
        keep = max(1, pol.evict_keep_tokens // c.block_size)
        mask = np.asarray(scorer.block_keep_mask(view, c.block_size,
                                                 np.full(len(rows), keep, np.int32)))
        return {int(r): mask[i] for i, r in enumerate(rows)
                if not (tables[i] >= c.num_blocks).any()}  # pool-0 only: no copies elsewhere

    # ---- apply -------------------------------------------------------------------------------
    def apply_plan(self, state, plan: ReclaimPlan, *, donate=False) -> tuple:
        """Run `plan` on the state it was made for (PlanMismatchError otherwise): set the new
        quota (quota cut) or the grow flag, then each step through the facade ops, then the
        rebalance. Returns (state, ReclaimReport) with the bytes each step really moved."""
        self._check_state(state)
        if not isinstance(plan, ReclaimPlan):
            raise InvalidArgumentError(f"plan must be a ReclaimPlan, got {type(plan).__name__}")
        if fingerprint(host_view(state), self._capacity(state)) != plan.fingerprint:
            raise PlanMismatchError("this plan was made for another state (tables, charges, "
                                    "pins or free capacity differ): plan again")
        req, pol = plan.request, plan.policy
        first = [True]

        def step_donate():  # the first op consumes the caller's state only when asked to
            d = donate or not first[0]
            first[0] = False
            return d

        if req.kind == "quota_cut":
            state, _ = self.set_quota(state, req.tenant, byte_quota=req.byte_quota,
                                      donate=step_donate())
        if pol.grow_no_admit and req.kind == "quota_cut":
            state, _ = self._run("set_growing", state, np.int32(req.tenant), np.bool_(True),
                                 donate=step_donate())
        victims = self._victims(plan)
        steps, archives, preempted = [], [], []
        for step in plan.steps:
            before = self._meter(state, victims)
            means = get_means(step.means)
            state, rep = means.apply(self, state, plan, step, step_donate())
            archives += [SeqArchive(seq=s, tenant=t, token_ids=tok, position=p)
                         for s, t, tok, p in means.archives(rep)]
            if means.fate == FATE_PREEMPTED:
                preempted += list(step.seqs)
            steps.append(self._measured(step, before, self._meter(state, victims)))
        rebalance = dict(recycled_slots=0, cold_blocks_dropped=0)
        if pol.rebalance and preempted:
            state, rebalance = self.rebalance(state, seq_ids=np.asarray(preempted, np.int32),
                                              donate=step_donate())
        return state, ReclaimReport(plan=plan, steps=tuple(steps), fates=plan.fates,
                                    archives=tuple(archives), rebalance=rebalance,
                                    shortfall_bytes=plan.shortfall_bytes)

    def _victims(self, plan):
        """Tenants whose charges a plan counts: the request's tenant, or (make room) all
        others (unregistered ones are charged nothing)."""
        t = plan.request.tenant
        if plan.request.kind != "make_room":
            return [t]
        return [u for u in range(self.config.num_tenants) if u != t]

    def _meter(self, state, victims):
        """(victims' charged blocks [POOLS], allocatable blocks [POOLS]) read from the state."""
        charged = np.asarray(state.tenants.charged_blocks)[victims].astype(np.int64).sum(axis=0)
        return charged, self._capacity(state)

    def _measured(self, step: PlanStep, before, after) -> PlanStep:
        """The step as observed: the plan's step with its byte figures re-measured."""
        c = self.config
        units = np.asarray(c.pool_units, np.int64)
        dev = np.asarray(c.device_pools)
        (cb, fb), (ca, fa) = before, after
        host = 0 if c.host_pool is None else int(fb[c.host_pool] - fa[c.host_pool])
        return dataclasses.replace(
            step, blocks=int(abs(cb[0] - ca[0])),
            quota_bytes=int(((cb - ca) * units * dev).sum()) * c.unit_bytes,
            pool_bytes=int(((fa - fb) * units * dev).sum()) * c.unit_bytes,
            pool0_bytes=int(fa[0] - fb[0]) * c.pool_bytes[0],
            host_bytes=max(host, 0) * c.pool_bytes[c.host_pool] if c.host_pool is not None else 0)
