"""The prefix cache's hash index (`kvquota.prefix_index`, `kvquota.core.index`): after every op
of random programs it holds exactly the hashed blocks (check_invariants recomputes it), and a
lookup through it returns exactly what the brute-force join over every block returns, for real
keys, keys with other tokens and random keys, under forced hash collisions (hash_bits=2), with
cold cached blocks on and off, every op donated (the serving path); rebuilds happen and keep it
exact; donated cores update it in place; and the checker catches each kind of corruption."""

import collections
import dataclasses
import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from hypothesis.stateful import run_state_machine_as_test

from kvquota import codes
from kvquota import errors as E
from kvquota.allocator import Allocator
from kvquota.builder import SyntheticSpec, build_state
from kvquota.core import index as core_index
from kvquota.core.prefix import brute_force_candidates
from kvquota.errors import InvariantError
from kvquota.hashing import block_hash, salt_root
from kvquota.prefix_index import EMPTY, TOMB, home, home_count, rebuild
from kvquota.sentinel import INVALID
from kvquota.state import StateConfig
from tests.state.common import BLOCK, TINY, TINY_MODEL, prompts, whole_array_copies, with_tenants

COLLIDE = dataclasses.replace(with_tenants(TINY, 3), hash_bits=2)  # 16 keys per salt
COLD = dataclasses.replace(COLLIDE, keep_cold_blocks=True)
Q = 24  # queries per check (fixed: one compile per config)
SYSTEM = ([1, 2, 1, 2], [2, 1], [1, 1, 2, 2, 1, 2])  # shared prompt prefixes (P = 2)
STATS = collections.Counter()


@functools.partial(jax.jit, static_argnums=0)
def _both(config, state, hashes, salts, tokens):
    return (core_index.candidates(config, state, hashes, salts, tokens),
            brute_force_candidates(config, state, hashes, salts, tokens))


