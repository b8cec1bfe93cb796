"""Attention mass from the decode path (`Decoder(with_mass=True)`) and its recording into the
state (`PagedEngine(record_attention=True)`), tiny model, f32, reference kernels unless named.

The oracle is a dense recomputation from the model's own pieces: the layers run one at a time
(`DecoderLayer` over a `DenseKV` holding the K/V the paged step wrote, gathered through the
table), each layer's queries rebuilt from its params (norm, q projection, RoPE), the softmax
over the cached keys taken densely and averaged over each group's query heads: per layer and KV
head, as the decoder returns it. Mixed pools: the mixed state's mass against the oracle's on the single-pool
state holding the dequantized pages (`test_mixed_pools`' surgery), i.e. the per-pool masses
weighted by exp(lse_pool - lse_merged) and mapped back to table columns.

Tolerance: per-token masses in [0, 1] per layer and KV head, f32; both sides take the
same softmax in another order (online over table chunks vs one dense pass in f64; per-pool
parts merged vs one pool), the oracle's layer inputs through the dense attention path: measured
max |diff| 1.5e-7 (single pool, tiny-qwen-untied) and 5e-8 (mixed); 1.5e-6 is 10x that. Measured
on purpose-broken variants: pools unweighted ~0.1, compacted columns not mapped back ~0.14,
each pool weighted by its group-mean share instead of per query head ~5e-3.

Prefill (`record_attention=True` records every prompt query too): a token's mass is a sum over
up to 40 queries (values up to ~4.9), so its rounding adds up: measured max |diff| 3.4e-7
against the dense oracle (tiny-qwen) and 1.2e-7 mixed pools against the single-pool oracle;
3.5e-6 is 10x the larger.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import get_model_config
from kvquota import model as M
from kvquota.errors import InvalidArgumentError
from kvquota.model import caches as C
from kvquota.model import decoder as D
from kvquota.sentinel import INVALID
from kvquota.serving import engine as E
from kvquota.state import StateConfig
from tests.model import test_mixed_pools as MP

ATOL = 1.5e-6  # per-token mass vs the dense recomputation (see the module docstring)
PREFILL_ATOL = 3.5e-6  # per-token prefill mass (a sum over <= 40 queries; see the docstring)
P = 8
LENGTHS = (13, 29, 8, 40)  # mid-block, a block boundary (8, 40: the step opens a new block)
BODY_AND_WINDOW = (13, 29, 20, 40)  # prompts split into a body and an 8-token window


@pytest.fixture(autouse=True)
def _f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


# The untied head changes nothing these comparisons look at (both sides share it); it is
# checked against the float64 oracle in the default run (tests/model/test_numpy_oracle.py).
@pytest.fixture(scope="module", params=[
    "tiny-qwen", pytest.param("tiny-qwen-untied", marks=pytest.mark.slow)])
def model(request):
    config = get_model_config(request.param)
    return config, M.init_params(config, seed=3, scale=0.1)


def _engine(config, params, *, record, backend="auto", compressed=(), host_blocks=0):
    sc = StateConfig(model=config, num_blocks=48, block_size=P, max_seqs=6, max_blocks_per_seq=8,
                     num_tenants=1, kv_format="f32", compressed_pools=compressed,
                     host_blocks=host_blocks)
    eng = E.PagedEngine(config, params, sc, chunk_size=16, backend=backend,
                        record_attention=record)
    eng.register_tenant(0, token_quota=10_000, byte_quota=eng.max_byte_quota)
    return eng


def _admitted(eng, lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, eng.config.vocab_size, n)] for n in lengths]
    report, last = eng.admit([0] * len(prompts), prompts)
    assert report.admitted.all()
    return report.seq_id.astype(np.int32), np.asarray(last).argmax(-1).astype(np.int32)


def _dense_chunk_mass(eng, ids, tokens, start, positions, from_query=0):
    """The oracle: mass f64[B, L, Hkv, M*P] of a chunk of queries `tokens` i32[B, T] that `eng`
    just ran at cache indices start + t (i32[B]; logical `positions` i32[B, T]; its state holds
    their K/V, real up to each sequence's length), summed over the real queries at cache index
    >= `from_query` (int or [B]): each the group mean of the dense softmax of the model's own q
    (the layers run densely over the chunk) against the stored K up to the query's own index."""
    cfg, params, sc = eng.config, eng.params, eng.state_config
    n, t = tokens.shape
    lengths = np.asarray(eng.state.seqs.seq_lens)[ids]
    width = sc.max_blocks_per_seq * P
    col = np.arange(width)
    tables = np.asarray(eng.state.seqs.block_tables)[ids][:, col // P]  # [B, C]
    stored = col[None] < lengths[:, None]
    blocks = np.where(stored, tables, 0)
    kv = [np.asarray(getattr(eng.state.pages[0], name))[:, :, blocks, col % P] for name in "kv"]
    kv = [jnp.asarray(np.where(stored[None, None, :, :, None], a, 0.0).transpose(0, 2, 1, 3, 4))
          for a in kv]  # [L, B, Hkv, C, D], zero past the length (unwritten pages may be NaN)
    cache = C.DenseKV(k=kv[0], v=kv[1])
    meta = C.ChunkMeta(start=jnp.asarray(start, jnp.int32),
                       num_new=jnp.asarray(lengths - start, jnp.int32))
    cos, sin = D.rope_tables(jnp.asarray(positions, jnp.int32), cfg.head_dim, cfg.rope_theta)
    h = params["embed"]["embedding"][jnp.asarray(tokens)]
    g = cfg.num_q_heads // cfg.num_kv_heads
    q_idx = start[:, None] + np.arange(t)[None, :]  # [B, T]
    counted = (q_idx < lengths[:, None]) & (q_idx >= np.broadcast_to(from_query, (n,))[:, None])
    visible = (col[None, None, :] <= q_idx[:, :, None]) & counted[..., None]  # [B, T, C]
    mass = np.zeros((n, cfg.num_layers, cfg.num_kv_heads, width), np.float64)
    for layer in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, l=layer: a[l], params["layers"])
        x = nn.RMSNorm(epsilon=cfg.rms_eps).apply({"params": lp["attn_norm"]}, h)
        q = nn.Dense(cfg.num_q_heads * cfg.head_dim, use_bias=cfg.qkv_bias).apply(
            {"params": lp["attn"]["q_proj"]}, x).reshape(n, t, cfg.num_q_heads, -1)
        q = np.asarray(D.apply_rope(q, cos, sin), np.float64).reshape(
            n, t, cfg.num_kv_heads, g, -1)
        k = np.asarray(cache.k[layer], np.float64)  # [B, Hkv, C, D]
        s = np.einsum("btkgd,bkcd->bkgtc", q, k) / np.sqrt(cfg.head_dim)
        s = np.where(visible[:, None, None], s, -np.inf)
        top = s.max(-1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(top), top, 0.0))
        p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)  # uncounted queries: all zero
        mass[:, layer] = p.mean(2).sum(2)
        (h, cache), _ = D.DecoderLayer(cfg).apply({"params": lp}, (h, cache), layer, cos, sin,
                                                  meta)
    return mass


