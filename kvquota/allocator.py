"""The validating public API over the jitted state operations.

`Allocator(config)` holds only the static config; every method is `op(state, ...) ->
(new_state, report)`. Each method checks its inputs against the config and the current state
(reading a few small arrays back to the host) and raises a typed `KVQuotaError` before calling
the jitted core, so on error the state is untouched. Every method takes `donate: bool = False` and
hands off through `kvquota.core.run`: without donation the input state stays valid (forks and
"unchanged on error" rely on that); with `donate=True` the state's buffers are reused in place
(serving loops; the caller must not use the old state afterwards).

Release and free touch only the rows they need: the facade lists the tenant's sequence slots (and
the table entries of the live slots of tenants sharing its salt, the only possible heirs) and pads
each list to a power of two, so the jitted core works on O(rows x MB + heir entries) entries and
compiles once per size bucket.
"""

from __future__ import annotations

import weakref
from typing import Optional

import jax
import numpy as np

from kvquota import core
from kvquota.reports import (
    AdmitReport,
    AppendReport,
    ForkReport,
    FreeReport,
    Ledger,
    PinReport,
    TenantReport,
)
from kvquota.errors import (BlockStateError, DoubleFreeError, DuplicateIdError, InputDtypeError,
                             InputShapeError, InvalidArgumentError, QuotaValueError,
                             SequenceTooLongError, StateMismatchError, TenantExistsError,
                             TierError, TokenIdError, UnknownSequenceError, UnknownTenantError)
from kvquota.invariants import check_invariants
from kvquota.sentinel import INVALID
from kvquota.codes import (INT32_MAX, SEQ_IDLE, SEQ_PREEMPTED, SEQ_RUNNING, SEQ_SUSPENDED,
                           STATUS_NAMES)
from kvquota.hashing import group_salt, private_salt
from kvquota.state import KVState, StateConfig, init_state, validate_state
from kvquota.reclaim.ops import ReclaimOps
from kvquota.tiering import TierOps
from kvquota.validation import bucket, int_array, int_scalar, pad


