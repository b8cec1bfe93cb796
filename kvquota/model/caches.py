"""KV caches the decoder reads and writes: their pytrees, writes and attention.

Two caches share one model (`kvquota.model.decoder.Decoder`):

  * `DenseKV`: a contiguous cache `[L, B, Hkv, S, D]`, row b of the batch = sequence b. The
    reference the paged path is tested against.
  * `PagedKV`: the functional state's device page pools: pool 0 `[L, Hkv, N0, P, D]` (full
    precision, the only one written) and, read only, each compressed pool (`QuantizedPages` or
    plain low-precision arrays with a leading [L] axis). Token at cache index i of a sequence
    lives at global block `block_table[i // P]`, slot `i % P`; a block's page is its id minus
    its pool's first id. Attention runs through `kernels.paged_attention` (`prefill` for
    chunks, `decode` when T == 1), which take each pool whole, [L] axis included, with
    `layer=` (the scan's index): slicing `pool[layer]` inside the scan would copy a layer's pool.

Mixed pools (DESIGN.md §2 "Pools per precision"). Attention over a set of cached keys does not
depend on their order (RoPE is applied before K is cached), so a sequence whose table mixes
pools is attended per pool and the parts merged by their log-sum-exp (`merge_attention`). Once
per forward call (`pool_tables`) each pool gets its own table: the sequence's entries that lie
in the pool, compacted to the front in order, as local page ids, with the tokens they hold.
Compressed blocks are full and older than the chunk, so every query row sees all of them (a
decode call with the chunk's tokens folded into the query rows); pool 0 holds the chunk, and
its causal mask is kept by shifting the chunk's start by the tokens that sit in other pools
(all of them precede the chunk, so a pool-0 key keeps its order against every query). A pool a
sequence holds nothing of contributes lse = -inf (weight 0); a pool nobody in the batch holds
is skipped at run time (`lax.cond`). With no compressed pool the path is the single-pool one,
unchanged: the raw table, one kernel call, no merge.

Attention mass (`_paged_attend_mass`, decode steps and prefill chunks, opt-in): the attention
each cached token receives, f32[B, Hkv, M * P] by KV head and cache index, each the mean over
the query heads of its group, summed over the chunk's real queries (the kernels'
`mass="token"`; causal: a query gives nothing to the chunk's later tokens). Single pool: the
kernels' mass as is. Mixed pools: a pool's mass is normalized within the pool, so each query
head's is weighted by its share of the merged softmax, exp(lse_pool - lse_merged), before the
group mean (hence one kernel call per head: each query head, and each query of a chunk, is its
own decode row, whose length in pool 0 is its own position + 1), and mapped back from the
pool's compacted columns to the table's (`PoolTables.slots`).

Under a mesh (`kvquota.sharding.use_mesh`) every kernel call (`_kernel`) and every pool-0 write
runs in `shard_map` over the KV heads (`kvquota.sharding`); with no mesh in context nothing of it
is traced.

Both writes drop padding tokens by pointing them out of bounds (`mode="drop"`); the sentinel
(negative) is never used as an index, since negative indices would wrap around. Paged writes go
to pool 0 only: a block id outside pool 0 (a compressed block: never the tail for a correct
caller) is out of bounds there and dropped.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from configs.models import ModelConfig
from kvquota.sentinel import INVALID


# --------------------------------------------------------------------------------------------
# Caches and chunk metadata (pytrees of arrays only).


@flax.struct.dataclass
class DenseKV:
    """Contiguous KV cache, one row per sequence of the batch."""

    k: jax.Array  # f[L, B, Hkv, S, D]
    v: jax.Array  # f[L, B, Hkv, S, D]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]


def _blocks_of(pages) -> int:
    """Blocks of one pool's K or V (block axis 2 in every array of every pool)."""
    return jax.tree_util.tree_leaves(pages)[0].shape[2]