def _dense_mass(eng, ids, tokens):
    """The oracle of the decode step of `tokens` i32[B] just taken by `eng` (ids all real)."""
    lengths = np.asarray(eng.state.seqs.seq_lens)[ids]
    positions = np.asarray(eng.state.seqs.positions)[ids] - 1
    return _dense_chunk_mass(eng, ids, np.asarray(tokens)[:, None], lengths - 1,
                             positions[:, None])


def test_decode_mass_matches_dense_softmax(model):
    """One decode step's mass per layer, KV head and cache index == the dense softmax of the
    model's own q and K; each (layer, head) row sums to 1; nothing past a sequence's length."""
    config, params = model
    eng = _engine(config, params, record=True)
    ids, tokens = _admitted(eng)
    _, logits = eng.decode(ids, tokens)
    got = np.asarray(eng.last_mass)
    lengths = np.asarray(eng.state.seqs.seq_lens)[ids]
    assert got.shape == (len(ids), config.num_layers, config.num_kv_heads, 8 * P)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _dense_mass(eng, ids, tokens), rtol=0, atol=ATOL)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)
    past = np.arange(got.shape[-1])[None] >= lengths[:, None]  # [B, C]
    assert (got.transpose(0, 3, 1, 2)[past] == 0).all()
    assert (got.transpose(0, 3, 1, 2)[~past] > 0).all()
    assert np.isfinite(np.asarray(logits)).all()


