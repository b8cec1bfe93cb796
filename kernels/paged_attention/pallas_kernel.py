"""Pallas (Triton-style GPU) paged attention: one kernel for decode and chunked prefill.

Decode is prefill with T = 1 and q_start = length - 1, so one flash-attention kernel serves both.
Query heads of a KV group are folded into "rows" ([B, Hkv, R, D], row r = t * group + h), so a
GQA group shares every K/V tile it loads (as the JAX peer kernel
`jax.experimental.pallas.ops.gpu.paged_attention` does with its `block_h` heads).

Grid (B, Hkv, row blocks, k_splits). Each program walks its split's pages `pages_per_block` at a
time with the online softmax of flash attention (Dao et al., 2022), reading only the pages below
the last position its rows can see: table entries past that are never dereferenced (loads are
masked and the index clamped), so they may hold the sentinel. Splits write unnormalized partial
results (o, running max, running sum) that the wrapper merges, as in flash-decoding.

Quantized pages are dequantized inside the kernel by `kernels.quantization.dequantize_tile`,
which uses only Triton-lowerable ops (shifts, two-way joins, power-of-two reshapes).

A pool of every layer (`[L, Hkv, N, P, D]`, QuantizedPages with a leading [L] axis) is read at
`layer` without slicing it: the page operands' BlockSpecs keep the whole layer axis of one KV
head (on GPU a block is only a base pointer, nothing is copied) and the layer, an i32[1] operand,
is one more index of each page gather, an offset of the load pointers. An index map cannot take
it: index maps are traced without operands, and the Triton lowering has no scalar prefetch.

Attention mass needs the final lse of every row, so it is a second kernel (`_mass_kernel`) that
re-reads K once the lse is known; it runs only when mass is asked for.

Lowering notes (Triton): every block dim is a power of two (rows padded to >= 16, keys per block
>= 16, head_dim and page size must be powers of two); all dots are 2-D; the page loop has a
data-dependent trip count (scf.while) but no data-dependent shapes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.paged_attention.layered import layer_index, page_shape, pool_layers
from kernels.paged_attention.reference import AttentionAux
from kernels.quantization import QuantizedPages, dequantize_tile

NEG_INF = float("-inf")


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# ---------------------------------------------------------------------------------------------
# Page operands: a plain [Hkv, N, P, D] array or the 2-3 arrays of a QuantizedPages.


def _page_operands(pages):
    """-> (arrays, spec or None): the pallas_call inputs standing for one of K or V."""
    if isinstance(pages, QuantizedPages):
        arrays = [pages.data, pages.scales] + ([pages.zeros] if pages.spec.asymmetric else [])
        return arrays, pages.spec
    return [pages], None


def _page_block_specs(arrays, head_axis_map, layered=False):
    """Each page array: the whole of one KV head (pages are gathered inside the kernel); of a
    pool with a layer axis, one KV head of every layer (the layer is indexed in the gather)."""
    if not layered:
        return [pl.BlockSpec((None, *a.shape[1:]), head_axis_map) for a in arrays]
    layer_map = lambda *ids: (0, *head_axis_map(*ids))
    return [pl.BlockSpec((a.shape[0], None, *a.shape[2:]), layer_map) for a in arrays]


def _load_tile(refs, spec, idx, page_ok, dtype, layer=None):
    """Loads pages `idx` of one KV head -> [pages, P, D] values in `dtype`.

    refs: plain: ([N, P, D],); quantized: ([N, P, D*bits/8] codes, [N, P|1, D/group|D] scales,
    optionally zero points like scales); with `layer` (an i32 scalar), each with a leading [L]
    axis, read at that layer. Pages with page_ok False are not read (masked load).
    """

    def load(ref):
        # All-array indices (a gather the Triton lowering turns into pointer offsets, and that
        # interpret mode can discharge), so the load can be masked page by page.
        shape = (idx.shape[0], *ref.shape[-2:])  # [pages, P | 1, last]
        slot = lax.broadcasted_iota(jnp.int32, (1, shape[1], 1), 1)
        lane = lax.broadcasted_iota(jnp.int32, (1, 1, shape[2]), 2)
        axes = (idx.reshape(-1, 1, 1), slot, lane)
        if layer is not None:  # a scalar index: the same offset for every loaded element
            axes = (layer,) + axes
        mask = jnp.broadcast_to(page_ok.reshape(-1, 1, 1), shape)
        return plgpu.load(ref.at[axes], mask=mask, other=jnp.zeros((), ref.dtype))

    if spec is None:
        return load(refs[0]).astype(dtype)
    data = load(refs[0])
    scales = load(refs[1])
    zeros = load(refs[2]) if spec.asymmetric else None
    return dequantize_tile(data, scales, zeros, spec, dtype)


# ---------------------------------------------------------------------------------------------
# The attention kernel.


def _dot(a, b, b_contract: int):
    """2-D dot with f32 accumulation; HIGHEST keeps f32 inputs out of TF32 on GPU."""
    return lax.dot_general(a, b, (((1,), (b_contract,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _row_positions(row0, block_r, group, num_t, q_start, length):
    """Cache position of each of the block's rows, -1 for padding rows -> i32[block_r]."""
    rows = row0 + lax.broadcasted_iota(jnp.int32, (block_r,), 0)
    t = lax.div(rows, jnp.int32(group))
    pos = q_start + t
    valid = (t < num_t) & (pos < length) & (pos >= 0)
    return jnp.where(valid, pos, -1)


