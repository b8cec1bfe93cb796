"""Plain-JAX paged attention: the semantics the Pallas kernel must match, and the CPU fast path.

Decode is chunked prefill with one query row per sequence at position `length - 1`, so both run
through `paged_attention_rows`: queries are "rows" `[Hkv, B, R, D]` (R = T * group, row
r = t * group + h), each with a cache position (or -1 for a padding row); a row attends to the
cached keys at positions `<= its own` and `< length`.

Why it is shaped this way (it is on the model's hot path on CPU, measured in
experiments/bench_attention.py):
  * the table is walked in cache-sized chunks of columns with the online softmax of flash
    attention: one big gathered copy of K and V costs more on CPU than the attention itself
    (fresh buffers), a small reused chunk does not; the walk stops at the last visible chunk;
  * at small batch (few query rows), when the pool is about the size of the tables, the logits
    come from one dot over the whole pool and a gather of logits, never of K;
  * each chunk is gathered with one `take` per array, page-contiguous (`[Hkv, B, C, D]` is a free
    reshape of the gathered `[Hkv, B, c, P, D]`), with the V mask fused into that gather; both
    contractions batch over the leading (Hkv, B) axes, so XLA adds no transposes;
  * masking is by `where` on the logits and on V before the value product: unused slots may hold
    NaN (another tenant's stale data), and 0 * NaN would leak through a multiplicative mask.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels.paged_attention.layered import at_layer, page_shape, pool_layers, take_blocks
from kernels.quantization import QuantizedPages, dequantize_tile


class AttentionAux(NamedTuple):
    """Side outputs of decode/prefill.

    Attributes:
      lse: f32[B, Hq] (decode) or f32[B, T, Hq] (prefill): log-sum-exp of each row's scaled
        logits; -inf for a row that attends to nothing. Merge pools with `merge_attention`.
      mass: None, or f32[B, Hkv, max_blocks] ("block") / f32[B, Hkv, max_blocks * P] ("token"):
        softmax probability per block-table column (or token slot), averaged over the query heads
        of a KV group and, for prefill, summed over the chunk's valid query rows.
    """

    lse: jax.Array
    mass: jax.Array | None


def gather_pages(pages, block_tables: jax.Array, dtype, layer=None) -> jax.Array:
    """Pages of each sequence, `[Hkv, B, M*P, D]` in `dtype`, one gather per array.

    Table entries are clipped into range: entries past a sequence's length may hold the sentinel
    or arbitrary blocks, and what they point at is masked out by the caller. With `layer`,
    `pages` is a pool with a layer axis and the layer is part of the gather's index.
    """
    b, m = block_tables.shape
    g = take_blocks(pages, block_tables, layer)  # arrays [Hkv, B, M, P|1, ...]
    if isinstance(pages, QuantizedPages):
        x = dequantize_tile(g.data, g.scales, g.zeros, g.spec, dtype)
    else:
        x = g.astype(dtype)
    h, _, _, p, d = x.shape
    return x.reshape(h, b, m * p, d)


def compute_dtype(q_dtype, page_dtype):
    """The dtype a dot of q against plain pages runs in: their promotion, except that 8-bit
    float pages (fp8), which JAX refuses to promote implicitly, are widened to q's dtype."""
    if jnp.issubdtype(page_dtype, jnp.floating) and jnp.dtype(page_dtype).itemsize == 1:
        return jnp.dtype(q_dtype)
    return jnp.promote_types(q_dtype, page_dtype)


_HIGHEST = lax.Precision.HIGHEST  # f32 stays f32 on GPU too (no TF32); free on CPU


def _chunk_logits(q_rows, k_pages, block_tables, row_pos, lengths, first_pos, sm_scale,
                  layer=None):
    """Scaled, masked logits of rows against one chunk of table columns.

    -> (logits f32[Hkv, B, R, C], in_len bool[B, C]) for the C = columns * P key slots starting at
    cache position `first_pos`; invisible slots hold -inf.
    """
    k_dtype = compute_dtype(q_rows.dtype, k_pages.dtype) if _plain(k_pages) else jnp.float32
    k = gather_pages(k_pages, block_tables, k_dtype, layer)
    key_pos = first_pos + jnp.arange(k.shape[2], dtype=jnp.int32)
    in_len = key_pos[None, :] < lengths[:, None]  # [B, C]
    logits = jnp.einsum("hbrd,hbsd->hbrs", q_rows.astype(k.dtype), k, precision=_HIGHEST,
                        preferred_element_type=jnp.float32) * jnp.float32(sm_scale)
    visible = in_len[:, None, :] & (key_pos[None, None, :] <= row_pos[:, :, None])  # [B, R, C]
    return jnp.where(visible[None], logits, -jnp.inf), in_len


