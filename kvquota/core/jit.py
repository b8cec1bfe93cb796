"""`donating_jit`: how every state operation is compiled, and the state version it stamps.

Each module of `kvquota.core` defines its cores at module level, beside the function that
validates their inputs: `@donating_jit def admit_core(config, state, ...)`. The result compiles
the core twice from one definition: plain (the input state stays valid, which forks and "state
unchanged on error" rely on) and donating `state` (XLA updates the large per-block arrays in
place; the caller must not use the old state again: serving loops). Both fold the operation into `state.meta.version`, so a
reclaim plan can tell in O(1) whether the state it is applied to is the one it was made for.
"""

from __future__ import annotations

import functools
import inspect
import zlib

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = np.uint32(0x9E3779B9)


def _mix(x):
    """murmur3's 32-bit finalizer: every input bit moves every output bit (u32 arrays)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(leaf):
    """A leaf's values as flat u32 words (bools and ints by value, floats by their bits)."""
    x = jnp.asarray(leaf)
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return x.astype(jnp.uint32).reshape(-1)


def next_version(version, name: str, args) -> jax.Array:
    """u32[2]: `version` with the operation `name` and its inputs `args` folded in.

    Each word of each input is mixed with its position, summed per input, and chained into two
    independently seeded lanes, so a different operation, input or order gives another version
    (64 bits of mixing: a collision is vanishingly unlikely, though not impossible, as for any
    digest). Costs O(input size), never O(state size)."""
    lanes = []
    for lane, seed in enumerate((zlib.crc32(name.encode()), zlib.adler32(name.encode()))):
        h = _mix(version[lane] ^ jnp.uint32(seed))
        for i, leaf in enumerate(jax.tree_util.tree_leaves(args)):
            w = _words(leaf)
            pos = jnp.arange(w.size, dtype=jnp.uint32) * _GOLDEN + jnp.uint32(i + 2 * lane + 1)
            h = _mix(h + jnp.uint32(i + 1) * _GOLDEN + jnp.sum(_mix(w ^ _mix(pos)),
                                                               dtype=jnp.uint32))
        lanes.append(h)
    return jnp.stack(lanes)


class DonatingJit:
    """A state core `core(config, state, *args) -> (state, report)` compiled plain and donating.

    `config` and the names in `static_argnames` are static. Call it as `core(config, state, *args,
    donate=False)`; `.fn` is the versioned core before jit, to fuse into a larger jitted step
    (serving executors); `.jitted(donate)` is the compiled function itself (benchmarks lower it
    and read its HLO); `.static_argnums` are the static positions, config's included."""

    def __init__(self, core, static_argnames=()):
        names = ("config",) + tuple(static_argnames)
        params = list(inspect.signature(core).parameters)
        self.name = core.__name__.removesuffix("_core")
        self.static_argnums = tuple(params.index(n) for n in names)

        @functools.wraps(core)
        def versioned(config, state, *args, **kwargs):
            new, report = core(config, state, *args, **kwargs)
            meta = new.meta.replace(version=next_version(state.meta.version, self.name,
                                                         (args, kwargs)))
            return new.replace(meta=meta), report

        self.fn = versioned
        self._jitted = {donate: jax.jit(versioned, static_argnames=names,
                                        donate_argnames=("state",) if donate else ())
                        for donate in (False, True)}

    def __call__(self, config, state, *args, donate: bool = False):
        return self._jitted[bool(donate)](config, state, *args)

    def jitted(self, donate: bool = False):
        return self._jitted[bool(donate)]

    def __repr__(self):
        return f"donating_jit({self.name})"


def donating_jit(core=None, *, static_argnames=()):
    """`DonatingJit(core, static_argnames)`; also usable as a decorator with arguments."""
    if core is None:
        return functools.partial(DonatingJit, static_argnames=static_argnames)
    return DonatingJit(core, static_argnames)
