"""The paged KV cache as one immutable pytree of small sub-pytrees, and the static config.

Layout (DESIGN.md §2 "State"):

* **Pools.** Global block ids are partitioned into contiguous ranges, one per pool. Pool 0 is the
  full-precision device pool and comes first, so its block ids equal its page indices
  `0 .. num_blocks - 1`. Then one device pool per compressed format (`compressed_pools`), then the
  host pool (full-precision format, host tier; kernels never read it). Each pool has its own free
  list. Tier and precision of a block are fixed by its pool.
* **Pages in every pool.** `KVState.pages[p]` holds pool p's K and V: full-precision arrays
  `[L, Hkv, N_p, P, D]` for pool 0 (so `pages[0].k[l]` is the `[Hkv, N, P, D]` layout the
  paged-attention kernels take), `QuantizedPages` with a leading `[L]` axis for each compressed
  pool, and for the host pool full-precision arrays placed in host memory (`pinned_host`) wherever
  the device offers it (`kvquota.pages`). A block's page index inside its pool is `block id - pool_starts[p]`.
  With `with_pages=False` the state is metadata-only (`pages == ()`), which is how the allocator
  runs at Qwen2.5-72B scale.
* **Bytes.** JAX is 32-bit by default and a Qwen2.5-72B block is 5 MiB, so byte quantities in the
  state are counted in *units* of `config.unit_bytes` = gcd of the pools' bytes per block (every
  block is a whole number of units). Reports and ledgers convert to exact Python-int bytes on the
  host.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from configs.formats import KVFormat, get_kv_format
from configs.models import ModelConfig
from kvquota.accounting import KVLayout, check_positive
from kvquota.codes import INT32_MAX, TIER_DEVICE, TIER_HOST
from kvquota.errors import ConfigError, FormatSpecError, StateMismatchError
from kvquota.pages import PoolPages, init_pages
from kvquota.prefix_index import PrefixIndex, init_index
from kvquota.sentinel import INVALID


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
      with_pages: allocate every pool's pages (False: metadata-only, no page arrays at all).
      scrub_on_free: zero the pages of blocks returned to any pool.
      lookup_candidates: equal-hash blocks checked per prefix lookup (token/parent check).
      hash_bits: bits kept per 32-bit hash word; < 32 only to force collisions in tests.
      host_watermark: fraction of the host pool at which its alarm rings (compression, the
        next reclaim means, is gated on it).
      host_bandwidth: host <-> device copy bandwidth in bytes/s for the modelled transfer time
        of offload/restore (default 50 GB/s: PCIe Gen5 x16, effective).
      keep_cold_blocks: full pool-0 blocks that lose their last reference stay in the prefix
        cache as *cold* blocks (charged to no one, counted as free capacity, reused least
        recently freed first), so a tenant's next turn can still hit them (vLLM, SGLang). Off:
        freed blocks leave the cache at once, exactly as before.
      prefix_index: lookups probe the hash index (False: join every block, O(pool): the baseline).
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
    host_watermark: float = 0.8
    host_bandwidth: float = 50e9
    keep_cold_blocks: bool = False
    prefix_index: bool = True

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_seqs", "max_blocks_per_seq",
                     "num_tenants", "lookup_candidates"):
            check_positive(**{name: getattr(self, name)})
        if not isinstance(self.host_blocks, int) or self.host_blocks < 0:
            raise ConfigError(f"host_blocks must be a non-negative integer, got {self.host_blocks!r}")
        if get_kv_format(self.kv_format).quantized:
            raise ConfigError(f"kv_format {self.kv_format!r} of pool 0 must be unquantized")
        if not isinstance(self.compressed_pools, tuple):
            raise ConfigError("compressed_pools must be a tuple of (format name, blocks)")
        for entry in self.compressed_pools:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise ConfigError(f"compressed pool {entry!r} is not (format name, blocks)")
            fmt = get_kv_format(entry[0])
            check_positive(**{f"blocks of compressed pool {entry[0]!r}": entry[1]})
            try:  # a KIVI key group must be a whole number of blocks
                if fmt.quantized:
                    fmt.key.pages_per_group(self.block_size)
            except FormatSpecError as err:
                raise ConfigError(f"compressed pool {entry[0]!r}: {err}") from None
        names = [self.kv_format] + [name for name, _ in self.compressed_pools]
        if len(set(names)) != len(names):
            raise ConfigError(f"pool formats must be distinct, got {names}")
        if not 0 < self.host_watermark <= 1:
            raise ConfigError(f"host_watermark must be in (0, 1], got {self.host_watermark}")
        if not self.host_bandwidth > 0:
            raise ConfigError(f"host_bandwidth must be > 0 bytes/s, got {self.host_bandwidth}")
        if not 0 <= self.hash_bits <= 32:
            raise ConfigError(f"hash_bits must be in [0, 32], got {self.hash_bits}")
        # Everything in the state is int32: make sure no count can overflow.
        if self.total_blocks * self.block_size > INT32_MAX:
            raise ConfigError("total_blocks * block_size must fit in int32")
        if self.total_blocks * max(self.pool_units) > INT32_MAX:
            raise ConfigError(f"byte units overflow int32: {self.total_blocks} blocks x "
                             f"{max(self.pool_units)} units of {self.unit_bytes} B")

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

    @functools.cached_property  # read in every room check and plan step
    def pool_bytes(self) -> tuple[int, ...]:
        """Bytes of one block in each pool (K and V, all layers and KV heads, scales included)."""
        return tuple(self.layout(p).bytes_per_block for p in range(self.num_pools))

    @functools.cached_property  # read in every room check and plan step
    def unit_bytes(self) -> int:
        """The byte unit of the int32 byte counters: gcd of the pools' bytes per block."""
        return math.gcd(*self.pool_bytes)

    @functools.cached_property  # read in every room check and plan step
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

    def page_shape(self, pool: int = 0) -> tuple[int, ...]:
        """Logical shape of one of K or V of a pool's pages: [L, Hkv, N_pool, P, D]."""
        m = self.model
        return (m.num_layers, m.num_kv_heads, self.pool_sizes[pool], self.block_size, m.head_dim)

    @property
    def head_mass_shape(self) -> tuple[int, int]:
        """(L, Hkv) of `Blocks.head_mass` when the state has pages, else (0, 0): per-head
        attention only matters where there are per-head pages to evict from."""
        m = self.model
        return (m.num_layers, m.num_kv_heads) if self.with_pages else (0, 0)

    @property
    def page_dtype(self):
        """dtype of the full-precision pools (pool 0 and the host pool)."""
        return jnp.dtype(self.pool_formats[0].dtype)


