"""The state and the model across devices with `jax.sharding` (DESIGN.md "Scale").

Layout. A mesh has two named axes, `KV_AXIS` ("kv") and `SEQ_AXIS` ("seq"):

* every page array of every pool (`state.pages`: pool 0, the compressed pools' `QuantizedPages`
  arrays, the host pool in `pinned_host` memory) is split over its KV-head axis (axis 1 of
  `[L, Hkv, N, ...]`) on "kv" and replicated over "seq": a device holds Hkv / kv heads of every
  block, so no op ever needs another device's pages;
* every other leaf (blocks, free lists, sequences, tenants, and any field added later) is
  replicated, `P()`. Both rules are read off the pytree's paths (`pages` or not), not a list of
  fields, so a new metadata field is replicated without a change here. `init_sharded` makes an
  empty state so (each device allocating only its shards), `shard_state` places one;
* the model (`shard_params`) is tensor-parallel over heads on "kv": Q/K/V projections split by
  output heads, O by input heads, the MLP by its inner width (when "kv" divides it); embeddings,
  norms and the LM head are replicated;
* under `use_mesh(mesh)` the model's paged-attention kernel calls and its page writes run in
  `shard_map` (`sharded_attention`, `sharded_write`): the kernel sees the local heads, and the
  decode rows (or a prefill's query chunk when the batch does not divide) are data-parallel over
  "seq". The rest of the model is left to XLA's automatic partitioning of the sharded weights.
  Without a mesh in context nothing of this is traced: the model runs exactly as before.

The allocator ops need no mesh in context: jit keeps the replicated metadata replicated and the
pages' head split (no op mixes heads). The model does: XLA's partitioner has no rule for a
Pallas call and would replicate (gather) the pages it reads. `collectives` and `page_collectives`
read a compiled program's HLO to check that no page data moves between devices.

Multi-host. There is no distribution layer here: start every process with
`jax.distributed.initialize()` (coordinator address, process count and id from its arguments or
the cluster's environment), build the same mesh on every process over the global device list,
`make_mesh(kv=..., seq=..., devices=jax.devices())`, and run the same program with the same
inputs on every process (SPMD). Metadata is replicated on every device of every host, so the
facade's host reads work on each process; keep a "kv" group inside one host ("kv" is the minor
axis of `jax.devices()`, which lists devices host by host) so that each process holds whole
pages too (`check_invariants` reads them). Tested on 8 forced CPU devices of one process
(`tests/test_sharding.py`), and as 2 JAX processes on one machine (`experiments/multihost.py`,
`docs/multihost.md`); not on GPUs nor on separate machines.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from kvquota.errors import ShardingError
from kvquota.pages import host_sharding, init_pages

__all__ = [
    "KV_AXIS", "SEQ_AXIS", "ShardingError", "make_mesh", "check_mesh", "use_mesh", "context_mesh",
    "state_shardings", "init_sharded", "shard_state", "param_specs", "shard_params",
    "sharded_attention", "sharded_write", "replicated", "collectives", "page_collectives",
    "local_bytes",
]

KV_AXIS = "kv"
SEQ_AXIS = "seq"
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


# --------------------------------------------------------------------------------------------
# Meshes.


def make_mesh(kv: int = 1, seq: int = 1, devices=None) -> Mesh:
    """A `("seq", "kv")` mesh of `seq x kv` devices (`devices`: default all of `jax.devices()`,
    which must number exactly kv * seq), automatic axis types; "kv" is the minor axis, so the
    devices sharing a sequence's heads are neighbours."""
    for name, size in (("kv", kv), ("seq", seq)):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ShardingError(f"mesh axis {name!r} must be a positive integer, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    if len({id(d) for d in devices}) != len(devices):
        raise ShardingError("a device appears twice in the mesh's device list")
    if kv * seq != len(devices):
        raise ShardingError(f"mesh kv={kv} x seq={seq} needs {kv * seq} devices, "
                            f"{len(devices)} given")
    return Mesh(np.asarray(devices, dtype=object).reshape(seq, kv), (SEQ_AXIS, KV_AXIS),
                axis_types=(AxisType.Auto, AxisType.Auto))


def check_mesh(mesh, kv_heads: int | None = None) -> Mesh:
    """Raise ShardingError unless `mesh` is a `jax.sharding.Mesh` with a "kv" axis (and
    optionally "seq"), automatic axis types, and "kv" dividing `kv_heads` when given."""
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if KV_AXIS not in mesh.axis_names:
        raise ShardingError(f"mesh axes {mesh.axis_names} lack {KV_AXIS!r} (make_mesh builds one)")
    if any(t != AxisType.Auto for t in mesh.axis_types):
        raise ShardingError(f"mesh axis types {mesh.axis_types} must all be AxisType.Auto "
                            "(make_mesh builds one)")
    if kv_heads is not None and kv_heads % mesh.shape[KV_AXIS]:
        raise ShardingError(f"{kv_heads} KV heads do not split over the mesh's "
                            f"{mesh.shape[KV_AXIS]}-way {KV_AXIS!r} axis")
    return mesh


def use_mesh(mesh: Mesh):
    """Context manager putting `mesh` in context (`jax.set_mesh`): model calls traced inside
    it run their attention in `shard_map` over the mesh. jit caches key on it."""
    check_mesh(mesh)
    if hasattr(jax, "set_mesh"):
        return jax.set_mesh(mesh)
    return jax.sharding.use_mesh(mesh)  # older jax


def context_mesh():
    """The (abstract) mesh in context when it has a "kv" axis, else None (no sharding)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or KV_AXIS not in mesh.axis_names:
        return None
    return mesh


def _axis_size(mesh, name: str) -> int:
    return mesh.shape[name] if name in mesh.axis_names else 1


# --------------------------------------------------------------------------------------------
# The state and the weights.


def _is_page_path(path) -> bool:
    first = path[0] if path else None
    return getattr(first, "name", None) == "pages"


def _leaf_sharding(path, leaf, mesh, memory_kind):
    """Page leaves (rank >= 2, KV heads at axis 1) split on "kv"; every other leaf replicated."""
    if _is_page_path(path) and len(leaf.shape) >= 2:
        return NamedSharding(mesh, P(None, KV_AXIS), memory_kind=memory_kind)
    return NamedSharding(mesh, P(), memory_kind=memory_kind)


def _page_heads(tree) -> set[int]:
    return {int(leaf.shape[1]) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if _is_page_path(path) and len(leaf.shape) >= 2}


def _pool_index(path) -> int | None:
    return getattr(path[1], "idx", None) if _is_page_path(path) and len(path) > 1 else None


def state_shardings(config, mesh: Mesh):
    """A KVState-shaped pytree of `NamedSharding` for a state of `config` (see the module
    docstring); the host pool's leaves in `pinned_host` memory where the device offers it."""
    from kvquota.state import init_state

    check_mesh(mesh, config.model.num_kv_heads)
    shapes = jax.eval_shape(lambda: init_state(config))
    host = "pinned_host" if host_sharding() is not None else None

    def one(path, leaf):
        is_host = config.host_pool is not None and _pool_index(path) == config.host_pool
        return _leaf_sharding(path, leaf, mesh, host if is_host else None)

    return jax.tree_util.tree_map_with_path(one, shapes)


def init_sharded(config, mesh: Mesh):
    """An empty state of `config` made on `mesh`: equal to `shard_state(init_state(config),
    mesh)`, but each device allocates only its own shard of the pages (a pool too large for one
    device never exists whole). The metadata is made once, then replicated."""
    from kvquota.state import init_state

    shardings = state_shardings(config, mesh)
    state = init_state(dataclasses.replace(config, with_pages=False))
    state = state.update(head_mass=jnp.zeros(  # the pageless config keeps no per-head mass
        state.blocks.attn_mass.shape + config.head_mass_shape, jnp.float32))
    shapes = jax.eval_shape(lambda: init_pages(config))
    zeros = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                    out_shardings=shardings.pages)
    return jax.device_put(state.replace(pages=zeros()), shardings)