def _visible_end(row0, block_r, group, num_t, q_start, length):
    """One past the last cache position any row of the block can see (>= 0)."""
    t_last = jnp.minimum(lax.div(row0 + (block_r - 1), jnp.int32(group)), num_t - 1)
    return jnp.maximum(jnp.minimum(q_start + t_last + 1, length), 0)


def _attention_kernel(
    lengths_ref,  # i32[1]: this sequence's length
    q_start_ref,  # i32[1]: cache position of the chunk's first query
    block_tables_ref,  # i32[M_pad]: this sequence's block table
    q_ref,  # [block_r, D]: query rows of one KV group
    *refs,  # [layer_ref i32[1] when layered], K page refs, V page refs (see _load_tile), then
    #   outputs: o_ref f32[block_r, D] (unnormalized), m_ref f32[block_r], l_ref f32[block_r]
    n_k_refs: int,
    k_spec,
    v_spec,
    group: int,
    num_t: int,
    page_size: int,
    pages_per_block: int,
    pages_per_split: int,
    sm_scale: float,
    layered: bool = False,
):
    layer = refs[0][0] if layered else None
    refs = refs[1:] if layered else refs
    k_refs, v_refs = refs[:n_k_refs], refs[n_k_refs:-3]
    o_ref, m_ref, l_ref = refs[-3:]
    block_r, head_dim = q_ref.shape
    block_k = pages_per_block * page_size
    row0 = pl.program_id(2) * block_r
    split = pl.program_id(3)
    length = lengths_ref[0]
    q_start = q_start_ref[0]

    pos = _row_positions(row0, block_r, group, num_t, q_start, length)
    n_pages = pl.cdiv(_visible_end(row0, block_r, group, num_t, q_start, length), page_size)
    first = split * pages_per_split
    last = jnp.minimum(first + pages_per_split, n_pages)
    n_iter = pl.cdiv(jnp.maximum(last - first, 0), pages_per_block)
    q = q_ref[...]

    def body(j, carry):
        o, m, l = carry
        page0 = first + j * pages_per_block
        page_ok = page0 + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0) < last
        idx = jnp.where(page_ok, block_tables_ref[pl.ds(page0, pages_per_block)], 0)
        k = _load_tile(k_refs, k_spec, idx, page_ok, q.dtype, layer).reshape(block_k, head_dim)
        s = _dot(q, k, 1)
        s = s * sm_scale
        key_pos = page0 * page_size + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        s = jnp.where(key_pos[None, :] <= pos[:, None], s, NEG_INF)  # pos = -1: row sees nothing
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new > NEG_INF, m_new, 0.0)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        v = _load_tile(v_refs, v_spec, idx, page_ok, q.dtype, layer).reshape(block_k, head_dim)
        # Zero V past the length before the product: tail slots may hold NaN and 0 * NaN = NaN.
        v = jnp.where((key_pos < length)[:, None], v, jnp.zeros_like(v))
        pv = _dot(p.astype(v.dtype), v, 0)
        return alpha[:, None] * o + pv, m_new, alpha * l + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((block_r, head_dim), jnp.float32),
        jnp.full((block_r,), NEG_INF, jnp.float32),
        jnp.zeros((block_r,), jnp.float32),
    )
    o, m, l = lax.fori_loop(0, n_iter, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _mass_kernel(
    lengths_ref,  # i32[1]
    q_start_ref,  # i32[1]
    block_tables_ref,  # i32[M_pad]
    q_ref,  # [R_pad, D]: all query rows of one KV group
    lse_ref,  # f32[R_pad]: final log-sum-exp of each row
    *refs,  # [layer_ref i32[1] when layered], K page refs, then mass_ref f32[block_k]: mass
    #   of this block of key slots
    k_spec,
    group: int,
    num_t: int,
    page_size: int,
    pages_per_block: int,
    block_r: int,
    sm_scale: float,
    layered: bool = False,
):
    layer = refs[0][0] if layered else None
    refs = refs[1:] if layered else refs
    k_refs, mass_ref = refs[:-1], refs[-1]
    rows_total, head_dim = q_ref.shape
    block_k = pages_per_block * page_size
    length = lengths_ref[0]
    q_start = q_start_ref[0]
    page0 = pl.program_id(2) * pages_per_block
    n_pages = pl.cdiv(_visible_end(0, rows_total, group, num_t, q_start, length), page_size)
    page_ok = page0 + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0) < n_pages
    idx = jnp.where(page_ok, block_tables_ref[pl.ds(page0, pages_per_block)], 0)
    k = _load_tile(k_refs, k_spec, idx, page_ok, q_ref.dtype, layer).reshape(block_k, head_dim)
    key_pos = page0 * page_size + lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def body(i, acc):
        row0 = i * block_r
        q = q_ref[pl.ds(row0, block_r), :]
        lse = lse_ref[pl.ds(row0, block_r)]
        pos = _row_positions(row0, block_r, group, num_t, q_start, length)
        s = _dot(q, k, 1)
        s = s * sm_scale
        lse_safe = jnp.where(lse > NEG_INF, lse, 0.0)
        visible = key_pos[None, :] <= pos[:, None]
        p = jnp.where(visible, jnp.exp(jnp.where(visible, s, NEG_INF) - lse_safe[:, None]), 0.0)
        return acc + jnp.sum(p, axis=0)

    acc = lax.fori_loop(0, rows_total // block_r, body, jnp.zeros((block_k,), jnp.float32))
    mass_ref[...] = acc / group


# ---------------------------------------------------------------------------------------------
# Wrapper.


def _default_pages_per_block(page_size: int) -> int:
    """Pages per inner step: 64 keys a step (>= 16, the smallest Triton dot)."""
    return max(1, 64 // page_size)


@functools.partial(
    jax.jit,
    static_argnames=(
        "group", "num_t", "sm_scale", "mass", "block_r", "pages_per_block", "k_splits",
        "num_warps", "num_stages", "interpret",
    ),
)
def paged_attention_rows_pallas(
    q_rows: jax.Array,  # [B, Hkv, R, D]
    k_pages,  # [Hkv, N, P, D] or QuantizedPages; with `layer`: [L, Hkv, N, P, D]
    v_pages,  # like k_pages
    block_tables: jax.Array,  # i32[B, M]
    lengths: jax.Array,  # i32[B]
    q_start: jax.Array,  # i32[B]
    layer=None,  # None, or i32[] (traced allowed): the layer of pools with a layer axis
    *,
    group: int,
    num_t: int,
    sm_scale: float,
    mass: str | None,
    block_r: int,
    pages_per_block: int,
    k_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """Rows -> (out f32[B, Hkv, R, D], lse f32[B, Hkv, R], per-token mass f32[B, Hkv, M*P]).

    With `layer`, K and V are pools with a layer axis read at that layer (clamped into range).
    """
    b, hkv, r, d = q_rows.shape
    m = block_tables.shape[1]
    page_size = page_shape(k_pages)[2]
    num_layers = pool_layers(k_pages)
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if (pool_layers(pages) is None) != (layer is None):
            raise ValueError(f"{name}: a [L, Hkv, N, P, D] pool goes with layer= and one "
                             f"layer's [Hkv, N, P, D] pages without it (layer={layer!r})")
    layered = layer is not None
    # The layer as an i32[1] operand read by every program (one block, index 0).
    layer_ops = [layer_index(layer, num_layers).reshape(1)] if layered else []
    for name, n in (("head_dim", d), ("page size", page_size), ("block_r", block_r),
                    ("pages_per_block", pages_per_block)):
        if not _is_pow2(n):
            raise ValueError(f"the Pallas kernel needs a power-of-two {name}, got {n}")
    if pages_per_block * page_size < 16 or block_r < 16:
        raise ValueError(f"Triton dots need >= 16 rows and keys: block_r={block_r}, "
                         f"keys per block={pages_per_block * page_size}")
    # Pad rows to whole row blocks and the table to whole (split x pages_per_block) blocks;
    # padded rows have t >= T (invalid), padded table columns are past every length.
    r_pad = pl.cdiv(r, block_r) * block_r
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, r_pad - r), (0, 0)))
    per_split = pl.cdiv(pl.cdiv(m, k_splits), pages_per_block) * pages_per_block
    m_pad = per_split * k_splits
    tables = jnp.pad(block_tables, ((0, 0), (0, m_pad - m)))

    k_arrays, k_spec = _page_operands(k_pages)
    v_arrays, v_spec = _page_operands(v_pages)
    head_map = lambda bi, h, i, s: (h,) + (0,) * 3
    scalar_spec = pl.BlockSpec((1,), lambda bi, h, i, s: (bi,))
    table_spec = pl.BlockSpec((None, m_pad), lambda bi, h, i, s: (bi, 0))
    n_r = r_pad // block_r
    kernel = functools.partial(
        _attention_kernel, n_k_refs=len(k_arrays), k_spec=k_spec, v_spec=v_spec, group=group,
        num_t=num_t, page_size=page_size, pages_per_block=pages_per_block,
        pages_per_split=per_split, sm_scale=float(sm_scale), layered=layered,
    )
    o, mx, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_r, k_splits),
        in_specs=[
            scalar_spec, scalar_spec, table_spec,
            pl.BlockSpec((None, None, block_r, d), lambda bi, h, i, s: (bi, h, i, 0)),
            *[pl.BlockSpec((1,), lambda bi, h, i, s: (0,))] * len(layer_ops),
            *_page_block_specs(k_arrays, head_map, layered),
            *_page_block_specs(v_arrays, head_map, layered),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_r, d), lambda bi, h, i, s: (s, bi, h, i, 0)),
            pl.BlockSpec((None, None, None, block_r), lambda bi, h, i, s: (s, bi, h, i)),
            pl.BlockSpec((None, None, None, block_r), lambda bi, h, i, s: (s, bi, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((k_splits, b, hkv, r_pad, d), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, b, hkv, r_pad), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, b, hkv, r_pad), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"kvq_paged_attention_r{block_r}_ppb{pages_per_block}_p{page_size}_s{k_splits}"
             + ("_layered" if layered else ""),
    )(lengths, q_start, tables, q_rows, *layer_ops, *k_arrays, *v_arrays)

    # Merge the splits (flash-decoding): rescale each to the global max, then normalize.
    top = jnp.max(mx, axis=0)
    top_safe = jnp.where(top > NEG_INF, top, 0.0)
    w = jnp.exp(mx - top_safe[None])  # splits that saw nothing have m = -inf -> weight 0
    total = jnp.sum(w * l, axis=0)
    has = total > 0
    out = jnp.sum(w[..., None] * o, axis=0) / jnp.where(has, total, 1.0)[..., None]
    lse = jnp.where(has, top_safe + jnp.log(jnp.where(has, total, 1.0)), NEG_INF)

    per_token = None
    if mass is not None:
        mass_kernel = functools.partial(
            _mass_kernel, k_spec=k_spec, group=group, num_t=num_t, page_size=page_size,
            pages_per_block=pages_per_block, block_r=block_r, sm_scale=float(sm_scale),
            layered=layered,
        )
        block_k = pages_per_block * page_size
        head_map3 = lambda bi, h, j: (h,) + (0,) * 3
        per_token = pl.pallas_call(
            mass_kernel,
            grid=(b, hkv, m_pad // pages_per_block),
            in_specs=[
                pl.BlockSpec((1,), lambda bi, h, j: (bi,)),
                pl.BlockSpec((1,), lambda bi, h, j: (bi,)),
                pl.BlockSpec((None, m_pad), lambda bi, h, j: (bi, 0)),
                pl.BlockSpec((None, None, r_pad, d), lambda bi, h, j: (bi, h, 0, 0)),
                pl.BlockSpec((None, None, r_pad), lambda bi, h, j: (bi, h, 0)),
                *[pl.BlockSpec((1,), lambda bi, h, j: (0,))] * len(layer_ops),
                *_page_block_specs(k_arrays, head_map3, layered),
            ],
            out_specs=pl.BlockSpec((None, None, block_k), lambda bi, h, j: (bi, h, j)),
            out_shape=jax.ShapeDtypeStruct((b, hkv, m_pad * page_size), jnp.float32),
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name=f"kvq_attention_mass_r{block_r}_ppb{pages_per_block}_p{page_size}"
                 + ("_layered" if layered else ""),
        )(lengths, q_start, tables, q_rows, lse, *layer_ops, *k_arrays)
        per_token = per_token[:, :, : m * page_size]
    return out[:, :, :r], lse[:, :, :r], per_token


def _finish_mass(per_token, mass, page_size):
    if per_token is None or mass == "token":
        return per_token
    b, h, s = per_token.shape
    return per_token.reshape(b, h, s // page_size, page_size).sum(-1)


def _default_splits(batch: int, kv_heads: int, row_blocks: int, max_blocks: int,
                    pages_per_block: int) -> int:
    """Enough programs to fill an H200 (132 SMs) about twice, never more than the work."""
    programs = batch * kv_heads * row_blocks
    want = _pow2(max(1, math.ceil(264 / max(programs, 1))))
    return max(1, min(want, max(1, max_blocks // pages_per_block)))


def decode_pallas(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None, mass=None,
                  interpret=False, block_r=None, pages_per_block=None, k_splits=None,
                  num_warps=4, num_stages=2, layer=None):
    """Decode through the Pallas kernel -> (out [B, Hq, D], AttentionAux). Knobs are static;
    `layer` (None or i32[], traced allowed) reads pools with a layer axis at that layer."""
    b, hq, d = q.shape
    hkv, _, page_size, _ = page_shape(k_pages)
    g = hq // hkv
    block_r = block_r or max(16, _pow2(g))
    pages_per_block = pages_per_block or _default_pages_per_block(page_size)
    if k_splits is None:
        k_splits = 1 if interpret else _default_splits(
            b, hkv, 1, block_tables.shape[1], pages_per_block)
    out, lse, per_token = paged_attention_rows_pallas(
        q.reshape(b, hkv, g, d), k_pages, v_pages, block_tables, lengths, lengths - 1, layer,
        group=g, num_t=1, sm_scale=float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale),
        mass=mass, block_r=block_r, pages_per_block=pages_per_block, k_splits=k_splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )
    out = out.reshape(b, hq, d).astype(q.dtype)
    return out, AttentionAux(lse=lse.reshape(b, hq), mass=_finish_mass(per_token, mass, page_size))


def prefill_pallas(q, k_pages, v_pages, block_tables, lengths, q_start, *, sm_scale=None,
                   mass=None, interpret=False, block_r=None, pages_per_block=None, k_splits=1,
                   num_warps=4, num_stages=2, layer=None):
    """Chunked prefill through the Pallas kernel -> (out [B, T, Hq, D], AttentionAux); `layer`
    as in `decode_pallas`."""
    b, t, hq, d = q.shape
    hkv, _, page_size, _ = page_shape(k_pages)
    g = hq // hkv
    block_r = block_r or max(16, min(64, _pow2(t * g)))
    pages_per_block = pages_per_block or _default_pages_per_block(page_size)
    q_rows = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
    out, lse, per_token = paged_attention_rows_pallas(
        q_rows, k_pages, v_pages, block_tables, lengths, q_start, layer,
        group=g, num_t=t, sm_scale=float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale),
        mass=mass, block_r=block_r, pages_per_block=pages_per_block, k_splits=k_splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )
    out = out.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
    lse = lse.reshape(b, hkv, t, g).transpose(0, 2, 1, 3).reshape(b, t, hq)
    return out.astype(q.dtype), AttentionAux(lse=lse, mass=_finish_mass(per_token, mass, page_size))