def test_padding_rows_get_no_mass(model):
    """An INVALID row of the batch (nothing attended) has mass 0; the others still sum right."""
    config, params = model
    eng = _engine(config, params, record=True)
    ids, tokens = _admitted(eng)
    rows = ids.copy()
    rows[1] = INVALID
    eng.decode(rows, tokens)
    got = np.asarray(eng.last_mass)
    assert (got[1] == 0).all()
    np.testing.assert_allclose(np.delete(got, 1, 0).sum(-1), 1.0, rtol=1e-5)


def test_record_attention_accumulates_per_step_mass(model):
    """N decode steps (two crossing a block boundary, one with a padding row): head_mass read
    through the tables == the sum of the steps' masses per layer and KV head, attn_mass == its
    sum over them; untouched blocks stay zero; the invariants hold (record_attention="decode":
    the prefill records nothing)."""
    config, params = model
    eng = _engine(config, params, record="decode")
    ids, tokens = _admitted(eng)
    want = np.zeros((len(ids), config.num_layers, config.num_kv_heads, 8 * P), np.float32)
    want_sum = np.zeros((len(ids), 8 * P), np.float32)  # summed per step, as attn_mass adds
    for step in range(4):
        rows = ids.copy()
        if step == 2:
            rows[0] = INVALID
        _, logits = eng.decode(rows, tokens)
        mass = np.asarray(eng.last_mass)
        want[rows >= 0] += mass[rows >= 0]
        want_sum[rows >= 0] += mass[rows >= 0].sum((1, 2))
        tokens = np.asarray(logits).argmax(-1).astype(np.int32)
    eng.allocator.check(eng.state)
    lengths = np.asarray(eng.state.seqs.seq_lens)[ids]
    tables = np.asarray(eng.state.seqs.block_tables)[ids]
    acc = np.asarray(eng.state.blocks.attn_mass)
    heads = np.asarray(eng.state.blocks.head_mass)  # [NB, P, L, Hkv]
    seen = np.zeros(acc.shape[0], bool)
    for b in range(len(ids)):
        i = np.arange(lengths[b])
        np.testing.assert_allclose(heads[tables[b, i // P], i % P],
                                   want[b, ..., i], rtol=1e-6, atol=0)  # [len, L, Hkv]
        np.testing.assert_allclose(acc[tables[b, i // P], i % P], want_sum[b, i], rtol=1e-6,
                                   atol=0)
        assert (want[b, ..., lengths[b]:] == 0).all()
        seen[tables[b, : -(-lengths[b] // P)]] = True
    assert (acc[~seen] == 0).all() and (heads[~seen] == 0).all()
    assert acc.sum() == pytest.approx(want.sum(), rel=1e-6)


def test_option_off_changes_nothing(model):
    """record_attention off: attn_mass stays zero, no mass is kept, the forward returns what it
    did; on: the same logits bitwise (the kernels' out does not depend on the mass pass)."""
    config, params = model
    runs = {}
    for record in (False, True):
        eng = _engine(config, params, record=record)
        ids, tokens = _admitted(eng)
        logits = []
        for _ in range(3):
            _, out = eng.decode(ids, tokens)
            logits.append(np.asarray(out))
            tokens = logits[-1].argmax(-1).astype(np.int32)
        runs[record] = logits
        if not record:
            assert eng.last_mass is None
            assert not np.asarray(eng.state.blocks.attn_mass).any()
            assert not np.asarray(eng.state.blocks.head_mass).any()
    for a, b in zip(runs[False], runs[True]):
        np.testing.assert_array_equal(a, b)


def test_with_mass_needs_a_paged_cache(model):
    config, params = model
    dec = D.Decoder(config)
    tokens = jnp.zeros((1, 2), jnp.int32)
    meta = C.ChunkMeta(start=jnp.zeros(1, jnp.int32), num_new=jnp.full(1, 2, jnp.int32))
    with pytest.raises(ValueError, match="with_mass needs a PagedKV cache"):
        dec.apply({"params": params}, tokens, tokens, C.init_dense_cache(config, 1, 4), meta,
                  with_mass=True)


# ---- mixed pools -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_model():
    config = get_model_config("tiny-qwen")  # test_mixed_pools' model
    return config, M.init_params(config, seed=5, scale=0.1)


class _PoolZeroOnly(E.PagedEngine):
    """The oracle engine read through pool 0 alone: the single-pool path (its compressed pools
    are configured but empty)."""

    pool_starts = (0,)


def _mixed_and_oracle(mixed_model, layout, backend="auto"):
    mixed, oracle, ids = MP._scenario(mixed_model, layout, backend=backend)
    for eng in (mixed, oracle):  # the prompts' last chunk (a prefill after the compression)
        MP._chunk(eng, ids, 3 * MP.CHUNK)
    for eng in (mixed, oracle):
        eng._record = eng.state_config  # what record_attention=True sets
    oracle.__class__ = _PoolZeroOnly
    return mixed, oracle, ids


@pytest.mark.parametrize("layout", ["int8", "all"])
def test_mixed_pool_mass_matches_single_pool_and_dense(mixed_model, layout):
    """A table mixing pool-0 and compressed blocks (`test_mixed_pools`' surgery): the merged
    mass by table column == the dequantized single-pool oracle's, and == the dense softmax; rows
    sum to 1 per layer and KV head (so the pools' weights are their shares of the merged
    softmax)."""
    config = mixed_model[0]
    mixed, oracle, ids = _mixed_and_oracle(mixed_model, layout)
    tokens = np.array([3, 1, 4], np.int32)
    for _ in range(2):  # sequence 0 opens pool-0 block 6 on the first step
        _, lm = mixed.decode(ids, tokens)
        _, lo = oracle.decode(ids, tokens)
        got, want = np.asarray(mixed.last_mass), np.asarray(oracle.last_mass)
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
        np.testing.assert_allclose(got, _dense_mass(oracle, ids, tokens), rtol=0, atol=ATOL)
        np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)
        MP._close(np.asarray(lm), np.asarray(lo))
        tokens = np.asarray(lo).argmax(-1).astype(np.int32)
    # the recorded mass lands on the compressed blocks too (by their global ids)
    acc = np.asarray(mixed.state.blocks.attn_mass)
    tables = np.asarray(mixed.state.seqs.block_tables)[ids]
    moved = [tables[row, col] for row, col, *_ in MP.LAYOUTS[layout]]
    assert all(b >= mixed.state_config.num_blocks and acc[b].sum() > 0 for b in moved)
    # (no Allocator.check here: the surgery leaves the ledger of the moved blocks as it was)
    np.testing.assert_allclose(acc.sum(), 2 * len(ids) * config.num_layers
                               * config.num_kv_heads, rtol=1e-5)


def test_mass_through_pallas_kernel(mixed_model):
    """The Pallas kernels (interpreted on CPU) give the reference path's mass, single pool: the
    prefill's recorded into the state, then a decode step's."""
    config, params = mixed_model
    prefill, decode = [], []
    for backend in ("reference", "pallas"):
        eng = _engine(config, params, record=True, backend=backend)
        ids, tokens = _admitted(eng, lengths=(13, 8))
        prefill.append(_recorded(eng, ids)[0])
        eng.decode(ids, tokens)
        decode.append(np.asarray(eng.last_mass))
    assert prefill[0].sum() > 0
    np.testing.assert_allclose(prefill[1], prefill[0], rtol=0, atol=PREFILL_ATOL)
    np.testing.assert_allclose(decode[1], decode[0], rtol=0, atol=ATOL)


def test_mixed_pool_mass_through_pallas_kernel(mixed_model):
    """The same over the Pallas kernels (interpreted on CPU) against the reference oracle."""
    mixed, oracle, ids = _mixed_and_oracle(mixed_model, "all", backend="pallas")
    tokens = np.array([3, 1, 4], np.int32)
    mixed.decode(ids, tokens)
    oracle.decode(ids, tokens)
    np.testing.assert_allclose(np.asarray(mixed.last_mass), np.asarray(oracle.last_mass),
                               rtol=0, atol=ATOL)


# ---- prefill ---------------------------------------------------------------------------------


def _dense_prefill_mass(eng, ids, prompts, from_query=0):
    """The oracle of a prefill of `prompts` from an empty cache (positions = cache indices),
    summed over the queries from `from_query` on (`_dense_chunk_mass`)."""
    t = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), t), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape)
    return _dense_chunk_mass(eng, ids, tokens, np.zeros(len(prompts), np.int64), positions,
                             from_query)


def _recorded(eng, ids):
    """head_mass f32[B, L, Hkv, M*P] and attn_mass f32[B, M*P] of each sequence, read through
    its table (zero past its length)."""
    sc = eng.state_config
    width = sc.max_blocks_per_seq * P
    col = np.arange(width)
    lengths = np.asarray(eng.state.seqs.seq_lens)[ids]
    tables = np.asarray(eng.state.seqs.block_tables)[ids][:, col // P]
    live = col[None] < lengths[:, None]
    at = (np.where(live, tables, 0), np.broadcast_to(col % P, live.shape))
    heads = np.where(live[..., None, None], np.asarray(eng.state.blocks.head_mass)[at], 0.0)
    total = np.where(live, np.asarray(eng.state.blocks.attn_mass)[at], 0.0)
    return heads.transpose(0, 2, 3, 1), total


def test_prefill_mass_matches_dense_causal_softmax(model):
    """A chunked prefill (chunks of 16 over prompts of 8-40 tokens: chunks starting mid-block,
    a block boundary) with record_attention=True: head_mass == the dense oracle's mass summed
    over every prompt query, per layer and KV head (causal: a query gives nothing to later
    tokens); attn_mass == its sum over layers and heads; each (layer, head) receives exactly one
    unit per query; the invariants hold."""
    config, params = model
    eng = _engine(config, params, record=True)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in LENGTHS]
    report, _ = eng.admit([0] * len(prompts), prompts)
    ids = report.seq_id.astype(np.int32)
    eng.allocator.check(eng.state)
    assert eng.last_mass is None  # prefill chunks are no decode step
    heads, total = _recorded(eng, ids)
    want = _dense_prefill_mass(eng, ids, prompts)
    np.testing.assert_allclose(heads, want, rtol=0, atol=PREFILL_ATOL)
    np.testing.assert_allclose(total, heads.sum((1, 2)), rtol=1e-6, atol=0)
    np.testing.assert_allclose(heads.sum(-1), np.broadcast_to(
        np.asarray(LENGTHS, np.float64)[:, None, None], heads.shape[:3]), rtol=1e-5)
    for b, n in enumerate(LENGTHS):  # causal: token i is seen by the n - i queries from i on
        seen_by = (n - np.arange(n)).astype(np.float64)
        assert (heads[b, ..., :n] <= seen_by + 1e-5).all() and (heads[b, ..., :n] > 0).all()


def test_prefill_then_decode_accumulates_every_query(model):
    """Prefill and two decode steps recorded: the state holds the prefill's mass plus each
    step's (`last_mass`); with record_attention="decode" only the steps' (the prefill records
    nothing); the logits are the same bitwise either way."""
    config, params = model
    runs = {}
    for mode in (True, "decode"):
        eng = _engine(config, params, record=mode)
        ids, tokens = _admitted(eng)
        prefill_heads, _ = _recorded(eng, ids)
        steps, logits = np.zeros_like(prefill_heads), []
        for _ in range(2):
            _, out = eng.decode(ids, tokens)
            steps += np.asarray(eng.last_mass)
            logits.append(np.asarray(out))
            tokens = logits[-1].argmax(-1).astype(np.int32)
        eng.allocator.check(eng.state)
        heads, _ = _recorded(eng, ids)
        np.testing.assert_allclose(heads, prefill_heads + steps, rtol=1e-6, atol=1e-6)
        runs[mode] = prefill_heads, logits
    assert runs[True][0].sum() > 0 and not runs["decode"][0].any()
    for a, b in zip(runs[True][1], runs["decode"][1]):
        np.testing.assert_array_equal(a, b)


def test_bad_record_attention_is_a_typed_error(model):
    config, params = model
    with pytest.raises(InvalidArgumentError, match="record_attention"):
        _engine(config, params, record="prefill")


def _record_chunk(eng, ids, start):
    """test_mixed_pools' prefill chunk from `start`, its mass recorded: mass f32[B, L, Hkv, C]."""
    toks, lens = eng._pad_prompts(MP._prompts(eng.config))
    num_new = np.clip(lens - start, 0, MP.CHUNK).astype(np.int32)
    idx = start + np.arange(MP.CHUNK)[None, :].repeat(len(ids), 0)
    tokens = np.take_along_axis(toks, np.minimum(idx, toks.shape[1] - 1), axis=1)
    eng.state, _, mass = E._paged_forward(
        eng.model, eng.params, eng.state, jnp.asarray(ids), jnp.asarray(tokens, jnp.int32),
        jnp.full(len(ids), start, jnp.int32), jnp.asarray(num_new), jnp.asarray(idx, jnp.int32),
        last_only=False, pool_starts=eng.pool_starts, record=eng.state_config)
    return np.asarray(mass), num_new


@pytest.mark.parametrize("layout", ["int8", "all"])
def test_mixed_pool_prefill_mass_matches_single_pool(mixed_model, layout):
    """A prefill chunk over a table mixing pool-0 and compressed blocks: its mass by table
    column (each query weighted per pool by its share of the merged softmax, causal in pool 0)
    == the dequantized single-pool oracle's; one unit per real query per (layer, head)."""
    mixed, oracle, ids = MP._scenario(mixed_model, layout)
    oracle.__class__ = _PoolZeroOnly
    got, num_new = _record_chunk(mixed, ids, 3 * MP.CHUNK)
    want, _ = _record_chunk(oracle, ids, 3 * MP.CHUNK)
    np.testing.assert_allclose(got, want, rtol=0, atol=PREFILL_ATOL)
    np.testing.assert_allclose(got.sum(-1), np.broadcast_to(
        num_new[:, None, None].astype(np.float64), got.shape[:3]), rtol=1e-5)


def test_extend_records_like_prefill_and_the_mode_switches(model):
    """`extend` on an engine recording attention records each chunk as its prefill does: a
    prompt's body unrecorded (record_attention=False), then its last W tokens extended with
    record_attention=True, holds exactly the mass of those W queries (the dense oracle's over
    queries t >= n - W, causal); a bad mode is refused and the mode kept."""
    from kvquota.serving.branching import extend

    config, params = model
    eng = _engine(config, params, record=False)
    w = 8
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in BODY_AND_WINDOW]
    report, _ = eng.admit([0] * len(prompts), [p[:-w] for p in prompts])
    ids = report.seq_id.astype(np.int32)
    assert not _recorded(eng, ids)[0].any()
    eng.record_attention = True
    window = np.asarray([p[-w:] for p in prompts], np.int32)
    extend(eng, ids, window, chunk_size=w)
    eng.allocator.check(eng.state)
    heads, _ = _recorded(eng, ids)
    want = _dense_prefill_mass(eng, ids, prompts, from_query=np.asarray(BODY_AND_WINDOW) - w)
    np.testing.assert_allclose(heads, want, rtol=0, atol=PREFILL_ATOL)
    np.testing.assert_allclose(heads.sum(-1), w, rtol=1e-5)
    with pytest.raises(InvalidArgumentError, match="record_attention"):
        eng.record_attention = "all"
    assert eng.record_attention is True


@pytest.mark.parametrize("pool", ["max", "avg"])
def test_snapkv_published_rule_end_to_end(model, pool):
    """SnapKV as the paper defines it, through the engine: the observation window (the prompt's
    last W = 8 tokens) extended with recording on after an unrecorded body, then `keep_mask`
    keeps in every (layer, KV head) the window and the top of the window queries' mass over the
    prefix, pooled (kernel 7, `pool`) over the prefix alone: NumPy's choice on the recorded
    mass (which the test above checks against the dense oracle)."""
    from kvquota.serving.branching import extend
    from tests.policies.test_scorers import _pool_reference

    config, params = model
    eng = _engine(config, params, record=False)
    w, keep = 8, 20
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in BODY_AND_WINDOW]
    report, _ = eng.admit([0] * len(prompts), [p[:-w] for p in prompts])
    ids = report.seq_id.astype(np.int32)
    eng.record_attention = True
    extend(eng, ids, np.asarray([p[-w:] for p in prompts], np.int32), chunk_size=w)
    heads, _ = _recorded(eng, ids)
    mask = eng.allocator.keep_mask(eng.state, ids, policy="snapkv", keep_tokens=keep, recent=w,
                                   pool=pool)
    for b, n in enumerate(BODY_AND_WINDOW):
        k = min(keep, n)
        for layer, head in np.ndindex(config.num_layers, config.num_kv_heads):
            pooled = _pool_reference(heads[b, layer, head, :n - w].astype(np.float32), 7, pool)
            older = sorted(range(n - w), key=lambda i: (-pooled[i], -i))
            want = sorted(older[:k - w] + list(range(n - w, n)))
            assert np.flatnonzero(mask[b, layer, head]).tolist() == want
