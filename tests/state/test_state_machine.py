"""Stateful property test: random programs of every operation (plain and donated) over the LIVE
sequences of the tiny pool, each report compared exactly with a plain-Python model of the state
(`tests/state/oracle.py`), and check_invariants, the ledger view and the whole state compared
with the model after every step.

Tenants are registered up front with quotas sized to bind sometimes (a few tokens to a few
blocks, byte quotas off the unit grid so the rounding down to whole units matters), usually in
one share group; prompts start from a few system prompts (block-aligned ones among them, sent
again as whole prompts) so prefix hits, shared blocks and heir transfers happen. Invalid calls
are a minority of steps: they must raise the documented error and leave the state equal leaf by
leaf (also with donate=True: validation runs before the donating call).

Each run counts what it explored (admits, appended tokens, prefix hits, forks, pins, heir
transfers, refusals by reason, ...), prints the counts and asserts floors, so a change that made
the machine stop reaching some behaviour fails instead of passing quietly. Runs are derandomized
(fixed seed, no example database): CI sees the same programs every time.
"""

import collections
import copy
import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvquota import codes
from kvquota import errors as E
from kvquota.core import release
from kvquota.allocator import Allocator
from kvquota.invariants import recompute
from kvquota.sentinel import INVALID
from tests.state.common import ADMIT_T, BLOCK, TINY, leaves_equal, prompts, seq_tokens, snapshot
from tests.state.oracle import Model

