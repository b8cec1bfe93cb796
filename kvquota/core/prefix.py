"""Prefix-cache lookup: chained hashes of a batch of prompts and their leading cache hits."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kvquota.core import index
from kvquota.core.scatter import clip
from kvquota.hashing import block_hash, salt_root
from kvquota.sentinel import INVALID


def brute_force_candidates(config, state, hashes, salts, tokens):
    """Up to C blocks per query whose hash, salt and token ids all match: i32[Q, C], the C
    lowest-id blocks with the key, each kept only if its token ids equal the query's.

    hashes u32[Q, 2], salts u32[Q], tokens i32[Q, P]. Cost O(Q * NB): a join over every block,
    exact and simple; the oracle of the hash index (`index.candidates`, which `lookup` uses)
    and the baseline of its benchmark.
    """
    eq = (
        (state.blocks.block_hash[None, :, 0] == hashes[:, 0:1])
        & (state.blocks.block_hash[None, :, 1] == hashes[:, 1:2])
        & (state.blocks.block_salt[None, :] == salts[:, None])
        & state.blocks.hashed[None, :]
    )
    nb = state.blocks.ref_count.shape[0]
    cols = jnp.arange(nb, dtype=jnp.int32)[None, :]
    found = []
    for _ in range(config.lookup_candidates):
        idx = jnp.argmax(eq, axis=1).astype(jnp.int32)
        hit = jnp.take_along_axis(eq, idx[:, None], axis=1)[:, 0]
        same = (state.blocks.token_ids[idx] == tokens).all(axis=1)
        found.append(jnp.where(hit & same, idx, INVALID))
        eq = eq & (cols != idx[:, None])
    return jnp.stack(found, axis=1)


def lookup(config, state, salts, hashes, tokens, usable):
    """Leading prefix-cache hits of each prompt: i32[B, M] (INVALID after the first miss).

    Candidates come from the hash index in O(B x M) (only the `usable` positions are looked
    up: the others are never hits), or with `config.prefix_index=False` from the brute force.
    A candidate for block k is accepted only if its parent is the hit for block k - 1 (and that
    parent has not been freed and reused since: `parent_gen`), so the whole prefix is checked
    token by token, not just the last block, and a hash collision never yields a wrong block.
    """
    b, m = usable.shape
    args = (config, state, hashes.reshape(b * m, 2), jnp.repeat(salts, m), tokens.reshape(b * m, -1))
    if config.prefix_index:
        cands = index.candidates(*args, usable.reshape(b * m))
    else:
        cands = brute_force_candidates(*args)
    cands = cands.reshape(b, m, -1)
    return _chain(state, cands, usable)


def _chain(state, cands, usable):
    """The leading chain of accepted candidates: i32[B, M] hits (INVALID after the first miss).

    Position k's choice depends on k - 1's (a candidate is accepted only if its parent is the
    block chosen at k - 1, of that block's generation; the first such candidate wins), so it is
    a recurrence over M. Written as maps T_k from "which candidate was chosen at k - 1" (0..C-1,
    or C: none) to the same at k, composed by an associative scan: O(B x M x C^2 log M) work in
    log M vectorised rounds instead of M dependent loop iterations."""
    b, m, c = cands.shape
    cc = clip(cands)
    parent, parent_gen = state.blocks.parent[cc], state.blocks.parent_gen[cc]  # [B, M, C]
    prev = jnp.pad(cands[:, :-1], ((0, 0), (1, 0), (0, 0)), constant_values=INVALID)
    prev_gen = state.blocks.generation[clip(prev)]
    # match[b, k, j, i]: candidate i at k is the child of candidate j at k - 1.
    match = ((cands[:, :, None, :] >= 0) & (prev[:, :, :, None] >= 0)
             & (parent[:, :, None, :] == prev[:, :, :, None])
             & (parent_gen[:, :, None, :] == prev_gen[:, :, :, None]))
    dead = jnp.int32(c)
    step = jnp.where(match.any(axis=3), jnp.argmax(match, axis=3), dead).astype(jnp.int32)
    root = (cands >= 0) & (parent == INVALID)  # position 0: a chain's first block
    start = jnp.where(root.any(axis=2), jnp.argmax(root, axis=2), dead).astype(jnp.int32)
    # T_k as a table over C + 1 inputs (input C, and every input where k is not usable: none).
    t = jnp.concatenate([step, jnp.full((b, m, 1), dead, jnp.int32)], axis=2)
    t = t.at[:, 0, :].set(start[:, 0, None])  # position 0 ignores its input
    t = jnp.where(usable[:, :, None], t, dead)

    def compose(first, then):  # (then o first)(j) = then[first[j]]
        return jnp.take_along_axis(then, first, axis=-1)

    chosen = lax.associative_scan(compose, t, axis=1)[:, :, 0]  # the maps applied from k = 0
    return jnp.where(chosen < c, jnp.take_along_axis(cands, jnp.minimum(chosen, c - 1)[..., None],
                                                     axis=2)[..., 0], INVALID)


def chain_hashes(config, salts, blocks):
    """u32[B, M, 2] chained hashes of every block of a batch (blocks i32[B, M, P])."""
    root = salt_root(salts, config.hash_bits)

    def step(prev, blk):
        h = block_hash(prev, blk, config.hash_bits)
        return h, h

    _, hs = lax.scan(step, root, jnp.swapaxes(blocks, 0, 1))
    return jnp.swapaxes(hs, 0, 1)
