"""Serving on the paged state: engines (paged and dense), sampling, one-call generate/score."""

from kvquota.serving.dense import DenseEngine
from kvquota.serving.engine import Generation, PagedEngine, ScoreResult
from kvquota.serving.oneshot import generate, score, scoring_state_config
from kvquota.serving.sampling import Sampling, sample_tokens

__all__ = [
    "DenseEngine", "Generation", "PagedEngine", "ScoreResult", "generate", "score",
    "scoring_state_config", "Sampling", "sample_tokens",
]
