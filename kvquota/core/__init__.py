"""The state operations, one concept per module: each jitted core (built by
`kvquota.core.jit.donating_jit`) beside the function that validates its inputs.

A core assumes valid inputs (padding rows use INVALID) and only touches the rows it is given:
updates are scatters of O(batch x MB) elements, so with the state donated XLA updates the large
per-block arrays in place. The validating function checks the inputs against the config and the
state first and raises a typed error, so on error the state is untouched; `kvquota.allocator`
delegates to it.
"""

from kvquota.core.cold import ColdReport, allocatable

__all__ = ["ColdReport", "allocatable"]