# ---- the state: one pytree of small sub-pytrees ---------------------------------------------------
# NB = config.total_blocks, P = block_size, S = max_seqs, MB = max_blocks_per_seq, T = num_tenants,
# POOLS = num_pools, L = layers, Hkv = KV heads, D = head_dim, N_p = blocks of pool p.
# Empty entries hold INVALID.


@struct.dataclass
class Blocks:
    """Per-block metadata over all pools (global block ids)."""

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
    attn_mass: jax.Array  # f32[NB, P]  attention each cached token received, accumulated over
    #                      decode steps (summed over layers and KV heads, each the mean over the
    #                      query heads of its group); 0 past `fill`, reset when freed or rewritten
    head_mass: jax.Array  # f32[NB, P, L', Hkv']  the same per layer and KV head, what per-head
    #                      eviction scores; (L', Hkv') = (L, Hkv) when the state has pages, else
    #                      (0, 0): a metadata-only state stores none (`StateConfig.head_mass_shape`)
    cold_at: jax.Array  # i32[NB]  LRU stamp of a *cold* cached block (pool 0, full, hashed, held
    #                    by nothing, on no free list; `keep_cold_blocks` only): the value of
    #                    `FreeLists.cold_clock` when it went cold. INVALID for every other block


@struct.dataclass
class FreeLists:
    """Per-pool stacks of free block ids: pool p's are free_list[start_p : start_p + free_count[p]],
    the top (highest index) popped first."""

    free_list: jax.Array  # i32[NB]
    free_count: jax.Array  # i32[POOLS]
    cold_count: jax.Array  # i32[]  cold cached blocks of pool 0 (free capacity beside the stack:
    #                       pool 0's allocatable blocks are free_count[0] + cold_count)
    cold_ring: jax.Array  # i32[N_0]  the LRU queue: the cold block stamped t sits at
    #                      cold_ring[t % N_0], for cold_head <= t < cold_clock (entries whose
    #                      block has another stamp are holes left by revived blocks)
    cold_head: jax.Array  # i32[]  stamp of the queue's oldest entry (pops advance it)
    cold_clock: jax.Array  # i32[]  the next `cold_at` stamp (int32, so a state takes at most
    #                       2^31 - 1 blocks going cold)


@struct.dataclass
class Sequences:
    """Per-sequence-slot tables."""

    block_tables: jax.Array  # i32[S, MB]  global block ids; INVALID past the sequence's blocks
    seq_lens: jax.Array  # i32[S]  cached tokens: slots held in the table (K/V written by the caller)
    positions: jax.Array  # i32[S]  logical (RoPE) position of the next token
    seq_tenant: jax.Array  # i32[S]  owning tenant; INVALID for a free slot
    seq_status: jax.Array  # i8[S]  kvquota.codes SEQ_FREE / SEQ_RUNNING / ...
    birth: jax.Array  # i32[S]  admission order stamp of the slot's sequence (reclaim's "newest
    #                  first" victim order); stale once the slot is free
    births: jax.Array  # i32[]  sequences admitted or forked so far: the next stamp


