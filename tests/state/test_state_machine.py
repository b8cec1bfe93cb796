"""Stateful property test: random sequences of every operation (plain and donated), valid and
invalid, on the tiny pool, with check_invariants and the ledger view checked after every step.

A Python model tracks only what the caller knows (which slots run, the tokens each sequence was
given); everything else must be recomputable from the state itself. Invalid calls must raise the
documented error and leave the state equal leaf by leaf. One static config and fixed batch shapes
keep the jitted cores to one compile each.
"""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvquota import errors as E
from kvquota.allocator import Allocator
from kvquota.invariants import recompute
from kvquota.sentinel import INVALID
from tests.state.common import ADMIT_T, BLOCK, TINY, leaves_equal, prompts, seq_tokens, snapshot

P, S, MB, T = TINY.block_size, TINY.max_seqs, TINY.max_blocks_per_seq, TINY.num_tenants
ALLOC = Allocator(TINY)

# Prompts start from a few shared prefixes so the prefix cache gets hits and collisions of
# content across tenants and sequences.
PREFIXES = ([], [1, 2], [1, 2, 3, 4], [1, 2, 5, 6], [7, 7, 7, 7])
prompt_st = st.builds(
    lambda pre, tail: (pre + tail)[:ADMIT_T] or [0],
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 3), min_size=0, max_size=ADMIT_T),
)
seq_st = st.one_of(st.integers(0, S - 1), st.just(INVALID), st.integers(S, S + 1))
tenant_st = st.integers(0, T - 1)


class KVStateMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = ALLOC.init()
        self.tokens = {}  # seq -> the token ids the caller gave it (prompt + appends)
        self.tenant_of = {}  # seq -> tenant
        self.registered = set()

    # ---- helpers -------------------------------------------------------------------------
    def _expect_error(self, error, call):
        before = snapshot(self.state)
        with pytest.raises(error):
            call()
        assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.state))
        assert leaves_equal(before, self.state)

    def _free_bytes(self):
        return int((np.asarray(self.state.free.free_count, np.int64) * np.asarray(TINY.pool_bytes)).sum())

    # ---- tenants -------------------------------------------------------------------------
    @rule(t=tenant_st, tq=st.integers(0, 24), bq=st.integers(0, 9),
          group=st.sampled_from([None, None, 5]), donate=st.booleans())
    def register(self, t, tq, bq, group, donate):
        call = lambda: ALLOC.register_tenant(  # noqa: E731
            self.state, t, token_quota=tq, byte_quota=bq * BLOCK, share_group=group, donate=donate)
        if t in self.registered:
            self._expect_error(E.TenantExistsError, call)
            return
        self.state, rep = call()
        self.registered.add(t)
        assert int(rep.tokens_over) == 0 and int(rep.units_over) == 0

    @rule(t=st.integers(-1, T), tq=st.integers(0, 24), bq=st.integers(0, 9), donate=st.booleans())
    def set_quota(self, t, tq, bq, donate):
        call = lambda: ALLOC.set_quota(self.state, t, token_quota=tq, byte_quota=bq * BLOCK,  # noqa: E731
                                       donate=donate)
        if t not in self.registered:
            self._expect_error(E.UnknownTenantError, call)
            return
        used = int(self.state.tenants.used_tokens[t])
        self.state, rep = call()
        assert int(rep.tokens_over) == max(used - tq, 0)

    @rule(t=st.integers(-1, T), lease=st.integers(-1, 50), donate=st.booleans())
    def set_lease(self, t, lease, donate):
        call = lambda: ALLOC.set_lease(self.state, t, lease, donate=donate)  # noqa: E731
        if t not in self.registered:
            self._expect_error(E.UnknownTenantError, call)
            return
        if lease < 0:
            self._expect_error(E.QuotaValueError, call)
            return
        self.state, _ = call()
        assert int(self.state.tenants.lease_expiry[t]) == lease
        assert t in ALLOC.expired_tenants(self.state, lease).tolist()

    # ---- sequences -----------------------------------------------------------------------
    @rule(rows=st.lists(st.tuples(st.one_of(tenant_st, st.just(INVALID)), prompt_st),
                        min_size=1, max_size=2), donate=st.booleans())
    def admit(self, rows, donate):
        args = prompts(rows)
        if any(t != INVALID and t not in self.registered for t, _ in rows):
            self._expect_error(E.UnknownTenantError, lambda: ALLOC.admit(self.state, *args, donate=donate))
            return
        free0 = int(self.state.free.free_count[0])
        self.state, rep = ALLOC.admit(self.state, *args, donate=donate)
        adm, seq, cached, new = (np.asarray(x) for x in (rep.admitted, rep.seq_id, rep.cached_tokens,
                                                          rep.new_blocks))
        assert free0 - int(self.state.free.free_count[0]) == int(new.sum())
        for i, (t, ids) in enumerate(rows):
            if not adm[i]:
                assert seq[i] == INVALID and new[i] == 0
                continue
            assert cached[i] % P == 0 and cached[i] <= len(ids) - 1
            self.tokens[int(seq[i])] = list(ids)
            self.tenant_of[int(seq[i])] = t

    @rule(seqs=st.lists(seq_st, min_size=2, max_size=2), toks=st.lists(st.integers(0, 255), min_size=2,
          max_size=2), donate=st.booleans())
    def append(self, seqs, toks, donate):
        call = lambda: ALLOC.append(self.state, seqs, toks, donate=donate)  # noqa: E731
        real = [s for s in seqs if s != INVALID]
        if any(s not in self.tokens for s in real):
            self._expect_error(E.UnknownSequenceError, call)
            return
        if len(set(real)) != len(real):
            self._expect_error(E.DuplicateIdError, call)
            return
        if any(len(self.tokens[s]) >= MB * P for s in real):
            self._expect_error(E.SequenceTooLongError, call)
            return
        self.state, rep = call()
        ok, blk, off = (np.asarray(x) for x in (rep.appended, rep.block, rep.offset))
        for i, s in enumerate(seqs):
            if ok[i]:
                assert int(self.state.blocks.token_ids[blk[i], off[i]]) == toks[i]
                self.tokens[s].append(toks[i])
            else:
                assert blk[i] == INVALID

    @rule(seq=seq_st, donate=st.booleans())
    def fork(self, seq, donate):
        call = lambda: ALLOC.fork(self.state, [seq], donate=donate)  # noqa: E731
        if seq != INVALID and seq not in self.tokens:
            self._expect_error(E.UnknownSequenceError, call)
            return
        self.state, rep = call()
        if bool(rep.forked[0]):
            child = int(rep.seq_id[0])
            self.tokens[child] = list(self.tokens[seq])
            self.tenant_of[child] = self.tenant_of[seq]

    @rule(seq=seq_st, n=st.integers(0, MB), donate=st.booleans())
    def pin_prefix(self, seq, n, donate):
        call = lambda: ALLOC.pin_prefix(self.state, seq, n, donate=donate)  # noqa: E731
        if seq not in self.tokens:
            self._expect_error(E.UnknownSequenceError, call)
            return
        if not 1 <= n <= -(-len(self.tokens[seq]) // P):
            self._expect_error(E.BlockStateError, call)
            return
        self.state, _ = call()

    @rule(block=st.integers(0, TINY.total_blocks - 1), donate=st.booleans())
    def pin_block(self, block, donate):
        call = lambda: ALLOC.pin_blocks(self.state, [block, INVALID], donate=donate)  # noqa: E731
        held = int(self.state.blocks.ref_count[block]) > 0 or int(self.state.blocks.pin_count[block]) > 0
        if not held:  # pinning a free block is an error
            self._expect_error(E.BlockStateError, call)
            return
        pins = int(self.state.blocks.pin_count[block])
        self.state, rep = call()
        assert int(rep.pin_count[0]) == pins + 1

    @rule(block=st.integers(0, TINY.total_blocks - 1), pick_pinned=st.booleans(), donate=st.booleans())
    def unpin(self, block, pick_pinned, donate):
        pinned = np.flatnonzero(np.asarray(self.state.blocks.pin_count) > 0)
        if pick_pinned and len(pinned):
            block = int(pinned[block % len(pinned)])
        call = lambda: ALLOC.unpin_blocks(self.state, [block, INVALID], donate=donate)  # noqa: E731
        if int(self.state.blocks.pin_count[block]) == 0:
            self._expect_error(E.BlockStateError, call)
            return
        before = self._free_bytes()
        self.state, rep = call()
        assert rep.pool_bytes_returned == self._free_bytes() - before

    @rule(seq=seq_st, donate=st.booleans())
    def free(self, seq, donate):
        call = lambda: ALLOC.free(self.state, [seq], donate=donate)  # noqa: E731
        if seq != INVALID and seq not in self.tokens:
            self._expect_error(E.DoubleFreeError, call)
            return
        before = self._free_bytes()
        self.state, rep = call()
        assert rep.pool_bytes_returned == self._free_bytes() - before
        assert int(rep.seqs_freed) == (seq != INVALID)
        self.tokens.pop(seq, None)
        self.tenant_of.pop(seq, None)

    @rule(t=st.integers(-1, T), unpin=st.booleans(), donate=st.booleans())
    def release(self, t, unpin, donate):
        call = lambda: ALLOC.release_tenant(self.state, t, unpin=unpin, donate=donate)  # noqa: E731
        if t not in self.registered:
            self._expect_error(E.UnknownTenantError, call)
            return
        before = self._free_bytes()
        mine = [s for s, owner in self.tenant_of.items() if owner == t]
        self.state, rep = call()
        assert rep.pool_bytes_returned == self._free_bytes() - before
        assert int(rep.seqs_freed) == len(mine)
        assert int(self.state.tenants.used_tokens[t]) == 0
        if unpin:
            assert int(np.asarray(self.state.tenants.pinned_blocks[t]).sum()) == 0
        for s in mine:
            del self.tokens[s], self.tenant_of[s]

    # ---- after every step ----------------------------------------------------------------
    @invariant()
    def consistent(self):
        ALLOC.check(self.state)
        live = {int(s) for s in np.flatnonzero(np.asarray(self.state.seqs.seq_status) != 0)}
        assert live == set(self.tokens)
        for s, toks in self.tokens.items():  # each table spells exactly its own tokens
            assert seq_tokens(self.state, s, P) == toks
            assert int(self.state.seqs.seq_tenant[s]) == self.tenant_of[s]
        led = ALLOC.ledger(self.state)
        want = recompute(TINY, jax.device_get(self.state))
        assert np.asarray(led.shared_blocks).tolist() == want["shared"].tolist()
        assert np.asarray(led.reclaimable_blocks).tolist() == want["reclaimable"].tolist()
        assert np.asarray(led.fragmentation).tolist() == want["fragmentation"].tolist()
        assert int(led.pool_fragmentation) == want["pool_fragmentation"]


_FAST = settings(max_examples=200, stateful_step_count=30, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_SLOW = settings(max_examples=5000, stateful_step_count=50, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class TestKVStateMachine(KVStateMachine.TestCase):
    settings = _FAST


@pytest.mark.slow
class TestKVStateMachineSlow(KVStateMachine.TestCase):
    settings = _SLOW
