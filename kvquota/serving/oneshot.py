"""One-call helpers over a fresh paged state (CLIs, tests): score a text, generate from prompts."""

from __future__ import annotations

import math
from typing import Sequence

from configs.models import ModelConfig
from kvquota.serving.engine import Generation, PagedEngine, ScoreResult, check_context, check_prompts
from kvquota.serving.sampling import Sampling
from kvquota.state import StateConfig


def scoring_state_config(config: ModelConfig, num_tokens: int, *, block_size: int = 16,
                         kv_format: str = "f32"):
    """A one-sequence, one-tenant state just large enough for `num_tokens`."""
    blocks = math.ceil(num_tokens / block_size)
    return StateConfig(model=config, num_blocks=blocks, block_size=block_size, max_seqs=1,
                       max_blocks_per_seq=blocks, num_tenants=1, kv_format=kv_format)


def score(config: ModelConfig, params, token_ids: Sequence[int], *, chunk_size: int = 256,
          return_logits: bool = False, block_size: int = 16, kv_format: str = "f32",
          backend: str = "auto") -> ScoreResult:
    """Teacher-forced scoring of `token_ids` on the paged path (a fresh one-tenant state)."""
    check_context(config, len(token_ids), "scoring")
    engine = PagedEngine(
        config, params, scoring_state_config(config, len(token_ids), block_size=block_size,
                                             kv_format=kv_format),
        chunk_size=chunk_size, backend=backend)
    engine.register_tenant(0, token_quota=len(token_ids), byte_quota=engine.max_byte_quota)
    return engine.score(token_ids, return_logits=return_logits, tenant=0)


def generate(config: ModelConfig, params, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, sampling: Sampling = Sampling(),
             stop_ids: Sequence[int] = (), chunk_size: int = 256, block_size: int = 16,
             kv_format: str = "f32", backend: str = "auto") -> list[Generation]:
    """Generates for `prompts` on the paged path (a fresh state, one private tenant)."""
    check_prompts(config, prompts, max_new_tokens)
    per_seq = math.ceil((max(len(p) for p in prompts) + max_new_tokens) / block_size)
    state_config = StateConfig(
        model=config, num_blocks=per_seq * len(prompts), block_size=block_size,
        max_seqs=len(prompts), max_blocks_per_seq=per_seq, num_tenants=1, kv_format=kv_format)
    engine = PagedEngine(config, params, state_config, chunk_size=chunk_size, backend=backend)
    engine.register_tenant(0, token_quota=2**31 - 1, byte_quota=engine.max_byte_quota)
    return engine.generate(prompts, max_new_tokens, tenants=[0] * len(prompts),
                           sampling=sampling, stop_ids=stop_ids)
