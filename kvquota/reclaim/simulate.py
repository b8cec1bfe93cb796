"""A host (NumPy) model of what each reclaim means does to the reference counts and charges, so
a plan can state its bytes exactly before anything runs.

The model follows the cores' rules (kvquota.core): a *drop* (free, preempt, release, the blocks an
eviction loses) removes one reference per table entry and then settles the touched blocks as one
batch (held by nothing: back to its pool — or cold when `keep_cold_blocks`, which is free capacity
too; payer without references: the charge passes to the lowest-id referencing tenant among the
live rows outside the batch that share the salt); a *move* (offload, compress) takes a sequence's
own blocks (ref 1, unpinned, paid by its tenant). It is an independent recomputation: apply_plan
measures the real bytes from the state, and tests compare the two exactly.
"""

from __future__ import annotations

import numpy as np

from kvquota.codes import SEQ_FREE
from kvquota.sentinel import INVALID
from kvquota.state import pool_of


class HostModel:
    """Mutable NumPy copy of the metadata a plan needs; one `drop`/`move` call per step.

    It holds what `planner.plan_view` read: the local rows (the victims' and their possible
    heirs', `tables` [R, MB]; `slot` maps a sequence id to its local row) and the blocks they
    reference or the victims pay for, in local ids (block i of the model is `view.block_ids[i]`).
    Per-sequence columns are whole ([S]), indexed by sequence id."""

    def __init__(self, config, view):
        c = config
        self.c = c
        b, s, t = view.blocks, view.seqs, view.tenants
        # Blocks a move creates get model-only ids past the read ones (U + k, the arrays grown
        # as needed: `_reserve`): their charges and references are tracked like any other's.
        self.ref = b.ref_count.astype(np.int64)
        self.pin = b.pin_count.astype(np.int64)
        self.payer = b.payer.astype(np.int64)
        self.prefs = b.payer_refs.astype(np.int64)
        self.fill = b.fill.astype(np.int64)
        self.hashed = np.array(b.hashed, bool)
        self.pool = pool_of(c, view.block_ids, xp=np).astype(np.int64)
        self.next_id = len(view.block_ids)
        self.rows, self.slot = view.rows, view.slot  # local row -> sequence id, and back
        self.tables = view.local_tables.astype(np.int64)
        self.ten = s.seq_tenant.astype(np.int64).copy()
        self.lens = s.seq_lens.astype(np.int64).copy()
        self.alive = s.seq_status != SEQ_FREE
        self.salt = t.salt
        self.charged = t.charged_blocks.astype(np.int64).copy()  # [T, POOLS]
        self.free = view.free.free_count.astype(np.int64).copy()
        self.units = np.asarray(c.pool_units, np.int64)
        self.device = np.asarray(c.device_pools)
        self.inherited_by_others = 0  # victims' device units whose charge passed to non-victims

    _BLOCK_FIELDS = {"ref": 0, "pin": 0, "payer": INVALID, "prefs": 0, "fill": 0,
                     "hashed": False, "pool": 0}  # per-block arrays and a new block's value

    def _reserve(self, n: int):
        """Room for n more model-only block ids (the per-block arrays at least double)."""
        size = len(self.ref)
        if self.next_id + n <= size:
            return
        more = max(self.next_id + n - size, size, 64)
        for name, value in self._BLOCK_FIELDS.items():
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.full(more, value, a.dtype)]))

    def copy(self) -> "HostModel":
        new = HostModel.__new__(HostModel)
        new.__dict__ = {k: (v.copy() if isinstance(v, np.ndarray) else v)
                        for k, v in self.__dict__.items()}
        return new

    # ---- figures --------------------------------------------------------------------------
    def device_units(self, tenants) -> int:
        """Device units charged to `tenants`."""
        return int((self.charged[list(tenants)] * (self.units * self.device)[None, :]).sum())

    def meters(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of what a step's figures are measured from: charges [T, POOLS], free [POOLS]."""
        return self.charged.copy(), self.free.copy()

    def pool0_free(self) -> int:
        return int(self.free[0])

    def table(self, row) -> np.ndarray:
        """Sequence `row`'s table in model block ids (a view: writes go to the model)."""
        return self.tables[self.slot[row]]

    def own(self, row, pool) -> np.ndarray:
        """Table positions of `row`'s own blocks in `pool` (the cores' rule)."""
        e = self.table(row)
        ok = e >= 0
        ec = np.where(ok, e, 0)
        return np.flatnonzero(ok & (self.pool[ec] == pool) & (self.ref[ec] == 1)
                              & (self.pin[ec] == 0) & (self.payer[ec] == self.ten[row]))

    # ---- means -----------------------------------------------------------------------------
    def drop(self, rows, entries=None, unpin_tenant=None, victims=()):
        """Drop references: every entry of `rows` (or the (row, positions) pairs of `entries`)
        plus, with `unpin_tenant`, every pin on its blocks; settle as one batch. Rows dropped
        whole leave the model's live rows."""
        pairs = [(r, np.flatnonzero(self.table(r) >= 0)) for r in rows] if entries is None \
            else entries
        touched = []
        tenants = set()
        for r, pos in pairs:
            blocks = self.table(r)[pos]
            t = self.ten[r]
            tenants.add(int(t))
            np.subtract.at(self.ref, blocks, 1)
            np.subtract.at(self.prefs, blocks[self.payer[blocks] == t], 1)
            touched.append(blocks)
            self.table(r)[pos] = INVALID
        if entries is None:
            for r in rows:
                self.alive[r] = False
        if unpin_tenant is not None:  # its blocks' heirs share its salt, live rows or not
            tenants.add(int(unpin_tenant))
            pinned = np.flatnonzero((self.payer == unpin_tenant) & (self.pin > 0))
            self.pin[pinned] = 0
            touched.append(pinned)
        touched = np.unique(np.concatenate(touched)) if touched else np.zeros(0, np.int64)
        batch = {int(r) for r in rows} if entries is None else {int(r) for r, _ in entries}
        self._settle(touched, tenants, set(victims), batch)

    def _settle(self, blocks, tenants, victims, batch_rows):
        freed = blocks[(self.ref[blocks] == 0) & (self.pin[blocks] == 0)]  # distinct ids
        np.subtract.at(self.charged, (self.payer[freed], self.pool[freed]), 1)
        np.add.at(self.free, self.pool[freed], 1)
        self.payer[freed], self.prefs[freed] = INVALID, 0
        orphans = blocks[(self.ref[blocks] > 0) & (self.pin[blocks] == 0)
                         & (self.prefs[blocks] == 0) & (self.payer[blocks] >= 0)]
        if not len(orphans):
            return
        salts = {int(self.salt[t]) for t in tenants}
        live = self.alive & (self.ten >= 0)
        heir_row = live & np.isin(self.salt[np.maximum(self.ten, 0)], list(salts))
        for r in batch_rows:
            heir_row[r] = False
        heir_row = heir_row[self.rows]  # every possible heir is a local row
        local_ten = self.ten[self.rows]
        for b in orphans:
            rows = np.flatnonzero(heir_row & (self.tables == b).any(axis=1))
            if not len(rows):
                continue  # no heir: the payer keeps the charge
            heir = int(local_ten[rows].min())
            old, p = int(self.payer[b]), self.pool[b]
            self.charged[old, p] -= 1
            self.charged[heir, p] += 1
            if old in victims and heir not in victims and self.device[p]:
                self.inherited_by_others += int(self.units[p])
            self.payer[b] = heir
            self.prefs[b] = int((self.tables[local_ten == heir] == b).sum())

    def move(self, row, pos, dst_pool):
        """Move the own blocks at table positions `pos` of `row` to `dst_pool` (offload to host,
        or compress): the old blocks return to pool 0, new ones (model-only ids) are charged in
        dst_pool and take their place in the row's table."""
        blocks = self.table(row)[pos]
        t = self.ten[row]
        n = len(blocks)
        self._reserve(n)
        new = np.arange(self.next_id, self.next_id + n)
        self.next_id += n
        self.ref[new], self.prefs[new], self.payer[new] = 1, 1, t
        self.pool[new], self.fill[new] = dst_pool, self.fill[blocks]
        self.ref[blocks] = 0
        self.prefs[blocks] = 0
        self.payer[blocks] = INVALID
        self.charged[t, 0] -= n
        self.free[0] += n
        self.charged[t, dst_pool] += n
        self.free[dst_pool] -= n
        self.table(row)[pos] = new

    def copy_on_write(self, row, n):
        """Eviction's copies of kept shared blocks: n fresh pool-0 blocks charged to the row."""
        self.charged[self.ten[row], 0] += n
        self.free[0] -= n

    def still_cached(self, blocks) -> np.ndarray:
        """bool per block: would a prefix lookup still find it (held, or cold when the config
        keeps cold blocks)?"""
        held = (self.ref[blocks] > 0) | (self.pin[blocks] > 0)
        if self.c.keep_cold_blocks:
            held |= (self.pool[blocks] == 0) & (self.fill[blocks] == self.c.block_size)
        return held & self.hashed[blocks]
