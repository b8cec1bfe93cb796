"""Eviction with compaction: exactly the chosen tokens survive, packed into full blocks at their
logical positions, per layer and KV head by default (each head its own tokens) or one set for the
whole model; shared blocks are copied on write; every registered policy keeps exactly its
top-scored tokens and leaves a consistent state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import paged_attention as pa
from kvquota import errors as E
from kvquota.policies import REGISTRY, TokenView, get_policy
from kvquota.sentinel import INVALID, PER_HEAD_TOKEN
from tests.state.common import BLOCK, TINY, fresh, leaves_equal, prompts, seq_tokens, snapshot
from tests.state.test_state_tiers import _ints, _seq_pages, _with_pages

P = TINY.block_size
WIDTH = TINY.max_tokens_per_seq
LAYERS, HEADS = TINY.model.num_layers, TINY.model.num_kv_heads




def test_kept_tokens_are_compacted_in_order_at_their_positions():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7]), (1, [8, 9])]))
    s = _with_pages(alloc, s)
    pages_before, other_before = _seq_pages(s, 0), _seq_pages(s, 1)
    # With no attention recorded every mass is 0 and H2O's ties go to the latest tokens: 3-6.
    s, rep = alloc.evict(s, [0, INVALID], policy="h2o", keep_tokens=4)
    alloc.check(s)
    assert _ints(rep.evicted_tokens) == [3, 0] and seq_tokens(s, 0, P) == [4, 5, 6, 7]
    assert int(s.seqs.seq_lens[0]) == 4 and int(s.seqs.positions[0]) == 7
    assert _same_tokens(_seq_pages(s, 0), [pages_before[i] for i in (3, 4, 5, 6)])
    assert _same_tokens(_seq_pages(s, 1), other_before)
    assert rep.pool_bytes_returned == 2 * BLOCK  # 4 blocks -> 2
    assert int(alloc.ledger(s).used_tokens[0]) == 4


def test_attention_after_eviction_equals_dense_attention_over_the_kept_tokens():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7])]))
    s = _with_pages(alloc, s, seed=3)
    before = _seq_pages(s, 0)
    mass = np.zeros((2, WIDTH), np.float32)
    mass[0, :7] = [5, 0, 4, 0, 3, 0, 1]
    s, _ = alloc.record_attention(s, [0, INVALID], mass)  # summed: a global choice
    s, rep = alloc.evict(s, [0, INVALID], policy="h2o", keep_tokens=4, aggregate="global")
    alloc.check(s)
    kept = [0, 2, 5, 6]  # H2O's half split: two heavy hitters, the two most recent
    assert _ints(rep.evicted_tokens) == [3, 0]
    q = jax.random.normal(jax.random.key(0), (1, TINY.model.num_q_heads, TINY.model.head_dim))
    table = s.seqs.block_tables[:1]
    got = pa.decode(q, s.pages[0].k[0], s.pages[0].v[0], table, s.seqs.seq_lens[:1],
                    backend="reference")
    k = jnp.stack([before[i][0][0] for i in kept])  # [n, Hkv, D] of layer 0
    v = jnp.stack([before[i][1][0] for i in kept])
    group = TINY.model.num_q_heads // TINY.model.num_kv_heads
    logits = jnp.einsum("hd,nhd->hn", q[0], jnp.repeat(k, group, axis=1)) / np.sqrt(k.shape[-1])
    want = jnp.einsum("hn,nhd->hd", jax.nn.softmax(logits, -1), jnp.repeat(v, group, axis=1))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_shared_blocks_are_copied_on_write_and_a_stable_prefix_stays_shared():
    alloc, s = fresh(tenants=((100, 8 * BLOCK, 1), (100, 8 * BLOCK, 1)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    s, r = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 9])]))  # shares blocks 0 and 1
    assert int(r.hit_blocks[0]) == 2
    s = _with_pages(alloc, s)
    shared = _ints(s.seqs.block_tables[0])[:2]
    other = snapshot(s)
    # "oldest" drops tokens 0 and 1 (the oldest): every block from block 0 on is rewritten, and
    # the shared ones are written into fresh copies.
    s2, rep = alloc.evict(s, [0, INVALID], policy="oldest", keep_tokens=4)
    alloc.check(s2)
    assert _ints(rep.copied_blocks)[0] >= 1
    assert _ints(s2.seqs.block_tables[1]) == _ints(other.seqs.block_tables[1])
    assert _same_tokens(_seq_pages(s2, 1), _seq_pages(other, 1))
    assert _ints(s2.seqs.block_tables[0])[:2] != shared
    # Keeping the first 4 tokens (streamingllm sinks) leaves both shared blocks shared.
    s3, rep = alloc.evict(s, [0, INVALID], policy="streamingllm", keep_tokens=4, sinks=4)
    alloc.check(s3)
    assert _ints(s3.seqs.block_tables[0])[:2] == shared and _ints(rep.copied_blocks)[0] == 0


def test_an_evicted_sequence_appends_but_is_no_lookup_target():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6])]))
    s, _ = alloc.evict(s, [0, INVALID], policy="oldest", keep_tokens=3)  # keeps 4, 5, 6
    s, r = alloc.append(s, [0, INVALID], [7, 0])  # block (6, 7) becomes full
    alloc.check(s)
    assert bool(r.appended[0]) and int(s.seqs.positions[0]) == 7 and int(s.seqs.seq_lens[0]) == 4
    s, r = alloc.admit(s, *prompts([(0, [4, 5, 6, 7, 1])]))  # same tokens, other positions
    alloc.check(s)
    assert int(r.hit_blocks[0]) == 0


def _view(lengths, seed=0, heads=(LAYERS, HEADS)):
    rng = np.random.default_rng(seed)
    shape = (len(lengths),) + heads + (WIDTH,)
    valid = np.arange(WIDTH) < np.asarray(lengths)[:, None, None, None]
    mass = np.where(valid, rng.random(shape), 0).astype(np.float32)
    return TokenView(lengths=jnp.asarray(lengths, jnp.int32), mass=jnp.asarray(mass),
                     key_norm=jnp.asarray(rng.random(shape), jnp.float32),
                     last_attention=jnp.asarray(rng.random(shape), jnp.float32))


@pytest.mark.parametrize("heads", [(LAYERS, HEADS), (1, 1)], ids=["per-head", "global"])
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_policy_keeps_exactly_its_top_scored_tokens(name, heads):
    """In every (layer, head): exactly min(keep, length) tokens, the recent window among them
    (`recent`, or H2O's half of the kept tokens), and no dropped older token scored above a kept
    one."""
    policy = get_policy(name, recent=1)
    view = _view([7, 3], heads=heads)
    keep = np.asarray(policy.keep_mask(view, jnp.asarray([4, 5], jnp.int32)))
    score = np.broadcast_to(np.asarray(policy.score(view)), keep.shape)
    assert keep.shape == (2,) + heads + (WIDTH,)
    for b, n in enumerate([7, 3]):
        k = min([4, 5][b], n)
        r = max(1, int(np.floor(policy.recent_share * k)))
        for layer, head in np.ndindex(*heads):
            kh, sh = keep[b, layer, head], score[b, layer, head]
            assert kh.sum() == k and not kh[n:].any()
            assert kh[n - r:n].all()  # the recent window
            kept = [i for i in range(n - r) if kh[i]]
            dropped = [i for i in range(n - r) if not kh[i]]
            if kept and dropped:
                assert min(sh[kept]) >= max(sh[dropped])


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_policy_runs_through_the_state(name):
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7]), (1, [8, 9, 1, 2, 3])]))
    s = _with_pages(alloc, s)
    rng = np.random.default_rng(1)
    s, _ = alloc.record_attention(s, [0, 1], rng.random((2, LAYERS, HEADS, WIDTH)))
    attention = rng.random((2, LAYERS, HEADS, WIDTH)).astype(np.float32)
    s, rep = alloc.evict(s, [0, 1], policy=name, keep_tokens=3, attention=attention)
    alloc.check(s)
    assert _ints(rep.evicted_tokens) == [4, 2] and _ints(s.seqs.seq_lens[:2]) == [3, 3]


# ---- per layer and KV head -------------------------------------------------------------------


def _top_k(score, length, keep, recent):
    """NumPy reference of a policy's choice in one (layer, head): the `recent` last tokens,
    then the highest scores, ties to the later token; sorted cache indices."""
    order = sorted(range(length), key=lambda i: (i < length - recent, -score[i], -i))
    return sorted(order[:min(keep, length)])


def _head_pages(s, seq, layer, head):
    """K and V rows [n, D] of one (layer, KV head) of a sequence, read through its table."""
    table = np.asarray(s.seqs.block_tables[seq])
    n = int(s.seqs.seq_lens[seq])
    i = np.arange(n)
    blk, off = table[i // P], i % P
    return [np.asarray(getattr(s.pages[0], kv))[layer, head, blk, off] for kv in "kv"]


def test_per_head_eviction_keeps_each_heads_own_tokens():
    """H2O on per-head mass that differs per (layer, head): slot j of head h holds h's j-th
    kept token (the NumPy reference's choice), K and V alike; the per-head mass moves with its
    token and the summed mass is the heads' sum; rewritten blocks hold no token ids and are no
    lookup target; the ledger frees the blocks the shorter table no longer needs."""
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7]), (1, [8, 9])]))
    s = _with_pages(alloc, s, seed=4)
    mass = np.zeros((2, LAYERS, HEADS, WIDTH), np.float32)
    mass[0, ..., :7] = np.random.default_rng(2).permutation(LAYERS * HEADS * 7).reshape(
        LAYERS, HEADS, 7) + 1.0  # distinct: every head its own ranking
    s, _ = alloc.record_attention(s, [0, INVALID], mass)
    before = snapshot(s)
    other = _seq_pages(before, 1)
    charged = int(alloc.ledger(s).device_bytes[0])
    mask = alloc.keep_mask(s, [0, INVALID], policy="h2o", keep_tokens=3, recent=1)
    assert mask.shape == (2, LAYERS, HEADS, WIDTH) and leaves_equal(before, s)
    s, rep = alloc.evict(s, [0, INVALID], policy="h2o", keep_tokens=3, recent=1)
    alloc.check(s)
    np.testing.assert_array_equal(rep.kept, mask)  # the report says what it kept
    assert _ints(rep.evicted_tokens) == [4, 0] and int(s.seqs.seq_lens[0]) == 3
    assert int(s.seqs.positions[0]) == 7  # logical positions are kept
    chosen = set()
    for layer, head in np.ndindex(LAYERS, HEADS):
        kept = _top_k(mass[0, layer, head], 7, 3, recent=1)
        assert np.flatnonzero(mask[0, layer, head]).tolist() == kept
        chosen.add(tuple(kept))
        k_before, v_before = _head_pages(before, 0, layer, head)
        k_after, v_after = _head_pages(s, 0, layer, head)
        np.testing.assert_array_equal(k_after, k_before[kept])
        np.testing.assert_array_equal(v_after, v_before[kept])
        table = np.asarray(s.seqs.block_tables[0])
        got = np.asarray(s.blocks.head_mass)[table[np.arange(3) // P], np.arange(3) % P,
                                              layer, head]
        np.testing.assert_array_equal(got, mass[0, layer, head, kept])
    assert len(chosen) > 1  # the heads did choose differently
    table = np.asarray(s.seqs.block_tables[0])
    i = np.arange(3)
    heads_sum = np.asarray(s.blocks.head_mass)[table[i // P], i % P].sum((1, 2))
    np.testing.assert_allclose(np.asarray(s.blocks.attn_mass)[table[i // P], i % P], heads_sum,
                               rtol=1e-6)
    tokens = np.asarray(s.blocks.token_ids)[table[:2]].ravel()
    assert (tokens[:3] == PER_HEAD_TOKEN).all() and tokens[3] == INVALID  # 3 held slots
    assert not np.asarray(s.blocks.hashed)[table[:2]].any()
    assert _same_tokens(_seq_pages(s, 1), other)
    assert int(alloc.ledger(s).device_bytes[0]) == charged - 2 * BLOCK  # 4 blocks -> 2
    assert rep.pool_bytes_returned == 2 * BLOCK


def test_per_head_attention_equals_dense_attention_over_each_heads_tokens():
    """After a per-head eviction, paged decode attention in every layer equals dense attention
    where each KV head attends over its own kept tokens."""
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7])]))
    s = _with_pages(alloc, s, seed=5)
    mass = np.zeros((2, LAYERS, HEADS, WIDTH), np.float32)
    mass[0, ..., :7] = np.random.default_rng(6).random((LAYERS, HEADS, 7)) + 0.1
    s, _ = alloc.record_attention(s, [0, INVALID], mass)
    before = snapshot(s)
    s, _ = alloc.evict(s, [0, INVALID], policy="snapkv", keep_tokens=4, kernel=3)
    alloc.check(s)
    keep = np.asarray(get_policy("snapkv", kernel=3).keep_mask(
        TokenView(lengths=jnp.asarray([7]), mass=jnp.asarray(mass[:1]), key_norm=None,
                  last_attention=None), jnp.asarray([4])))[0]  # [L, H, C]
    group = TINY.model.num_q_heads // HEADS
    q = jax.random.normal(jax.random.key(1), (1, TINY.model.num_q_heads, TINY.model.head_dim))
    for layer in range(LAYERS):
        got = pa.decode(q, s.pages[0].k[layer], s.pages[0].v[layer], s.seqs.block_tables[:1],
                        s.seqs.seq_lens[:1], backend="reference")[0]
        for head in range(HEADS):
            kept = np.flatnonzero(keep[layer, head])
            k, v = (a[kept] for a in _head_pages(before, 0, layer, head))
            qh = np.asarray(q[0, head * group:(head + 1) * group])
            w = jax.nn.softmax(qh @ k.T / np.sqrt(k.shape[-1]), axis=-1)
            np.testing.assert_allclose(np.asarray(got[head * group:(head + 1) * group]),
                                       np.asarray(w @ v), rtol=1e-5, atol=1e-6)


def test_heads_that_agree_keep_their_token_ids_and_evicted_sequences_append():
    """StreamingLLM chooses by position, the same tokens in every head: the rewritten blocks
    keep their token ids; the sequence then appends."""
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7])]))
    s = _with_pages(alloc, s)
    s, _ = alloc.evict(s, [0, INVALID], policy="streamingllm", keep_tokens=3, sinks=1)
    assert seq_tokens(s, 0, P) == [1, 6, 7]
    s, r = alloc.append(s, [0, INVALID], [8, 0])
    alloc.check(s)
    assert bool(r.appended[0]) and seq_tokens(s, 0, P) == [1, 6, 7, 8]


def test_block_mode_drops_whole_blocks_without_copying_own_blocks():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7])]))  # blocks 0-2 full, 3 tail
    s = _with_pages(alloc, s)
    s, _ = alloc.compress(s, [0, INVALID], kv_format="int8", keep_recent=0, max_blocks=1)
    before, table = _seq_pages(s, 0), _ints(s.seqs.block_tables[0])
    mass = np.zeros((2, WIDTH), np.float32)
    mass[0, :7] = [9, 9, 0, 0, 5, 5, 1]  # block 1 is the coldest
    s, _ = alloc.record_attention(s, [0, INVALID], mass)
    s, rep = alloc.evict(s, [0, INVALID], policy="h2o", keep_tokens=6, mode="block")
    alloc.check(s)
    # 3 blocks kept: the compressed block 0, block 2 and the tail; block 1 dropped.
    assert _ints(s.seqs.block_tables[0])[:3] == [table[0], table[2], table[3]]
    assert _ints(rep.evicted_tokens) == [2, 0] and _ints(rep.copied_blocks) == [0, 0]
    assert seq_tokens(s, 0, P) == [1, 2, 5, 6, 7] and int(s.seqs.positions[0]) == 7
    assert _same_tokens(_seq_pages(s, 0)[2:], [before[i] for i in (4, 5, 6)])


def test_block_mode_copies_a_shared_block_that_loses_its_predecessor():
    alloc, s = fresh(tenants=((100, 8 * BLOCK, 1), (100, 8 * BLOCK, 1)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    s, r = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 9])]))  # shares blocks 0 and 1
    s = _with_pages(alloc, s)
    other = snapshot(s)
    s, rep = alloc.evict(s, [0, INVALID], policy="oldest", keep_tokens=4, mode="block")
    alloc.check(s)
    # Block 0 (oldest) dropped; block 1 (shared) follows a new predecessor: copied.
    assert _ints(rep.copied_blocks) == [1, 0] and seq_tokens(s, 0, P) == [3, 4, 5]
    assert _ints(s.seqs.block_tables[1]) == _ints(other.seqs.block_tables[1])
    assert _same_tokens(_seq_pages(s, 1), _seq_pages(other, 1))


BAD = [
    ("unknown mode", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="h2o", keep_tokens=2, mode="page")),
    ("unknown policy", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="h3o", keep_tokens=2)),
    ("bad policy option", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="h2o", keep_tokens=2, window=3)),
    ("unknown snapkv pooling", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="snapkv", keep_tokens=2, aggregate="global",
                          pool="mean")),
    ("h2o recent_share above 1", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="h2o", keep_tokens=2, aggregate="global",
                          recent_share=1.5)),
    ("snapkv kernel 0", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="snapkv", keep_tokens=2, aggregate="global",
                          kernel=0)),
    ("negative keep_tokens", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="h2o", keep_tokens=-1)),
    ("keep nothing (free it instead)", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="h2o", keep_tokens=0)),
    ("tova without attention", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="tova", keep_tokens=2)),
    ("per-head tova with summed attention", E.InputShapeError,
     lambda a, s: a.evict(s, [0], policy="tova", keep_tokens=2,
                          attention=np.ones((1, WIDTH), np.float32))),
    ("unknown aggregate", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="h2o", keep_tokens=2, aggregate="layer")),
    ("per-head whole blocks", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="h2o", keep_tokens=2, mode="block", aggregate="head")),
    ("per-head h2o on summed mass", E.InvalidArgumentError,
     lambda a, s: a.evict(s, [0], policy="h2o", keep_tokens=2)),
    ("a free slot", E.UnknownSequenceError, lambda a, s: a.evict(s, [3], policy="h2o",
                                                                 keep_tokens=2)),
    ("a sequence with compressed blocks", E.TierError,
     lambda a, s: a.evict(s, [1], policy="h2o", keep_tokens=2)),
]


@pytest.mark.parametrize("name,error,call", BAD, ids=[b[0] for b in BAD])
def test_bad_evict_raises_and_leaves_state_unchanged(name, error, call):
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5]), (1, [6, 7, 8, 9, 1])]))
    s, _ = alloc.compress(s, [1, INVALID], kv_format="int8", keep_recent=0, max_blocks=1)
    s, _ = alloc.record_attention(s, [0, INVALID], np.ones((2, WIDTH), np.float32))  # summed
    before = snapshot(s)
    with pytest.raises(error):
        call(alloc, s)
    assert leaves_equal(before, s)


def _same_tokens(a, b):
    return len(a) == len(b) and all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
                                    for x, y in zip(a, b))
