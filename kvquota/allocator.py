"""The validating public API over the jitted state operations: one class of one-line delegations.

`Allocator(config)` holds only the static config; every method is `op(state, ...) ->
(new_state, report)`. Each op lives in `kvquota.core` (or `kvquota.reclaim.ops`) beside its
jitted core: it checks its inputs against the config and the current state (reading a few small
arrays back to the host) and raises a typed `KVQuotaError` before calling the core, so on error
the state is untouched. Every method takes `donate: bool = False`: without donation the input
state stays valid (forks and "unchanged on error" rely on that); with `donate=True` the state's
buffers are reused in place (serving loops; the caller must not use the old state afterwards).

Release and free touch only the rows they need: the op lists the tenant's sequence slots (and the
table entries of the live slots of tenants sharing its salt, the only possible heirs) and pads
each list to a power of two, so the jitted core works on O(rows x MB + heir entries) entries and
compiles once per size bucket.
"""

from __future__ import annotations

import weakref
from typing import Optional

import jax
import numpy as np

from kvquota.codes import INT32_MAX
from kvquota.core import (admission, cold, compress, evict, lifecycle, pins, release,
                          statistics, tenants, tiers)
from kvquota.errors import StateMismatchError
from kvquota.invariants import check_invariants
from kvquota.reclaim import ops as reclaim_ops
from kvquota.reclaim.plan import ReclaimPlan, ReclaimRequest
from kvquota.reports import (AdmitReport, AppendReport, CompressReport, EvictReport, ForkReport,
                             FreeReport, Ledger, MoveReport, PinReport, TenantReport)
from kvquota.state import KVState, StateConfig, init_state, validate_state


