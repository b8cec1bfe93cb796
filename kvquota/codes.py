"""Named codes stored in the state and in reports: sequence statuses, tiers, refusal reasons.

Values are part of the public contract (reports and results files carry them): existing codes keep
their numbers and new codes take new ones.
"""

# ---- sequence status (i8, `KVState.seqs.seq_status`) ---------------------------------------------
SEQ_FREE = 0  # slot unused: tenant INVALID, empty table
SEQ_RUNNING = 1  # holds its blocks, may append
SEQ_PREEMPTED = 2  # reserved: archived, to be replayed by recomputing prefill
SEQ_SUSPENDED = 3  # its own blocks offloaded to the host pool; not decodable until restored
# The fates of a reclaim (idle sessions, lossy survivors, "grow but admit nothing new") take the
# next numbers, 4 and up.
STATUS_NAMES = {SEQ_FREE: "free", SEQ_RUNNING: "running", SEQ_PREEMPTED: "preempted",
                SEQ_SUSPENDED: "suspended"}

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
REASONS = {
    OK: "ok",
    REFUSED_TOKEN_QUOTA: "over token quota",
    REFUSED_BYTE_QUOTA: "over byte quota",
    REFUSED_POOL_FULL: "pool full",
    REFUSED_NO_SEQ_SLOT: "no sequence slot",
    REFUSED_SEQ_FULL: "block table full",
    SKIPPED_PADDING: "padding row",
}

INT32_MAX = 2**31 - 1  # every counter in the state is int32; quotas and leases saturate here
