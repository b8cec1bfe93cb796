"""The decoder over mixed pools: a running sequence's table mixes pool-0 and compressed blocks.

Compressed blocks are made by test-only surgery on a prefilled state (the allocator's compress is
not used): a full block's pool-0 pages are quantized into a compressed pool at a chosen local
page, its table entry rewritten to that global id, and its old pool-0 pages filled with NaN (so
any read of them shows). The oracle is the same state with the block left in pool 0 but its pages
replaced by dequantize(quantize(pages)): the same keys and values, attended in one pool.

Tolerances (one per-dtype table, never loosened to pass): logits, mixed vs oracle, float32 —
both sides attend to bit-identical K/V (the kernel dequantizes in f32 exactly what the oracle
stores), so they differ only in summation order (per-pool softmax partials merged by their
log-sum-exp vs one online softmax): a few f32 ulps at the attention output, carried through two
layers and the vocabulary projection. Measured max |diff| ~2e-6 at logits up to ~4
(reference and Pallas-interpreted alike), while the formats' own rounding moves these logits by
~1e-2 (int8), ~5e-2 (fp8) and ~1e-1 (kivi4): a path that read the unquantized pages, or the
wrong ones, fails by orders of magnitude. The tolerance, 2e-5, is 10x the measured gap.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import get_model_config
from kernels.quantization import dequantize_pages, quantize_kv
from kvquota import model as M
from kvquota.model import caches as C
from kvquota.model import decoder as D
from kvquota.sentinel import INVALID
from kvquota.serving import engine as E
from kvquota.state import StateConfig

ATOL = {"float32": 2e-5}  # logits, mixed pools vs the dequantized single-pool oracle
P = 8  # block size
CHUNK = 12  # prefill chunk (not a multiple of P: chunks start mid-block)
LENGTHS = (48, 44, 46)  # three sequences; chunk 4 starts at token 36, in block 4
POOLS = {"int8": 1, "kivi4": 2, "fp8": 3}  # pool index of each compressed format
FORMATS = tuple((name, 8) for name in POOLS)  # compressed_pools of the state


@pytest.fixture(autouse=True)
def _f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def model():
    config = get_model_config("tiny-qwen")
    return config, M.init_params(config, seed=5, scale=0.1)


def _state_config(config, compressed=FORMATS, host_blocks=4):
    return StateConfig(model=config, num_blocks=40, block_size=P, max_seqs=4,
                       max_blocks_per_seq=10, num_tenants=1, kv_format="f32",
                       compressed_pools=compressed, host_blocks=host_blocks)


def _prompts(config):
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in LENGTHS]


def _nan_scales(q):
    if isinstance(q, jax.Array):  # a plain low-precision pool (fp8)
        return jnp.full_like(q, jnp.nan)
    return q.replace(scales=jnp.full_like(q.scales, jnp.nan))


def _nan_fill(state):
    """Pool 0 all NaN, every compressed scale (fp8: value) NaN: only what the model wrote (or
    the surgery placed) may be read."""
    pages = list(state.pages)
    pages[0] = pages[0].replace(k=jnp.full_like(pages[0].k, jnp.nan),
                                v=jnp.full_like(pages[0].v, jnp.nan))
    for p in POOLS.values():
        pages[p] = pages[p].replace(k=_nan_scales(pages[p].k), v=_nan_scales(pages[p].v))
    return state.replace(pages=tuple(pages))


def _prefilled(config, params, sc, chunks=3, backend="auto"):
    """A fresh engine with the three prompts reserved and `chunks` chunks of CHUNK prefilled."""
    eng = E.PagedEngine(config, params, sc, chunk_size=CHUNK, backend=backend)
    eng.register_tenant(0, token_quota=10_000, byte_quota=eng.max_byte_quota)
    if sc.compressed_pools:
        eng.state = _nan_fill(eng.state)
    prompts = _prompts(config)
    report = eng.reserve([0] * len(prompts), prompts)
    eng.prefill(report, prompts, last_only=False, max_chunks=chunks)
    return eng, report.seq_id.astype(np.int32)


def _chunk(eng, ids, start):
    """One prefill chunk of CHUNK tokens from cache index `start` (every row): logits [B, T, V]."""
    toks, lens = eng._pad_prompts(_prompts(eng.config))
    num_new = np.clip(lens - start, 0, CHUNK).astype(np.int32)
    idx = start + np.arange(CHUNK)[None, :].repeat(len(ids), 0)
    tokens = np.take_along_axis(toks, np.minimum(idx, toks.shape[1] - 1), axis=1)
    eng.state, logits = E._paged_forward(
        eng.model, eng.params, eng.state, jnp.asarray(ids), jnp.asarray(tokens, jnp.int32),
        jnp.full(len(ids), start, jnp.int32), jnp.asarray(num_new), jnp.asarray(idx, jnp.int32),
        last_only=False, pool_starts=eng.pool_starts)
    return np.asarray(logits), num_new


def _quantize_block(state, block, fmt):
    """K and V pages of pool-0 block `block`, all layers, quantized (QuantizedPages with a
    leading [L] axis and one page; fp8: plain float8 arrays)."""
    k, v = state.pages[0].k[:, :, block:block + 1], state.pages[0].v[:, :, block:block + 1]
    if fmt == "fp8":
        return k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn)
    per_layer = [quantize_kv(k[l], v[l], fmt) for l in range(k.shape[0])]
    return (jax.tree.map(_stack, *[q[0] for q in per_layer]),
            jax.tree.map(_stack, *[q[1] for q in per_layer]))


def _stack(*xs):
    return jnp.stack(xs)


def _dequantize_layers(q, layers):
    """QuantizedPages with a leading [L] axis (or fp8 pages) -> f32[L, Hkv, N, P, D]."""
    if isinstance(q, jax.Array):
        return q.astype(jnp.float32)
    return jnp.stack([dequantize_pages(jax.tree.map(lambda a, i=i: a[i], q))
                      for i in range(layers)])


def _put_pages(pool, q, local):
    """A compressed pool's K or V with page `local` set to the one page of `q` (fp8 values cast
    to the pool's dtype: `kvquota.pages` stores a plain compressed pool in pool 0's dtype)."""
    return jax.tree.map(lambda a, b: a.at[:, :, local:local + 1].set(b.astype(a.dtype)), pool, q)


def _move(eng, moves, *, oracle: bool):
    """Surgery: for each (seq, column, format, local page), quantize the block's pages. Mixed:
    into the format's pool at `local`, the table entry rewritten to its global id and the old
    pool-0 pages set to NaN. Oracle: the block stays in pool 0 with the dequantized values."""
    sc = eng.state_config
    state = eng.state
    tables = np.asarray(state.seqs.block_tables).copy()
    for seq, col, fmt, local in moves:
        block = int(tables[seq, col])
        assert 0 <= block < sc.num_blocks  # a pool-0 block of the sequence
        qk, qv = _quantize_block(state, block, fmt)
        pages = list(state.pages)
        if oracle:
            layers = sc.model.num_layers
            pages[0] = pages[0].replace(
                k=pages[0].k.at[:, :, block:block + 1].set(_dequantize_layers(qk, layers)),
                v=pages[0].v.at[:, :, block:block + 1].set(_dequantize_layers(qv, layers)))
        else:
            p = POOLS[fmt]
            pages[p] = pages[p].replace(k=_put_pages(pages[p].k, qk, local),
                                        v=_put_pages(pages[p].v, qv, local))
            pages[0] = pages[0].replace(k=pages[0].k.at[:, :, block].set(jnp.nan),
                                        v=pages[0].v.at[:, :, block].set(jnp.nan))
            tables[seq, col] = sc.pool_starts[p] + local
        state = state.replace(pages=tuple(pages))
    eng.state = state.update(block_tables=jnp.asarray(tables))


# (seq row, table column, format, local page): sequence 0 at the front and in the middle,
# sequence 1 a front run (and, in "all", one more after a pool-0 block), sequence 2 none;
# "all" mixes the three compressed pools within one table.
LAYOUTS = {
    "int8": [(0, 0, "int8", 3), (0, 2, "int8", 0), (1, 0, "int8", 7), (1, 1, "int8", 5)],
    "kivi4": [(0, 0, "kivi4", 3), (0, 2, "kivi4", 0), (1, 0, "kivi4", 7), (1, 1, "kivi4", 5)],
    "fp8": [(0, 0, "fp8", 3), (0, 2, "fp8", 0), (1, 0, "fp8", 7), (1, 1, "fp8", 5)],
    "all": [(0, 0, "int8", 2), (0, 2, "kivi4", 4), (1, 0, "fp8", 1), (1, 1, "int8", 6),
            (1, 3, "kivi4", 0)],
}


def _scenario(model, layout, backend="auto"):
    """(mixed engine, oracle engine, seq ids) after 3 prefill chunks and the surgery; `backend`
    is the mixed engine's (the oracle's stays the default)."""
    config, params = model
    sc = _state_config(config)
    mixed, ids = _prefilled(config, params, sc, backend=backend)
    oracle, ids2 = _prefilled(config, params, sc)
    assert np.array_equal(ids, ids2)
    moves = [(int(ids[s]), c, f, loc) for s, c, f, loc in LAYOUTS[layout]]
    _move(mixed, moves, oracle=False)
    _move(oracle, moves, oracle=True)
    return mixed, oracle, ids


def _close(a, b):
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))
    np.testing.assert_allclose(a, b, rtol=0, atol=ATOL["float32"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mixed_pools_match_dequantized_oracle(model, layout):
    """A chunked prefill starting mid-block after compressed blocks, then decode steps (one
    opening a new pool-0 block), give the oracle's logits; the writes land in pool 0."""
    mixed, oracle, ids = _scenario(model, layout)
    start = 3 * CHUNK
    got, num_new = _chunk(mixed, ids, start)
    want, _ = _chunk(oracle, ids, start)
    assert num_new.tolist() == [12, 8, 10]  # every row real, two with padding
    for b in range(len(ids)):
        _close(got[b, :num_new[b]], want[b, :num_new[b]])
    tokens = np.array([3, 1, 4], np.int32)
    for _ in range(2):  # sequence 0 is at 48 = 6 blocks: its first append opens block 6
        rep_m, got = mixed.decode(ids, tokens)
        rep_o, want = oracle.decode(ids, tokens)
        assert rep_m.appended.all() and rep_o.appended.all()
        got, want = np.asarray(got), np.asarray(want)
        _close(got, want)
        tokens = want.argmax(-1).astype(np.int32)
    # Every pool-0 block of the tables holds the oracle's K/V (moved blocks, NaN on the mixed
    # side, are skipped): layer 0's bitwise (a function of tokens and positions alone), later
    # layers' within the tolerance (they see attention outputs). NaN = never written, both sides.
    tables = np.asarray(mixed.state.seqs.block_tables)[ids]
    for b in range(len(ids)):
        for col in range(-(-int(mixed.state.seqs.seq_lens[ids[b]]) // P)):
            blk = tables[b, col]
            assert blk >= 0
            if blk >= mixed.state_config.num_blocks:
                continue
            for name in ("k", "v"):
                m = np.asarray(getattr(mixed.state.pages[0], name)[:, :, blk])
                o = np.asarray(getattr(oracle.state.pages[0], name)[:, :, blk])
                np.testing.assert_array_equal(m[0], o[0])
                np.testing.assert_allclose(m, o, rtol=0, atol=ATOL["float32"])


def test_mixed_pools_through_pallas_kernel(model):
    """The same over the Pallas kernel (interpreted on CPU, lowered on GPU) against the
    reference oracle: the kernel's in-kernel dequantization and lse on the mixed path."""
    mixed, oracle, ids = _scenario(model, "all", backend="pallas")
    got, num_new = _chunk(mixed, ids, 3 * CHUNK)
    want, _ = _chunk(oracle, ids, 3 * CHUNK)
    for b in range(len(ids)):
        _close(got[b, :num_new[b]], want[b, :num_new[b]])
    tokens = np.array([3, 1, 4], np.int32)
    (_, got), (_, want) = mixed.decode(ids, tokens), oracle.decode(ids, tokens)
    _close(np.asarray(got), np.asarray(want))


def test_decode_right_after_compression(model):
    """Compression after the whole prompt is cached: the first decode step's logits."""
    config, params = model
    sc = _state_config(config)
    engines = [_prefilled(config, params, sc, chunks=None) for _ in range(2)]
    ids = engines[0][1]
    moves = [(int(ids[0]), 1, "kivi4", 6), (int(ids[0]), 4, "int8", 1), (int(ids[1]), 0, "int8", 2)]
    _move(engines[0][0], moves, oracle=False)
    _move(engines[1][0], moves, oracle=True)
    tokens = np.array([9, 8, 7], np.int32)
    (_, got), (_, want) = (e.decode(ids, tokens) for e, _ in engines)
    _close(np.asarray(got), np.asarray(want))


def test_padding_rows_and_rows_without_blocks_stay_finite(model):
    """A batch with a padding row (INVALID) and rows holding nothing in a compressed pool:
    no NaN anywhere, the padding row included (its logits mean nothing, but must not poison
    the merge)."""
    mixed, _, ids = _scenario(model, "int8")
    rows = np.array([ids[0], INVALID, ids[2]], np.int32)
    _, logits = mixed.decode(rows, np.array([1, 0, 2], np.int32))
    assert np.all(np.isfinite(np.asarray(logits)))


def test_pool_tables_compacts_each_pool_in_order():
    """Entries in each pool, compacted to the front in order, as local ids; lengths count the
    tokens of held columns only; the sentinel and ids of no given pool (a host block) count
    nowhere."""
    # pools: 0 = [0, 10), 1 = [10, 14), 2 = [20, 24); id 30 is a host block.
    table = jnp.asarray([[11, 3, 20, 4, 12, INVALID],
                         [5, 6, 7, INVALID, INVALID, INVALID],
                         [30, 21, 2, 13, 9, 1],
                         [INVALID] * 6], jnp.int32)
    lengths = jnp.asarray([38, 20, 27, 0], jnp.int32)  # row 2: columns 0-3 held (3 full + 3)
    pt = C.pool_tables(table, lengths, (0, 10, 20), (10, 4, 4), P)
    I = INVALID
    want_tables = [
        [[3, 4, I, I, I, I], [5, 6, 7, I, I, I], [2, I, I, I, I, I], [I] * 6],
        [[1, 2, I, I, I, I], [I] * 6, [3, I, I, I, I, I], [I] * 6],
        [[0, I, I, I, I, I], [I] * 6, [1, I, I, I, I, I], [I] * 6],
    ]
    want_lengths = [[8 + 8, 20, 8, 0], [8 + 6, 0, 3, 0], [8, 0, 8, 0]]
    for p in range(3):
        np.testing.assert_array_equal(np.asarray(pt.tables[p]), want_tables[p])
        np.testing.assert_array_equal(np.asarray(pt.lengths[p]), want_lengths[p])


def test_layout_checked():
    k = jnp.zeros((1, 1, 4, P, 16))
    q = jnp.zeros((1, 1, 2, P, 16))
    with pytest.raises(ValueError, match="inside pool 0"):
        C.PagedKV(k, k, compressed=((q, q),), pool_starts=(0, 3)).check_layout()
    with pytest.raises(ValueError, match="one entry per pool"):
        C.PagedKV(k, k, compressed=((q, q),)).check_layout()
    C.PagedKV(k, k, compressed=((q, q),), pool_starts=(0, 4)).check_layout()


# ---- the single-pool path is the one from before mixed pools -------------------------------


def _legacy_write(cache, layer, k, v, meta):
    """`_paged_write` as it was before mixed pools (verbatim but for the return)."""
    chunk = k.shape[1]
    num_blocks, page = cache.k_pages.shape[2], cache.k_pages.shape[3]
    idx = meta.start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    real = jnp.arange(chunk, dtype=jnp.int32)[None, :] < meta.num_new[:, None]
    max_blocks = meta.block_tables.shape[1]
    slot_of = jnp.clip(idx // page, 0, max_blocks - 1)
    block = jnp.take_along_axis(meta.block_tables, slot_of, axis=1)
    block = jnp.where(real & (block >= 0), block, num_blocks)
    offset = idx % page
    new_k = cache.k_pages.at[layer, :, block, offset, :].set(
        k.astype(cache.k_pages.dtype), mode="drop")
    new_v = cache.v_pages.at[layer, :, block, offset, :].set(
        v.astype(cache.v_pages.dtype), mode="drop")
    return C.PagedKV(k_pages=new_k, v_pages=new_v)


def _legacy_attend(cache, layer, q, meta, sm_scale, backend):
    """`_paged_attend` as it was before mixed pools (verbatim)."""
    from kernels import paged_attention

    k_pages, v_pages = cache.k_pages[layer], cache.v_pages[layer]
    if q.shape[1] == 1:
        out = paged_attention.decode(
            q[:, 0], k_pages, v_pages, meta.block_tables, meta.lengths,
            sm_scale=sm_scale, backend=backend,
        )
        return out[:, None]
    return paged_attention.prefill(
        q, k_pages, v_pages, meta.block_tables, meta.lengths, meta.start,
        sm_scale=sm_scale, backend=backend,
    )


def _apply(model_obj, params, state, ids, tokens, start, num_new):
    """The model on pool 0 of `state`, as the engine builds it, freshly traced (so a patched
    module function is the one used)."""
    tables = state.seqs.block_tables[ids]
    meta = C.ChunkMeta(start=start, num_new=num_new, block_tables=tables)
    cache = C.PagedKV(k_pages=state.pages[0].k, v_pages=state.pages[0].v)
    fn = jax.jit(lambda p, c, m: model_obj.apply({"params": p}, tokens, start[:, None]
                                                 + jnp.arange(tokens.shape[1])[None, :], c, m))
    logits, cache = fn(params, cache, meta)
    return np.asarray(logits), np.asarray(cache.k_pages), np.asarray(cache.v_pages)


@pytest.mark.parametrize("chunk", [1, CHUNK])
def test_single_pool_path_unchanged(model, monkeypatch, chunk):
    """No compressed pool: logits and written pages bitwise equal to the pre-mixed-pools code."""
    config, params = model
    eng, ids = _prefilled(config, params, _state_config(config, compressed=(), host_blocks=0))
    state = eng.state
    start = jnp.full(len(ids), 3 * CHUNK, jnp.int32)
    num_new = jnp.asarray([chunk, max(chunk - 4, 1), 0], jnp.int32)
    tokens = jnp.asarray(np.arange(len(ids) * chunk).reshape(len(ids), chunk) % 200, jnp.int32)
    ids = jnp.asarray(ids)
    new = _apply(eng.model, eng.params, state, ids, tokens, start, num_new)
    monkeypatch.setattr(D, "_paged_write", _legacy_write)
    monkeypatch.setattr(D, "_paged_attend", _legacy_attend)
    old = _apply(eng.model, eng.params, state, ids, tokens, start, num_new)
    for a, b in zip(new, old):
        np.testing.assert_array_equal(a, b)


def test_unused_compressed_pools_change_nothing(model):
    """Compressed pools configured but no block in them: the mixed path (empty pools merged
    with weight 0, their kernels skipped) gives the single-pool logits exactly."""
    config, params = model
    prompts = _prompts(config)
    out = []
    for compressed in (FORMATS, ()):
        eng = E.PagedEngine(config, params, _state_config(config, compressed), chunk_size=CHUNK)
        eng.register_tenant(0, token_quota=10_000, byte_quota=eng.max_byte_quota)
        report, chunks = eng.admit([0, 0, 0], prompts, last_only=False)
        _, logits = eng.decode(report.seq_id, np.array([5, 6, 7], np.int32))
        out.append([np.asarray(c) for c in chunks] + [np.asarray(logits)])
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)
