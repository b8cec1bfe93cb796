"""Stateful property test of the reclaim means: random programs of admit, append, free, offload,
restore, compress (every compressed pool, both orders) and evict (every registered policy, both
modes) over the live sequences of the tiny pool, with `check_invariants` (the per-pool ledger
recomputed from the tables, exactly) after every step, and the properties no oracle is needed
for: a lossless move keeps every token of the sequence, a lossy one keeps exactly what its report
says, bytes returned equal the free-list change. Exploration is counted and floored, as in
test_state_machine.py, so the machine cannot quietly stop reaching an operation."""

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from hypothesis.stateful import run_state_machine_as_test

from kvquota import codes
from kvquota import errors as E
from kvquota.allocator import Allocator
from kvquota.policies import REGISTRY
from kvquota.sentinel import PER_HEAD_TOKEN
from tests.state.common import BLOCK, TINY, prompts, seq_tokens

STATS = collections.Counter()
FORMATS = [name for name, _ in TINY.compressed_pools]


class TierMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = Allocator(TINY)
        s = self.alloc.init()
        for t in range(TINY.num_tenants):
            s, _ = self.alloc.register_tenant(s, t, token_quota=64, byte_quota=8 * BLOCK,
                                              share_group=0 if t < 2 else None)
        self.s = s

    def _seqs(self, status):
        st_ = np.asarray(self.s.seqs.seq_status)
        return [int(i) for i in np.flatnonzero(st_ == status)]

    def _tokens(self, seq):
        return seq_tokens(self.s, seq, TINY.block_size)

    def _free0(self):
        return int(np.asarray(self.s.free.free_count)[0])

    @rule(t=st.integers(0, TINY.num_tenants - 1),
          toks=st.lists(st.integers(1, 5), min_size=1, max_size=TINY.max_tokens_per_seq))
    def admit(self, t, toks):
        self.s, r = self.alloc.admit(self.s, *prompts([(t, toks)]))
        STATS["admits"] += int(r.admitted[0])

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), tok=st.integers(1, 5))
    def append(self, data, tok):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        if int(self.s.seqs.seq_lens[seq]) < TINY.max_tokens_per_seq:
            self.s, r = self.alloc.append(self.s, [seq], [tok])
            STATS["appends"] += int(r.appended[0])

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING) + self._seqs(codes.SEQ_SUSPENDED))
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)
                                        + self._seqs(codes.SEQ_SUSPENDED)))
        self.s, _ = self.alloc.free(self.s, [seq])
        STATS["frees"] += 1

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), donate=st.booleans())
    def offload(self, data, donate):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        before = self._tokens(seq)
        try:
            self.s, rep = self.alloc.offload(self.s, [seq], donate=donate)
        except E.PoolFullError:
            STATS["offload refused"] += 1
            return
        assert self._tokens(seq) == before
        STATS["offloads"] += 1
        STATS["blocks offloaded"] += rep.blocks_moved

    @precondition(lambda self: self._seqs(codes.SEQ_SUSPENDED))
    @rule(data=st.data(), donate=st.booleans())
    def restore(self, data, donate):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_SUSPENDED)))
        before = self._tokens(seq)
        try:
            self.s, rep = self.alloc.restore(self.s, [seq], donate=donate)
        except (E.PoolFullError, E.QuotaExceededError):
            STATS["restore refused"] += 1
            return
        assert self._tokens(seq) == before
        STATS["restores"] += 1

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), fmt=st.sampled_from(FORMATS), keep=st.integers(0, 4),
          policy=st.sampled_from(["oldest", "coldest"]), donate=st.booleans())
    def compress(self, data, fmt, keep, policy, donate):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        before, free0 = self._tokens(seq), self._free0()
        try:
            self.s, rep = self.alloc.compress(self.s, [seq], kv_format=fmt, keep_recent=keep,
                                              policy=policy, donate=donate)
        except E.PoolFullError:
            STATS["compress refused"] += 1
            return
        assert self._tokens(seq) == before  # lossy in values, never in tokens
        assert rep.pool0_bytes_freed == (self._free0() - free0) * TINY.pool_bytes[0]
        STATS["blocks compressed"] += rep.blocks_compressed

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), policy=st.sampled_from(sorted(REGISTRY)), keep=st.integers(1, 6),
          mode=st.sampled_from(["token", "block"]), donate=st.booleans())
    def evict(self, data, policy, keep, mode, donate):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        before, n = self._tokens(seq), int(self.s.seqs.seq_lens[seq])
        pos = int(self.s.seqs.positions[seq])
        heads = (TINY.model.num_layers, TINY.model.num_kv_heads) if mode == "token" else ()
        attention = np.random.default_rng(keep).random(  # per head in token mode (its default)
            (1,) + heads + (TINY.max_tokens_per_seq,)).astype(np.float32)
        try:
            self.s, rep = self.alloc.evict(self.s, [seq], policy=policy, keep_tokens=keep,
                                           mode=mode, attention=attention, donate=donate)
        except (E.TierError, E.PoolFullError):
            STATS["evict refused"] += 1
            return
        after = self._tokens(seq)
        assert len(after) == n - int(rep.evicted_tokens[0])
        it = iter(before)  # the survivors are a subsequence of the old tokens, in order
        assert all(tok in it for tok in after if tok != PER_HEAD_TOKEN)  # heads that differ
        assert PER_HEAD_TOKEN not in after or mode == "token"
        assert int(self.s.seqs.positions[seq]) == pos
        STATS[f"evicted ({mode})"] += int(rep.evicted_tokens[0])

    @invariant()
    def consistent(self):
        self.alloc.check(self.s)


_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
FAST = settings(max_examples=30, stateful_step_count=25, deadline=None, derandomize=True,
                database=None, suppress_health_check=_HEALTH)
SLOW = settings(max_examples=400, stateful_step_count=50, deadline=None, derandomize=True,
                database=None, suppress_health_check=_HEALTH)
FLOORS = {"admits": 40, "offloads": 5, "restores": 3, "blocks compressed": 5,
          "evicted (token)": 5, "evicted (block)": 5}


def _run(how, capsys):
    STATS.clear()
    run_state_machine_as_test(TierMachine, settings=how)
    with capsys.disabled():
        print("\ntier machine exploration: " + ", ".join(f"{k}={v}" for k, v in
                                                         sorted(STATS.items())))
    return dict(STATS)


def test_tier_state_machine(capsys):
    stats = _run(FAST, capsys)
    low = {k: (stats.get(k, 0), f) for k, f in FLOORS.items() if stats.get(k, 0) < f}
    assert not low, f"the machine stopped exploring: (count, floor) {low}"


@pytest.mark.slow
def test_tier_state_machine_long(capsys):
    stats = _run(SLOW, capsys)
    low = {k: (stats.get(k, 0), 10 * f) for k, f in FLOORS.items() if stats.get(k, 0) < 10 * f}
    assert not low, f"the machine stopped exploring: (count, floor) {low}"
