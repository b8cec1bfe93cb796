"""The prefix cache's hash index: open addressing with linear probing over arrays, in the state.

A prefix lookup must return the `lookup_candidates` (C) lowest-id blocks whose key (two hash
words and salt) matches, as a brute-force join over every block does, but in O(query blocks)
instead of O(pool). The index maps keys to block ids:

* `slots` i32[2H] holds block ids, EMPTY or TOMB (a removed entry). A key's *home* slot is a
  mix of its words and salt modulo H (a power of two >= 2 x pool-0 blocks); an entry sits at
  or after its home with no EMPTY slot in between (linear probing, Peterson 1957 / Knuth TAOCP
  vol. 3, 6.4). The physical length 2H means a probe never wraps: at most 3H/4 slots are ever
  non-EMPTY (`occupied`), so a probe from any home meets an EMPTY before the end.
* Every entry with a key lies between the key's home and the first EMPTY after it, because
  slots become EMPTY only in a rebuild. So a lookup probes from the home to that EMPTY and keeps
  the C smallest matching ids: exactly the brute force's candidates.
* `slot_of` i32[N_0] gives each indexed block's slot, so removal is an O(k) tombstone scatter.
* When tombstones would push `occupied` past 3H/4, the index is rebuilt from the hashed blocks
  in one sort (no sequential loop): sorted by home, entry i goes to i + max_{j <= i}(home_j - j),
  a valid linear-probing layout without tombstones. Live entries are at most N_0 <= H/2, so a
  rebuild happens at most once per N_0 / 4 insertions.

Only pool-0 blocks are ever hashed (full-precision device blocks are the only lookup targets), so
only they are indexed. This module holds the layout, the home slot and the rebuild; the jitted
maintenance and the probe live in `kvquota.core.index`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvquota.codes import INT32_MAX
from kvquota.hashing import _fmix32
from kvquota.sentinel import INVALID

EMPTY = INT32_MAX  # never used: ends every probe (ids are < EMPTY, so a scatter-min claims it)
TOMB = INT32_MAX - 1  # a removed entry: probes go past it, inserts may reuse it
_HOME_SEED = 0x3C6EF372  # digits of sqrt(3)'s fraction, as the salt's starting mix


@struct.dataclass
class PrefixIndex:
    """Hash index of the hashed (lookup-target) pool-0 blocks by (hash words, salt)."""

    slots: jax.Array  # i32[2H]  block id at each slot, or EMPTY / TOMB (H = home_count(config))
    slot_of: jax.Array  # i32[N_0]  slot of each indexed pool-0 block; INVALID when not indexed
    occupied: jax.Array  # i32[]  slots that are not EMPTY (live entries + tombstones)


def home_count(config) -> int:
    """H: home slots, the smallest power of two >= 2 x pool-0 blocks (so live entries fill at
    most half of them)."""
    return max(8, 1 << (2 * config.num_blocks - 1).bit_length())


def max_occupied(config) -> int:
    """Most non-EMPTY slots an insert may leave (3H/4); past it the index is rebuilt."""
    return 3 * home_count(config) // 4


def home(words, salt, homes: int, xp=jnp):
    """i32[...]: home slot of keys (words u32[..., 2], salt u32[...]) among `homes` (a power of
    two). MurmurHash3's fmix32 (Appleby) chained over salt, word 0 and word 1."""
    words = xp.asarray(words).astype(xp.uint32)
    h = _fmix32(xp.asarray(salt).astype(xp.uint32) ^ xp.uint32(_HOME_SEED), xp)
    h = _fmix32(h ^ words[..., 0], xp)
    h = _fmix32(h ^ words[..., 1], xp)
    return (h & xp.uint32(homes - 1)).astype(xp.int32)


def rebuild(config, hashed, block_hash, block_salt, xp=jnp) -> dict:
    """The index of every hashed pool-0 block (`hashed` bool[NB], `block_hash` u32[NB, 2],
    `block_salt` u32[NB]), without tombstones: the fields of a PrefixIndex as a dict.

    Sorted by home (ties by id), entry i is placed at i + max_{j <= i}(home_j - j): positions
    strictly increase, and the entries from the maximising j to i fill consecutive slots from
    home_j <= home_i, so no EMPTY lies between an entry's home and its slot. O(N_0 log N_0)."""
    n0, hh = config.num_blocks, home_count(config)
    h = home(block_hash[:n0], block_salt[:n0], hh, xp)
    key = xp.where(hashed[:n0], h, 2 * hh)  # unhashed blocks sort last
    if xp is np:
        order = np.argsort(key, kind="stable").astype(np.int32)
    else:
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sorted_home = key[order]
    i = xp.arange(n0, dtype=xp.int32)
    live = sorted_home < hh
    gap = xp.where(live, sorted_home - i, -n0)
    cummax = np.maximum.accumulate(gap) if xp is np else jax.lax.cummax(gap)
    pos = (i + cummax).astype(xp.int32)
    n_live = live.sum().astype(xp.int32)
    if xp is np:
        slots = np.full(2 * hh, EMPTY, np.int32)
        slots[pos[live]] = order[live]
        slot_of = np.full(n0, INVALID, np.int32)
        slot_of[order[live]] = pos[live]
        return dict(slots=slots, slot_of=slot_of, occupied=np.int32(n_live))
    slots = jnp.full(2 * hh, EMPTY, jnp.int32).at[jnp.where(live, pos, 2 * hh)].set(
        order, mode="drop")
    slot_of = jnp.full(n0, INVALID, jnp.int32).at[jnp.where(live, order, n0)].set(
        pos, mode="drop")
    return dict(slots=slots, slot_of=slot_of, occupied=n_live)


def init_index(config) -> dict:
    """The fields of an empty index (NumPy arrays), for `init_state`."""
    return dict(slots=np.full(2 * home_count(config), EMPTY, np.int32),
                slot_of=np.full(config.num_blocks, INVALID, np.int32), occupied=np.int32(0))
