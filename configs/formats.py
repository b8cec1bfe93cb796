"""KV-cache storage formats, defined once and shared by the accounting, kernels and reclaim.

A format says how one page (one KV head's `block_size` tokens of K, or of V) is stored, and so
how many bytes a block really costs, scales and zero points included. Quantization itself
(`quantize`/`dequantize`) lives beside the kernels in `kernels/`; this module is only the
description, so it stays importable without touching device code.

Quantized layouts (KIVI: Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for
KV Cache"):
  * int8: symmetric, one bf16 scale per (token, KV head).
  * int4: symmetric, two values per byte, one bf16 scale per (token, KV head, group of 64
    channels, or head_dim if smaller).
  * kivi2 / kivi4: the paper's setting: asymmetric (bf16 scale and bf16 zero point per group);
    keys per channel over groups of G = 32 tokens, values per token over groups of 32 channels;
    the newest R = 128 tokens stay in full precision (`residual`).
  * kivi2-g16 / kivi4-g16: the same with G = 16 and R = 32 (this project's earlier setting: at
    block size 16, one key group per block).

A key group spans G / block_size whole blocks of one sequence, quantized with ONE per-channel
scale and zero point computed over the group's G tokens; every block stores its own copy of them,
so blocks stay independently movable (offload, block eviction) and the kernels read a block
alone. The ledger charges what is stored: per block and KV head, D scales and D zero points of
2 B for the keys whatever G is, i.e. (G / block_size - 1) x 4 D bytes per group more than one
stored copy would take (kivi2, D = 64, block 16, G = 32: 256 B of 1,792 per group of 32 tokens
and head, 14 %; none at block size 32).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from configs.errors import FormatSpecError, UnknownFormatError

SCALE_BYTES = 2  # every scale and zero point is stored as bf16


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one of K or V is quantized inside a page.

    Attributes:
      bits: bits per stored value (8, 4 or 2); values narrower than a byte are packed.
      scale_axis: "token": each token has its own scales, one per `group` channels;
        "channel": each channel has one scale over the page's tokens (KIVI keys).
      group: channels per scale group when `scale_axis == "token"` (capped at head_dim; a
        larger head_dim must be a multiple of it, see `check_head_dim`).
      asymmetric: whether a zero point is stored beside each scale.
      tokens: when `scale_axis == "channel"`: tokens that share one per-channel scale (KIVI's
        G), a whole number of blocks; 0: the tokens of one block.
    """

    bits: int
    scale_axis: Literal["token", "channel"]
    group: int = 0
    asymmetric: bool = False
    tokens: int = 0

    def check_head_dim(self, head_dim: int) -> None:
        """Raises FormatSpecError unless `head_dim` fits this spec: a positive whole number of
        bytes of packed codes and, for per-token scales, a whole number of scale groups.

        The one place this is decided: the byte accounting (`num_scales`, `page_bytes`), the
        array layout (`data_shape`, `scale_shape`) and quantization all call it.
        """
        if head_dim <= 0 or (head_dim * self.bits) % 8:
            raise FormatSpecError(
                f"head_dim {head_dim} is not a whole number of bytes at {self.bits} bits")
        if self.scale_axis == "token" and self.group and head_dim > self.group \
                and head_dim % self.group:
            raise FormatSpecError(
                f"head_dim {head_dim} is not a multiple of the {self.bits}-bit scale group "
                f"{self.group} (a partial last group has no defined scale)")

    def pages_per_group(self, block_size: int) -> int:
        """Consecutive blocks of one sequence quantized with one per-channel scale: tokens /
        block_size (1 for per-token specs and a one-block group). Raises FormatSpecError unless
        the group is a whole number of blocks."""
        if self.scale_axis != "channel" or not self.tokens:
            return 1
        if not isinstance(block_size, int) or block_size <= 0 or self.tokens % block_size:
            raise FormatSpecError(
                f"a key group of {self.tokens} tokens is not a whole number of blocks of "
                f"{block_size} tokens (use a block size that divides {self.tokens})")
        return self.tokens // block_size

    def group_size(self, head_dim: int) -> int:
        """Channels that share one scale within a token (head_dim for a per-token scale)."""
        self.check_head_dim(head_dim)
        return min(self.group, head_dim) if self.group else head_dim

    def groups_per_token(self, head_dim: int) -> int:
        """Scale groups per token (per-token specs): head_dim / group_size, exactly."""
        return head_dim // self.group_size(head_dim)

    def num_scales(self, block_size: int, head_dim: int) -> int:
        """Scales (and as many zero points, if asymmetric) stored per page."""
        self.check_head_dim(head_dim)
        if self.scale_axis == "channel":
            return head_dim
        return block_size * self.groups_per_token(head_dim)

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        """Bytes of one page: packed data plus scales plus zero points."""
        data = block_size * head_dim * self.bits // 8
        per_scale = SCALE_BYTES * (2 if self.asymmetric else 1)
        return data + self.num_scales(block_size, head_dim) * per_scale

    # The array layout of a quantized pool, shared by the kernels and the state. Values are
    # packed along channels (low bits first); scales broadcast against [H, N, P, D] once the
    # channels are split into groups.
    @property
    def data_dtype(self) -> str:
        """int8 for symmetric 8-bit values, uint8 for packed or offset (asymmetric) codes."""
        return "int8" if self.bits == 8 and not self.asymmetric else "uint8"

    def data_shape(self, heads: int, blocks: int, block_size: int, head_dim: int):
        """[H, N, P, D * bits / 8]: packed codes."""
        self.check_head_dim(head_dim)
        return (heads, blocks, block_size, head_dim * self.bits // 8)

    def scale_shape(self, heads: int, blocks: int, block_size: int, head_dim: int):
        """[H, N, P, D / group] per token, or [H, N, 1, D] per channel; bf16 (zero points alike)."""
        self.check_head_dim(head_dim)
        if self.scale_axis == "channel":
            return (heads, blocks, 1, head_dim)
        return (heads, blocks, block_size, self.groups_per_token(head_dim))


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """A KV storage format.

    Attributes:
      name: registry name ("bf16", "int8", "kivi2", ...).
      dtype: numpy/jax dtype name of the stored data for unquantized formats ("bfloat16", ...),
        or the container dtype ("int8", "uint8") of quantized data.
      key: QuantSpec for keys, None for a plain floating-point format.
      value: QuantSpec for values, None for a plain floating-point format.
      residual: the newest tokens its paper keeps in full precision (KIVI's R), the default
        window of `Allocator.compress`; None: no prescribed window (the caller's, 32 by default).
    """

    name: str
    dtype: str
    key: QuantSpec | None = None
    value: QuantSpec | None = None
    residual: int | None = None

    @property
    def quantized(self) -> bool:
        return self.key is not None

    @property
    def compressed(self) -> bool:
        """A format a full-precision cache is compressed into: quantized, or an 8-bit float."""
        return self.quantized or self.element_bytes < 2

    @property
    def element_bytes(self) -> int:
        """Bytes per element of a plain floating-point format."""
        return {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}[self.dtype]

    def key_page_bytes(self, block_size: int, head_dim: int) -> int:
        """Bytes of one KV head's keys for one block."""
        if self.key is None:
            return block_size * head_dim * self.element_bytes
        return self.key.page_bytes(block_size, head_dim)

    def value_page_bytes(self, block_size: int, head_dim: int) -> int:
        """Bytes of one KV head's values for one block."""
        if self.value is None:
            return block_size * head_dim * self.element_bytes
        return self.value.page_bytes(block_size, head_dim)

    def head_block_bytes(self, block_size: int, head_dim: int) -> int:
        """Bytes of K plus V of one KV head for one block in one layer."""
        return self.key_page_bytes(block_size, head_dim) + self.value_page_bytes(
            block_size, head_dim
        )

    def fraction_of_bf16(self, block_size: int, head_dim: int) -> float:
        """Size of a block relative to the same block stored in bf16."""
        return self.head_block_bytes(block_size, head_dim) / (4 * block_size * head_dim)


_FORMATS = (
    KVFormat("f32", "float32"),
    KVFormat("bf16", "bfloat16"),
    KVFormat("f16", "float16"),
    KVFormat("fp8", "float8_e4m3fn"),
    KVFormat(
        "int8", "int8",
        key=QuantSpec(bits=8, scale_axis="token"),
        value=QuantSpec(bits=8, scale_axis="token"),
    ),
    KVFormat(
        "int4", "uint8",
        key=QuantSpec(bits=4, scale_axis="token", group=64),
        value=QuantSpec(bits=4, scale_axis="token", group=64),
    ),
    *(KVFormat(
        f"kivi{bits}{suffix}", "uint8",
        key=QuantSpec(bits=bits, scale_axis="channel", asymmetric=True, tokens=g),
        value=QuantSpec(bits=bits, scale_axis="token", group=32, asymmetric=True),
        residual=r,
    ) for suffix, g, r in (("", 32, 128), ("-g16", 16, 32)) for bits in (2, 4)),
)

KV_FORMATS: dict[str, KVFormat] = {fmt.name: fmt for fmt in _FORMATS}


def get_kv_format(name: str) -> KVFormat:
    """Returns the format called `name`, or raises UnknownFormatError listing the valid names."""
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise UnknownFormatError(
            f"unknown kv_format {name!r}; valid choices: {', '.join(KV_FORMATS)}"
        ) from None
