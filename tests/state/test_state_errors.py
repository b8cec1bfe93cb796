"""Catalog of bad inputs: each raises its typed error and leaves every leaf of the state equal.

Where an operation has a donating variant, the bad input is also sent to it: validation runs
before the donating call, so the state must still be intact (not deleted) afterwards.
"""

import dataclasses
import pickle

import jax
import numpy as np
import pytest

from kvquota import errors as E
from kvquota.allocator import Allocator
from kvquota.invariants import check_invariants
from kvquota.sentinel import INVALID
from kvquota.codes import INT32_MAX
from tests.state.common import BLOCK, TINY, fresh, leaves_equal, prompts, snapshot


@pytest.fixture
def setup():
    """t0, t1 registered; seq 0 (t0, 5 tokens, blocks 0-2), seq 1 (t1, 8 tokens = full table);
    seq 2 admitted then freed; block 0 pinned."""
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (1, [9] * 8)]))
    s, _ = alloc.admit(s, *prompts([(0, [7])]))
    s, _ = alloc.free(s, [2])
    s, _ = alloc.pin_blocks(s, [0])
    alloc.check(s)
    return alloc, s


def _ok_prompt():
    return prompts([(0, [1, 2])])


CASES = [
    # (name, error type, call(alloc, state, donate))
    ("register tenant out of range", E.UnknownTenantError,
     lambda a, s, d: a.register_tenant(s, 5, token_quota=1, byte_quota=1, donate=d)),
    ("register negative tenant", E.UnknownTenantError,
     lambda a, s, d: a.register_tenant(s, -1, token_quota=1, byte_quota=1, donate=d)),
    ("register twice", E.TenantExistsError,
     lambda a, s, d: a.register_tenant(s, 0, token_quota=1, byte_quota=1, donate=d)),
    ("negative token quota", E.QuotaValueError,
     lambda a, s, d: a.set_quota(s, 0, token_quota=-1, donate=d)),
    ("negative byte quota", E.QuotaValueError,
     lambda a, s, d: a.set_quota(s, 0, byte_quota=-BLOCK, donate=d)),
    ("float quota", E.QuotaValueError,
     lambda a, s, d: a.set_quota(s, 0, token_quota=1.5, donate=d)),
    ("byte quota beyond int32 units", E.QuotaValueError,
     lambda a, s, d: a.set_quota(s, 0, byte_quota=(INT32_MAX + 1) * TINY.unit_bytes, donate=d)),
    ("token quota beyond int32", E.QuotaValueError,
     lambda a, s, d: a.set_quota(s, 0, token_quota=2**31, donate=d)),
    ("negative lease", E.QuotaValueError, lambda a, s, d: a.set_lease(s, 0, -3, donate=d)),
    ("negative share group", E.QuotaValueError,
     lambda a, s, d: a.register_tenant(s, 1, token_quota=1, byte_quota=1, share_group=-2, donate=d)),
    ("set quota of unknown tenant", E.UnknownTenantError,
     lambda a, s, d: a.set_quota(s, 7, token_quota=1, donate=d)),
    ("admit for unknown tenant", E.UnknownTenantError,
     lambda a, s, d: a.admit(s, [0, 3], *_ok_prompt()[1:], donate=d)),
    ("admit float tokens", E.InputDtypeError,
     lambda a, s, d: a.admit(s, _ok_prompt()[0], _ok_prompt()[1].astype(np.float32),
                             _ok_prompt()[2], donate=d)),
    ("admit bool tenants", E.InputDtypeError,
     lambda a, s, d: a.admit(s, np.array([True, False]), *_ok_prompt()[1:], donate=d)),
    ("admit list of floats", E.InputDtypeError,
     lambda a, s, d: a.admit(s, [0.0, 1.0], *_ok_prompt()[1:], donate=d)),
    ("admit 1-D tokens", E.InputShapeError,
     lambda a, s, d: a.admit(s, [0, INVALID], np.zeros(8, np.int32), [1, 0], donate=d)),
    ("admit mismatched batch", E.InputShapeError,
     lambda a, s, d: a.admit(s, [0], np.zeros((2, 8), np.int32), [1, 1], donate=d)),
    ("admit empty prompt", E.TokenIdError,
     lambda a, s, d: a.admit(s, [0, INVALID], np.zeros((2, 8), np.int32), [0, 0], donate=d)),
    ("admit length past tokens", E.TokenIdError,
     lambda a, s, d: a.admit(s, [0, INVALID], np.zeros((2, 4), np.int32), [5, 0], donate=d)),
    ("admit token id past vocab", E.TokenIdError,
     lambda a, s, d: a.admit(s, *prompts([(0, [1, 256])]), donate=d)),
    ("admit negative token in prompt", E.TokenIdError,
     lambda a, s, d: a.admit(s, *prompts([(0, [1, -1])]), donate=d)),
    ("admit sequence longer than the table", E.SequenceTooLongError,
     lambda a, s, d: a.admit(s, [0, INVALID], np.ones((2, 9), np.int32), [9, 0], donate=d)),
    ("append to a freed sequence", E.UnknownSequenceError,
     lambda a, s, d: a.append(s, [2, INVALID], [1, 0], donate=d)),
    ("append to an out-of-range sequence", E.UnknownSequenceError,
     lambda a, s, d: a.append(s, [4, INVALID], [1, 0], donate=d)),
    ("append twice to one sequence", E.DuplicateIdError,
     lambda a, s, d: a.append(s, [0, 0], [1, 1], donate=d)),
    ("append shape mismatch", E.InputShapeError,
     lambda a, s, d: a.append(s, [0, INVALID], [1], donate=d)),
    ("append past the block table", E.SequenceTooLongError,
     lambda a, s, d: a.append(s, [1, INVALID], [1, 0], donate=d)),
    ("append token id past vocab", E.TokenIdError,
     lambda a, s, d: a.append(s, [0, INVALID], [300, 0], donate=d)),
    ("double free", E.DoubleFreeError, lambda a, s, d: a.free(s, [2], donate=d)),
    ("free the same sequence twice in one call", E.DoubleFreeError,
     lambda a, s, d: a.free(s, [0, 0], donate=d)),
    ("fork a freed sequence", E.UnknownSequenceError, lambda a, s, d: a.fork(s, [2], donate=d)),
    ("pin a free block", E.BlockStateError, lambda a, s, d: a.pin_blocks(s, [7], donate=d)),
    ("pin an out-of-range block", E.BlockStateError,
     lambda a, s, d: a.pin_blocks(s, [TINY.total_blocks], donate=d)),
    ("pin the same block twice in one call", E.DuplicateIdError,
     lambda a, s, d: a.pin_blocks(s, [1, 1], donate=d)),
    ("unpin a block that is not pinned", E.BlockStateError,
     lambda a, s, d: a.unpin_blocks(s, [1], donate=d)),
    ("pin more prefix blocks than the sequence has", E.BlockStateError,
     lambda a, s, d: a.pin_prefix(s, 0, 4, donate=d)),
    ("pin prefix of a freed sequence", E.UnknownSequenceError,
     lambda a, s, d: a.pin_prefix(s, 2, 1, donate=d)),
    ("release an unknown tenant", E.UnknownTenantError,
     lambda a, s, d: a.release_tenant(s, 9, donate=d)),
    ("release with a non-bool unpin", E.InputDtypeError,
     lambda a, s, d: a.release_tenant(s, 0, unpin="yes", donate=d)),
    ("state of another config", E.StateMismatchError,
     lambda a, s, d: Allocator(dataclasses.replace(TINY, num_blocks=16)).free(s, [0], donate=d)),
    ("not a state", E.StateMismatchError, lambda a, s, d: a.free({"block_tables": 1}, [0], donate=d)),
    ("admit zero-width tokens (all padding)", E.InputShapeError,
     lambda a, s, d: a.admit(s, [INVALID, INVALID], np.zeros((2, 0), np.int32), [0, 0], donate=d)),
    ("admit ragged token lists", E.InputShapeError,
     lambda a, s, d: a.admit(s, [0, 1], [[1, 2, 3], [4]], [3, 1], donate=d)),
    ("append ragged token lists", E.InputShapeError,
     lambda a, s, d: a.append(s, [0, INVALID], [[1], [2, 3]], donate=d)),
]


