"""Eviction: drop tokens of a sequence and compact the survivors, keeping their logical positions.

Block mode (`evict_blocks`) drops whole blocks and compacts the table: own blocks keep their
pages (no copy), only shared or pinned blocks after the first dropped one are copied on write.

Token mode (`evict_tokens`): the kept tokens, in their original order, are packed into full
blocks (no hole wastes a slot). Blocks before the first dropped token are unchanged and stay
as they are (shared ones too: a shared system prompt survives by reference). From there on, new
block q is written into the sequence's old block q when that block is its own (only it
references it, unpinned, in pool 0), else into a fresh pool-0 block: copy on write, so a shared
block is never altered under another sequence. Old blocks past the new end lose this
sequence's reference (`settle` frees them or passes their charge to an heir).

RoPE was applied before K was cached, so a token keeps its rotation wherever it lands: the
sequence's `positions` (next logical position) is unchanged while `seq_lens` shrinks. Rewritten
blocks are no prefix-cache targets (their K/V sit at other positions than a prompt of the same
tokens would put them); their chain hash is still stored, so appends keep chaining.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvquota.codes import SEQ_IDLE, SEQ_RUNNING
from kvquota.core.cold import allocatable
from kvquota.core.index import forget
from kvquota.core.jit import donating_jit
from kvquota.core.pages import copy_blocks
from kvquota.core.prefix import chain_hashes
from kvquota.core.release import heir_inputs, seq_rows, settle
from kvquota.core.scatter import clip, oob
from kvquota.core.tiers import own_blocks, pop_blocks
from kvquota.errors import InputShapeError, InvalidArgumentError, PoolFullError, TierError
from kvquota.policies import TokenView, get_policy
from kvquota.reports import EvictReport
from kvquota.sentinel import INVALID, PER_HEAD_TOKEN
from kvquota.state import KVState, StateConfig
from kvquota.validation import heirs_of_rows, int_scalar, seq_batch


def plan_tokens(config: StateConfig, state: KVState, seq_ids, keep):
    """Where every kept token goes. keep bool[B, G, C] (C = MB * P; False past each length): one
    kept set (G = 1) or one per layer and KV head (G = L * Hkv, the same count in each).

    Returns a dict of the new table i32[B, MB], which new blocks are written (bool[B, MB]),
    which of them are fresh copies (bool[B, MB]), each kept token's destination (block, slot:
    i32[B, G, C]), whether every head keeps the same tokens (`agree` bool[B]) and the number of
    kept tokens i32[B]."""
    p, mb = config.block_size, config.max_blocks_per_seq
    b, _, c = keep.shape
    rows, tcol = seq_rows(state, seq_ids)
    lens = jnp.where(seq_ids >= 0, state.seqs.seq_lens[clip(seq_ids)], 0)
    i = jnp.arange(c, dtype=jnp.int32)[None, None, :]
    held = i < lens[:, None, None]
    keep = keep & held
    n_keep = keep[:, 0].sum(axis=1).astype(jnp.int32)
    dropped = held & ~keep
    first_drop = jnp.where(dropped.any(axis=2), jnp.argmax(dropped, axis=2), lens[:, None])
    stable = (first_drop.min(axis=1) // p).astype(jnp.int32)  # blocks left exactly as they are
    q = jnp.arange(mb, dtype=jnp.int32)[None, :]
    new_nblk = (n_keep + p - 1) // p
    written = (q >= stable[:, None]) & (q < new_nblk[:, None])
    own = own_blocks(config, state, rows, tcol, 0)
    fresh = written & ~own
    fresh_ids, n_fresh, state = pop_blocks(config, state, fresh.ravel(), 0)
    table = jnp.where(q < new_nblk[:, None], rows, INVALID)
    table = jnp.where(fresh, fresh_ids.reshape(b, mb), table)
    j = jnp.cumsum(keep, axis=2) - 1  # new cache index of each kept token, per head
    moved = keep & (i >= (stable * p)[:, None, None])  # kept tokens that land in a written block
    dst_blk = jnp.take_along_axis(table[:, None, :], jnp.clip(j // p, 0, mb - 1), axis=2)
    src = jnp.arange(c, dtype=jnp.int32)[None, :]
    return dict(state=state, table=table, rows=rows, tcol=tcol, written=written, fresh=fresh,
                n_fresh=n_fresh, n_keep=n_keep, lens=lens, moved=moved, dst_blk=dst_blk,
                dst_slot=j % p, agree=(keep == keep[:, :1]).all(axis=(1, 2)),
                src_blk=jnp.take_along_axis(rows, jnp.clip(src // p, 0, mb - 1), axis=1),
                src_slot=jnp.broadcast_to(src % p, (b, c)), new_nblk=new_nblk)


def fresh_count(config: StateConfig, state: KVState, seq_ids, keep):
    """i32[]: pool-0 blocks the eviction needs for copies on write (the facade's room check)."""
    return plan_tokens(config, state, seq_ids, keep)["n_fresh"].astype(jnp.int32)


@donating_jit
def evict_tokens_core(config: StateConfig, state: KVState, seq_ids, keep, heir_rows):
    """Keep exactly the tokens `keep` (bool[B, G, MB * P]: G = 1 for every layer and head alike,
    or L * Hkv, each (layer, head) its own tokens, the same number) of `seq_ids` (i32[B],
    unique, INVALID = padding), compacted: slot j of head h holds h's j-th kept token.
    `heir_rows` (the live rows' table entries, see `release.heir_inputs`) may inherit a shared
    block's charge.

    Written blocks whose heads keep different tokens hold no single token per slot: their
    token ids are PER_HEAD_TOKEN (never hashed: they are no prefix-cache target anyway), and
    their summed mass is the sum of each head's kept token's mass."""
    p, nb, ns, ntn = config.block_size, config.total_blocks, config.max_seqs, config.num_tenants
    pl = plan_tokens(config, state, seq_ids, keep)
    state = pl["state"]  # the fresh blocks popped
    b, mb = pl["table"].shape
    groups = keep.shape[1]
    blk, s = state.blocks, state
    valid = seq_ids >= 0
    ten = pl["tcol"][:, 0]
    written = oob(pl["table"], pl["written"], nb)
    fresh = oob(pl["table"], pl["fresh"], nb)
    src = (clip(pl["src_blk"]), pl["src_slot"])  # [B, C] each
    moved, dst_blk, dst_slot = pl["moved"], pl["dst_blk"], pl["dst_slot"]  # [B, G, C] each
    dst0 = (oob(dst_blk[:, 0], moved[:, 0], nb), dst_slot[:, 0])  # head 0's tokens
    fill = jnp.clip(pl["n_keep"][:, None] - jnp.arange(mb)[None, :] * p, 0, p)

    # Token ids, mass and pages of the written blocks: cleared, then the kept tokens scattered.
    named = jnp.where(pl["agree"][:, None], blk.token_ids[src], PER_HEAD_TOKEN)  # [B, C]
    token_ids = blk.token_ids.at[written].set(INVALID, mode="drop").at[dst0].set(
        named, mode="drop")
    head_mass = blk.head_mass.at[written].set(0.0, mode="drop")
    mass = blk.attn_mass.at[written].set(0.0, mode="drop")
    if groups == 1:
        mass = mass.at[dst0].set(blk.attn_mass[src], mode="drop")
        head_mass = head_mass.at[dst0].set(blk.head_mass[src], mode="drop")
    else:  # head g = (layer g // Hkv, KV head g % Hkv) moves its own tokens
        hkv = blk.head_mass.shape[3]
        layer = (jnp.arange(groups) // hkv)[None, :, None]
        head = (jnp.arange(groups) % hkv)[None, :, None]
        dst = (oob(dst_blk, moved, nb), dst_slot, layer, head)
        kept_mass = blk.head_mass[src[0][:, None], src[1][:, None], layer, head]  # [B, G, C]
        head_mass = head_mass.at[dst].set(kept_mass, mode="drop")
        mass = mass.at[dst[:2]].add(kept_mass, mode="drop")
    # Chain hashes of the new token stream (the prefix stays; rewritten blocks re-chained).
    salts = s.tenants.salt[clip(ten)]
    stream = token_ids[clip(pl["table"])]  # [B, MB, P]
    hashes = chain_hashes(config, salts, stream)
    full = fill == p
    prev = jnp.pad(pl["table"][:, :-1], ((0, 0), (1, 0)), constant_values=INVALID)
    # References: fresh copies gain one; old entries no longer in the table lose one.
    kk = jnp.arange(mb)[None, :]
    gone = (pl["rows"] >= 0) & ((kk >= pl["new_nblk"][:, None]) | pl["fresh"])
    gone_ids = oob(pl["rows"], gone, nb)
    own_gone = oob(pl["rows"], gone & (blk.payer[clip(pl["rows"])] == pl["tcol"]), nb)
    heirs = heir_inputs(state, heir_rows)
    state = s.update(
        token_ids=token_ids,
        attn_mass=mass,
        head_mass=head_mass,
        fill=blk.fill.at[written].set(fill, mode="drop"),
        block_hash=blk.block_hash.at[written].set(
            jnp.where(full[..., None], hashes, jnp.uint32(0)), mode="drop"),
        hashed=blk.hashed.at[written].set(False, mode="drop"),
        block_salt=blk.block_salt.at[fresh].set(jnp.broadcast_to(salts[:, None], (b, mb)),
                                                mode="drop"),
        parent=blk.parent.at[written].set(prev, mode="drop"),
        parent_gen=blk.parent_gen.at[written].set(
            jnp.where(prev >= 0, blk.generation[clip(prev)], 0), mode="drop"),
        ref_count=blk.ref_count.at[fresh].set(1, mode="drop").at[gone_ids].add(-1, mode="drop"),
        payer_refs=blk.payer_refs.at[fresh].set(1, mode="drop").at[own_gone].add(
            -1, mode="drop"),
        payer=blk.payer.at[fresh].set(pl["tcol"], mode="drop"),
        block_tables=s.seqs.block_tables.at[oob(seq_ids, valid, ns)].set(pl["table"],
                                                                          mode="drop"),
        seq_lens=s.seqs.seq_lens.at[oob(seq_ids, valid, ns)].set(pl["n_keep"], mode="drop"),
        used_tokens=s.tenants.used_tokens.at[oob(ten, valid, ntn)].add(
            pl["n_keep"] - pl["lens"], mode="drop"),
        charged_blocks=s.tenants.charged_blocks.at[oob(ten, valid, ntn), 0].add(
            pl["fresh"].sum(axis=1).astype(jnp.int32), mode="drop"),
    )
    state = forget(config, state, written.ravel())  # rewritten blocks leave the prefix index
    if s.pages:
        # Only pool-0 blocks are rewritten (the facade refuses sequences holding compressed
        # blocks in token mode); gather every kept token from the old pages, then scatter.
        state = state.replace(pages=(_move_tokens(config, s.pages[0], src, moved, dst_blk,
                                                  dst_slot),) + s.pages[1:])
    return _settle_and_report(config, state, pl, gone, heirs,
                              jnp.where(valid, pl["lens"] - pl["n_keep"], 0))


def _move_tokens(config: StateConfig, pool0, src, moved, dst_blk, dst_slot):
    """Pool-0 pages with each kept token's K/V copied from `src` (block, slot: i32[B, C]) to its
    destination (i32[B, G, C] where `moved`): all heads alike (G = 1), or each (layer, KV head)
    its own tokens, one layer at a time (a [B, G, C, D] gather of every layer would not fit)."""
    n0 = config.num_blocks
    d_blk = jnp.where(moved & (dst_blk < n0), dst_blk, n0)  # the rest out of bounds: dropped
    if moved.shape[1] == 1:
        move = lambda a: a.at[:, :, d_blk[:, 0], dst_slot[:, 0]].set(  # noqa: E731
            a[:, :, src[0], src[1]], mode="drop")
        return jax.tree.map(move, pool0)
    layers = pool0.k.shape[0]
    d_blk = d_blk.reshape(d_blk.shape[0], layers, -1, d_blk.shape[-1])  # [B, L, Hkv, C]
    d_slot = dst_slot.reshape(d_blk.shape)

    def one_head(pages, d_b, d_s):  # [N0, P, D], [B, C], [B, C]
        return pages.at[d_b, d_s].set(pages[src[0], src[1]], mode="drop")

    def one_layer(layer, pages):
        # The heads are a vmapped (batch) axis, never an index: a pool split over KV heads
        # (`kvquota.sharding`) then moves each device's own heads, with no collective.
        move = lambda a: a.at[layer].set(jax.vmap(one_head, in_axes=(0, 1, 1))(  # noqa: E731
            a[layer], d_blk[:, layer], d_slot[:, layer]))
        return jax.tree.map(move, pages)

    return jax.lax.fori_loop(0, layers, one_layer, pool0)


def plan_blocks(config: StateConfig, state: KVState, seq_ids, keep):
    """Block mode: keep bool[B, MB] whole blocks. Returns the new table, the kept blocks that
    need a copy on write (shared or pinned ones after the first dropped block) and counts."""
    mb = config.max_blocks_per_seq
    b = keep.shape[0]
    rows, tcol = seq_rows(state, seq_ids)
    keep = keep & (rows >= 0)
    q = jnp.arange(mb, dtype=jnp.int32)[None, :]
    dropped = (rows >= 0) & ~keep
    first_drop = jnp.where(dropped.any(axis=1), jnp.argmax(dropped, axis=1), mb)
    after = keep & (q >= first_drop[:, None])  # kept blocks whose predecessor changes
    rc = clip(rows)
    blk = state.blocks
    own = (blk.ref_count[rc] == 1) & (blk.pin_count[rc] == 0) & (blk.payer[rc] == tcol)
    fresh = after & ~own  # the facade refuses copies of blocks outside pool 0
    fresh_ids, n_fresh, state = pop_blocks(config, state, fresh.ravel(), 0)
    ids = jnp.where(fresh, fresh_ids.reshape(b, mb), rows)
    rank = jnp.where(keep, jnp.cumsum(keep, axis=1) - 1, mb)  # new slot of each kept block
    table = jnp.full((b, mb), INVALID, jnp.int32)
    table = jax.vmap(lambda t, r, x: t.at[r].set(x, mode="drop"))(table, rank, ids)
    rewritten = jnp.zeros((b, mb), bool)
    rewritten = jax.vmap(lambda t, r, a: t.at[r].set(a, mode="drop"))(rewritten, rank, after)
    return dict(state=state, rows=rows, tcol=tcol, keep=keep, fresh=fresh, n_fresh=n_fresh,
                table=table, rewritten=rewritten, fresh_ids=ids, dropped=dropped,
                fresh_outside_pool0=(fresh & (rows >= config.num_blocks)).any())


def fresh_block_count(config: StateConfig, state: KVState, seq_ids, keep):
    """(i32[] pool-0 blocks block-mode eviction needs for copies on write, bool[] whether a
    block outside pool 0 would need one: the facade's checks)."""
    pl = plan_blocks(config, state, seq_ids, keep)
    return pl["n_fresh"].astype(jnp.int32), pl["fresh_outside_pool0"]


@donating_jit
def evict_blocks_core(config: StateConfig, state: KVState, seq_ids, keep, heir_rows):
    """Keep exactly the whole blocks `keep` (bool[B, MB]) of `seq_ids`, the table compacted.
    Own blocks keep their pages (no copy); only shared or pinned blocks after the first dropped
    one are copied on write (pool 0 only: the facade refuses the rest)."""
    p, nb, ns, ntn = config.block_size, config.total_blocks, config.max_seqs, config.num_tenants
    pl = plan_blocks(config, state, seq_ids, keep)
    state = pl["state"]  # the fresh blocks popped
    b, mb = pl["table"].shape
    blk, s = state.blocks, state
    valid = seq_ids >= 0
    ten = pl["tcol"][:, 0]
    rows_c = clip(pl["rows"])
    fresh = oob(pl["fresh_ids"], pl["fresh"], nb)
    lens = jnp.where(valid, s.seqs.seq_lens[clip(seq_ids)], 0)
    kept_tokens = jnp.where(pl["keep"], blk.fill[rows_c], 0).sum(axis=1).astype(jnp.int32)
    # Fresh copies first take their source's data; then the rewritten part of the new table is
    # re-chained (new parents, chain hashes of the new stream) and leaves the prefix cache.
    token_ids = blk.token_ids.at[fresh].set(blk.token_ids[rows_c], mode="drop")
    salts = s.tenants.salt[clip(ten)]
    tab_c = clip(pl["table"])
    hashes = chain_hashes(config, salts, token_ids[tab_c])
    full = blk.fill.at[fresh].set(blk.fill[rows_c], mode="drop")[tab_c] == p
    prev = jnp.pad(pl["table"][:, :-1], ((0, 0), (1, 0)), constant_values=INVALID)
    rew = oob(pl["table"], pl["rewritten"], nb)
    gone = pl["dropped"] | pl["fresh"]
    own_gone = oob(pl["rows"], gone & (blk.payer[rows_c] == pl["tcol"]), nb)
    heirs = heir_inputs(state, heir_rows)
    state = s.update(
        token_ids=token_ids,
        attn_mass=blk.attn_mass.at[fresh].set(blk.attn_mass[rows_c], mode="drop"),
        head_mass=blk.head_mass.at[fresh].set(blk.head_mass[rows_c], mode="drop"),
        fill=blk.fill.at[fresh].set(blk.fill[rows_c], mode="drop"),
        block_hash=blk.block_hash.at[rew].set(
            jnp.where(full[..., None], hashes, jnp.uint32(0)), mode="drop"),
        hashed=blk.hashed.at[rew].set(False, mode="drop"),
        block_salt=blk.block_salt.at[fresh].set(blk.block_salt[rows_c], mode="drop"),
        parent=blk.parent.at[rew].set(prev, mode="drop"),
        parent_gen=blk.parent_gen.at[rew].set(
            jnp.where(prev >= 0, blk.generation[clip(prev)], 0), mode="drop"),
        ref_count=blk.ref_count.at[fresh].set(1, mode="drop").at[
            oob(pl["rows"], gone, nb)].add(-1, mode="drop"),
        payer_refs=blk.payer_refs.at[fresh].set(1, mode="drop").at[own_gone].add(
            -1, mode="drop"),
        payer=blk.payer.at[fresh].set(pl["tcol"], mode="drop"),
        block_tables=s.seqs.block_tables.at[oob(seq_ids, valid, ns)].set(pl["table"],
                                                                          mode="drop"),
        seq_lens=s.seqs.seq_lens.at[oob(seq_ids, valid, ns)].set(kept_tokens, mode="drop"),
        used_tokens=s.tenants.used_tokens.at[oob(ten, valid, ntn)].add(kept_tokens - lens,
                                                                       mode="drop"),
        charged_blocks=s.tenants.charged_blocks.at[oob(ten, valid, ntn), 0].add(
            pl["fresh"].sum(axis=1).astype(jnp.int32), mode="drop"),
    )
    state = forget(config, state, rew.ravel())  # re-chained blocks leave the prefix index
    if s.pages:
        state = state.replace(pages=copy_blocks(config, s.pages, pl["rows"].ravel(),
                                                pl["fresh_ids"].ravel(), pl["fresh"].ravel()))
    return _settle_and_report(config, state, pl, gone, heirs,
                              jnp.where(valid, lens - kept_tokens, 0))


def _settle_and_report(config, state, pl, gone, heirs, evicted):
    """Drop the references of the `gone` entries (freeing or passing on their blocks) and
    report the eviction."""
    state, rep = settle(config, state, jnp.where(gone, pl["rows"], INVALID).ravel(), heirs)
    report = EvictReport(
        evicted_tokens=evicted,
        copied_blocks=pl["fresh"].sum(axis=1).astype(jnp.int32),
        blocks_returned=rep["blocks_returned"],
        quota_units_released=rep["quota_units_released"],
        transferred_blocks=rep["transferred_blocks"],
        host_blocks_used=rep["host_blocks_used"],
        pool_bytes=config.pool_bytes,
        unit_bytes=config.unit_bytes,
        host_blocks=config.host_blocks,
        host_watermark=config.host_watermark,
    )
    return state, report


_fresh_count = jax.jit(fresh_count, static_argnums=(0,))
# One compiled mask per policy (a frozen, hashable dataclass) and shape: run eagerly, its sorts
# and temporaries cost an eviction more than the eviction itself.
_keep_mask = jax.jit(lambda policy, view, keep: policy.keep_mask(view, keep), static_argnums=0)
_fresh_block_count = jax.jit(fresh_block_count, static_argnums=(0,))


# ---- the facade's checks ------------------------------------------------------------------------
AGGREGATES = ("head", "global")


def _checked(config, state, seq_ids, policy, keep_tokens, mode, aggregate, options):
    """The facade's checks of an eviction's arguments: (policy, ids, real ids, keep, aggregate,
    tables i32[B, MB])."""
    c = config
    pol = get_policy(policy, **options)
    ids, real = seq_batch(c, state, seq_ids, "evict", (SEQ_RUNNING, SEQ_IDLE))
    keep = int_scalar("keep_tokens", keep_tokens, InvalidArgumentError)
    if keep < 1:  # a running sequence holds at least one token (free it instead)
        raise InvalidArgumentError(f"keep_tokens must be >= 1, got {keep}")
    if mode not in ("token", "block"):
        raise InvalidArgumentError(f"evict mode must be 'token' or 'block', got {mode!r}")
    if aggregate is None:
        aggregate = "head" if mode == "token" and state.pages else "global"
    if aggregate not in AGGREGATES:
        raise InvalidArgumentError(f"evict aggregate must be 'head' or 'global', got "
                                   f"{aggregate!r}")
    if aggregate == "head" and (mode != "token" or not state.pages):
        raise InvalidArgumentError("per-head eviction (aggregate='head') compacts each head's "
                                   "pages: it needs token mode on a state with pages")
    tables = np.asarray(state.seqs.block_tables)[np.maximum(ids, 0)]
    tables = np.where((ids >= 0)[:, None], tables, INVALID)
    if mode == "token" and (tables >= c.num_blocks).any():
        raise TierError("evict: a sequence holds compressed blocks; token eviction rewrites "
                        "pool-0 pages only (use mode='block')")
    return pol, ids, real, keep, aggregate, tables


def keep_mask(config: StateConfig, state: KVState, seq_ids, *, policy, keep_tokens,
              aggregate=None, attention=None, **options) -> np.ndarray:
    """Allocator.keep_mask: the tokens a token-mode `evict` with these arguments keeps, bool[B,
    L, Hkv, C] (L = Hkv = 1 with aggregate "global"), the state unchanged."""
    pol, ids, _, keep, aggregate, tables = _checked(config, state, seq_ids, policy, keep_tokens,
                                                    "token", aggregate, options)
    view = token_view(config, state, ids, tables, pol, attention, aggregate)
    return np.asarray(_keep_mask(pol, view, np.full(ids.size, keep, np.int32)))


def evict(config: StateConfig, state: KVState, seq_ids, *, policy, keep_tokens, mode="token",
          aggregate=None, attention=None, donate=False, **options):
    """Allocator.evict: the policy's keep mask computed on the host view, then room for the
    copies on write checked by the core's own count. `aggregate` "head" (the default in token
    mode on a state with pages): each layer and KV head keeps its own top tokens; "global" (the
    only choice for block mode and metadata-only states): one set for the whole model, scored
    on the statistics summed over layers and heads."""
    c = config
    pol, ids, real, keep, aggregate, tables = _checked(c, state, seq_ids, policy, keep_tokens,
                                                       mode, aggregate, options)
    view = token_view(c, state, ids, tables, pol, attention, aggregate)
    if mode == "token":
        kept = np.asarray(_keep_mask(pol, view, np.full(ids.size, keep, np.int32)))
        mask = kept.reshape(ids.size, -1, kept.shape[-1])  # [B, G, C]
        need = int(_fresh_count(c, state, ids, mask))
    else:
        mask = np.asarray(pol.block_keep_mask(
            view, c.block_size, np.full(ids.size, max(1, keep // c.block_size), np.int32)))
        need, outside = _fresh_block_count(c, state, ids, mask)
        need = int(need)
        if bool(outside):
            raise TierError("evict: a shared or pinned compressed block would need a copy "
                            "on write; copies are made in pool 0 only")
    room = int(allocatable(c, state, xp=np)[0])
    if need > room:
        raise PoolFullError(f"evict: {need} blocks needed for copies on write, pool 0 has "
                            f"{room} free")
    if mode == "block":
        return evict_blocks_core(c, state, ids, mask, heirs_of_rows(c, state, real),
                                 donate=donate)
    state, report = evict_tokens_core(c, state, ids, mask, heirs_of_rows(c, state, real),
                                      donate=donate)
    return state, report.replace(kept=kept)


def token_view(config: StateConfig, state: KVState, ids, tables, policy, attention,
               aggregate: str = "global") -> TokenView:
    """What an eviction policy reads, per cache index of rows `ids` (tables i32[B, MB]): mass,
    and key norms / last attention when the policy needs them; per layer and KV head
    (`aggregate="head"`: [B, L, Hkv, C]) or summed over them ("global": [B, 1, 1, C])."""
    c = config
    width = c.max_tokens_per_seq
    b = ids.size
    per_head = aggregate == "head"
    safe = np.maximum(tables, 0)
    lengths = np.where(ids >= 0, np.asarray(state.seqs.seq_lens)[np.maximum(ids, 0)], 0)
    if not policy.reads_mass:  # only its shape is read: no copy of the state's mass
        shape = (c.model.num_layers, c.model.num_kv_heads) if per_head else (1, 1)
        mass = np.zeros((b, *shape, width), np.float32)
    elif per_head:
        heads = np.asarray(state.blocks.head_mass[safe])  # [B, MB, P, L, Hkv]
        if not heads.any() and \
                np.asarray(state.blocks.attn_mass[safe]).any():
            raise InvalidArgumentError(
                "evict: the mass of these sequences was recorded summed over layers and heads "
                "(record_attention with f32[B, C]); per-head eviction needs it per head "
                "(f32[B, L, Hkv, C], as the engine records it), or pass aggregate='global'")
        mass = np.moveaxis(heads.reshape(b, width, *heads.shape[3:]), 1, -1)
    else:
        mass = np.asarray(state.blocks.attn_mass[safe]).reshape(b, 1, 1, width)
    key_norm = last = None
    if "key_norm" in policy.needs:
        if not state.pages:
            raise TierError(f"policy {policy.name!r} reads keys: this state has no pages")
        k = state.pages[0].k[:, :, np.minimum(safe, c.num_blocks - 1)]  # [L, H, B, MB, P, D]
        sq = jnp.square(k.astype(jnp.float32))
        if per_head:
            key_norm = jnp.moveaxis(jnp.sqrt(jnp.sum(sq, axis=-1)).reshape(*k.shape[:3], width),
                                    2, 0)
        else:
            key_norm = jnp.sqrt(jnp.sum(sq, axis=(0, 1, -1))).reshape(b, 1, 1, width)
    if "last_attention" in policy.needs:
        if attention is None:
            raise InvalidArgumentError(f"policy {policy.name!r} needs attention= (the last "
                                       "step's attention per cached token)")
        last = np.asarray(attention, np.float32)
        layers, hkv = c.model.num_layers, c.model.num_kv_heads
        if last.shape == (b, layers, hkv, width) and not per_head:
            last = last.sum(axis=(1, 2))
        if last.shape == (b, width) and not per_head:
            last = last.reshape(b, 1, 1, width)
        if last.shape != mass.shape:
            want = f"[{b}, {layers}, {hkv}, {width}]" if per_head else \
                f"[{b}, {width}] or [{b}, {layers}, {hkv}, {width}]"
            raise InputShapeError(f"attention must be {want} for aggregate={aggregate!r}, got "
                                  f"{last.shape}")
    return TokenView(lengths=jnp.asarray(lengths, jnp.int32), mass=jnp.asarray(mass),
                     key_norm=key_norm, last_attention=None if last is None else
                     jnp.asarray(last))