def shard_state(state, mesh: Mesh):
    """`state` placed on `mesh` (`jax.device_put`, every leaf keeping its memory kind): pages
    split over KV heads, everything else replicated. The input state stays valid."""
    heads = _page_heads(state)
    check_mesh(mesh, min(heads) if heads else None)
    if len(heads) > 1:
        raise ShardingError(f"page arrays disagree on their KV-head axis: {sorted(heads)}")

    def one(path, leaf):
        kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None)
        return _leaf_sharding(path, leaf, mesh, kind)

    return jax.device_put(state, jax.tree_util.tree_map_with_path(one, state))


def param_specs(params, mesh: Mesh):
    """PartitionSpecs of `kvquota.model` params (see `shard_params`), by each leaf's path."""
    kv = _axis_size(check_mesh(mesh), KV_AXIS)
    # module -> (axis to split, for kernels [L, in, out]; biases [L, out] split their last axis)
    split = {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 1,
             "gate_proj": 2, "up_proj": 2, "down_proj": 1}

    def spec(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        module = names[-2] if len(names) >= 2 else None
        if "layers" not in names or module not in split:
            return P()  # embeddings, norms, the LM head: replicated
        axis = split[module] if names[-1] == "kernel" else leaf.ndim - 1
        if leaf.shape[axis] % kv:  # an MLP width "kv" does not divide: replicated
            return P()
        return P(*(KV_AXIS if i == axis else None for i in range(leaf.ndim)))

    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params, mesh: Mesh, config=None):
    """Model params placed tensor-parallel on "kv" (replicated over "seq"): Q/K/V kernels and
    biases split by output heads, O by input heads, gate/up/down by the MLP's inner width when
    "kv" divides it; embeddings, norms and the LM head replicated. `config` (a ModelConfig,
    optional) checks that "kv" divides its KV heads."""
    check_mesh(mesh, None if config is None else config.num_kv_heads)
    specs = param_specs(params, mesh)
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                               is_leaf=lambda x: isinstance(x, P)))