@flax.struct.dataclass
class PagedKV:
    """The device page pools of the functional state.

    Attributes:
      k_pages, v_pages: pool 0, full precision, f[L, Hkv, N0, P, D] (block id == page index);
        the only pool the model writes.
      compressed: ((k, v), ...) for each compressed device pool in pool order, read only: each
        `kernels.quantization.QuantizedPages` whose arrays carry a leading [L] axis, or a plain
        low-precision array [L, Hkv, N_p, P, D] (fp8). Empty: the single-pool path.
      pool_starts: (static) first global block id of pool 0 (always 0) and of each compressed
        pool; a block's page in pool p is `id - pool_starts[p]`. Pool sizes come from the arrays.
    """

    k_pages: jax.Array  # f[L, Hkv, N0, P, D]
    v_pages: jax.Array  # f[L, Hkv, N0, P, D]
    compressed: tuple = ()
    pool_starts: tuple[int, ...] = flax.struct.field(pytree_node=False, default=(0,))

    @property
    def pool_sizes(self) -> tuple[int, ...]:
        """Blocks of pool 0 and of each compressed pool."""
        return (self.k_pages.shape[2],) + tuple(_blocks_of(k) for k, _ in self.compressed)

    def check_layout(self) -> None:
        """Raises ValueError unless the static pool layout fits the arrays (pool 0 first at id 0,
        one start per pool, ranges disjoint and increasing). Shapes only: runs under jit."""
        starts, sizes = tuple(self.pool_starts), self.pool_sizes
        if len(starts) != len(sizes) or not starts or starts[0] != 0:
            raise ValueError(f"pool_starts {starts} must start at 0 with one entry per pool "
                             f"(pool 0 + {len(self.compressed)} compressed)")
        for p in range(1, len(starts)):
            if starts[p] < starts[p - 1] + sizes[p - 1]:
                raise ValueError(f"pool {p} starts at {starts[p]}, inside pool {p - 1} "
                                 f"[{starts[p - 1]}, {starts[p - 1] + sizes[p - 1]})")


@flax.struct.dataclass
class PoolTables:
    """Per-pool block tables of one chunk (see `pool_tables`), derived once per forward call.

    tables[p]: i32[B, M] local page ids of the sequence's blocks in pool p, compacted to the
    front in table order, INVALID past them; lengths[p]: i32[B] tokens those blocks hold;
    slots[p]: i32[B, M] each table column's compacted column in pool p, -1 where the column is
    no held entry of pool p (maps a pool's per-column results back to the table).
    """

    tables: tuple
    lengths: tuple
    slots: tuple = ()


def pool_tables(block_tables, lengths, pool_starts, pool_sizes, page_size: int) -> PoolTables:
    """Splits global block tables i32[B, M] (sequences of `lengths` i32[B] tokens) by pool.

    Only the entries holding tokens (column j < ceil(length / P)) count; an entry in no given
    pool (the sentinel, a host block) counts in none. Block j holds min(P, length - j*P) tokens.
    """
    b, m = block_tables.shape
    col = jnp.arange(m, dtype=jnp.int32)
    held = jnp.clip(lengths[:, None] - col[None, :] * page_size, 0, page_size)  # [B, M]
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, m))
    tables, lens, slots = [], [], []
    for start, size in zip(pool_starts, pool_sizes):
        inside = (held > 0) & (block_tables >= start) & (block_tables < start + size)
        dest = jnp.cumsum(inside.astype(jnp.int32), axis=1) - 1
        slots.append(jnp.where(inside, dest, -1))
        dest = jnp.where(inside, dest, m)  # others out of bounds -> dropped
        local = jnp.full((b, m), INVALID, jnp.int32).at[rows, dest].set(
            block_tables - start, mode="drop")
        tables.append(local)
        lens.append(jnp.sum(jnp.where(inside, held, 0), axis=1).astype(jnp.int32))
    return PoolTables(tables=tuple(tables), lengths=tuple(lens), slots=tuple(slots))


