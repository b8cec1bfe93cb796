"""LMCache-style controller verbs over the allocator: lookup, clear, pin / unpin, compress, move.

For researchers who know LMCache's controller API (`lookup(tokens)`, `clear(instance, location)`,
`pin(instance, location, tokens)`, `compress(instance, method, location, tokens)`,
`move(old, new, tokens, copy)`). Here the "instance" is an `Allocator` with its state, and each
verb is a thin, pure function `verb(alloc, state, ...) -> (new_state, Action)` built only from the
public `Allocator` ops and read-only NumPy reads of the state's metadata (pages are never read).
`lookup` changes nothing and returns a dict. Verbs never donate: on any error (a typed
`KVQuotaError`) the caller's state is untouched. Eviction stays in the caller's policy
(`Allocator.evict`); it has no verb. Each call reads the block metadata to the host once
(O(total_blocks x block_size) for the token ids): made for research-sized states and control
decisions, not for the per-step serving loop.

Locations: "device" (pool 0 and the compressed device pools) and "host" (the host pool);
`location_pools` maps them to pools. `clear` also takes "all".

Semantics:

* **Holding.** A sequence *holds* `tokens` (a 1-D int sequence of n tokens) when it is live
  (running, idle or suspended), its cache is an exact prefix of its context (not evicted:
  `positions == seq_lens`) and its first n cached token ids, read block by block through its
  table (`blocks.token_ids`), equal `tokens`.
* `lookup(alloc, state, tokens, tenant) -> {"device": int, "host": int}`, leading tokens cached
  per tier. device: the prefix-cache hit the tenant's next `admit` of `tokens` would get, by
  admission's own rule (same salt, chained two-word hash, token ids, up to `lookup_candidates`
  candidates, parent chain and generation) recomputed in NumPy: full blocks only, never the
  block of the last token (admission always recomputes the final token), so it is a multiple of
  `block_size` <= n - 1. host: the most leading tokens held by one of the tenant's suspended
  sequences (restorable without recompute), counted block by block: a block counts its tokens
  inside `tokens` when all of them match, and the walk stops at the first block that does not.
* `pin(alloc, state, tokens, tenant)`: pins the full blocks inside the prefix (the first
  n // block_size) of the lowest-slot running or idle holder (`Allocator.pin_blocks`); pinned
  blocks stay resident, charged and lookup targets after every holder is freed.
  `unpin`: drops one pin from each pinned block among those blocks of the first holder (any live
  one) that has some, else of the tenant's prefix-cache chain (so pins outlive their holder).
* `compress(alloc, state, tokens, tenant, method, keep_recent=32)`: requantizes, in every running
  holder, the blocks of the prefix that `Allocator.compress` may take (own, full, outside the
  `keep_recent` most recent tokens) into the pool of format `method`, and no block past the
  prefix: one call per holder with policy "oldest" and `max_blocks` = that count.
* `move(alloc, state, tokens, tenant, src, dst)`: "device" -> "host" offloads every running
  holder, "host" -> "device" restores every suspended one. Whole sequences move (a suspended
  sequence is decodable only after restore); LMCache's `copy` has no counterpart.
* `clear(alloc, state, tenant, location)`: frees the tenant's sequences on that location —
  "device": its running ones, "host": its suspended ones (with any shared blocks they still hold
  on the device) — or "all": `release_tenant(unpin=True)`. Idle sessions are cleared by "all".

Errors: an unknown location or src == dst -> InvalidArgumentError; an unknown or unregistered
tenant -> UnknownTenantError; no holder of `tokens` (or nothing pinned to unpin) ->
BlockStateError; a missing pool -> TierError; bad tokens -> InputDtypeError / InputShapeError /
TokenIdError / SequenceTooLongError; the facade's own errors (PoolFullError, ...) pass through.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from kvquota.allocator import Allocator
from kvquota.codes import SEQ_IDLE, SEQ_RUNNING, SEQ_SUSPENDED, TIER_DEVICE, TIER_HOST
from kvquota.errors import (
    BlockStateError,
    InputShapeError,
    InvalidArgumentError,
    SequenceTooLongError,
    TierError,
    TokenIdError,
    UnknownTenantError,
)
from kvquota.hashing import block_hash, salt_root
from kvquota.sentinel import INVALID
from kvquota.state import KVState, validate_state
from kvquota.validation import bucket, int_array, int_scalar, pad

LOCATIONS = ("device", "host")
_LIVE = (SEQ_RUNNING, SEQ_IDLE, SEQ_SUSPENDED)
_ON_DEVICE = (SEQ_RUNNING, SEQ_IDLE)


@dataclasses.dataclass(frozen=True)
class Action:
    """What a mutating verb did: the sequences it acted on (in the facade's row order; report
    rows past them are padding), the blocks it pinned or unpinned, and the facade reports in call
    order (PinReport, FreeReport, CompressReport or MoveReport)."""

    verb: str
    seq_ids: tuple[int, ...]
    block_ids: tuple[int, ...] = ()
    reports: tuple = ()

    @property
    def report(self):
        """The one report of a single-call verb (every verb but compress with several holders)."""
        if len(self.reports) != 1:
            raise InvalidArgumentError(f"{self.verb} made {len(self.reports)} calls; read .reports")
        return self.reports[0]


def location_pools(config, location: str) -> tuple[int, ...]:
    """The pools of a location: "device" = pool 0 and the compressed pools, "host" = the host
    pool (TierError when the config has none)."""
    if location not in LOCATIONS:
        raise InvalidArgumentError(f"unknown location {location!r}; known: {', '.join(LOCATIONS)}")
    if location == "host" and config.host_pool is None:
        raise TierError("location 'host': this config has no host pool (host_blocks=0)")
    want = TIER_DEVICE if location == "device" else TIER_HOST
    return tuple(p for p, tier in enumerate(config.pool_tiers) if tier == want)


# ---- host-side reads and checks ------------------------------------------------------------------
def _meta(state: KVState) -> dict:
    """One host read of the metadata the verbs look at (never the pages)."""
    b, s, t = state.blocks, state.seqs, state.tenants
    return jax.device_get({
        "token_ids": b.token_ids, "block_hash": b.block_hash, "hashed": b.hashed,
        "salt": b.block_salt, "parent": b.parent, "parent_gen": b.parent_gen,
        "generation": b.generation, "pin_count": b.pin_count, "ref_count": b.ref_count,
        "payer": b.payer, "fill": b.fill, "tables": s.block_tables, "seq_lens": s.seq_lens,
        "positions": s.positions, "seq_tenant": s.seq_tenant, "status": s.seq_status,
        "registered": t.registered, "tenant_salt": t.salt})


def _tenant(alloc: Allocator, meta: dict, tenant) -> int:
    t = int_scalar("tenant", tenant, UnknownTenantError)
    if not 0 <= t < alloc.config.num_tenants:
        raise UnknownTenantError(f"tenant {t} outside [0, {alloc.config.num_tenants})")
    if not meta["registered"][t]:
        raise UnknownTenantError(f"tenant {t} is not registered")
    return t


def _tokens(alloc: Allocator, tokens) -> np.ndarray:
    """`tokens` as i32[n], 1 <= n <= max_tokens_per_seq, every id in the vocabulary."""
    c = alloc.config
    tok = int_array("tokens", tokens, 1)
    if tok.size == 0:
        raise InputShapeError("tokens is empty: name at least one token")
    if tok.size > c.max_tokens_per_seq:
        raise SequenceTooLongError(f"{tok.size} tokens; a sequence holds at most "
                                   f"{c.max_tokens_per_seq}")
    if ((tok < 0) | (tok >= c.model.vocab_size)).any():
        raise TokenIdError(f"token ids must be in [0, {c.model.vocab_size})")
    return tok


def _start(alloc: Allocator, state, tenant, tokens=None):
    """Validate state, tenant and tokens in one place: (meta, tenant, tokens or None)."""
    validate_state(alloc.config, state)
    meta = _meta(state)
    t = _tenant(alloc, meta, tenant)
    return meta, t, None if tokens is None else _tokens(alloc, tokens)


def _held(config, meta: dict, rows: np.ndarray, tok: np.ndarray) -> np.ndarray:
    """i32[R]: leading tokens of `tok` each sequence of `rows` holds, block by block (a block
    counts its tokens inside `tok` when all match; the walk stops at the first that does not)."""
    p, mb = config.block_size, config.max_blocks_per_seq
    n = tok.size
    tables = meta["tables"][rows]  # [R, MB]
    ids = meta["token_ids"][np.maximum(tables, 0)].reshape(rows.size, mb * p)
    lens = meta["seq_lens"][rows]
    limit = np.where(meta["positions"][rows] == lens, np.minimum(lens, n), 0)  # evicted: 0
    want = np.full(mb * p, INVALID, np.int32)
    want[:n] = tok
    j = np.arange(mb * p)
    inside = j[None, :] < limit[:, None]
    ok = ((ids == want[None, :]) | ~inside).reshape(rows.size, mb, p).all(-1)
    lead = np.cumprod(ok, axis=1).astype(bool)
    per_block = np.clip(limit[:, None] - np.arange(mb)[None, :] * p, 0, p)
    return np.where(lead, per_block, 0).sum(1).astype(np.int32)


def _holders(alloc: Allocator, meta: dict, tok: np.ndarray, tenant: int, statuses,
             what: str) -> np.ndarray:
    """Ascending slot ids of the tenant's sequences in `statuses` that hold all of `tok`;
    BlockStateError when there are none."""
    rows = np.flatnonzero((meta["seq_tenant"] == tenant) & np.isin(meta["status"], statuses))
    rows = rows[_held(alloc.config, meta, rows, tok) == tok.size]
    if rows.size == 0:
        raise BlockStateError(f"{what}: no sequence of tenant {tenant} in a status that allows it "
                              f"holds these {tok.size} tokens")
    return rows.astype(np.int32)


def _chain(config, meta: dict, tok: np.ndarray, tenant: int, nblocks: int) -> np.ndarray:
    """i32[h]: the leading prefix-cache hits for the first `nblocks` blocks of `tok`, by the rule
    of `kvquota.core.prefix.lookup` (the first `lookup_candidates` blocks in id order with the
    same hash, salt and hashed flag; of those with equal token ids, the first whose parent is the
    previous hit, of the same generation; the walk stops at the first miss)."""
    p, bits = config.block_size, config.hash_bits
    salt = meta["tenant_salt"][tenant]
    prev_hash = salt_root(np.array([salt], np.uint32), bits, xp=np)  # [1, 2]
    hits: list[int] = []
    for k in range(nblocks):
        blk = tok[k * p:(k + 1) * p]
        prev_hash = block_hash(prev_hash, blk[None, :], bits, xp=np)
        eq = (meta["hashed"] & (meta["block_hash"] == prev_hash).all(1)
              & (meta["salt"] == salt))
        cands = np.flatnonzero(eq)[:config.lookup_candidates]
        cands = cands[(meta["token_ids"][cands] == blk[None, :]).all(1)]
        if not hits:
            good = meta["parent"][cands] == INVALID
        else:
            good = ((meta["parent"][cands] == hits[-1])
                    & (meta["parent_gen"][cands] == meta["generation"][hits[-1]]))
        if not good.any():
            break
        hits.append(int(cands[good][0]))
    return np.asarray(hits, np.int32)


def _rows(ids: np.ndarray) -> np.ndarray:
    """Facade rows: ids padded with INVALID to a power of two (one compile per size bucket)."""
    return pad(ids, bucket(len(ids)))


# ---- the verbs -----------------------------------------------------------------------------------
def lookup(alloc: Allocator, state: KVState, tokens, tenant) -> dict[str, int]:
    """Leading tokens of `tokens` the tenant has cached, per location (see the module
    docstring): {"device": the next admit's prefix-cache hit, "host": held by a suspended
    sequence}. A dict of Python ints; the state is not changed."""
    meta, t, tok = _start(alloc, state, tenant, tokens)
    c = alloc.config
    device = _chain(c, meta, tok, t, (tok.size - 1) // c.block_size).size * c.block_size
    rows = np.flatnonzero((meta["seq_tenant"] == t) & (meta["status"] == SEQ_SUSPENDED))
    host = int(_held(c, meta, rows, tok).max(initial=0))
    return {"device": int(device), "host": host}


def clear(alloc: Allocator, state: KVState, tenant, location: str) -> tuple[KVState, Action]:
    """Free the tenant's sequences on `location` ("device": running, "host": suspended) or
    release all of them and their pins ("all"). Returns (state, Action) with one FreeReport
    (all zero when there was nothing to free)."""
    if location != "all":
        location_pools(alloc.config, location)
    meta, t, _ = _start(alloc, state, tenant)
    if location == "all":
        ids = np.flatnonzero(meta["seq_tenant"] == t).astype(np.int32)
        state, rep = alloc.release_tenant(state, t, unpin=True)
    else:
        status = SEQ_RUNNING if location == "device" else SEQ_SUSPENDED
        ids = np.flatnonzero((meta["seq_tenant"] == t) & (meta["status"] == status))
        state, rep = alloc.free(state, _rows(ids))
    return state, Action("clear", tuple(int(i) for i in ids), (), (rep,))


def _prefix_blocks(config, meta: dict, seq: int, tok: np.ndarray) -> np.ndarray:
    """i32[n // P]: the full blocks inside the prefix `tok`, along the table of `seq`."""
    return meta["tables"][seq, : tok.size // config.block_size].astype(np.int32)


def _full_prefix(alloc: Allocator, tok: np.ndarray, what: str) -> None:
    if tok.size < alloc.config.block_size:
        raise InvalidArgumentError(f"{what}: {tok.size} tokens cover no full block of "
                                   f"{alloc.config.block_size}")


def pin(alloc: Allocator, state: KVState, tokens, tenant) -> tuple[KVState, Action]:
    """Pin the full blocks inside the prefix `tokens` of the tenant's lowest-slot running or
    idle holder. Returns (state, Action) with one PinReport and the pinned block ids."""
    meta, t, tok = _start(alloc, state, tenant, tokens)
    _full_prefix(alloc, tok, "pin")
    seq = int(_holders(alloc, meta, tok, t, _ON_DEVICE, "pin")[0])
    blocks = _prefix_blocks(alloc.config, meta, seq, tok)
    state, rep = alloc.pin_blocks(state, blocks)
    return state, Action("pin", (seq,), tuple(int(b) for b in blocks), (rep,))


def unpin(alloc: Allocator, state: KVState, tokens, tenant) -> tuple[KVState, Action]:
    """Drop one pin from each pinned full block inside the prefix `tokens`, found along the
    first live holder that has some, else along the tenant's prefix-cache chain. Returns
    (state, Action) with one FreeReport (blocks held by nothing return to their pool)."""
    meta, t, tok = _start(alloc, state, tenant, tokens)
    _full_prefix(alloc, tok, "unpin")
    c = alloc.config
    rows = np.flatnonzero((meta["seq_tenant"] == t) & np.isin(meta["status"], _LIVE))
    rows = rows[_held(c, meta, rows, tok) == tok.size]
    lists = [((int(s),), _prefix_blocks(c, meta, int(s), tok)) for s in rows]
    lists.append(((), _chain(c, meta, tok, t, tok.size // c.block_size)))
    for seqs, blocks in lists:
        pinned = blocks[meta["pin_count"][blocks] > 0]
        if pinned.size:
            state, rep = alloc.unpin_blocks(state, pinned)
            return state, Action("unpin", seqs, tuple(int(b) for b in pinned), (rep,))
    raise BlockStateError(f"unpin: no pinned block holds the first {tok.size} tokens of "
                          f"tenant {t}")


def _compressible(config, meta: dict, seq: int, tok: np.ndarray, keep_recent: int) -> int:
    """Blocks of the prefix that `Allocator.compress` may take from `seq`: own (ref 1, unpinned,
    paid by its tenant), in pool 0, full, and outside the `keep_recent` most recent tokens."""
    p = config.block_size
    blocks = _prefix_blocks(config, meta, seq, tok)
    k = np.arange(blocks.size)
    ok = ((blocks < config.num_blocks) & (meta["ref_count"][blocks] == 1)
          & (meta["pin_count"][blocks] == 0) & (meta["payer"][blocks] == meta["seq_tenant"][seq])
          & (meta["fill"][blocks] == p) & ((k + 1) * p <= meta["seq_lens"][seq] - keep_recent))
    return int(ok.sum())


def compress(alloc: Allocator, state: KVState, tokens, tenant, method: str,
             keep_recent: int = 32) -> tuple[KVState, Action]:
    """Requantize the prefix `tokens` of every running holder into the compressed pool of
    format `method` (lossy; see the module docstring). Returns (state, Action) with one
    CompressReport per holder, in slot order."""
    names = [name for name, _ in alloc.config.compressed_pools]
    if method not in names:
        raise TierError(f"compress: no compressed pool of format {method!r} in this config "
                        f"(compressed pools: {names or 'none'})")
    keep = int_scalar("keep_recent", keep_recent, InvalidArgumentError)
    if keep < 0:
        raise InvalidArgumentError(f"keep_recent must be >= 0, got {keep}")
    meta, t, tok = _start(alloc, state, tenant, tokens)
    holders = _holders(alloc, meta, tok, t, (SEQ_RUNNING,), "compress")
    reports = []
    for seq in holders:
        limit = _compressible(alloc.config, meta, int(seq), tok, keep)
        state, rep = alloc.compress(state, np.array([seq], np.int32), kv_format=method,
                                    keep_recent=keep, policy="oldest", max_blocks=limit)
        reports.append(rep)
    return state, Action("compress", tuple(int(s) for s in holders), (), tuple(reports))


def move(alloc: Allocator, state: KVState, tokens, tenant, src: str, dst: str
         ) -> tuple[KVState, Action]:
    """Move the tenant's holders of `tokens` between locations: "device" -> "host" offloads the
    running ones, "host" -> "device" restores the suspended ones. Returns (state, Action) with
    one MoveReport whose rows follow `seq_ids`."""
    for where in (src, dst):
        location_pools(alloc.config, where)
    if src == dst:
        raise InvalidArgumentError(f"move: source and destination are both {src!r}")
    meta, t, tok = _start(alloc, state, tenant, tokens)
    status = SEQ_RUNNING if src == "device" else SEQ_SUSPENDED
    ids = _holders(alloc, meta, tok, t, (status,), f"move {src} -> {dst}")
    op = alloc.offload if src == "device" else alloc.restore
    state, rep = op(state, _rows(ids))
    return state, Action("move", tuple(int(i) for i in ids), (), (rep,))
