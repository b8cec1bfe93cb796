"""The plain-JAX reference path: hand-worked cases, dense attention, mass, lse merge."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from kernels import paged_attention as pa
from kvquota.sentinel import INVALID
from tests.kernels.cases import assert_close, make_case

BACKENDS = ["reference", "pallas"]


def numpy_attention(q, k, v, q_pos, kv_len, sm_scale):
    """Float64 causal GQA attention written with loops: an independent oracle.

    q [B, T, Hq, D], k/v [B, S, Hkv, D] (only the first kv_len[b] rows are read), q_pos [B, T]
    (-1: padding row). Returns out [B, T, Hq, D], lse [B, T, Hq], probs [B, T, Hq, S].
    """
    b_, t_, hq, d = q.shape
    s_, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    out = np.zeros((b_, t_, hq, d))
    lse = np.full((b_, t_, hq), -np.inf)
    probs = np.zeros((b_, t_, hq, s_))
    for b in range(b_):
        for t in range(t_):
            n = min(q_pos[b, t] + 1, kv_len[b]) if q_pos[b, t] >= 0 else 0
            if n <= 0:
                continue
            for h in range(hq):
                kk = k[b, :n, h // g].astype(np.float64)
                vv = v[b, :n, h // g].astype(np.float64)
                logits = kk @ q[b, t, h].astype(np.float64) * sm_scale
                top = logits.max()
                w = np.exp(logits - top)
                lse[b, t, h] = top + np.log(w.sum())
                probs[b, t, h, :n] = w / w.sum()
                out[b, t, h] = probs[b, t, h, :n] @ vv
    return out, lse, probs


def hand_case():
    """One sequence of 3 tokens in blocks [2, 0] (P = 2); block 1 and block 0's slot 1 are NaN."""
    k = np.full((1, 3, 2, 2), np.nan, np.float32)
    v = np.full((1, 3, 2, 2), np.nan, np.float32)
    # positions 0, 1 live in block 2, position 2 in block 0 slot 0
    k[0, 2, 0], k[0, 2, 1], k[0, 0, 0] = [0, 0], [1, 0], [2, 0]
    v[0, 2, 0], v[0, 2, 1], v[0, 0, 0] = [1, 0], [0, 1], [1, 1]
    tables = np.array([[2, 0, INVALID]], np.int32)
    return k, v, tables, np.array([3], np.int32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_worked_decode(backend):
    k, v, tables, lengths = hand_case()
    q = np.array([[[1.0, 0.0]]], np.float32)  # [B=1, Hq=1, D=2]
    if backend == "reference":
        out, aux = pa.decode(q, k, v, tables, lengths, sm_scale=1.0, mass="block", backend=backend)
    else:
        out, aux = _pallas_tiny(q, k, v, tables, lengths)
        assert np.all(np.asarray(out)[0, 0, 2:] == 0)  # the zero padding channels stay zero
    # q.k = [0, 1, 2] -> softmax = [1, e, e^2] / (1 + e + e^2) = [0.0900, 0.2447, 0.6652]
    z = 1 + math.e + math.e**2
    p = np.array([1, math.e, math.e**2]) / z
    # out = p0 [1,0] + p1 [0,1] + p2 [1,1] = [p0 + p2, p1 + p2] = [0.7553, 0.9100]
    np.testing.assert_allclose(out[0, 0, :2], [p[0] + p[2], p[1] + p[2]], rtol=1e-6)
    np.testing.assert_allclose(aux.lse[0, 0], math.log(z), rtol=1e-6)  # 2.4076
    # block mass: column 0 (block 2) holds positions 0, 1; column 1 (block 0) position 2
    np.testing.assert_allclose(aux.mass[0, 0], [p[0] + p[1], p[2], 0.0], rtol=1e-6, atol=1e-7)


def _pallas_tiny(q, k, v, tables, lengths):
    """The hand case at Pallas-legal sizes: D padded with zero channels to 16, P kept at 2."""
    pad = lambda x: np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 14)])
    return pa.decode(pad(q), pad(k), pad(v), tables, lengths, sm_scale=1.0, mass="block",
                     backend="pallas")


def test_hand_worked_prefill():
    """Chunk of 2 queries at positions 1, 2 over the hand case: row 0 sees 2 keys, row 1 sees 3."""
    k, v, tables, lengths = hand_case()
    q = np.array([[[[1.0, 0.0]], [[1.0, 0.0]]]], np.float32)  # [B=1, T=2, Hq=1, D=2]
    out, aux = pa.prefill(q, k, v, tables, lengths, np.array([1], np.int32), sm_scale=1.0,
                          mass="token")
    # row 0 (position 1): softmax([0, 1]) = [1, e] / (1 + e); out = [1, e] / (1 + e)
    np.testing.assert_allclose(out[0, 0, 0], np.array([1, math.e]) / (1 + math.e), rtol=1e-6)
    z = 1 + math.e + math.e**2
    np.testing.assert_allclose(out[0, 1, 0], [(1 + math.e**2) / z, (math.e + math.e**2) / z],
                               rtol=1e-6)
    # token mass sums the two rows: slot 0: 1/(1+e) + 1/z, slot 1: e/(1+e) + e/z, slot 2: e^2/z
    want = [1 / (1 + math.e) + 1 / z, math.e / (1 + math.e) + math.e / z, math.e**2 / z]
    np.testing.assert_allclose(aux.mass[0, 0, :3], want, rtol=1e-6)
    np.testing.assert_allclose(aux.mass[0, 0, 3:], 0.0)


