"""The LMCache-style controller verbs (kvquota/controller.py) end to end: lookup against the
admission it predicts, move / clear / pin / compress, and typed errors that leave the state as it
was. check_invariants after every transformation."""

import dataclasses

import numpy as np
import pytest

from kvquota import controller as ctl
from kvquota import errors as E
from kvquota.allocator import Allocator
from kvquota.codes import SEQ_FREE, SEQ_RUNNING, SEQ_SUSPENDED
from kvquota.state import StateConfig
from tests.state.common import TINY_MODEL, leaves_equal, seq_tokens, snapshot

# 16 device blocks of 4 tokens, an int8 pool, a host pool; sequences of <= 4 blocks (16 tokens).
# Tenants 0 and 2 share a salt (group 5), tenant 1 is private, tenant 3 is left unregistered.
CFG = StateConfig(TINY_MODEL, num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=4,
                  num_tenants=4, kv_format="f32", compressed_pools=(("int8", 8),), host_blocks=8,
                  with_pages=False)
P, WIDTH = CFG.block_size, CFG.max_tokens_per_seq
A = list(range(10, 24))  # 14 tokens: 3 full blocks and 2 tokens of a 4th
B = list(range(40, 46))
C = list(range(60, 76))  # 16 tokens: 4 full blocks


def _fresh(config=CFG):
    alloc = Allocator(config)
    s = alloc.init()
    for t, group in ((0, 5), (1, None), (2, 5)):
        s, _ = alloc.register_tenant(s, t, token_quota=10_000, byte_quota=16 * config.pool_bytes[0],
                                     share_group=group)
    return alloc, s


def _admit(alloc, s, tenant, toks):
    """One prompt in the fixed admit shape [1, WIDTH] (one compile): (state, seq id, report)."""
    row = np.zeros((1, WIDTH), np.int32)
    row[0, : len(toks)] = toks
    s, rep = alloc.admit(s, np.array([tenant], np.int32), row, np.array([len(toks)], np.int32))
    assert bool(rep.admitted[0]), rep.reasons()
    return s, int(rep.seq_id[0]), rep


def _cached_by_admit(alloc, s, tenant, toks) -> int:
    """cached_tokens of a fresh admit of `toks` (its new state is dropped)."""
    return int(_admit(alloc, s, tenant, toks)[2].cached_tokens[0])


def _pool(config, block) -> int:
    return int(np.searchsorted(config.pool_starts, block, side="right") - 1)


def _table(s, seq, n):
    return [int(b) for b in np.asarray(s.seqs.block_tables[seq, :n])]


# ---- lookup ----------------------------------------------------------------------------------------
def test_lookup_device_is_the_next_admits_hit():
    alloc, s = _fresh()
    s, _, _ = _admit(alloc, s, 0, A)
    s, _, _ = _admit(alloc, s, 1, B)
    alloc.check(s)
    queries = [(0, A), (0, A[:12]), (0, A[:13]), (0, A[:5]), (0, A[:4]), (0, A[:1]),
               (0, A[:8] + [99, 98, 97]), (0, [1] + A[1:]), (2, A), (1, A), (1, B)]
    got = []
    for t, q in queries:
        before = snapshot(s)
        found = ctl.lookup(alloc, s, np.array(q, np.int32), t)
        assert leaves_equal(s, before)
        assert found["host"] == 0
        assert found["device"] == _cached_by_admit(alloc, s, t, q), (t, q)
        got.append(found["device"])
    # Full blocks only, never the last token's block; tenant 2 shares tenant 0's salt, 1 does not.
    assert got == [12, 8, 12, 4, 0, 0, 8, 0, 12, 0, 4]


def test_lookup_matches_admission_under_hash_collisions():
    """With every hash equal (hash_bits=0) only the first `lookup_candidates` blocks in id order
    are candidates, and the parent chain decides; freed blocks are never hits."""
    cfg = dataclasses.replace(CFG, hash_bits=0, lookup_candidates=2)
    alloc, s = _fresh(cfg)
    rng = np.random.default_rng(0)
    base = [list(rng.integers(0, 2, size=n)) for n in (16, 13, 9, 15)]
    seqs = []
    for i, toks in enumerate(base):
        s, seq, _ = _admit(alloc, s, i % 2, toks)
        seqs.append(seq)
    s, _ = alloc.free(s, np.array([seqs[0], seqs[2]], np.int32))
    alloc.check(s)
    found = []
    for _ in range(24):
        src = base[rng.integers(len(base))]
        n = int(rng.integers(1, 17))
        q = (src + list(rng.integers(0, 2, size=16)))[:n]
        if rng.random() < 0.3:
            q[int(rng.integers(n))] ^= 1
        t = int(rng.integers(3))
        got = ctl.lookup(alloc, s, np.array(q, np.int32), t)["device"]
        assert got == _cached_by_admit(alloc, s, t, q), (t, q)
        found.append(got)
    assert max(found) >= 8 and 0 in found  # the walk both hits and misses


