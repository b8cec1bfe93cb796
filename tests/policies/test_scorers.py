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
