"""Reports returned by the state operations: data (pytrees of arrays), so a step can be printed,
tested and plotted. Byte figures are exact Python ints computed on the host from block counts
(or int32 byte units) and the static bytes per block carried beside the arrays."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from flax import struct

from kvquota.codes import REASONS


def _units_to_bytes(units, unit_bytes: int):
    return np.asarray(units).astype(np.int64) * unit_bytes


def _blocks_to_bytes(blocks, pool_bytes):
    """Exact bytes of a [..., POOLS] block-count array, summed over pools."""
    blocks = np.asarray(blocks).astype(np.int64)
    return (blocks * np.asarray(pool_bytes, np.int64)).sum(-1)


@struct.dataclass
class AdmitReport:
    """Per prompt of an admit batch (B rows)."""

    admitted: jax.Array  # bool[B]
    reason: jax.Array  # i32[B]  OK or a REFUSED_* / SKIPPED_PADDING code
    seq_id: jax.Array  # i32[B]  assigned sequence slot; INVALID if refused
    cached_tokens: jax.Array  # i32[B]  prompt tokens whose K/V already sit in hit blocks
    hit_blocks: jax.Array  # i32[B]  blocks taken by reference from the prefix cache
    new_blocks: jax.Array  # i32[B]  blocks allocated from pool 0
    # i32[B]  blocks of the prompt the prefix cache did not hold (hot or cold), refused rows
    # too: the fewest new blocks the row can need while the cache keeps them (cold hits it
    # revives are charged on top); the scheduler's host-side sure refusals use it
    missing_blocks: jax.Array

    def reasons(self) -> list[str]:
        return [REASONS[int(r)] for r in np.asarray(self.reason)]


@struct.dataclass
class AppendReport:
    """Per row of an append batch: where the new token's K/V goes (pool-0 page, offset)."""

    appended: jax.Array  # bool[B]
    reason: jax.Array  # i32[B]
    block: jax.Array  # i32[B]  block (= page index) holding the token; INVALID if refused
    offset: jax.Array  # i32[B]  slot of the token inside the block
    new_block: jax.Array  # bool[B]  a block was allocated for it

    def reasons(self) -> list[str]:
        return [REASONS[int(r)] for r in np.asarray(self.reason)]


@struct.dataclass
class ForkReport:
    """Per source sequence of a fork batch."""

    forked: jax.Array  # bool[B]
    reason: jax.Array  # i32[B]
    seq_id: jax.Array  # i32[B]  the child's slot; INVALID if refused
    copied_from: jax.Array  # i32[B]  partly filled last block copied on write, or INVALID
    copied_to: jax.Array  # i32[B]  the child's private copy of it, or INVALID

    def reasons(self) -> list[str]:
        return [REASONS[int(r)] for r in np.asarray(self.reason)]


@struct.dataclass
class PinReport:
    pin_count: jax.Array  # i32[B]  pin count of each block after the call
    blocks_returned: jax.Array  # i32[POOLS]  blocks freed by an unpin (0 for pin)
    pool_bytes: tuple = struct.field(pytree_node=False, default=())

    @property
    def pool_bytes_returned(self) -> int:
        return int(_blocks_to_bytes(self.blocks_returned, self.pool_bytes))


class _HostUse:
    """The host watermark alarm of a report carrying `host_blocks_used` (i32[], host pool blocks
    held after the op) and the static `host_blocks` / `host_watermark` of its config."""

    @property
    def host_alarm(self) -> bool:
        return host_alarm(int(self.host_blocks_used), self.host_blocks, self.host_watermark)


