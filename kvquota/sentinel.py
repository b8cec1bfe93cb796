"""The one named sentinel for an empty slot (block-table entry, free-list slot, owner, ...).

No real block index has a special meaning: block 0 is an ordinary block. Kernels never
dereference a block-table entry past a sequence's length, so the sentinel is safe in a table.
"""

import jax.numpy as jnp

INVALID = -1

# The token id of a slot of a block compacted per layer and KV head (`Allocator.evict`'s default
# on a state with pages) whose heads keep different tokens: no one token id names the slot. Such
# a sequence cannot be recomputed from its token ids (admission refuses the id).
PER_HEAD_TOKEN = -2


def is_valid(index):
    """True where `index` names a real slot."""
    return jnp.asarray(index) >= 0


def is_invalid(index):
    """True where `index` is the sentinel."""
    return jnp.asarray(index) < 0