# Prompts start from shared system prompts (2 and 4 tokens are whole blocks of 2) so the prefix
# cache gets hits, duplicates and block-aligned repeats; tails reuse the same few token ids.
SYSTEMS = ([1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [5, 6, 5, 6], [3, 4], [])
prompt_st = st.builds(
    lambda pre, tail: (pre + tail)[:ADMIT_T] or [1],
    st.sampled_from(SYSTEMS),
    st.lists(st.integers(1, 6), min_size=0, max_size=2),
)
token_st = st.integers(1, 6)

STATS = collections.Counter()  # what the current run explored, summed over its examples


def _ints(x):
    return np.asarray(x).tolist()


class KVMachine(RuleBasedStateMachine):
    config = TINY

    def __init__(self):
        super().__init__()
        self.alloc = Allocator(self.config)
        self.state = self.alloc.init()
        self.model = Model(self.config)
        self.c = self.config
        self.history = []  # (tenant, tokens) of sequences freed so far
        STATS["examples"] += 1

    # ---- helpers -------------------------------------------------------------------------
    def _host(self):
        return jax.device_get(self.state)

    def _expect_error(self, error, call):
        before = snapshot(self.state)
        with pytest.raises(error):
            call()
        assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.state))
        assert leaves_equal(before, self.state)
        STATS["invalid calls"] += 1

    def _live(self, data, exclude=()):
        return data.draw(st.sampled_from([s for s in self.model.live() if s not in exclude]))

    def _room(self):
        """Live sequences with room in their block table."""
        return [s for s in self.model.live()
                if len(self.model.seqs[s].tokens) < self.c.max_tokens_per_seq]

    def _blocks(self, seq):
        return -(-len(self.model.seqs[seq].tokens) // self.c.block_size)

    def _remember(self, seqs):
        self.history += [(self.model.seqs[q].tenant, tuple(self.model.seqs[q].tokens))
                         for q in seqs if q != INVALID]
        self.history = sorted(set(self.history))[-12:]

    def _check_free_report(self, rep, want):
        assert int(rep.seqs_freed) == want["seqs_freed"]
        assert _ints(rep.tokens_released) == want["tokens_released"]
        rest = [0] * (self.c.num_pools - 1)  # only pool 0 is allocated from
        assert _ints(rep.blocks_returned) == [want["blocks_returned"]] + rest
        assert rep.pool_bytes_returned == want["blocks_returned"] * BLOCK
        assert _ints(rep.quota_units_released) == want["quota_units_released"]
        assert int(rep.transferred_blocks) == want["transferred_blocks"]
        assert _ints(rep.inherited_units) == want["inherited_units"]
        assert _ints(rep.heir_over_quota) == want["heir_over_quota"]
        assert int(rep.unpinned_blocks) == want["unpinned_blocks"]
        if want["duplicates"]:  # push order of repeated ids is XLA's choice: adopt it
            self.model.sync_free_order(self._host())
        STATS["blocks returned"] += want["blocks_returned"]
        STATS["heir transfers"] += want["transferred_blocks"]
        STATS["heir over quota"] += sum(want["heir_over_quota"])
        for t, units in enumerate(want["inherited_units"]):
            if units and self.model.charged(t) * self.model.unit0 == self.model.bq[t]:
                STATS["heir exactly at quota"] += 1

    # ---- tenants -------------------------------------------------------------------------
    @initialize(quotas=st.lists(st.tuples(st.integers(6, 40), st.sampled_from([3, 4, 6, 8, 12, 16]),
                                          st.sampled_from([0, 16, 31, 32])),
                                min_size=TINY.num_tenants, max_size=TINY.num_tenants),
                shared=st.sampled_from([True, True, True, False]), donate=st.booleans())
    def tenants(self, quotas, shared, donate):
        """Every tenant registered up front; byte quotas of whole blocks plus 0..1 unit
        (rounded down to whole units: a block needs all of its units)."""
        STATS["examples sharing a group"] += shared
        for t, (tq, blocks, extra) in enumerate(quotas):
            bq = blocks * BLOCK + extra
            self.state, rep = self.alloc.register_tenant(
                self.state, t, token_quota=tq, byte_quota=bq, share_group=5 if shared else None,
                donate=donate)
            self.model.register(t, tq, bq, 5 if shared else None)
            assert int(rep.tokens_over) == 0 and int(rep.units_over) == 0

    @rule(t=st.integers(0, TINY.num_tenants - 1), tq=st.integers(-2, 16),
          blocks=st.integers(0, 10), extra=st.sampled_from([0, 31, 32]),
          near=st.sampled_from([None, None, 0, 1, 2]),
          lease=st.one_of(st.none(), st.none(), st.none(), st.integers(0, 50)),
          donate=st.booleans())
    def set_quota(self, t, tq, blocks, extra, near, lease, donate):
        """Raise or cut the quotas (the token quota to the tenant's use plus -2..16 tokens: a
        cut below use is allowed, then admits and appends are refused); `near` sets the byte
        quota to the tenant's current charge plus 0..2 blocks. Or move the lease."""
        if lease is not None:
            self.state, _ = self.alloc.set_lease(self.state, t, lease, donate=donate)
            self.model.lease[t] = lease
            want = [u for u in range(self.c.num_tenants) if self.model.lease[u] <= lease]
            assert _ints(self.alloc.expired_tenants(self.state, lease)) == want
            return
        tq = max(self.model.used(t) + tq, 0)
        if near is not None:
            blocks = self.model.charged(t) + near
        bq = blocks * BLOCK + extra
        self.state, rep = self.alloc.set_quota(self.state, t, token_quota=tq, byte_quota=bq,
                                               donate=donate)
        want = self.model.set_quota(t, tq, bq)
        assert (int(rep.tokens_over), int(rep.units_over)) == want
        assert rep.bytes_over == want[1] * self.c.unit_bytes
        STATS["quota changes"] += 1

    # ---- sequences -----------------------------------------------------------------------
    def _row(self, data):
        """(tenant or INVALID, prompt): a fresh prompt from the system prompts, or half the time
        the full blocks of a live or earlier sequence's tokens (mostly under the other tenant)
        and a tail of 1-2 tokens: prefix hits, blocks shared across the group, heir transfers,
        and prompts re-sent after their blocks were freed and reused."""
        t = data.draw(st.sampled_from(list(range(self.c.num_tenants)) * 2 + [INVALID]))
        sources = [(q.tenant, tuple(q.tokens)) for q in self.model.seqs.values()] + self.history
        if not sources or data.draw(st.booleans()):
            return t, data.draw(prompt_st)
        owner, toks = data.draw(st.sampled_from(sorted(set(sources))))
        if t != INVALID and data.draw(st.booleans()):
            t = (owner + 1) % self.c.num_tenants
        p = self.c.block_size
        k = data.draw(st.integers(min(1, len(toks) // p), len(toks) // p))
        tail = data.draw(st.lists(token_st, min_size=0, max_size=2))  # empty: block-aligned
        return t, (list(toks[: k * p]) + tail)[:ADMIT_T] or [1]

    @rule(data=st.data(), n=st.integers(1, 2), donate=st.booleans())
    def admit(self, data, n, donate):
        self._admit([self._row(data) for _ in range(n)], donate)

    @rule(data=st.data(), n=st.integers(1, 2), donate=st.booleans())
    def admit_again(self, data, n, donate):  # a second rule: admits are frequent
        self._admit([self._row(data) for _ in range(n)], donate)

    def _admit(self, rows, donate):
        self.state, rep = self.alloc.admit(self.state, *prompts(rows), donate=donate)
        p = self.c.block_size
        capped = [t != INVALID and len(ids) % p == 0 and len(
            self.model.lookup(self.model.tsalt[t], ids + [1])) == len(ids) // p
            for t, ids in rows]  # every block cached: only the cap keeps the last one computed
        payer, stale = list(self.model.payer), self.model.stale_parents
        want = self.model.admit(rows)
        STATS["stale parents rejected"] += self.model.stale_parents - stale
        for (t, _), w in zip(rows, want):
            if w["admitted"]:
                table = self.model.seqs[w["seq_id"]].table[: w["hit_blocks"]]
                STATS["hit blocks paid by another tenant"] += sum(payer[b] != t for b in table)
        for field in ("admitted", "reason", "seq_id", "cached_tokens", "hit_blocks", "new_blocks"):
            assert _ints(getattr(rep, field))[: len(rows)] == [w[field] for w in want], field
        for (t, ids), w in zip(rows, want):
            STATS[f"admit: {codes.REASONS[w['reason']]}"] += 1
            if w["admitted"]:
                STATS["admits"] += 1
                STATS["prefix hits"] += w["hit_blocks"] > 0
                STATS["hit blocks"] += w["hit_blocks"]
        for c, w in zip(capped, want):
            STATS["aligned prompt wholly cached, last block computed"] += c and w["admitted"]

    @precondition(lambda self: self._room())
    @rule(data=st.data(), toks=st.lists(token_st, min_size=2, max_size=2), donate=st.booleans())
    def append(self, data, toks, donate):
        self._append(data, toks, donate)

    @precondition(lambda self: self._room())
    @rule(data=st.data(), toks=st.lists(token_st, min_size=2, max_size=2), donate=st.booleans())
    def append_again(self, data, toks, donate):
        self._append(data, toks, donate)

    def _append(self, data, toks, donate):
        room = self._room()
        a = data.draw(st.sampled_from(room))
        b = data.draw(st.sampled_from([INVALID] + [s for s in room if s != a]))
        seqs = [a, b] if data.draw(st.booleans()) else [b, a]
        self.state, rep = self.alloc.append(self.state, seqs, toks, donate=donate)
        want = self.model.append(seqs, toks)
        for field in ("appended", "reason", "block", "offset", "new_block"):
            assert _ints(getattr(rep, field)) == [w[field] for w in want], field
        for s, w in zip(seqs, want):
            if s != INVALID:
                STATS[f"append: {codes.REASONS[w['reason']]}"] += 1
                STATS["appended tokens"] += w["appended"]

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), donate=st.booleans())
    def fork(self, data, donate):
        seq = self._live(data)
        self.state, rep = self.alloc.fork(self.state, [seq], donate=donate)
        want = self.model.fork([seq])
        for field in ("forked", "reason", "seq_id", "copied_from", "copied_to"):
            assert _ints(getattr(rep, field)) == [w[field] for w in want], field
        STATS[f"fork: {codes.REASONS[want[0]['reason']]}"] += 1
        STATS["forks"] += want[0]["forked"]

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), prefix=st.booleans())
    def pin(self, data, prefix, donate=False):
        """Pin a live sequence's first n blocks, or any one held block (a pinned block may
        outlive every reference)."""
        if prefix:
            seq = self._live(data)
            n = data.draw(st.integers(1, min(2, self._blocks(seq))))
            blocks = self.model.seqs[seq].table[:n]
            self.state, rep = self.alloc.pin_prefix(self.state, seq, n, donate=donate)
            assert _ints(rep.pin_count) == self.model.pin_blocks(blocks)
            STATS["pins"] += n
            return
        block = data.draw(st.sampled_from([b for b in range(self.model.N) if self.model.held(b)]))
        self.state, rep = self.alloc.pin_blocks(self.state, [block, INVALID], donate=donate)
        assert _ints(rep.pin_count) == self.model.pin_blocks([block, INVALID])
        STATS["pins"] += 1

    @precondition(lambda self: any(len(q.table) >= 2 for q in self.model.seqs.values()))
    @rule(data=st.data())
    def pin_child_free_parent(self, data):
        """Pin one block past the first of a live sequence, alone, then free the sequence: the
        pinned block outlives its parent, whose id is reused later (a stale parent that prefix
        lookups must reject by its generation)."""
        m = self.model
        seq = data.draw(st.sampled_from([s for s in m.live() if len(m.seqs[s].table) >= 2]))
        block = data.draw(st.sampled_from(m.seqs[seq].table[1:]))
        self.state, rep = self.alloc.pin_blocks(self.state, [block, INVALID])
        assert _ints(rep.pin_count) == m.pin_blocks([block, INVALID])
        self.state, rep = self.alloc.free(self.state, [seq])
        self._remember([seq])
        self._check_free_report(rep, m.free([seq]))
        STATS["pins"] += 1
        STATS["frees"] += 1

    @precondition(lambda self: any(p > 0 for p in self.model.pin))
    @rule(data=st.data(), prefix=st.booleans())
    def unpin_again(self, data, prefix):
        self.unpin(data, prefix)

    @precondition(lambda self: any(p > 0 for p in self.model.pin))
    @rule(data=st.data(), prefix=st.booleans())
    def unpin(self, data, prefix, donate=False):
        """Drop one pin of a pinned block, or of a live sequence's first 2 blocks."""
        m = self.model
        two = [s for s in m.live() if len(m.seqs[s].table) >= 2
               and all(m.pin[b] > 0 for b in m.seqs[s].table[:2])]
        if prefix and two:
            seq = data.draw(st.sampled_from(two))
            blocks = m.seqs[seq].table[:2]
            call = lambda: self.alloc.unpin_prefix(self.state, seq, 2, donate=donate)  # noqa: E731
        else:
            blocks = [INVALID, data.draw(st.sampled_from(
                [b for b, p in enumerate(self.model.pin) if p > 0]))]
            call = lambda: self.alloc.unpin_blocks(self.state, blocks, donate=donate)  # noqa: E731
        self.state, rep = call()
        self._check_free_report(rep, self.model.unpin_blocks(blocks))
        STATS["unpins"] += 1

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), two=st.booleans())
    def free(self, data, two):
        self._free(data, two, False)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), two=st.booleans())
    def free_again(self, data, two):
        self._free(data, two, False)

    def _payers(self):
        """Live sequences whose free orphans a block: one their tenant pays for, references
        only through them, has not pinned, and another sequence still references (so its
        charge passes to an heir)."""
        m = self.model
        return [s for s in m.live() if any(
            m.payer[b] == m.seqs[s].tenant and m.prefs[b] == 1 and m.pin[b] == 0 and m.ref[b] > 1
            for b in m.seqs[s].table)]

    margin_st = st.sampled_from([0, -1, 1, None])

    @precondition(lambda self: self._payers())
    @rule(data=st.data(), margin=margin_st, extra=st.sampled_from([0, 31]))
    def free_payer(self, data, margin, extra):
        self._free_payer(data.draw(st.sampled_from(self._payers())), margin, extra)

    def _shareable(self):
        """Live sequences with a full block and another tenant in their share group."""
        m = self.model
        return [s for s in m.live() if len(m.seqs[s].tokens) >= self.c.block_size and any(
            u != m.seqs[s].tenant and m.tsalt[u] == m.tsalt[m.seqs[s].tenant]
            for u in range(self.c.num_tenants))]

    @precondition(lambda self: self._shareable())
    @rule(data=st.data(), tail=st.lists(token_st, min_size=1, max_size=2), margin=margin_st,
          extra=st.sampled_from([0, 31]))
    def share_and_leave(self, data, tail, margin, extra):
        """Another tenant of the group admits a prompt starting with a live sequence's full
        blocks, then the sequence's owner frees it: its blocks' charges pass to that heir."""
        m = self.model
        seq = data.draw(st.sampled_from(self._shareable()))
        owner = m.seqs[seq].tenant
        other = data.draw(st.sampled_from([u for u in range(self.c.num_tenants)
                                           if u != owner and m.tsalt[u] == m.tsalt[owner]]))
        full = len(m.seqs[seq].tokens) // self.c.block_size * self.c.block_size
        self._admit([(other, (m.seqs[seq].tokens[:full] + tail)[:ADMIT_T])], False)
        if seq in self._payers():
            self._free_payer(seq, margin, extra)

    def _free_payer(self, seq, margin, extra):
        """Free a sequence whose blocks others share. With `margin`, first set each heir's byte
        quota to what it will be charged afterwards plus `margin` blocks (plus under one unit
        of bytes, rounded away): an heir exactly at its quota is not over it; one unit more is."""
        if margin is not None:
            sim = copy.deepcopy(self.model)
            heirs = [t for t, u in enumerate(sim.free([seq])["inherited_units"]) if u]
            for t in heirs:
                bq = max(sim.charged(t) + margin, 0) * BLOCK + extra
                self.state, _ = self.alloc.set_quota(self.state, t, byte_quota=bq)
                self.model.set_quota(t, byte_quota=bq)
        self._check_orphans([seq])
        self.state, rep = self.alloc.free(self.state, [seq])
        self._remember([seq])
        self._check_free_report(rep, self.model.free([seq]))
        STATS["frees"] += 1

    def _check_orphans(self, seqs):
        """The free's pre-check (`release.leaves_orphans`: are heir entries needed?) against the
        oracle: some block of the freed tables stays referenced and unpinned while its payer
        holds no reference of its own. A wrong False would lose an heir's charge."""
        m, drops, own = self.model, collections.Counter(), collections.Counter()
        for q in seqs:
            for b in m.seqs[q].table:
                drops[b] += 1
                own[b] += m.payer[b] == m.seqs[q].tenant
        want = any(m.ref[b] - drops[b] > 0 and m.pin[b] == 0 and m.prefs[b] - own[b] == 0
                   for b in drops)
        rows = np.asarray(seqs + [INVALID] * (4 - len(seqs)), np.int32)
        assert bool(release.leaves_orphans(self.c, self.state, rows)) == want
        STATS["orphaning frees"] += want

    def _free(self, data, two, donate):
        """Free one or two live sequences."""
        seqs = [self._live(data)]
        if two and len(self.model.seqs) > 1:
            seqs.append(self._live(data, exclude=seqs))
        self._check_orphans(seqs)
        self.state, rep = self.alloc.free(self.state, seqs, donate=donate)
        self._remember(seqs)
        self._check_free_report(rep, self.model.free(seqs))
        STATS["frees"] += len(seqs)

    @precondition(lambda self: self.model.seqs or any(p > 0 for p in self.model.pin))
    @rule(t=st.integers(0, TINY.num_tenants - 1), unpin=st.sampled_from([True, True, True, False]))
    def release(self, t, unpin, donate=False):
        """Release a whole tenant, keeping or dropping its pins."""
        self.state, rep = self.alloc.release_tenant(self.state, t, unpin=unpin, donate=donate)
        self._remember([q for q in self.model.live() if self.model.seqs[q].tenant == t])
        self._check_free_report(rep, self.model.release(t, unpin))
        STATS["releases"] += 1

    # ---- invalid calls -------------------------------------------------------------------
    @rule(kind=st.integers(0, 11), data=st.data(), donate=st.booleans())
    def invalid(self, kind, data, donate):
        a, s, m, c = self.alloc, self.state, self.model, self.c
        free_slot = data.draw(st.sampled_from(m.free_slots() + [c.max_seqs]))
        free_block = [b for b in range(m.N) if not m.held(b)]
        unpinned = [b for b in range(m.N) if m.pin[b] == 0]
        if kind == 0:
            self._expect_error(E.UnknownSequenceError,
                               lambda: a.append(s, [free_slot, INVALID], [1, 1], donate=donate))
        elif kind == 1 and m.seqs:
            seq = self._live(data)
            self._expect_error(E.DuplicateIdError,
                               lambda: a.append(s, [seq, seq], [1, 1], donate=donate))
        elif kind == 2:
            self._expect_error(E.DoubleFreeError, lambda: a.free(s, [free_slot], donate=donate))
        elif kind == 3:
            self._expect_error(E.UnknownSequenceError,
                               lambda: a.fork(s, [free_slot], donate=donate))
        elif kind == 4 and free_block:
            b = data.draw(st.sampled_from(free_block))
            self._expect_error(E.BlockStateError,
                               lambda: a.pin_blocks(s, [b, INVALID], donate=donate))
        elif kind == 5 and unpinned:
            b = data.draw(st.sampled_from(unpinned))
            self._expect_error(E.BlockStateError,
                               lambda: a.unpin_blocks(s, [INVALID, b], donate=donate))
        elif kind == 6:
            t = data.draw(st.integers(0, c.num_tenants - 1))
            self._expect_error(E.TenantExistsError, lambda: a.register_tenant(
                s, t, token_quota=1, byte_quota=1, donate=donate))
        elif kind == 7:
            t = data.draw(st.sampled_from([-1, c.num_tenants]))
            self._expect_error(E.UnknownTenantError, lambda: a.release_tenant(s, t, donate=donate))
        elif kind == 8 and m.seqs:
            seq = self._live(data)
            self._expect_error(E.BlockStateError,
                               lambda: a.pin_prefix(s, seq, self._blocks(seq) + 1, donate=donate))
        elif kind == 9:
            self._expect_error(E.UnknownTenantError, lambda: a.admit(
                s, *prompts([(c.num_tenants, [1, 2])]), donate=donate))
        elif kind == 11:
            full = [q for q in m.live() if len(m.seqs[q].tokens) >= c.max_tokens_per_seq]
            if full:
                seq = data.draw(st.sampled_from(full))
                self._expect_error(E.SequenceTooLongError,
                                   lambda: a.append(s, [INVALID, seq], [1, 1], donate=donate))
        elif kind == 10:
            unpinned_two = [q for q in m.live() if len(m.seqs[q].table) >= 2
                            and any(m.pin[b] == 0 for b in m.seqs[q].table[:2])]
            if unpinned_two:
                seq = data.draw(st.sampled_from(unpinned_two))
                self._expect_error(E.BlockStateError,
                                   lambda: a.unpin_prefix(s, seq, 2, donate=donate))

    # ---- after every step ----------------------------------------------------------------
    @invariant()
    def consistent(self):
        self.alloc.check(self.state)
        host = self._host()
        problems = self.model.compare(host)
        assert not problems, "\n".join(problems)
        for s, seq in self.model.seqs.items():  # each table spells exactly its own tokens
            assert seq_tokens(host, s, self.c.block_size) == seq.tokens
        led = self.alloc.ledger(self.state)
        want = recompute(self.c, host)
        assert _ints(led.shared_blocks) == want["shared"].tolist()
        assert _ints(led.reclaimable_blocks) == want["reclaimable"].tolist()
        assert _ints(led.fragmentation) == want["fragmentation"].tolist()
        assert int(led.pool_fragmentation) == want["pool_fragmentation"]
        STATS["steps"] += 1
        STATS["steps with an orphan-able sequence"] += bool(self._payers())