# --------------------------------------------------------------------------------------------
# The model's kernel calls and page writes under the mesh in context.


def _shard_map(fn, mesh, in_specs, out_specs):
    """`jax.shard_map` (jax >= 0.6) or `jax.experimental.shard_map.shard_map`, unchecked
    replication (the Pallas kernels carry no replication rules)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map  # pragma: no cover - old jax

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def sharded_attention(kernel, q, k_pages, v_pages, block_tables, lengths, q_start=None, *,
                      mesh, layer, **kwargs):
    """`kernel` (`kernels.paged_attention.decode`, or `prefill` when `q_start` is given) run in
    `shard_map` over `mesh`: KV heads on "kv" (q's heads split with their KV heads: query head h
    belongs to KV head h // G, so contiguous splits match), rows on "seq" when the batch divides,
    else (prefill) the query chunk when its length divides, else rows replicated over "seq".

    q [B, Hq, D] (decode) or [B, T, Hq, D]; pages [L, Hkv, ...] of one pool read at `layer`;
    tables i32[B, M], lengths/q_start i32[B]. Returns what `kernel` returns.
    """
    prefill = q_start is not None
    kv, seq = _axis_size(mesh, KV_AXIS), _axis_size(mesh, SEQ_AXIS)
    hkv = jax.tree_util.tree_leaves(k_pages)[0].shape[1]
    if hkv % kv or q.shape[-2] % kv:
        raise ShardingError(f"{hkv} KV heads ({q.shape[-2]} query heads) do not split over "
                            f"the mesh's {kv}-way {KV_AXIS!r} axis")
    rows = SEQ_AXIS if seq > 1 and q.shape[0] % seq == 0 else None
    chunk = SEQ_AXIS if prefill and rows is None and seq > 1 and q.shape[1] % seq == 0 else None
    mass = kwargs.get("mass")
    want_aux = kwargs.get("return_lse", False) or mass is not None
    q_spec = P(rows, chunk, KV_AXIS, None) if prefill else P(rows, KV_AXIS, None)
    lse_spec = P(rows, chunk, KV_AXIS) if prefill else P(rows, KV_AXIS)
    page_spec = P(None, KV_AXIS)

    def local(q, k, v, tables, lens, start, layer):
        if rows is not None:  # this shard's rows of the (replicated) tables
            at = jax.lax.axis_index(SEQ_AXIS) * q.shape[0]
            tables, lens, start = (jax.lax.dynamic_slice_in_dim(x, at, q.shape[0])
                                   for x in (tables, lens, start))
        if chunk is not None:  # this shard's query rows start further into the chunk
            start = start + jax.lax.axis_index(SEQ_AXIS) * q.shape[1]
        args = (q, k, v, tables, lens) + ((start,) if prefill else ())
        res = kernel(*args, layer=layer, **kwargs)
        if not want_aux:
            return (res,)
        out, aux = res
        parts = (out, aux.lse)
        if mass is not None:  # a prefill's mass sums over query rows: add the chunk's shards
            parts += (jax.lax.psum(aux.mass, SEQ_AXIS) if chunk is not None else aux.mass,)
        return parts

    out_specs = (q_spec,) + ((lse_spec,) if want_aux else ()) + (
        (P(rows, KV_AXIS, None),) if mass is not None else ())
    start = q_start if prefill else jnp.zeros_like(lengths)
    # The split over "seq" stays inside: every input and output is replicated over "seq"
    # outside (tables, lengths and starts sliced inside; q and the results constrained), else
    # XLA spreads the row split to the metadata reads and scatters around the call (adding
    # `attn_mass` shards up by an all-reduce of [NB, P], for one).
    fn = _shard_map(local, mesh, (q_spec, page_spec, page_spec, P(), P(), P(), P()), out_specs)
    q = _only_kv(q, mesh, q_spec)
    parts = fn(q, k_pages, v_pages, block_tables, lengths, start, layer)
    parts = tuple(_only_kv(x, mesh, spec) for x, spec in zip(parts, out_specs))
    if not want_aux:
        return parts[0]
    from kernels.paged_attention import AttentionAux

    return parts[0], AttentionAux(lse=parts[1], mass=parts[2] if mass is not None else None)


def _only_kv(x, mesh, spec):
    """`x` constrained to `spec` with every "seq" entry dropped (replicated over "seq")."""
    kept = P(*(None if axis == SEQ_AXIS else axis for axis in spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, kept))


def sharded_write(write, pages, layer, block, offset, values, *, mesh):
    """`write(pages, layer, block, offset, values) -> pages` run in `shard_map`: each device
    scatters its own heads of every row (values [B, T, Hkv, D] split on "kv", rows replicated
    so the copies along "seq" stay equal). pages [L, Hkv, N, P, D]; block/offset i32[B, T]."""
    page_spec = P(None, KV_AXIS)
    fn = _shard_map(write, mesh, (page_spec, P(), P(), P(), P(None, None, KV_AXIS, None)),
                    page_spec)
    return fn(pages, layer, block, offset, values)


def replicated(x):
    """`x` constrained to be replicated over the mesh in context (no-op without one): the step's
    attention mass, so that adding it into the replicated per-block `attn_mass` needs no
    collective on that [NB, P] array (XLA would otherwise scatter shards and all-reduce it)."""
    mesh = context_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


# --------------------------------------------------------------------------------------------
# Reading a compiled program.

_SHAPE = re.compile(r"\b(?:pred|[fsu]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo_text: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Every cross-device collective of a compiled HLO text (`jit(f).lower(...).compile()
    .as_text()`), as (op name, its result shapes); async `-start` forms count once."""
    found = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m:
            shapes = [tuple(int(x) for x in s.split(",") if x) for s in _SHAPE.findall(m.group(1))]
            found.append((m.group(2), shapes))
    return found


def page_collectives(hlo_text: str, config) -> list[tuple[str, list[tuple[int, ...]]]]:
    """The collectives of `hlo_text` that move page data of a state of `config`: a result with a
    pool's block count as a dimension (a page array, or a per-block metadata array), or ending
    in (tokens per sequence, head_dim) (pages gathered along a block table). Give test states a
    block count no other dimension shares."""
    blocks = set(config.pool_sizes) | {config.total_blocks}
    tail = (config.max_tokens_per_seq, config.model.head_dim)

    def touches(shape):
        return bool(blocks & set(shape)) or tuple(shape[-2:]) == tail

    return [(op, shapes) for op, shapes in collectives(hlo_text) if any(map(touches, shapes))]


def local_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of arrays (its first device's shards)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shard = leaf.addressable_shards[0].data
        total += math.prod(shard.shape) * shard.dtype.itemsize
    return total
