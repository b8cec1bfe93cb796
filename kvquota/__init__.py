"""kvquota: a paged KV cache shared by tenants under quotas, as pure JAX transformations.

The public API, by concept. Implementation modules (`kvquota.core` above all) are private.
"""

# ---- sizes, formats, byte accounting ---------------------------------------------------------
from configs.formats import KV_FORMATS, KVFormat, QuantSpec, get_kv_format
from configs.models import MODELS, ModelConfig, get_model_config
from kvquota.accounting import Footprint, KVLayout, tenant_footprint

# ---- the state and its operations --------------------------------------------------------------
from kvquota.allocator import Allocator
from kvquota.builder import SyntheticSpec, build_state
from kvquota.codes import (
    FATE_COMPRESSED,
    FATE_EVICTED,
    FATE_GROWING,
    FATE_NAMES,
    FATE_PREEMPTED,
    FATE_RELEASED,
    FATE_SUSPENDED,
    FATE_UNTOUCHED,
    INT32_MAX,
    REASONS,
    REFUSED_GROWING,
    SEQ_FREE,
    SEQ_IDLE,
    SEQ_PREEMPTED,
    SEQ_RUNNING,
    SEQ_SUSPENDED,
    STATUS_NAMES,
    TIER_DEVICE,
    TIER_HOST,
)
from kvquota.hashing import group_salt, private_salt
from kvquota.invariants import check_invariants
from kvquota.pages import PoolPages, host_sharding
from kvquota.sentinel import INVALID, is_invalid, is_valid
from kvquota.state import (
    Blocks,
    FreeLists,
    KVState,
    Sequences,
    StateConfig,
    Tenants,
    init_state,
    validate_state,
)

# ---- reclaim in one action, and the LMCache-style controller verbs ------------------------------
from kvquota import controller, sharding, sim
from kvquota.reclaim import (
    PRESETS as RECLAIM_PRESETS,
    PlanStep,
    ReclaimPlan,
    ReclaimPolicy,
    ReclaimReport,
    ReclaimRequest,
    SeqArchive,
    SeqFate,
    get_reclaim_policy,
)

# ---- eviction policies (one scoring hook each, registered by name) ---------------------------
from kvquota.policies import REGISTRY as POLICIES
from kvquota.policies import EvictionPolicy, TokenView, get_policy

# ---- reports -------------------------------------------------------------------------------------
from kvquota.reports import (
    AdmitReport,
    AppendReport,
    CompressReport,
    EvictReport,
    ForkReport,
    FreeReport,
    Ledger,
    MoveReport,
    PinReport,
    PreemptReport,
    TenantReport,
)

# ---- errors (one hierarchy under KVQuotaError) --------------------------------------------------
from kvquota.errors import (
    BlockStateError,
    ConfigError,
    ConfigMismatchError,
    ContextTooLongError,
    DoubleFreeError,
    DuplicateIdError,
    FormatSpecError,
    InputDtypeError,
    InputShapeError,
    InvalidArgumentError,
    InvariantError,
    KVQuotaError,
    PlanMismatchError,
    PoolFullError,
    QuotaExceededError,
    QuotaValueError,
    SequenceTooLongError,
    ShardingError,
    StateMismatchError,
    TenantExistsError,
    TierError,
    TokenIdError,
    TokenizerError,
    TraceFormatError,
    UnknownFormatError,
    UnknownModelError,
    UnknownSequenceError,
    UnknownTenantError,
    UnsupportedArchitectureError,
    WeightsError,
    WeightsNotFoundError,
)

# ---- model: decoder, weights, tokenizer ----------------------------------------------------------
from kvquota.model import (
    ChunkMeta,
    Decoder,
    DenseKV,
    PagedKV,
    Tokenizer,
    from_gguf,
    from_hf_dir,
    init_params,
    load_gguf,
    load_pretrained,
    load_safetensors,
    load_smollm2,
    load_tokenizer,
    save_safetensors,
    smollm2_gguf_path,
)

# ---- serving ------------------------------------------------------------------------------------
from kvquota.serving import (
    CachePolicy,
    cache_bytes_by_pool,
    generate_streaming,
    score_streaming,
    StepwiseEviction,
    score_stepwise,
    stepwise_state_config,
    DenseEngine,
    Generation,
    PagedEngine,
    Sampling,
    ScoreResult,
    generate,
    read_json_lines,
    sample_tokens,
    score,
)