@struct.dataclass
class FreeReport(_HostUse):
    """What dropping references (free / release / unpin) gave back.

    `pool_bytes_returned` counts blocks that went back to a free list; `quota_bytes_released`
    counts charges a tenant stopped paying, which includes shared blocks whose charge passed to
    an heir and returned nothing to the pool.
    """

    seqs_freed: jax.Array  # i32[]
    tokens_released: jax.Array  # i32[T]  logical tokens each tenant stopped using
    blocks_returned: jax.Array  # i32[POOLS]  blocks returned to each pool's free capacity
    quota_units_released: jax.Array  # i32[T]  charges dropped per tenant, in byte units
    transferred_blocks: jax.Array  # i32[]  blocks whose charge passed to an heir
    inherited_units: jax.Array  # i32[T]  charges taken over per heir, in byte units
    heir_over_quota: jax.Array  # bool[T]  an inherited charge put the heir over its byte quota
    unpinned_blocks: jax.Array  # i32[]  pins dropped (release with unpin=True, or unpin)
    host_blocks_used: jax.Array  # i32[]  host pool blocks held after the call
    pool_bytes: tuple = struct.field(pytree_node=False, default=())
    unit_bytes: int = struct.field(pytree_node=False, default=1)
    host_blocks: int = struct.field(pytree_node=False, default=0)
    host_watermark: float = struct.field(pytree_node=False, default=0.8)

    @property
    def pool_bytes_returned(self) -> int:
        return int(_blocks_to_bytes(self.blocks_returned, self.pool_bytes))

    @property
    def quota_bytes_released(self) -> int:
        return int(_units_to_bytes(self.quota_units_released, self.unit_bytes).sum())

    @property
    def quota_bytes_released_by_tenant(self) -> np.ndarray:
        return _units_to_bytes(self.quota_units_released, self.unit_bytes)

    @property
    def inherited_bytes(self) -> np.ndarray:
        return _units_to_bytes(self.inherited_units, self.unit_bytes)


@struct.dataclass
class PreemptReport:
    """What a preemption archived (per row of the batch) and what dropping the KV gave back."""

    seq_ids: jax.Array  # i32[B]  the preempted slots (INVALID = padding)
    tenants: jax.Array  # i32[B]
    lengths: jax.Array  # i32[B]  cached tokens dropped
    positions: jax.Array  # i32[B]  logical position of the next token (RoPE)
    token_ids: jax.Array  # i32[B, MB * P]  cached token ids in cache order; INVALID past length
    free: FreeReport  # the references dropped

    def archives(self) -> list[tuple[int, int, np.ndarray, int]]:
        """(seq, tenant, token ids, position) of each real row, on the host."""
        ids, ten, lens, pos, tok = jax.device_get(
            (self.seq_ids, self.tenants, self.lengths, self.positions, self.token_ids))
        return [(int(ids[i]), int(ten[i]), np.asarray(tok[i, :lens[i]]), int(pos[i]))
                for i in range(len(ids)) if ids[i] >= 0]


@struct.dataclass
class MoveReport(_HostUse):
    """What a lossless move between pools (offload to host, restore to device) did.

    `pool_bytes_returned` counts the source pool's blocks that went back to its free list;
    `bytes_moved` the bytes copied across; `transfer_seconds` their time at the configured host
    bandwidth (a model, not a measurement). The host alarm rings when the host pool is filled to
    its watermark.
    """

    moved_blocks: jax.Array  # i32[B]  own blocks moved per sequence
    blocks_returned: jax.Array  # i32[POOLS]  blocks returned to each pool's free capacity
    quota_units_released: jax.Array  # i32[T]  charges dropped per tenant in the source pool
    host_blocks_used: jax.Array  # i32[]  host pool blocks held after the move
    src_pool: int = struct.field(pytree_node=False, default=0)
    dst_pool: int = struct.field(pytree_node=False, default=0)
    pool_bytes: tuple = struct.field(pytree_node=False, default=())
    unit_bytes: int = struct.field(pytree_node=False, default=1)
    host_blocks: int = struct.field(pytree_node=False, default=0)
    host_watermark: float = struct.field(pytree_node=False, default=0.8)
    host_bandwidth: float = struct.field(pytree_node=False, default=50e9)

    @property
    def blocks_moved(self) -> int:
        return int(np.asarray(self.moved_blocks).sum())

    @property
    def bytes_moved(self) -> int:
        return self.blocks_moved * self.pool_bytes[self.src_pool]

    @property
    def pool_bytes_returned(self) -> int:
        return int(_blocks_to_bytes(self.blocks_returned, self.pool_bytes))

    @property
    def transfer_seconds(self) -> float:
        return self.bytes_moved / self.host_bandwidth