def test_lookup_rejects_a_parent_freed_and_reused():
    """A pinned block outlives its parent; when the parent's id comes back holding the same
    tokens, the old child still names it, and only the generation tells the chains apart."""
    alloc, s = _fresh()
    s, first, _ = _admit(alloc, s, 0, A)
    old = _table(s, first, 4)
    s, _ = alloc.pin_blocks(s, np.array([old[1]], np.int32))
    s, _ = alloc.free(s, np.array([first], np.int32))
    s, _, _ = _admit(alloc, s, 1, B[:5])  # takes the two blocks on top of the free stack
    s, second, _ = _admit(alloc, s, 0, A)
    alloc.check(s)
    new = _table(s, second, 4)
    assert new[0] == old[0] and old[1] < new[1]  # the stale child is the first candidate
    assert ctl.lookup(alloc, s, A, 0)["device"] == 12 == _cached_by_admit(alloc, s, 0, A)


# ---- move ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_pages", [False, True])
def test_move_round_trip_and_lookup(with_pages):
    alloc, s = _fresh(dataclasses.replace(CFG, with_pages=with_pages))
    s, seq, _ = _admit(alloc, s, 0, A)
    s, other, _ = _admit(alloc, s, 0, B)  # not a holder of A: stays where it is
    alloc.check(s)
    assert ctl.lookup(alloc, s, A, 0) == {"device": 12, "host": 0}
    s, act = ctl.move(alloc, s, A[:8], 0, "device", "host")
    alloc.check(s)
    assert act.seq_ids == (seq,) and act.report.blocks_moved == 4
    assert int(s.seqs.seq_status[seq]) == SEQ_SUSPENDED
    assert int(s.seqs.seq_status[other]) == SEQ_RUNNING
    assert {_pool(CFG, b) for b in _table(s, seq, 4)} == {CFG.host_pool}
    assert ctl.lookup(alloc, s, A, 0) == {"device": 0, "host": 14}
    assert ctl.lookup(alloc, s, A[:6], 0) == {"device": 0, "host": 6}
    assert ctl.lookup(alloc, s, A[:5] + [0], 0) == {"device": 0, "host": 4}  # block 1 differs
    assert ctl.lookup(alloc, s, A[:4] + [0] * 4 + A[8:], 0)["host"] == 4  # leading blocks only
    assert ctl.lookup(alloc, s, A, 2)["host"] == 0  # another tenant's suspended sequences
    s, act = ctl.move(alloc, s, A, 0, "host", "device")
    alloc.check(s)
    assert act.seq_ids == (seq,) and act.report.blocks_moved == 4
    assert int(s.seqs.seq_status[seq]) == SEQ_RUNNING
    assert ctl.lookup(alloc, s, A, 0) == {"device": 12, "host": 0}
    assert _cached_by_admit(alloc, s, 0, A) == 12


# ---- clear -----------------------------------------------------------------------------------------
def test_clear_per_location():
    alloc, s = _fresh()
    s, a, _ = _admit(alloc, s, 0, A)
    s, b, _ = _admit(alloc, s, 0, B)
    s, c, _ = _admit(alloc, s, 1, C)
    s, _ = alloc.offload(s, np.array([b], np.int32))
    s, _ = ctl.pin(alloc, s, C[:8], 1)
    alloc.check(s)
    status = lambda: [int(x) for x in np.asarray(s.seqs.seq_status)[[a, b, c]]]

    s, act = ctl.clear(alloc, s, 0, "host")
    alloc.check(s)
    assert act.seq_ids == (b,) and int(act.report.seqs_freed) == 1
    assert status() == [SEQ_RUNNING, SEQ_FREE, SEQ_RUNNING]
    assert int(s.free.free_count[CFG.host_pool]) == CFG.host_blocks

    s, act = ctl.clear(alloc, s, 0, "device")
    alloc.check(s)
    assert act.seq_ids == (a,) and status() == [SEQ_FREE, SEQ_FREE, SEQ_RUNNING]
    before = snapshot(s)
    s, act = ctl.clear(alloc, s, 0, "device")  # nothing left there
    alloc.check(s)
    assert act.seq_ids == () and int(act.report.seqs_freed) == 0 and leaves_equal(s, before)

    s, act = ctl.clear(alloc, s, 1, "all")  # frees c and drops its two pins
    alloc.check(s)
    assert act.seq_ids == (c,) and int(act.report.unpinned_blocks) == 2
    assert int(s.free.free_count[0]) == CFG.num_blocks
    assert int(np.asarray(s.tenants.charged_blocks).sum()) == 0
    assert ctl.lookup(alloc, s, C, 1)["device"] == 0