def queries(config, state, rng):
    """Q lookup keys: every block's stored key (hashed or not) with its tokens, some of them
    with one token changed, then random keys within hash_bits and the tenants' salts."""
    b = jax.device_get(state.blocks)
    salts = np.asarray(state.tenants.salt)
    have = np.flatnonzero((b.block_hash != 0).any(1) | b.hashed)
    rng.shuffle(have)
    have = have[: Q // 2]
    hashes = np.zeros((Q, 2), np.uint32)
    salt = np.zeros(Q, np.uint32)
    toks = rng.integers(1, 3, size=(Q, config.block_size)).astype(np.int32)
    n = len(have)
    hashes[:n], salt[:n], toks[:n] = b.block_hash[have], b.block_salt[have], b.token_ids[have]
    if n:
        toks[n // 2: n, 0] = np.where(toks[n // 2: n, 0] == 1, 2, 1)  # same key, other tokens
    mask = (1 << config.hash_bits) - 1
    hashes[n:] = rng.integers(0, mask + 1, size=(Q - n, 2), dtype=np.int64).astype(np.uint32)
    salt[n:] = rng.choice(salts, size=Q - n)
    return hashes, salt, toks


def assert_lookups_exact(config, state, rng):
    """The index's candidates equal the brute force's on a batch of keys; returns them."""
    hashes, salts, toks = queries(config, state, rng)
    got, want = jax.device_get(_both(config, state, hashes, salts, toks))
    np.testing.assert_array_equal(got, want)
    return got


class IndexMachine(RuleBasedStateMachine):
    config = COLLIDE

    def __init__(self):
        super().__init__()
        self.alloc = Allocator(self.config)
        s = self.alloc.init()
        for t in range(self.config.num_tenants):
            s, _ = self.alloc.register_tenant(s, t, token_quota=64, byte_quota=8 * BLOCK,
                                              share_group=0 if t < 2 else None)
        self.s = s
        self.rng = np.random.default_rng(0)
        self.occupied = 0

    def _seqs(self, *status):
        st_ = np.asarray(self.s.seqs.seq_status)
        return [int(i) for i in np.flatnonzero(np.isin(st_, status))]

    @rule(rows=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(SYSTEM),
                                  st.lists(st.integers(1, 2), max_size=4)), min_size=1,
                        max_size=2))
    def admit(self, rows):
        batch = [(t, (sys + tail)[: self.config.max_tokens_per_seq]) for t, sys, tail in rows]
        self.s, r = self.alloc.admit(self.s, *prompts(batch), donate=True)
        STATS["admitted"] += int(np.asarray(r.admitted).sum())
        STATS["hit blocks"] += int(np.asarray(r.hit_blocks).sum())

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), tok=st.integers(1, 2))
    def append(self, data, tok):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        if int(self.s.seqs.seq_lens[seq]) < self.config.max_tokens_per_seq:
            self.s, r = self.alloc.append(self.s, [seq], [tok], donate=True)
            STATS["appends"] += int(r.appended[0])

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING, codes.SEQ_SUSPENDED))
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING, codes.SEQ_SUSPENDED)))
        self.s, _ = self.alloc.free(self.s, [seq], donate=True)
        STATS["frees"] += 1

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        self.s, r = self.alloc.fork(self.s, [seq], donate=True)
        STATS["forks"] += int(r.forked[0])

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data())
    def offload(self, data):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        try:
            self.s, _ = self.alloc.offload(self.s, [seq], donate=True)
            STATS["offloads"] += 1
        except E.PoolFullError:
            pass

    @precondition(lambda self: self._seqs(codes.SEQ_SUSPENDED))
    @rule(data=st.data())
    def restore(self, data):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_SUSPENDED)))
        try:
            self.s, _ = self.alloc.restore(self.s, [seq], donate=True)
            STATS["restores"] += 1
        except (E.PoolFullError, E.QuotaExceededError):
            pass

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), keep=st.integers(0, 2))
    def compress(self, data, keep):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        try:
            self.s, rep = self.alloc.compress(self.s, [seq], kv_format="int8", keep_recent=keep,
                                                donate=True)
            STATS["blocks compressed"] += rep.blocks_compressed
        except E.PoolFullError:
            pass

    @precondition(lambda self: self._seqs(codes.SEQ_RUNNING))
    @rule(data=st.data(), keep=st.integers(1, 5), mode=st.sampled_from(["token", "block"]))
    def evict(self, data, keep, mode):
        seq = data.draw(st.sampled_from(self._seqs(codes.SEQ_RUNNING)))
        try:
            self.s, rep = self.alloc.evict(self.s, [seq], policy="oldest", keep_tokens=keep,
                                           mode=mode, donate=True)
            STATS[f"evicted ({mode})"] += int(rep.evicted_tokens[0])
        except (E.TierError, E.PoolFullError):
            pass

    @rule(n=st.integers(0, 3))
    def drop_cold(self, n):
        self.s, rep = self.alloc.drop_cold(self.s, n, donate=True)
        STATS["cold dropped"] += int(rep.dropped_blocks)

    @invariant()
    def exact(self):
        self.alloc.check(self.s)
        got = assert_lookups_exact(self.config, self.s, self.rng)
        STATS["candidates found"] += int((got >= 0).sum())
        STATS["keys with several candidates"] += int(((got >= 0).sum(1) > 1).sum())
        occupied = int(self.s.index.occupied)
        STATS["rebuilds"] += occupied < self.occupied  # only a rebuild lowers it
        self.occupied = occupied


class ColdIndexMachine(IndexMachine):
    config = COLD


_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
FAST = settings(max_examples=10, stateful_step_count=25, deadline=None, derandomize=True,
                database=None, suppress_health_check=_HEALTH)
SLOW = settings(max_examples=200, stateful_step_count=50, deadline=None, derandomize=True,
                database=None, suppress_health_check=_HEALTH)
FLOORS = {"admitted": 20, "hit blocks": 5, "frees": 8, "appends": 4, "offloads": 3,
          "restores": 1, "blocks compressed": 2, "evicted (token)": 2, "evicted (block)": 2,
          "rebuilds": 1, "keys with several candidates": 10}


def _explore(machine, how, capsys, scale=1):
    STATS.clear()
    run_state_machine_as_test(machine, settings=how)
    with capsys.disabled():
        print(f"\n{machine.__name__}: " + ", ".join(f"{k}={v}" for k, v in sorted(STATS.items())))
    floors = dict(FLOORS, **({"cold dropped": 1} if machine.config.keep_cold_blocks else {}))
    low = {k: (STATS.get(k, 0), scale * f) for k, f in floors.items()
           if STATS.get(k, 0) < scale * f}
    assert not low, f"the machine stopped exploring: (count, floor) {low}"