@flax.struct.dataclass
class ChunkMeta:
    """Where a chunk of T tokens per sequence sits in the cache."""

    start: jax.Array  # i32[B]: cache index of the chunk's first token (= tokens cached before)
    num_new: jax.Array  # i32[B]: real tokens in the chunk (0..T); the rest is padding
    block_tables: Any = None  # i32[B, M] for PagedKV (INVALID past the sequence), else None
    pools: Any = None  # PoolTables when PagedKV has compressed pools (set by Decoder), else None

    @property
    def lengths(self) -> jax.Array:
        """i32[B]: cached tokens once the chunk is written."""
        return self.start + self.num_new


def init_dense_cache(config: ModelConfig, batch: int, capacity: int, dtype=jnp.float32):
    """A zeroed `DenseKV` for `batch` sequences of up to `capacity` tokens."""
    shape = (config.num_layers, batch, config.num_kv_heads, capacity, config.head_dim)
    return DenseKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


# --------------------------------------------------------------------------------------------
# Cache writes and attention.


def _dense_write(cache: DenseKV, layer, k, v, meta: ChunkMeta) -> DenseKV:
    """Writes k, v [B, T, Hkv, D] at cache indices start + t of layer `layer`."""
    batch, chunk = k.shape[:2]
    idx = meta.start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [B, T]
    real = jnp.arange(chunk, dtype=jnp.int32)[None, :] < meta.num_new[:, None]
    idx = jnp.where(real, idx, cache.capacity)  # out of bounds -> dropped
    rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], idx.shape)
    new_k = cache.k.at[layer, rows, :, idx, :].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[layer, rows, :, idx, :].set(v.astype(cache.v.dtype), mode="drop")
    return DenseKV(k=new_k, v=new_v)