_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
FAST = settings(max_examples=100, stateful_step_count=30, deadline=None, derandomize=True,
                database=None, suppress_health_check=_HEALTH)
SLOW = settings(max_examples=2000, stateful_step_count=60, deadline=None, derandomize=True,
                database=None, suppress_health_check=_HEALTH)

# What the default run must reach. Its derandomized counts are printed; over 14 runs with random
# seeds the smallest were: admits 318, appended tokens 68, prefix hits 47, forks 40, pins 115,
# unpins 26, heir transfers 21 (over quota 1, exactly at it 3), blocks returned 285, refusals
# 5-86 per reason. The floors sit near half of those minima, so only a change that made the
# machine stop reaching something trips them (any edit of this file reshuffles the programs).
FLOORS = {
    "admits": 150, "appended tokens": 30, "prefix hits": 20, "forks": 20, "pins": 50,
    "unpins": 10, "heir transfers": 8, "heir over quota": 1, "heir exactly at quota": 1,
    "blocks returned": 140, "admit: over token quota": 20, "admit: over byte quota": 40,
    "admit: pool full": 2, "fork: no sequence slot": 30, "append: over byte quota": 5,
    "aligned prompt wholly cached, last block computed": 10, "invalid calls": 80,
}


def _run(machine, how, capsys):
    STATS.clear()
    run_state_machine_as_test(machine, settings=how)
    stats = dict(sorted(STATS.items()))
    with capsys.disabled():
        counts = ", ".join(f"{k}={v}" for k, v in stats.items())
        print(f"\n{machine.__name__} exploration: {counts}")
    return stats


def test_state_machine(capsys):
    stats = _run(KVMachine, FAST, capsys)
    low = {k: (stats.get(k, 0), floor) for k, floor in FLOORS.items() if stats.get(k, 0) < floor}
    assert not low, f"the machine stopped exploring: (count, floor) {low}"


# Forced hash collisions (every full block's hash is 0, every hashed block of a salt is a
# candidate): only the token, salt and parent/generation checks separate contexts, and a stale
# parent (freed, reused) is a live candidate.
COLLIDE = dataclasses.replace(TINY, hash_bits=0, lookup_candidates=8)


class CollidingKVMachine(KVMachine):
    config = COLLIDE


@pytest.mark.slow
@pytest.mark.parametrize("machine", [KVMachine, CollidingKVMachine])
def test_state_machine_long(machine, capsys):
    stats = _run(machine, SLOW, capsys)
    low = {k: (stats.get(k, 0), 10 * f) for k, f in FLOORS.items() if stats.get(k, 0) < 10 * f}
    assert not low, f"the machine stopped exploring: (count, floor) {low}"
