"""Page moves inside the jitted cores, for every pool: copy blocks (fork) and scrub freed blocks.

`state.pages[p]` holds pool p's K and V with the block axis at position 2 (`[L, Hkv, N_p, ...]`,
for full-precision arrays and for every array of a `QuantizedPages` alike), indexed by the block's
page index `block id - pool_starts[p]`. Metadata-only states (`pages == ()`) skip all of this.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvquota.core.scatter import oob
from kvquota.state import PoolPages, StateConfig, pool_of


def _local(config: StateConfig, ids, mask, pool: int):
    """Page index inside `pool` of each id where mask and the id is in that pool; else OOB."""
    start, size = config.pool_starts[pool], config.pool_sizes[pool]
    inside = mask & (pool_of(config, jnp.maximum(ids, 0)) == pool)
    return oob(ids - start, inside, size)


def copy_blocks(config: StateConfig, pages: tuple[PoolPages, ...], src, dst, mask):
    """Copy the pages of blocks `src` into blocks `dst` (i32[B] each) where `mask`; a copy is
    done within one device pool (both ids in the same pool, as a fork's partial tail block is).
    The host pool is never copied into: a gather from host memory with device indices is
    rejected inside jit, and kernels never read that pool anyway."""
    out = []
    for pool, pp in enumerate(pages):
        if not config.device_pools[pool]:
            out.append(pp)
            continue
        same = mask & (pool_of(config, jnp.maximum(src, 0)) == pool_of(config, jnp.maximum(dst, 0)))
        s_idx = jnp.maximum(_local(config, src, same, pool), 0)
        d_idx = _local(config, dst, same, pool)
        move = lambda a: a.at[:, :, d_idx].set(a[:, :, jnp.minimum(s_idx, a.shape[2] - 1)],  # noqa: E731
                                               mode="drop")
        out.append(jax.tree.map(move, pp))
    return tuple(out)


def scrub_blocks(config: StateConfig, pages: tuple[PoolPages, ...], ids, mask):
    """Zero every page array (codes, scales and zero points included) of blocks `ids` where
    `mask`, in whichever pool each block lives."""
    out = []
    for pool, pp in enumerate(pages):
        idx = _local(config, ids, mask, pool)
        out.append(jax.tree.map(lambda a: a.at[:, :, idx].set(0, mode="drop"), pp))
    return tuple(out)
