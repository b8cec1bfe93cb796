"""Private jitted cores of the state operations, one concept per module, behind one jit table.

Inputs are assumed valid (the facade in `kvquota.allocator` checks them first); padding rows use
INVALID. Each core only touches the rows it is given: updates are scatters of O(batch x MB)
elements, so with the state donated XLA updates the large per-block arrays in place.
"""

from kvquota.core.cold import ColdReport, allocatable
from kvquota.core.jit import (
    compiled,
    compress_count,
    evict_block_fresh_count,
    evict_fresh_count,
    ledger,
    leaves_orphans,
    own_count,
    run,
)

__all__ = ["ColdReport", "allocatable", "compiled", "compress_count", "evict_block_fresh_count",
           "evict_fresh_count", "leaves_orphans", "ledger", "own_count", "run"]
