"""Reclaim in one action: plan (bytes per means, every sequence's fate, the shortfall), then apply."""

from kvquota.reclaim.plan import (
    MEANS,
    PRESETS,
    PlanStep,
    ReclaimPlan,
    ReclaimPolicy,
    ReclaimReport,
    ReclaimRequest,
    SeqArchive,
    SeqFate,
    get_reclaim_policy,
)
