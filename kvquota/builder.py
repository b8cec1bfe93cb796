"""Vectorised builder of large synthetic states, for benchmarks and scale tests.

Building a state through `admit` one batch at a time is exact but slow at 2^20 blocks; this
builder lays the same structure out directly with NumPy (no Python loop over blocks or
sequences): every tenant's sequences share a system-prompt prefix, tenants in a sharing group
share one group prefix (paid by its lowest-id referencer), and each sequence then owns private
blocks, the last one partly filled. The result satisfies `check_invariants`.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import numpy as np

from kvquota.sentinel import INVALID
from kvquota.codes import INT32_MAX, SEQ_RUNNING
from kvquota.hashing import block_hash, group_salt, private_salt, salt_root
from kvquota.prefix_index import rebuild
from kvquota.state import KVState, StateConfig, init_pages, init_state, pool_of


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    """What to lay out.

    Attributes:
      num_seqs: live sequences (<= config.max_seqs), assigned to tenants round robin.
      prefix_blocks: full blocks of the shared prefix at the start of every sequence.
      group_size: tenants per sharing group (one shared salt and prefix per group).
      num_groups: sharing groups (tenants [0, group_size * num_groups)); the rest are private.
      pool_fill: fraction of pool 0 to occupy (prefixes + private blocks).
      pin_prefixes: pin every prefix block once.
      seed: NumPy seed for lengths and token ids.
    """

    num_seqs: int
    prefix_blocks: int = 4
    group_size: int = 4
    num_groups: int = 0
    pool_fill: float = 0.9
    pin_prefixes: bool = False
    seed: int = 0


def _spec_version(config: StateConfig, spec: SyntheticSpec) -> np.ndarray:
    """u32[2]: a version per config and spec (KVState.meta.version), never 0 (the empty
    state's)."""
    digest = hashlib.sha256(repr((config, spec)).encode()).digest()
    return np.frombuffer(digest[:8], np.uint32) | np.uint32(1)


def build_state(config: StateConfig, spec: SyntheticSpec) -> KVState:
    """A KVState with every tenant registered (unbounded quotas) and `spec.num_seqs` sequences."""
    c, sp = config, spec
    rng = np.random.default_rng(sp.seed)
    nb, n0, p, mb, ntn = c.total_blocks, c.num_blocks, c.block_size, c.max_blocks_per_seq, c.num_tenants
    s_used = sp.num_seqs
    if not 1 <= s_used <= c.max_seqs:
        raise ValueError(f"num_seqs {s_used} outside [1, {c.max_seqs}]")
    if sp.group_size * sp.num_groups > ntn or sp.prefix_blocks >= mb:
        raise ValueError("groups exceed the tenants, or the prefix fills the block table")

    # Tenants, salts and prefixes: one prefix per group, one per private tenant.
    tenants = np.arange(ntn)
    grouped = tenants < sp.group_size * sp.num_groups
    group = np.where(grouped, tenants // max(sp.group_size, 1), -1)
    salts = np.array([group_salt(int(g)) if g >= 0 else private_salt(int(t))
                      for t, g in zip(tenants, group)], np.uint32)
    prefix_of = np.where(grouped, group, sp.num_groups + tenants - sp.group_size * sp.num_groups)
    n_prefix = sp.num_groups + int((~grouped).sum())
    prefix_salt = np.zeros(n_prefix, np.uint32)
    prefix_salt[prefix_of] = salts

    # Sequences and their private blocks, sized to fill the pool.
    seq_t = np.arange(s_used) % ntn
    pb = sp.prefix_blocks
    used_pfx = np.unique(prefix_of[seq_t])
    budget = int(sp.pool_fill * n0) - len(used_pfx) * pb
    avg = budget / s_used
    if avg < 1:
        raise ValueError("pool too small for one private block per sequence")
    hi = int(min(max(1, 2 * avg - 1), mb - pb))
    priv = rng.integers(1, hi + 1, size=s_used)
    priv = np.minimum(priv, mb - pb)
    over = priv.sum() - budget  # trim so the total never exceeds the budget
    while over > 0:
        cut = np.minimum(priv - 1, over)
        take = np.minimum(cut, -(-over // s_used))
        priv -= take
        over -= int(take.sum())
        if take.sum() == 0:
            raise ValueError("cannot fit the sequences into the pool")
    last_fill = rng.integers(1, p + 1, size=s_used)
    lens = (pb + priv - 1) * p + last_fill

    # Block ids: used prefixes first, then private runs in sequence order.
    pfx_base = np.full(n_prefix, INVALID)
    pfx_base[used_pfx] = np.arange(len(used_pfx)) * pb
    priv_start = len(used_pfx) * pb + np.concatenate([[0], np.cumsum(priv)[:-1]])
    n_used = len(used_pfx) * pb + int(priv.sum())
    k = np.arange(mb)[None, :]
    pfx_ids = pfx_base[prefix_of[seq_t]][:, None] + k
    priv_ids = priv_start[:, None] + k - pb
    nblk = pb + priv
    tables = np.full((c.max_seqs, mb), INVALID, np.int32)
    tables[:s_used] = np.where(k < pb, pfx_ids, np.where(k < nblk[:, None], priv_ids, INVALID))

    # Per-block contents.
    fill = np.zeros(nb, np.int32)
    fill[:n_used] = p
    last_ids = priv_start + priv - 1
    fill[last_ids] = last_fill
    token_ids = np.full((nb, p), INVALID, np.int32)
    token_ids[:n_used] = rng.integers(0, c.model.vocab_size, size=(n_used, p), dtype=np.int32)
    token_ids[:n_used][np.arange(p)[None, :] >= fill[:n_used, None]] = INVALID

    # Chain data: hashes of full blocks, salts, parents (walk the table column by column).
    block_h = np.zeros((nb, 2), np.uint32)
    hashed = np.zeros(nb, bool)
    block_salt = np.zeros(nb, np.uint32)
    parent = np.full(nb, INVALID, np.int32)
    live_tab = tables[:s_used]
    prev_h = salt_root(salts[seq_t], c.hash_bits, xp=np)
    prev_b = np.full(s_used, INVALID, np.int32)
    for col in range(int(nblk.max())):
        ids = live_tab[:, col]
        have = ids >= 0
        full = have & (fill[np.maximum(ids, 0)] == p)
        h = block_hash(prev_h, token_ids[np.maximum(ids, 0)], c.hash_bits, xp=np)
        block_h[ids[full]] = h[full]
        hashed[ids[full]] = True
        block_salt[ids[have]] = salts[seq_t][have]
        parent[ids[have]] = prev_b[have]
        prev_h, prev_b = h, ids

    # References, payers, ledger.
    ents = live_tab[live_tab >= 0]
    ent_t = np.broadcast_to(seq_t[:, None], live_tab.shape)[live_tab >= 0]
    ref = np.bincount(ents, minlength=nb).astype(np.int32)
    payer = np.full(nb, ntn, np.int64)
    np.minimum.at(payer, ents, ent_t)  # the lowest-id referencer pays (the prefix's creator)
    payer = np.where(payer == ntn, INVALID, payer).astype(np.int32)
    payer_refs = np.bincount(ents[payer[ents] == ent_t], minlength=nb).astype(np.int32)
    pin = np.zeros(nb, np.int32)
    if sp.pin_prefixes:
        pin[: len(used_pfx) * pb] = 1
    pools = pool_of(c, np.arange(nb), xp=np)
    held = ref > 0
    charged = np.zeros((ntn, c.num_pools), np.int32)
    np.add.at(charged, (payer[held], pools[held]), 1)
    pinned = np.zeros((ntn, c.num_pools), np.int32)
    np.add.at(pinned, (payer[pin > 0], pools[pin > 0]), 1)
    used_tokens = np.bincount(seq_t, weights=lens, minlength=ntn).astype(np.int32)

    base = jax.device_get(init_state(dataclasses.replace(c, with_pages=False)))
    free_list = np.asarray(base.free.free_list).copy()
    free_count = np.asarray(base.free.free_count).copy()
    free_list[:n0 - n_used] = np.arange(n0 - 1, n_used - 1, -1)  # lowest free id popped first
    free_count[0] = n0 - n_used
    seq_lens = np.zeros(c.max_seqs, np.int32)
    seq_lens[:s_used] = lens
    seq_tenant = np.full(c.max_seqs, INVALID, np.int32)
    seq_tenant[:s_used] = seq_t
    status = np.zeros(c.max_seqs, np.int8)
    status[:s_used] = SEQ_RUNNING
    arrays = dict(
        ref_count=ref, pin_count=pin, payer=payer, payer_refs=payer_refs,
        tier=base.blocks.tier, precision=base.blocks.precision, fill=fill, token_ids=token_ids,
        block_hash=block_h, hashed=hashed, block_salt=block_salt, parent=parent,
        parent_gen=np.zeros(nb, np.int32), generation=np.zeros(nb, np.int32),
        attn_mass=np.zeros((nb, p), np.float32),
        head_mass=np.zeros((nb, p) + c.head_mass_shape, np.float32), cold_at=np.full(nb, INVALID, np.int32),
        free_list=free_list, free_count=free_count, cold_count=np.int32(0),
        cold_ring=np.full(n0, INVALID, np.int32), cold_head=np.int32(0), cold_clock=np.int32(0),
        block_tables=tables, seq_lens=seq_lens,
        positions=seq_lens.copy(), seq_tenant=seq_tenant, seq_status=status,
        birth=np.arange(len(seq_lens), dtype=np.int32), births=np.int32(len(seq_lens)),
        registered=np.ones(ntn, bool), token_quota=np.full(ntn, INT32_MAX, np.int32),
        byte_quota=np.full(ntn, INT32_MAX, np.int32),
        lease_expiry=np.full(ntn, INT32_MAX, np.int32), salt=salts,
        used_tokens=used_tokens, charged_blocks=charged, pinned_blocks=pinned,
        growing=np.zeros(ntn, bool), preemptions=np.zeros(ntn, np.int32),
        **rebuild(c, hashed, block_h, block_salt, xp=np),  # the prefix index of the hashed blocks
        config_id=base.meta.config_id,
        version=_spec_version(config, spec),  # a built state's history is its spec
    )
    return KVState.from_fields(init_pages(c), **arrays)