def _pool_logits(q_rows, k_pages, block_tables, row_pos, lengths, sm_scale, layer=None):
    """Like `_chunk_logits` over the whole table, but by one dot against every slot of the pool
    followed by a gather of logits (4 bytes a slot and row) instead of K (4*D bytes a slot).

    Pays when the pool is about as large as the tables it serves; unused slots may give NaN
    logits, but only the table's slots are picked and the invisible ones replaced by -inf.
    With `layer`, the dot runs over that layer of a pool with a layer axis.
    """
    if layer is not None:
        k_pages = at_layer(k_pages, layer)
    h, n, p, d = k_pages.shape
    _, b, r, _ = q_rows.shape
    dt = compute_dtype(q_rows.dtype, k_pages.dtype)
    every = jnp.einsum("hxd,hsd->hxs", q_rows.reshape(h, b * r, d).astype(dt),
                       k_pages.reshape(h, n * p, d).astype(dt), precision=_HIGHEST,
                       preferred_element_type=jnp.float32).reshape(h, b, r, n, p)
    idx = jnp.clip(block_tables, 0, n - 1)[None, :, None, :, None]  # [1, B, 1, M, 1]
    logits = jnp.take_along_axis(every, idx, axis=3).reshape(h, b, r, -1) * jnp.float32(sm_scale)
    key_pos = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    in_len = key_pos[None, :] < lengths[:, None]
    visible = in_len[:, None, :] & (key_pos[None, None, :] <= row_pos[:, :, None])
    return jnp.where(visible[None], logits, -jnp.inf), in_len


def use_pool_dot(k_pages, batch, rows, max_blocks, max_rows=8, logits_budget=1 << 23) -> bool:
    """Static choice of `_pool_logits`: plain pages, a pool at most twice the tables' pages, few
    query rows in all (measured on CPU: one dot over the pool beats gathering K at batch 1 by
    ~1.5x, but loses to the chunked gather at batch 8) and all logits within `logits_budget`."""
    if not _plain(k_pages):
        return False
    h, n, p, _ = page_shape(k_pages)  # one layer's, with or without a layer axis
    return (n <= 2 * batch * max_blocks and batch * rows <= max_rows
            and h * batch * rows * n * p * 4 <= logits_budget)


def _chunk_values(v_pages, block_tables, in_len, layer=None):
    """V of one chunk [Hkv, B, C, D] f32, zero past the length (those slots may hold NaN:
    0 * NaN would leak through the value product). The mask fuses into the gather."""
    v = gather_pages(v_pages, block_tables, jnp.float32, layer)
    return jnp.where(in_len[None, :, :, None], v, 0.0)


def _safe(m):
    return jnp.where(jnp.isfinite(m), m, 0.0)


