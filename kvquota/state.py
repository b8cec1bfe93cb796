"""The paged KV cache as one immutable pytree, and the static config that fixes its shapes.

Layout (DESIGN.md §2 "State"):

* **Pools.** Global block ids are partitioned into contiguous ranges, one per pool. Pool 0 is the
  full-precision device pool and comes first, so its block ids equal its page indices
  `0 .. num_blocks - 1`. Then one device pool per compressed format (`compressed_pools`), then the
  host pool (full-precision format, host tier; kernels never read it). Each pool has its own free
  list. Tier and precision of a block are fixed by its pool.
* **Pages.** Only pool 0 carries pages for now: `k_pages`, `v_pages`, each
  `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]` (so `k_pages[l]` is the
  `[Hkv, N, P, D]` layout the paged-attention kernels take). Compressed and host pools are
  metadata-only in this version; the compression/offload work gives them storage following
  `QuantSpec.data_shape` / `scale_shape`. With `with_pages=False` the whole state is metadata-only,
  which is how the allocator runs at Qwen2.5-72B scale.
* **Bytes.** JAX is 32-bit by default and a Qwen2.5-72B block is 5 MiB, so byte quantities in the
  state are counted in *units* of `config.unit_bytes` = gcd of the pools' bytes per block (every
  block is a whole number of units). Reports and ledgers convert to exact Python-int bytes on the
  host.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from configs.models import ModelConfig
from kvquota.accounting import KVLayout, check_positive
from kvquota.formats import KVFormat, get_kv_format
from kvquota.sentinel import INVALID

# Sequence status (i8). Later reclaim work adds its fates as new values.
SEQ_FREE = 0  # slot unused: tenant INVALID, empty table
SEQ_RUNNING = 1  # holds its blocks, may append
SEQ_PREEMPTED = 2  # reserved: archived, to be replayed by recomputing prefill
SEQ_SUSPENDED = 3  # reserved: its blocks offloaded to the host pool

# Block tier (i8): where a pool lives.
TIER_DEVICE = 0
TIER_HOST = 1

# Reason codes (i32) in admit/append/fork reports; 0 means the request went through.
OK = 0
REFUSED_TOKEN_QUOTA = 1  # the tenant's token quota (logical usage) would be exceeded
REFUSED_BYTE_QUOTA = 2  # the tenant's byte quota (resident bytes charged) would be exceeded
REFUSED_POOL_FULL = 3  # not enough free blocks in the pool
REFUSED_NO_SEQ_SLOT = 4  # no free sequence slot
REFUSED_SEQ_FULL = 5  # the sequence's block table is full (append only)
SKIPPED_PADDING = 6  # the row was padding (INVALID tenant or sequence id)
REASONS = {
    OK: "ok",
    REFUSED_TOKEN_QUOTA: "over token quota",
    REFUSED_BYTE_QUOTA: "over byte quota",
    REFUSED_POOL_FULL: "pool full",
    REFUSED_NO_SEQ_SLOT: "no sequence slot",
    REFUSED_SEQ_FULL: "block table full",
    SKIPPED_PADDING: "padding row",
}

INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class StateConfig:
    """Static sizes of a paged KV state; frozen and hashable, passed to `jax.jit` as static.

    Attributes:
      model: model shape (layers, KV heads, head_dim) used for bytes per block and page shapes.
      num_blocks: blocks in the full-precision device pool (pool 0).
      block_size: tokens per block (P).
      max_seqs: sequence slots (S).
      max_blocks_per_seq: block-table width (MB); a sequence holds at most MB * P tokens.
      num_tenants: tenant slots (T); tenants are registered into them.
      kv_format: full-precision format of pool 0 and the host pool ("bf16", "f32", ...).
      compressed_pools: (format name, blocks) for each compressed device pool, in pool order.
      host_blocks: blocks in the host pool (0: no host pool).
      with_pages: allocate pool 0's `k_pages`/`v_pages` (False: metadata-only).
      scrub_on_free: zero the pages of blocks returned to the pool.
      lookup_candidates: equal-hash blocks checked per prefix lookup (token/parent check).
      hash_bits: bits kept per 32-bit hash word; < 32 only to force collisions in tests.
    """

    model: ModelConfig
    num_blocks: int
    block_size: int = 16
    max_seqs: int = 64
    max_blocks_per_seq: int = 64
    num_tenants: int = 8
    kv_format: str = "bf16"
    compressed_pools: tuple[tuple[str, int], ...] = ()
    host_blocks: int = 0
    with_pages: bool = True
    scrub_on_free: bool = False
    lookup_candidates: int = 4
    hash_bits: int = 32

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_seqs", "max_blocks_per_seq",
                     "num_tenants", "lookup_candidates"):
            check_positive(**{name: getattr(self, name)})
        if not isinstance(self.host_blocks, int) or self.host_blocks < 0:
            raise ValueError(f"host_blocks must be a non-negative integer, got {self.host_blocks!r}")
        if get_kv_format(self.kv_format).quantized:
            raise ValueError(f"kv_format {self.kv_format!r} of pool 0 must be unquantized")
        if not isinstance(self.compressed_pools, tuple):
            raise ValueError("compressed_pools must be a tuple of (format name, blocks)")
        for entry in self.compressed_pools:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise ValueError(f"compressed pool {entry!r} is not (format name, blocks)")
            get_kv_format(entry[0])
            check_positive(**{f"blocks of compressed pool {entry[0]!r}": entry[1]})
        names = [self.kv_format] + [name for name, _ in self.compressed_pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool formats must be distinct, got {names}")
        if not 0 <= self.hash_bits <= 32:
            raise ValueError(f"hash_bits must be in [0, 32], got {self.hash_bits}")
        # Everything in the state is int32: make sure no count can overflow.
        if self.total_blocks * self.block_size > INT32_MAX:
            raise ValueError("total_blocks * block_size must fit in int32")
        if self.total_blocks * max(self.pool_units) > INT32_MAX:
            raise ValueError(
                f"byte units overflow int32: {self.total_blocks} blocks x "
                f"{max(self.pool_units)} units of {self.unit_bytes} B"
            )

    # ---- pools -------------------------------------------------------------------------------
    @property
    def pool_formats(self) -> tuple[KVFormat, ...]:
        """Storage format of each pool, in pool order (device full, compressed..., host)."""
        fmts = [get_kv_format(self.kv_format)]
        fmts += [get_kv_format(name) for name, _ in self.compressed_pools]
        if self.host_blocks:
            fmts.append(get_kv_format(self.kv_format))
        return tuple(fmts)

    @property
    def pool_sizes(self) -> tuple[int, ...]:
        """Blocks per pool."""
        sizes = [self.num_blocks] + [n for _, n in self.compressed_pools]
        if self.host_blocks:
            sizes.append(self.host_blocks)
        return tuple(sizes)

    @property
    def num_pools(self) -> int:
        return len(self.pool_sizes)

    @property
    def pool_starts(self) -> tuple[int, ...]:
        """First global block id of each pool (pool 0 starts at 0)."""
        return tuple(int(x) for x in np.cumsum((0,) + self.pool_sizes[:-1]))

    @property
    def total_blocks(self) -> int:
        """NB: blocks over all pools; length of every per-block array."""
        return sum(self.pool_sizes)

    @property
    def pool_tiers(self) -> tuple[int, ...]:
        tiers = [TIER_DEVICE] * (1 + len(self.compressed_pools))
        if self.host_blocks:
            tiers.append(TIER_HOST)
        return tuple(tiers)

    @property
    def pool_precisions(self) -> tuple[int, ...]:
        """Precision code of each pool: index into `precisions` (host pool: full precision, 0)."""
        codes = list(range(1 + len(self.compressed_pools)))
        if self.host_blocks:
            codes.append(0)
        return tuple(codes)

    @property
    def precisions(self) -> tuple[str, ...]:
        """Format names by precision code."""
        return (self.kv_format,) + tuple(name for name, _ in self.compressed_pools)

    @property
    def host_pool(self) -> Optional[int]:
        """Index of the host pool, or None."""
        return self.num_pools - 1 if self.host_blocks else None

    def layout(self, pool: int = 0) -> KVLayout:
        return KVLayout(self.model, self.pool_formats[pool], self.block_size)

    @property
    def pool_bytes(self) -> tuple[int, ...]:
        """Bytes of one block in each pool (K and V, all layers and KV heads, scales included)."""
        return tuple(self.layout(p).bytes_per_block for p in range(self.num_pools))

    @property
    def unit_bytes(self) -> int:
        """The byte unit of the int32 byte counters: gcd of the pools' bytes per block."""
        return math.gcd(*self.pool_bytes)

    @property
    def pool_units(self) -> tuple[int, ...]:
        """Units per block of each pool."""
        return tuple(b // self.unit_bytes for b in self.pool_bytes)

    @property
    def device_pools(self) -> tuple[bool, ...]:
        """Whether each pool counts against byte quotas (device-resident)."""
        return tuple(t == TIER_DEVICE for t in self.pool_tiers)

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of `k_pages` / `v_pages`: [L, Hkv, N, P, D]."""
        m = self.model
        return (m.num_layers, m.num_kv_heads, self.num_blocks, self.block_size, m.head_dim)

    @property
    def page_dtype(self):
        return jnp.dtype(self.pool_formats[0].dtype)


@struct.dataclass
class KVState:
    """The whole paged KV cache: pages, per-block metadata, sequences and the tenant ledger.

    NB = config.total_blocks, N = config.num_blocks (pool 0), P = block_size, S = max_seqs,
    MB = max_blocks_per_seq, T = num_tenants, POOLS = num_pools. Empty entries hold INVALID.
    Fields whose values a later reclaim op needs (tier, precision, status, positions) exist now.
    """

    # ---- pages of pool 0 (None when metadata-only) --------------------------------------------
    k_pages: Optional[jax.Array]  # dtype[L, Hkv, N, P, D]
    v_pages: Optional[jax.Array]  # dtype[L, Hkv, N, P, D]

    # ---- per-block metadata --------------------------------------------------------------------
    ref_count: jax.Array  # i32[NB]  block-table entries (of live sequences) naming the block
    pin_count: jax.Array  # i32[NB]  pins, counted apart from references
    payer: jax.Array  # i32[NB]  tenant charged for the block; INVALID when free
    payer_refs: jax.Array  # i32[NB]  references held by the payer's own sequences
    tier: jax.Array  # i8[NB]   TIER_DEVICE / TIER_HOST, fixed by the pool range
    precision: jax.Array  # i8[NB]   index into config.precisions, fixed by the pool range
    fill: jax.Array  # i32[NB]  tokens stored in the block (0..P)
    token_ids: jax.Array  # i32[NB, P]  the block's token ids; INVALID past `fill`
    block_hash: jax.Array  # u32[NB, 2]  chained content hash (two 32-bit words) of a full block
    hashed: jax.Array  # bool[NB]  the block is a prefix-cache lookup target
    block_salt: jax.Array  # u32[NB]  salt of the hash chain the block belongs to
    parent: jax.Array  # i32[NB]  previous block of its chain at creation; INVALID for the first
    parent_gen: jax.Array  # i32[NB]  `generation` of `parent` when this block was created
    generation: jax.Array  # i32[NB]  bumped each time the block is freed (detects stale parents)

    # ---- free lists: pool p's free ids are free_list[start_p : start_p + free_count[p]] -------
    free_list: jax.Array  # i32[NB]  per-pool stacks; the top is popped first
    free_count: jax.Array  # i32[POOLS]

    # ---- per-sequence tables ---------------------------------------------------------------
    block_tables: jax.Array  # i32[S, MB]  global block ids; INVALID past the sequence's blocks
    seq_lens: jax.Array  # i32[S]  cached tokens: slots held in the table (K/V written by the caller)
    positions: jax.Array  # i32[S]  logical (RoPE) position of the next token
    seq_tenant: jax.Array  # i32[S]  owning tenant; INVALID for a free slot
    seq_status: jax.Array  # i8[S]  SEQ_FREE / SEQ_RUNNING / ...

    # ---- tenant ledger -----------------------------------------------------------------------
    registered: jax.Array  # bool[T]
    token_quota: jax.Array  # i32[T]  cap on used_tokens
    byte_quota: jax.Array  # i32[T]  cap on device-resident charged bytes, in units of unit_bytes
    lease_expiry: jax.Array  # i32[T]  step at which the lease ends (release_tenant then)
    salt: jax.Array  # u32[T]  first-block hash salt: private per tenant, or a shared group's
    used_tokens: jax.Array  # i32[T]  sum of seq_lens over the tenant's sequences
    charged_blocks: jax.Array  # i32[T, POOLS]  blocks whose payer is the tenant
    pinned_blocks: jax.Array  # i32[T, POOLS]  charged blocks with pin_count > 0


# ---- hashing --------------------------------------------------------------------------------
# Chained block hash, as in vLLM's prefix cache: h_k = f(h_{k-1}, tokens of block k), with the
# chain seeded from the tenant's salt. Each 32-bit word runs its own chain with its own seed;
# mixing uses the MurmurHash3 32-bit finalizer (Appleby), which is a bijection on uint32.
# This is not a keyed cryptographic hash: a hit is only accepted after the token ids, salt and
# parent block are checked, so a collision can cost a miss, never a wrong block.
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B1
HASH_SEEDS = (0x243F6A88, 0x85A308D3)  # digits of pi, one per word


def _fmix32(h, xp):
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(_M1)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(_M2)
    return h ^ (h >> xp.uint32(16))


def _hash_mask(bits: int) -> int:
    return (1 << bits) - 1


def salt_root(salt, bits: int = 32, xp=jnp):
    """u32[..., 2]: the chain value before the first block, from a u32 salt."""
    salt = xp.asarray(salt).astype(xp.uint32)
    words = [_fmix32(salt ^ xp.uint32(seed), xp) for seed in HASH_SEEDS]
    return xp.stack(words, axis=-1) & xp.uint32(_hash_mask(bits))


def block_hash(prev, tokens, bits: int = 32, xp=jnp):
    """u32[..., 2] hash of a full block from the previous chain value u32[..., 2], tokens i32[..., P]."""
    tokens = xp.asarray(tokens).astype(xp.uint32)
    words = []
    for w, seed in enumerate(HASH_SEEDS):
        h = prev[..., w]
        for j in range(tokens.shape[-1]):
            h = _fmix32(h ^ (tokens[..., j] * xp.uint32(_GOLDEN) + xp.uint32(seed)), xp)
        words.append(h)
    return xp.stack(words, axis=-1) & xp.uint32(_hash_mask(bits))


def private_salt(tenant: int) -> int:
    """Default salt of a tenant: distinct per tenant id (fmix32 is a bijection)."""
    return int(_fmix32(np.array([tenant + 1], np.uint32), np)[0])


def group_salt(group: int) -> int:
    """Salt of a sharing group: tenants registered with the same group share prefix blocks."""
    return int(_fmix32(np.array([0x80000000 | group], np.uint32), np)[0])


def pool_of(config: StateConfig, block_ids, xp=jnp):
    """Pool index of each global block id (ids must be valid)."""
    ids = xp.asarray(block_ids)
    pool = xp.zeros(ids.shape, dtype=xp.int32)
    for start in config.pool_starts[1:]:
        pool = pool + (ids >= start).astype(xp.int32)
    return pool


def init_state(config: StateConfig) -> KVState:
    """An empty state: every block free (lowest ids popped first), no sequence, no tenant."""
    nb, p = config.total_blocks, config.block_size
    s, mb, t, npools = config.max_seqs, config.max_blocks_per_seq, config.num_tenants, config.num_pools
    free_list = np.concatenate([
        np.arange(start + size - 1, start - 1, -1, dtype=np.int32)
        for start, size in zip(config.pool_starts, config.pool_sizes)
    ])
    tier = np.concatenate([np.full(n, tr, np.int8) for n, tr in zip(config.pool_sizes, config.pool_tiers)])
    prec = np.concatenate([
        np.full(n, pr, np.int8) for n, pr in zip(config.pool_sizes, config.pool_precisions)
    ])
    pages = None, None
    if config.with_pages:
        pages = tuple(jnp.zeros(config.page_shape, config.page_dtype) for _ in range(2))
    i32 = lambda shape, v=0: jnp.full(shape, v, jnp.int32)  # noqa: E731
    return KVState(
        k_pages=pages[0],
        v_pages=pages[1],
        ref_count=i32((nb,)),
        pin_count=i32((nb,)),
        payer=i32((nb,), INVALID),
        payer_refs=i32((nb,)),
        tier=jnp.asarray(tier),
        precision=jnp.asarray(prec),
        fill=i32((nb,)),
        token_ids=i32((nb, p), INVALID),
        block_hash=jnp.zeros((nb, 2), jnp.uint32),
        hashed=jnp.zeros((nb,), bool),
        block_salt=jnp.zeros((nb,), jnp.uint32),
        parent=i32((nb,), INVALID),
        parent_gen=i32((nb,)),
        generation=i32((nb,)),
        free_list=jnp.asarray(free_list),
        free_count=jnp.asarray(np.array(config.pool_sizes, np.int32)),
        block_tables=i32((s, mb), INVALID),
        seq_lens=i32((s,)),
        positions=i32((s,)),
        seq_tenant=i32((s,), INVALID),
        seq_status=jnp.zeros((s,), jnp.int8),
        registered=jnp.zeros((t,), bool),
        token_quota=i32((t,)),
        byte_quota=i32((t,)),
        lease_expiry=i32((t,)),
        salt=jnp.zeros((t,), jnp.uint32),
        used_tokens=i32((t,)),
        charged_blocks=i32((t, npools)),
        pinned_blocks=i32((t, npools)),
    )
