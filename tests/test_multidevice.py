"""Multi-device checks on CPU (8 host devices in a subprocess, `multidevice` in conftest.py),
and the suite's strict JAX settings themselves.

DESIGN.md "Scale": the same state is sharded with `jax.sharding`, KV heads across devices and
sequences replicated or data-parallel. These checks run the plain-JAX reference decode on a
sharded pool-0 page array `[L, Hkv, N, P, D]` and compare with the unsharded result; the state,
the model and the allocator ops on a mesh (`kvquota.sharding`) are tested in test_sharding.py.
"""

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import warning_filters

SHARDED_DECODE = """
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from kernels import paged_attention as pa
from tests.kernels.cases import TOLERANCES, make_case

LAYERS, LAYER = 2, 1
c = make_case(7, batch=4, q_heads=16, kv_heads=8, head_dim=32, page_size=8, max_blocks=5,
              lengths=[0, 1, 17, 40])  # NaN in every slot no sequence owns
k = np.stack([c.k_pages] * LAYERS)  # [L, Hkv, N, P, D]: layer 0 a copy, the model reads LAYER
v = np.stack([c.v_pages] * LAYERS)

@jax.jit
def decode(q, k, v, tables, lengths):
    return pa.decode(q, k[LAYER], v[LAYER], tables, lengths, mass="block", backend="reference")

want, want_aux = decode(c.q, k, v, c.block_tables, c.lengths)
out = {}
for name, shape, axes, q_spec, page_spec, seq_spec in [
        # KV heads over all 8 devices; sequences (q, tables, lengths) replicated
        ("heads", (8,), ("kv",), P(None, "kv", None), P(None, "kv"), P()),
        # KV heads over 4, sequences data-parallel over 2
        ("heads_x_seqs", (2, 4), ("seq", "kv"), P("seq", "kv", None), P(None, "kv"), P("seq"))]:
    mesh = Mesh(np.array(jax.devices()).reshape(shape), axes)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    args = (put(c.q, q_spec), put(k, page_spec), put(v, page_spec),
            put(c.block_tables, seq_spec), put(c.lengths, seq_spec))
    assert len(args[1].sharding.device_set) == 8
    got, aux = decode(*args)
    # the pages really are split: each device holds 1/shape[-1] of the KV heads
    assert args[1].addressable_shards[0].data.shape[1] == 8 // shape[-1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOLERANCES["float32"])
    np.testing.assert_allclose(np.asarray(aux.mass), np.asarray(want_aux.mass),
                               **TOLERANCES["float32"])
    np.testing.assert_array_equal(np.isfinite(np.asarray(aux.lse)),
                                  np.isfinite(np.asarray(want_aux.lse)))
    out[name] = dict(max_abs_diff=float(np.abs(np.asarray(got) - np.asarray(want)).max()),
                     nan=bool(np.isnan(np.asarray(got)).any()),
                     out_devices=len(got.sharding.device_set))
report(devices=jax.device_count(), **out)
"""


def test_reference_decode_sharded_over_kv_heads(multidevice):
    """Pages sharded over KV heads (sequences replicated, or also data-parallel) give the
    unsharded decode, NaN-filled unused slots included."""
    result = multidevice(SHARDED_DECODE)
    assert result["devices"] == 8
    for name in ("heads", "heads_x_seqs"):
        assert not result[name]["nan"], name
        assert result[name]["out_devices"] == 8, name  # the output stays distributed


def test_multidevice_runs_with_the_suites_strict_settings(multidevice):
    """The subprocess applies rank promotion "raise" and the misuse-warning filters."""
    result = multidevice("""
        import jax.numpy as jnp
        try:
            jnp.ones((2, 3)) + jnp.ones(3)
            promotion = "allowed"
        except ValueError:
            promotion = "raised"
        try:
            jax.jit(lambda x: x.sum(), donate_argnums=0)(jnp.ones(4))
            donation = "silent"
        except UserWarning:
            donation = "raised"
        report(promotion=promotion, donation=donation)
    """)
    assert result == dict(promotion="raised", donation="raised")


def test_jax_misuse_warnings_are_errors_in_the_suite():
    """setup.cfg's filterwarnings turn jax's misuse warnings into errors here too."""
    assert any(message.startswith("Some donated buffers") for _, message, _ in warning_filters())
    with pytest.raises(UserWarning, match="Some donated buffers were not usable"):
        jax.jit(lambda x: x.sum(), donate_argnums=0)(jnp.ones(4))
    with pytest.raises(UserWarning, match="Explicitly requested dtype float64"):
        jnp.zeros(3, dtype="float64")
    with pytest.raises(FutureWarning, match="scatter inputs have incompatible types"):
        jnp.zeros(3, jnp.int32).at[0].set(1.5)
    with pytest.raises(ValueError, match="jax_numpy_rank_promotion='raise'"):
        jnp.ones((2, 3)) + jnp.ones(3)
