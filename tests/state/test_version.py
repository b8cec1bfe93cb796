"""The state version (`KVState.meta.version`): every jitted core folds its name and inputs into
it, so apply_plan can refuse a plan for another state in O(1) — including a sibling fork that a
plain counter of operations would not tell apart."""

import jax
import numpy as np
import pytest

from kvquota import errors as E
from kvquota.core import admission
from kvquota.reclaim import ReclaimRequest
from tests.state.common import BLOCK, TINY, fresh, prompts, snapshot


def version(state):
    return tuple(int(v) for v in np.asarray(state.meta.version))


def _running():
    alloc, s = fresh(TINY)
    s, rep = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (1, [6, 7, 8])]))
    assert np.asarray(rep.admitted).all()
    return alloc, s


def test_the_empty_state_is_version_zero_and_every_op_moves_it():
    alloc = fresh(TINY)[0]
    assert version(alloc.init()) == (0, 0)
    alloc, s = _running()
    ops = [
        lambda s: alloc.append(s, [0], [9]),
        lambda s: alloc.fork(s, [0]),
        lambda s: alloc.pin_prefix(s, 0, 1),
        lambda s: alloc.set_idle(s, [1]),
        lambda s: alloc.preempt(s, [1]),
        lambda s: alloc.offload(s, [0]),
        lambda s: alloc.compress(s, [0], kv_format=TINY.compressed_pools[0][0], keep_recent=0),
        lambda s: alloc.evict(s, [0], policy="h2o", keep_tokens=1, mode="block"),
        lambda s: alloc.record_attention(s, [0], np.ones((1, 5), np.float32)),
        lambda s: alloc.set_quota(s, 0, byte_quota=BLOCK),
        lambda s: alloc.set_lease(s, 0, 7),
        lambda s: alloc.free(s, [0]),
        lambda s: alloc.release_tenant(s, 1),
        lambda s: alloc.drop_cold(s),
    ]
    seen = {version(s)}
    for op in ops:
        s2, _ = op(s)
        alloc.check(s2)
        assert version(s2) not in seen, op
        seen.add(version(s2))


def test_a_refused_op_still_moves_the_version():
    """The version is the history, not the content: a refused admission leaves every other leaf
    equal and the version new (a plan for the old state is refused: plan again, it is cheap)."""
    alloc, s = fresh(TINY, tenants=((64, 2 * BLOCK, 0),))
    s2, rep = alloc.admit(s, *prompts([(0, list(range(1, 9)))]))
    assert not bool(rep.admitted[0])
    assert version(s2) != version(s)


def test_the_same_ops_on_the_same_inputs_give_the_same_version():
    """Donated or not, in two runs: the version is a function of the history."""
    a, s = _running()
    b, t = _running()
    assert version(s) == version(t)
    s2, _ = a.append(s, [0, 1], [4, 4])
    t2, _ = b.append(t, [0, 1], [4, 4], donate=True)
    assert version(s2) == version(t2)
    s3, _ = a.append(s, [0, 1], [4, 5])  # another input
    s4, _ = a.append(s, [1, 0], [4, 4])  # the same pairs, another order
    assert len({version(s2), version(s3), version(s4)}) == 3


def test_apply_plan_refuses_a_sibling_fork_with_as_many_operations():
    """Two states made from one by one op each: a counter would give both the same number."""
    alloc, s = _running()
    left, _ = alloc.append(s, [0], [9])
    right, _ = alloc.append(s, [1], [9])
    plan = alloc.plan_reclaim(left, ReclaimRequest.quota_cut(0, 0), "swap-all")
    assert version(left) != version(right)
    before = snapshot(right)
    with pytest.raises(E.PlanMismatchError, match="another state"):
        alloc.apply_plan(right, plan)
    assert version(right) == version(before)
    done, rep = alloc.apply_plan(left, plan)
    alloc.check(done)
    assert [st.means for st in rep.steps] == [st.means for st in plan.steps]


def test_planning_does_not_move_the_version():
    alloc, s = _running()
    v = version(s)
    plan = alloc.plan_reclaim(s, ReclaimRequest.quota_cut(0, 0), "tiered")
    assert version(s) == v and plan.version == v


def test_a_core_fused_into_a_larger_jit_moves_the_version_too():
    """Serving executors fuse `append_core.fn` into their step: the version moves there as in
    the facade, by the same rule."""
    alloc, s = _running()
    ids, tok = np.asarray([0, 1], np.int32), np.asarray([4, 4], np.int32)
    fused, _ = jax.jit(admission.append_core.fn, static_argnums=0)(TINY, s, ids, tok)
    direct, _ = alloc.append(s, ids, tok)
    assert version(fused) == version(direct) != version(s)