@struct.dataclass
class CompressReport(_HostUse):
    """What a compression did: pool-0 bytes freed, compressed bytes now charged, the net device
    bytes returned. Always lossy: the compressed blocks' K/V are approximations from now on."""

    compressed_blocks: jax.Array  # i32[B]  blocks requantized per sequence
    blocks_returned: jax.Array  # i32[POOLS]  blocks returned to each pool's free capacity
    quota_units_released: jax.Array  # i32[T]  pool-0 charges dropped per tenant, in byte units
    host_blocks_used: jax.Array  # i32[]  host pool blocks held after the call
    pool: int = struct.field(pytree_node=False, default=1)  # the compressed pool written
    pool_bytes: tuple = struct.field(pytree_node=False, default=())
    unit_bytes: int = struct.field(pytree_node=False, default=1)
    lossy: bool = struct.field(pytree_node=False, default=True)
    host_blocks: int = struct.field(pytree_node=False, default=0)
    host_watermark: float = struct.field(pytree_node=False, default=0.8)

    @property
    def blocks_compressed(self) -> int:
        return int(np.asarray(self.compressed_blocks).sum())

    @property
    def pool0_bytes_freed(self) -> int:
        return int(np.asarray(self.blocks_returned)[0]) * self.pool_bytes[0]

    @property
    def compressed_bytes_charged(self) -> int:
        return self.blocks_compressed * self.pool_bytes[self.pool]

    @property
    def net_device_bytes_returned(self) -> int:
        return self.pool0_bytes_freed - self.compressed_bytes_charged


@struct.dataclass
class EvictReport(_HostUse):
    """What an eviction did: tokens gone for good per sequence (the context breaks there), the
    blocks copied on write (shared blocks are never altered under another sequence) and the
    blocks returned."""

    evicted_tokens: jax.Array  # i32[B]  tokens dropped per sequence
    copied_blocks: jax.Array  # i32[B]  fresh pool-0 blocks taken for copies on write
    blocks_returned: jax.Array  # i32[POOLS]  blocks returned to each pool's free capacity
    quota_units_released: jax.Array  # i32[T]  charges dropped per tenant, in byte units
    transferred_blocks: jax.Array  # i32[]  shared blocks whose charge passed to an heir
    host_blocks_used: jax.Array  # i32[]  host pool blocks held after the call
    kept: Optional[np.ndarray] = None  # token mode: bool[B, L, Hkv, C] what each head kept
    pool_bytes: tuple = struct.field(pytree_node=False, default=())
    unit_bytes: int = struct.field(pytree_node=False, default=1)
    lossy: bool = struct.field(pytree_node=False, default=True)
    host_blocks: int = struct.field(pytree_node=False, default=0)
    host_watermark: float = struct.field(pytree_node=False, default=0.8)

    @property
    def pool_bytes_returned(self) -> int:
        return int(_blocks_to_bytes(self.blocks_returned, self.pool_bytes))

    @property
    def quota_bytes_released(self) -> int:
        return int(_units_to_bytes(self.quota_units_released, self.unit_bytes).sum())


def host_alarm(used_blocks: int, host_blocks: int, watermark: float) -> bool:
    """The host pool's watermark alarm: held blocks at or above `watermark` of its capacity."""
    return host_blocks > 0 and used_blocks >= watermark * host_blocks


@struct.dataclass
class TenantReport:
    """After registering or changing a tenant: how far it is over its (possibly cut) quotas."""

    tokens_over: jax.Array  # i32[]  used_tokens - token_quota, or 0
    units_over: jax.Array  # i32[]  charged device units - byte_quota, or 0
    unit_bytes: int = struct.field(pytree_node=False, default=1)

    @property
    def bytes_over(self) -> int:
        return int(_units_to_bytes(self.units_over, self.unit_bytes))