# ---- pin / unpin -----------------------------------------------------------------------------------
def test_pinned_prefix_survives_free_and_unpins_through_the_cache():
    alloc, s = _fresh()
    s, seq, _ = _admit(alloc, s, 0, A)
    table = _table(s, seq, 4)
    s, act = ctl.pin(alloc, s, A[:9], 0)  # 9 tokens: two full blocks inside
    alloc.check(s)
    assert act.seq_ids == (seq,) and list(act.block_ids) == table[:2]
    assert [int(x) for x in np.asarray(s.blocks.pin_count)[table]] == [1, 1, 0, 0]
    s, _ = ctl.clear(alloc, s, 0, "device")
    alloc.check(s)
    assert [int(x) for x in np.asarray(s.blocks.ref_count)[table[:2]]] == [0, 0]
    assert int(s.free.free_count[0]) == CFG.num_blocks - 2  # the pinned blocks stay resident
    assert ctl.lookup(alloc, s, A, 0)["device"] == 8 == _cached_by_admit(alloc, s, 0, A)
    s, act = ctl.unpin(alloc, s, A[:8], 0)  # no holder left: found along the prefix cache
    alloc.check(s)
    assert act.seq_ids == () and list(act.block_ids) == table[:2]
    assert int(np.asarray(act.report.blocks_returned)[0]) == 2
    assert int(s.free.free_count[0]) == CFG.num_blocks
    assert ctl.lookup(alloc, s, A, 0)["device"] == 0
    with pytest.raises(E.BlockStateError):
        ctl.unpin(alloc, s, A[:8], 0)


def test_unpin_through_a_live_holder():
    alloc, s = _fresh()
    s, seq, _ = _admit(alloc, s, 0, C)
    s, _ = ctl.pin(alloc, s, C, 0)
    s, _ = ctl.pin(alloc, s, C[:4], 0)  # block 0 pinned twice
    alloc.check(s)
    table = _table(s, seq, 4)
    assert [int(x) for x in np.asarray(s.blocks.pin_count)[table]] == [2, 1, 1, 1]
    s, act = ctl.unpin(alloc, s, C[:8], 0)
    alloc.check(s)
    assert act.seq_ids == (seq,) and list(act.block_ids) == table[:2]
    assert [int(x) for x in np.asarray(s.blocks.pin_count)[table]] == [1, 0, 1, 1]
    assert int(np.asarray(act.report.blocks_returned).sum()) == 0  # still referenced


# ---- compress --------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_pages", [False, True])
def test_compress_takes_the_prefix_only(with_pages):
    cfg = dataclasses.replace(CFG, with_pages=with_pages)
    alloc, s = _fresh(cfg)
    s, mine, _ = _admit(alloc, s, 1, C)
    s, act = ctl.compress(alloc, s, C, 1, "int8")  # the default 32-token recent window: nothing
    alloc.check(s)
    assert act.seq_ids == (mine,) and act.report.blocks_compressed == 0
    s, act = ctl.compress(alloc, s, C[:9], 1, "int8", keep_recent=0)
    alloc.check(s)
    assert act.report.blocks_compressed == 2
    assert [_pool(cfg, b) for b in _table(s, mine, 4)] == [1, 1, 0, 0]
    assert ctl.lookup(alloc, s, C, 1)["device"] == 0  # compressed blocks are no lookup targets
    s, act = ctl.compress(alloc, s, C[:8], 1, "int8", keep_recent=0)  # already compressed
    alloc.check(s)
    assert act.report.blocks_compressed == 0
    assert [_pool(cfg, b) for b in _table(s, mine, 4)] == [1, 1, 0, 0]

    # Shared blocks are never rewritten: tenant 2 takes tenant 0's first three blocks.
    s, a, _ = _admit(alloc, s, 0, C)
    s, b, rep = _admit(alloc, s, 2, C)
    assert int(rep.cached_tokens[0]) == 12
    s, act = ctl.compress(alloc, s, C, 0, "int8", keep_recent=0)
    alloc.check(s)
    assert act.seq_ids == (a,) and act.report.blocks_compressed == 1
    assert [_pool(cfg, x) for x in _table(s, a, 4)] == [0, 0, 0, 1]
    s, act = ctl.compress(alloc, s, C[:8], 2, "int8", keep_recent=0)
    alloc.check(s)
    assert act.seq_ids == (b,) and act.report.blocks_compressed == 0