class Allocator(TierOps, ReclaimOps):
    """Validating facade of the paged KV state for one static `StateConfig`."""

    def __init__(self, config: StateConfig):
        if not isinstance(config, StateConfig):
            raise TypeError(f"config must be a StateConfig, got {type(config).__name__}")
        self.config = config
        self._made = None  # weak reference to the state the last op returned

    # ---- state ---------------------------------------------------------------------------
    def init(self) -> KVState:
        """An empty state for this config."""
        return init_state(self.config)

    def check(self, state: KVState, **kwargs) -> dict:
        """check_invariants(config, state): raises InvariantError on any difference."""
        return check_invariants(self.config, state, **kwargs)

    def ledger(self, state: KVState) -> Ledger:
        """The per-tenant ledger view (bytes via its properties)."""
        self._check_state(state)
        return core.ledger(self.config, state)

    def _check_state(self, state):
        """The state the last op returned is one of this config by construction: only its
        donation is checked (the full check's device read waits for the op to finish)."""
        made = None if self._made is None else self._made()  # None once it was collected
        if made is None or made is not state:
            validate_state(self.config, state)
        elif any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(state)):
            raise StateMismatchError("state was donated to an earlier call")

    def __getstate__(self):  # pickled or copied: the weak reference is a cache, not state
        return {**self.__dict__, "_made": None}

    def _run(self, name: str, state, *args, donate: bool = False):
        """core.run, remembering (weakly) the state it returned for `_check_state`."""
        state, report = core.run(name, self.config, state, *args, donate=donate)
        self._made = weakref.ref(state)
        return state, report

    # ---- small host reads for validation ---------------------------------------------------
    @staticmethod
    def _tenant_row(state, t: int) -> dict:
        """One tenant's ledger settings as Python values (one host read of the [T] columns)."""
        host = jax.device_get((state.tenants.token_quota, state.tenants.byte_quota,
                               state.tenants.lease_expiry, state.tenants.salt,
                               state.tenants.growing))
        tq, bq, lease, salt, growing = (column[t] for column in host)
        return dict(token_quota=int(tq), byte_quota=int(bq), lease_expiry=int(lease),
                    salt=np.uint32(salt), growing=np.bool_(growing))

    def _tenant(self, state, tenant, *, registered=True) -> int:
        t = int_scalar("tenant", tenant, UnknownTenantError)
        if not 0 <= t < self.config.num_tenants:
            raise UnknownTenantError(f"tenant {t} outside [0, {self.config.num_tenants})")
        if registered and not np.asarray(state.tenants.registered)[t]:
            raise UnknownTenantError(f"tenant {t} is not registered")
        return t

    def _running(self, state, seq_ids, what: str, error=UnknownSequenceError,
                 allowed=(SEQ_RUNNING,)):
        """The real (non-padding) ids of `seq_ids`, each in range and in an `allowed` status."""
        ids = seq_ids[seq_ids != INVALID]
        bad = ids[(ids < 0) | (ids >= self.config.max_seqs)]
        if bad.size:
            raise error(f"{what}: sequence id {int(bad[0])} outside [0, {self.config.max_seqs})")
        if ids.size:
            status = np.asarray(state.seqs.seq_status)[ids]
            wrong = ~np.isin(status, allowed)
            if wrong.any():
                names = " or ".join(STATUS_NAMES[a] for a in allowed)
                raise error(f"{what}: sequence {int(ids[wrong][0])} is "
                            f"{STATUS_NAMES.get(int(status[wrong][0]), 'unknown')}, not {names}")
        return ids

    def _heir_rows(self, state, salts, exclude) -> Optional[tuple]:
        """The table entries of the live sequence slots of tenants whose salt is in `salts` (the
        only possible heirs): (rows, cols) i32[S] naming each of their ceil(len / P) entries,
        padded with INVALID to a power of two; None when there are none (the core then reads no
        other row). Listing entries, not rows x MB, keeps the core's cost at the entries held."""
        ten = np.asarray(state.seqs.seq_tenant)
        salt = np.asarray(state.tenants.salt)
        live = ten >= 0
        rows = np.flatnonzero(live & np.isin(salt[np.maximum(ten, 0)], np.asarray(salts)))
        rows = np.setdiff1d(rows, exclude)
        p = self.config.block_size
        n = (np.asarray(state.seqs.seq_lens)[rows].astype(np.int64) + p - 1) // p
        if not n.sum():
            return None
        size = bucket(int(n.sum()))
        starts = np.cumsum(n) - n
        cols = np.arange(int(n.sum())) - np.repeat(starts, n)
        return pad(np.repeat(rows, n), size), pad(cols, size)

    # ---- tenants ---------------------------------------------------------------------------
    def _quota_units(self, byte_quota) -> int:
        b = int_scalar("byte_quota", byte_quota)
        if b < 0:
            raise QuotaValueError(f"byte_quota must be >= 0, got {b}")
        units = b // self.config.unit_bytes  # whole units: a cap, so round down
        if units > INT32_MAX:
            raise QuotaValueError(
                f"byte_quota {b} exceeds the largest representable "
                f"{INT32_MAX * self.config.unit_bytes} B"
            )
        return units

    @staticmethod
    def _nonneg(name, value, top=INT32_MAX) -> int:
        v = int_scalar(name, value)
        if not 0 <= v <= top:
            raise QuotaValueError(f"{name} must be in [0, {top}], got {v}")
        return v

    def register_tenant(self, state, tenant, *, token_quota, byte_quota,
                        lease_expiry=INT32_MAX, share_group: Optional[int] = None,
                        donate=False) -> tuple[KVState, TenantReport]:
        """Register a tenant with a token quota (logical tokens), a byte quota (bytes of device
        blocks charged to it; rounded down to whole byte units) and a lease expiry step.

        Its prefix-cache salt is private unless `share_group` is given: tenants of the same group
        share a salt and may then share prompt blocks.
        """
        self._check_state(state)
        t = self._tenant(state, tenant, registered=False)
        tq = self._nonneg("token_quota", token_quota)
        units = self._quota_units(byte_quota)
        lease = self._nonneg("lease_expiry", lease_expiry)
        if share_group is None:
            salt = private_salt(t)
        else:
            salt = group_salt(self._nonneg("share_group", share_group, 2**31 - 1))
        if np.asarray(state.tenants.registered)[t]:
            raise TenantExistsError(f"tenant {t} is already registered")
        return self._run("set_tenant", state, t, tq, units, lease, np.uint32(salt),
                         np.bool_(False), donate=donate)

    def set_quota(self, state, tenant, *, token_quota=None, byte_quota=None,
                  donate=False) -> tuple[KVState, TenantReport]:
        """Raise or cut a tenant's quotas (None keeps the current value). Cutting below current
        usage is allowed: the report says by how much it is over, which a reclaim then handles;
        until then new admissions and appends of that tenant are refused. A new quota ends
        grow-no-admit (a reclaim plan sets it again after its cut); lease and salt are kept."""
        self._check_state(state)
        t = self._tenant(state, tenant)
        row = self._tenant_row(state, t)
        tq = row["token_quota"] if token_quota is None else self._nonneg("token_quota", token_quota)
        units = row["byte_quota"] if byte_quota is None else self._quota_units(byte_quota)
        return self._run("set_tenant", state, t, tq, units, row["lease_expiry"], row["salt"],
                         np.bool_(False), donate=donate)

    def set_lease(self, state, tenant, lease_expiry, *, donate=False):
        """Move a tenant's lease expiry step (release_tenant is the action at expiry); its
        quotas, salt and grow-no-admit flag are kept."""
        self._check_state(state)
        t = self._tenant(state, tenant)
        lease = self._nonneg("lease_expiry", lease_expiry)
        row = self._tenant_row(state, t)
        return self._run("set_tenant", state, t, row["token_quota"], row["byte_quota"],
                         lease, row["salt"], row["growing"], donate=donate)

    def expired_tenants(self, state, step: int) -> np.ndarray:
        """Registered tenants whose lease_expiry <= step."""
        self._check_state(state)
        step = int_scalar("step", step)
        return np.flatnonzero(np.asarray(state.tenants.registered) & (np.asarray(state.tenants.lease_expiry) <= step))

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
        self._check_state(state)
        c = self.config
        ten = int_array("tenants", tenants, 1)
        tok = int_array("tokens", tokens, 2)
        lens = int_array("lengths", lengths, 1)
        b = ten.shape[0]
        if b == 0 or tok.shape[0] != b or lens.shape[0] != b:
            raise InputShapeError(
                f"tenants {ten.shape}, tokens {tok.shape}, lengths {lens.shape}: need B >= 1 rows each")
        if tok.shape[1] == 0:
            raise InputShapeError("tokens has no columns: a prompt has at least one token")
        if tok.shape[1] > c.max_tokens_per_seq:
            raise SequenceTooLongError(
                f"tokens has {tok.shape[1]} columns; a sequence holds at most "
                f"{c.max_tokens_per_seq} = {c.max_blocks_per_seq} blocks x {c.block_size}")
        real = ten != INVALID
        bad = np.flatnonzero(real & ((ten < 0) | (ten >= c.num_tenants)))
        if bad.size:
            raise UnknownTenantError(f"tenants[{bad[0]}] = {ten[bad[0]]}: a tenant id is in "
                                     f"[0, {c.num_tenants}), or {INVALID} for a padding row")
        for t in np.unique(ten[real]):
            self._tenant(state, t)
        if (real & ((lens < 1) | (lens > tok.shape[1]))).any():
            i = int(np.flatnonzero(real & ((lens < 1) | (lens > tok.shape[1])))[0])
            raise TokenIdError(f"lengths[{i}] = {lens[i]} outside [1, {tok.shape[1]}]")
        vocab = c.model.vocab_size
        if not 0 <= tok.min() <= tok.max() < vocab:  # some id out of range: in a prompt?
            in_prompt = real[:, None] & (np.arange(tok.shape[1])[None, :] < lens[:, None])
            bad = np.argwhere(((tok < 0) | (tok >= vocab)) & in_prompt)
            if len(bad):
                i, j = (int(x) for x in bad[0])
                raise TokenIdError(f"tokens[{i}, {j}] = {tok[i, j]}: prompt token ids must be "
                                   f"in [0, {vocab})")
        return self._run("admit", state, ten, tok, np.where(real, lens, 0).astype(np.int32), donate=donate)

    def append(self, state, seq_ids, tokens, *, donate=False) -> tuple[KVState, AppendReport]:
        """Append one token to each sequence: seq_ids i32[B] (unique; INVALID = padding),
        tokens i32[B]. A block is allocated when a boundary is crossed; rows over quota or pool
        are refused. The report names the (block, offset) slot where the caller writes the
        token's K/V."""
        self._check_state(state)
        c = self.config
        ids = int_array("seq_ids", seq_ids, 1)
        tok = int_array("tokens", tokens, 1)
        if ids.shape != tok.shape or ids.size == 0:
            raise InputShapeError(f"seq_ids {ids.shape} and tokens {tok.shape} must be [B], B >= 1")
        real_ids = self._running(state, ids, "append")
        if len(np.unique(real_ids)) != len(real_ids):
            raise DuplicateIdError("append: a sequence appears twice in one call")
        real = ids != INVALID
        bad = np.flatnonzero(((tok < 0) | (tok >= c.model.vocab_size)) & real)
        if bad.size:
            raise TokenIdError(f"tokens[{bad[0]}] = {tok[bad[0]]}: token ids must be in "
                               f"[0, {c.model.vocab_size})")
        if real_ids.size and (np.asarray(state.seqs.seq_lens)[real_ids] >= c.max_tokens_per_seq).any():
            raise SequenceTooLongError(
                f"append: a sequence already holds {c.max_tokens_per_seq} tokens (table full)")
        return self._run("append", state, ids, tok, donate=donate)

    def fork(self, state, seq_ids, *, donate=False) -> tuple[KVState, ForkReport]:
        """Fork running sequences (i32[B], INVALID = padding) into new slots of the same tenant:
        full blocks shared by reference, the partly filled last block copied."""
        self._check_state(state)
        ids = int_array("seq_ids", seq_ids, 1)
        if ids.size == 0:
            raise InputShapeError("seq_ids must have at least one row")
        self._running(state, ids, "fork")
        return self._run("fork", state, ids, donate=donate)

    # ---- pins ------------------------------------------------------------------------------
    def _blocks(self, state, block_ids, what):
        ids = int_array("block_ids", block_ids, 1)
        if ids.size == 0:
            raise InputShapeError("block_ids must have at least one row")
        real = ids[ids != INVALID]
        if ((real < 0) | (real >= self.config.total_blocks)).any():
            raise BlockStateError(f"{what}: block id outside [0, {self.config.total_blocks})")
        if len(np.unique(real)) != len(real):
            raise DuplicateIdError(f"{what}: a block appears twice in one call")
        return ids, real

    def pin_blocks(self, state, block_ids, *, donate=False) -> tuple[KVState, PinReport]:
        """Pin held blocks (i32[B]); pinning a free block is an error. A pinned block stays
        resident and charged even with no references, and prefix lookups may still hit it."""
        self._check_state(state)
        ids, real = self._blocks(state, block_ids, "pin")
        host = self.config.host_pool
        if host is not None and real.size and (real >= self.config.pool_starts[host]).any():
            raise TierError("pin: a host-pool block cannot be pinned (restore it first); a pin "
                            "keeps a block resident on the device")
        if real.size:
            held = (np.asarray(state.blocks.ref_count[real]) > 0) | (np.asarray(state.blocks.pin_count[real]) > 0)
            if not held.all():
                raise BlockStateError(f"pin: block {int(real[~held][0])} is free")
        return self._run("pin", state, ids, donate=donate)

    def unpin_blocks(self, state, block_ids, *, donate=False) -> tuple[KVState, FreeReport]:
        """Drop one pin on each block (i32[B]); blocks held by nothing return to their pool."""
        self._check_state(state)
        ids, real = self._blocks(state, block_ids, "unpin")
        if real.size and (np.asarray(state.blocks.pin_count[real]) <= 0).any():
            bad = real[np.asarray(state.blocks.pin_count[real]) <= 0][0]
            raise BlockStateError(f"unpin: block {int(bad)} is not pinned")
        payers = np.asarray(state.blocks.payer[real]) if real.size else np.zeros(0, np.int32)
        heirs = self._heir_rows(state, np.asarray(state.tenants.salt)[payers], [])
        return self._run("unpin", state, ids, heirs, donate=donate)

    def _prefix(self, state, seq_id, num_blocks):
        sid = int_scalar("seq_id", seq_id, UnknownSequenceError)
        if not 0 <= sid < self.config.max_seqs:
            raise UnknownSequenceError(f"sequence id {sid} outside [0, {self.config.max_seqs})")
        self._running(state, np.array([sid], np.int32), "prefix")
        n = int_scalar("num_blocks", num_blocks, BlockStateError)
        have = -(-int(state.seqs.seq_lens[sid]) // self.config.block_size)
        if not 1 <= n <= have:
            raise BlockStateError(f"num_blocks {n} outside [1, {have}] for sequence {sid}")
        return np.asarray(state.seqs.block_tables[sid, :n])

    def pin_prefix(self, state, seq_id, num_blocks, *, donate=False):
        """Pin the first `num_blocks` blocks of a running sequence (e.g. its system prompt)."""
        self._check_state(state)
        return self.pin_blocks(state, self._prefix(state, seq_id, num_blocks), donate=donate)

    def unpin_prefix(self, state, seq_id, num_blocks, *, donate=False):
        """Unpin the first `num_blocks` blocks of a running sequence."""
        self._check_state(state)
        return self.unpin_blocks(state, self._prefix(state, seq_id, num_blocks), donate=donate)

    # ---- free / release --------------------------------------------------------------------
    def free(self, state, seq_ids, *, donate=False) -> tuple[KVState, FreeReport]:
        """Free sequences (i32[B], INVALID = padding): one reference dropped per block-table
        entry; blocks held by nothing return to their pool with their hash entries cleared
        (with `keep_cold_blocks`, full pool-0 blocks stay in the prefix cache as cold blocks,
        uncharged free capacity that the next allocation short of stack blocks reuses; their
        pages are trusted as cache content, so free a sequence only after its K/V are written,
        never between admit and its prefill)."""
        self._check_state(state)
        ids = int_array("seq_ids", seq_ids, 1)
        if ids.size == 0:
            raise InputShapeError("seq_ids must have at least one row")
        real = self._running(state, ids, "free", error=DoubleFreeError,
                             allowed=(SEQ_RUNNING, SEQ_SUSPENDED, SEQ_IDLE, SEQ_PREEMPTED))
        if len(np.unique(real)) != len(real):
            raise DoubleFreeError("free: a sequence appears twice in one call")
        rows, cols = pad(real, bucket(len(real))), self._table_cols(state, real)
        heirs = None  # most frees orphan nothing: then no other row's entries are listed or read
        if bool(core.leaves_orphans(self.config, state, rows, cols)):
            ten = np.asarray(state.seqs.seq_tenant)[real]
            heirs = self._heir_rows(state, np.asarray(state.tenants.salt)[ten], real)
        return self._run("drop", state, rows, heirs, None, 0, cols, donate=donate)

    def _table_cols(self, state, ids) -> int:
        """Table columns holding every entry of sequences `ids` (a table holds exactly its first
        ceil(len / P) entries): 16 x a power of 4, at most max_blocks_per_seq, so a free reads
        the blocks its rows hold, not whole tables, in a few compiled sizes."""
        p, cols = self.config.block_size, 16
        held = int(np.max((np.asarray(state.seqs.seq_lens)[ids] + p - 1) // p, initial=0))
        while cols < held:
            cols *= 4
        return min(cols, self.config.max_blocks_per_seq)

    def release_plan(self, state, tenant, unpin=False):
        """Host-side inputs of the jitted release (tenant's rows, heir rows, pin slots)."""
        t = self._tenant(state, tenant)
        ten = np.asarray(state.seqs.seq_tenant)
        rows = np.flatnonzero(ten == t)
        heirs = self._heir_rows(state, np.asarray(state.tenants.salt)[[t]], rows)
        pinned = int(np.asarray(state.tenants.pinned_blocks)[t].sum()) if unpin else 0
        slots = bucket(pinned) if pinned else 0
        return t, pad(rows, bucket(len(rows))), heirs, slots

    def release_tenant(self, state, tenant, *, unpin=False, donate=False
                       ) -> tuple[KVState, FreeReport]:
        """Release a tenant (e.g. at lease expiry): walk each of its block tables entry by entry,
        dropping one reference per entry. Its pinned blocks stay pinned and charged unless
        `unpin=True`. Shared blocks it paid for that others still reference pass their charge to
        the lowest-id remaining referencer (reported, with heirs pushed over their byte quota)."""
        self._check_state(state)
        if not isinstance(unpin, bool):
            raise InputDtypeError(f"unpin must be a bool, got {unpin!r}")
        t, rows, heirs, slots = self.release_plan(state, tenant, unpin)
        return self._run("drop", state, rows, heirs, np.int32(t) if slots else None, slots,
                         donate=donate)

    # ---- cold cached blocks ----------------------------------------------------------------
    def allocatable_blocks(self, state) -> np.ndarray:
        """i32[POOLS]: blocks an allocation may take from each pool now: its free list, plus
        pool 0's cold cached blocks (`keep_cold_blocks`: free capacity that is still cache).
        Every room check of the facade counts with it."""
        self._check_state(state)
        return self._allocatable(state)

    def _allocatable(self, state) -> np.ndarray:
        """`allocatable_blocks` of a checked state (two small host reads)."""
        return core.allocatable(self.config, state, xp=np)

    def drop_cold(self, state, max_blocks: Optional[int] = None, *, donate=False
                  ) -> tuple[KVState, core.ColdReport]:
        """Push up to `max_blocks` (None: all) cold cached blocks, least recently cold first,
        onto pool 0's free list, clearing their prefix-cache entries (rebalance: "drop cold
        cache LRU"). Allocatable capacity is unchanged; without keep_cold_blocks nothing is
        cold and nothing changes."""
        self._check_state(state)
        cold = int(np.asarray(state.free.cold_count))
        n = cold
        if max_blocks is not None:
            m = int_scalar("max_blocks", max_blocks, InvalidArgumentError)
            if m < 0:
                raise InvalidArgumentError(f"max_blocks must be >= 0, got {m}")
            n = min(m, cold)
        slots = min(bucket(n), self.config.num_blocks)
        return self._run("drop_cold", state, np.int32(n), slots, donate=donate)

    # ---- attention statistics --------------------------------------------------------------
    def record_attention(self, state, seq_ids, mass, *, donate=False) -> tuple[KVState, None]:
        """Accumulate the attention mass each cached token received (the kernels' `mass`
        output: f32[B, C], column i = cache index i, summed over layers and KV heads) into the
        state, where compression and eviction policies read it."""
        self._check_state(state)
        ids = int_array("seq_ids", seq_ids, 1)
        m = np.asarray(mass)
        if m.ndim != 2 or m.shape[0] != ids.shape[0] or m.shape[1] > self.config.max_tokens_per_seq:
            raise InputShapeError(f"mass must be [B={ids.shape[0]}, C <= "
                                  f"{self.config.max_tokens_per_seq}], got {m.shape}")
        if not np.issubdtype(m.dtype, np.floating) or not (np.isfinite(m) & (m >= 0)).all():
            raise InputDtypeError("mass must be finite, non-negative floats")
        real = self._running(state, ids, "record_attention")
        if len(np.unique(real)) != len(real):
            raise DuplicateIdError("record_attention: a sequence appears twice in one call")
        return self._run("record_mass", state, ids, m.astype(np.float32), donate=donate)
