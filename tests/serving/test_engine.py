"""The decoder on the paged state vs the same decoder on a plain contiguous cache (tiny models).

Float tolerances come from one per-dtype table and are never loosened to pass. Pages not yet
written are filled with NaN, so an attention read of a slot it should not see shows up.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import get_model_config
from kvquota import serving as E
from kvquota import model as M
from kvquota.errors import ContextTooLongError
from kvquota.state import StateConfig

ATOL = {"float32": 1e-4}  # logits, paged vs dense (issue #5)


@pytest.fixture(autouse=True)
def _f32_matmuls():
    """f32 tests compute in f32: on GPU, XLA's default matmul precision may round operands to
    TF32, which would test the hardware's rounding instead of the cache (CPU: no change)."""
    with jax.default_matmul_precision("highest"):
        yield


def _prompts(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def _nan_pages(engine):
    """Fills the state's pages with NaN: only slots the model wrote may ever be read."""
    s = engine.state
    engine.state = s.replace(pages=(s.pages[0].replace(k=jnp.full_like(s.pages[0].k, jnp.nan),
                                                       v=jnp.full_like(s.pages[0].v, jnp.nan)),) + s.pages[1:])


def _paged(config, params, *, tenants=4, share=None, num_blocks=96, block_size=8, chunk=16):
    sc = StateConfig(model=config, num_blocks=num_blocks, block_size=block_size, max_seqs=8,
                     max_blocks_per_seq=24, num_tenants=tenants, kv_format="f32")
    eng = E.PagedEngine(config, params, sc, chunk_size=chunk)
    for t in range(tenants):
        group = None if share is None else share.get(t)
        eng.register_tenant(t, token_quota=10_000, byte_quota=eng.max_byte_quota,
                            share_group=group)
    _nan_pages(eng)
    return eng


# The untied head changes nothing these comparisons look at (both sides share it); it is
# checked against the float64 oracle in the default run (tests/model/test_numpy_oracle.py).
@pytest.fixture(scope="module", params=[
    "tiny-qwen", pytest.param("tiny-qwen-untied", marks=pytest.mark.slow)])
def model(request):
    config = get_model_config(request.param)
    return config, M.init_params(config, seed=11, scale=0.1)


def test_dense_chunking_does_not_change_logits():
    """Prefill in chunks of 16 (and 64) == one pass: the dense reference itself is consistent."""
    config = get_model_config("tiny-qwen-untied")
    params = M.init_params(config, seed=11, scale=0.1)
    prompts = _prompts(config.vocab_size, [29, 11], seed=0)
    small = E.DenseEngine(config, params, capacity=64, chunk_size=16).prefill(
        prompts, last_only=False)
    whole = E.DenseEngine(config, params, capacity=64, chunk_size=64).prefill(
        prompts, last_only=False)
    small = np.concatenate([np.asarray(c) for c in small], axis=1)[:, :29]
    whole = np.asarray(whole[0])[:, :29]
    for b, n in enumerate([29, 11]):
        np.testing.assert_allclose(small[b, :n], whole[b, :n], rtol=0, atol=ATOL["float32"])


def test_paged_matches_dense_mixed_batch(model):
    """A batch of three tenants with prompts of 37, 5 and 20 tokens (chunks of 16, blocks of 8):
    prefill logits and every decode step's logits within 1e-4, same greedy tokens."""
    config, params = model
    prompts = _prompts(config.vocab_size, [37, 5, 20], seed=1)
    paged = _paged(config, params)
    dense = E.DenseEngine(config, params, capacity=64, chunk_size=16)

    report, chunks = paged.admit([0, 1, 2], prompts, last_only=False)
    assert report.admitted.all() and (report.cached_tokens == 0).all()
    paged.allocator.check(paged.state)
    ref = dense.prefill(prompts, last_only=False)
    got = np.concatenate([np.asarray(c) for c in chunks], axis=1)
    want = np.concatenate([np.asarray(c) for c in ref], axis=1)
    for b, n in enumerate([37, 5, 20]):
        assert np.isfinite(got[b, :n]).all()
        np.testing.assert_allclose(got[b, :n], want[b, :n], rtol=0, atol=ATOL["float32"])

    # Greedy decode, step by step, on both caches; row 1 sits out steps 2..3 (padding row).
    seq_ids = report.seq_id.astype(np.int32)
    last_p = np.stack([got[b, n - 1] for b, n in enumerate([37, 5, 20])])
    last_d = np.stack([want[b, n - 1] for b, n in enumerate([37, 5, 20])])
    for step in range(6):
        tok_p, tok_d = last_p.argmax(-1), last_d.argmax(-1)
        np.testing.assert_array_equal(tok_p, tok_d)
        skip = np.array([False, step in (2, 3), False])
        rep, lp = paged.decode(np.where(skip, -1, seq_ids), tok_p.astype(np.int32))
        ld = dense.decode(np.where(skip, -1, np.arange(3)), tok_d.astype(np.int32))
        assert (rep.appended == ~skip).all()
        paged.allocator.check(paged.state)
        lp, ld = np.asarray(lp), np.asarray(ld)
        np.testing.assert_allclose(lp[~skip], ld[~skip], rtol=0, atol=ATOL["float32"])
        last_p = np.where(skip[:, None], last_p, lp)
        last_d = np.where(skip[:, None], last_d, ld)

    # The K/V the paged path wrote sit exactly where the state's block tables say.
    state = paged.state
    for b in range(3):
        sid = int(seq_ids[b])
        n = int(state.seqs.seq_lens[sid])
        assert n == dense._lens[b]
        blocks = np.asarray(state.seqs.block_tables[sid])
        idx = np.arange(n)
        k_paged = np.asarray(state.pages[0].k)[:, :, blocks[idx // 8], idx % 8]  # [L, Hkv, n, D]
        k_dense = np.asarray(dense.cache.k)[:, b, :, :n]
        np.testing.assert_allclose(k_paged, k_dense, rtol=0, atol=ATOL["float32"])


def test_generate_paged_equals_dense_greedy():
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=11, scale=0.1)
    prompts = _prompts(config.vocab_size, [9, 30], seed=2)
    paged = _paged(config, params)
    got = paged.generate(prompts, 10, tenants=[0, 3])
    want = E.DenseEngine(config, params, capacity=64, chunk_size=16).generate(prompts, 10)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert all(g.finish == "length" and len(g.tokens) == 10 for g in got)
    # Released at the end: the ledger is back to zero and the invariants hold.
    assert int(np.asarray(paged.state.tenants.used_tokens).sum()) == 0
    paged.allocator.check(paged.state)


def test_prefix_cache_hit_across_shared_tenants_equals_recompute():
    """Tenants 0 and 1 share a salt (group 5), tenant 2 is private. Tenant 1's prompt starts with
    the 24-token system prompt tenant 0 prefilled: 3 full blocks of 8 are hits, and its logits
    (prefill and decode) equal a recomputation from scratch; tenant 2 gets no hit."""
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=5, scale=0.1)
    system = _prompts(config.vocab_size, [26], seed=3)[0]
    q0, q1 = _prompts(config.vocab_size, [7, 12], seed=4)
    eng = _paged(config, params, share={0: 5, 1: 5})
    r0, _ = eng.admit([0], [system + q0])
    assert r0.cached_tokens[0] == 0
    r1, chunks = eng.admit([1], [system + q1], last_only=False)
    assert r1.cached_tokens[0] == 24 and r1.hit_blocks[0] == 3
    r2, _ = eng.admit([2], [system + q1])
    assert r2.cached_tokens[0] == 0  # private salt: no cross-tenant hit
    eng.allocator.check(eng.state)

    fresh = _paged(config, params)
    rf, ref_chunks = fresh.admit([1], [system + q1], last_only=False)
    assert rf.cached_tokens[0] == 0
    n = len(system + q1)
    got = np.concatenate([np.asarray(c)[0] for c in chunks])[: n - 24]  # positions 24..n-1
    want = np.concatenate([np.asarray(c)[0] for c in ref_chunks])[24:n]
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL["float32"])
    # Decoding on top of the shared blocks also matches.
    tok = np.array([int(want[-1].argmax())], np.int32)
    _, lg = eng.decode(r1.seq_id[:1].astype(np.int32), tok)
    _, lf = fresh.decode(rf.seq_id[:1].astype(np.int32), tok)
    eng.allocator.check(eng.state)
    fresh.allocator.check(fresh.state)
    np.testing.assert_allclose(np.asarray(lg), np.asarray(lf), rtol=0, atol=ATOL["float32"])