@pytest.mark.parametrize("pool_dot", [False, True])
@pytest.mark.parametrize("past_length", ["sentinel", "arbitrary"])
@pytest.mark.parametrize("kv_heads,q_heads,page_size", [(1, 1, 8), (3, 9, 16), (2, 14, 32)])
def test_decode_matches_numpy(kv_heads, q_heads, page_size, past_length, pool_dot):
    c = make_case(1, batch=7, q_heads=q_heads, kv_heads=kv_heads, page_size=page_size,
                  max_blocks=4, past_length=past_length)
    out, aux = pa.decode_reference(c.q, c.k_pages, c.v_pages, c.block_tables, c.lengths,
                                   mass="token", pool_dot=pool_dot)
    scale = 1 / math.sqrt(c.q.shape[-1])
    want, lse, probs = numpy_attention(c.q[:, None], c.k_dense, c.v_dense,
                                       (c.lengths - 1)[:, None], c.lengths, scale)
    assert_close(out, want[:, 0], np.float32, "out")
    np.testing.assert_allclose(np.asarray(aux.lse), lse[:, 0], rtol=1e-5, atol=1e-5)
    g = q_heads // kv_heads
    mass = probs[:, 0].reshape(7, kv_heads, g, -1).mean(2)
    assert_close(aux.mass, mass, np.float32, "token mass")


def test_length_zero_gives_zeros():
    c = make_case(2, batch=3, lengths=[0, 5, 0])
    out, aux = pa.decode(c.q, c.k_pages, c.v_pages, c.block_tables, c.lengths, mass="block")
    assert np.all(np.asarray(out)[[0, 2]] == 0)
    assert np.all(np.isneginf(np.asarray(aux.lse)[[0, 2]]))
    assert np.all(np.asarray(aux.mass)[[0, 2]] == 0)
    assert np.all(np.asarray(aux.mass)[1].sum(-1) > 0.999)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_prefill_matches_dense_causal(dtype):
    """Chunk at q_start .. lengths-1 against prefix + chunk, with padding rows past the end."""
    dtype = jnp.dtype(dtype)
    c = make_case(3, batch=4, q_heads=6, kv_heads=2, page_size=8, max_blocks=5,
                  lengths=[13, 40, 1, 0], query_len=6, dtype=dtype)
    q_start = np.array([9, 34, 0, 0], np.int32)  # chunks of 4, 6, 1 and 0 valid rows
    out, aux = pa.prefill(c.q, c.k_pages, c.v_pages, c.block_tables, c.lengths, q_start,
                          mass="block")
    pos = q_start[:, None] + np.arange(6)[None]
    pos = np.where(pos < c.lengths[:, None], pos, -1)
    want, lse, probs = numpy_attention(np.asarray(c.q, np.float32), c.k_dense, c.v_dense, pos,
                                       c.lengths, 1 / 8)
    assert_close(out, want, dtype, "prefill out")
    assert np.all(np.asarray(out)[pos < 0] == 0)
    # mass: probabilities summed over valid rows, mean over the group's heads, per block
    block = probs.reshape(4, 6, 2, 3, 5, 8).mean(3).sum((1, 4))
    assert_close(aux.mass, block, dtype, "block mass")
    np.testing.assert_allclose(np.asarray(aux.mass).sum(-1), np.repeat(
        (pos >= 0).sum(1)[:, None], 2, 1), rtol=1e-5)


