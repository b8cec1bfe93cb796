"""plan_reclaim and apply_plan: the reclaim in one action, validated (`Allocator` delegates here).

plan_reclaim reads to the host the metadata the victims' blocks touch and plans there
(kvquota.reclaim.planner), or, with `on_device=True`, plans on the device in one jitted call
(kvquota.reclaim.device_plan: equal plans; on a CPU at 2^20 blocks the host plan is the faster);
apply_plan runs each step through the validated ops in `kvquota.core` and measures what each step
really returned from the state itself (charges and allocatable capacity before and after), so the
report's bytes are observed, not copied from the plan — tests hold them equal. A plan records
the state's version (`KVState.meta.version`): apply_plan refuses a state of any other.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from kvquota.codes import FATE_PREEMPTED, SEQ_IDLE, SEQ_RUNNING
from kvquota.core.cold import allocatable
from kvquota.core.evict import token_view
from kvquota.core.lifecycle import rebalance, set_growing_core
from kvquota.core.tenants import quota_units, set_quota
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
from kvquota.reclaim.device_plan import host_reason, plan_on_device
from kvquota.reclaim.means import get_means
from kvquota.reclaim.planner import Planner, plan_view
from kvquota.validation import int_scalar, tenant_id


# ---- plan --------------------------------------------------------------------------------
def _capacity(config, state) -> np.ndarray:
    """Allocatable blocks per pool (free stacks, plus pool 0's cold cached blocks)."""
    return np.asarray(allocatable(config, state, xp=np)).astype(np.int64)


def plan_reclaim(config, state, request: ReclaimRequest, policy="tiered", *,
                 now: Optional[int] = None, on_device: bool = False) -> ReclaimPlan:
    """Plan a reclaim without changing the state: ordered steps with their exact bytes,
    every affected sequence's fate and resume cost, the shortfall. `now` (a step) marks
    tenants whose lease ended as inactive for the drop_idle means.

    The plan is made with the host model over the victims' blocks (`planner.Planner`); with
    `on_device` in one jitted call over the state's arrays (`device_plan`, equal plans, tested
    against the host model), except where `device_plan.host_reason` names a reason (a policy
    that may evict, a user's means)."""
    c = config
    pol = get_reclaim_policy(policy)
    if not isinstance(request, ReclaimRequest) or request.kind not in REQUEST_KINDS:
        raise InvalidArgumentError(f"request must be a ReclaimRequest of kind "
                                   f"{'/'.join(REQUEST_KINDS)}, got {request!r}")
    t = tenant_id(c, state, request.tenant)
    if pol.compress_format is not None and pol.compress_format not in dict(c.compressed_pools):
        raise TierError(f"policy {pol.name!r} compresses into {pol.compress_format!r}: this "
                        f"config has no such pool")
    if request.kind == "make_room":
        need = int_scalar("bytes_needed", request.bytes_needed, QuotaValueError)
        if need < 0:
            raise QuotaValueError(f"bytes_needed must be >= 0, got {need}")
    elif request.kind == "quota_cut":
        new_units = quota_units(c, request.byte_quota)

    def target_of(charged_blocks, capacity):
        """(target, bytes per unit): pool-0 blocks to make allocatable (make room), or device
        units the tenant is charged above its new quota (quota cut) or at all (lease expiry)."""
        if request.kind == "make_room":
            return max(0, -(-need // c.pool_bytes[0]) - int(capacity[0])), c.pool_bytes[0]
        dev_units = np.asarray([u if d else 0 for u, d in zip(c.pool_units, c.device_pools)])
        charged = int((np.asarray(charged_blocks)[t] * dev_units).sum())
        if request.kind == "quota_cut":
            return max(0, charged - new_units), c.unit_bytes
        return charged, c.unit_bytes

    if on_device and host_reason(pol, request) is None:
        return plan_on_device(c, state, request, pol, t, target_of, now)

    def victims_of(view):  # make room: every other registered tenant; else the request's
        if request.kind == "make_room":
            return [int(v) for v in np.flatnonzero(view.tenants.registered) if v != t]
        return [t]

    view = plan_view(c, state, victims_of)
    victims = view.victims
    capacity = _capacity(c, state)
    target, unit = target_of(view.tenants.charged_blocks, capacity)
    masks = _evict_masks(c, state, view, victims, pol) if (
        pol.allow_evict and "evict" in pol.means) else {}
    planner = Planner(c, view, capacity, request, pol, victims, target, now, masks)
    steps, fates = planner.plan()
    pinned, shared = planner.held()
    gained = planner.progress() if request.kind != "lease_expiry" else target
    return ReclaimPlan(request=request, policy=pol, target_bytes=target * unit,
                       steps=tuple(steps), fates=fates,
                       shortfall_bytes=max(0, target - gained) * unit,
                       pinned_bytes_held=pinned, shared_bytes_held=shared,
                       version=view.version)


def _evict_masks(config, state, view, victims, pol) -> dict:
    """row -> bool[MB]: the whole blocks the eviction policy keeps (as `evict` chooses)."""
    c = config
    s = view.seqs
    rows = np.flatnonzero(np.isin(s.seq_tenant, victims)
                          & np.isin(s.seq_status, (SEQ_RUNNING, SEQ_IDLE))).astype(np.int32)
    if not len(rows):
        return {}
    scorer = get_policy(pol.evict_policy)
    if "last_attention" in scorer.needs:
        raise InvalidArgumentError(f"eviction policy {pol.evict_policy!r} needs the last "
                                   "step's attention, which a reclaim plan does not have")
    tables = view.tables[view.slot[rows]]  # victims' rows are local rows of the view
    view = token_view(c, state, rows, tables, scorer, None)
    keep = max(1, pol.evict_keep_tokens // c.block_size)
    mask = np.asarray(scorer.block_keep_mask(view, c.block_size,
                                             np.full(len(rows), keep, np.int32)))
    return {int(r): mask[i] for i, r in enumerate(rows)
            if not (tables[i] >= c.num_blocks).any()}  # pool-0 only: no copies elsewhere


# ---- apply -------------------------------------------------------------------------------
def apply_plan(config, state, plan: ReclaimPlan, *, donate=False) -> tuple:
    """Run `plan` on the state it was made for (PlanMismatchError otherwise): set the new
    quota (quota cut) or the grow flag, then each step through the validated ops, then the
    rebalance. Returns (state, ReclaimReport) with the bytes each step really moved."""
    c = config
    if not isinstance(plan, ReclaimPlan):
        raise InvalidArgumentError(f"plan must be a ReclaimPlan, got {type(plan).__name__}")
    if tuple(int(v) for v in np.asarray(state.meta.version)) != plan.version:
        raise PlanMismatchError("this plan was made for another state (an operation ran "
                                "since, or it is another fork): plan again")
    req, pol = plan.request, plan.policy
    first = [True]

    def step_donate():  # the first op consumes the caller's state only when asked to
        d = donate or not first[0]
        first[0] = False
        return d

    if req.kind == "quota_cut":
        state, _ = set_quota(c, state, req.tenant, byte_quota=req.byte_quota,
                             donate=step_donate())
    if pol.grow_no_admit and req.kind == "quota_cut":
        state, _ = set_growing_core(c, state, np.int32(req.tenant), np.bool_(True),
                                    donate=step_donate())
    victims = _victims(c, plan)
    steps, archives, preempted = [], [], []
    for step in plan.steps:
        before = _meter(c, state, victims)
        means = get_means(step.means)
        state, rep = means.apply(c, state, plan, step, step_donate())
        archives += [SeqArchive(seq=s, tenant=t, token_ids=tok, position=p)
                     for s, t, tok, p in means.archives(rep)]
        if means.fate == FATE_PREEMPTED:
            preempted += list(step.seqs)
        steps.append(_measured(c, step, before, _meter(c, state, victims)))
    moved = dict(recycled_slots=0, cold_blocks_dropped=0)
    if pol.rebalance and preempted:
        state, moved = rebalance(c, state, seq_ids=np.asarray(preempted, np.int32),
                                 donate=step_donate())
    return state, ReclaimReport(plan=plan, steps=tuple(steps), fates=plan.fates,
                                archives=tuple(archives), rebalance=moved,
                                shortfall_bytes=plan.shortfall_bytes)


def _victims(config, plan):
    """Tenants whose charges a plan counts: the request's tenant, or (make room) all
    others (unregistered ones are charged nothing)."""
    t = plan.request.tenant
    if plan.request.kind != "make_room":
        return [t]
    return [u for u in range(config.num_tenants) if u != t]


def _meter(config, state, victims):
    """(victims' charged blocks [POOLS], allocatable blocks [POOLS]) read from the state."""
    charged = np.asarray(state.tenants.charged_blocks)[victims].astype(np.int64).sum(axis=0)
    return charged, _capacity(config, state)


def _measured(config, step: PlanStep, before, after) -> PlanStep:
    """The step as observed: the plan's step with its byte figures re-measured."""
    c = config
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
