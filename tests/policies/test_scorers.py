"""Each published eviction rule against a small NumPy reference of its paper's rule, per layer and
KV head (a TokenView [B, L, Hkv, C] of random statistics: every head ranks differently)."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvquota import errors as E
from kvquota.policies import SnapKV, TokenView, get_policy

B, L, H, C = 2, 2, 3, 24
LENGTHS = (21, 13)


def _view(seed=0, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    valid = np.arange(C) < np.asarray(lengths)[:, None, None, None]
    mass = np.where(valid, rng.random((len(lengths), L, H, C)), 0).astype(np.float32)
    norm = np.where(valid, rng.random(mass.shape) + 0.5, 0).astype(np.float32)
    return TokenView(lengths=jnp.asarray(lengths, jnp.int32), mass=jnp.asarray(mass),
                     key_norm=jnp.asarray(norm), last_attention=None)


# ---- SnapKV -----------------------------------------------------------------------------------


def _pool_reference(x, kernel, pool):
    """SnapKV's pooling of one head's prefix x[n] (stride 1, kernel // 2 padding on the left):
    max over the in-range places ("max", torch max_pool1d), or the sum over them / kernel ("avg",
    torch avg_pool1d with count_include_pad=True, as kvpress calls it)."""
    pad, n = kernel // 2, len(x)
    out = np.empty(n, np.float64)
    for i in range(n):
        w = x[max(i - pad, 0):min(i - pad + kernel, n)]
        out[i] = w.max() if pool == "max" else w.sum() / kernel
    return out


@pytest.mark.parametrize("kernel", [1, 4, 7])
@pytest.mark.parametrize("pool", ["max", "avg"])
def test_snapkv_pools_each_heads_prefix_as_the_reference(pool, kernel):
    """Scores over the prefix before the observation (recent) window are the pooled mass of
    that prefix alone; the window scores +inf (always kept), empty columns 0."""
    view = _view()
    recent = 5
    got = np.asarray(SnapKV(kernel=kernel, pool=pool, recent=recent).score(view))
    mass = np.asarray(view.mass, np.float64)
    for b, n in enumerate(LENGTHS):
        n0 = n - recent
        for layer, head in np.ndindex(L, H):
            want = _pool_reference(mass[b, layer, head, :n0], kernel, pool)
            np.testing.assert_allclose(got[b, layer, head, :n0], want, rtol=1e-6)
            assert np.isposinf(got[b, layer, head, n0:n]).all()
            assert (got[b, layer, head, n:] == 0).all()


def test_snapkv_pooling_by_hand():
    """One head, kernel 3, no window: mass [3, 0, 0, 6, 0, 0]. max: [3, 3, 6, 6, 6, 0];
    avg (zeros counted in the padding): [(0+3+0)/3, (3+0+0)/3, (0+0+6)/3, 2, 2, 0]."""
    mass = np.zeros((1, 1, 1, C), np.float32)
    mass[0, 0, 0, :6] = [3, 0, 0, 6, 0, 0]
    view = TokenView(lengths=jnp.asarray([6], jnp.int32), mass=jnp.asarray(mass),
                     key_norm=None, last_attention=None)
    got_max = np.asarray(SnapKV(kernel=3).score(view))[0, 0, 0, :6]
    got_avg = np.asarray(SnapKV(kernel=3, pool="avg").score(view))[0, 0, 0, :6]
    np.testing.assert_array_equal(got_max, [3, 3, 6, 6, 6, 0])
    np.testing.assert_allclose(got_avg, [1, 1, 2, 2, 2, 0], rtol=1e-6)


def test_snapkv_defaults_are_the_papers():
    policy = get_policy("snapkv")
    assert (policy.kernel, policy.pool) == (7, "max")


@pytest.mark.parametrize("options", [dict(pool="mean"), dict(pool=None), dict(kernel=0),
                                     dict(kernel=2.5), dict(kernel=True)])
def test_snapkv_bad_options_are_typed_errors(options):
    with pytest.raises(E.InvalidArgumentError):
        get_policy("snapkv", **options)


# ---- H2O --------------------------------------------------------------------------------------


def _h2o_reference(mass, n, keep, recent, share):
    """The authors' rule (H2OKVCache_LayerWise) in one head: the r = max(recent, floor(share *
    k)) most recent of the n tokens, and the k - r heaviest of the older ones (ties to the later
    token), k = min(keep, n); sorted cache indices."""
    k = min(keep, n)
    r = min(max(recent, int(np.floor(share * k))), k)
    older = sorted(range(n - r), key=lambda i: (-mass[i], -i))
    return sorted(older[:k - r] + list(range(n - r, n)))


@pytest.mark.parametrize("keep", [1, 2, 7, 8, 11, 30])
@pytest.mark.parametrize("name,recent,share", [("h2o", 0, 0.5), ("h2o", 4, 0.5),
                                               ("h2o-fixed", 3, 0.0), ("h2o", 0, 0.25)])
def test_h2o_keeps_half_heavy_hitters_half_recent_per_head(name, recent, share, keep):
    """Odd budgets: keep 7 of 21 is 3 recent + 4 heavy hitters (floor for the recent half); a
    `recent` floor above the half wins (recent=4 of keep 7); h2o-fixed is the fixed window."""
    options = dict(recent=recent) if name == "h2o-fixed" else dict(recent=recent,
                                                                    recent_share=share)
    policy = get_policy(name, **options)
    assert policy.recent_share == share
    view = _view(seed=keep)
    got = np.asarray(policy.keep_mask(view, jnp.full(B, keep, jnp.int32)))
    mass = np.asarray(view.mass)
    for b, n in enumerate(LENGTHS):
        for layer, head in np.ndindex(L, H):
            want = _h2o_reference(mass[b, layer, head], n, keep, recent, share)
            assert np.flatnonzero(got[b, layer, head]).tolist() == want


def test_h2o_split_by_hand():
    """keep 5 of 8 with mass [9, 1, 8, 2, 7, 3, 0, 0]: recent floor(5/2) = 2 (tokens 6, 7),
    heavy hitters 0, 2, 4; h2o-fixed with recent=1: token 7 and the heaviest 0, 2, 4, 5."""
    mass = np.zeros((1, 1, 1, C), np.float32)
    mass[0, 0, 0, :8] = [9, 1, 8, 2, 7, 3, 0, 0]
    view = TokenView(lengths=jnp.asarray([8], jnp.int32), mass=jnp.asarray(mass),
                     key_norm=None, last_attention=None)
    keep = jnp.asarray([5], jnp.int32)
    h2o = np.asarray(get_policy("h2o").keep_mask(view, keep))[0, 0, 0]
    fixed = np.asarray(get_policy("h2o-fixed", recent=1).keep_mask(view, keep))[0, 0, 0]
    assert np.flatnonzero(h2o).tolist() == [0, 2, 4, 6, 7]
    assert np.flatnonzero(fixed).tolist() == [0, 2, 4, 5, 7]


def test_h2o_block_mode_keeps_the_recent_half_in_whole_blocks():
    """Whole-block eviction (one set for the model) keeps the blocks of the recent half first:
    8 blocks of 2 tokens, keep 4 blocks (8 tokens): the recent 4 tokens are blocks 6 and 7, the
    heaviest other blocks 0 and 2 (mass by block: 9, 1, 8, 2, 7, 3, 0, 0)."""
    mass = np.zeros((1, 1, 1, 16), np.float32)
    mass[0, 0, 0] = np.repeat([9, 1, 8, 2, 7, 3, 0, 0], 2)
    view = TokenView(lengths=jnp.asarray([16], jnp.int32), mass=jnp.asarray(mass),
                     key_norm=None, last_attention=None)
    keep = jnp.asarray([4], jnp.int32)
    h2o = np.asarray(get_policy("h2o").block_keep_mask(view, 2, keep))[0]
    fixed = np.asarray(get_policy("h2o-fixed").block_keep_mask(view, 2, keep))[0]
    assert np.flatnonzero(h2o).tolist() == [0, 2, 6, 7]
    assert np.flatnonzero(fixed).tolist() == [0, 2, 4, 5]


@pytest.mark.parametrize("share", [-0.1, 1.5, "half", None, True])
def test_h2o_bad_recent_share_is_a_typed_error(share):
    with pytest.raises(E.InvalidArgumentError):
        get_policy("h2o", recent_share=share)


# ---- key norm ----------------------------------------------------------------------------------


def test_knorm_keeps_each_heads_lowest_key_norms_through_the_state():
    """Devoto et al.'s rule end to end: `keep_mask` and `evict` on a state with random pages keep,
    in every (layer, KV head), the tokens whose stored (rotated) key has the lowest L2 norm over
    its channels, besides the `recent` window (NumPy, read through the block table); each head
    then holds exactly those keys and the invariants hold."""
    from tests.state.common import TINY, fresh, prompts
    from tests.state.test_state_tiers import _with_pages

    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5, 6, 7])]))
    s = _with_pages(alloc, s, seed=7)
    p, n, keep, recent = TINY.block_size, 7, 4, 1
    table = np.asarray(s.seqs.block_tables[0])
    i = np.arange(n)
    k = np.asarray(s.pages[0].k)[:, :, table[i // p], i % p]  # [L, Hkv, n, D]
    norms = np.sqrt((k.astype(np.float64) ** 2).sum(-1))
    mask = alloc.keep_mask(s, [0], policy="knorm", keep_tokens=keep, recent=recent)
    s2, _ = alloc.evict(s, [0], policy="knorm", keep_tokens=keep, recent=recent)
    alloc.check(s2)
    table2 = np.asarray(s2.seqs.block_tables[0])
    j = np.arange(keep)
    k2 = np.asarray(s2.pages[0].k)[:, :, table2[j // p], j % p]
    chosen = set()
    for layer, head in np.ndindex(*norms.shape[:2]):
        older = sorted(range(n - recent), key=lambda t: (norms[layer, head, t], -t))
        want = sorted(older[:keep - recent] + list(range(n - recent, n)))
        assert np.flatnonzero(mask[0, layer, head]).tolist() == want
        np.testing.assert_array_equal(k2[layer, head], k[layer, head, want])
        chosen.add(tuple(want))
    assert len(chosen) > 1  # the heads chose differently
