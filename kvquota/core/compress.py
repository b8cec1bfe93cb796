"""Compression: requantize a sequence's cold full blocks from pool 0 into a compressed pool.

Lossy and irreversible: a compressed block never returns to pool 0, and it is no longer a
prefix-cache target (only exact full-precision blocks are). Which blocks: the sequence's own
(only it references them, unpinned, paid by its tenant), full, outside the `keep_recent` most
recent tokens (KIVI's full-precision residual window; the partial tail block is never full),
lowest score first, at most `limit` per sequence. Scores come from the caller's policy (block
index for "oldest first"; accumulated attention mass for "coldest first").

A format whose key group spans several blocks (KIVI at G = 32 tokens over 16-token blocks,
`QuantSpec.pages_per_group`) compresses whole groups only: the g = G / P blocks holding tokens
[j G, (j + 1) G) of a sequence, all of them eligible, are quantized together with one key scale
per channel (each block storing its copy); a group's score is its blocks' summed score, and
`limit` counts blocks (a group takes g of them).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kernels.quantization import quantize_pages
from kvquota.codes import SEQ_IDLE, SEQ_RUNNING
from kvquota.core.cold import allocatable
from kvquota.core.jit import donating_jit
from kvquota.core.scatter import clip, oob
from kvquota.core.tiers import own_blocks, relocate, seq_rows
from kvquota.errors import InvalidArgumentError, PoolFullError, TierError
from kvquota.reports import CompressReport
from kvquota.state import KVState, StateConfig
from kvquota.validation import int_scalar, seq_batch

# Which eligible blocks are compressed first: "oldest" (lowest block index) or "coldest" (lowest
# accumulated attention mass, `blocks.attn_mass`, as H2O scores tokens).
COMPRESS_ORDERS = ("oldest", "coldest")


def select(config: StateConfig, state: KVState, seq_ids, scores, limit, keep_recent,
           group: int = 1):
    """bool[B, MB]: the blocks compress takes. scores f32[B, MB] (lowest first), limit i32[B]
    (blocks), keep_recent i32[] (tokens at the end of each sequence that stay in full
    precision), group (static): blocks quantized together, taken whole or not at all."""
    p, mb = config.block_size, config.max_blocks_per_seq
    rows, tcol = seq_rows(state, seq_ids)
    lens = jnp.where(seq_ids >= 0, state.seqs.seq_lens[clip(seq_ids)], 0)
    k = jnp.arange(mb, dtype=jnp.int32)[None, :]
    cold = (k + 1) * p <= lens[:, None] - keep_recent
    full = state.blocks.fill[clip(rows)] == p
    eligible = own_blocks(config, state, rows, tcol, 0) & full & cold
    b, ng = eligible.shape[0], -(-mb // group)  # a table tail shorter than a group never fits
    pad = ((0, 0), (0, ng * group - mb))
    whole = jnp.pad(eligible, pad).reshape(b, ng, group).all(axis=2)
    gscore = jnp.pad(scores, pad).reshape(b, ng, group).sum(axis=2)
    order = jnp.argsort(jnp.where(whole, gscore, jnp.inf), axis=1, stable=True)
    rank = jnp.argsort(order, axis=1, stable=True)  # position of each group in the order
    take = whole & ((rank + 1) * group <= limit[:, None])
    return jnp.repeat(take, group, axis=1)[:, :mb]


def count(config: StateConfig, state: KVState, seq_ids, scores, limit, keep_recent,
          group: int = 1):
    """i32[]: blocks `select` takes (the facade's room check, by the very same rule)."""
    return select(config, state, seq_ids, scores, limit, keep_recent,
                  group).sum().astype(jnp.int32)


def group_blocks(config: StateConfig, pool: int) -> int:
    """Blocks quantized together by compressed pool `pool`'s format (its key group, in blocks)."""
    fmt = config.pool_formats[pool]
    return fmt.key.pages_per_group(config.block_size) if fmt.quantized else 1


def _requantize(config: StateConfig, pool: int):
    """Page writer for `relocate`: quantize the moved pool-0 pages into `pool`'s format."""
    fmt = config.pool_formats[pool]
    start, size = config.pool_starts[pool], config.pool_sizes[pool]

    group = group_blocks(config, pool)

    def write(pages, old, new, mask):
        # [B, MB] padded to whole groups: a group's blocks sit side by side in `src`.
        pad = ((0, 0), (0, -old.shape[1] % group))
        old, new, mask = (jnp.pad(a, pad) for a in (old, new, mask))
        src = clip(jnp.where(mask, old, 0)).ravel()  # pool-0 ids are page indices
        dst = oob(new - start, mask, size).ravel()
        out = []
        for which in ("k", "v"):
            x = getattr(pages[0], which)[:, :, src]  # [L, Hkv, B*MB, P, D]
            role = "key" if which == "k" else "value"
            if fmt.quantized:
                q = jax.vmap(lambda xl, r=role: quantize_pages(xl, fmt, r,
                                                               group_pages=group))(x)
            else:  # a plain low-precision dtype (fp8): a cast is the whole compression
                q = x.astype(fmt.dtype)
            out.append(jax.tree.map(lambda a, m: a.at[:, :, dst].set(m, mode="drop"),
                                    getattr(pages[pool], which), q))
        new_pool = pages[pool].replace(k=out[0], v=out[1])
        return tuple(new_pool if i == pool else pp for i, pp in enumerate(pages))

    return write


@donating_jit(static_argnames=("pool",))
def compress_core(config: StateConfig, state: KVState, seq_ids, scores, limit, keep_recent,
                  pool):
    """Compress the selected blocks of `seq_ids` (i32[B], unique, INVALID = padding) into
    compressed pool `pool` (static). The facade checked that the pool has room."""
    move = select(config, state, seq_ids, scores, limit, keep_recent, group_blocks(config, pool))
    state, per_seq, rep = relocate(config, state, seq_ids, move, 0, pool,
                                   _requantize(config, pool))
    report = CompressReport(
        compressed_blocks=per_seq,
        blocks_returned=rep["blocks_returned"],
        quota_units_released=rep["quota_units_released"],
        host_blocks_used=rep["host_blocks_used"],
        pool=pool,
        pool_bytes=config.pool_bytes,
        unit_bytes=config.unit_bytes,
        host_blocks=config.host_blocks,
        host_watermark=config.host_watermark,
    )
    return state, report


_count = jax.jit(count, static_argnums=(0, 6))

DEFAULT_KEEP_RECENT = 32  # full-precision window of a format that prescribes none


def compress(config: StateConfig, state: KVState, seq_ids, *, kv_format: str,
             keep_recent: Optional[int] = None, policy: str = "oldest",
             max_blocks: Optional[int] = None, donate=False):
    """Allocator.compress: a configured format, the options, running or idle ids, and room in
    the compressed pool for exactly the blocks `select` takes. keep_recent None: the format's
    `residual` (KIVI: R = 128), else 32."""
    c = config
    names = [name for name, _ in c.compressed_pools]
    if kv_format not in names:
        raise TierError(f"compress: no compressed pool of format {kv_format!r} in this "
                        f"config (compressed pools: {names or 'none'})")
    pool = 1 + names.index(kv_format)
    if keep_recent is None:
        keep_recent = c.pool_formats[pool].residual
        keep_recent = DEFAULT_KEEP_RECENT if keep_recent is None else keep_recent
    keep = int_scalar("keep_recent", keep_recent, InvalidArgumentError)
    if keep < 0:
        raise InvalidArgumentError(f"keep_recent must be >= 0, got {keep}")
    if policy not in COMPRESS_ORDERS:
        raise InvalidArgumentError(f"unknown compress policy {policy!r}; known: "
                                   f"{', '.join(COMPRESS_ORDERS)}")
    limit = c.max_blocks_per_seq if max_blocks is None else int_scalar(
        "max_blocks", max_blocks, InvalidArgumentError)
    if limit < 0:
        raise InvalidArgumentError(f"max_blocks must be >= 0, got {limit}")
    ids, _ = seq_batch(c, state, seq_ids, "compress", (SEQ_RUNNING, SEQ_IDLE))
    if policy == "coldest":
        tables = np.maximum(np.asarray(state.seqs.block_tables)[np.maximum(ids, 0)], 0)
        scores = np.asarray(state.blocks.attn_mass[tables].sum(-1), np.float32)
    else:  # "oldest": the block index is the score
        scores = np.broadcast_to(np.arange(c.max_blocks_per_seq, dtype=np.float32),
                                 (ids.size, c.max_blocks_per_seq))
    args = (ids, scores, np.full(ids.size, limit, np.int32), np.int32(keep))
    need = int(_count(c, state, *args, group_blocks(c, pool)))
    room = int(allocatable(c, state, xp=np)[pool])
    if need > room:
        raise PoolFullError(f"compress: {need} blocks to compress, the {kv_format} pool has "
                            f"{room} free")
    return compress_core(c, state, *args, pool, donate=donate)
