"""The reclaim verbs of the facade: session lifecycle (idle, resume, preempt), plan_reclaim,
apply_plan and rebalance. A mixin of `kvquota.allocator.Allocator`."""

from __future__ import annotations


class ReclaimOps:
    """Lifecycle, plan / apply and rebalance; `self.config` and the validation helpers come from
    the Allocator."""