def auto_chunk_pages(batch, kv_heads, rows, page_size, head_dim, max_blocks,
                     target_bytes=1 << 22):
    """Table columns per step: K + V + logits of a chunk near `target_bytes` (cache-sized).

    Big fresh buffers are what makes a one-shot gather slow on CPU (a 50 MB gathered copy costs
    more than the attention itself); a loop over cache-sized chunks reuses one small buffer.
    """
    per_column = batch * kv_heads * page_size * (2 * head_dim + rows) * 4
    cols = max(1, target_bytes // per_column)
    cols = 1 << (cols.bit_length() - 1)  # a power of two
    return max_blocks if cols >= max_blocks else cols


def paged_attention_rows(
    q_rows: jax.Array,  # [Hkv, B, R, D]
    row_pos: jax.Array,  # i32[B, R]: cache position of each row, -1 for padding rows
    k_pages,  # [Hkv, N, P, D] or QuantizedPages; with `layer`: [L, Hkv, N, P, D]
    v_pages,  # like k_pages
    block_tables: jax.Array,  # i32[B, M]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    group: int,
    mass: str | None,
    chunk_pages: int | None = None,
    pool_dot: bool | None = None,
    layer=None,
):
    """Attention of query rows over paged K/V -> (out [Hkv, B, R, D] f32, lse [Hkv, B, R], mass).

    `mass` (when asked) is f32[B, Hkv, M*P] per token slot: probabilities summed over rows and
    divided by `group` (the mean over a group's heads, summed over query positions).

    The table is walked `chunk_pages` columns at a time with the online softmax of flash
    attention (one pass when it fits one chunk); the loop stops after the last chunk any row can
    see, so a wide table over short sequences costs what the sequences cost. `pool_dot` (None:
    `use_pool_dot` decides) takes all logits in one pass by `_pool_logits` instead.

    `layer` (i32[], traced allowed): K and V are pools with a layer axis, read at that layer
    (clamped into range); every choice above is made on one layer's shape, so the result is
    that of the call on `pool[layer]`, bitwise.
    """
    hkv, b, r, d = q_rows.shape
    m_cols = block_tables.shape[1]
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if (pool_layers(pages) is None) != (layer is None):
            raise ValueError(f"{name}: a [L, Hkv, N, P, D] pool goes with layer= and one "
                             f"layer's [Hkv, N, P, D] pages without it (layer={layer!r})")
    if layer is not None:
        layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, pool_layers(k_pages) - 1)
    page = page_shape(k_pages)[2]
    if pool_dot is None:
        pool_dot = use_pool_dot(k_pages, b, r, m_cols)
    if pool_dot and not _plain(k_pages):
        raise ValueError("pool_dot needs plain (unquantized) pages")
    if chunk_pages is None:
        chunk_pages = m_cols if pool_dot else auto_chunk_pages(b, hkv, r, page, d, m_cols)
    if pool_dot:
        chunk_pages = m_cols
    c = min(chunk_pages, m_cols)
    n_chunks = -(-m_cols // c)
    tables = jnp.pad(block_tables, ((0, 0), (0, n_chunks * c - m_cols)))  # padding: past lengths

    def columns(j):
        return lax.dynamic_slice_in_dim(tables, j * c, c, axis=1)

    def step(j, carry):
        o, m, l = carry
        if pool_dot:  # one chunk: the whole table
            logits, in_len = _pool_logits(q_rows, k_pages, tables, row_pos, lengths, sm_scale,
                                          layer)
        else:
            logits, in_len = _chunk_logits(q_rows, k_pages, columns(j), row_pos, lengths,
                                           j * c * page, sm_scale, layer)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        alpha = jnp.exp(m - _safe(m_new))  # m = -inf (nothing seen yet) -> 0
        p = jnp.exp(logits - _safe(m_new)[..., None])  # invisible: exp(-inf) = 0
        v = _chunk_values(v_pages, columns(j), in_len, layer)
        pv = jnp.einsum("hbrs,hbsd->hbrd", p, v, precision=_HIGHEST,
                        preferred_element_type=jnp.float32)
        return alpha[..., None] * o + pv, m_new, alpha * l + jnp.sum(p, axis=-1)

    init = (jnp.zeros((hkv, b, r, d), jnp.float32), jnp.full((hkv, b, r), -jnp.inf),
            jnp.zeros((hkv, b, r), jnp.float32))
    if n_chunks == 1:
        o, m, l = step(0, init)
    else:
        seen = jnp.max(jnp.minimum(jnp.max(row_pos, axis=1) + 1, lengths))  # last visible + 1
        o, m, l = lax.fori_loop(0, jnp.minimum(-(-seen // (c * page)), n_chunks), step, init)
    has = l > 0
    inv_l = jnp.where(has, 1.0 / jnp.where(has, l, 1.0), 0.0)
    out = o * inv_l[..., None]
    lse = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
    if mass is None:
        return out, lse, None

    def mass_step(j):
        logits, _ = _chunk_logits(q_rows, k_pages, columns(j), row_pos, lengths, j * c * page,
                                  sm_scale, layer)
        p = jnp.exp(logits - _safe(lse)[..., None])  # exact probabilities; invisible -> 0
        return jnp.sum(p, axis=2).transpose(1, 0, 2) / group  # [B, Hkv, C]

    per_chunk = lax.map(mass_step, jnp.arange(n_chunks)) if n_chunks > 1 else mass_step(0)[None]
    per_token = per_chunk.transpose(1, 2, 0, 3).reshape(b, hkv, n_chunks * c * page)
    return out, lse, per_token[:, :, : m_cols * page]


def _plain(pages) -> bool:
    return not isinstance(pages, QuantizedPages)


def _block_mass(per_token: jax.Array, mass: str, page_size: int) -> jax.Array:
    """[B, Hkv, M*P] -> itself ("token") or summed per block-table column ("block")."""
    if mass == "token":
        return per_token
    b, h, s = per_token.shape
    return per_token.reshape(b, h, s // page_size, page_size).sum(-1)


def _page_size(pages) -> int:
    return page_shape(pages)[2]


def decode_reference(
    q: jax.Array,  # [B, Hq, D]
    k_pages,  # [Hkv, N, P, D] or QuantizedPages ([L, ...] with layer)
    v_pages,  # like k_pages
    block_tables: jax.Array,  # i32[B, M]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    mass: str | None = None,
    chunk_pages: int | None = None,
    pool_dot: bool | None = None,
    layer=None,
) -> tuple[jax.Array, AttentionAux]:
    """Decode attention, plain JAX: (out [B, Hq, D] in q.dtype, AttentionAux).

    Static knobs of the algorithm (same result either way): `chunk_pages`, table columns per
    loop step (None: cache-sized); `pool_dot`, logits by one dot over the pool (None: by shape).
    `layer` (i32[], traced allowed): k_pages/v_pages are `[L, Hkv, N, P, D]` pools (QuantizedPages
    with a leading [L] axis) read at that layer; the result is the call on `pool[layer]`'s.
    """
    b, hq, d = q.shape
    hkv = page_shape(k_pages)[0]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    q_rows = q.reshape(b, hkv, g, d).transpose(1, 0, 2, 3)  # [Hkv, B, g, D]
    row_pos = jnp.broadcast_to((lengths - 1)[:, None], (b, g)).astype(jnp.int32)
    out, lse, per_token = paged_attention_rows(
        q_rows, row_pos, k_pages, v_pages, block_tables, lengths,
        sm_scale=scale, group=g, mass=mass, chunk_pages=chunk_pages,
        pool_dot=pool_dot, layer=layer,
    )
    out = out.transpose(1, 0, 2, 3).reshape(b, hq, d).astype(q.dtype)
    lse = lse.transpose(1, 0, 2).reshape(b, hq)
    mass_out = None if mass is None else _block_mass(per_token, mass, _page_size(k_pages))
    return out, AttentionAux(lse=lse, mass=mass_out)


def prefill_reference(
    q: jax.Array,  # [B, T, Hq, D]
    k_pages,  # [Hkv, N, P, D] or QuantizedPages ([L, ...] with layer)
    v_pages,  # like k_pages
    block_tables: jax.Array,  # i32[B, M]
    lengths: jax.Array,  # i32[B]
    q_start: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    mass: str | None = None,
    chunk_pages: int | None = None,
    pool_dot: bool | None = None,
    layer=None,
) -> tuple[jax.Array, AttentionAux]:
    """Chunked prefill attention, plain JAX: (out [B, T, Hq, D] in q.dtype, AttentionAux).

    Static knobs and `layer` as in `decode_reference`.
    """
    b, t, hq, d = q.shape
    hkv = page_shape(k_pages)[0]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    q_rows = q.reshape(b, t, hkv, g, d).transpose(2, 0, 1, 3, 4).reshape(hkv, b, t * g, d)
    pos = q_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    pos = jnp.where(pos < lengths[:, None], pos, -1).astype(jnp.int32)
    row_pos = jnp.repeat(pos, g, axis=1)  # row r = t * g + h
    out, lse, per_token = paged_attention_rows(
        q_rows, row_pos, k_pages, v_pages, block_tables, lengths,
        sm_scale=scale, group=g, mass=mass, chunk_pages=chunk_pages,
        pool_dot=pool_dot, layer=layer,
    )
    out = out.reshape(hkv, b, t, g, d).transpose(1, 2, 0, 3, 4).reshape(b, t, hq, d)
    lse = lse.reshape(hkv, b, t, g).transpose(1, 2, 0, 3).reshape(b, t, hq)
    mass_out = None if mass is None else _block_mass(per_token, mass, _page_size(k_pages))
    return out.astype(q.dtype), AttentionAux(lse=lse, mass=mass_out)


def dense_attention_reference(
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [B, S, Hkv, D]
    v: jax.Array,  # [B, S, Hkv, D]
    q_pos: jax.Array,  # i32[B, T]: position of each query, -1 for padding rows
    kv_len: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal GQA attention over a contiguous cache: (out [B, T, Hq, D] f32, lse [B, T, Hq]).

    Independent of the paged code (no gathers, no row folding); tests compare against it.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qg = q.astype(jnp.float32).reshape(b, t, hkv, g, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * scale
    s_pos = jnp.arange(k.shape[1])
    ok = (s_pos[None, None, :] <= q_pos[:, :, None]) & (s_pos[None, None, :] < kv_len[:, None, None])
    logits = jnp.where(ok[:, None, None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, Hkv, g, T]
    w = jnp.where(ok[:, None, None], jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    vz = jnp.where((s_pos[None, :] < kv_len[:, None])[..., None, None], v.astype(jnp.float32), 0)
    out = jnp.einsum("bkgts,bskd->btkgd", w, vz).reshape(b, t, hq, d)
    return out, lse.transpose(0, 3, 1, 2).reshape(b, t, hq)