# ---- holding -----------------------------------------------------------------------------------------
def test_an_evicted_sequence_holds_nothing():
    """StreamingLLM keeps the sinks A[:4] at their place, but the cache no longer spells out the
    context, so the sequence is no holder (the safe reading) and the host figure ignores it."""
    alloc, s = _fresh()
    s, seq, _ = _admit(alloc, s, 0, A)
    s, _ = alloc.evict(s, np.array([seq], np.int32), policy="streamingllm", keep_tokens=8,
                       sinks=4)
    alloc.check(s)
    assert seq_tokens(s, seq, P) == A[:4] + A[-4:]  # a naive comparison would see A[:4] held
    with pytest.raises(E.BlockStateError):
        ctl.move(alloc, s, A[:4], 0, "device", "host")


# ---- errors ------------------------------------------------------------------------------------------
def test_location_pools():
    assert ctl.location_pools(CFG, "device") == (0, 1)
    assert ctl.location_pools(CFG, "host") == (CFG.host_pool,)
    with pytest.raises(E.TierError):
        ctl.location_pools(dataclasses.replace(CFG, host_blocks=0), "host")
    with pytest.raises(E.InvalidArgumentError):
        ctl.location_pools(CFG, "disk")


ERRORS = [
    ("unknown location", lambda al, s: ctl.clear(al, s, 0, "disk"), E.InvalidArgumentError),
    ("unknown src", lambda al, s: ctl.move(al, s, A, 0, "gpu", "host"), E.InvalidArgumentError),
    ("src == dst", lambda al, s: ctl.move(al, s, A, 0, "host", "host"), E.InvalidArgumentError),
    ("tenant out of range", lambda al, s: ctl.lookup(al, s, A, 9), E.UnknownTenantError),
    ("unregistered tenant", lambda al, s: ctl.clear(al, s, 3, "all"), E.UnknownTenantError),
    ("tenant not an int", lambda al, s: ctl.pin(al, s, A, "0"), E.UnknownTenantError),
    ("no holder", lambda al, s: ctl.pin(al, s, C, 0), E.BlockStateError),
    ("suspended holder", lambda al, s: ctl.pin(al, s, B, 1), E.BlockStateError),
    ("no running holder", lambda al, s: ctl.move(al, s, B, 1, "device", "host"),
     E.BlockStateError),
    ("no suspended holder", lambda al, s: ctl.move(al, s, A, 0, "host", "device"),
     E.BlockStateError),
    ("other tenant's tokens", lambda al, s: ctl.compress(al, s, A, 2, "int8"), E.BlockStateError),
    ("nothing pinned", lambda al, s: ctl.unpin(al, s, A, 0), E.BlockStateError),
    ("no full block", lambda al, s: ctl.pin(al, s, A[:3], 0), E.InvalidArgumentError),
    ("no such pool", lambda al, s: ctl.compress(al, s, A, 0, "kivi2"), E.TierError),
    ("keep_recent < 0", lambda al, s: ctl.compress(al, s, A, 0, "int8", keep_recent=-1),
     E.InvalidArgumentError),
    ("float tokens", lambda al, s: ctl.lookup(al, s, [1.0, 2.0], 0), E.InputDtypeError),
    ("2-D tokens", lambda al, s: ctl.lookup(al, s, [A], 0), E.InputShapeError),
    ("no tokens", lambda al, s: ctl.lookup(al, s, [], 0), E.InputShapeError),
    ("token id", lambda al, s: ctl.pin(al, s, [999] * 4, 0), E.TokenIdError),
    ("too long", lambda al, s: ctl.lookup(al, s, list(range(WIDTH + 1)), 0),
     E.SequenceTooLongError),
    ("host full", lambda al, s: ctl.move(al, s, C, 2, "device", "host"), E.PoolFullError),
]


@pytest.fixture(scope="module")
def error_state():
    """Tenant 0 runs A; tenant 1's B is suspended; tenant 2 runs C, which needs 4 host blocks
    when only 8 - 2 - 4 = 2 are free after tenant 0's D is offloaded too."""
    alloc, s = _fresh()
    s, _, _ = _admit(alloc, s, 0, A)
    s, b, _ = _admit(alloc, s, 1, B)
    s, d, _ = _admit(alloc, s, 0, list(range(80, 96)))
    s, _, _ = _admit(alloc, s, 2, C)
    s, _ = alloc.offload(s, np.array([b, d], np.int32))
    alloc.check(s)
    assert int(s.free.free_count[CFG.host_pool]) == 2
    return alloc, s


@pytest.mark.parametrize("name,call,error", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_leave_the_state_unchanged(error_state, name, call, error):
    alloc, s = error_state
    before = snapshot(s)
    with pytest.raises(error):
        call(alloc, s)
    assert leaves_equal(s, before)
    alloc.check(s)
