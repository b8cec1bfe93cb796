"""Chained block hashes and tenant salts of the prefix cache.

As in vLLM's prefix cache: h_k = f(h_{k-1}, tokens of block k), the chain seeded from the tenant's
salt, so tenants with different salts never share a block. Each of the two 32-bit words runs its
own chain with its own seed (jax is 32-bit by default, and one word collides ~128 times over 2^20
blocks); mixing uses the MurmurHash3 32-bit finalizer (Appleby), a bijection on uint32.

This is not a keyed cryptographic hash: a hit is only accepted after the token ids, salt and
parent block are checked, so a collision can cost a miss, never a wrong block.

Every function takes `xp` (jax.numpy or numpy) so the invariant checker recomputes the very same
hashes on the host.
"""

import jax.numpy as jnp
import numpy as np

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