def _dense_attend(cache: DenseKV, layer, q, meta: ChunkMeta, sm_scale: float):
    """Causal GQA attention of q [B, T, Hq, D] over the dense layer cache -> [B, T, Hq, D].

    The G = Hq / Hkv query heads of a KV head are folded with the chunk's tokens into
    R = T * G rows (row r = t * G + g), so each (sequence, KV head) is one [R, D] x [D, S]
    product rather than G thin ones; with the late normalization below, a 512-token chunk at
    2K context spends ~2.3x less time here on CPU than a per-head einsum + softmax did.
    """
    batch, chunk, q_heads, head_dim = q.shape
    k, v = cache.k[layer], cache.v[layer]  # [B, Hkv, S, D]
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    rows = q.reshape(batch, chunk, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    rows = rows.reshape(batch, kv_heads, chunk * group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("bkrd,bksd->bkrs", rows, k.astype(jnp.float32)) * sm_scale
    q_idx = meta.start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [B, T]
    q_idx = jnp.repeat(q_idx, group, axis=1)  # [B, R]
    k_idx = jnp.arange(cache.capacity, dtype=jnp.int32)  # [S]
    visible = (k_idx[None, None, :] <= q_idx[:, :, None]) & (
        k_idx[None, None, :] < meta.lengths[:, None, None]
    )  # [B, R, S]
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    # Softmax normalized after the value product (divide [R, D], not [R, S]). A padding row
    # may see no key at all: its max is -inf, so it is given 0 and its output is 0.
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)  # [B, Hkv, R, 1]
    out = jnp.einsum("bkrs,bksd->bkrd", weights, v.astype(jnp.float32))  # [B, Hkv, R, D]
    out = out / jnp.where(total > 0, total, 1.0)
    out = out.reshape(batch, kv_heads, chunk, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, chunk, q_heads, head_dim)


def _paged_write(cache: PagedKV, layer, k, v, meta: ChunkMeta) -> PagedKV:
    """Writes k, v [B, T, Hkv, D] into pool-0 pages (block_table[i // P], i % P), i = start + t.

    Only pool 0 is written: a block id outside [0, N0) (the sentinel, a compressed block) is
    dropped, as padding is.
    """
    chunk = k.shape[1]
    num_blocks, page = cache.k_pages.shape[2], cache.k_pages.shape[3]
    idx = meta.start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [B, T]
    real = jnp.arange(chunk, dtype=jnp.int32)[None, :] < meta.num_new[:, None]
    max_blocks = meta.block_tables.shape[1]
    slot_of = jnp.clip(idx // page, 0, max_blocks - 1)
    block = jnp.take_along_axis(meta.block_tables, slot_of, axis=1)  # [B, T]
    # padding / sentinel -> N0; ids >= N0 (other pools) are out of bounds: both dropped
    block = jnp.where(real & (block >= 0), block, num_blocks)
    offset = idx % page
    from kvquota import sharding

    mesh = sharding.context_mesh()
    if mesh is None:
        new_k = _scatter(cache.k_pages, layer, block, offset, k)
        new_v = _scatter(cache.v_pages, layer, block, offset, v)
    else:  # each device writes its own heads (`kvquota.sharding`)
        new_k = sharding.sharded_write(_scatter, cache.k_pages, layer, block, offset, k, mesh=mesh)
        new_v = sharding.sharded_write(_scatter, cache.v_pages, layer, block, offset, v, mesh=mesh)
    return cache.replace(k_pages=new_k, v_pages=new_v)


def _scatter(pages, layer, block, offset, values):
    """pages f[L, Hkv, N0, P, D] with values [B, T, Hkv, D] at [layer, :, block, offset, :]
    (block i32[B, T]: N0 drops the entry)."""
    return pages.at[layer, :, block, offset, :].set(values.astype(pages.dtype), mode="drop")


def _kernel(name: str, q, k_pages, v_pages, *args, layer, **kwargs):
    """`kernels.paged_attention.<name>` (decode or prefill), run in `shard_map` over the KV heads
    when a mesh with a "kv" axis is in context (`kvquota.sharding.use_mesh`); else the plain call,
    exactly as without sharding."""
    from kernels import paged_attention
    from kvquota import sharding

    fn = getattr(paged_attention, name)
    mesh = sharding.context_mesh()
    if mesh is None:
        return fn(q, k_pages, v_pages, *args, layer=layer, **kwargs)
    return sharding.sharded_attention(fn, q, k_pages, v_pages, *args, mesh=mesh, layer=layer,
                                      **kwargs)


def _fold(chunk: int, group: int, backend: str) -> int:
    """Chunk tokens folded into one decode row block by `_attend_all`: all of them on the
    reference path (one table walk per sequence); on the Pallas kernel the largest divisor of
    the chunk with at most 64 rows, the prefill kernel's own row-block cap (the rest of the
    chunk goes to the batch axis, each copy re-reading the pool's pages)."""
    from kernels.paged_attention import resolve_backend

    if resolve_backend(backend) == "reference":
        return chunk
    cap = max(1, 64 // group)
    return max(f for f in range(1, min(chunk, cap) + 1) if chunk % f == 0)


def _attend_all(q, k_pages, v_pages, layer, tables, lengths, sm_scale: float, backend: str):
    """Every query row of q [B, T, Hq, D] against every cached key of layer `layer` of a pool
    (keys that all precede the chunk: compressed blocks) -> (out [B, T, Hq, D], lse [B, T, Hq]).

    Through `paged_attention.decode`, whose query sits past every key: the T tokens are folded
    into the query rows of their KV head ([B*T/f, Hkv*f*G, D], f = `_fold`). The prefill kernel
    cannot be used, since its rows see only keys up to their own position and its lengths
    bound the query positions too. Sequences with no block here give zeros and lse = -inf; when
    no sequence of the batch has one the kernel is skipped (`lax.cond`).
    """
    b, t, hq, d = q.shape
    hkv = jax.tree_util.tree_leaves(k_pages)[0].shape[1]  # [L, Hkv, ...] in every array
    g = hq // hkv
    f = _fold(t, g, backend)
    n = t // f
    qf = q.reshape(b, n, f, hkv, g, d).transpose(0, 1, 3, 2, 4, 5).reshape(b * n, hkv * f * g, d)
    rep_tables = jnp.repeat(tables, n, axis=0) if n > 1 else tables
    rep_lengths = jnp.repeat(lengths, n) if n > 1 else lengths

    def run():
        out, aux = _kernel("decode", qf, k_pages, v_pages, rep_tables, rep_lengths,
                           sm_scale=sm_scale, return_lse=True, backend=backend, layer=layer)
        return out, aux.lse

    def empty():
        return jnp.zeros(qf.shape, q.dtype), jnp.full(qf.shape[:2], -jnp.inf, jnp.float32)

    out, lse = lax.cond(jnp.any(lengths > 0), run, empty)
    out = out.reshape(b, n, hkv, f, g, d).transpose(0, 1, 3, 2, 4, 5).reshape(b, t, hq, d)
    lse = lse.reshape(b, n, hkv, f, g).transpose(0, 1, 3, 2, 4).reshape(b, t, hq)
    return out, lse


def _paged_attend(cache: PagedKV, layer, q, meta: ChunkMeta, sm_scale: float, backend: str):
    """Attention through `kernels.paged_attention` for q [B, T, Hq, D] -> [B, T, Hq, D]."""
    from kernels import paged_attention  # local: the model module imports without kernels

    k_pages, v_pages = cache.k_pages, cache.v_pages  # [L, Hkv, N, P, D], read at `layer`
    if not cache.compressed:  # the single-pool path: the raw table, one call
        if q.shape[1] == 1:
            out = _kernel(
                "decode", q[:, 0], k_pages, v_pages, meta.block_tables, meta.lengths,
                sm_scale=sm_scale, backend=backend, layer=layer,
            )
            return out[:, None]
        return _kernel(
            "prefill", q, k_pages, v_pages, meta.block_tables, meta.lengths, meta.start,
            sm_scale=sm_scale, backend=backend, layer=layer,
        )
    pools = meta.pools
    tables0, lengths0 = pools.tables[0], pools.lengths[0]
    if q.shape[1] == 1:  # the query is the last pool-0 token
        out0, aux0 = _kernel(
            "decode", q[:, 0], k_pages, v_pages, tables0, lengths0,
            sm_scale=sm_scale, return_lse=True, backend=backend, layer=layer,
        )
        outs, lses = [out0[:, None]], [aux0.lse[:, None]]
    else:  # every other pool's tokens precede the chunk: shift it by their count
        start0 = meta.start - (meta.lengths - lengths0)
        out0, aux0 = _kernel(
            "prefill", q, k_pages, v_pages, tables0, lengths0, start0,
            sm_scale=sm_scale, return_lse=True, backend=backend, layer=layer,
        )
        outs, lses = [out0], [aux0.lse]
    for p, (kp, vp) in enumerate(cache.compressed, start=1):
        out, lse = _attend_all(q, kp, vp, layer, pools.tables[p], pools.lengths[p], sm_scale,
                               backend)
        outs.append(out)
        lses.append(lse)
    out, _ = paged_attention.merge_attention(outs, lses)
    return out


# --------------------------------------------------------------------------------------------
# Attention mass (decode steps and prefill chunks).


def _decode_per_head(q, k_pages, v_pages, layer, tables, lengths, page: int, sm_scale: float,
                     backend: str):
    """Decode of q [B, Hq, D] over layer `layer` of one pool with each query head its own batch
    row (group 1), so the kernels' mass is per head -> (out [B, Hq, D], lse f32[B, Hq], mass
    f32[B, Hq, M*P]). A pool no sequence of the batch holds anything of is skipped (`lax.cond`)."""
    b, hq, d = q.shape
    hkv = jax.tree_util.tree_leaves(k_pages)[0].shape[1]  # [L, Hkv, ...] in every array
    g = hq // hkv
    width = tables.shape[1] * page  # M * P (every pool has pool 0's page size)
    qh = q.reshape(b, hkv, g, d).transpose(0, 2, 1, 3).reshape(b * g, hkv, d)

    def run():
        out, aux = _kernel("decode", qh, k_pages, v_pages, jnp.repeat(tables, g, axis=0),
                           jnp.repeat(lengths, g), sm_scale=sm_scale, mass="token",
                           backend=backend, layer=layer)
        return out, aux.lse, aux.mass

    def empty():
        return (jnp.zeros(qh.shape, q.dtype), jnp.full(qh.shape[:2], -jnp.inf, jnp.float32),
                jnp.zeros((b * g, hkv, width), jnp.float32))

    out, lse, mass = lax.cond(jnp.any(lengths > 0), run, empty)
    out = out.reshape(b, g, hkv, d).transpose(0, 2, 1, 3).reshape(b, hq, d)
    lse = lse.reshape(b, g, hkv).transpose(0, 2, 1).reshape(b, hq)
    mass = mass.reshape(b, g, hkv, width).transpose(0, 2, 1, 3).reshape(b, hq, width)
    return out, lse, mass


def _paged_attend_mass(cache: PagedKV, layer, q, meta: ChunkMeta, sm_scale: float,
                       backend: str):
    """Attention of a decode step or prefill chunk (q [B, T, Hq, D]) and the mass each cached
    token receives -> (out [B, T, Hq, D], mass f32[B, Hkv, M * P]: column i = cache index i of
    the row's sequence, per KV head the mean over its group's query heads, summed over the
    chunk's real queries; see the module docstring).
    """
    from kernels import paged_attention

    b, t, hq, d = q.shape
    k_pages, v_pages = cache.k_pages, cache.v_pages  # [L, Hkv, N, P, D], read at `layer`
    page, m = cache.k_pages.shape[3], meta.block_tables.shape[1]
    if not cache.compressed:  # the single-pool path's call, its out unchanged
        if t == 1:
            out, aux = _kernel("decode", q[:, 0], k_pages, v_pages, meta.block_tables,
                               meta.lengths, sm_scale=sm_scale, mass="token", backend=backend,
                               layer=layer)
            return out[:, None], aux.mass
        out, aux = _kernel("prefill", q, k_pages, v_pages, meta.block_tables, meta.lengths,
                           meta.start, sm_scale=sm_scale, mass="token", backend=backend,
                           layer=layer)
        return out, aux.mass
    # Mixed pools: each query of the chunk is a decode row of its own (B*T rows); in pool 0 it
    # sees the tokens up to its own (every other pool's tokens precede the chunk).
    pools = meta.pools
    real = jnp.arange(t, dtype=jnp.int32)[None, :] < meta.num_new[:, None]  # [B, T]
    own0 = pools.lengths[0][:, None] - meta.num_new[:, None] + jnp.arange(t)[None, :] + 1
    row_lengths = [jnp.where(real, own0, 0)] + [
        jnp.where(real, n[:, None], 0) for n in pools.lengths[1:]]  # i32[B, T] per pool
    parts = [(k_pages, v_pages)] + list(cache.compressed)
    results = [_decode_per_head(q.reshape(b * t, hq, d), kp, vp, layer,
                                jnp.repeat(pools.tables[p], t, axis=0),
                                row_lengths[p].reshape(b * t), page, sm_scale, backend)
               for p, (kp, vp) in enumerate(parts)]
    out, lse = paged_attention.merge_attention([r[0] for r in results], [r[1] for r in results])
    hkv = cache.k_pages.shape[1]
    mass = jnp.zeros((b * t, hkv, m, page), jnp.float32)
    for p, (_, lse_p, mass_p) in enumerate(results):
        share = jnp.where(jnp.isfinite(lse_p), jnp.exp(lse_p - jnp.where(
            jnp.isfinite(lse), lse, 0.0)), 0.0)  # [B*T, Hq]: the pool's part of the softmax
        weighted = (share[..., None] * mass_p).reshape(b * t, hkv, hq // hkv, m, page)
        pooled = jnp.mean(weighted, axis=2)  # [B*T, Hkv, M, P]: the group mean, compacted
        slots = jnp.repeat(pools.slots[p], t, axis=0)[:, None, :, None]  # [B*T, 1, M, 1]
        back = jnp.take_along_axis(pooled, jnp.maximum(slots, 0), axis=2)
        mass = mass + jnp.where(slots >= 0, back, 0.0)
    out = out.reshape(b, t, hq, d)
    return out, mass.reshape(b, t, hkv, m * page).sum(axis=1)
