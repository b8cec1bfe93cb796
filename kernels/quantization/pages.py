"""Quantized KV pages: the pytree the kernels read, and quantize/dequantize helpers.

The array layout is the one `configs.formats.QuantSpec` defines, so a pool built here has exactly
the bytes the ledger charges: packed codes `[H, N, P, D*bits/8]` (low bits first along channels),
bf16 scales `[H, N, P, D/group]` (per token) or `[H, N, 1, D]` (per channel, KIVI keys: the
pages of one key group hold the same copy) and, for asymmetric specs, bf16 zero points of the
same shape.

Code conventions (one place, shared by the reference and the Pallas kernel):
  * symmetric 8-bit: int8 codes c in [-127, 127], x = c * scale.
  * symmetric 4-bit: uint8 nibbles u in [1, 15], x = (u - 8) * scale (range [-7, 7]).
  * asymmetric b-bit: uint codes u in [0, 2^b - 1], x = u * scale + zero (zero = group minimum),
    as in KIVI (Liu et al., 2024).

Quantizing is told how many tokens each page holds (`fill`, i32[N], as the state's per-block
fill): slots past it may hold NaN or another tenant's stale data and must reach no scale (KIVI
keys reduce over the page's tokens, so a partial last page would otherwise be corrupted).

`unpack_codes` and `dequantize_tile` use only ops the Pallas Triton lowering supports (shifts,
masks, two-way stacks along the last axis, broadcasts and reshapes of power-of-two shapes), so the
kernel calls the very same functions on its loaded tiles.
"""

from __future__ import annotations


import flax.struct
import jax
import jax.numpy as jnp

from configs.formats import KVFormat, QuantSpec, get_kv_format


@flax.struct.dataclass
class QuantizedPages:
    """One of K or V of a quantized page pool.

    Attributes:
      data: i8/u8[H, N, P, D*bits/8] packed codes.
      scales: bf16[H, N, P, D/group] per-token scales, or bf16[H, N, 1, D] per-channel scales.
      zeros: bf16, same shape as `scales`, for asymmetric specs; None for symmetric ones.
      kv_format: the registered format (static).
      role: "key" or "value": which of the format's two specs applies (static).
    """

    data: jax.Array
    scales: jax.Array
    zeros: jax.Array | None
    kv_format: KVFormat = flax.struct.field(pytree_node=False)
    role: str = flax.struct.field(pytree_node=False)

    @property
    def spec(self) -> QuantSpec:
        return self.kv_format.key if self.role == "key" else self.kv_format.value

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * 8 // self.spec.bits

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical [H, N, P, D] of the pages this pytree stands for."""
        h, n, p, _ = self.data.shape
        return (h, n, p, self.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes really stored: codes, scales and zero points."""
        total = self.data.nbytes + self.scales.nbytes
        return total + (self.zeros.nbytes if self.zeros is not None else 0)

    def take_blocks(self, index: jax.Array, axis: int = 1) -> "QuantizedPages":
        """Gathers blocks (axis 1 of every array) by `index`; used by the reference path."""
        take = lambda a: None if a is None else jnp.take(a, index, axis=axis, mode="clip")
        return self.replace(data=take(self.data), scales=take(self.scales), zeros=take(self.zeros))


def _spec_for(kv_format: KVFormat | str, role: str) -> tuple[KVFormat, QuantSpec]:
    fmt = get_kv_format(kv_format) if isinstance(kv_format, str) else kv_format
    if not fmt.quantized:
        raise ValueError(f"kv_format {fmt.name!r} is not a quantized format")
    if role not in ("key", "value"):
        raise ValueError(f"role must be 'key' or 'value', got {role!r}")
    return fmt, (fmt.key if role == "key" else fmt.value)


def _pack(codes: jax.Array, bits: int) -> jax.Array:
    """u8[..., D] codes < 2^bits -> u8[..., D*bits/8], channel ppb*j+i at bits*i of byte j."""
    per_byte = 8 // bits
    grouped = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], -1, per_byte)
    shifts = (jnp.arange(per_byte, dtype=jnp.uint32) * bits).reshape((1,) * codes.ndim + (-1,))
    return jnp.sum(grouped << shifts, axis=-1).astype(jnp.uint8)