def test_merge_two_pools_equals_union():
    """A sequence's blocks split over two pools: attend per pool, merge by lse = attend to all."""
    c = make_case(4, batch=3, q_heads=6, kv_heads=2, page_size=8, max_blocks=6,
                  lengths=[41, 8, 3])
    full, aux = pa.decode(c.q, c.k_pages, c.v_pages, c.block_tables, c.lengths, return_lse=True)
    split = np.array([2, 1, 0])  # blocks before `split` stay in pool A, the rest go to pool B
    tables_a = np.full_like(c.block_tables, INVALID)
    tables_b = np.full_like(c.block_tables, INVALID)
    len_a = np.minimum(split * 8, c.lengths).astype(np.int32)
    len_b = (c.lengths - len_a).astype(np.int32)
    for b in range(3):
        tables_a[b, : split[b]] = c.block_tables[b, : split[b]]
        rest = c.block_tables[b, split[b]:]
        tables_b[b, : len(rest)] = rest
    # pool B is a copy holding only B's blocks (NaN elsewhere), as a second pool would
    keep_b = np.zeros(c.k_pages.shape[1], bool)
    for b in range(3):
        keep_b[tables_b[b][: -(-len_b[b] // 8)]] = True
    k_b = np.where(keep_b[None, :, None, None], c.k_pages, np.nan)
    v_b = np.where(keep_b[None, :, None, None], c.v_pages, np.nan)
    out_a, aux_a = pa.decode(c.q, c.k_pages, c.v_pages, tables_a, len_a, return_lse=True)
    out_b, aux_b = pa.decode(c.q, k_b, v_b, tables_b, len_b, return_lse=True)
    assert np.isneginf(np.asarray(aux_a.lse)[2]).all()  # sequence 2 has nothing in pool A
    merged, lse = pa.merge_attention([out_a, out_b], [aux_a.lse, aux_b.lse])
    assert_close(merged, full, np.float32, "merged out")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(aux.lse), rtol=1e-5, atol=1e-5)


def test_merge_of_empty_parts_is_empty():
    out = jnp.full((2, 3), jnp.nan)
    merged, lse = pa.merge_attention([out, out], [jnp.full((2,), -jnp.inf)] * 2)
    assert np.all(np.asarray(merged) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_reference_is_jittable_under_outer_jit():
    """The model calls decode inside its own jit with a layer slice of the state's pages."""
    import jax

    c = make_case(5, batch=2, lengths=[17, 30])
    k = np.stack([c.k_pages, c.k_pages])  # [L, Hkv, N, P, D]
    v = np.stack([c.v_pages, c.v_pages])

    @jax.jit
    def step(q, k, v, tables, lengths):
        return pa.decode(q, k[1], v[1], tables, lengths)

    got = step(c.q, k, v, c.block_tables, c.lengths)
    want = pa.decode(c.q, c.k_pages, c.v_pages, c.block_tables, c.lengths)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("chunk_pages,pool_dot", [(1, False), (2, False), (3, False), (7, True)])
def test_chunked_walk_equals_one_pass(chunk_pages, pool_dot):
    """The reference walks long tables in chunks (online softmax), or takes all logits by one
    dot over the pool; every way gives the one-pass gather's result."""
    c = make_case(6, batch=5, q_heads=6, kv_heads=2, page_size=8, max_blocks=7,
                  lengths=[0, 1, 8, 56, 30], past_length="arbitrary", query_len=4)
    q_start = np.maximum(c.lengths - 3, 0).astype(np.int32)
    args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.lengths, q_start)
    one, one_aux = pa.prefill_reference(*args, mass="token", chunk_pages=7, pool_dot=False)
    got, aux = pa.prefill_reference(*args, mass="token", chunk_pages=chunk_pages,
                                    pool_dot=pool_dot)
    assert_close(got, one, np.float32, "prefill out")
    assert_close(aux.mass, one_aux.mass, np.float32, "token mass")
    np.testing.assert_allclose(np.asarray(aux.lse), np.asarray(one_aux.lse), rtol=1e-6)
    dq = c.q[:, 0]
    one, one_aux = pa.decode_reference(dq, *args[1:5], mass="block", chunk_pages=7,
                                       pool_dot=False)
    got, aux = pa.decode_reference(dq, *args[1:5], mass="block", chunk_pages=chunk_pages,
                                   pool_dot=pool_dot)
    assert_close(got, one, np.float32, "decode out")
    assert_close(aux.mass, one_aux.mass, np.float32, "block mass")


def test_random_cases_match_numpy():
    """Random shapes, lengths, tables and chunkings (hypothesis) against the float64 oracle."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=8, deadline=None, derandomize=True)
    @given(
        seed=st.integers(0, 2**16),
        kv_heads=st.sampled_from([1, 2]),
        ratio=st.sampled_from([1, 3]),
        page_size=st.sampled_from([4, 8]),
        max_blocks=st.integers(1, 5),
        query_len=st.integers(1, 4),
        chunk_pages=st.sampled_from([None, 1, 2]),
        past_length=st.sampled_from(["sentinel", "arbitrary"]),
        data=st.data(),
    )
    def check(seed, kv_heads, ratio, page_size, max_blocks, query_len, chunk_pages,
              past_length, data):
        cap = page_size * max_blocks
        lengths = data.draw(st.lists(st.integers(0, cap), min_size=1, max_size=3))
        c = make_case(seed, batch=len(lengths), q_heads=kv_heads * ratio, kv_heads=kv_heads,
                      head_dim=16, page_size=page_size, max_blocks=max_blocks, lengths=lengths,
                      past_length=past_length, query_len=query_len)
        q_start = np.array([data.draw(st.integers(0, max(n, 0))) for n in c.lengths], np.int32)
        out, aux = pa.prefill_reference(c.q, c.k_pages, c.v_pages, c.block_tables, c.lengths,
                                        q_start, mass="block", chunk_pages=chunk_pages)
        pos = q_start[:, None] + np.arange(query_len)[None]
        pos = np.where(pos < c.lengths[:, None], pos, -1)
        want, lse, probs = numpy_attention(c.q, c.k_dense, c.v_dense, pos, c.lengths, 0.25)
        assert_close(out, want, np.float32, "out")
        b = len(lengths)
        block = probs.reshape(b, query_len, kv_heads, ratio, max_blocks, page_size)
        assert_close(aux.mass, block.mean(3).sum((1, 4)), np.float32, "block mass")

    check()
