"""Eviction policies: small registered dataclasses with one scoring hook (`score`)."""

from kvquota.policies.base import REGISTRY, EvictionPolicy, TokenView, get_policy
from kvquota.policies.scorers import (H2O, TOVA, H2OFixedWindow, KeyNorm, OldestFirst, Random,
                                      SnapKV, StreamingLLM)

__all__ = ["REGISTRY", "EvictionPolicy", "TokenView", "get_policy", "H2O", "H2OFixedWindow",
           "TOVA", "KeyNorm", "OldestFirst", "Random", "SnapKV", "StreamingLLM"]