class Allocator:
    """Validating facade of the paged KV state for one static `StateConfig`."""

    def __init__(self, config: StateConfig):
        if not isinstance(config, StateConfig):
            raise TypeError(f"config must be a StateConfig, got {type(config).__name__}")
        self.config = config
        self._made = None  # weak reference to the state the last op returned

    def __getstate__(self):  # pickled or copied: the weak reference is a cache, not state
        return {**self.__dict__, "_made": None}

    def _check_state(self, state):
        """The state the last op returned is one of this config by construction: only its
        donation is checked (the full check's device read waits for the op to finish)."""
        made = None if self._made is None else self._made()  # None once it was collected
        if made is None or made is not state:
            validate_state(self.config, state)
        elif any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(state)):
            raise StateMismatchError("state was donated to an earlier call")

    def _query(self, op, state, *args, **kwargs):
        """A read-only op on a checked state."""
        self._check_state(state)
        return op(self.config, state, *args, **kwargs)

    def _op(self, op, state, *args, **kwargs):
        """A state op on a checked state, remembering (weakly) the state it returns."""
        self._check_state(state)
        state, report = op(self.config, state, *args, **kwargs)
        self._made = weakref.ref(state)
        return state, report

    # ---- state ---------------------------------------------------------------------------
    def init(self) -> KVState:
        """An empty state for this config."""
        return init_state(self.config)

    def check(self, state: KVState, **kwargs) -> dict:
        """check_invariants(config, state): raises InvariantError on any difference."""
        return check_invariants(self.config, state, **kwargs)

    def ledger(self, state: KVState) -> Ledger:
        """The per-tenant ledger view (bytes via its properties)."""
        return self._query(tenants.ledger_view, state)

    # ---- tenants ---------------------------------------------------------------------------
    def register_tenant(self, state, tenant, *, token_quota, byte_quota,
                        lease_expiry=INT32_MAX, share_group: Optional[int] = None,
                        donate=False) -> tuple[KVState, TenantReport]:
        """Register a tenant with a token quota (logical tokens), a byte quota (bytes of device
        blocks charged to it; rounded down to whole byte units) and a lease expiry step.

        Its prefix-cache salt is private unless `share_group` is given: tenants of the same group
        share a salt and may then share prompt blocks.
        """
        return self._op(tenants.register_tenant, state, tenant, token_quota=token_quota,
                        byte_quota=byte_quota, lease_expiry=lease_expiry,
                        share_group=share_group, donate=donate)

    def set_quota(self, state, tenant, *, token_quota=None, byte_quota=None,
                  donate=False) -> tuple[KVState, TenantReport]:
        """Raise or cut a tenant's quotas (None keeps the current value). Cutting below current
        usage is allowed: the report says by how much it is over, which a reclaim then handles;
        until then new admissions and appends of that tenant are refused. A new quota ends
        grow-no-admit (a reclaim plan sets it again after its cut); lease and salt are kept."""
        return self._op(tenants.set_quota, state, tenant, token_quota=token_quota,
                        byte_quota=byte_quota, donate=donate)

    def set_lease(self, state, tenant, lease_expiry, *, donate=False):
        """Move a tenant's lease expiry step (release_tenant is the action at expiry); its
        quotas, salt and grow-no-admit flag are kept."""
        return self._op(tenants.set_lease, state, tenant, lease_expiry, donate=donate)

    def expired_tenants(self, state, step: int) -> np.ndarray:
        """Registered tenants whose lease_expiry <= step."""
        return self._query(tenants.expired_tenants, state, step)

    # ---- admit / append / fork -------------------------------------------------------------
    def admit(self, state, tenants, tokens, lengths, *, donate=False
              ) -> tuple[KVState, AdmitReport]:
        """Admit prompts. tenants i32[B] (INVALID rows are padding), tokens i32[B, Tmax] (row i's
        first lengths[i] entries are its prompt), lengths i32[B].

        Full prompt blocks found in the prefix cache (same salt, hash, token ids and parent
        chain) are taken by reference; the rest are allocated from pool 0. A row that would go
        over its tenant's quotas, the pool or the sequence slots is refused and allocates
        nothing. The slots of all prompt tokens are reserved (seq_lens = length); the caller
        writes the K/V of tokens [cached_tokens, length) into those slots (prefill) before the
        sequence is attended or another admit runs.
        """
        return self._op(admission.admit, state, tenants, tokens, lengths, donate=donate)

    def append(self, state, seq_ids, tokens, *, donate=False) -> tuple[KVState, AppendReport]:
        """Append one token to each sequence: seq_ids i32[B] (unique; INVALID = padding),
        tokens i32[B]. A block is allocated when a boundary is crossed; rows over quota or pool
        are refused. The report names the (block, offset) slot where the caller writes the
        token's K/V."""
        return self._op(admission.append, state, seq_ids, tokens, donate=donate)

    def fork(self, state, seq_ids, *, donate=False) -> tuple[KVState, ForkReport]:
        """Fork running sequences (i32[B], INVALID = padding) into new slots of the same tenant:
        full blocks shared by reference, the partly filled last block copied."""
        return self._op(admission.fork, state, seq_ids, donate=donate)

    # ---- pins ------------------------------------------------------------------------------
    def pin_blocks(self, state, block_ids, *, donate=False) -> tuple[KVState, PinReport]:
        """Pin held blocks (i32[B]); pinning a free block is an error. A pinned block stays
        resident and charged even with no references, and prefix lookups may still hit it."""
        return self._op(pins.pin_blocks, state, block_ids, donate=donate)

    def unpin_blocks(self, state, block_ids, *, donate=False) -> tuple[KVState, FreeReport]:
        """Drop one pin on each block (i32[B]); blocks held by nothing return to their pool."""
        return self._op(pins.unpin_blocks, state, block_ids, donate=donate)

    def pin_prefix(self, state, seq_id, num_blocks, *, donate=False):
        """Pin the first `num_blocks` blocks of a running sequence (e.g. its system prompt)."""
        return self._op(pins.pin_prefix, state, seq_id, num_blocks, donate=donate)

    def unpin_prefix(self, state, seq_id, num_blocks, *, donate=False):
        """Unpin the first `num_blocks` blocks of a running sequence."""
        return self._op(pins.unpin_prefix, state, seq_id, num_blocks, donate=donate)

    # ---- free / release --------------------------------------------------------------------
    def free(self, state, seq_ids, *, donate=False) -> tuple[KVState, FreeReport]:
        """Free sequences (i32[B], INVALID = padding): one reference dropped per block-table
        entry; blocks held by nothing return to their pool with their hash entries cleared
        (with `keep_cold_blocks`, full pool-0 blocks stay in the prefix cache as cold blocks,
        uncharged free capacity that the next allocation short of stack blocks reuses; their
        pages are trusted as cache content, so free a sequence only after its K/V are written,
        never between admit and its prefill)."""
        return self._op(release.free, state, seq_ids, donate=donate)

    def release_plan(self, state, tenant, unpin=False):
        """Host-side inputs of the jitted release (tenant, its rows, heir rows, pin slots)."""
        return self._query(release.release_inputs, state, tenant, unpin)

    def release_tenant(self, state, tenant, *, unpin=False, donate=False
                       ) -> tuple[KVState, FreeReport]:
        """Release a tenant (e.g. at lease expiry): walk each of its block tables entry by entry,
        dropping one reference per entry. Its pinned blocks stay pinned and charged unless
        `unpin=True`. Shared blocks it paid for that others still reference pass their charge to
        the lowest-id remaining referencer (reported, with heirs pushed over their byte quota)."""
        return self._op(release.release_tenant, state, tenant, unpin=unpin, donate=donate)

    # ---- cold cached blocks ----------------------------------------------------------------
    def allocatable_blocks(self, state) -> np.ndarray:
        """i32[POOLS]: blocks an allocation may take from each pool now: its free list, plus
        pool 0's cold cached blocks (`keep_cold_blocks`: free capacity that is still cache).
        Every room check of the ops counts with it."""
        return self._query(cold.allocatable, state, xp=np)

    def drop_cold(self, state, max_blocks: Optional[int] = None, *, donate=False
                  ) -> tuple[KVState, cold.ColdReport]:
        """Push up to `max_blocks` (None: all) cold cached blocks, least recently cold first,
        onto pool 0's free list, clearing their prefix-cache entries (rebalance: "drop cold
        cache LRU"). Allocatable capacity is unchanged; without keep_cold_blocks nothing is
        cold and nothing changes."""
        return self._op(cold.drop_cold, state, max_blocks, donate=donate)

    # ---- attention statistics --------------------------------------------------------------
    def record_attention(self, state, seq_ids, mass, *, donate=False) -> tuple[KVState, None]:
        """Accumulate the attention mass each cached token received (the kernels' `mass`
        output: f32[B, C], column i = cache index i, summed over layers and KV heads; or
        f32[B, L, Hkv, C] per layer and KV head, which a state with pages also keeps per head)
        into the state, where compression and eviction policies read it."""
        return self._op(statistics.record_attention, state, seq_ids, mass, donate=donate)

    # ---- tiers: lossless moves, lossy compression and eviction -------------------------------
    def offload(self, state, seq_ids, *, donate=False) -> tuple[KVState, MoveReport]:
        """Move running sequences' own full-precision (pool-0) blocks to the host pool; they
        become SUSPENDED (not decodable until restored). Shared, pinned and compressed blocks
        stay on the device (the host pool holds full precision; a compressed block is small)."""
        return self._op(tiers.offload, state, seq_ids, donate=donate)

    def restore(self, state, seq_ids, *, donate=False) -> tuple[KVState, MoveReport]:
        """Bring suspended sequences' host blocks back to pool 0, bit-exact; RUNNING again.
        Needs room in pool 0 and room under each tenant's byte quota for the restored blocks."""
        return self._op(tiers.restore, state, seq_ids, donate=donate)

    def compress(self, state, seq_ids, *, kv_format: str, keep_recent: Optional[int] = None,
                 policy: str = "oldest", max_blocks: Optional[int] = None,
                 donate=False) -> tuple[KVState, CompressReport]:
        """Requantize running sequences' own full blocks outside the `keep_recent` most recent
        tokens (None: the format's `residual`, KIVI's R = 128; else 32) from pool 0 into the
        compressed pool of `kv_format` (lossy, irreversible), at most `max_blocks` per sequence
        (None: all eligible), in the policy's order ("oldest": lowest block index; "coldest":
        least attention mass). A KIVI key group of several blocks is taken whole or not at all.
        Shared and pinned blocks are never rewritten."""
        return self._op(compress.compress, state, seq_ids, kv_format=kv_format,
                        keep_recent=keep_recent, policy=policy, max_blocks=max_blocks,
                        donate=donate)

    def evict(self, state, seq_ids, *, policy, keep_tokens, mode="token", aggregate=None,
              attention=None, donate=False, **options) -> tuple[KVState, EvictReport]:
        """Keep `keep_tokens` tokens of each running sequence — the ones the eviction policy
        scores highest (a registered name, with `options`, or an EvictionPolicy) — and drop the
        rest for good, compacting the survivors at their logical positions. Shared blocks are
        copied on write. `attention` is the last step's attention, f32[B, L, Hkv, C] (the
        engine's `last_mass`; f32[B, C] summed, for a global choice): TOVA needs it.

        mode "token": survivors packed into full blocks (pool-0 pages rewritten; sequences
        holding compressed blocks are refused); by default (`aggregate="head"`, a state with
        pages) each layer and KV head keeps its own top tokens, the same number in each, as the
        papers and kvpress choose; `aggregate="global"` keeps one set for the whole model.
        mode "block": the `keep_tokens // block_size` (at least one) top-scored whole blocks
        stay, one set for the whole model, the table is compacted and own blocks are not
        copied. keep_tokens >= 1: to drop everything, free the sequence."""
        return self._op(evict.evict, state, seq_ids, policy=policy, keep_tokens=keep_tokens,
                        mode=mode, aggregate=aggregate, attention=attention, donate=donate,
                        **options)

    def keep_mask(self, state, seq_ids, *, policy, keep_tokens, aggregate=None, attention=None,
                  **options):
        """The tokens `evict` in token mode with these arguments would keep, bool[B, L, Hkv, C]
        (L = Hkv = 1 with aggregate "global"), without changing the state: what an experiment
        compares the evicted pages against."""
        return self._query(evict.keep_mask, state, seq_ids, policy=policy,
                           keep_tokens=keep_tokens, aggregate=aggregate, attention=attention,
                           **options)

    # ---- session lifecycle -------------------------------------------------------------------
    def set_idle(self, state, seq_ids, *, donate=False):
        """RUNNING -> IDLE: a multi-turn session between turns keeps its KV, appends refused."""
        return self._op(lifecycle.set_idle, state, seq_ids, donate=donate)

    def resume(self, state, seq_ids, *, donate=False):
        """IDLE -> RUNNING: the session's next turn (append its tokens as usual)."""
        return self._op(lifecycle.resume, state, seq_ids, donate=donate)

    def preempt(self, state, seq_ids, *, donate=False):
        """Drop running or idle sequences' KV (one reference per table entry, as `free`), archive
        their token ids and positions in the report, and hold each slot as PREEMPTED (tenant
        kept, counted in its `preemptions`) until `rebalance` recycles it."""
        return self._op(lifecycle.preempt, state, seq_ids, donate=donate)

    def rebalance(self, state, *, seq_ids=None, cold_blocks: int = 0, donate=False) -> tuple:
        """Make returned capacity allocatable: recycle PREEMPTED slots (`seq_ids`, default all)
        into free slots, and drop up to `cold_blocks` cold cached blocks from the prefix cache,
        least recently used first (they are already free capacity; dropping them only forgets
        their content). Reports what it moved. (The block-level means never leave partly
        filled blocks except each sequence's tail, so there is nothing to compact.)"""
        return self._op(lifecycle.rebalance, state, seq_ids=seq_ids, cold_blocks=cold_blocks,
                        donate=donate)

    # ---- reclaim in one action ---------------------------------------------------------------
    def plan_reclaim(self, state, request: ReclaimRequest, policy="tiered", *,
                     now: Optional[int] = None, on_device: bool = False) -> ReclaimPlan:
        """Plan a reclaim without changing the state: ordered steps with their exact bytes,
        every affected sequence's fate and resume cost, the shortfall. `now` (a step) marks
        tenants whose lease ended as inactive for the drop_idle means. `on_device`: plan in
        one jitted call over the state's arrays (the same plan; see reclaim.device_plan)."""
        return self._query(reclaim_ops.plan_reclaim, state, request, policy, now=now,
                           on_device=on_device)

    def apply_plan(self, state, plan: ReclaimPlan, *, donate=False) -> tuple:
        """Run `plan` on the state it was made for (PlanMismatchError otherwise): set the new
        quota (quota cut) or the grow flag, then each step through the validated ops, then the
        rebalance. Returns (state, ReclaimReport) with the bytes each step really moved."""
        return self._op(reclaim_ops.apply_plan, state, plan, donate=donate)
