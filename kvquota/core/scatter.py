"""Index helpers shared by the jitted cores: scatters that drop padding rows, safe gathers, and
the ordering trick that keeps donated scatters in place.

Scatters route INVALID indices to an out-of-bounds index with `mode="drop"` (JAX wraps -1 to the
last element even under "drop")."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvquota.state import StateConfig


def oob(idx, keep, n):
    """`idx` where `keep`, else the out-of-bounds index n (dropped by mode="drop" scatters)."""
    return jnp.where(keep, idx, n)


def clip(idx):
    """A safe gather index for entries that may be INVALID (results must be masked)."""
    return jnp.maximum(idx, 0)


def device_units(config: StateConfig):
    """i32[POOLS]: units per block of each pool, 0 for pools outside the byte quota (host)."""
    return jnp.asarray(
        [u if dev else 0 for u, dev in zip(config.pool_units, config.device_pools)], jnp.int32
    )


def charged_units(config, state):
    """i32[T]: device-resident units charged to each tenant."""
    return (state.tenants.charged_blocks * device_units(config)[None, :]).sum(axis=1)


def after(index, *reads):
    """`index`, made data-dependent on `reads` (earlier reads of the array it will scatter into).

    An in-place scatter must run after every read of the array's old value. Unless the scatter's
    indices depend on those reads, XLA cannot order them and its copy insertion protects the
    reads by copying the whole (NB-sized) array, which defeats donation. The dependency is the
    condition min(x) <= max(x): true for any integer or bool array, but not foldable by XLA.
    (`lax.optimization_barrier` does not help: XLA:CPU expands it before copy insertion.)
    """
    ok = jnp.bool_(True)
    for x in jax.tree_util.tree_leaves(reads):
        if x.size:
            ok = ok & (jnp.min(x) <= jnp.max(x))
    return jnp.where(ok, index, jnp.iinfo(jnp.int32).max)


def materialize(x):
    """`x` (an integer array) as a buffer of its own. A gather whose result is still used after
    the array it reads is scattered into gets fused into each consumer, each re-reading the
    array, so copy insertion copies the whole array to keep the old value. Rebuilding `x` as
    the running sum of its differences (exact in wrapping int32 arithmetic) makes it a
    reduce-window, which XLA:CPU does not duplicate into consumers, so the gather runs once,
    before the scatter (the donated-core HLO tests check that no whole table is copied)."""
    flat = x.ravel()
    steps = jnp.concatenate([flat[:1], flat[1:] - flat[:-1]])
    return jnp.cumsum(steps, dtype=flat.dtype).reshape(x.shape)
