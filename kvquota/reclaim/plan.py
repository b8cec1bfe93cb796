"""The data of a reclaim: what was asked (ReclaimRequest), how to answer (ReclaimPolicy and its
presets), what will happen (ReclaimPlan) and what did (ReclaimReport).

All plain frozen dataclasses of Python ints and tuples, so a plan prints, compares, serialises to
JSON (`summary()`) and plots without touching the device. Bytes are exact Python ints.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from kvquota.codes import FATE_NAMES
from kvquota.errors import InvalidArgumentError
from kvquota.reclaim.means import REGISTRY

REQUEST_KINDS = ("quota_cut", "lease_expiry", "make_room")


@dataclasses.dataclass(frozen=True)
class ReclaimRequest:
    """Why a reclaim runs.

    * `quota_cut`: tenant's device byte quota becomes `byte_quota`; what it is charged above that
      must come back.
    * `lease_expiry`: everything of `tenant` goes (device and host); shared blocks pass to heirs.
    * `make_room`: `bytes_needed` bytes of pool 0 must become allocatable for `tenant`, taken from
      the other tenants.
    """

    kind: str
    tenant: int
    byte_quota: Optional[int] = None
    bytes_needed: Optional[int] = None

    @classmethod
    def quota_cut(cls, tenant: int, byte_quota: int) -> "ReclaimRequest":
        return cls("quota_cut", tenant, byte_quota=byte_quota)

    @classmethod
    def lease_expiry(cls, tenant: int) -> "ReclaimRequest":
        return cls("lease_expiry", tenant)

    @classmethod
    def make_room(cls, tenant: int, bytes_needed: int) -> "ReclaimRequest":
        return cls("make_room", tenant, bytes_needed=bytes_needed)


# The built-in means, in the tiered order of DESIGN.md §1.4 (kvquota.reclaim.means holds one class
# each; a policy lists any registered means). Cold cached blocks are charged to no one and already
# count as free capacity, so they are no means toward a target; `rebalance` drops them when asked.
#   drop_idle: IDLE sessions of inactive tenants, KV dropped (preempted: replay on resume)
#   offload_idle: IDLE sessions' own blocks to host (suspended)
#   suspend_running: RUNNING sequences' own blocks to host (suspended)
#   compress: own cold full blocks into a compressed pool (lossy)
#   preempt: RUNNING sequences' KV dropped; replay by recomputing prefill
#   evict: whole blocks of the least-scored tokens dropped for good (lossy); off by default
MEANS = tuple(REGISTRY)
VICTIM_ORDERS = ("newest", "largest", "priority")


@dataclasses.dataclass(frozen=True)
class ReclaimPolicy:
    """How a reclaim is answered: which means, in which order, on which sequences first.

    Attributes:
      name: preset name (or the caller's own).
      means: the means used, in order (names registered in kvquota.reclaim.means).
      allow_evict: eviction runs only when this is True, even if listed (the last resort).
      take_all: each step takes every sequence it can, not just until the target is met.
      victim_order: which sequences go first: "newest" (latest admitted, as vLLM), "largest"
        (most device bytes), "priority" (lowest `priorities` first; unlisted sequences 0).
      priorities: ((seq id, priority), ...) for victim_order "priority".
      compress_format: the compressed pool written (None: the config's first compressed pool).
      compress_keep_recent: tokens at each sequence's end kept in full precision.
      compress_gated: compress only when the host alarm rings or the host pool cannot take the
        rest (DESIGN.md §1.4); False compresses whenever the step is reached.
      evict_policy: eviction scorer name (kvquota.policies) for the evict step.
      evict_keep_tokens: tokens each evicted sequence keeps (whole blocks, at least one).
      grow_no_admit: take nothing; after a quota cut the tenant keeps decoding past it while its
        admissions are refused (REFUSED_GROWING) until it is under its quota again (for other
        requests the whole target is a shortfall).
      rebalance: end with a rebalance step (recycle preempted slots, make capacity allocatable).
    """

    name: str = "tiered"
    means: tuple[str, ...] = ("drop_idle", "offload_idle", "suspend_running", "compress",
                              "preempt", "evict")
    allow_evict: bool = False
    take_all: bool = False
    victim_order: str = "newest"
    priorities: tuple[tuple[int, int], ...] = ()
    compress_format: Optional[str] = None
    compress_keep_recent: int = 32
    compress_gated: bool = True
    evict_policy: str = "streamingllm"
    evict_keep_tokens: int = 64
    grow_no_admit: bool = False
    rebalance: bool = True

    def __post_init__(self):
        unknown = [m for m in self.means if m not in REGISTRY]
        if unknown:
            raise InvalidArgumentError(f"unknown reclaim means {unknown}; known: "
                                       f"{', '.join(REGISTRY)}")
        if len(set(self.means)) != len(self.means):
            raise InvalidArgumentError(f"a reclaim means is listed twice: {self.means}")
        if self.victim_order not in VICTIM_ORDERS:
            raise InvalidArgumentError(f"unknown victim_order {self.victim_order!r}; known: "
                                       f"{', '.join(VICTIM_ORDERS)}")
        if self.compress_keep_recent < 0 or self.evict_keep_tokens < 1:
            raise InvalidArgumentError("compress_keep_recent must be >= 0 and evict_keep_tokens >= 1")


PRESETS = {
    "tiered": ReclaimPolicy(),
    # vLLM V1: no swapping; requests are dropped and recomputed when they come back.
    "preempt-all": ReclaimPolicy(name="preempt-all", means=("preempt",), take_all=True),
    "swap-all": ReclaimPolicy(name="swap-all", means=("offload_idle", "suspend_running"),
                              take_all=True),
    "evict-first": ReclaimPolicy(name="evict-first", means=("evict", "preempt"),
                                 allow_evict=True),
    "grow-no-admit": ReclaimPolicy(name="grow-no-admit", means=(), grow_no_admit=True,
                                   rebalance=False),
}


def get_reclaim_policy(policy) -> ReclaimPolicy:
    """A ReclaimPolicy from a preset name, or the policy itself."""
    if isinstance(policy, ReclaimPolicy):
        return policy
    if policy not in PRESETS:
        raise InvalidArgumentError(f"unknown reclaim policy {policy!r}; presets: "
                                   f"{', '.join(PRESETS)}")
    return PRESETS[policy]


@dataclasses.dataclass(frozen=True)
class PlanStep:
    """One means applied to some sequences, with the bytes it moves.

    quota_bytes: device quota bytes the requesting side gets back (charges released by the
      target tenant(s); for compress, net of the compressed copy).
    pool_bytes: device bytes returned to the pools' free capacity (pool 0 and compressed pools,
      net of blocks the step itself takes there).
    pool0_bytes: of which pool 0's: what a "make room" request counts.
    host_bytes: bytes written into the host pool.
    blocks: blocks moved, freed, compressed or dropped from tables.
    per_seq: ((seq, blocks), ...) the blocks each sequence gives.
    """

    means: str
    seqs: tuple[int, ...] = ()
    blocks: int = 0
    quota_bytes: int = 0
    pool_bytes: int = 0
    pool0_bytes: int = 0
    host_bytes: int = 0
    per_seq: tuple[tuple[int, int], ...] = ()

    def summary(self) -> dict:
        return dataclasses.asdict(self)


def progress(request: ReclaimRequest, step: PlanStep) -> int:
    """A step's bytes toward the request's target: the victims' device quota bytes released
    (quota cut, lease expiry) or pool-0 bytes made allocatable (make room)."""
    return step.pool0_bytes if request.kind == "make_room" else step.quota_bytes


def bytes_by_means(request, steps) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in steps:
        out[s.means] = out.get(s.means, 0) + progress(request, s)
    return out


@dataclasses.dataclass(frozen=True)
class SeqFate:
    """What one sequence does after the reclaim, and what coming back costs it.

    resume_tokens: tokens to recompute (preempted: cached length minus the prefix-cache hits
      expected on re-admission, assuming the blocks that are cached now still are then: others'
      allocations may reuse them while it waits, so the cost paid can be higher).
      resume_bytes: bytes to prefetch from host (suspended).
    resume_seconds: resume_bytes at the configured host bandwidth (a model).
    """

    seq: int
    tenant: int
    fate: int
    tokens: int
    resume_tokens: int = 0
    resume_bytes: int = 0
    resume_seconds: float = 0.0

    @property
    def fate_name(self) -> str:
        return FATE_NAMES[self.fate]

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d["fate"] = self.fate_name
        return d


@dataclasses.dataclass(frozen=True)
class ReclaimPlan:
    """Ordered steps, every affected sequence's fate, and what cannot be had.

    target_bytes: device quota bytes the request asks for. planned_bytes: what the steps give
    (sum of their quota_bytes). shortfall_bytes: max(0, target - planned), never hidden.
    pinned_bytes_held / shared_bytes_held: the target's bytes that stay because pins hold them /
    because other tenants' sequences reference them (their charge passes to an heir or stays).
    version: the version (`KVState.meta.version`) of the state the plan was made for;
    apply_plan refuses any other.
    """

    request: ReclaimRequest
    policy: ReclaimPolicy
    target_bytes: int
    steps: tuple[PlanStep, ...]
    fates: tuple[SeqFate, ...]
    shortfall_bytes: int
    pinned_bytes_held: int
    shared_bytes_held: int
    version: tuple[int, ...] = dataclasses.field(repr=False, default=())

    @property
    def planned_bytes(self) -> int:
        """What the steps give toward the target, in the request's measure."""
        return sum(progress(self.request, s) for s in self.steps)

    def bytes_by_means(self) -> dict[str, int]:
        return bytes_by_means(self.request, self.steps)

    def summary(self) -> dict:
        return dict(request=dataclasses.asdict(self.request), policy=self.policy.name,
                    target_bytes=self.target_bytes, planned_bytes=self.planned_bytes,
                    shortfall_bytes=self.shortfall_bytes,
                    pinned_bytes_held=self.pinned_bytes_held,
                    shared_bytes_held=self.shared_bytes_held,
                    steps=[s.summary() for s in self.steps],
                    fates=[f.summary() for f in self.fates])

    def __str__(self) -> str:
        r = self.request
        lines = [f"reclaim plan: {r.kind} of tenant {r.tenant} under policy {self.policy.name!r}: "
                 f"target {self.target_bytes:,} B, planned {self.planned_bytes:,} B, shortfall "
                 f"{self.shortfall_bytes:,} B (pins hold {self.pinned_bytes_held:,} B, other "
                 f"tenants {self.shared_bytes_held:,} B)"]
        for i, s in enumerate(self.steps):
            lines.append(f"  {i + 1}. {s.means:<16} seqs {list(s.seqs)}: {s.blocks} blocks, quota "
                         f"{s.quota_bytes:,} B, pool {s.pool_bytes:,} B, host {s.host_bytes:,} B")
        for f in self.fates:
            cost = (f"recompute {f.resume_tokens} tokens (if the {f.tokens - f.resume_tokens} "
                    "before them are still cached when it comes back)" if f.resume_tokens else
                    f"prefetch {f.resume_bytes:,} B ({f.resume_seconds * 1e3:.3f} ms)"
                    if f.resume_bytes else "no resume cost")
            lines.append(f"  seq {f.seq} (tenant {f.tenant}, {f.tokens} tokens): "
                         f"{f.fate_name}, {cost}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class SeqArchive:
    """What a preempted sequence needs to be replayed: its cached token ids (in cache order) and
    logical position. The caller keeps its own generation state beside it."""

    seq: int
    tenant: int
    token_ids: np.ndarray  # i32[length]
    position: int


@dataclasses.dataclass(frozen=True)
class ReclaimReport:
    """What apply_plan did: the steps with the bytes actually moved (equal to the plan's), the
    fates, the archives of preempted sequences, and the rebalance's work."""

    plan: ReclaimPlan
    steps: tuple[PlanStep, ...]
    fates: tuple[SeqFate, ...]
    archives: tuple[SeqArchive, ...]
    rebalance: dict
    shortfall_bytes: int

    @property
    def reclaimed_bytes(self) -> int:
        return sum(progress(self.plan.request, s) for s in self.steps)

    def bytes_by_means(self) -> dict[str, int]:
        return bytes_by_means(self.plan.request, self.steps)

    def summary(self) -> dict:
        return dict(reclaimed_bytes=self.reclaimed_bytes, by_means=self.bytes_by_means(),
                    shortfall_bytes=self.shortfall_bytes, rebalance=dict(self.rebalance),
                    steps=[s.summary() for s in self.steps],
                    fates=[f.summary() for f in self.fates],
                    preempted=[a.seq for a in self.archives])