@struct.dataclass
class Tenants:
    """The tenant ledger: quotas, leases, salts and what each tenant uses and is charged."""

    registered: jax.Array  # bool[T]
    token_quota: jax.Array  # i32[T]  cap on used_tokens
    byte_quota: jax.Array  # i32[T]  cap on device-resident charged bytes, in units of unit_bytes
    lease_expiry: jax.Array  # i32[T]  step at which the lease ends (release_tenant then)
    salt: jax.Array  # u32[T]  first-block hash salt: private per tenant, or a shared group's
    used_tokens: jax.Array  # i32[T]  sum of seq_lens over the tenant's sequences
    charged_blocks: jax.Array  # i32[T, POOLS]  blocks whose payer is the tenant
    pinned_blocks: jax.Array  # i32[T, POOLS]  charged blocks with pin_count > 0
    growing: jax.Array  # bool[T]  "grow-no-admit" set by a reclaim plan: its sequences may append
    #                     past the byte quota, its admissions are refused while it is over it
    preemptions: jax.Array  # i32[T]  sequences of the tenant preempted so far


@struct.dataclass
class StateMeta:
    """What the arrays mean: a state's bytes per block and its page contents depend on the model
    shape, the block size and the pools' formats, which its array shapes alone do not fix (a
    metadata-only state of Qwen2.5-7B has the shapes of one of Qwen2.5-72B)."""

    config_id: jax.Array  # u32[2]  `config_id(config)` of the StateConfig that made the state
    # u32[2]  which history of operations made the state: every jitted core folds its name and
    # inputs into it (`kvquota.core.jit.next_version`), so two states share a version only if
    # the same operations on the same inputs made them (forks of one state differ); a reclaim
    # plan records it and apply_plan refuses any other. 0 for `init_state`.
    version: jax.Array


_GROUPS = {"blocks": Blocks, "free": FreeLists, "seqs": Sequences, "tenants": Tenants,
           "index": PrefixIndex, "meta": StateMeta}
_FIELD_GROUP = {f.name: g for g, cls in _GROUPS.items() for f in dataclasses.fields(cls)}


@struct.dataclass
class KVState:
    """The whole paged KV cache: pages of every pool, per-block metadata, free lists, sequences
    and the tenant ledger. Only arrays; the sizes live in `StateConfig`."""

    pages: tuple[PoolPages, ...]  # one entry per pool; () when metadata-only
    blocks: Blocks
    free: FreeLists
    seqs: Sequences
    tenants: Tenants
    index: PrefixIndex  # the prefix cache's hash index of the hashed blocks (kvquota.prefix_index)
    meta: StateMeta  # which config made the state (validate_state compares it)

    def update(self, **fields) -> "KVState":
        """A copy with the named leaf fields replaced, each routed to its sub-pytree
        (`state.update(ref_count=..., seq_lens=...)`), so a core that touches several
        sub-pytrees reads as one list of new values."""
        groups: dict[str, dict] = {}
        for name, value in fields.items():
            if name not in _FIELD_GROUP:
                raise TypeError(f"KVState has no field {name!r}")
            groups.setdefault(_FIELD_GROUP[name], {})[name] = value
        return self.replace(**{g: getattr(self, g).replace(**kv) for g, kv in groups.items()})

    @classmethod
    def from_fields(cls, pages: tuple, **fields) -> "KVState":
        """Build a state from its flat leaf fields (every field of every sub-pytree)."""
        missing = set(_FIELD_GROUP) - set(fields)
        if missing:
            raise TypeError(f"missing state fields: {sorted(missing)}")
        kw = {g: c(**{f.name: jnp.asarray(fields[f.name]) for f in dataclasses.fields(c)})
              for g, c in _GROUPS.items()}
        return cls(pages=tuple(pages), **kw)


