"""A plain-Python model of the paged KV state: what every operation should decide and leave.

`Model(config)` mirrors the allocator block by block for pool 0 (the only pool the operations
under test allocate from; the other pools must stay untouched): the pool-0 free stack, per-block
references, pins, payer, payer-held references, fill, token ids, chain hash, salt, parent and
parent generation, the sequence tables and the tenant ledger. It is written from the rules in
DESIGN.md and the facade's docstrings, in plain Python loops over lists — no jax, and none of
`kvquota.core` or `kvquota.invariants` — so a slip in a jitted core shows up as a difference:

* **admission decisions** (`_decide`): rows in batch order, each checked against the ledger as
  left by the accepted rows before it, in the order padding, block table full, token quota
  (`ntok > token_quota - used`), byte quota in whole units (`nblk * units_per_block >
  byte_quota - charged`), pool-0 free blocks, sequence slots; a refused row takes nothing;
* **prefix lookup**: only the first `(length - 1) // P` full blocks of a prompt may hit (its last
  token is always computed, so the model has logits); a candidate has the same salt, chain hash
  and token ids, and its parent is the previous hit *with the generation it had then*
  (`lookup_candidates` equal-hash blocks at most, lowest ids first); prompts of one batch never
  hit each other's new blocks;
* **settling** after references or pins are dropped: blocks held by nothing return to the pool
  (generation + 1, metadata cleared); a block whose payer holds no reference and no pin passes
  its charge to the lowest-id tenant still referencing it, which is over its quota only if its
  charged units are now *strictly* above its byte quota.

Only the chain hash function itself is shared with the library (`kvquota.hashing`): it is the
definition of the hash, not a rule.

Each operation returns the report the model expects (plain Python values) and updates the model;
`compare(host_state)` lists every field where a state differs from the model.
"""

from __future__ import annotations

import numpy as np

from kvquota.codes import (
    OK,
    REFUSED_BYTE_QUOTA,
    REFUSED_NO_SEQ_SLOT,
    REFUSED_POOL_FULL,
    REFUSED_SEQ_FULL,
    REFUSED_TOKEN_QUOTA,
    SEQ_FREE,
    SEQ_RUNNING,
    SKIPPED_PADDING,
)
from kvquota.hashing import block_hash, group_salt, private_salt, salt_root
from kvquota.sentinel import INVALID

NO_HASH = (0, 0)


class Seq:
    def __init__(self, tenant, tokens, table):
        self.tenant = tenant
        self.tokens = list(tokens)
        self.table = list(table)


