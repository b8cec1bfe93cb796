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

    def step(carry, xs):
        prev, alive = carry
        cand, use = xs  # i32[B, C], bool[B]
        cc = clip(cand)
        prev_c = clip(prev)
        parent_ok = jnp.where(
            prev[:, None] < 0,
            state.blocks.parent[cc] == INVALID,
            (state.blocks.parent[cc] == prev[:, None])
            & (state.blocks.parent_gen[cc] == state.blocks.generation[prev_c][:, None]),
        )
        good = (cand >= 0) & parent_ok
        first = jnp.argmax(good, axis=1)
        chosen = jnp.take_along_axis(cand, first[:, None], axis=1)[:, 0]
        alive = alive & good.any(axis=1) & use
        hit = jnp.where(alive, chosen, INVALID)
        return (hit, alive), hit

    init = (jnp.full((b,), INVALID, jnp.int32), jnp.ones((b,), bool))
    _, hits = lax.scan(step, init, (jnp.swapaxes(cands, 0, 1), usable.T))
    return hits.T


def chain_hashes(config, salts, blocks):
    """u32[B, M, 2] chained hashes of every block of a batch (blocks i32[B, M, P])."""
    root = salt_root(salts, config.hash_bits)

    def step(prev, blk):
        h = block_hash(prev, blk, config.hash_bits)
        return h, h

    _, hs = lax.scan(step, root, jnp.swapaxes(blocks, 0, 1))
    return jnp.swapaxes(hs, 0, 1)