def unpack_codes(data: jax.Array, bits: int) -> jax.Array:
    """Packed bytes [..., D*bits/8] -> int32 codes [..., D] in natural channel order.

    Interleaves with two-way stacks along the last axis (Triton's join) and a reshape, so the
    same code lowers inside the Pallas GPU kernel.
    """
    if bits == 8:
        return data.astype(jnp.int32)
    raw = data.astype(jnp.int32)
    mask = (1 << bits) - 1
    phases = [(raw >> (bits * i)) & mask for i in range(8 // bits)]
    if bits == 4:
        joined = jnp.stack([phases[0], phases[1]], axis=-1)
    elif bits == 2:
        # [..., j, a, b] = phase 2a+b, so the flattened order is phase 0, 1, 2, 3.
        joined = jnp.stack(
            [jnp.stack([phases[0], phases[2]], axis=-1), jnp.stack([phases[1], phases[3]], axis=-1)],
            axis=-1,
        )
    else:
        raise ValueError(f"unsupported bit width {bits}")
    return joined.reshape(*data.shape[:-1], data.shape[-1] * (8 // bits))


def _expand_groups(x: jax.Array, head_dim: int) -> jax.Array:
    """[..., P, G] per-group values -> [..., P, D] (each repeated D/G times), reshape-only."""
    groups = x.shape[-1]
    if groups == head_dim:
        return x
    wide = jnp.broadcast_to(x[..., None], (*x.shape, head_dim // groups))
    return wide.reshape(*x.shape[:-1], head_dim)


def dequantize_tile(
    data: jax.Array,  # [..., P, D*bits/8] codes
    scales: jax.Array,  # [..., P, D/group] or [..., 1, D]
    zeros: jax.Array | None,  # like scales, or None
    spec: QuantSpec,
    dtype=jnp.float32,
) -> jax.Array:
    """Codes and scales of some pages -> values [..., P, D] in `dtype` (math in f32)."""
    head_dim = data.shape[-1] * 8 // spec.bits
    codes = unpack_codes(data, spec.bits).astype(jnp.float32)
    if not spec.asymmetric and spec.bits < 8:
        codes = codes - float(1 << (spec.bits - 1))
    s = scales.astype(jnp.float32)
    if spec.scale_axis == "token":
        s = _expand_groups(s, head_dim)
    out = codes * s
    if spec.asymmetric:
        z = zeros.astype(jnp.float32)
        if spec.scale_axis == "token":
            z = _expand_groups(z, head_dim)
        out = out + z
    return out.astype(dtype)


def dequantize_pages(pages: QuantizedPages, dtype=jnp.float32) -> jax.Array:
    """QuantizedPages -> [H, N, P, D] values in `dtype`."""
    return dequantize_tile(pages.data, pages.scales, pages.zeros, pages.spec, dtype)


def _slot_mask(fill: jax.Array | None, shape: tuple[int, int, int, int]) -> jax.Array | None:
    """bool[1, N, P, 1]: slot s of page n holds a token (s < fill[n]); None when every slot does."""
    if fill is None:
        return None
    _, n, p, _ = shape
    fill = jnp.asarray(fill)
    if fill.shape != (n,) or not jnp.issubdtype(fill.dtype, jnp.integer):
        raise ValueError(f"fill must be an integer array [N] = [{n}] of tokens per page, got "
                         f"shape {fill.shape} dtype {fill.dtype}")
    slots = jnp.arange(p, dtype=jnp.int32)
    return (slots[None, :] < fill.astype(jnp.int32)[:, None])[None, :, :, None]


def quantize_pages(
    x: jax.Array,  # [H, N, P, D] float
    kv_format: KVFormat | str,
    role: str,
    fill: jax.Array | None = None,  # i32[N]: tokens stored in each page (its first fill[n] slots)
    group_pages: int = 1,
) -> QuantizedPages:
    """Quantizes whole pages to `kv_format`'s spec for `role` ("key" or "value").

    `group_pages` (per-channel specs only): consecutive pages n, n+1, ... of one group share one
    per-channel scale and zero point, computed over the group's tokens (KIVI's key group G =
    group_pages x P tokens); each page stores its own copy, so it dequantizes alone. N must be
    a multiple of it.

    `fill[n]` is how many tokens page n holds (its slots 0 .. fill[n]-1, as the state's per-block
    `fill`); None means all P. Slots past the fill never reach a scale or zero point — they may
    hold NaN or another tenant's stale data, and per-channel (KIVI key) scales reduce over the
    page's tokens, so an unmasked tail would corrupt the valid keys of a partial last page. Those
    slots are stored as zeros (per-token: a zero scale; per-channel: code 0, the zero point; a
    page with no token at all: zero scales), so every stored scale, zero point and dequantized
    value is finite.

    Scales and zero points are rounded to bf16 first and the codes computed against the rounded
    values, so dequantization sees exactly what is stored.
    """
    fmt, spec = _spec_for(kv_format, role)
    h, n, p, d = x.shape
    spec.check_head_dim(d)  # raises FormatSpecError, as the byte accounting does
    g = 1 if spec.scale_axis == "token" else group_pages
    if not isinstance(g, int) or g < 1 or n % g:
        raise ValueError(f"group_pages must be a positive integer dividing the {n} pages, got "
                         f"{group_pages!r}")
    x = x.astype(jnp.float32)
    valid = _slot_mask(fill, x.shape)
    if valid is not None:
        x = jnp.where(valid, x, 0.0)  # NaN and stale tails gone before any arithmetic
    if spec.scale_axis == "token":
        group = spec.group_size(d)
        xg = x.reshape(h, n, p, d // group, group)
        reduce_axis = -1
        # A per-token scale sees only its own token: a zeroed slot gets scale 0, code "0".
        lo_in, hi_in = xg, xg
    else:
        # One scale per channel over the group's g pages of tokens (axis -2).
        xg = x.reshape(h, n // g, g * p, d)
        reduce_axis = -2
        # Padding slots must not widen the range: +inf / -inf are neutral for min / max.
        gvalid = None if valid is None else valid.reshape(1, n // g, g * p, 1)
        lo_in = xg if valid is None else jnp.where(gvalid, xg, jnp.inf)
        hi_in = xg if valid is None else jnp.where(gvalid, xg, -jnp.inf)

    def finite(a):  # an all-padding page reduces to +-inf: store zeros instead
        return a if valid is None else jnp.where(jnp.isfinite(a), a, 0.0)

    if spec.asymmetric:
        lo = finite(jnp.min(lo_in, axis=reduce_axis, keepdims=True))
        hi = finite(jnp.max(hi_in, axis=reduce_axis, keepdims=True))
        levels = (1 << spec.bits) - 1
        scale = ((hi - lo) / levels).astype(jnp.bfloat16)
        zero = lo.astype(jnp.bfloat16)
        s32 = scale.astype(jnp.float32)
        safe = jnp.where(s32 > 0, s32, 1.0)
        codes = jnp.clip(jnp.round((xg - zero.astype(jnp.float32)) / safe), 0, levels)
    else:
        qmax = (1 << (spec.bits - 1)) - 1
        amax = jnp.max(jnp.abs(xg), axis=reduce_axis, keepdims=True)  # padding is 0: neutral
        scale = (amax / qmax).astype(jnp.bfloat16)
        zero = None
        s32 = scale.astype(jnp.float32)
        safe = jnp.where(s32 > 0, s32, 1.0)
        codes = jnp.clip(jnp.round(xg / safe), -qmax, qmax)
        if spec.bits < 8:
            codes = codes + (1 << (spec.bits - 1))
    codes = codes.reshape(h, n, p, d)
    if valid is not None and spec.asymmetric:  # padding slots: code 0, the zero point
        codes = jnp.where(valid, codes, 0.0)
    if g > 1:  # each page of a group stores the group's scale (and zero point)
        scale = jnp.repeat(scale, g, axis=1)
        zero = None if zero is None else jnp.repeat(zero, g, axis=1)
    if spec.bits == 8:
        data = codes.astype(jnp.dtype(spec.data_dtype))
    else:
        data = _pack(codes.astype(jnp.uint8), spec.bits)
    scales = scale.reshape(spec.scale_shape(h, n, p, d))
    zeros = None if zero is None else zero.reshape(spec.scale_shape(h, n, p, d))
    return QuantizedPages(data=data, scales=scales, zeros=zeros, kv_format=fmt, role=role)


def quantize_kv(
    k: jax.Array, v: jax.Array, kv_format: KVFormat | str, fill: jax.Array | None = None,
    group_pages: int = 1,
) -> tuple[QuantizedPages, QuantizedPages]:
    """Quantizes K and V pages [H, N, P, D] with the format's key and value specs; `fill`
    (i32[N], tokens per page) and `group_pages` as in `quantize_pages`."""
    return (quantize_pages(k, kv_format, "key", fill, group_pages),
            quantize_pages(v, kv_format, "value", fill))


def empty_quantized_pages(
    kv_format: KVFormat | str, role: str, heads: int, blocks: int, block_size: int, head_dim: int
) -> QuantizedPages:
    """A zero-filled quantized pool with the layout of `configs.formats` (for the state)."""
    fmt, spec = _spec_for(kv_format, role)
    shape = spec.scale_shape(heads, blocks, block_size, head_dim)
    data = jnp.zeros(spec.data_shape(heads, blocks, block_size, head_dim), spec.data_dtype)
    zeros = jnp.zeros(shape, jnp.bfloat16) if spec.asymmetric else None
    return QuantizedPages(
        data=data, scales=jnp.zeros(shape, jnp.bfloat16), zeros=zeros, kv_format=fmt, role=role
    )