def test_quota_refusals_are_reported():
    """An admit over the token quota is refused; a decode that would exceed it stops the row."""
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=6, scale=0.1)
    sc = StateConfig(model=config, num_blocks=32, block_size=8, max_seqs=4,
                     max_blocks_per_seq=8, num_tenants=2, kv_format="f32")
    eng = E.PagedEngine(config, params, sc, chunk_size=16)
    eng.register_tenant(0, token_quota=12, byte_quota=eng.max_byte_quota)
    eng.register_tenant(1, token_quota=5, byte_quota=eng.max_byte_quota)
    prompts = _prompts(config.vocab_size, [9, 9], seed=7)
    out = eng.generate(prompts, 8, tenants=[0, 1])
    assert out[0].finish.startswith("append refused: over token quota")
    assert len(out[0].tokens) == 4  # 9 prompt tokens + 3 appended = 12; the 4th is sampled only
    assert out[1].finish.startswith("refused: over token quota") and out[1].tokens == []
    eng.allocator.check(eng.state)


def test_sampling_is_seeded():
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=8, scale=0.1)
    dense = E.DenseEngine(config, params, capacity=48, chunk_size=16)
    prompts = _prompts(config.vocab_size, [6, 6], seed=9)
    hot = lambda seed: E.Sampling(temperature=1.5, seed=seed)  # noqa: E731
    a = [g.tokens for g in dense.generate(prompts, 12, sampling=hot(1))]
    b = [g.tokens for g in dense.generate(prompts, 12, sampling=hot(1))]
    c = [g.tokens for g in dense.generate(prompts, 12, sampling=hot(2))]
    assert a == b and a != c
    greedy = [g.tokens for g in dense.generate(prompts, 12)]
    top1 = [g.tokens for g in dense.generate(prompts, 12, sampling=E.Sampling(1.0, top_k=1))]
    assert greedy == top1
    with pytest.raises(ValueError, match="temperature"):
        E.Sampling(temperature=-1.0)


