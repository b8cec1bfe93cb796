"""KV memory accounting in bytes: the unit every ledger in kvquota works in (DESIGN.md §1.1).

KV per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element. For formats that
store scales per block (KIVI keys) the honest per-token figure is the block's bytes divided by the
block size, so everything here starts from the bytes of one block.
"""

from __future__ import annotations

import dataclasses
import math

from configs.models import ModelConfig
from configs.errors import ConfigError
from configs.formats import KVFormat


def check_positive(**sizes: int) -> None:
    """Raises ConfigError naming each size that is not a positive int (bools excluded)."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """A model's KV cache in one format, paged into blocks of `block_size` tokens."""

    model: ModelConfig
    kv_format: KVFormat
    block_size: int = 16

    def __post_init__(self):
        check_positive(block_size=self.block_size)

    @property
    def bytes_per_layer_block(self) -> int:
        """K and V of every KV head of one layer for one block."""
        per_head = self.kv_format.head_block_bytes(self.block_size, self.model.head_dim)
        return per_head * self.model.num_kv_heads

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer and KV head for one block: the unit the allocator charges."""
        return self.bytes_per_layer_block * self.model.num_layers

    @property
    def bytes_per_token(self) -> float:
        """Block bytes / block size (exact integer for the plain float formats)."""
        per_token = self.bytes_per_block / self.block_size
        return int(per_token) if per_token.is_integer() else per_token

    @property
    def bytes_per_layer_token(self) -> float:
        per_token = self.bytes_per_layer_block / self.block_size
        return int(per_token) if per_token.is_integer() else per_token

    def blocks_for(self, num_tokens: int) -> int:
        """Whole blocks needed to hold `num_tokens` tokens."""
        return math.ceil(num_tokens / self.block_size)

    def sequence_bytes(self, num_tokens: int) -> int:
        """Resident bytes of one sequence of `num_tokens` tokens, in whole blocks."""
        return self.blocks_for(num_tokens) * self.bytes_per_block


@dataclasses.dataclass(frozen=True)
class Footprint:
    """The KV footprint of a tenant's batch of equal-length sequences."""

    batch: int
    seq_len: int
    token_bytes: int  # bytes_per_token x batch x seq_len (logical usage)
    block_bytes: int  # whole blocks per sequence x bytes_per_block x batch (resident)
    blocks: int  # total blocks allocated


def tenant_footprint(layout: KVLayout, batch: int, seq_len: int) -> Footprint:
    """KV bytes of `batch` sequences of `seq_len` tokens each, by tokens and by whole blocks."""
    check_positive(batch=batch, seq_len=seq_len)
    blocks = layout.blocks_for(seq_len) * batch
    token_bytes = layout.bytes_per_token * batch * seq_len
    return Footprint(
        batch=batch,
        seq_len=seq_len,
        token_bytes=int(round(token_bytes)),
        block_bytes=blocks * layout.bytes_per_block,
        blocks=blocks,
    )
