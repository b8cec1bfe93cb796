"""Page storage of every pool: shapes and bytes agree with the ledger's units, the host pool lives
in host memory through every op, and scrub-on-free zeroes a freed block in whichever pool."""

import jax
import jax.numpy as jnp
import numpy as np

from kvquota.core import admission, pins, release, tenants
from kvquota.core.pages import scrub_blocks
from kvquota.pages import host_sharding, init_pages
from tests.state.common import TINY, fresh, prompts


def _pool_nbytes(pages) -> int:
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(pages))


def test_every_pool_has_pages_whose_bytes_are_what_the_ledger_charges():
    pages = init_pages(TINY)
    assert len(pages) == TINY.num_pools == 3  # f32 pool 0, int8 pool 1, host pool 2
    for pool, pp in enumerate(pages):
        # Stored bytes per block (codes, scales, zero points) = the bytes a block is charged.
        assert _pool_nbytes(pp) == TINY.pool_sizes[pool] * TINY.pool_bytes[pool], pool
        for leaf in jax.tree_util.tree_leaves(pp):
            assert leaf.shape[:3] == (TINY.model.num_layers, TINY.model.num_kv_heads,
                                      TINY.pool_sizes[pool])
    assert pages[0].k.dtype == jnp.float32 and pages[2].k.dtype == jnp.float32
    assert pages[1].k.data.dtype == jnp.int8 and pages[1].k.kv_format.name == "int8"


def test_a_plain_low_precision_pool_is_stored_in_its_own_dtype():
    import dataclasses

    config = dataclasses.replace(TINY, compressed_pools=(("int8", 4), ("fp8", 4)))
    pages = init_pages(config)
    assert pages[2].k.dtype == jnp.float8_e4m3fn
    for pool, pp in enumerate(pages):
        assert _pool_nbytes(pp) == config.pool_sizes[pool] * config.pool_bytes[pool], pool


def test_metadata_only_state_has_no_pages():
    import dataclasses

    assert init_pages(dataclasses.replace(TINY, with_pages=False)) == ()


def test_host_pool_stays_in_host_memory_through_plain_and_donated_ops():
    if host_sharding() is None:
        import pytest

        pytest.skip("this backend offers no pinned_host memory")
    alloc, s = fresh()
    kinds = lambda st: {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(st.pages[2])}  # noqa: E731
    assert kinds(s) == {"pinned_host"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(s.pages[0])} != {
        "pinned_host"}
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3])]))
    assert kinds(s) == {"pinned_host"}
    s, _ = alloc.fork(s, [0], donate=True)
    s, _ = alloc.free(s, [0, 1], donate=True)
    assert kinds(s) == {"pinned_host"}
    alloc.check(s)


def test_scrub_zeroes_only_the_freed_blocks_of_each_pool():
    # Ones everywhere, each array placed where init_pages put it (host pool in host memory).
    pages = jax.tree_util.tree_map(lambda a: jax.device_put(np.ones(a.shape, a.dtype), a.sharding),
                                   init_pages(TINY))
    starts = TINY.pool_starts  # pool 0: ids 0-7, int8 pool: 8-11, host pool: 12-15
    ids = jnp.asarray([3, starts[1] + 1, starts[2] + 2, 5], jnp.int32)
    mask = jnp.asarray([True, True, True, False])  # block 5 is not freed
    out = jax.jit(scrub_blocks, static_argnums=0)(TINY, pages, ids, mask)
    want_zero = {0: {3}, 1: {1}, 2: {2}}
    for pool, pp in enumerate(out):
        for leaf in jax.tree_util.tree_leaves(pp):
            per_block = np.asarray(leaf).reshape(leaf.shape[0], leaf.shape[1], leaf.shape[2], -1)
            zero = {b for b in range(leaf.shape[2]) if not per_block[:, :, b].any()}
            assert zero == want_zero[pool], (pool, zero)
    if host_sharding() is not None:
        assert out[2].k.sharding.memory_kind == "pinned_host"


def test_donating_jit_builds_plain_and_donated_variants_of_each_core():
    cores = (admission.admit_core, admission.append_core, admission.fork_core, pins.pin_core,
             pins.unpin_core, release.drop_core, tenants.set_tenant_core)
    for fn in cores:
        assert fn.jitted() is not fn.jitted(donate=True), fn
        assert callable(fn.jitted()) and callable(fn.jitted(donate=True)), fn
    assert release.drop_core.static_argnums == (0, 5, 6)  # config, unpin_slots, cols
