"""`DenseEngine`: the same model, prompts and sampling over a contiguous cache, the reference the
paged path is tested and benchmarked against."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import ModelConfig
from kvquota.errors import ContextTooLongError
from kvquota.model.caches import ChunkMeta, DenseKV, init_dense_cache
from kvquota.model.decoder import Decoder
from kvquota.serving.engine import _Engine, _bucket, check_context


@functools.partial(jax.jit, static_argnames=("model", "last_only"), donate_argnames=("cache",))
def _dense_forward(model: Decoder, params, cache, tokens, start, num_new, positions,
                   *, last_only: bool):
    """One chunk over a DenseKV cache (donates `cache`); rows are the batch's sequences."""
    meta = ChunkMeta(start=start, num_new=num_new)
    logits, cache = model.apply({"params": params}, tokens, positions, cache, meta, last_only)
    return cache, (logits[:, 0] if last_only else logits)




class DenseEngine(_Engine):
    """The same model over a contiguous cache `[L, B, Hkv, S, D]`: the paged path's reference.

    Rows are independent sequences; each `generate`/`score` call starts from an empty cache of
    `capacity` tokens per row (no prefix cache, no quotas).
    """

    def __init__(self, config: ModelConfig, params, *, capacity: int, chunk_size: int = 256,
                 cache_dtype=jnp.float32):
        check_context(config, capacity, "dense cache capacity")
        self.config = config
        self.params = jax.device_put(params)
        self.capacity = capacity
        self.chunk_size = chunk_size
        self.cache_dtype = cache_dtype
        self.model = Decoder(config)
        self.cache: DenseKV | None = None
        self._lens = np.zeros(0, np.int32)

    def prefill(self, prompts, *, last_only: bool = True, max_chunks: int | None = None):
        """Fresh cache with one row per prompt; chunked prefill (stopping after `max_chunks`
        if given). Returns logits as in `PagedEngine.admit`."""
        b = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        if lens.max() > self.capacity:
            raise ContextTooLongError(f"prompt of {lens.max()} tokens > capacity {self.capacity}")
        width = int(lens.max())
        toks = np.zeros((b, width), np.int32)
        for i, p in enumerate(prompts):
            toks[i, : len(p)] = p
        self.cache = init_dense_cache(self.config, b, self.capacity, self.cache_dtype)
        done = np.zeros(b, np.int32)
        last = np.zeros((b, self.config.vocab_size), np.float32)
        chunks = []
        while (done < lens).any() and (max_chunks is None or len(chunks) < max_chunks):
            t = _bucket(int((lens - done).max()), self.chunk_size)
            num_new = np.clip(lens - done, 0, t).astype(np.int32)
            idx = done[:, None] + np.arange(t)[None, :]
            chunk_tokens = np.take_along_axis(toks, np.minimum(idx, width - 1), axis=1)
            self.cache, logits = _dense_forward(
                self.model, self.params, self.cache, jnp.asarray(chunk_tokens),
                jnp.asarray(done), jnp.asarray(num_new), jnp.asarray(idx.astype(np.int32)),
                last_only=last_only)
            if last_only:
                finishing = (num_new > 0) & (done + num_new == lens)
                last[finishing] = np.asarray(logits)[finishing]
            chunks.append(logits)
            done = done + num_new
        self._lens = done.copy()
        return last if last_only else chunks

    def decode(self, rows, tokens):
        """One step: rows i32[B] (a row's own index, or INVALID to skip) -> logits f32[B, V]."""
        rows = np.asarray(rows, np.int32)
        real = rows >= 0
        if (self._lens[real] >= self.capacity).any():
            raise ContextTooLongError(f"dense cache capacity {self.capacity} reached")
        start = self._lens.copy()
        self.cache, logits = _dense_forward(
            self.model, self.params, self.cache,
            jnp.asarray(np.asarray(tokens, np.int32)[:, None]), jnp.asarray(start),
            jnp.asarray(real.astype(np.int32)), jnp.asarray(start[:, None]), last_only=True)
        self._lens = self._lens + real
        return logits

    @property
    def _capacity(self) -> int:
        return self.capacity

    def _prefill(self, prompts, tenants):
        b = len(prompts)
        last = self.prefill(prompts)
        return (np.arange(b, dtype=np.int32), np.zeros(b, np.int32),
                np.array([""] * b, dtype=object), jnp.asarray(last))

    def _decode(self, rows, tokens):
        logits = self.decode(rows, tokens)
        return np.ones(len(rows), bool), [""] * len(rows), logits

    def _release(self, ids):
        pass

    def _prefill_all(self, ids, tenant):
        return self.prefill([ids], last_only=False)


