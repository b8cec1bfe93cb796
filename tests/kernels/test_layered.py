"""decode/prefill on a pool of every layer, `[L, Hkv, N, P, D]`, read at `layer=`.

The call with `layer=l` must be the call on `pool[l]`: bitwise on the reference path (the same
values gathered, every algorithmic choice made on one layer's shape), within the per-dtype
tolerance on the Pallas kernel (interpreted on CPU). Every other layer of the pool is NaN (for
quantized pools: NaN scales and zero points), so a read of the wrong layer shows; the scan tests
give each layer distinct finite values instead, so a wrong (finite) layer shows too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kernels import paged_attention as pa
from kernels.paged_attention import pallas_kernel, reference
from kernels.paged_attention.layered import page_shape, pool_layers
from kernels.quantization import QuantizedPages, quantize_kv
from tests.kernels.cases import assert_close, make_case

INTERPRET = jax.default_backend() != "gpu"
F32 = np.dtype("float32")
L = 3  # layers of the test pools
QUANTIZED = ["int8", "int4", "kivi2", "kivi4"]
FORMATS = ["f32", "bf16", "fp8"] + QUANTIZED  # plain pages in a float dtype, then quantized


def _case(fmt, seed, prefill=False):
    """A NaN-poisoned case (cases.make_case) with its pages stored in format `fmt`; ->
    (case, k, v, q_start or None, dtype of the tolerance)."""
    dtype = jnp.bfloat16 if fmt == "bf16" else np.float32
    t = 5 if prefill else None
    c = make_case(seed, batch=4, q_heads=6, kv_heads=2, head_dim=64, page_size=16, max_blocks=4,
                  lengths=[0, 1, 33, 64], dtype=dtype, query_len=t)
    q_start = np.maximum(c.lengths - t + 2, 0).astype(np.int32) if prefill else None
    k, v = _store(fmt, c, c.k_pages, c.v_pages)
    return c, k, v, q_start, (np.dtype("bfloat16") if fmt == "bf16" else F32)


def _store(fmt, c, k, v):
    if fmt in QUANTIZED:
        return quantize_kv(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), fmt,
                           fill=c.fill)
    if fmt == "fp8":
        return jnp.asarray(k, jnp.float8_e4m3fn), jnp.asarray(v, jnp.float8_e4m3fn)
    return jnp.asarray(k), jnp.asarray(v)


def _poisoned(pages):
    """The same pages with every value read from them NaN (quantized: NaN scales, zero points)."""
    if isinstance(pages, QuantizedPages):
        nan = lambda a: None if a is None else jnp.full_like(a, jnp.nan)
        return pages.replace(scales=nan(pages.scales), zeros=nan(pages.zeros))
    return jnp.full_like(pages, jnp.nan)


def _stack(layers):
    """One layer's pages (plain or QuantizedPages) per entry -> the pool with a leading [L]."""
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)


def _pool(pages, layer):
    """A pool of L layers holding `pages` at `layer` and NaN everywhere else."""
    return _stack([pages if i == layer else _poisoned(pages) for i in range(L)])


def _layer(pool, i):
    return jax.tree_util.tree_map(lambda a: a[i], pool)


def _run(kind, c, k, v, q_start, **kw):
    if kind == "decode":
        return pa.decode(c.q, k, v, c.block_tables, c.lengths, return_lse=True, **kw)
    return pa.prefill(c.q, k, v, c.block_tables, c.lengths, q_start, return_lse=True, **kw)


def _bitwise(got, want):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pool_shapes():
    c, k, v, _, _ = _case("kivi4", 0)
    assert pool_layers(k) is None and pool_layers(c.k_pages) is None
    assert pool_layers(_pool(k, 1)) == L and pool_layers(_pool(c.k_pages, 1)) == L
    assert page_shape(_pool(k, 1)) == k.shape == page_shape(_pool(c.k_pages, 0))


# ---- reference: bitwise ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_layer_equals_slice_bitwise(fmt, kind):
    c, k, v, q_start, _ = _case(fmt, 1, prefill=kind == "prefill")
    want = _run(kind, c, k, v, q_start, mass="token", backend="reference")
    assert not np.isnan(np.asarray(want[0], np.float32)).any()
    for layer in (0, L - 1):
        got = _run(kind, c, _pool(k, layer), _pool(v, layer), q_start, mass="token",
                   backend="reference", layer=layer)
        _bitwise(got, want)


@pytest.mark.parametrize("knobs", [dict(pool_dot=True), dict(pool_dot=False),
                                   dict(pool_dot=False, chunk_pages=1)],
                         ids=["pool_dot", "one_chunk", "chunk_loop"])
