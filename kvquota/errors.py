"""Every typed error of kvquota, in one hierarchy under `KVQuotaError` (a ValueError).

The root and the presets' errors (unknown model or format) live in `configs.errors`, the lowest
layer, and are re-exported here. The state facade raises its errors before any jitted (possibly
donating) call, so on error the state is never touched.
"""

from configs.errors import (ConfigError, FormatSpecError, KVQuotaError, UnknownFormatError,
                            UnknownModelError)

__all__ = [
    "KVQuotaError", "ConfigError", "UnknownModelError", "UnknownFormatError", "FormatSpecError",
    "StateMismatchError", "InputShapeError", "InputDtypeError", "UnknownTenantError",
    "TenantExistsError", "QuotaValueError", "UnknownSequenceError", "DoubleFreeError",
    "DuplicateIdError", "SequenceTooLongError", "TokenIdError", "BlockStateError",
    "PoolFullError", "QuotaExceededError", "TierError", "InvalidArgumentError",
    "InvariantError", "ContextTooLongError", "TokenizerError", "WeightsError",
    "WeightsNotFoundError", "UnsupportedArchitectureError", "ConfigMismatchError",
]


class StateMismatchError(KVQuotaError):
    """The state is not a KVState, or its arrays do not have the shapes the config fixes."""


class InputShapeError(KVQuotaError):
    """An input array has the wrong rank or shape."""


class InputDtypeError(KVQuotaError):
    """An input is not an integer array (floats and bools are rejected, never cast)."""


class UnknownTenantError(KVQuotaError):
    """The tenant id is outside [0, num_tenants) or the tenant is not registered."""


class TenantExistsError(KVQuotaError):
    """Registering a tenant slot that is already registered."""


class QuotaValueError(KVQuotaError):
    """A quota or lease value is negative, not an integer, or too large for the state."""


class UnknownSequenceError(KVQuotaError):
    """The sequence id is out of range or the slot holds no running sequence."""


class DoubleFreeError(UnknownSequenceError):
    """Freeing a sequence that is already free (or twice in one call)."""


class DuplicateIdError(KVQuotaError):
    """The same sequence or block id appears twice in a call where that is ambiguous."""


class SequenceTooLongError(KVQuotaError):
    """A prompt or an append does not fit in the block table (max_blocks_per_seq x block_size)."""


class TokenIdError(KVQuotaError):
    """A token id is negative or outside the model's vocabulary, or a prompt length is invalid."""


class BlockStateError(KVQuotaError):
    """A block id is out of range, or the block is in the wrong state (pinning a free block,
    unpinning a block that is not pinned)."""


class PoolFullError(KVQuotaError):
    """A move needs more free blocks than the target pool has (offload without host room,
    restore without device room)."""


class QuotaExceededError(KVQuotaError):
    """An explicit move would put a tenant over its byte quota (restore after a quota cut)."""


class TierError(KVQuotaError):
    """The config lacks the pool an operation needs (no host pool, no pool of that format)."""


class InvalidArgumentError(KVQuotaError):
    """An option of an operation is outside its range (keep_recent < 0, an unknown policy)."""


class ShardingError(InvalidArgumentError):
    """A mesh that does not fit: axis sizes, device count, axis names or types, or KV heads
    that the "kv" axis does not divide (kvquota.sharding)."""


class TraceFormatError(InvalidArgumentError):
    """A trace file (or a trace being saved) that breaks the format: the message names the file,
    the line and the problem (kvquota.sim)."""


class PlanMismatchError(KVQuotaError):
    """A reclaim plan applied to a state other than the one it was made for."""


class InvariantError(KVQuotaError):
    """`check_invariants` found state that disagrees with its recomputation from the tables."""

    def __init__(self, problems):
        self.problems = list(problems)
        shown = "\n  ".join(self.problems[:20])
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        super().__init__(f"{len(self.problems)} invariant(s) violated:\n  {shown}{more}")


# ---- model, tokenizer, weights ------------------------------------------------------------------
class ContextTooLongError(KVQuotaError):
    """A sequence would run past the model's `max_context`."""


class TokenizerError(KVQuotaError):
    """A tokenizer that cannot be built (unsupported model or pre-tokenizer, missing file)."""


class WeightsError(KVQuotaError):
    """Base class of the weight loaders' errors."""


class WeightsNotFoundError(WeightsError, FileNotFoundError):
    """A weights file or checkpoint directory does not exist or is incomplete."""


class UnsupportedArchitectureError(WeightsError):
    """The checkpoint is not a Llama/Qwen2-family decoder this model implements."""


class ConfigMismatchError(WeightsError):
    """The checkpoint's shapes disagree with the requested preset."""
