"""Quantized pages: real storage sizes, bit layout, exact and bounded round trips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.quantization import (
    QuantizedPages,
    dequantize_pages,
    empty_quantized_pages,
    quantize_kv,
    quantize_pages,
    unpack_codes,
)
from configs.formats import get_kv_format
from tests.kernels.cases import assert_close

FORMATS = ["int8", "int4", "kivi2", "kivi4"]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", FORMATS)
def test_nbytes_match_format_page_sizes(name, head_dim):
    fmt = get_kv_format(name)
    heads, blocks, page = 2, 3, 16
    x = jax.random.normal(jax.random.PRNGKey(0), (heads, blocks, page, head_dim))
    k, v = quantize_kv(x, x, name)
    assert k.nbytes == heads * blocks * fmt.key_page_bytes(page, head_dim)
    assert v.nbytes == heads * blocks * fmt.value_page_bytes(page, head_dim)
    assert k.shape == v.shape == (heads, blocks, page, head_dim)
    # the state can allocate the same layout empty
    e = empty_quantized_pages(name, "key", heads, blocks, page, head_dim)
    assert e.nbytes == k.nbytes and e.data.dtype == k.data.dtype


@pytest.mark.parametrize("name,fraction", [("int8", 0.516), ("int4", 0.266), ("kivi2", 0.219),
                                           ("kivi4", 0.344)])
def test_fraction_of_bf16_at_head_dim_64_block_16(name, fraction):
    """The issue's figures: a quantized block (scales, zero points included) vs bf16."""
    x = jnp.ones((1, 1, 16, 64))
    k, v = quantize_kv(x, x, name)
    assert round((k.nbytes + v.nbytes) / (2 * 16 * 64 * 2), 3) == fraction


def test_unpack_low_bits_first():
    """Byte 0x21 holds channels (1, 2) at 4 bits; 0b11_10_01_00 holds (0, 1, 2, 3) at 2 bits."""
    np.testing.assert_array_equal(unpack_codes(jnp.array([0x21], jnp.uint8), 4), [1, 2])
    np.testing.assert_array_equal(unpack_codes(jnp.array([0b11100100], jnp.uint8), 2),
                                  [0, 1, 2, 3])