def test_reference_algorithms_with_layer_bitwise(knobs):
    """The whole-pool dot, one gathered chunk and the chunk loop (fori_loop + mass lax.map)."""
    c, k, v, _, _ = _case("f32", 2)
    fn = jax.jit(reference.decode_reference, static_argnames=("mass", "pool_dot", "chunk_pages"))
    want = fn(c.q, k, v, c.block_tables, c.lengths, mass="block", **knobs)
    got = fn(c.q, _pool(k, 1), _pool(v, 1), c.block_tables, c.lengths, mass="block", layer=1,
             **knobs)
    _bitwise(got, want)


# ---- Pallas (interpreted on CPU): within the per-dtype tolerance ---------------------------


def _close(got, want, dtype):
    out, aux = got
    want_out, want_aux = want
    assert_close(out, want_out, dtype, "out")
    finite = np.isfinite(np.asarray(want_aux.lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(aux.lse)), finite)
    assert_close(np.asarray(aux.lse)[finite], np.asarray(want_aux.lse)[finite], dtype, "lse")
    if want_aux.mass is not None:
        assert_close(aux.mass, want_aux.mass, dtype, "mass")


@pytest.mark.parametrize("fmt,kind,mass", [
    ("f32", "decode", "token"),
    ("bf16", "decode", None),
    ("fp8", "decode", None),
    ("f32", "prefill", "token"),
    ("bf16", "prefill", None),
    *[(name, "decode", "block") for name in QUANTIZED],
    ("kivi2", "prefill", "token"),
])
def test_pallas_layer_equals_slice(fmt, kind, mass):
    c, k, v, q_start, dtype = _case(fmt, 3, prefill=kind == "prefill")
    want = _run(kind, c, k, v, q_start, mass=mass, backend="pallas")
    got = _run(kind, c, _pool(k, 1), _pool(v, 1), q_start, mass=mass, backend="pallas",
               layer=1)
    _close(got, want, dtype)


def test_pallas_layer_with_splits():
    """Two KV splits, one page per step: every program offsets its loads by the layer."""
    c, k, v, _, _ = _case("f32", 4)
    want = pallas_kernel.decode_pallas(c.q, k, v, c.block_tables, c.lengths, mass="token",
                                       interpret=INTERPRET, k_splits=2, pages_per_block=1)
    got = pallas_kernel.decode_pallas(c.q, _pool(k, 2), _pool(v, 2), c.block_tables, c.lengths,
                                      mass="token", interpret=INTERPRET, k_splits=2,
                                      pages_per_block=1, layer=jnp.int32(2))
    _close(got, want, F32)


# ---- a traced layer: under jit and as a scan's loop index ----------------------------------


def _distinct_pool(fmt, c):
    """L layers of distinct finite values (NaN only where make_case put it: unowned slots)."""
    layers = [_store(fmt, c, c.k_pages * (1 + 0.5 * i) + 0.1 * i, c.v_pages * (1 - 0.3 * i) - i)
              for i in range(L)]
    return _stack([kv[0] for kv in layers]), _stack([kv[1] for kv in layers])


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_traced_layer_under_jit(backend):
    c, k, v, _, dtype = _case("int8", 5)
    kp, vp = _pool(k, 1), _pool(v, 1)
    fn = jax.jit(lambda kp, vp, layer: pa.decode(c.q, kp, vp, c.block_tables, c.lengths,
                                                 mass="block", backend=backend, layer=layer))
    got = fn(kp, vp, jnp.int32(1))
    want = pa.decode(c.q, k, v, c.block_tables, c.lengths, mass="block", backend=backend)
    if backend == "reference":
        _bitwise(got, want)
    else:
        assert_close(got[0], want[0], dtype, "out")
        assert_close(got[1].mass, want[1].mass, dtype, "mass")


@pytest.mark.parametrize("backend,fmt,kind", [
    ("reference", "f32", "decode"),
    ("reference", "kivi4", "prefill"),
    ("pallas", "f32", "prefill"),
    ("pallas", "kivi4", "decode"),
])
def test_scan_over_layers(backend, fmt, kind):
    """`lax.scan` over the layers with the loop index as `layer` (as the model's nn.scan does):
    step l gives the call on pool[l], bitwise on the reference (the model's logits rest on it)."""
    c, _, _, q_start, dtype = _case(fmt, 6, prefill=kind == "prefill")
    kp, vp = _distinct_pool(fmt, c)

    def step(carry, layer):
        return carry, _run(kind, c, kp, vp, q_start, mass="token", backend=backend, layer=layer)

    _, (outs, auxs) = jax.jit(lambda: lax.scan(step, 0, jnp.arange(L, dtype=jnp.int32)))()
    for i in range(L):
        want = _run(kind, c, _layer(kp, i), _layer(vp, i), q_start, mass="token",
                    backend=backend)
        got = (outs[i], jax.tree_util.tree_map(lambda a: a[i], auxs))
        if backend == "reference":
            _bitwise(got, want)
        else:
            _close(got, want, dtype)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_traced_layer_out_of_range_is_clamped(backend):
    c, _, _, _, _ = _case("f32", 7)
    kp, vp = _distinct_pool("f32", c)
    fn = jax.jit(lambda layer: pa.decode(c.q, kp, vp, c.block_tables, c.lengths,
                                         backend=backend, layer=layer))
    for layer, clamped in ((L + 4, L - 1), (-2, 0)):
        want = pa.decode(c.q, _layer(kp, clamped), _layer(vp, clamped), c.block_tables,
                         c.lengths, backend=backend)
        assert_close(fn(jnp.int32(layer)), want, F32, f"layer {layer}")


