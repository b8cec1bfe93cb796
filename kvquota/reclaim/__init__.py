"""Reclaim in one action: plan (bytes per means, every sequence's fate, the shortfall), then apply.
Each means is one class in `kvquota.reclaim.means`, registered by name."""

from kvquota.reclaim.means import Means, get_means, register
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
