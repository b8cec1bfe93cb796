"""Serving on the paged state: engines (paged and dense), sampling, one-call generate/score."""

from kvquota.serving.branching import branch, extend
from kvquota.serving.dense import DenseEngine
from kvquota.serving.engine import Generation, PagedEngine, ScoreResult
from kvquota.serving.oneshot import generate, score, scoring_state_config
from kvquota.serving.sampling import Sampling, sample_tokens
from kvquota.serving.streaming import (
    CachePolicy,
    cache_bytes_by_pool,
    generate_streaming,
    score_streaming,
)
from kvquota.serving.stepwise import StepwiseEviction, score_stepwise, stepwise_state_config

__all__ = [
    "DenseEngine", "Generation", "PagedEngine", "ScoreResult", "generate", "score",
    "scoring_state_config", "Sampling", "sample_tokens", "CachePolicy", "cache_bytes_by_pool",
    "generate_streaming", "score_streaming", "branch", "extend", "StepwiseEviction",
    "score_stepwise", "stepwise_state_config",
]

# ---- the multi-tenant scheduler (issue #11) ------------------------------------------------------
from kvquota.serving.executors import CostModelExecutor, ModelExecutor, StepBatch, StepOutput
from kvquota.serving.metrics import JsonLines, read_json_lines
from kvquota.serving.requests import Event, Request, RequestStatus, Session
from kvquota.serving.scheduler import Scheduler, StepPlan
from kvquota.serving.waiting import WaitQueue

__all__ += [
    "CostModelExecutor", "ModelExecutor", "StepBatch", "StepOutput", "Event", "JsonLines",
    "Request", "RequestStatus", "Session", "read_json_lines", "Scheduler", "StepPlan",
    "WaitQueue",
]