# ---- validation ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pools():
    c, k, v, _, _ = _case("f32", 8)
    qk, qv = quantize_kv(k, v, "kivi2", fill=c.fill)
    return c, _pool(k, 0), _pool(v, 0), _pool(qk, 0), _pool(qv, 0)


def _decode(c, k, v, **kw):
    return pa.decode(c.q, k, v, c.block_tables, c.lengths, **kw)


@pytest.mark.parametrize("change,pattern", [
    (lambda c, k, v, qk, qv: dict(k=k, v=v),
     r"k_pages must be \[Hkv, N, P, D\] or QuantizedPages, got shape \(3, .*needs layer="),
    (lambda c, k, v, qk, qv: dict(k=qk, v=qv),
     r"k_pages.data must be \[Hkv, N, P, D\*bits/8\], got shape \(3, .*needs layer="),
    (lambda c, k, v, qk, qv: dict(k=k[0], v=v[0], layer=0),
     r"k_pages must be \[L, Hkv, N, P, D\] .* with layer=, got shape \(2, "),
    (lambda c, k, v, qk, qv: dict(k=_layer(qk, 0), v=_layer(qv, 0), layer=0),
     r"k_pages.data must be \[L, Hkv, N, P, D\*bits/8\]"),
    (lambda c, k, v, qk, qv: dict(k=k, v=v[:2], layer=0),
     r"k_pages shape \(3, .*\) != v_pages shape \(2, "),
    (lambda c, k, v, qk, qv: dict(k=qk.replace(scales=qk.scales[0]), v=qv, layer=0),
     r"k_pages.scales shape .* != expected \(3, "),
    (lambda c, k, v, qk, qv: dict(k=qk, v=qv.replace(zeros=qv.zeros[:, :, :1]), layer=0),
     r"v_pages.zeros shape .* != expected \(3, "),
    (lambda c, k, v, qk, qv: dict(k=k, v=v, layer=3), r"layer 3 is out of range .* 3 layers"),
    (lambda c, k, v, qk, qv: dict(k=k, v=v, layer=np.int32(-1)), r"layer -1 is out of range"),
    (lambda c, k, v, qk, qv: dict(k=qk, v=qv, layer=jnp.int32(7)), r"layer 7 is out of range"),
    (lambda c, k, v, qk, qv: dict(k=k, v=v, layer=1.0), r"layer must be an integer scalar"),
    (lambda c, k, v, qk, qv: dict(k=k, v=v, layer=True), r"layer must be an integer scalar"),
    (lambda c, k, v, qk, qv: dict(k=k, v=v, layer=jnp.zeros((1,), jnp.int32)),
     r"layer must be an integer scalar .* shape \(1,\)"),
    (lambda c, k, v, qk, qv: dict(k=k, v=v, layer=jnp.float32(0)),
     r"layer must be an integer scalar .* dtype float32"),
])
def test_layered_inputs_rejected(pools, change, pattern):
    c, k, v, qk, qv = pools
    args = change(c, k, v, qk, qv)
    with pytest.raises(ValueError, match=pattern):
        _decode(c, args.pop("k"), args.pop("v"), **args)


def test_prefill_validates_layer(pools):
    c, k, v, _, _ = pools
    q = np.stack([c.q, c.q], axis=1)
    with pytest.raises(ValueError, match=r"needs layer="):
        pa.prefill(q, k, v, c.block_tables, c.lengths, c.lengths)
    with pytest.raises(ValueError, match=r"layer 5 is out of range"):
        pa.prefill(q, k, v, c.block_tables, c.lengths, c.lengths, layer=5)


def test_kernels_refuse_a_pool_without_layer(pools):
    """The backends' own entry points, below validation, refuse the mismatch too."""
    c, k, v, _, _ = pools
    with pytest.raises(ValueError, match=r"goes with layer="):
        reference.decode_reference(c.q, k, v, c.block_tables, c.lengths)
    with pytest.raises(ValueError, match=r"goes with layer="):
        pallas_kernel.decode_pallas(c.q, k[0], v[0], c.block_tables, c.lengths, layer=0,
                                    interpret=INTERPRET)