def _grid_values(name, role, shape, seed):
    """Values on the quantization grid of `name`, with each group's extreme codes present.

    Scales are powers of two and zero points small integers, so quantizing must return exactly
    these values: a check of packing, code offsets and scale/zero placement all at once.
    """
    fmt = get_kv_format(name)
    spec = fmt.key if role == "key" else fmt.value
    rng = np.random.default_rng(seed)
    h, n, p, d = shape
    if spec.asymmetric:
        lo_code, hi_code = 0, (1 << spec.bits) - 1
    else:
        hi_code = (1 << (spec.bits - 1)) - 1
        lo_code = -hi_code
    codes = rng.integers(lo_code, hi_code + 1, shape)
    if spec.scale_axis == "channel":  # extremes in every channel over the page's tokens
        codes[:, :, 0, :], codes[:, :, 1, :] = lo_code, hi_code
        scale = 2.0 ** rng.integers(-4, 1, (h, n, 1, d))
        zero = rng.integers(-3, 1, (h, n, 1, d)).astype(float)
    else:  # extremes in every token's channel group
        group = spec.group_size(d)
        codes[..., ::group], codes[..., 1::group] = lo_code, hi_code
        scale = np.repeat(2.0 ** rng.integers(-4, 1, (h, n, p, d // group)), group, -1)
        zero = np.repeat(rng.integers(-3, 1, (h, n, p, d // group)), group, -1).astype(float)
    x = codes * scale + (zero if spec.asymmetric else 0.0)
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("name", FORMATS)
def test_grid_values_round_trip_exactly(name, role):
    x = _grid_values(name, role, (2, 3, 16, 64), seed=7)
    q = quantize_pages(x, name, role)
    np.testing.assert_array_equal(np.asarray(dequantize_pages(q)), np.asarray(x))


@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_error_within_half_a_step(name, role):
    """|x - dq(q(x))| <= scale/2 plus the bf16 rounding of the stored scale and zero point."""
    x = 3.0 * jax.random.normal(jax.random.PRNGKey(1), (2, 4, 16, 128))
    q = quantize_pages(x, name, role)
    spec = q.spec
    err = np.abs(np.asarray(dequantize_pages(q)) - np.asarray(x))
    scale = np.asarray(q.scales, np.float32)
    zero = np.zeros_like(scale) if q.zeros is None else np.abs(np.asarray(q.zeros, np.float32))
    if spec.scale_axis == "token":
        group = spec.group_size(128)
        scale, zero = np.repeat(scale, group, -1), np.repeat(zero, group, -1)
    levels = (1 << spec.bits) - 1 if spec.asymmetric else (1 << (spec.bits - 1)) - 1
    bf16_eps = 2.0**-8  # relative rounding of a bf16 scale or zero point
    bound = scale * (0.5 + levels * bf16_eps) + zero * bf16_eps + 1e-6
    assert np.all(err <= bound), float((err - bound).max())


def test_quantized_pages_is_a_pytree_with_static_format():
    x = jnp.ones((2, 3, 16, 64))
    q = quantize_pages(x, "kivi2", "key")
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 3  # data, scales, zeros; the format rides in the treedef
    layer = jax.tree_util.tree_map(lambda a: a[1], jax.tree_util.tree_unflatten(treedef, leaves))
    assert isinstance(layer, QuantizedPages) and layer.kv_format.name == "kivi2"


def test_quantize_rejects_unquantized_format():
    with pytest.raises(ValueError, match="bf16"):
        quantize_pages(jnp.ones((1, 1, 16, 64)), "bf16", "key")


def _poisoned_pages(poison, seed=3):
    """Pages [2, 3, 16, 64] with fills 16, 5 and 0; slots past the fill hold `poison` (NaN, or
    stale data far outside the valid range). Also returns the pages with each tail replaced by
    copies of the page's first token, which changes no scale (per token or per channel)."""
    x = np.asarray(3.0 * jax.random.normal(jax.random.PRNGKey(seed), (2, 3, 16, 64)))
    fill = np.array([16, 5, 0], np.int32)
    tail = np.arange(16)[None, :, None] >= fill[:, None, None]  # [N, P, 1]
    poisoned = np.where(tail[None], poison, x).astype(np.float32)
    neutral = np.where(tail[None], x[:, :, :1], x).astype(np.float32)
    return poisoned, neutral, fill, tail


@pytest.mark.parametrize("poison", [np.nan, 1e4], ids=["nan", "stale"])
@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("name", FORMATS)
def test_slots_past_fill_reach_no_scale(name, role, poison):
    """A partial last page: its tail (NaN or stale) must not move the valid tokens' scales.

    KIVI keys take one scale per channel over the page's tokens, so an unmasked tail would set
    every valid key of the page to NaN (or widen its step 1000-fold)."""
    poisoned, neutral, fill, tail = _poisoned_pages(poison)
    q = quantize_pages(jnp.asarray(poisoned), name, role, fill=jnp.asarray(fill))
    for a in (q.scales, q.zeros):
        assert a is None or np.isfinite(np.asarray(a, np.float32)).all()
    got = np.asarray(dequantize_pages(q))
    assert np.isfinite(got).all()
    want = np.asarray(dequantize_pages(quantize_pages(jnp.asarray(neutral[:, :2]), name, role)))
    valid = ~np.broadcast_to(tail[None], got.shape)
    np.testing.assert_array_equal(got[:, :2][valid[:, :2]], want[valid[:, :2]])
    # An empty page stores zero scales; every padding slot dequantizes to a finite value.
    assert np.all(np.asarray(q.scales, np.float32)[:, 2] == 0)
    # The same fill through quantize_kv, and under jit (fill traced).
    k, v = jax.jit(lambda x, f: quantize_kv(x, x, name, fill=f))(jnp.asarray(poisoned),
                                                                jnp.asarray(fill))
    again = k if role == "key" else v
    np.testing.assert_array_equal(np.asarray(dequantize_pages(again)), got)


@pytest.mark.parametrize("poison", [np.nan, 1e4], ids=["nan", "stale"])
def test_without_fill_a_tail_spoils_kivi_keys(poison):
    """Why `fill` exists: unmasked, the tail moves the per-channel range of the page's valid
    keys (NaN gives NaN, or, as XLA's CPU min/max may skip NaN, a wrong range; stale data a
    step ~1000x too coarse)."""
    poisoned, _, fill, tail = _poisoned_pages(poison)
    masked = np.asarray(dequantize_pages(quantize_pages(jnp.asarray(poisoned), "kivi2", "key",
                                                        fill=jnp.asarray(fill))))
    unmasked = np.asarray(dequantize_pages(quantize_pages(jnp.asarray(poisoned), "kivi2", "key")))
    valid = slice(0, int(fill[1]))  # page 1: 5 valid tokens
    assert not np.array_equal(unmasked[:, 1, valid], masked[:, 1, valid])
    # the full page (no tail) is the same either way
    np.testing.assert_array_equal(unmasked[:, 0], masked[:, 0])


def test_fill_must_name_every_page():
    with pytest.raises(ValueError, match="fill must be an integer array"):
        quantize_pages(jnp.ones((1, 3, 16, 64)), "kivi2", "key", fill=jnp.array([16, 5]))
    with pytest.raises(ValueError, match="fill must be an integer array"):
        quantize_pages(jnp.ones((1, 3, 16, 64)), "kivi2", "key", fill=jnp.ones(3))


def _kivi_key_reference(x, bits, group_tokens):
    """KIVI's key rule in NumPy (Liu et al., 2024): per channel over each group of
    `group_tokens` consecutive tokens of one head, scale = (max - min) / (2^b - 1) and zero =
    min (both rounded to bf16, as stored), code = clip(round((x - zero) / scale), 0, 2^b - 1),
    x' = code * scale + zero. x f32[T, D], T a multiple of the group."""
    t, d = x.shape
    xg = x.reshape(t // group_tokens, group_tokens, d)
    levels = (1 << bits) - 1
    lo, hi = xg.min(axis=1, keepdims=True), xg.max(axis=1, keepdims=True)
    scale = ((hi - lo) / np.float32(levels)).astype(jnp.bfloat16).astype(np.float32)
    zero = lo.astype(jnp.bfloat16).astype(np.float32)
    codes = np.clip(np.round((xg - zero) / np.where(scale > 0, scale, 1)), 0, levels)
    return codes.reshape(t, d), scale[:, 0], zero[:, 0], (codes * scale + zero).reshape(t, d)


@pytest.mark.parametrize("name,page", [("kivi2", 16), ("kivi4", 16), ("kivi2", 8),
                                       ("kivi2-g16", 16)])
def test_kivi_keys_at_the_papers_group_against_numpy(name, page):
    """G = 32 (kivi2/kivi4) spans 32 / P pages: one scale and zero point per channel over the
    group's 32 tokens, each page of the group storing the same copy; kivi2-g16 (G = 16) is the
    one-page group at P = 16."""
    spec = get_kv_format(name).key
    g = spec.pages_per_group(page)
    heads, pages, d = 2, 4, 64
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (heads, pages, page, d)) * 3.0)
    q = quantize_pages(jnp.asarray(x), name, "key", group_pages=g)
    codes = np.asarray(unpack_codes(q.data, spec.bits))
    scales, zeros = np.asarray(q.scales, np.float32), np.asarray(q.zeros, np.float32)
    got = np.asarray(dequantize_pages(q))
    for h in range(heads):
        w_codes, w_scale, w_zero, w_x = _kivi_key_reference(x[h].reshape(-1, d), spec.bits,
                                                            spec.tokens)
        np.testing.assert_array_equal(codes[h].reshape(-1, d), w_codes)
        # Page n stores its group's scale and zero point: [N, 1, D] against [N / g, D].
        np.testing.assert_array_equal(scales[h, :, 0], np.repeat(w_scale, g, axis=0))
        np.testing.assert_array_equal(zeros[h, :, 0], np.repeat(w_zero, g, axis=0))
        assert_close(got[h].reshape(-1, d), w_x, np.float32, f"{name} head {h}")
    # The group is not the page: per-page scales (today's rule at G = P) would differ.
    if g > 1:
        per_page = np.asarray(quantize_pages(jnp.asarray(x), name, "key").scales)
        assert not np.array_equal(per_page, np.asarray(q.scales))


@pytest.mark.parametrize("group_pages", [3, 0, -1, 2.0])
def test_a_key_group_must_divide_the_pages(group_pages):
    with pytest.raises(ValueError, match="group_pages"):
        quantize_pages(jnp.ones((1, 4, 16, 64)), "kivi2", "key", group_pages=group_pages)


@pytest.mark.parametrize("page", [64, 12, 0])
def test_a_key_group_that_is_no_whole_number_of_blocks_is_refused(page):
    from configs.errors import FormatSpecError

    with pytest.raises(FormatSpecError, match="not a whole number of blocks"):
        get_kv_format("kivi2").key.pages_per_group(page)