def test_catalog_is_large_enough():
    assert len(CASES) >= 25


@pytest.mark.parametrize("donate", [False, True], ids=["plain", "donated"])
@pytest.mark.parametrize("name,error,call", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_leaves_state_unchanged(setup, name, error, call, donate):
    alloc, s = setup
    before = snapshot(s)
    with pytest.raises(error) as info:
        call(alloc, s, donate)
    assert isinstance(info.value, E.KVQuotaError)
    for leaf in jax.tree_util.tree_leaves(s):
        assert not leaf.is_deleted()
    assert leaves_equal(before, s)
    alloc.check(s)


def test_donated_state_cannot_be_reused():
    alloc, s = fresh()
    s2, _ = alloc.admit(jax.tree_util.tree_map(lambda x: x.copy(), s), *_ok_prompt(), donate=True)
    consumed = jax.tree_util.tree_map(lambda x: x.copy(), s2)
    alloc.append(consumed, [0, INVALID], [5, 0], donate=True)
    if not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(consumed)):
        pytest.skip("this backend ignored donation")
    with pytest.raises(E.StateMismatchError):
        alloc.append(consumed, [0, INVALID], [5, 0])


def test_the_state_an_op_returned_is_only_checked_for_donation():
    """The facade skips the full check (and its device read) for the state its last op
    returned, but not the donation check: that state, with its leaves deleted, is refused; the
    state before it (donated) is refused by the full check. A pickled allocator forgets it."""
    alloc, s = fresh()
    s2, _ = alloc.admit(s, *_ok_prompt())
    s3, _ = alloc.append(s2, [0, INVALID], [5, 0], donate=True)
    alloc.check(s3)
    if not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(s2)):
        pytest.skip("this backend ignored donation")
    with pytest.raises(E.StateMismatchError, match="donated"):
        alloc.append(s2, [0, INVALID], [5, 0])
    for leaf in jax.tree_util.tree_leaves(s3):
        leaf.delete()
    with pytest.raises(E.StateMismatchError, match="donated"):
        alloc.append(s3, [0, INVALID], [5, 0])
    again = pickle.loads(pickle.dumps(alloc))
    assert again.config == alloc.config and again._made is None


