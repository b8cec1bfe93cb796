"""kvquota: a paged KV cache shared by tenants under quotas, as pure JAX transformations."""

from kvquota.accounting import Footprint, KVLayout, tenant_footprint
from kvquota.formats import (
    KV_FORMATS,
    KVFormat,
    QuantSpec,
    UnknownFormatError,
    get_kv_format,
)
from kvquota.sentinel import INVALID, is_invalid, is_valid

# Model, weights, tokenizer and serving on the paged state (issue #5).
from kvquota.engine import (
    DenseEngine,
    Generation,
    PagedEngine,
    Sampling,
    ScoreResult,
    generate,
    score,
)
from kvquota.model import ChunkMeta, ContextTooLongError, Decoder, DenseKV, PagedKV, init_params
from kvquota.tokenizer import Tokenizer, TokenizerError, from_gguf, from_hf_dir, load_tokenizer
from kvquota.weights import (
    ConfigMismatchError,
    UnsupportedArchitectureError,
    WeightsError,
    WeightsNotFoundError,
    load_gguf,
    load_pretrained,
    load_safetensors,
    load_smollm2,
    save_safetensors,
)

# Functional paged KV state: config, pytree, validating ops, ledger, invariants (issue #3).
from kvquota._reports import (
    AdmitReport,
    AppendReport,
    ForkReport,
    FreeReport,
    Ledger,
    PinReport,
    TenantReport,
)
from kvquota.allocator import Allocator
from kvquota.builder import SyntheticSpec, build_state
from kvquota.errors import (
    BlockStateError,
    DoubleFreeError,
    DuplicateIdError,
    InputDtypeError,
    InputShapeError,
    InvariantError,
    KVQuotaError,
    QuotaValueError,
    SequenceTooLongError,
    StateMismatchError,
    TenantExistsError,
    TokenIdError,
    UnknownSequenceError,
    UnknownTenantError,
)
from kvquota.invariants import check_invariants
from kvquota.state import (
    REASONS,
    SEQ_FREE,
    SEQ_PREEMPTED,
    SEQ_RUNNING,
    SEQ_SUSPENDED,
    TIER_DEVICE,
    TIER_HOST,
    KVState,
    StateConfig,
    init_state,
)
