"""The one jit table: every core compiled twice from one definition, plain and donating `state`.

`run(name, config, state, *args, donate=False)` is the single hand-off from the facade. Without
donation (the default) the input state stays valid, which forks and "state unchanged on error"
rely on; with `donate=True` XLA updates the large per-block arrays in place and the caller must
not use the old state again (serving loops).
"""

from __future__ import annotations

import functools

import jax

from kvquota.core import (admission, cold, compress, evict, lifecycle, pins, release,
                          statistics, tenants, tiers)

# name -> (core, static argument positions besides the config at 0)
_CORES = {
    "admit": (admission.admit, ()),
    "append": (admission.append, ()),
    "fork": (admission.fork, ()),
    "pin": (pins.pin, ()),
    "unpin": (pins.unpin, ()),
    "drop": (release.drop_sequences, (5, 6)),  # unpin_slots and cols size arrays
    "set_tenant": (tenants.set_tenant, ()),
    "offload": (tiers.offload, ()),
    "restore": (tiers.restore, ()),
    "record_mass": (statistics.record_mass, ()),
    "compress": (compress.compress, (6,)),
    "evict_tokens": (evict.evict_tokens, ()),
    "evict_blocks": (evict.evict_blocks, ()),  # the target pool fixes its page layout
    "drop_cold": (cold.drop_cold, (3,)),  # slots sizes the LRU selection
    "set_status": (lifecycle.set_status, ()),
    "preempt": (lifecycle.preempt, ()),
    "recycle": (lifecycle.recycle, ()),
    "set_growing": (lifecycle.set_growing, ()),
}


def _variants(fn, extra_static):
    statics = (0,) + tuple(extra_static)
    plain = jax.jit(fn, static_argnums=statics)
    donated = jax.jit(fn, static_argnums=statics, donate_argnums=(1,))
    functools.update_wrapper(donated, fn)
    return {False: plain, True: donated}


_TABLE = {name: _variants(fn, extra) for name, (fn, extra) in _CORES.items()}
# Read-only queries (nothing to donate): the ledger view and the facade's room checks, which
# count with the very rule the core applies.
ledger = jax.jit(tenants.ledger, static_argnums=(0,))
compress_count = jax.jit(compress.count, static_argnums=(0,))
evict_fresh_count = jax.jit(evict.fresh_count, static_argnums=(0,))
evict_block_fresh_count = jax.jit(evict.fresh_block_count, static_argnums=(0,))
leaves_orphans = jax.jit(release.leaves_orphans, static_argnums=(0, 3))  # free's heirs needed?
own_count = jax.jit(lambda config, state, seq_ids, pool: tiers.own_blocks(
    config, state, *release.seq_rows(state, seq_ids), pool).sum(axis=1), static_argnums=(0, 3))


def run(name: str, config, state, *args, donate: bool = False):
    """Call core `name` as `core(config, state, *args) -> (state, report)`."""
    return _TABLE[name][bool(donate)](config, state, *args)


def compiled(name: str, donate: bool = False):
    """The jitted function itself (for benchmarks that lower it, or inspect its HLO)."""
    return _TABLE[name][bool(donate)]