def test_stop_ids_end_generation():
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=10, scale=0.1)
    dense = E.DenseEngine(config, params, capacity=48, chunk_size=16)
    prompt = _prompts(config.vocab_size, [6], seed=12)
    free_run = dense.generate(prompt, 6)[0].tokens
    out = dense.generate(prompt, 6, stop_ids=[free_run[2]])[0]
    assert out.finish == "stop" and out.tokens == free_run[: free_run.index(free_run[2]) + 1]


def test_context_past_the_preset_limit_is_refused():
    config = get_model_config("tiny-qwen")  # max_context 512
    params = M.init_params(config, seed=0)
    with pytest.raises(ContextTooLongError, match="max_context 512"):
        E.score(config, params, [1] * 513)
    with pytest.raises(ContextTooLongError, match="max_context 512"):
        E.generate(config, params, [[1] * 500], 13)
    with pytest.raises(ContextTooLongError):
        E.DenseEngine(config, params, capacity=1024)
    with pytest.raises(ValueError, match="outside"):
        E.generate(config, params, [[config.vocab_size]], 1)


def test_rope_uses_logical_positions():
    """RoPE is relative: shifting every logical position by 100 leaves the logits unchanged
    (up to rounding of the angles), doubling them does not. The cache indices are the same in
    all three calls, so it is the positions argument that drives RoPE."""
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=13, scale=0.1)
    dec = M.Decoder(config)
    toks = jnp.asarray(_prompts(config.vocab_size, [10], seed=14), jnp.int32)
    meta = M.ChunkMeta(start=jnp.zeros((1,), jnp.int32), num_new=jnp.full((1,), 10, jnp.int32))
    cache = M.init_dense_cache(config, 1, 16)
    pos = jnp.arange(10, dtype=jnp.int32)[None]
    apply = jax.jit(dec.apply)
    base, _ = apply({"params": params}, toks, pos, cache, meta)
    shifted, _ = apply({"params": params}, toks, pos + 100, cache, meta)
    scaled, _ = apply({"params": params}, toks, pos * 2, cache, meta)
    np.testing.assert_allclose(np.asarray(base), np.asarray(shifted), rtol=0, atol=ATOL["float32"])
    assert np.abs(np.asarray(base) - np.asarray(scaled)).max() > 1e-3