@struct.dataclass
class Ledger:
    """Per-tenant accounting view (T tenants, POOLS pools), derived from the state."""

    used_tokens: jax.Array  # i32[T]
    token_quota: jax.Array  # i32[T]
    byte_quota_units: jax.Array  # i32[T]
    charged_blocks: jax.Array  # i32[T, POOLS]  blocks it pays for
    pinned_blocks: jax.Array  # i32[T, POOLS]  of which pinned
    shared_blocks: jax.Array  # i32[T, POOLS]  distinct blocks it references but others pay for
    reclaimable_blocks: jax.Array  # i32[T, POOLS]  charged, unpinned, referenced only by itself
    fragmentation: jax.Array  # i32[T]  device slots charged to it minus tokens stored in them
    free_blocks: jax.Array  # i32[POOLS]  allocatable now: free lists, plus pool 0's cold blocks
    cold_blocks: jax.Array  # i32[]  cold cached blocks (keep_cold_blocks): free, still cache
    pool_fragmentation: jax.Array  # i32[]  held device slots minus tokens stored in them
    growing: jax.Array  # bool[T]  grow-no-admit flag set by a reclaim plan
    preemptions: jax.Array  # i32[T]  sequences preempted so far
    pool_bytes: tuple = struct.field(pytree_node=False, default=())
    unit_bytes: int = struct.field(pytree_node=False, default=1)
    pool_sizes: tuple = struct.field(pytree_node=False, default=())
    host_pool: Optional[int] = struct.field(pytree_node=False, default=None)
    host_watermark: float = struct.field(pytree_node=False, default=0.8)

    def bytes(self, field: str) -> np.ndarray:
        """Exact bytes (int64[T]) of a [T, POOLS] block-count field, e.g. "reclaimable_blocks"."""
        return _blocks_to_bytes(getattr(self, field), self.pool_bytes)

    @property
    def charged_bytes(self) -> np.ndarray:
        return self.bytes("charged_blocks")

    @property
    def pinned_bytes(self) -> np.ndarray:
        return self.bytes("pinned_blocks")

    @property
    def shared_bytes(self) -> np.ndarray:
        return self.bytes("shared_blocks")

    @property
    def reclaimable_bytes(self) -> np.ndarray:
        return self.bytes("reclaimable_blocks")

    @property
    def byte_quota(self) -> np.ndarray:
        return _units_to_bytes(self.byte_quota_units, self.unit_bytes)

    @property
    def host_bytes(self) -> np.ndarray:
        """int64[T]: bytes each tenant holds in the host pool (outside its device byte quota)."""
        if self.host_pool is None:
            return np.zeros(len(np.asarray(self.used_tokens)), np.int64)
        blocks = np.asarray(self.charged_blocks)[:, self.host_pool].astype(np.int64)
        return blocks * self.pool_bytes[self.host_pool]

    @property
    def device_bytes(self) -> np.ndarray:
        """int64[T]: device-resident bytes charged (what the byte quota caps)."""
        return self.charged_bytes - self.host_bytes

    @property
    def host_alarm(self) -> bool:
        """The host pool is filled to its watermark (compression is gated on this)."""
        if self.host_pool is None:
            return False
        used = self.pool_sizes[self.host_pool] - int(np.asarray(self.free_blocks)[self.host_pool])
        return host_alarm(used, self.pool_sizes[self.host_pool], self.host_watermark)

    def summary(self, tenant: Optional[int] = None) -> dict:
        """Plain-Python numbers for printing or JSON."""
        h = jax.device_get(self)  # one host read, then NumPy indexing
        rows = range(len(np.asarray(h.used_tokens))) if tenant is None else [tenant]
        out = {}
        for t in rows:
            out[t] = {
                "used_tokens": int(h.used_tokens[t]),
                "token_quota": int(h.token_quota[t]),
                "byte_quota": int(h.byte_quota[t]),
                "charged_bytes": int(h.charged_bytes[t]),
                "device_bytes": int(h.device_bytes[t]),
                "host_bytes": int(h.host_bytes[t]),
                "pinned_bytes": int(h.pinned_bytes[t]),
                "shared_bytes": int(h.shared_bytes[t]),
                "reclaimable_bytes": int(h.reclaimable_bytes[t]),
                "fragmentation_tokens": int(h.fragmentation[t]),
                "preemptions": int(h.preemptions[t]),
                "growing": bool(h.growing[t]),
            }
        return out
