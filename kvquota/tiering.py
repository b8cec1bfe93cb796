"""The reclaim means of the facade beyond freeing: lossless moves (offload, restore) and the lossy
ones (compress, evict).

A mixin of `kvquota.allocator.Allocator` (one facade; this file keeps the tier concept apart). Same
contract as every facade method: inputs and room are checked on the host, then one hand-off to
`kvquota.core.run` with `donate`; on error the state is untouched.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from kvquota import core
from kvquota.codes import SEQ_IDLE, SEQ_RUNNING, SEQ_SUSPENDED
from kvquota.errors import (
    DuplicateIdError,
    InputShapeError,
    InvalidArgumentError,
    PoolFullError,
    QuotaExceededError,
    TierError,
)
from kvquota.policies import TokenView, get_policy
from kvquota.reports import CompressReport, EvictReport, MoveReport
from kvquota.sentinel import INVALID
from kvquota.state import KVState
from kvquota.validation import bucket, int_array, int_scalar, pad

# Which eligible blocks are compressed first: "oldest" (lowest block index) or "coldest" (lowest
# accumulated attention mass, `blocks.attn_mass`, as H2O scores tokens).
COMPRESS_ORDERS = ("oldest", "coldest")


class TierOps:
    """offload / restore / compress / evict; `self.config`, `_check_state`, `_run`, `_running`,
    `_heir_rows` and `_allocatable` (every room check) come from the Allocator."""

    def _batch(self, state, seq_ids, what, allowed):
        """(validated input rows i32[B], their real ids): every real id in range, in an
        `allowed` status, at most once. Reports follow the input rows."""
        ids = int_array("seq_ids", seq_ids, 1)
        if ids.size == 0:
            raise InputShapeError("seq_ids must have at least one row")
        real = self._running(state, ids, what, allowed=allowed)
        if len(np.unique(real)) != len(real):
            raise DuplicateIdError(f"{what}: a sequence appears twice in one call")
        return ids, real

    def _moves(self, state, seq_ids, what, allowed):
        """`_batch` for a move to or from the host pool, which must exist."""
        if self.config.host_pool is None:
            raise TierError(f"{what}: this config has no host pool (host_blocks=0)")
        return self._batch(state, seq_ids, what, allowed)

    def _move(self, name, state, rows, donate):
        """The move core on `rows` padded with INVALID to a power of two (a reclaim suspends a
        different number of sequences each time: one compile per size bucket, not per count);
        the report's rows are the input's."""
        state, report = self._run(name, state, pad(rows, bucket(len(rows))), donate=donate)
        return state, report.replace(moved_blocks=report.moved_blocks[:len(rows)])

    def _own_blocks(self, state, real, pool):
        """Own blocks (ref 1, unpinned, paid by the sequence's tenant) of each real row in
        `pool` — counted by the core's own rule — and each row's tenant."""
        counts = np.asarray(core.own_count(self.config, state, real.astype(np.int32), pool))
        return counts, np.asarray(state.seqs.seq_tenant)[real]

    def offload(self, state, seq_ids, *, donate=False) -> tuple[KVState, MoveReport]:
        """Move running sequences' own full-precision (pool-0) blocks to the host pool; they
        become SUSPENDED (not decodable until restored). Shared, pinned and compressed blocks
        stay on the device (the host pool holds full precision; a compressed block is small)."""
        self._check_state(state)
        c = self.config
        rows, real = self._moves(state, seq_ids, "offload", (SEQ_RUNNING, SEQ_IDLE))
        need = int(self._own_blocks(state, real, 0)[0].sum())
        room = int(self._allocatable(state)[c.host_pool])
        if need > room:
            raise PoolFullError(f"offload: {need} blocks to move, the host pool has {room} free")
        return self._move("offload", state, rows, donate)

    def restore(self, state, seq_ids, *, donate=False) -> tuple[KVState, MoveReport]:
        """Bring suspended sequences' host blocks back to pool 0, bit-exact; RUNNING again.
        Needs room in pool 0 and room under each tenant's byte quota for the restored blocks."""
        self._check_state(state)
        c = self.config
        rows, real = self._moves(state, seq_ids, "restore", (SEQ_SUSPENDED,))
        per_row, ten = self._own_blocks(state, real, c.host_pool)
        room = int(self._allocatable(state)[0])
        if int(per_row.sum()) > room:
            raise PoolFullError(f"restore: {int(per_row.sum())} blocks to bring back, pool 0 has "
                                f"{room} free")
        # The same byte check as an admission: every device pool's charges count (a tenant's
        # compressed blocks are device bytes too), the restored blocks land in pool 0.
        charged = np.asarray(state.tenants.charged_blocks).astype(np.int64)
        units = (charged * np.asarray(c.pool_units) * np.asarray(c.device_pools)).sum(axis=1)
        quota = np.asarray(state.tenants.byte_quota).astype(np.int64)
        for t in np.unique(ten):
            after = units[t] + int(per_row[ten == t].sum()) * c.pool_units[0]
            if after > quota[t]:
                raise QuotaExceededError(
                    f"restore: tenant {int(t)} would hold {after * c.unit_bytes} B of device "
                    f"blocks, over its byte quota of {int(quota[t]) * c.unit_bytes} B")
        return self._move("restore", state, rows, donate)

    def compress(self, state, seq_ids, *, kv_format: str, keep_recent: int = 32,
                 policy: str = "oldest", max_blocks: Optional[int] = None,
                 donate=False) -> tuple[KVState, CompressReport]:
        """Requantize running sequences' own full blocks outside the `keep_recent` most recent
        tokens from pool 0 into the compressed pool of `kv_format` (lossy, irreversible), at most
        `max_blocks` per sequence (None: all eligible), in the policy's order. Shared and pinned
        blocks are never rewritten."""
        self._check_state(state)
        c = self.config
        names = [name for name, _ in c.compressed_pools]
        if kv_format not in names:
            raise TierError(f"compress: no compressed pool of format {kv_format!r} in this "
                            f"config (compressed pools: {names or 'none'})")
        pool = 1 + names.index(kv_format)
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
        ids, real = self._batch(state, seq_ids, "compress", (SEQ_RUNNING, SEQ_IDLE))
        if policy == "coldest":
            tables = np.maximum(np.asarray(state.seqs.block_tables)[np.maximum(ids, 0)], 0)
            scores = np.asarray(state.blocks.attn_mass[tables].sum(-1), np.float32)
        else:  # "oldest": the block index is the score
            scores = np.broadcast_to(np.arange(c.max_blocks_per_seq, dtype=np.float32),
                                     (ids.size, c.max_blocks_per_seq))
        limits = np.full(ids.size, limit, np.int32)
        args = (ids, scores, limits, np.int32(keep))
        need = int(core.compress_count(c, state, *args))
        room = int(self._allocatable(state)[pool])
        if need > room:
            raise PoolFullError(f"compress: {need} blocks to compress, the {kv_format} pool has "
                                f"{room} free")
        return self._run("compress", state, *args, pool, donate=donate)

    def evict(self, state, seq_ids, *, policy, keep_tokens, mode="token", attention=None,
              donate=False, **options) -> tuple[KVState, EvictReport]:
        """Keep `keep_tokens` tokens of each running sequence — the ones the eviction policy
        scores highest (a registered name, with `options`, or an EvictionPolicy) — and drop the
        rest for good, compacting the survivors at their logical positions. Shared blocks are
        copied on write. `attention` f32[B, C] is the last step's attention (TOVA needs it).

        mode "token": survivors packed into full blocks (pool-0 pages rewritten; sequences
        holding compressed blocks are refused). mode "block": the `keep_tokens // block_size` (at
        least one) top-scored whole blocks stay, the table is compacted and own blocks are not
        copied. keep_tokens >= 1: to drop everything, free the sequence."""
        self._check_state(state)
        c = self.config
        pol = get_policy(policy, **options)
        ids, real = self._batch(state, seq_ids, "evict", (SEQ_RUNNING, SEQ_IDLE))
        keep = int_scalar("keep_tokens", keep_tokens, InvalidArgumentError)
        if keep < 1:  # a running sequence holds at least one token (free it instead)
            raise InvalidArgumentError(f"keep_tokens must be >= 1, got {keep}")
        if mode not in ("token", "block"):
            raise InvalidArgumentError(f"evict mode must be 'token' or 'block', got {mode!r}")
        tables = np.asarray(state.seqs.block_tables)[np.maximum(ids, 0)]
        tables = np.where((ids >= 0)[:, None], tables, INVALID)
        if mode == "token" and (tables >= c.num_blocks).any():
            raise TierError("evict: a sequence holds compressed blocks; token eviction rewrites "
                            "pool-0 pages only (use mode='block')")
        view = self._token_view(state, ids, tables, pol, attention)
        if mode == "token":
            mask = np.asarray(pol.keep_mask(view, np.full(ids.size, keep, np.int32)))
            need = int(core.evict_fresh_count(c, state, ids, mask))
        else:
            mask = np.asarray(pol.block_keep_mask(
                view, c.block_size, np.full(ids.size, max(1, keep // c.block_size), np.int32)))
            need, outside = core.evict_block_fresh_count(c, state, ids, mask)
            need = int(need)
            if bool(outside):
                raise TierError("evict: a shared or pinned compressed block would need a copy "
                                "on write; copies are made in pool 0 only")
        room = int(self._allocatable(state)[0])
        if need > room:
            raise PoolFullError(f"evict: {need} blocks needed for copies on write, pool 0 has "
                                f"{room} free")
        ten = np.asarray(state.seqs.seq_tenant)[real]
        heirs = self._heir_rows(state, np.asarray(state.tenants.salt)[ten], real)
        return self._run(f"evict_{mode}s", state, ids, mask, heirs, donate=donate)

    def _token_view(self, state, ids, tables, policy, attention) -> TokenView:
        """What the policy reads, per cache index: mass, and key norms / last attention when
        the policy needs them."""
        c = self.config
        width = c.max_tokens_per_seq
        safe = np.maximum(tables, 0)
        lengths = np.where(ids >= 0, np.asarray(state.seqs.seq_lens)[np.maximum(ids, 0)], 0)
        mass = np.asarray(state.blocks.attn_mass[safe]).reshape(ids.size, width)
        key_norm = last = None
        if "key_norm" in policy.needs:
            if not state.pages:
                raise TierError(f"policy {policy.name!r} reads keys: this state has no pages")
            k = state.pages[0].k[:, :, np.minimum(safe, c.num_blocks - 1)]  # [L, H, B, MB, P, D]
            norm = jnp.sqrt(jnp.sum(jnp.square(k.astype(jnp.float32)), axis=(0, 1, -1)))
            key_norm = jnp.asarray(norm).reshape(ids.size, width)
        if "last_attention" in policy.needs:
            if attention is None:
                raise InvalidArgumentError(f"policy {policy.name!r} needs attention= (the last "
                                           "step's attention per cached token)")
            last = np.asarray(attention, np.float32)
            if last.shape != (ids.size, width):
                raise InputShapeError(f"attention must be [{ids.size}, {width}], "
                                      f"got {last.shape}")
        return TokenView(lengths=jnp.asarray(lengths, jnp.int32), mass=jnp.asarray(mass),
                         key_norm=key_norm, last_attention=None if last is None else
                         jnp.asarray(last))