def test_generation_past_the_cache_capacity_is_refused_up_front():
    """A prompt plus max_new_tokens that cannot fit the block table (or the dense capacity)
    raises before anything is admitted, instead of failing mid-generation."""
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=0)
    sc = StateConfig(model=config, num_blocks=8, block_size=8, max_seqs=2,
                     max_blocks_per_seq=4, num_tenants=1, kv_format="f32")
    eng = E.PagedEngine(config, params, sc, chunk_size=16)
    eng.register_tenant(0, token_quota=100, byte_quota=eng.max_byte_quota)
    with pytest.raises(ContextTooLongError, match="holds 32 per sequence"):
        eng.generate([[1] * 30], 4, tenants=[0])  # 30 + 3 appended > 32
    assert int(np.asarray(eng.state.seqs.seq_status).sum()) == 0  # nothing admitted
    with pytest.raises(ContextTooLongError, match="holds 16 per sequence"):
        E.DenseEngine(config, params, capacity=16).generate([[1] * 10], 8)
    # Exactly full is fine: 29 + 3 appended = 32 slots (the 4th token is only sampled).
    assert len(eng.generate([[1] * 29], 4, tenants=[0])[0].tokens) == 4


def test_rope_theta_reaches_the_model():
    """The preset's RoPE theta drives the rotation: the tables are cos/sin of position x
    theta^(-2i/D) for that theta, and the same params under another theta give other logits
    (a theta hard-coded anywhere between the preset and the tables would make them equal)."""
    config = get_model_config("tiny-qwen")  # its own theta (5e3) is replaced below
    pos = jnp.asarray([[0, 1, 7, 300]], jnp.int32)
    for theta in (1e4, 1e5, 1e6):
        cos, sin = M.rope_tables(pos, config.head_dim, theta)
        inv = theta ** (-np.arange(0, config.head_dim, 2) / config.head_dim)
        ang = np.asarray(pos, np.float64)[..., None] * inv
        np.testing.assert_allclose(np.asarray(cos), np.cos(ang), rtol=0, atol=1e-4)
        np.testing.assert_allclose(np.asarray(sin), np.sin(ang), rtol=0, atol=1e-4)
    params = M.init_params(config, seed=13, scale=0.1)
    toks = jnp.asarray(_prompts(config.vocab_size, [24], seed=14), jnp.int32)
    meta = M.ChunkMeta(start=jnp.zeros((1,), jnp.int32), num_new=jnp.full((1,), 24, jnp.int32))
    pos = jnp.arange(24, dtype=jnp.int32)[None]
    logits = {}
    for theta in (1e4, 1e6):
        cfg = dataclasses.replace(config, rope_theta=theta)
        logits[theta], _ = jax.jit(M.Decoder(cfg).apply)(
            {"params": params}, toks, pos, M.init_dense_cache(cfg, 1, 24), meta)
    assert np.abs(np.asarray(logits[1e4]) - np.asarray(logits[1e6])).max() > 1e-2


def test_block_aligned_repeated_prompt_computes_its_last_token():
    """A prompt of exactly 2 blocks sent again by the same tenant: every block is in the prefix
    cache, yet only the first may be a hit -- the last block is recomputed so the last prompt
    token has logits. They equal the first admission's, the greedy continuation equals the
    dense reference's, and with NaN-filled unwritten pages nothing unwritten is read."""
    config = get_model_config("tiny-qwen")
    params = M.init_params(config, seed=15, scale=0.1)
    prompt = _prompts(config.vocab_size, [16], seed=16)[0]  # 2 blocks of 8
    eng = _paged(config, params)
    r0, last0 = eng.admit([0], [prompt])
    assert r0.cached_tokens[0] == 0
    r1, last1 = eng.admit([0], [prompt])
    eng.allocator.check(eng.state)
    assert r1.admitted[0] and r1.cached_tokens[0] == 8 and r1.hit_blocks[0] == 1
    assert r1.new_blocks[0] == 1
    assert np.isfinite(last1).all()
    np.testing.assert_allclose(last1, last0, rtol=0, atol=ATOL["float32"])
    # Once more through generate (prompt cached twice over by now): same tokens as dense.
    got = eng.generate([prompt], 6, tenants=[0])[0]
    assert got.cached_tokens == 8
    want = E.DenseEngine(config, params, capacity=64, chunk_size=16).generate([prompt], 6)[0]
    assert got.tokens == want.tokens
