"""Lossy cache policies applied while a sequence grows: compress the blocks that fall out of a
full-precision recent window, or evict down to a token budget, before the next token attends.

This is how `score --kv_format=int8` and `--evict_policy=h2o --budget_tokens=N` measure what a
lossy means costs: teacher-forced scoring in chunks of one block, the policy applied before
each chunk, so every position past the window (or the budget) sees the compressed (or the
evicted) cache. A full-precision format and no eviction compress nothing: the scores then equal
ordinary scoring.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from configs.formats import get_kv_format
from configs.models import ModelConfig
from kvquota.errors import InvalidArgumentError
from kvquota.policies import get_policy
from kvquota.serving.engine import PagedEngine, ScoreResult, _paged_forward, _token_logprobs
from kvquota.serving.engine import check_context
from kvquota.state import StateConfig


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    """What happens to a growing sequence's cache.

    Attributes:
      kv_format: a compressed format (quantized or fp8) to compress into, or None.
      keep_recent: tokens at the end kept in full precision (KIVI's residual window).
      evict_policy: a registered eviction policy name (kvquota.policies), or None.
      budget_tokens: with evict_policy, the tokens kept after each eviction.
    """

    kv_format: Optional[str] = None
    keep_recent: int = 32
    evict_policy: Optional[str] = None
    budget_tokens: Optional[int] = None

    def __post_init__(self):
        if self.kv_format is not None and not get_kv_format(self.kv_format).compressed:
            raise InvalidArgumentError(f"{self.kv_format!r} is a full-precision format: "
                                       "nothing to compress into")
        if not isinstance(self.keep_recent, int) or self.keep_recent < 0:
            raise InvalidArgumentError(f"keep_recent must be >= 0, got {self.keep_recent!r}")
        if (self.evict_policy is None) != (self.budget_tokens is None):
            raise InvalidArgumentError("evict_policy and budget_tokens go together")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise InvalidArgumentError(f"budget_tokens must be >= 1, got {self.budget_tokens}")
        if self.kv_format is not None and self.evict_policy is not None:
            raise InvalidArgumentError("compress or evict, one lossy means at a time")

    @property
    def lossless(self) -> bool:
        return self.kv_format is None and self.evict_policy is None

    def state_config(self, model: ModelConfig, num_tokens: int, block_size: int,
                     kv_format: str) -> StateConfig:
        """A one-sequence, one-tenant state for `num_tokens`: pool 0 in `kv_format` (full
        precision) and, when compressing, a compressed pool that can take every block."""
        blocks = math.ceil(num_tokens / block_size) + 1  # + 1: a copy on write when evicting
        pools = ((self.kv_format, blocks),) if self.kv_format else ()
        return StateConfig(model=model, num_blocks=blocks, block_size=block_size, max_seqs=1,
                           max_blocks_per_seq=blocks, num_tenants=1, kv_format=kv_format,
                           compressed_pools=pools)

    def apply(self, engine: PagedEngine, seq_ids: np.ndarray) -> None:
        """Compress or evict `seq_ids` of the engine's state, in place of `engine.state`."""
        alloc = engine.allocator
        if self.kv_format is not None:
            engine.state, _ = alloc.compress(engine.state, seq_ids, kv_format=self.kv_format,
                                             keep_recent=self.keep_recent, donate=True)
        elif self.evict_policy is not None:
            lens = np.asarray(engine.state.seqs.seq_lens)[np.maximum(seq_ids, 0)]
            if (lens > self.budget_tokens).any():
                last = getattr(engine, "last_mass", None)  # TOVA reads the last step's
                if last is None and "last_attention" in get_policy(self.evict_policy).needs:
                    return  # no decode step yet (right after the prefill): evict next time
                engine.state, _ = alloc.evict(engine.state, seq_ids, policy=self.evict_policy,
                                              keep_tokens=self.budget_tokens,
                                              recent=min(self.keep_recent, self.budget_tokens),
                                              attention=None if last is None else
                                              np.asarray(last), donate=True)


def cache_bytes_by_pool(engine: PagedEngine) -> dict[str, int]:
    """Bytes of the blocks held in each pool (pool name -> bytes), from the state's ledger."""
    sc = engine.state_config
    held = np.asarray(sc.pool_sizes) - engine.allocator.allocatable_blocks(engine.state)
    names = list(sc.precisions) + (["host"] if sc.host_blocks else [])
    return {name: int(n) * b for name, n, b in zip(names, held, sc.pool_bytes)}


def score_streaming(config: ModelConfig, params, token_ids: Sequence[int], policy: CachePolicy,
                    *, block_size: int = 16, kv_format: str = "f32", backend: str = "auto",
                    return_logits: bool = False) -> tuple[ScoreResult, dict[str, int]]:
    """Teacher-forced scoring one block at a time, `policy` applied before each block attends.
    An eviction policy that reads attention mass (H2O, SnapKV) scores what every query so far
    gave each token (each block's mass is recorded as it is written). Returns the scores and
    the bytes each pool holds at the end."""
    ids = [int(t) for t in token_ids]
    if len(ids) < 2:
        raise ValueError(f"scoring needs at least 2 tokens, got {len(ids)}")
    check_context(config, len(ids), "scoring")
    reads_mass = policy.evict_policy is not None and get_policy(policy.evict_policy).reads_mass
    engine = PagedEngine(config, params, policy.state_config(config, len(ids), block_size,
                                                             kv_format),
                         chunk_size=block_size, backend=backend, record_attention=reads_mass)
    engine.register_tenant(0, token_quota=len(ids), byte_quota=engine.max_byte_quota)
    first = ids[:block_size]
    report, chunks = engine.admit([0], [first], last_only=False)
    seq = np.asarray(report.seq_id[:1], np.int32)
    for at in range(len(first), len(ids), block_size):
        policy.apply(engine, seq)
        chunk = ids[at:at + block_size]
        start = int(engine.state.seqs.seq_lens[seq[0]])
        pos = int(engine.state.seqs.positions[seq[0]])
        for t in chunk:  # reserve the chunk's slots (a block boundary allocates)
            engine.state, rep = engine.allocator.append(engine.state, seq,
                                                        np.asarray([t], np.int32), donate=True)
            if not bool(rep.appended[0]):
                raise RuntimeError(f"scoring refused by the allocator: {rep.reasons()[0]}")
        width = block_size
        toks = np.zeros((1, width), np.int32)
        toks[0, : len(chunk)] = chunk
        positions = (pos + np.arange(width, dtype=np.int32))[None, :]
        engine.state, logits = _paged_forward(
            engine.model, engine.params, engine.state, jnp.asarray(seq), jnp.asarray(toks),
            jnp.asarray([start], jnp.int32), jnp.asarray([len(chunk)], jnp.int32),
            jnp.asarray(positions), last_only=False, pool_starts=engine.pool_starts,
            record=engine._record_prefill)[:2]
        chunks.append(logits[:, : len(chunk)])
    held = cache_bytes_by_pool(engine)
    logits = jnp.concatenate([c[:, : min(c.shape[1], len(ids))] for c in chunks], axis=1)
    logits = logits[:, : len(ids)]
    targets = np.zeros((1, logits.shape[1]), np.int32)
    targets[0, : len(ids) - 1] = ids[1:]
    lp, top1 = _token_logprobs(logits, jnp.asarray(targets))
    result = ScoreResult(token_ids=ids, nll=-np.asarray(lp[0], np.float64)[: len(ids) - 1],
                         top1=np.asarray(top1[0]),
                         logits=np.asarray(logits[0]) if return_logits else None)
    return result, held


def generate_streaming(config: ModelConfig, params, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int, policy: CachePolicy, *, sampling=None,
                       stop_ids: Sequence[int] = (), block_size: int = 16,
                       kv_format: str = "f32", backend: str = "auto"):
    """Generation with `policy` applied after the prefill and after every decode step (one
    private tenant, a fresh state). Returns (generations, bytes held per pool at the end)."""
    from kvquota.serving.sampling import Sampling

    longest = max(len(p) for p in prompts) + max_new_tokens
    one = policy.state_config(config, longest, block_size, kv_format)
    n = len(prompts)
    pools = tuple((name, blocks * n) for name, blocks in one.compressed_pools)
    state_config = dataclasses.replace(one, num_blocks=one.num_blocks * n, max_seqs=n,
                                       compressed_pools=pools)
    # Prefill and decode steps record their attention mass, which H2O/SnapKV/TOVA and
    # "coldest" read.
    engine = PagedEngine(config, params, state_config, chunk_size=256, backend=backend,
                         record_attention=not policy.lossless)
    engine.register_tenant(0, token_quota=2**31 - 1, byte_quota=engine.max_byte_quota)
    out = engine.generate(prompts, max_new_tokens, tenants=[0] * n,
                          sampling=sampling or Sampling(), stop_ids=stop_ids, release=False,
                          on_step=None if policy.lossless else lambda ids: policy.apply(
                              engine, ids))
    return out, cache_bytes_by_pool(engine)
