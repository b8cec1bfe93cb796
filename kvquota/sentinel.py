"""The one named sentinel for an empty slot (block-table entry, free-list slot, owner, ...).

No real block index has a special meaning: block 0 is an ordinary block. Kernels never
dereference a block-table entry past a sequence's length, so the sentinel is safe in a table.
"""

import jax.numpy as jnp

INVALID = -1


def is_valid(index):
    """True where `index` names a real slot."""
    return jnp.asarray(index) >= 0


def is_invalid(index):
    """True where `index` is the sentinel."""
    return jnp.asarray(index) < 0
