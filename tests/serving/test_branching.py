"""Branching a served state (kvquota.serving.branching): a branch survives donation of the
original's copy and vice versa, `extend` equals scoring the whole sequence at once, continues an
evicted sequence at its logical positions, runs its hook before each chunk, and refuses bad
input with a typed error before touching the state."""

import jax
import numpy as np
import pytest

import kvquota as kq
from kvquota import errors as E
from tests.state.common import leaves_equal, snapshot

CONFIG = kq.get_model_config("tiny-qwen")
PARAMS = kq.init_params(CONFIG, seed=3)
P = 8
IDS = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (2, 40)).astype(np.int32)


def engine(num_blocks=24):
    sc = kq.StateConfig(model=CONFIG, num_blocks=num_blocks, block_size=P, max_seqs=2,
                        max_blocks_per_seq=8, num_tenants=2, kv_format="f32",
                        compressed_pools=(("int8", 8),))
    eng = kq.PagedEngine(CONFIG, PARAMS, sc, chunk_size=P)
    for t in range(2):
        eng.register_tenant(t, token_quota=1 << 20, byte_quota=eng.max_byte_quota)
    return eng


def admitted(eng, n=16):
    report, _ = eng.admit([0, 1], [list(r[:n]) for r in IDS], last_only=False)
    return np.asarray(report.seq_id, np.int32)


def test_branch_is_independent_of_the_original_under_donation():
    eng = engine()
    seqs = admitted(eng)
    base = eng.state
    before = snapshot(base)
    eng.state = kq.serving.branch(base)
    kq.serving.extend(eng, seqs, IDS[:, 16:32])  # every op on the branch donates
    eng.allocator.check(eng.state)
    assert leaves_equal(snapshot(base), before)  # the original is intact and still live
    again = kq.serving.branch(base)
    assert leaves_equal(snapshot(again), before)
    assert not any(a is b for a, b in zip(jax.tree_util.tree_leaves(again),
                                          jax.tree_util.tree_leaves(base)))


def test_extend_equals_scoring_the_whole_sequence():
    want = kq.score(CONFIG, PARAMS, list(IDS[0]), block_size=P, return_logits=True)
    eng = engine()
    seqs = admitted(eng)
    chunks = kq.serving.extend(eng, seqs, IDS[:, 16:], lengths=np.array([24, 10]))
    got = np.concatenate([np.asarray(c) for c in chunks], axis=1)
    assert got.shape == (2, 24, CONFIG.vocab_size)  # 3 chunks of one block
    # Same maths, other chunking: f32 summation order only (tests/serving/test_engine.py).
    np.testing.assert_allclose(got[0], want.logits[16:], rtol=1e-5, atol=1e-5)
    lens = np.asarray(eng.state.seqs.seq_lens)[seqs]
    np.testing.assert_array_equal(lens, [40, 26])  # row 1 took only its 10 tokens
    eng.allocator.check(eng.state)


def test_extend_continues_an_evicted_sequence_at_its_logical_position():
    eng = engine()
    seqs = admitted(eng, 32)
    eng.state, _ = eng.allocator.evict(eng.state, seqs, policy="streamingllm", keep_tokens=16,
                                       recent=8, donate=True)
    lens, pos = (np.asarray(x)[seqs] for x in (eng.state.seqs.seq_lens,
                                               eng.state.seqs.positions))
    np.testing.assert_array_equal(lens, [16, 16])
    np.testing.assert_array_equal(pos, [32, 32])
    kq.serving.extend(eng, seqs, IDS[:, 32:40])
    np.testing.assert_array_equal(np.asarray(eng.state.seqs.seq_lens)[seqs], [24, 24])
    np.testing.assert_array_equal(np.asarray(eng.state.seqs.positions)[seqs], [40, 40])
    # The new tokens sit right after the 16 survivors, in cache order.
    table = np.asarray(eng.state.seqs.block_tables)[seqs[0]]
    np.testing.assert_array_equal(np.asarray(eng.state.blocks.token_ids)[table[2]], IDS[0, 32:])
    eng.allocator.check(eng.state)


def test_the_hook_runs_before_each_chunk_on_the_rows_still_taking_tokens():
    eng = engine()
    seqs = admitted(eng)
    seen = []
    kq.serving.extend(eng, seqs, IDS[:, 16:], lengths=np.array([24, 8]),
                      before_chunk=lambda e, rows: seen.append(list(rows)))
    assert seen == [list(seqs), [seqs[0], kq.INVALID], [seqs[0], kq.INVALID]]


@pytest.mark.parametrize("case, error", [
    (dict(seq_ids=np.array([0, 0])), E.DuplicateIdError),
    (dict(seq_ids=np.array([0, 5])), E.UnknownSequenceError),
    (dict(tokens=np.full((2, 4), 999)), E.TokenIdError),
    (dict(tokens=np.zeros((2, 60), np.int32)), E.SequenceTooLongError),
    (dict(lengths=np.array([5, 9])), E.InputShapeError),
    (dict(seq_ids=np.array([0.0, 1.0])), E.InputShapeError),
])
def test_bad_input_is_a_typed_error_and_the_state_is_untouched(case, error):
    eng = engine()
    seqs = admitted(eng)
    args = dict(seq_ids=seqs, tokens=IDS[:, 16:24], lengths=None) | case
    before = snapshot(eng.state)
    with pytest.raises(error):
        kq.serving.extend(eng, args["seq_ids"], args["tokens"], lengths=args["lengths"])
    assert leaves_equal(snapshot(eng.state), before)


def test_no_room_in_pool_0_is_refused_before_any_work():
    eng = engine(num_blocks=5)  # 4 blocks held by the two prompts, 1 free
    seqs = admitted(eng)
    before = snapshot(eng.state)
    with pytest.raises(E.PoolFullError):
        kq.serving.extend(eng, seqs, IDS[:, 16:32])
    assert leaves_equal(snapshot(eng.state), before)
