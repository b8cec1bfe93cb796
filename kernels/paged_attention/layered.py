"""Page pools of every layer at once: `[L, Hkv, N, P, D]`, read at one layer.

A model keeps one K and one V pool for all its layers (QuantizedPages: every array with a
leading [L] axis). `decode`/`prefill` take such a pool whole with `layer=` (a traced int32 scalar
is allowed: under a scan over layers it is the loop index), so the caller never slices
`pool[layer]`, which inside a scan is a dynamic slice of the whole layer pool, most likely copied
on GPU. The reference folds the layer into its page gather (only the table's pages are read);
the Pallas kernel offsets its page loads by it (see `pallas_kernel`).

A traced layer cannot be range-checked: one outside [0, L) is clamped to it (as JAX's dynamic
indexing does); a Python int or concrete array is checked by `validation`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels.quantization import QuantizedPages


def _lead(pages) -> jax.Array:
    """The array whose rank says whether `pages` has a layer axis (QuantizedPages: its codes)."""
    return pages.data if isinstance(pages, QuantizedPages) else pages


def pool_layers(pages) -> int | None:
    """L of a `[L, Hkv, N, P, D]` pool (QuantizedPages: codes `[L, Hkv, N, P, D*bits/8]`), None
    for one layer's `[Hkv, N, P, D]` pages."""
    lead = _lead(pages)
    return lead.shape[0] if lead.ndim == 5 else None


def page_shape(pages) -> tuple[int, int, int, int]:
    """Logical `[Hkv, N, P, D]` of one layer's pages, with or without a layer axis."""
    if pool_layers(pages) is None:
        return tuple(pages.shape)
    if isinstance(pages, QuantizedPages):
        h, n, p, _ = pages.data.shape[1:]
        return (h, n, p, pages.head_dim)
    return tuple(pages.shape[1:])


def layer_index(layer, num_layers: int) -> jax.Array:
    """`layer` as an i32[] clamped into [0, num_layers) (a traced value cannot be checked)."""
    return jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)


def take_layer_blocks(a: jax.Array, block_tables: jax.Array, layer) -> jax.Array:
    """Blocks `block_tables` i32[B, M] of layer `layer` of a [L, H, N, X, Y] array ->
    [H, B, M, X, Y], by one gather (no layer slice is made): `jnp.take(a[layer], block_tables,
    axis=1, mode="clip")` with the same values. Layer and block indices are clamped."""
    _, h, _, x, y = a.shape
    b, m = block_tables.shape
    layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (b, m))
    idx = jnp.stack([layers, block_tables.astype(jnp.int32)], axis=-1)  # [B, M, 2]
    dnums = lax.GatherDimensionNumbers(offset_dims=(0, 3, 4), collapsed_slice_dims=(0, 2),
                                       start_index_map=(0, 2))
    return lax.gather(a, idx, dnums, slice_sizes=(1, h, 1, x, y),
                      mode=lax.GatherScatterMode.CLIP)


def take_blocks(pages, block_tables: jax.Array, layer=None):
    """`pages` (plain or QuantizedPages) gathered at blocks `block_tables` [B, M] along the block
    axis: arrays `[Hkv, B, M, ...]`. With `layer`, of that layer of a pool with a layer axis."""
    if layer is None:
        if isinstance(pages, QuantizedPages):
            return pages.take_blocks(block_tables)
        return jnp.take(pages, block_tables, axis=1, mode="clip")
    take = lambda a: None if a is None else take_layer_blocks(a, block_tables, layer)
    if isinstance(pages, QuantizedPages):
        return pages.replace(data=take(pages.data), scales=take(pages.scales),
                             zeros=take(pages.zeros))
    return take(pages)


def at_layer(pages, layer):
    """One layer of a pool with a layer axis (a dynamic index: a copy of that layer where XLA
    materializes it). Only the reference's whole-pool dot uses it, which reads the whole layer."""
    return jax.tree_util.tree_map(
        lambda a: lax.dynamic_index_in_dim(a, layer, axis=0, keepdims=False), pages)