@pytest.mark.slow  # ~25 s: the default run's budget; its check_invariants covers the index
def test_index_equals_brute_force_after_every_op(capsys):
    """Cold blocks on (the superset of paths: settle pushes some blocks and keeps others
    cached). Cold off runs in the long test below. In the default run every state test's
    check_invariants checks the index after each op, in both modes (the cold state machine
    of tests/state/test_state_cold.py among them)."""
    _explore(ColdIndexMachine, FAST, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("machine", [IndexMachine, ColdIndexMachine], ids=["cold-off", "cold-on"])
def test_index_equals_brute_force_long(machine, capsys):
    _explore(machine, SLOW, capsys, scale=10)


def test_batches_past_the_shrinking_buffers_stay_exact():
    """An admission of 8 prompts of 128 blocks (1,024 entries to insert) and a lookup of 4,096
    keys of which a tenth are active (as an admission of long prompts padded to the longest):
    both probe loops move their stragglers into 8x smaller buffers (`core.index._rounds`),
    under hash_bits=2, so probe runs are long. The index stays exact (check_invariants
    recomputes it) and the lookup equals the brute force's."""
    config = dataclasses.replace(COLLIDE, num_blocks=1024, max_seqs=8, max_blocks_per_seq=128)
    alloc, p = Allocator(config), config.block_size
    s = alloc.init()
    for t in range(3):
        s, _ = alloc.register_tenant(s, t, token_quota=10**6, byte_quota=1024 * config.pool_bytes[0],
                                     share_group=0 if t < 2 else None)
    rng = np.random.default_rng(3)
    tok = rng.integers(1, 3, size=(8, 128 * p)).astype(np.int32)
    tok[1::2, : 16 * p] = tok[0, : 16 * p]  # shared prefixes: hits and equal keys
    s, r = alloc.admit(s, np.asarray([0, 1, 2, 0, 1, 2, 0, 1], np.int32), tok,
                       np.full(8, 128 * p, np.int32), donate=True)
    alloc.check(s)
    assert np.asarray(r.admitted).all() and int(s.blocks.hashed.sum()) > 900
    hashes, salts, toks = [np.concatenate(x) for x in zip(*(queries(config, s, rng)
                                                               for _ in range(4096 // Q + 1)))]
    hashes, salts, toks = hashes[:4096], salts[:4096], toks[:4096]
    active = rng.random(4096) < 0.1
    got = jax.device_get(jax.jit(core_index.candidates, static_argnums=0)(
        config, s, hashes, salts, toks, active))
    want = jax.device_get(_both(config, s, hashes, salts, toks)[1])
    np.testing.assert_array_equal(got, np.where(active[:, None], want, INVALID))
    assert (got[active] >= 0).any(axis=1).mean() > 0.3  # real keys among them


# ---- rebuilds ------------------------------------------------------------------------------------
def test_many_insert_free_cycles_rebuild_and_stay_exact():
    """A pool of 8 blocks (16 home slots, rebuilt past 12 non-EMPTY): admit / free cycles leave
    tombstones until a rebuild clears them; the index stays exact throughout."""
    alloc = Allocator(COLLIDE)
    s = alloc.init()
    for t in range(3):
        s, _ = alloc.register_tenant(s, t, token_quota=64, byte_quota=8 * BLOCK,
                                     share_group=0 if t < 2 else None)
    rng = np.random.default_rng(1)
    history = []
    for cycle in range(24):
        toks = rng.integers(1, 4, size=int(rng.integers(3, 9))).tolist()
        s, r = alloc.admit(s, *prompts([(cycle % 3, toks)]), donate=True)
        history.append(int(s.index.occupied))
        alloc.check(s)
        assert_lookups_exact(COLLIDE, s, rng)
        if r.admitted[0]:
            s, _ = alloc.free(s, [int(r.seq_id[0])], donate=True)
            history.append(int(s.index.occupied))
            alloc.check(s)
            assert_lookups_exact(COLLIDE, s, rng)
    drops = sum(b < a for a, b in zip(history, history[1:]))
    assert drops >= 2, history  # rebuilds happened (only they lower `occupied`)
    assert max(history) <= 3 * home_count(COLLIDE) // 4


def test_rebuild_places_every_key_reachably():
    """The one-sort layout (NumPy and jax agree) puts every entry at or after its home with no
    EMPTY in between, each once, even when every key is the same."""
    config = StateConfig(TINY_MODEL, num_blocks=300, block_size=2, max_seqs=2,
                         max_blocks_per_seq=2, num_tenants=1, with_pages=False)
    rng = np.random.default_rng(2)
    for bits in (0, 3, 32):
        hashed = rng.random(config.num_blocks) < 0.7
        words = rng.integers(0, 1 << bits, size=(config.num_blocks, 2), dtype=np.int64)
        words = np.where(hashed[:, None], words, 0).astype(np.uint32)
        salts = np.where(hashed, rng.integers(0, 3, size=config.num_blocks), 0).astype(np.uint32)
        ref = rebuild(config, hashed, words, salts, xp=np)
        got = jax.device_get(jax.jit(lambda h, w, s: rebuild(config, h, w, s))(hashed, words,
                                                                                  salts))
        for k in ref:
            np.testing.assert_array_equal(np.asarray(got[k]), ref[k])
        slots, slot_of = ref["slots"], ref["slot_of"]
        ids = np.flatnonzero(hashed)
        assert int(ref["occupied"]) == len(ids) == int((slots != EMPTY).sum())
        assert np.array_equal(np.sort(slots[slots != EMPTY]), ids)
        assert np.array_equal(slots[slot_of[ids]], ids)
        hm = home(words[ids], salts[ids], home_count(config), xp=np)
        at = slot_of[ids]
        assert (hm <= at).all()
        empty = np.concatenate([[0], np.cumsum(slots == EMPTY)])
        assert (empty[at + 1] == empty[hm]).all()  # no EMPTY in [home, slot]


def test_builder_state_has_an_exact_index():
    config = StateConfig(TINY_MODEL, num_blocks=1 << 12, block_size=4, max_seqs=64,
                         max_blocks_per_seq=32, num_tenants=8, with_pages=False)
    state = build_state(config, SyntheticSpec(num_seqs=64, num_groups=1, group_size=4, seed=5))
    Allocator(config).check(state)
    assert int(state.index.occupied) == int(np.asarray(state.blocks.hashed).sum()) > 500
    assert_lookups_exact(config, state, np.random.default_rng(3))


# ---- the checker catches a corrupted index -------------------------------------------------------
def _colliding_blocks(salt, n=3):
    """n distinct token pairs whose full blocks get one key under COLLIDE's 2-bit hashes."""
    root = salt_root(np.array([salt], np.uint32), COLLIDE.hash_bits, xp=np)
    pairs = np.array([(a, b) for a in range(1, 12) for b in range(1, 12)], np.int32)
    keys = block_hash(np.repeat(root, len(pairs), axis=0), pairs, COLLIDE.hash_bits, xp=np)
    _, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    return pairs[inverse.ravel() == int(np.argmax(counts))][:n].tolist()


def _clustered():
    """Three hashed blocks of one tenant with the same key (one cluster from a shared home),
    the first one freed (a tombstone in the others' probe path). Returns (alloc, state, slots,
    the two live blocks)."""
    alloc = Allocator(COLLIDE)
    s = alloc.init()
    for t in range(3):
        s, _ = alloc.register_tenant(s, t, token_quota=64, byte_quota=8 * BLOCK)
    first, *rest = _colliding_blocks(int(np.asarray(s.tenants.salt)[2]))
    s, r = alloc.admit(s, *prompts([(2, first + [1])]))
    s, r2 = alloc.admit(s, *prompts([(2, pair + [1]) for pair in rest]))
    live = [int(b) for b in np.asarray(s.seqs.block_tables)[np.asarray(r2.seq_id), 0]]
    s, _ = alloc.free(s, [int(r.seq_id[0])])  # its full block's entry becomes a tombstone
    alloc.check(s)
    return alloc, s, np.asarray(s.index.slots), live


def _corrupt(s, slots=None, slot_of=None, occupied=None):
    ix = s.index
    return s.replace(index=ix.replace(
        slots=ix.slots if slots is None else jax.numpy.asarray(slots, np.int32),
        slot_of=ix.slot_of if slot_of is None else jax.numpy.asarray(slot_of, np.int32),
        occupied=ix.occupied if occupied is None else jax.numpy.int32(occupied)))


def test_checker_catches_a_removed_entry():
    alloc, s, slots, (_, b) = _clustered()
    slot_of = np.asarray(s.index.slot_of).copy()
    slots = slots.copy()
    slots[slot_of[b]], slot_of[b] = TOMB, INVALID
    with pytest.raises(InvariantError, match="hashed block not in the prefix index"):
        alloc.check(_corrupt(s, slots, slot_of))


def test_checker_catches_a_duplicated_entry():
    alloc, s, slots, (b, _) = _clustered()
    slots = slots.copy()
    spare = int(np.asarray(s.index.slot_of)[b]) + 2  # past the cluster: reachable, not EMPTY
    assert slots[spare] == EMPTY
    slots[spare] = b
    with pytest.raises(InvariantError, match="more than once"):
        alloc.check(_corrupt(s, slots, occupied=int(s.index.occupied) + 1))


def test_checker_catches_an_empty_hole_in_a_probe_path():
    alloc, s, slots, (b, c) = _clustered()
    (tomb,) = np.flatnonzero(slots == TOMB)
    assert slots[tomb + 1: tomb + 3].tolist() == [b, c]  # the tombstone is in their probe path
    slots = slots.copy()
    slots[tomb] = EMPTY
    bad = _corrupt(s, slots, occupied=int(s.index.occupied) - 1)
    with pytest.raises(InvariantError, match="unreachable") as err:
        alloc.check(bad)
    assert len(err.value.problems) == 1, err.value.problems  # nothing else is wrong with it
    # What the hole does: a lookup through the index now stops short of the block.
    key = np.asarray(s.blocks.block_hash[c])[None], np.asarray(s.blocks.block_salt[c])[None]
    tok = np.asarray(s.blocks.token_ids[c])[None]
    got, want = jax.device_get(_both(alloc.config, bad, *key, tok))
    assert c in want[0] and c not in got[0]


def test_checker_catches_a_wrong_slot_of():
    alloc, s, slots, (b, c) = _clustered()
    slot_of = np.asarray(s.index.slot_of).copy()
    slot_of[b], slot_of[c] = slot_of[c], slot_of[b]
    with pytest.raises(InvariantError, match="index slot_of"):
        alloc.check(_corrupt(s, slot_of=slot_of))


# ---- lookups through tombstones (fast; the state machines above are slow) -----------------------
def _numpy_hits(s, words, salt, tokens):
    """Brute force over the stored arrays, in NumPy: the hashed blocks whose two hash words,
    salt and token ids all equal the query's."""
    b = jax.device_get(s.blocks)
    return [int(i) for i in np.flatnonzero(
        b.hashed & (b.block_hash == words).all(1) & (b.block_salt == salt)
        & (b.token_ids == np.asarray(tokens)).all(1))]


def test_lookups_probe_past_tombstones_and_never_return_a_freed_block():
    """Four full blocks of one tenant with one key fill one cluster from its home; the 1st and
    3rd entries are freed, so the cluster reads TOMB, live, TOMB, live. A lookup of each live
    block's tokens walks past a tombstone to it (index == brute force == that block; a new
    admission of its prompt takes it by reference), and a lookup of a freed block's tokens
    misses (no hit, new blocks: never the freed or reused block). A lookup that stopped at a
    tombstone misses the live blocks."""
    alloc = Allocator(COLLIDE)
    s = alloc.init()
    for t in range(3):
        s, _ = alloc.register_tenant(s, t, token_quota=64, byte_quota=8 * BLOCK)
    salt = int(np.asarray(s.tenants.salt)[2])
    pairs = _colliding_blocks(salt, n=4)
    assert len(pairs) == 4
    seqs = []
    for rows in ([(2, pairs[0] + [1]), (2, pairs[1] + [1])],
                 [(2, pairs[2] + [1]), (2, pairs[3] + [1])]):
        s, r = alloc.admit(s, *prompts(rows))
        alloc.check(s)
        assert np.asarray(r.admitted).all() and _ints(r.new_blocks) == [2, 2]
        seqs += _ints(r.seq_id)
    full = _ints(np.asarray(s.seqs.block_tables)[seqs, 0])  # each prompt's full (hashed) block
    assert int(s.blocks.hashed.sum()) == 4
    words, salts = np.asarray(s.blocks.block_hash)[full], np.asarray(s.blocks.block_salt)[full]
    assert (words == words[0]).all() and (salts == salt).all()  # one key
    h0 = int(home(words[:1], salts[:1], home_count(COLLIDE), xp=np)[0])
    at = np.asarray(s.index.slot_of)[full]
    assert sorted(at.tolist()) == list(range(h0, h0 + 4))  # one cluster from the home
    by_slot = [int(i) for i in np.argsort(at)]  # prompt indices in probe order
    gone, live = by_slot[0::2], by_slot[1::2]
    s, _ = alloc.free(s, [seqs[i] for i in gone])
    alloc.check(s)
    slots = np.asarray(s.index.slots)
    assert slots[h0: h0 + 5].tolist() == [TOMB, full[live[0]], TOMB, full[live[1]], EMPTY]
    assert int(s.index.occupied) == 4  # tombstones still count: no rebuild since

    # The index's candidates for every prompt's key and tokens equal the brute force's (jax
    # and NumPy): the live block alone for a live prompt, nothing for a freed one.
    q = np.asarray(pairs, np.int32)
    got, want = jax.device_get(_both(COLLIDE, s, words, salts, q))
    np.testing.assert_array_equal(got, want)
    for i in range(4):
        expect = [full[i]] if i in live else []
        assert _numpy_hits(s, words[0], salt, pairs[i]) == expect
        assert [int(c) for c in got[i] if c != INVALID] == expect, (i, got[i])

    # Admissions: the live prompts hit their blocks by reference ...
    s, r = alloc.admit(s, *prompts([(2, pairs[i] + [2]) for i in live]))
    alloc.check(s)
    assert _ints(r.cached_tokens) == [2, 2] and _ints(r.hit_blocks) == [1, 1]
    assert _ints(r.new_blocks) == [1, 1]
    hit_seqs = _ints(r.seq_id)
    assert _ints(np.asarray(s.seqs.block_tables)[hit_seqs, 0]) == [full[i] for i in live]
    assert _ints(np.asarray(s.blocks.ref_count)[[full[i] for i in live]]) == [2, 2]
    # (their partial blocks came from the stack the freed blocks went back to)
    assert not np.asarray(s.blocks.hashed)[[full[i] for i in gone]].any()
    s, _ = alloc.free(s, hit_seqs)
    alloc.check(s)
    assert _ints(np.asarray(s.blocks.ref_count)[[full[i] for i in live]]) == [1, 1]
    # The freed prompts miss: no hit, every block new, none of them a live block.
    s, r = alloc.admit(s, *prompts([(2, pairs[i] + [1]) for i in gone]))
    alloc.check(s)
    assert np.asarray(r.admitted).all()
    assert _ints(r.cached_tokens) == [0, 0] and _ints(r.hit_blocks) == [0, 0]
    assert _ints(r.new_blocks) == [2, 2]
    tables = np.asarray(s.seqs.block_tables)[np.asarray(r.seq_id)][:, :2]
    assert not set(tables.ravel().tolist()) & {full[i] for i in live}
    assert _ints(np.asarray(s.blocks.ref_count)[tables.ravel()]) == [1, 1, 1, 1]


def _ints(x):
    return [int(v) for v in np.ravel(np.asarray(x))]


# ---- donation: the index is updated in place -----------------------------------------------------
@pytest.mark.parametrize("keep_cold", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["cold-off", "cold-on"])
def test_donated_cores_update_the_index_in_place(keep_cold):
    """No whole-array copy of the index's slots ([2H]) nor of any per-block or LRU array ([NB],
    [N_0]) in the compiled donated admit, append, free and drop_cold, with cold blocks off or
    on: a per-op O(pool) copy would undo the index's point. (The cold-reuse path used to copy
    its LRU arrays through `lax.cond` branches on every allocation.)"""
    from kvquota.core import admission, cold, release

    config = StateConfig(TINY_MODEL, num_blocks=4093, block_size=4, max_seqs=37,
                         max_blocks_per_seq=29, num_tenants=5, with_pages=False,
                         keep_cold_blocks=keep_cold)
    state = build_state(config, SyntheticSpec(num_seqs=30, num_groups=1, group_size=2,
                                              pool_fill=0.4))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    heirs = (i32([2, 2, 3, 3]), i32([0, 1, 0, 1]))  # (rows, cols) of heir table entries
    calls = {
        "admit": (admission.admit_core, (i32([0, 1]), i32(np.ones((2, 9))), i32([9, 5]))),
        "append": (admission.append_core, (i32([0, 1]), i32([3, 4]))),
        "free": (release.drop_core, (i32([0, 1]), heirs, None, 0)),
        "drop_cold": (cold.drop_cold_core, (np.int32(2), 2)),
    }
    sizes = sorted({2 * home_count(config), config.total_blocks, config.num_blocks})
    for name, (op, args) in calls.items():
        if keep_cold is False and name == "drop_cold":
            continue  # nothing is ever cold
        fn = op.jitted(donate=True)
        copies = whole_array_copies(fn.lower(config, state, *args).compile().as_text(), sizes)
        assert not copies, (name, copies[:3])