def config_id(config: StateConfig) -> np.ndarray:
    """u32[2]: a digest of what gives a state's arrays their meaning (model shape, block size,
    each pool's format and size); settings that change only behaviour (scrubbing, lookup
    candidates, watermarks) are left out, so one state may serve allocators that differ there."""
    key = repr((config.model, config.block_size, config.kv_format, config.compressed_pools,
                config.host_blocks))
    return np.frombuffer(hashlib.sha256(key.encode()).digest()[:8], np.uint32).copy()


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
    i32 = lambda shape, v=0: np.full(shape, v, np.int32)  # noqa: E731
    return KVState.from_fields(
        init_pages(config),
        ref_count=i32((nb,)),
        pin_count=i32((nb,)),
        payer=i32((nb,), INVALID),
        payer_refs=i32((nb,)),
        tier=tier,
        precision=prec,
        fill=i32((nb,)),
        token_ids=i32((nb, p), INVALID),
        block_hash=np.zeros((nb, 2), np.uint32),
        hashed=np.zeros((nb,), bool),
        block_salt=np.zeros((nb,), np.uint32),
        parent=i32((nb,), INVALID),
        parent_gen=i32((nb,)),
        generation=i32((nb,)),
        attn_mass=np.zeros((nb, p), np.float32),
        head_mass=np.zeros((nb, p) + config.head_mass_shape, np.float32),
        cold_at=i32((nb,), INVALID),
        free_list=free_list,
        free_count=np.array(config.pool_sizes, np.int32),
        cold_count=np.int32(0),
        cold_ring=i32((config.num_blocks,), INVALID),
        cold_head=np.int32(0),
        cold_clock=np.int32(0),
        block_tables=i32((s, mb), INVALID),
        seq_lens=i32((s,)),
        positions=i32((s,)),
        seq_tenant=i32((s,), INVALID),
        seq_status=np.zeros((s,), np.int8),
        birth=i32((s,)),
        births=np.int32(0),
        registered=np.zeros((t,), bool),
        token_quota=i32((t,)),
        byte_quota=i32((t,)),
        lease_expiry=i32((t,)),
        salt=np.zeros((t,), np.uint32),
        used_tokens=i32((t,)),
        charged_blocks=i32((t, npools)),
        pinned_blocks=i32((t, npools)),
        growing=np.zeros((t,), bool),
        preemptions=i32((t,)),
        **init_index(config),
        config_id=config_id(config),
        version=np.zeros((2,), np.uint32),
    )


@functools.lru_cache(maxsize=64)
def _expected(config: StateConfig):
    """(treedef, leaf ShapeDtypeStructs, boundary ids, their tier/precision codes, config_id)
    of a state of `config`, computed once per config."""
    shapes = jax.eval_shape(lambda: init_state(config))
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    bounds = sorted({i for s, n in zip(config.pool_starts, config.pool_sizes) for i in (s, s + n - 1)})
    pools = pool_of(config, np.asarray(bounds), xp=np)
    codes = np.stack([np.asarray(config.pool_tiers)[pools], np.asarray(config.pool_precisions)[pools]])
    return treedef, list(zip(paths, leaves)), np.asarray(bounds, np.int32), codes, config_id(config)


@jax.jit
def _pool_codes(tier, precision, bounds):
    """i32[2, K]: tier and precision of the blocks `bounds` (one small dispatch, one host read)."""
    return jnp.stack([tier[bounds], precision[bounds]]).astype(jnp.int32)


def validate_state(config: StateConfig, state) -> None:
    """Raise StateMismatchError unless `state` is a live KVState of exactly this config.

    Checks the pytree structure (a leaf that is a list or None changes it), every leaf's type,
    shape and dtype (an int64 leaf is rejected, never cast), that no leaf was donated to an
    earlier call, the `config_id` the state carries (a state of another model, block size or
    pool formats whose arrays happen to have the same shapes), and the tier/precision of each
    pool's first and last block. Host reads: 2 x POOLS + 8 bytes, in one transfer.
    """
    if not isinstance(state, KVState):
        raise StateMismatchError(f"expected a KVState, got {type(state).__name__}")
    treedef, expected, bounds, codes, want_id = _expected(config)
    leaves, got_def = jax.tree_util.tree_flatten(state)
    if got_def != treedef:
        raise StateMismatchError(
            "state structure does not match this config (a field that is None or a list, pages "
            f"of another pool layout, or with_pages={config.with_pages} differs)")
    for (path, want), leaf in zip(expected, leaves):
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise StateMismatchError(f"state field {path} is a {type(leaf).__name__}, not an array")
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise StateMismatchError(f"state field {path} was donated to an earlier call")
        if tuple(leaf.shape) != tuple(want.shape) or leaf.dtype != want.dtype:
            raise StateMismatchError(
                f"state field {path} is {leaf.dtype}{tuple(leaf.shape)}, this config needs "
                f"{want.dtype}{tuple(want.shape)}")
    got_codes, got_id = jax.device_get(
        (_pool_codes(state.blocks.tier, state.blocks.precision, bounds), state.meta.config_id))
    if not np.array_equal(got_id, want_id):
        raise StateMismatchError(
            f"state was made for another config: its model, block size or pool formats differ "
            f"from this one's ({config.model.name}, blocks of {config.block_size}, pools "
            f"{config.precisions}), so its bytes per block would be misread")
    if not np.array_equal(got_codes, codes):
        raise StateMismatchError("state belongs to another config: its pools' tiers or precisions "
                                 "differ (a different pool split)")
