"""Named codes stored in the state and in reports: sequence statuses, tiers, refusal reasons.

Values are part of the public contract (reports and results files carry them): existing codes keep
their numbers and new codes take new ones.
"""

# ---- sequence status (i8, `KVState.seqs.seq_status`) ---------------------------------------------
SEQ_FREE = 0  # slot unused: tenant INVALID, empty table
SEQ_RUNNING = 1  # holds its blocks, may append
SEQ_PREEMPTED = 2  # KV dropped by a reclaim (tokens archived in its report); the slot is held,
#                    tenant kept, table empty, until `rebalance` recycles it
SEQ_SUSPENDED = 3  # its own blocks offloaded to the host pool; not decodable until restored
SEQ_IDLE = 4  # a multi-turn session between turns: KV kept, no appends until resumed
STATUS_NAMES = {SEQ_FREE: "free", SEQ_RUNNING: "running", SEQ_PREEMPTED: "preempted",
                SEQ_SUSPENDED: "suspended", SEQ_IDLE: "idle"}

# ---- fates of a reclaim (ReclaimPlan / ReclaimReport): what each sequence of a tenant does next --
FATE_UNTOUCHED = 10  # keeps decoding (or idling) on its cache as it was
FATE_COMPRESSED = 11  # continues on a cache partly requantized into a compressed pool (lossy)
FATE_EVICTED = 12  # continues on a cache with tokens evicted for good (lossy, context break)
FATE_SUSPENDED = 13  # own blocks offloaded to host; resume = prefetch them (restore)
FATE_PREEMPTED = 14  # KV dropped; resume = re-admit its tokens and recompute what misses the cache
FATE_GROWING = 15  # "grow but admit nothing new": keeps decoding past the cut
FATE_RELEASED = 16  # lease expired: the request ends, its references are dropped
FATE_NAMES = {FATE_UNTOUCHED: "untouched", FATE_COMPRESSED: "compressed",
              FATE_EVICTED: "evicted", FATE_SUSPENDED: "suspended", FATE_PREEMPTED: "preempted",
              FATE_GROWING: "growing", FATE_RELEASED: "released"}

# ---- block tier (i8, `KVState.blocks.tier`): where a pool lives ------------------------------------
TIER_DEVICE = 0
TIER_HOST = 1

# ---- reason codes (i32) in admit/append/fork reports; 0 means the request went through -----------
OK = 0
REFUSED_TOKEN_QUOTA = 1  # the tenant's token quota (logical usage) would be exceeded
REFUSED_BYTE_QUOTA = 2  # the tenant's byte quota (resident bytes charged) would be exceeded
REFUSED_POOL_FULL = 3  # not enough free blocks in the pool
REFUSED_NO_SEQ_SLOT = 4  # no free sequence slot
REFUSED_SEQ_FULL = 5  # the sequence's block table is full (append only)
SKIPPED_PADDING = 6  # the row was padding (INVALID tenant or sequence id)
REFUSED_GROWING = 7  # the tenant is growing past a cut ("grow-no-admit"): no new admissions
#                      while its device bytes are over its byte quota
REASONS = {
    OK: "ok",
    REFUSED_TOKEN_QUOTA: "over token quota",
    REFUSED_BYTE_QUOTA: "over byte quota",
    REFUSED_POOL_FULL: "pool full",
    REFUSED_NO_SEQ_SLOT: "no sequence slot",
    REFUSED_SEQ_FULL: "block table full",
    SKIPPED_PADDING: "padding row",
    REFUSED_GROWING: "tenant over its cut quota admits nothing new",
}

INT32_MAX = 2**31 - 1  # every counter in the state is int32; quotas and leases saturate here
INT32_MIN = -(2**31)
