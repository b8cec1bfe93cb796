"""plan_reclaim on the device: the whole plan in one jitted call, read back once.

The host model (`kvquota.reclaim.simulate.HostModel`, driven by `planner.Planner`) walks the
victims' sequences one at a time in NumPy; this module computes the same plan from the state's
device arrays in one `jax.jit` call and reads back a few small fixed-shape arrays (which step took
each victim row, the blocks it moved, its fate and prefix-cache hits; each step's meters; the
bytes pins and other tenants hold), which `plan_on_device` turns into the very `ReclaimPlan` the
host planner gives. The host model stays the oracle: tests compare the two plans exactly.

How each means is computed (the steps interact, so they run in the policy's order, unrolled in
Python inside the jit, each on the model the previous one left):

* **drops** (drop_idle, preempt): per block, the rank (in the step's victim order) of the
  candidate whose drop releases its last reference that counts — any reference for "make room"
  (the block returns to pool 0), the payer's own references for a quota cut or lease expiry (its
  charge leaves the tenant: freed, or passed to an heir) — never when pinned or held by a row
  that is not a candidate. Cumulative units by rank give the progress after k rows, so the step
  takes the first k that meet the target (all under `take_all`) without a loop, and settles
  them as the one batch apply_plan's call makes (heirs: the lowest-id tenant among the live rows
  outside the batch that share a dropped row's salt and reference the block; none: the payer
  keeps the charge).
* **moves** (offload_idle, suspend_running, compress): a `lax.while_loop` over the victim rows in
  order with a scalar carry (progress, the destination pool's free blocks, the "host short" flag
  that opens compression), stopping once the target is met; each row's own blocks (ref 1,
  unpinned, paid by its tenant; compress: the cold full ones) are counted vectorised beforehand.
* **release** (lease expiry): every victim row dropped and the tenant's pins dropped, one batch.

Moved blocks keep their table entry, marked with their new pool (`moved_pool`): the host model
gives them fresh ids and leaves the old ids free, and so does this model (ref 0, no payer).

Cost: each drop step, the lease expiry's unpinning and the held bytes pass over the pool-sized
per-block arrays, and each step that may modify them gets a copy inside its `lax.cond`; the
host plan reads only the victims' blocks (`planner.plan_view`). On a CPU the host plan is so
the faster of the two at 2^20 blocks (a tiered quota cut's plan 16.9 ms on the host, 70.6 ms
here, bench_reclaim, 2 loaded cores), and `plan_reclaim` makes the host plan unless asked
(`on_device=True`); the device plan keeps the metadata where an accelerator holds it, unmeasured
on one so far.

What stays on the host (`host_reason`): a policy whose eviction step may run (the scorer's
masks and the per-row copy-on-write steps), and a means registered by a user (its hooks are
Python). `plan_reclaim` sends those to `planner.Planner`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvquota.codes import (
    FATE_COMPRESSED,
    FATE_GROWING,
    FATE_PREEMPTED,
    FATE_RELEASED,
    FATE_SUSPENDED,
    FATE_UNTOUCHED,
    SEQ_FREE,
    SEQ_IDLE,
    SEQ_RUNNING,
)
from kvquota.reclaim import means as means_mod
from kvquota.reclaim.means import inactive_tenants
from kvquota.reclaim.plan import PlanStep, ReclaimPlan, SeqFate
from kvquota.reclaim.planner import victim_rows
from kvquota.sentinel import INVALID
from kvquota.state import StateConfig, pool_of
from kvquota.validation import bucket, pad

# The means this module computes, each by the built-in class whose rules it follows.
DEVICE_MEANS = {"drop_idle": means_mod.DropIdle, "offload_idle": means_mod.OffloadIdle,
                "suspend_running": means_mod.SuspendRunning, "compress": means_mod.Compress,
                "preempt": means_mod.Preempt}
_DROPS = ("drop_idle", "preempt")
_MOVES = ("offload_idle", "suspend_running", "compress")


def host_reason(policy, request) -> Optional[str]:
    """Why this plan must be made on the host (None: the device plans it).

    * the policy may evict (`allow_evict` and "evict" listed) in a request that runs the means:
      eviction needs the scorer's block masks and settles one row per step;
    * the policy lists a means registered by a user (or a built-in name re-registered with
      another class): its hooks are Python code the device cannot run."""
    runs_means = request.kind != "lease_expiry" and not policy.grow_no_admit
    if not runs_means:
        return None
    if policy.allow_evict and "evict" in policy.means:
        return "the policy may evict"
    for name in policy.means:
        if name == "evict":
            continue  # listed but not allowed: never usable
        if type(means_mod.REGISTRY[name]) is not DEVICE_MEANS.get(name):
            return f"means {name!r} is not a built-in the device plans"
    return None


@dataclasses.dataclass(frozen=True)
class Spec:
    """The static description of one plan (hashable: a `jax.jit` static argument): what fixes
    the program's shape. The policy's knobs (`knobs`) are arguments, so presets that list the
    same means share one compiled plan.

    kind: the request kind. slots: the steps in order — the policy's usable means, or
    ("release",) for a lease expiry, () for grow-no-admit."""

    config: StateConfig
    kind: str
    slots: tuple[str, ...]


def spec_of(config, request, policy) -> Spec:
    c = config
    if request.kind == "lease_expiry":
        slots = ("release",)
    elif policy.grow_no_admit:
        slots = ()
    else:
        slots = tuple(m for m in policy.means if m in DEVICE_MEANS
                      and (m != "compress" or c.compressed_pools)
                      and (m not in ("offload_idle", "suspend_running") or c.host_pool is not None))
    return Spec(config=c, kind=request.kind, slots=slots)


def knobs(config, policy) -> np.ndarray:
    """i32[4]: take_all; the pool compress writes; the host blocks in use at which the host
    alarm rings (-1: compression ungated; it also runs once an offload found the host short);
    the tokens compression keeps recent."""
    c = config
    cpool, gate = 0, -1
    if c.compressed_pools:
        names = [n for n, _ in c.compressed_pools]
        cpool = 1 + names.index(policy.compress_format or names[0])
        if policy.compress_gated and c.host_pool is not None:
            gate = math.ceil(c.host_watermark * c.pool_sizes[c.host_pool])
    return np.asarray([policy.take_all, cpool, gate, policy.compress_keep_recent], np.int32)


# ---- the jitted plan -------------------------------------------------------------------------
@dataclasses.dataclass
class _Model:
    """The mutable model, as a pytree carried from step to step (V victim rows, NB blocks)."""

    ref: jax.Array  # i32[NB]
    pin: jax.Array  # i32[NB]
    payer: jax.Array  # i32[NB]
    prefs: jax.Array  # i32[NB]
    tab: jax.Array  # i32[V, MB]  the victim rows' tables (INVALID once dropped)
    moved_pool: jax.Array  # i32[V, MB]  pool an entry's block was moved to (-1: not moved)
    alive: jax.Array  # bool[V]
    fate: jax.Array  # i32[V]
    moved: jax.Array  # i32[V]  blocks offloaded to host
    steps: jax.Array  # i32[V]  bit k set: the step of slot k took the row (a compressed row
    #                  may be preempted later)
    charged: jax.Array  # i32[T, POOLS]
    free: jax.Array  # i32[POOLS]  allocatable blocks per pool
    short: jax.Array  # bool[]  an offload found no room on the host
    inherited: jax.Array  # i32[]  victims' device units whose charge passed to non-victims


jax.tree_util.register_dataclass(
    _Model, data_fields=[f.name for f in dataclasses.fields(_Model)], meta_fields=[])


@functools.partial(jax.jit, static_argnames="spec")
def _plan_core(tables, seq_tenant, seq_status, seq_lens, salt, ref, pin, payer, prefs, fill, hashed,
               charged, free, rows, idle_ok, victim_t, target, tenant, knob, *, spec: Spec):
    """The plan of `spec` on the state's arrays; `rows` i32[V] are the victim rows in victim
    order (INVALID padding), `idle_ok` bool[V] whether a row's tenant is inactive (drop_idle),
    `victim_t` bool[T], `target` the units to gain, `tenant` the request's, `knob` the policy's
    `knobs`. Returns the small arrays `plan_on_device` reads back."""
    c = spec.config
    nb, ntn, npools = c.total_blocks, c.num_tenants, c.num_pools
    P, mb = c.block_size, c.max_blocks_per_seq
    i32 = jnp.int32
    units = jnp.asarray(c.pool_units, i32)
    units_dev = jnp.asarray([u if d else 0 for u, d in zip(c.pool_units, c.device_pools)], i32)
    quota = spec.kind != "make_room"  # progress in victims' device units, else pool-0 blocks
    take_all, cp, gate, keep_recent = knob[0] > 0, knob[1], knob[2], knob[3]
    pool_nb = pool_of(c, jnp.arange(nb, dtype=i32))

    valid = rows >= 0
    rc = jnp.maximum(rows, 0)
    v = rows.shape[0]
    tab0 = jnp.where(valid[:, None], tables[rc], INVALID)
    ten_v = jnp.where(valid, seq_tenant[rc], 0)
    status_v = jnp.where(valid, seq_status[rc].astype(i32), SEQ_FREE)
    seq_lens_v = jnp.where(valid, seq_lens[rc], 0)
    pos = jnp.arange(mb, dtype=i32)[None, :]
    victim_row = jnp.zeros(tables.shape[0], bool).at[jnp.where(valid, rows, tables.shape[0])].set(
        True, mode="drop")
    live_full = (seq_status != SEQ_FREE) & (seq_tenant >= 0)
    ten_full = jnp.maximum(seq_tenant, 0)
    other_rows = live_full & ~victim_row  # rows no step touches

    def vcharged(ch):
        return jnp.sum(jnp.where(victim_t[:, None], ch, 0), axis=0)

    def progress(m, start):
        if quota:
            return jnp.sum(start[0] * units_dev) - jnp.sum(vcharged(m.charged) * units_dev)
        return m.free[0] - start[1][0]

    def done(prog):
        return (target <= 0) | (~take_all & (prog >= target))

    # ---- settling a batch of dropped references (HostModel.drop / _settle) -----------------
    def heirs(m, touched_tenants, orphan, batch):
        """(heir i32[NB] (T: none), its references i32[NB], charges' change i32[T, POOLS],
        victims' units passed to non-victims) of the orphans: computed under a `lax.cond` that
        returns only these fresh arrays (a branch returning the model would copy it)."""
        same = (salt[:, None] == salt[None, :]) & touched_tenants[None, :]
        salt_ok = jnp.any(same, axis=1)  # [T] tenant shares a dropped row's salt
        ok_full = other_rows & salt_ok[ten_full]
        ok_v = valid & m.alive & ~batch & salt_ok[ten_v]
        heir = jnp.full(nb, ntn, i32)
        ent = ok_full[:, None] & (tables >= 0)
        heir = heir.at[jnp.where(ent, tables, nb)].min(
            jnp.broadcast_to(ten_full[:, None], tables.shape), mode="drop")
        ent = ok_v[:, None] & (m.tab >= 0) & (m.moved_pool < 0)
        heir = heir.at[jnp.where(ent, m.tab, nb)].min(
            jnp.broadcast_to(ten_v[:, None], m.tab.shape), mode="drop")
        has = orphan & (heir < ntn)
        old = jnp.maximum(m.payer, 0)
        hc = jnp.minimum(heir, ntn - 1)
        ch = jnp.zeros_like(m.charged).at[jnp.where(has, old, ntn), pool_nb].add(-1, mode="drop")
        ch = ch.at[jnp.where(has, heir, ntn), pool_nb].add(1, mode="drop")
        gone = has & victim_t[old] & ~victim_t[hc] & (units_dev[pool_nb] > 0)
        inherited = jnp.sum(jnp.where(gone, units[pool_nb], 0))
        # the heir's references: entries of its rows (all rows, as they are now) naming the block
        tf = jnp.maximum(tables, 0)
        hit = (tables >= 0) & ~victim_row[:, None] & (ten_full[:, None] == heir[tf])
        cnt = jnp.zeros(nb, i32).at[jnp.where(hit, tables, nb)].add(1, mode="drop")
        tv = jnp.maximum(m.tab, 0)
        hit = valid[:, None] & (m.tab >= 0) & (m.moved_pool < 0) & (ten_v[:, None] == heir[tv])
        cnt = cnt.at[jnp.where(hit, m.tab, nb)].add(1, mode="drop")
        return heir, cnt, ch, inherited

    def no_heirs(m):
        return (jnp.full(nb, ntn, i32), jnp.zeros(nb, i32), jnp.zeros_like(m.charged),
                jnp.int32(0))

    eidx = jnp.arange(v * mb, dtype=i32).reshape(v, mb)

    def firsts(ent, tab):
        """bool[V, MB]: `ent` entries that are the first of `ent` naming their block (each block
        counted once when a batch's entries are summed)."""
        first = jnp.full(nb, v * mb, i32).at[jnp.where(ent, tab, nb)].min(eidx, mode="drop")
        return ent & (first[jnp.maximum(tab, 0)] == eidx)

    def drop(m, batch, unpin):
        ent = batch[:, None] & (m.tab >= 0)
        plain = ent & (m.moved_pool < 0)
        mov = ent & (m.moved_pool >= 0)
        tv = jnp.maximum(m.tab, 0)
        ids = jnp.where(plain, m.tab, nb)
        ref = m.ref.at[ids].add(-1, mode="drop")
        own = plain & (m.payer[tv] == ten_v[:, None])
        prefs = m.prefs.at[jnp.where(own, m.tab, nb)].add(-1, mode="drop")
        # blocks a move made (their own fresh ids in the host model) are freed at once
        tb = jnp.broadcast_to(ten_v[:, None], m.tab.shape)
        mp = jnp.maximum(m.moved_pool, 0)
        ch = m.charged.at[jnp.where(mov, tb, ntn), mp].add(-1, mode="drop")
        fr = m.free.at[jnp.where(mov, mp, npools)].add(1, mode="drop")
        touched = jnp.zeros(nb, bool).at[ids].set(True, mode="drop")
        tenants = jnp.zeros(ntn, bool).at[jnp.where(batch, ten_v, ntn)].set(True, mode="drop")
        pin = m.pin
        if unpin:  # a lease expiry's: every pin on the tenant's blocks, in a table or not
            unp = (m.payer == tenant) & (pin > 0)
            pin = jnp.where(unp, 0, pin)
            tenants = tenants.at[tenant].set(True)
        # settle: held by nothing -> back to its pool (counted once per block: its first entry)
        pool_e = pool_of(c, tv)
        freed = firsts(plain, m.tab) & (ref[tv] == 0) & (pin[tv] == 0)
        pay = m.payer[tv]
        pay = jnp.where(pay < 0, pay + ntn, pay)  # as NumPy indexes (never, in a valid state)
        ch = ch.at[jnp.where(freed, pay, ntn), pool_e].add(-1, mode="drop")
        fr = fr.at[jnp.where(freed, pool_e, npools)].add(1, mode="drop")
        if unpin:  # unpinned blocks no dropped entry names: paid by the tenant
            alone = unp & ~touched & (ref == 0)
            for p in range(npools):
                k = jnp.sum((alone & (pool_nb == p)).astype(i32))
                ch, fr = ch.at[tenant, p].add(-k), fr.at[p].add(k)
            touched = touched | unp
        gone = touched & (ref == 0) & (pin == 0)
        m = dataclasses.replace(m, ref=ref, prefs=jnp.where(gone, 0, prefs), pin=pin,
                                payer=jnp.where(gone, INVALID, m.payer), charged=ch, free=fr,
                                tab=jnp.where(ent, INVALID, m.tab), alive=m.alive & ~batch)
        # payer without references -> an heir
        orphan = touched & (m.ref > 0) & (m.pin == 0) & (m.prefs == 0) & (m.payer >= 0)
        heir, cnt, dch, inh = jax.lax.cond(
            jnp.any(orphan), lambda x: heirs(x, tenants, orphan, batch), no_heirs, m)
        has = orphan & (heir < ntn)
        return dataclasses.replace(m, payer=jnp.where(has, heir, m.payer),
                                   prefs=jnp.where(has, cnt, m.prefs), charged=m.charged + dch,
                                   inherited=m.inherited + inh)

    # ---- steps ---------------------------------------------------------------------------------
    def own0(m):
        """bool[V, MB]: the rows' own pool-0 entries (ref 1, unpinned, paid by the row's tenant)."""
        tv = jnp.maximum(m.tab, 0)
        return ((m.tab >= 0) & (m.moved_pool < 0) & (pool_nb[tv] == 0) & (m.ref[tv] == 1)
                & (m.pin[tv] == 0) & (m.payer[tv] == ten_v[:, None]))

    def take(m, taken, slot, fate):
        return dataclasses.replace(m, fate=jnp.where(taken, fate, m.fate),
                                   steps=m.steps | jnp.where(taken, 1 << slot, 0))

    def drop_step(m, cand, slot, start, runs):
        crank = jnp.where(cand, jnp.cumsum(cand.astype(i32)) - 1, v)
        n_cand = jnp.sum(cand.astype(i32))
        plain = cand[:, None] & (m.tab >= 0) & (m.moved_pool < 0)
        mov = cand[:, None] & (m.tab >= 0) & (m.moved_pool >= 0)
        tv = jnp.maximum(m.tab, 0)
        r2 = jnp.broadcast_to(crank[:, None], m.tab.shape)
        if quota:  # the payer's own references (its charge leaves when the last one goes)
            ent = plain & (m.payer[tv] == ten_v[:, None])
        else:  # every reference (the block returns to pool 0 when the last one goes)
            ent = plain
        ids = jnp.where(ent, m.tab, nb)
        cnt = jnp.zeros(nb, i32).at[ids].add(1, mode="drop")
        rank = jnp.full(nb, -1, i32).at[ids].max(r2, mode="drop")
        held = m.prefs[tv] if quota else m.ref[tv]
        ev = firsts(ent, m.tab) & (cnt[tv] == held) & (m.pin[tv] == 0)
        pool_e = pool_of(c, tv)
        if quota:
            pay = m.payer[tv]
            ev = ev & (pay >= 0) & victim_t[jnp.maximum(pay, 0)]
            val, mval = units_dev[pool_e], units_dev[jnp.maximum(m.moved_pool, 0)]
        else:
            val, mval = (pool_e == 0).astype(i32), (m.moved_pool == 0).astype(i32)
        gains = jnp.zeros(v + 1, i32).at[jnp.where(ev, rank[tv], v)].add(
            jnp.where(ev, val, 0), mode="drop")
        gains = gains.at[jnp.where(mov, r2, v)].add(jnp.where(mov, mval, 0), mode="drop")
        prog = progress(m, start) + jnp.concatenate(
            [jnp.zeros(1, i32), jnp.cumsum(gains[:v])])  # after k rows, k = 0 .. V
        k = jnp.arange(v + 1, dtype=i32)
        reach = (prog >= target) & (k <= n_cand) & ~take_all
        n = jnp.where(jnp.any(reach), jnp.argmax(reach).astype(i32), n_cand)
        n = jnp.where(target > 0, n, 0)
        n = jnp.where(runs, n, 0)
        batch = cand & (crank < n)
        return take(drop(m, batch, False), batch, slot, FATE_PREEMPTED)

    def move_step(m, cand, sel_of, dst, gain, room, slot, fate, start, runs):
        """Take candidates in order while not done: a row with n = its `sel_of` entries fits
        when `room(n, free)`; a row that does not fit under an offload marks the host short."""
        sel = sel_of(m)
        last = jnp.max(jnp.where(cand, jnp.arange(v, dtype=i32) + 1, 0))  # past the last one
        n_row = jnp.sum(sel.astype(i32), axis=1)
        offload = fate == FATE_SUSPENDED

        def cond(carry):
            i, _, prog, _, _ = carry
            return runs & (i < last) & ~done(prog)

        def body(carry):
            i, fr, prog, short, taken = carry
            n = n_row[i]
            fits = room(n, fr)
            ok = cand[i] & fits
            short = short | (cand[i] & ~fits & offload)
            return (i + 1, fr - jnp.where(ok, n, 0), prog + jnp.where(ok, n * gain, 0), short,
                    taken.at[i].set(ok))

        init = (jnp.int32(0), m.free[dst], progress(m, start), m.short, jnp.zeros(v, bool))
        _, _, _, short, taken = jax.lax.while_loop(cond, body, init)
        sel = sel & taken[:, None]
        n = jnp.sum(sel.astype(i32), axis=1)
        ids = jnp.where(sel, m.tab, nb)
        tk = jnp.where(taken, ten_v, ntn)
        m = dataclasses.replace(
            m, ref=m.ref.at[ids].set(0, mode="drop"), prefs=m.prefs.at[ids].set(0, mode="drop"),
            payer=m.payer.at[ids].set(INVALID, mode="drop"),
            moved_pool=jnp.where(sel, dst, m.moved_pool),
            charged=m.charged.at[tk, 0].add(-n, mode="drop").at[tk, dst].add(n, mode="drop"),
            free=m.free.at[0].add(jnp.sum(n)).at[dst].add(-jnp.sum(n)), short=short,
            moved=jnp.where(taken & offload, n, m.moved))
        return take(m, taken, slot, fate)

    untouched = (lambda m: m.fate == FATE_UNTOUCHED)
    run_idle = (status_v == SEQ_RUNNING) | (status_v == SEQ_IDLE)

    m = _Model(ref=ref, pin=pin, payer=payer, prefs=prefs, tab=tab0,
               moved_pool=jnp.full(tab0.shape, -1, i32), alive=valid,
               fate=jnp.full(v, FATE_UNTOUCHED, i32), moved=jnp.zeros(v, i32),
               steps=jnp.zeros(v, i32), charged=charged, free=free,
               short=jnp.bool_(False), inherited=jnp.int32(0))
    start = (vcharged(charged), free)
    meters = []
    for slot, name in enumerate(spec.slots):
        if name == "release":
            m = take(drop(m, valid, True), valid, slot, FATE_RELEASED)
            meters.append((vcharged(m.charged), m.free))
            continue
        usable = jnp.bool_(True)
        if name == "drop_idle":
            cand = valid & untouched(m) & (status_v == SEQ_IDLE) & idle_ok
            step = functools.partial(drop_step, cand=cand, slot=slot, start=start)
        elif name == "preempt":
            cand = valid & run_idle & (untouched(m) | (m.fate == FATE_COMPRESSED))
            step = functools.partial(drop_step, cand=cand, slot=slot, start=start)
        elif name in ("offload_idle", "suspend_running"):
            status = SEQ_IDLE if name == "offload_idle" else SEQ_RUNNING
            cand = valid & untouched(m) & (status_v == status)
            step = functools.partial(
                move_step, cand=cand, sel_of=own0, dst=c.host_pool,
                gain=units_dev[0] if quota else 1, room=lambda n, fr: n <= fr,
                slot=slot, fate=FATE_SUSPENDED, start=start)
        else:  # compress: own cold full pool-0 blocks, once the host alarm rings (or ungated)
            if c.host_pool is not None:
                used = c.pool_sizes[c.host_pool] - m.free[c.host_pool]
                usable = (gate < 0) | m.short | (used >= gate)
            cand = valid & untouched(m) & run_idle

            def cold_full(x):
                tv = jnp.maximum(x.tab, 0)
                cold = (pos + 1) * P <= seq_lens_v[:, None] - keep_recent
                return own0(x) & (fill[tv] == P) & cold

            step = functools.partial(
                move_step, cand=cand, sel_of=cold_full, dst=cp,
                gain=(units_dev[0] - units_dev[cp]) if quota else 1,
                room=lambda n, fr: (n > 0) & (n <= fr), slot=slot, fate=FATE_COMPRESSED,
                start=start)
        # a step with no candidate, unusable, or reached with the target met takes nothing
        runs = jnp.any(cand) & usable & ~done(progress(m, start))
        m = jax.lax.cond(runs, functools.partial(step, runs=True), lambda x: x, m)
        meters.append((vcharged(m.charged), m.free))

    # ---- what the plan leaves ----------------------------------------------------------------
    vict_blk = (m.payer >= 0) & victim_t[jnp.maximum(m.payer, 0)] & (units_dev[pool_nb] > 0)
    pinned = jnp.sum(jnp.where(vict_blk & (m.pin > 0), units[pool_nb], 0))
    ent = (m.alive[:, None]) & (m.tab >= 0) & (m.moved_pool < 0)
    own_refs = jnp.zeros(nb, i32).at[jnp.where(ent, m.tab, nb)].add(1, mode="drop")
    shared = jnp.sum(jnp.where(vict_blk & (m.pin == 0) & (m.ref > own_refs), units[pool_nb], 0))
    t0 = jnp.maximum(tab0, 0)
    cached = (m.ref[t0] > 0) | (m.pin[t0] > 0)
    if c.keep_cold_blocks:
        cached = cached | ((pool_nb[t0] == 0) & (fill[t0] == P))
    usable_blocks = jnp.maximum(seq_lens_v - 1, 0) // P
    ok = (tab0 >= 0) & (pos < usable_blocks[:, None]) & cached & hashed[t0]
    hits = jnp.sum(jnp.cumprod(ok.astype(i32), axis=1), axis=1)
    empty = jnp.zeros((0, npools), i32)
    return dict(
        steps=m.steps, moved=m.moved, fate=m.fate, hits=hits,
        start=jnp.stack(start),
        charged_after=jnp.stack([a for a, _ in meters]) if meters else empty,
        free_after=jnp.stack([b for _, b in meters]) if meters else empty,
        progress=progress(m, start), pinned=pinned, shared=shared + m.inherited)


# ---- the host side: one small read before, one read back after ------------------------------
def plan_on_device(config, state, request, policy, tenant: int, target_of, now=None) -> ReclaimPlan:
    """The plan of `request` under `policy` (validated by `plan_reclaim`) made on the device.

    Reads the small columns ([S] and [T]) to pick and order the victim rows exactly as the host
    planner does (`planner.victim_rows`), runs `_plan_core` once, and reads its small results
    back once. `target_of(charged_blocks, capacity)` gives (target units, bytes per unit)."""
    c = config
    s, tn = state.seqs, state.tenants
    got = jax.device_get(dict(
        seq_lens=s.seq_lens, seq_tenant=s.seq_tenant, seq_status=s.seq_status, birth=s.birth,
        registered=tn.registered, lease_expiry=tn.lease_expiry,
        charged_blocks=tn.charged_blocks, free_count=state.free.free_count,
        cold_count=state.free.cold_count, version=state.meta.version))
    capacity = got["free_count"].astype(np.int64)
    capacity[0] += int(got["cold_count"])
    if request.kind == "make_room":
        victims = [int(u) for u in np.flatnonzero(got["registered"]) if u != tenant]
    else:
        victims = [tenant]
    seqs = dataclasses.make_dataclass("Seqs", ["seq_lens", "seq_tenant", "seq_status", "birth"])(
        got["seq_lens"], got["seq_tenant"], got["seq_status"], got["birth"])
    rows = victim_rows(policy, seqs, victims)
    target, unit = target_of(got["charged_blocks"], capacity)
    inactive = inactive_tenants(seqs, got["lease_expiry"], victims, now)
    # Victim rows padded to a power of two, at least 64 (up to the sequence slots' bucket): few
    # compiled sizes, and a tenant's rows at scale (128 of 8,192) stay a small scan.
    size = min(bucket(max(len(rows), 64)), bucket(c.max_seqs))
    idle_ok = np.zeros(size, bool)
    idle_ok[:len(rows)] = np.isin(got["seq_tenant"][rows], list(inactive))
    victim_t = np.zeros(c.num_tenants, bool)
    victim_t[victims] = True
    b = state.blocks
    out = jax.device_get(_plan_core(
        s.block_tables, s.seq_tenant, s.seq_status, s.seq_lens, tn.salt, b.ref_count,
        b.pin_count, b.payer, b.payer_refs, b.fill, b.hashed, tn.charged_blocks,
        jnp.asarray(capacity.astype(np.int32)), pad(rows, size), idle_ok, victim_t,
        np.int32(target), np.int32(tenant), knobs(c, policy), spec=spec_of(c, request, policy)))
    return _assemble(c, request, policy, rows, got, out, target, unit,
                     tuple(int(x) for x in got["version"]))


def _assemble(config, request, policy, rows, got, out, target, unit, version) -> ReclaimPlan:
    """The ReclaimPlan from `_plan_core`'s results: as `Planner.add_step`, `fates` and `held`."""
    c = config
    units = np.asarray(c.pool_units, np.int64)
    dev = np.asarray(c.device_pools)
    spec_slots = spec_of(c, request, policy).slots
    n = len(rows)
    took, moved = out["steps"][:n], out["moved"][:n].astype(np.int64)
    moved_of = {int(r): int(k) for r, k in zip(rows, moved)}
    before = (out["start"][0].astype(np.int64), out["start"][1].astype(np.int64))
    steps = []
    for slot, name in enumerate(spec_slots):
        taken = [int(r) for r, k in zip(rows, took) if k >> slot & 1]
        if not taken and name != "release":
            continue
        after = (out["charged_after"][slot].astype(np.int64),
                 out["free_after"][slot].astype(np.int64))
        (cb, fb), (ca, fa) = before, after
        host = 0 if c.host_pool is None else int(fb[c.host_pool] - fa[c.host_pool]) * units[-1]
        steps.append(PlanStep(
            means=name, seqs=tuple(taken), blocks=int(abs(cb[0] - ca[0])),
            quota_bytes=int(((cb - ca) * units * dev).sum()) * c.unit_bytes,
            pool_bytes=int(((fa - fb) * units * dev).sum()) * c.unit_bytes,
            pool0_bytes=int(fa[0] - fb[0]) * c.pool_bytes[0],
            host_bytes=max(int(host), 0) * c.unit_bytes,
            per_seq=tuple((r, moved_of.get(r, 0)) for r in taken)))
        before = after
    fate_of = {int(r): int(f) for r, f in zip(rows, out["fate"][:n])}
    hits_of = {int(r): int(h) for r, h in zip(rows, out["hits"][:n])}
    if policy.grow_no_admit and request.kind == "quota_cut":
        for r in rows:
            if got["seq_status"][r] == SEQ_RUNNING:
                fate_of[int(r)] = FATE_GROWING
    fates = []
    for r in sorted(int(x) for x in rows):
        f = fate_of[r]
        tokens = int(got["seq_lens"][r])
        resume_tokens = resume_bytes = 0
        if f == FATE_PREEMPTED:
            resume_tokens = tokens - hits_of[r] * c.block_size
        elif f == FATE_SUSPENDED:
            resume_bytes = moved_of[r] * c.pool_bytes[c.host_pool]
        fates.append(SeqFate(seq=r, tenant=int(got["seq_tenant"][r]), fate=f, tokens=tokens,
                             resume_tokens=resume_tokens, resume_bytes=resume_bytes,
                             resume_seconds=resume_bytes / c.host_bandwidth))
    gained = int(out["progress"]) if request.kind != "lease_expiry" else target
    return ReclaimPlan(request=request, policy=policy, target_bytes=target * unit,
                       steps=tuple(steps), fates=tuple(fates),
                       shortfall_bytes=max(0, target - gained) * unit,
                       pinned_bytes_held=int(out["pinned"]) * c.unit_bytes,
                       shared_bytes_held=int(out["shared"]) * c.unit_bytes, version=version)