class Model:
    """Plain-Python mirror of a state of `config` (pool 0 only; see the module docstring)."""

    def __init__(self, config):
        c = config
        self.config = c
        self.P, self.S = c.block_size, c.max_seqs
        self.MB, self.T = c.max_blocks_per_seq, c.num_tenants
        self.N = c.num_blocks  # pool 0: global ids 0 .. N - 1
        self.unit0 = c.pool_units[0]
        self.unit_bytes = c.unit_bytes
        self.bits = c.hash_bits
        self.C = c.lookup_candidates
        n = self.N
        self.ref, self.pin, self.prefs, self.fill = [0] * n, [0] * n, [0] * n, [0] * n
        self.payer = [INVALID] * n
        self.tokens = [[] for _ in range(n)]
        self.hash = [NO_HASH] * n
        self.hashed = [False] * n
        self.salt = [0] * n
        self.parent, self.pgen, self.gen = [INVALID] * n, [0] * n, [0] * n
        self.stack = list(range(n - 1, -1, -1))  # a stack: the top (end) is popped first
        self.seqs: dict[int, Seq] = {}
        self.registered = [False] * self.T
        self.tq, self.bq = [0] * self.T, [0] * self.T  # token quota, byte quota in units
        self.tsalt = [0] * self.T
        self.lease = [0] * self.T
        self.stale_parents = 0  # lookup candidates refused only for their parent's generation

    # ---- derived ledger figures ----------------------------------------------------------
    def held(self, b) -> bool:
        return self.ref[b] > 0 or self.pin[b] > 0

    def used(self, t) -> int:
        return sum(len(s.tokens) for s in self.seqs.values() if s.tenant == t)

    def charged(self, t) -> int:
        """Pool-0 blocks charged to t."""
        return sum(1 for b in range(self.N) if self.held(b) and self.payer[b] == t)

    def pinned(self, t) -> int:
        return sum(1 for b in range(self.N) if self.pin[b] > 0 and self.payer[b] == t)

    def live(self) -> list[int]:
        return sorted(self.seqs)

    def free_slots(self) -> list[int]:
        return [s for s in range(self.S) if s not in self.seqs]

    # ---- hashing ---------------------------------------------------------------------------
    def _root(self, salt):
        return tuple(int(x) for x in salt_root(np.array([salt], np.uint32), self.bits, xp=np)[0])

    def _hash(self, prev, toks):
        h = block_hash(np.array([prev], np.uint32), np.array([toks], np.int32), self.bits, xp=np)
        return tuple(int(x) for x in h[0])

    def chain(self, salt, toks) -> list[tuple]:
        """Chain hash of every full block of `toks`."""
        out, h = [], self._root(salt)
        for k in range(len(toks) // self.P):
            h = self._hash(h, toks[k * self.P:(k + 1) * self.P])
            out.append(h)
        return out

    # ---- tenants -----------------------------------------------------------------------------
    def register(self, t, token_quota, byte_quota, share_group=None, lease=2**31 - 1):
        """Returns (tokens_over, units_over)."""
        self.registered[t] = True
        self.tsalt[t] = private_salt(t) if share_group is None else group_salt(share_group)
        self.lease[t] = lease
        return self.set_quota(t, token_quota, byte_quota)

    def set_quota(self, t, token_quota=None, byte_quota=None):
        if token_quota is not None:
            self.tq[t] = token_quota
        if byte_quota is not None:
            self.bq[t] = byte_quota // self.unit_bytes  # whole units, rounded down
        return max(self.used(t) - self.tq[t], 0), max(self.charged(t) * self.unit0 - self.bq[t], 0)

    # ---- decisions ---------------------------------------------------------------------------
    def _decide(self, rows, need_slot):
        """rows: (tenant or INVALID, tokens needed, blocks needed, table full) in batch order."""
        free0 = len(self.stack)
        used = {t: self.used(t) for t in range(self.T)}
        units = {t: self.charged(t) * self.unit0 for t in range(self.T)}
        slots = len(self.free_slots())
        out = []
        for t, ntok, nblk, full in rows:
            if t == INVALID:
                reason = SKIPPED_PADDING
            elif full:
                reason = REFUSED_SEQ_FULL
            elif ntok > self.tq[t] - used[t]:
                reason = REFUSED_TOKEN_QUOTA
            elif nblk * self.unit0 > self.bq[t] - units[t]:
                reason = REFUSED_BYTE_QUOTA
            elif nblk > free0:
                reason = REFUSED_POOL_FULL
            elif need_slot and slots < 1:
                reason = REFUSED_NO_SEQ_SLOT
            else:
                reason = OK
                free0 -= nblk
                used[t] += ntok
                units[t] += nblk * self.unit0
                slots -= int(need_slot)
            out.append(reason)
        return out

    def lookup(self, salt, toks) -> list[int]:
        """Leading prefix-cache hits of a prompt (block ids)."""
        p = self.P
        hashes = self.chain(salt, toks)
        hits, prev = [], INVALID
        for k in range((len(toks) - 1) // p):
            blk = toks[k * p:(k + 1) * p]
            cands = [b for b in range(self.N)
                     if self.hashed[b] and self.hash[b] == hashes[k] and self.salt[b] == salt]
            self.stale_parents += sum(
                1 for b in cands[: self.C] if self.tokens[b] == blk and prev != INVALID
                and self.parent[b] == prev and self.pgen[b] != self.gen[prev])
            good = [b for b in cands[: self.C] if self.tokens[b] == blk and (
                self.parent[b] == INVALID if prev == INVALID
                else self.parent[b] == prev and self.pgen[b] == self.gen[prev])]
            if not good:
                break
            prev = good[0]
            hits.append(prev)
        return hits

    def _new_block(self, tenant, salt, parent):
        b = self.stack.pop()
        self.ref[b], self.prefs[b], self.payer[b] = 1, 1, tenant
        self.salt[b], self.parent[b] = salt, parent
        self.pgen[b] = self.gen[parent] if parent != INVALID else 0
        self.tokens[b], self.fill[b], self.hashed[b], self.hash[b] = [], 0, False, NO_HASH
        return b

    def _take(self, b, tenant):
        self.ref[b] += 1
        if self.payer[b] == tenant:
            self.prefs[b] += 1

    # ---- admit / append / fork -----------------------------------------------------------------
    def admit(self, rows):
        """rows: [(tenant or INVALID, prompt tokens)]. Returns per-row dicts of the report."""
        p = self.P
        looked = [self.lookup(self.tsalt[t], toks) if t != INVALID else [] for t, toks in rows]
        nblk = [-(-len(toks) // p) if t != INVALID else 0 for t, toks in rows]
        reasons = self._decide(
            [(t, len(toks) if t != INVALID else 0, nblk[i] - len(looked[i]), False)
             for i, (t, toks) in enumerate(rows)], need_slot=True)
        free_slots = self.free_slots()
        out = []
        for i, (t, toks) in enumerate(rows):
            hits = looked[i]
            if reasons[i] != OK:
                out.append(dict(admitted=False, reason=reasons[i], seq_id=INVALID,
                                cached_tokens=0, hit_blocks=0, new_blocks=0))
                continue
            slot = free_slots.pop(0)
            salt = self.tsalt[t]
            hashes = self.chain(salt, toks)
            table = []
            for k in range(nblk[i]):
                if k < len(hits):
                    self._take(hits[k], t)
                    table.append(hits[k])
                    continue
                b = self._new_block(t, salt, table[-1] if table else INVALID)
                self.tokens[b] = list(toks[k * p:(k + 1) * p])
                self.fill[b] = len(self.tokens[b])
                if self.fill[b] == p:
                    self.hashed[b], self.hash[b] = True, hashes[k]
                table.append(b)
            self.seqs[slot] = Seq(t, toks, table)
            out.append(dict(admitted=True, reason=OK, seq_id=slot, cached_tokens=len(hits) * p,
                            hit_blocks=len(hits), new_blocks=nblk[i] - len(hits)))
        return out

    def append(self, seq_ids, toks):
        """One token per sequence (INVALID = padding). Returns per-row dicts of the report."""
        p = self.P
        rows = []
        for sid in seq_ids:
            if sid == INVALID:
                rows.append((INVALID, 0, 0, False))
                continue
            n = len(self.seqs[sid].tokens)
            rows.append((self.seqs[sid].tenant, 1, int(n % p == 0), n // p >= self.MB))
        reasons = self._decide(rows, need_slot=False)
        out = []
        for sid, tok, reason in zip(seq_ids, toks, reasons):
            if reason != OK:
                out.append(dict(appended=False, reason=reason, block=INVALID, offset=INVALID,
                                new_block=False))
                continue
            seq = self.seqs[sid]
            t, n = seq.tenant, len(seq.tokens)
            k, off = divmod(n, p)
            new = off == 0
            if new:
                seq.table.append(self._new_block(t, self.tsalt[t], seq.table[k - 1]))
            b = seq.table[k]
            self.tokens[b].append(tok)
            self.fill[b] += 1
            seq.tokens.append(tok)
            if off == p - 1:
                prev = self.hash[seq.table[k - 1]] if k > 0 else self._root(self.tsalt[t])
                self.hashed[b], self.hash[b] = True, self._hash(prev, self.tokens[b])
            out.append(dict(appended=True, reason=OK, block=b, offset=off, new_block=new))
        return out

    def fork(self, seq_ids):
        """Fork sequences into new slots of the same tenant. Returns per-row dicts."""
        p = self.P
        rows = []
        for sid in seq_ids:
            if sid == INVALID:
                rows.append((INVALID, 0, 0, False))
                continue
            seq = self.seqs[sid]
            rows.append((seq.tenant, len(seq.tokens), int(len(seq.tokens) % p != 0), False))
        reasons = self._decide(rows, need_slot=True)
        free_slots = self.free_slots()
        out = []
        for sid, reason in zip(seq_ids, reasons):
            if reason != OK:
                out.append(dict(forked=False, reason=reason, seq_id=INVALID,
                                copied_from=INVALID, copied_to=INVALID))
                continue
            src = self.seqs[sid]
            t = src.tenant
            slot = free_slots.pop(0)
            table, old, new = list(src.table), INVALID, INVALID
            if len(src.tokens) % p:
                old = table[-1]
                new = self._new_block(t, self.salt[old], self.parent[old])
                self.pgen[new] = self.pgen[old]
                self.tokens[new], self.fill[new] = list(self.tokens[old]), self.fill[old]
                table[-1] = new
            for b in table:
                if b != new:
                    self._take(b, t)
            self.seqs[slot] = Seq(t, src.tokens, table)
            out.append(dict(forked=True, reason=OK, seq_id=slot, copied_from=old, copied_to=new))
        return out

    # ---- pins ----------------------------------------------------------------------------------
    def pin_blocks(self, blocks):
        for b in blocks:
            if b != INVALID:
                self.pin[b] += 1
        return [self.pin[b] if b != INVALID else 0 for b in blocks]

    def unpin_blocks(self, blocks):
        real = [b for b in blocks if b != INVALID]
        salts = {self.tsalt[self.payer[b]] for b in real}
        for b in real:
            self.pin[b] -= 1
        return self._settle(real, salts, seqs_freed=0, tokens={}, unpinned=len(real))

    # ---- free / release ------------------------------------------------------------------------
    def _drop(self, sids):
        tokens, touched = {}, []
        for sid in sids:
            seq = self.seqs.pop(sid)
            for b in seq.table:
                self.ref[b] -= 1
                if self.payer[b] == seq.tenant:
                    self.prefs[b] -= 1
                touched.append(b)
            tokens[seq.tenant] = tokens.get(seq.tenant, 0) + len(seq.tokens)
        return tokens, touched

    def free(self, sids):
        real = [s for s in sids if s != INVALID]
        salts = {self.tsalt[self.seqs[s].tenant] for s in real}
        tokens, touched = self._drop(real)
        return self._settle(touched, salts, seqs_freed=len(real), tokens=tokens, unpinned=0)

    def release(self, t, unpin=False):
        rows = [s for s in self.live() if self.seqs[s].tenant == t]
        tokens, touched = self._drop(rows)
        unpinned = 0
        if unpin:
            for b in range(self.N):
                if self.payer[b] == t and self.pin[b] > 0:
                    self.pin[b] = 0
                    touched.append(b)
                    unpinned += 1
        return self._settle(touched, {self.tsalt[t]}, seqs_freed=len(rows), tokens=tokens,
                            unpinned=unpinned)

    def _settle(self, touched, heir_salts, *, seqs_freed, tokens, unpinned):
        """Blocks held by nothing return to the pool; orphaned charges pass to an heir."""
        released, inherited = [0] * self.T, [0] * self.T
        returned = transferred = 0
        seen = set()
        for b in touched:
            if b in seen:
                continue
            seen.add(b)
            if self.ref[b] == 0 and self.pin[b] == 0:
                released[self.payer[b]] += self.unit0
                self.payer[b], self.prefs[b], self.fill[b] = INVALID, 0, 0
                self.hash[b], self.hashed[b], self.salt[b] = NO_HASH, False, 0
                self.parent[b], self.pgen[b] = INVALID, 0
                self.gen[b] += 1
                self.stack.append(b)
                returned += 1
            elif self.ref[b] > 0 and self.pin[b] == 0 and self.prefs[b] == 0:
                holders = [s.tenant for s in self.seqs.values()
                           if b in s.table and self.tsalt[s.tenant] in heir_salts]
                if not holders:
                    continue  # no heir: the charge stays where it was
                heir = min(holders)
                released[self.payer[b]] += self.unit0
                inherited[heir] += self.unit0
                self.payer[b] = heir
                self.prefs[b] = holders.count(heir)
                transferred += 1
        over = [inherited[t] > 0 and self.charged(t) * self.unit0 > self.bq[t]
                for t in range(self.T)]
        return dict(seqs_freed=seqs_freed,
                    tokens_released=[tokens.get(t, 0) for t in range(self.T)],
                    blocks_returned=returned, quota_units_released=released,
                    transferred_blocks=transferred, inherited_units=inherited,
                    heir_over_quota=over, unpinned_blocks=unpinned,
                    duplicates=len(seen) != len([b for b in touched if b != INVALID]))

    def sync_free_order(self, host_state):
        """Adopt the order of the pool-0 free stack from the state (its SET must already equal
        the model's): blocks pushed by one call in a scatter with repeated ids (several freed
        entries naming one block) land in an order XLA does not specify."""
        cnt = int(host_state.free.free_count[0])
        order = [int(b) for b in host_state.free.free_list[:cnt]]
        assert sorted(order) == sorted(self.stack), (order, self.stack)
        self.stack = order

    # ---- comparison ----------------------------------------------------------------------------
    def expected_arrays(self) -> dict:
        """The model as the state's arrays (pool 0 for per-block fields)."""
        p, n = self.P, self.N
        tables = np.full((self.S, self.MB), INVALID, np.int32)
        lens = np.zeros(self.S, np.int32)
        ten = np.full(self.S, INVALID, np.int32)
        status = np.full(self.S, SEQ_FREE, np.int8)
        for s, seq in self.seqs.items():
            tables[s, : len(seq.table)] = seq.table
            lens[s], ten[s], status[s] = len(seq.tokens), seq.tenant, SEQ_RUNNING
        token_ids = np.full((n, p), INVALID, np.int32)
        for b in range(n):
            if self.held(b):
                token_ids[b, : self.fill[b]] = self.tokens[b]
        return dict(
            block_tables=tables, seq_lens=lens, positions=lens, seq_tenant=ten, seq_status=status,
            ref_count=np.array(self.ref, np.int32), pin_count=np.array(self.pin, np.int32),
            payer=np.array(self.payer, np.int32), payer_refs=np.array(self.prefs, np.int32),
            fill=np.array(self.fill, np.int32), hashed=np.array(self.hashed),
            block_hash=np.array(self.hash, np.uint32).reshape(n, 2),
            block_salt=np.array(self.salt, np.uint32), parent=np.array(self.parent, np.int32),
            parent_gen=np.array(self.pgen, np.int32), generation=np.array(self.gen, np.int32),
            token_ids=token_ids,
            free_stack=np.array(self.stack, np.int32),
            registered=np.array(self.registered), token_quota=np.array(self.tq, np.int32),
            byte_quota=np.array(self.bq, np.int32), salt=np.array(self.tsalt, np.uint32),
            lease_expiry=np.array(self.lease, np.int32),
            used_tokens=np.array([self.used(t) for t in range(self.T)], np.int32),
            charged0=np.array([self.charged(t) for t in range(self.T)], np.int32),
            pinned0=np.array([self.pinned(t) for t in range(self.T)], np.int32),
        )

    def compare(self, st) -> list[str]:
        """Every field where the host state `st` (jax.device_get of a KVState) differs."""
        want = self.expected_arrays()
        n = self.N
        got = dict(
            block_tables=st.seqs.block_tables, seq_lens=st.seqs.seq_lens,
            positions=st.seqs.positions, seq_tenant=st.seqs.seq_tenant,
            seq_status=st.seqs.seq_status,
            **{f: getattr(st.blocks, f)[:n] for f in (
                "ref_count", "pin_count", "payer", "payer_refs", "fill", "hashed", "block_hash",
                "block_salt", "parent", "parent_gen", "generation")},
            token_ids=np.where(np.asarray(want["ref_count"] + want["pin_count"] > 0)[:, None],
                               st.blocks.token_ids[:n], INVALID),
            free_stack=st.free.free_list[: int(st.free.free_count[0])],
            **{f: getattr(st.tenants, f) for f in (
                "registered", "token_quota", "byte_quota", "salt", "lease_expiry", "used_tokens")},
            charged0=st.tenants.charged_blocks[:, 0], pinned0=st.tenants.pinned_blocks[:, 0],
        )
        problems = []
        for name, w in want.items():
            g = np.asarray(got[name])
            if g.shape != w.shape or g.dtype != w.dtype or not np.array_equal(g, w):
                problems.append(f"{name}: state {g.tolist()} != model {w.tolist()}")
        # Only pool 0 is ever allocated from: every other pool stays whole and uncharged.
        rest = slice(n, None)
        if (np.asarray(st.blocks.ref_count[rest]) != 0).any() or (
                np.asarray(st.blocks.generation[rest]) != 0).any():
            problems.append("a block outside pool 0 was touched")
        if list(np.asarray(st.free.free_count[1:])) != list(self.config.pool_sizes[1:]):
            problems.append(f"free_count of pools 1.. changed: {np.asarray(st.free.free_count)}")
        if (np.asarray(st.tenants.charged_blocks[:, 1:]) != 0).any():
            problems.append("charges outside pool 0")
        return problems