# ---- states that are not a state of this config: StateMismatchError from every entry point ----
def _replace_leaf(state, path_fn, value):
    """`state` with one leaf swapped (path_fn picks the sub-pytree and field)."""
    group, field = path_fn
    return state.replace(**{group: getattr(state, group).replace(**{field: value})})


BAD_STATES = [
    ("None", lambda s: None),
    ("a dict", lambda s: {"seqs": s.seqs}),
    ("a leaf that is a list", lambda s: _replace_leaf(s, ("seqs", "seq_lens"),
                                                      np.asarray(s.seqs.seq_lens).tolist())),
    ("a leaf that is None", lambda s: _replace_leaf(s, ("blocks", "fill"), None)),
    ("an int64 leaf", lambda s: _replace_leaf(s, ("blocks", "ref_count"),
                                              np.asarray(s.blocks.ref_count).astype(np.int64))),
    ("a leaf of the wrong shape", lambda s: _replace_leaf(s, ("free", "free_count"),
                                                          np.zeros(2, np.int32))),
    ("pages missing", lambda s: s.replace(pages=())),
    ("a deleted (donated) leaf", lambda s: _replace_leaf(
        s, ("tenants", "used_tokens"), _deleted(s.tenants.used_tokens))),
]


def _deleted(x):
    y = jax.numpy.array(x)
    y.delete()
    return y


ENTRY_POINTS = [
    ("ledger", lambda a, s: a.ledger(s)),
    ("check", lambda a, s: a.check(s)),
    ("check_invariants", lambda a, s: check_invariants(a.config, s)),
    ("register_tenant", lambda a, s: a.register_tenant(s, 1, token_quota=1, byte_quota=1)),
    ("set_quota", lambda a, s: a.set_quota(s, 0, token_quota=1)),
    ("set_lease", lambda a, s: a.set_lease(s, 0, 5)),
    ("expired_tenants", lambda a, s: a.expired_tenants(s, 0)),
    ("admit", lambda a, s: a.admit(s, *_ok_prompt())),
    ("append", lambda a, s: a.append(s, [0, INVALID], [1, 0])),
    ("fork", lambda a, s: a.fork(s, [0])),
    ("pin_blocks", lambda a, s: a.pin_blocks(s, [1])),
    ("unpin_blocks", lambda a, s: a.unpin_blocks(s, [0])),
    ("pin_prefix", lambda a, s: a.pin_prefix(s, 0, 1)),
    ("unpin_prefix", lambda a, s: a.unpin_prefix(s, 0, 1)),
    ("free", lambda a, s: a.free(s, [0])),
    ("release_tenant", lambda a, s: a.release_tenant(s, 0)),
]


@pytest.mark.parametrize("entry,call", ENTRY_POINTS, ids=[e[0] for e in ENTRY_POINTS])
@pytest.mark.parametrize("what,make", BAD_STATES, ids=[b[0] for b in BAD_STATES])
def test_not_a_state_of_this_config_is_refused_everywhere(setup, what, make, entry, call):
    alloc, s = setup
    before = snapshot(s)
    with pytest.raises(E.StateMismatchError):
        call(alloc, make(s))
    assert leaves_equal(before, s)


def test_foreign_state_with_identical_shapes_is_refused():
    """Same array shapes, another pool split (metadata-only, so no page shape tells them apart):
    the tiers/precisions of the pool boundaries do."""
    mine = dataclasses.replace(TINY, with_pages=False)
    other = dataclasses.replace(mine, compressed_pools=(("int8", 2),), host_blocks=6)
    assert mine.total_blocks == other.total_blocks and mine.num_pools == other.num_pools
    alloc, foreign = Allocator(mine), Allocator(other).init()
    assert jax.tree_util.tree_structure(foreign) == jax.tree_util.tree_structure(alloc.init())
    for call in (lambda: alloc.free(foreign, [0]), lambda: alloc.ledger(foreign),
                 lambda: alloc.check(foreign)):
        with pytest.raises(E.StateMismatchError, match="another config"):
            call()
