"""Page storage of every pool: the `PoolPages` pytree and its zeroed allocation.

Pool 0 and the host pool store full-precision arrays `[L, Hkv, N_p, P, D]`; a compressed pool of
a plain low-precision format (fp8) stores such arrays in its own dtype; each other compressed pool
stores `QuantizedPages` (the layout of `configs.formats`, shared with the kernels) whose arrays
carry a leading `[L]` axis. The host pool lives in `pinned_host` memory wherever the device offers
it (the CPU backend of jax >= 0.10 does, so CPU tests run the GPU's code path); kernels never read
it. Block axis is 2 in every array, so one page move serves every pool (`kvquota.core.pages`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import jax
import jax.numpy as jnp
from flax import struct

from kernels.quantization import QuantizedPages, empty_quantized_pages

if TYPE_CHECKING:
    from kvquota.state import StateConfig


Pages = Union[jax.Array, QuantizedPages]


@struct.dataclass
class PoolPages:
    """K and V pages of one pool: dtype[L, Hkv, N_p, P, D] for full-precision pools (host memory
    for the host pool), or `QuantizedPages` whose arrays carry a leading [L] axis."""

    k: Pages
    v: Pages


def host_sharding():
    """Where the host pool lives: `pinned_host` memory of the default device when it offers it
    (the CPU backend of jax >= 0.10 does; so do GPUs), else None (ordinary device memory)."""
    device = jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, NotImplementedError):  # backends without memory spaces
        return None
    if "pinned_host" not in kinds:
        return None
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def init_pages(config: StateConfig) -> tuple[PoolPages, ...]:
    """Zeroed pages for every pool (pool order), or () for a metadata-only config."""
    if not config.with_pages:
        return ()
    m = config.model
    pages = []
    for pool, fmt in enumerate(config.pool_formats):
        shape = config.page_shape(pool)
        if fmt.quantized:
            pair = []
            for role in ("key", "value"):
                one = jax.eval_shape(lambda r=role: empty_quantized_pages(
                    fmt, r, m.num_kv_heads, shape[2], config.block_size, m.head_dim))
                pair.append(jax.tree.map(lambda a: jnp.zeros((m.num_layers,) + a.shape, a.dtype),
                                         one))
            pages.append(PoolPages(k=pair[0], v=pair[1]))
            continue
        k, v = (jnp.zeros(shape, jnp.dtype(fmt.dtype)) for _ in range(2))  # f32/bf16/fp8...
        if pool == config.host_pool and host_sharding() is not None:
            k, v = (jax.device_put(a, host_sharding()) for a in (k, v))
        pages.append(PoolPages(k=k, v=v))
    return tuple(pages)


def to_memory(tree, host: bool):
    """Inside jit: place every array of `tree` in host (`pinned_host`) or device memory, where
    the backend has host memory (else unchanged). Moves between the host pool and a device pool
    go through this explicitly, so XLA never mixes memory spaces in one gather or scatter. Only
    the memory space changes: a pool split over a mesh (`kvquota.sharding`) stays split (older
    jax, without `jax.memory.Space`: the default device's memory, single-device states only)."""
    sharding = host_sharding()
    if sharding is None:
        return tree
    space = getattr(getattr(jax, "memory", None), "Space", None)
    if space is not None:  # the memory space alone: each array keeps its sharding
        target = space.Host if host else space.Device  # (a mesh-sharded pool stays split)
        return jax.tree.map(lambda a: jax.device_put(a, target), tree)
    if not host:
        device = next(iter(sharding.device_set))
        sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    return jax.tree.map(lambda a: jax.device_put(a, sharding), tree)
