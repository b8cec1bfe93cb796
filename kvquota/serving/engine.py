"""Serving on the paged KV state: admit + chunked prefill, decode steps, generation, scoring.

`PagedEngine` drives the model (`kvquota.model.Decoder`) over the functional state through the
state's validating facade (`kvquota.allocator.Allocator`), always with `donate=True`: a serving
loop that copied the whole cache each step would measure the copy, not the cache. The model's own jitted forward donates the state
too. The engine owns `self.state`; it replaces it after each call and never reuses an old one.

One request's life:
  1. `admit`: the allocator reserves every prompt slot, taking full prompt blocks already in the
     prefix cache (same salt) by reference and reporting `cached_tokens`;
  2. prefill in chunks of `chunk_size`: the model writes the K/V of prompt tokens
     [cached_tokens, length) into the sequence's pages and attends through
     `kernels.paged_attention.prefill`;
  3. decode steps: `append` reserves the next slot (allocating a block at a boundary), then the
     model writes that token's K/V and attends through `kernels.paged_attention.decode`;
  4. `free` drops one reference per block-table entry.

`DenseEngine` (`kvquota.serving.dense`) runs the same model, prompts and sampling over a
contiguous cache: the reference the paged path is tested and benchmarked against. Both share
`generate` and `score`; one-call helpers live in `kvquota.serving.oneshot`.

Positions: a token's cache index is `seq_lens` before it is written; its RoPE position is the
state's logical `positions` (they differ after eviction).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import ModelConfig
from kvquota.core.statistics import record_mass_core
from kvquota.errors import ContextTooLongError, InvalidArgumentError
from kvquota.model.caches import ChunkMeta, PagedKV
from kvquota.model.decoder import Decoder
from kvquota.sentinel import INVALID
from kvquota.serving.sampling import Sampling, sample_tokens

# --------------------------------------------------------------------------------------------
# Jitted model calls.


@functools.partial(jax.jit, static_argnames=("model", "last_only", "pool_starts", "record"),
                   donate_argnames=("state",))
def _paged_forward(model: Decoder, params, state, seq_ids, tokens, start, num_new, positions,
                   *, last_only: bool, pool_starts: tuple[int, ...], record=None):
    """One chunk over the paged state (donates `state`); with `record` (static: a StateConfig)
    the chunk's attention mass (f32[B, L, Hkv, M * P], summed over its queries) is added into
    `blocks.head_mass` and, summed, `blocks.attn_mass`, and returned too.

    seq_ids i32[B] (INVALID rows are padding), tokens/positions i32[B, T], start/num_new i32[B].
    `pool_starts` (static): first global block id of each device pool the model reads, pool 0
    then the compressed pools (`StateConfig.pool_starts` less the host pool); `(0,)`: pool 0
    alone. Only pool 0 is written back. Returns (state with the chunk's K/V written, logits
    [B, V] if last_only else [B, T, V][, mass f32[B, L, Hkv, M * P]: `Decoder`'s with_mass]).
    """
    valid = seq_ids >= 0
    tables = state.seqs.block_tables[jnp.clip(seq_ids, 0)]
    tables = jnp.where(valid[:, None], tables, INVALID)
    num_new = jnp.where(valid, num_new, 0)
    meta = ChunkMeta(start=start, num_new=num_new, block_tables=tables)
    pool0 = state.pages[0]
    compressed = tuple((pool.k, pool.v) for pool in state.pages[1:len(pool_starts)])
    cache = PagedKV(k_pages=pool0.k, v_pages=pool0.v, compressed=compressed,
                    pool_starts=pool_starts)
    logits, cache, *mass = model.apply({"params": params}, tokens, positions, cache, meta,
                                       last_only, record is not None)  # [] or [f32[B,L,Hkv,C]]
    pool0 = pool0.replace(k=cache.k_pages, v=cache.v_pages)
    state = state.replace(pages=(pool0,) + state.pages[1:])
    if record is not None:  # the engine's own rows: unique, running (no facade validation)
        state, _ = record_mass_core.fn(record, state, seq_ids, mass[0])
    return (state, logits[:, 0] if last_only else logits, *mass)


@functools.partial(jax.jit, static_argnames=("model", "last_only"), donate_argnames=("cache",))
def _dense_forward(model: Decoder, params, cache, tokens, start, num_new, positions,
                   *, last_only: bool):
    """One chunk over a DenseKV cache (donates `cache`); rows are the batch's sequences."""
    meta = ChunkMeta(start=start, num_new=num_new)
    logits, cache = model.apply({"params": params}, tokens, positions, cache, meta, last_only)
    return cache, (logits[:, 0] if last_only else logits)


@jax.jit
def _token_logprobs(logits, targets):
    """log p(targets) f32[B, T] and argmax i32[B, T] of logits [B, T, V]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# Results.


@dataclasses.dataclass
class Generation:
    """One request's outcome.

    Attributes:
      tokens: generated token ids (the prompt excluded).
      finish: "stop" (a stop id, included in tokens), "length" (max_new_tokens), or
        "refused: <reason>" (admit refused, nothing generated) or "append refused: <reason>"
        (a quota or the pool ran out mid-generation).
      seq_id: sequence slot (paged), or the batch row (dense).
      cached_tokens: prompt tokens served from the prefix cache (0 on the dense path).
    """

    tokens: list[int]
    finish: str
    seq_id: int
    cached_tokens: int = 0


@dataclasses.dataclass
class ScoreResult:
    """Teacher-forced scoring of one token sequence.

    Attributes:
      token_ids: the ids fed to the model (T).
      nll: f64[T - 1]: -log p(token_{i+1} | tokens_{<=i}), natural log.
      top1: i32[T]: the model's most likely next token at each position.
      logits: f32[T, V] when asked for, else None.
    """

    token_ids: list[int]
    nll: np.ndarray
    top1: np.ndarray
    logits: np.ndarray | None = None

    @property
    def ppl(self) -> float:
        """exp(mean nll)."""
        return float(np.exp(np.mean(self.nll)))


def _bucket(n: int, cap: int, floor: int = 16) -> int:
    """Chunk length for n remaining tokens: a power of two >= floor, at most `cap`.

    Every distinct chunk shape is one more compile of the whole model; padding a short tail to
    16 tokens costs less than that on any model here.
    """
    return min(cap, max(floor, 1 << max(0, n - 1).bit_length()))


def check_context(config: ModelConfig, total: int, what: str):
    if total > config.max_context:
        raise ContextTooLongError(
            f"{what}: {total} tokens exceed {config.name}'s max_context {config.max_context}"
        )


def check_prompts(config: ModelConfig, prompts, extra: int):
    if not prompts:
        raise ValueError("no prompts given")
    for i, prompt in enumerate(prompts):
        if len(prompt) < 1:
            raise ValueError(f"prompt {i} is empty")
        check_context(config, len(prompt) + extra, f"prompt {i} + {extra} new tokens")
        bad = [t for t in prompt if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids outside [0, {config.vocab_size}): {bad[:5]}")


# --------------------------------------------------------------------------------------------
# Engines.


class _Engine:
    """Generation and scoring written once over `_prefill` and `_decode` (paged or dense)."""

    config: ModelConfig
    chunk_size: int

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 tenants: Sequence[int] | None = None, sampling: Sampling = Sampling(),
                 stop_ids: Sequence[int] = (), release: bool = True,
                 on_step=None) -> list[Generation]:
        """Generates up to `max_new_tokens` for each prompt, batched (rows stop independently).

        `tenants` (paged engine only) names each prompt's tenant. With `release`, finished
        sequences are freed at the end; otherwise they stay cached (for a later `free`).
        `on_step(seq_ids)` (paged engine only) runs after the prefill and after every decode
        step on the live rows' sequence ids (INVALID for finished rows): a cache policy's hook.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        check_prompts(self.config, prompts, max_new_tokens)
        # The last sampled token is returned, never cached: max_new_tokens - 1 appends.
        longest = max(len(p) for p in prompts) + max(max_new_tokens - 1, 0)
        if longest > self._capacity:
            raise ContextTooLongError(
                f"a prompt plus {max_new_tokens} new tokens needs {longest} cache slots; "
                f"this engine holds {self._capacity} per sequence")
        ids, cached, refused, last = self._prefill(prompts, tenants)
        b = len(prompts)
        out = [Generation([], "length", int(ids[i]), int(cached[i])) for i in range(b)]
        live = np.ones(b, bool)
        for i in range(b):
            if refused[i]:
                out[i].finish = f"refused: {refused[i]}"
                live[i] = False
        stops = set(int(s) for s in stop_ids)
        key = jax.random.key(sampling.seed)
        for step in range(max_new_tokens):
            if not live.any():
                break
            if on_step is not None:
                on_step(np.where(live, ids, INVALID).astype(np.int32))
            nxt = np.asarray(sample_tokens(
                last, jax.random.fold_in(key, step),
                temperature=float(sampling.temperature), top_k=int(sampling.top_k)))
            for i in np.flatnonzero(live):
                out[i].tokens.append(int(nxt[i]))
                if int(nxt[i]) in stops:
                    out[i].finish = "stop"
                    live[i] = False
            if step == max_new_tokens - 1 or not live.any():
                break
            rows = np.where(live, ids, INVALID).astype(np.int32)
            appended, reasons, last = self._decode(rows, np.where(live, nxt, 0).astype(np.int32))
            for i in np.flatnonzero(live & ~appended):
                out[i].finish = f"append refused: {reasons[i]}"
                live[i] = False
        if release:
            self._release(ids[ids >= 0])
        return out

    def score(self, token_ids: Sequence[int], *, return_logits: bool = False,
              tenant: int | None = None) -> ScoreResult:
        """Teacher-forced scoring: nll of each token given the ones before (prefill in chunks)."""
        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise ValueError(f"scoring needs at least 2 tokens, got {len(ids)}")
        check_prompts(self.config, [ids], 0)
        logits_chunks = self._prefill_all(ids, tenant)
        total = sum(int(c.shape[1]) for c in logits_chunks)
        targets = np.zeros(total, np.int32)  # padding positions score token 0, then are cut
        targets[: len(ids) - 1] = ids[1:]
        nll, top1, kept = [], [], []
        at = 0
        for logits in logits_chunks:
            t = logits.shape[1]
            lp, am = _token_logprobs(logits, jnp.asarray(targets[None, at:at + t]))
            nll.append(-np.asarray(lp[0], np.float64))
            top1.append(np.asarray(am[0]))
            if return_logits:
                kept.append(np.asarray(logits[0]))
            at += t
        return ScoreResult(
            token_ids=ids,
            nll=np.concatenate(nll)[: len(ids) - 1],
            top1=np.concatenate(top1)[: len(ids)],
            logits=np.concatenate(kept)[: len(ids)] if return_logits else None,
        )


class PagedEngine(_Engine):
    """The model serving from the paged KV state (see the module docstring).

    Args:
      config: model preset; params: its parameters (`kvquota.model.weights` layout).
      state_config: the state's static config (`kvquota.state.StateConfig`, model == config).
      chunk_size: prefill chunk length (tokens per sequence per forward call).
      backend: `kernels.paged_attention` backend ("auto": Pallas on GPU, reference on CPU).
      state: an existing state to serve from (default: a fresh one); the engine takes it over.
      record_attention: True: every query of the prefill and of the decode adds its attention
        mass, per layer and KV head, into the state (`blocks.head_mass`, summed into
        `blocks.attn_mass`: what H2O accumulates); "decode": decode steps only (a caller that
        observes a window of its own choosing, as SnapKV does); False: none. The last decode
        step's mass is `last_mass` f32[B, L, Hkv, M * P] (prefill chunks leave it as it is).
    """

    def __init__(self, config: ModelConfig, params, state_config, *, chunk_size: int = 256,
                 backend: str = "auto", state=None, record_attention: bool | str = False):
        from kvquota.allocator import Allocator

        if state_config.model != config:
            raise ValueError(
                f"state_config.model is {state_config.model.name!r}, the model is {config.name!r}"
            )
        if not state_config.with_pages:
            raise ValueError("the paged engine needs a state with pages (with_pages=True)")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.config = config
        # Once: numpy leaves would be copied every call. Arrays already placed stay as they are
        # (sharded weights may span other processes' devices, which device_put refuses).
        self.params = jax.tree_util.tree_map(
            lambda x: x if isinstance(x, jax.Array) else jax.device_put(x), params)
        self.allocator = Allocator(state_config)
        self.state = self.allocator.init() if state is None else state
        self.chunk_size = chunk_size
        self.model = Decoder(config, backend=backend)
        self.last_mass = None
        self.record_attention = record_attention

    @property
    def state_config(self):
        return self.allocator.config

    @property
    def pool_starts(self) -> tuple[int, ...]:
        """First block id of each pool the model reads: pool 0 and the compressed device pools
        (a running sequence's table may mix them; the host pool is never read)."""
        sc = self.state_config
        return sc.pool_starts[: 1 + len(sc.compressed_pools)]

    @property
    def _capacity(self) -> int:
        """Tokens one sequence can hold: its block table's width in tokens."""
        return self.state_config.max_tokens_per_seq

    @property
    def max_byte_quota(self) -> int:
        """The largest byte quota the state represents (int32 count of its byte units)."""
        return (2**31 - 1) * self.state_config.unit_bytes

    @property
    def record_attention(self) -> bool | str:
        """What records attention mass into the state: True (prefill and decode), "decode" or
        False. Settable between calls (e.g. a prompt's body unrecorded, then its observation
        window recorded: what SnapKV scores)."""
        return self._record_mode

    @record_attention.setter
    def record_attention(self, mode: bool | str):
        if not (isinstance(mode, bool) or mode == "decode"):
            raise InvalidArgumentError(f"record_attention must be True, False or 'decode', got "
                                       f"{mode!r}")
        self._record_mode = mode
        self._record = self.state_config if mode else None  # what decode steps pass

    @property
    def _record_prefill(self):
        """What prefill chunks pass as `_paged_forward`'s record (None: nothing recorded)."""
        return self._record if self._record_mode is True else None

    def register_tenant(self, tenant: int, *, token_quota: int, byte_quota: int,
                        share_group: int | None = None):
        """Registers a tenant (quotas in tokens and bytes; a shared group shares prefixes)."""
        self.state, report = self.allocator.register_tenant(
            self.state, tenant, token_quota=token_quota, byte_quota=byte_quota,
            share_group=share_group, donate=True)
        return report

    def ledger(self):
        return self.allocator.ledger(self.state)

    # ---- the serving steps ---------------------------------------------------------------
    def admit(self, tenants: Sequence[int], prompts: Sequence[Sequence[int]], *,
              last_only: bool = True):
        """Admits prompts and prefills their uncached tokens in chunks (`reserve` + `prefill`).

        Returns (AdmitReport with host arrays, logits): with `last_only`, f32[B, V], each row's
        last prompt token's logits; otherwise the list of each chunk's f32[B, T_c, V] logits
        (positions cached_tokens onwards).
        """
        report = self.reserve(tenants, prompts)
        return report, self.prefill(report, prompts, last_only=last_only)

    def reserve(self, tenants: Sequence[int], prompts: Sequence[Sequence[int]]):
        """The allocator's admit alone (donated): slots reserved, prefix hits taken. The caller
        must `prefill` before any other admit (the hit blocks' K/V is the prefill's to write)."""
        b = len(prompts)
        if len(tenants) != b:
            raise ValueError(f"{len(tenants)} tenants for {b} prompts")
        toks, lens = self._pad_prompts(prompts)
        self.state, report = self.allocator.admit(
            self.state, np.asarray(tenants, np.int32), toks, lens, donate=True)
        return jax.tree_util.tree_map(np.asarray, report)

    def _pad_prompts(self, prompts):
        """Prompts as i32[B, W] (zero padded) and lengths i32[B]; W a power of two within the
        table, since the allocator's admit compiles once per shape."""
        lens = np.array([len(p) for p in prompts], np.int32)
        width = min(_bucket(int(lens.max()), 1 << 30), self.state_config.max_tokens_per_seq)
        width = max(width, int(lens.max()))
        toks = np.zeros((len(prompts), width), np.int32)
        for i, p in enumerate(prompts):
            toks[i, : len(p)] = p
        return toks, lens

    def prefill(self, report, prompts, *, last_only: bool = True, max_chunks: int | None = None):
        """Writes the K/V of prompt tokens [cached_tokens, length) of admitted rows, in chunks.

        `max_chunks` stops early (benchmarks use one chunk to compile). Returns logits as
        `admit` does.
        """
        toks, lens = self._pad_prompts(prompts)
        b, width = toks.shape
        seq_ids = np.where(report.admitted, report.seq_id, INVALID).astype(np.int32)
        cached = np.where(report.admitted, report.cached_tokens, 0).astype(np.int32)
        # Logical position of cache index 0 (positions = RoPE position of the next token).
        pos0 = np.asarray(self.state.seqs.positions)[np.maximum(seq_ids, 0)] - lens
        last = np.zeros((b, self.config.vocab_size), np.float32)
        chunks = []
        done = np.where(report.admitted, cached, lens)
        while (done < lens).any() and (max_chunks is None or len(chunks) < max_chunks):
            t = _bucket(int((lens - done).max()), self.chunk_size)
            num_new = np.clip(lens - done, 0, t).astype(np.int32)
            idx = done[:, None] + np.arange(t)[None, :]
            chunk_tokens = np.take_along_axis(toks, np.minimum(idx, width - 1), axis=1)
            positions = (pos0[:, None] + idx).astype(np.int32)
            self.state, logits = _paged_forward(
                self.model, self.params, self.state, jnp.asarray(seq_ids),
                jnp.asarray(chunk_tokens), jnp.asarray(done, jnp.int32),
                jnp.asarray(num_new), jnp.asarray(positions), last_only=last_only,
                pool_starts=self.pool_starts, record=self._record_prefill)[:2]
            if last_only:
                finishing = (num_new > 0) & (done + num_new == lens)
                last[finishing] = np.asarray(logits)[finishing]
            chunks.append(logits)
            done = done + num_new
        return last if last_only else chunks

    def decode(self, seq_ids, tokens):
        """One decode step: append `tokens` i32[B] to `seq_ids` i32[B] (INVALID = padding) and
        run the model on them. Returns (AppendReport with host arrays, logits f32[B, V])."""
        seq_ids = np.asarray(seq_ids, np.int32)
        real, at = seq_ids >= 0, np.maximum(seq_ids, 0)
        start = np.where(real, np.asarray(self.state.seqs.seq_lens)[at], 0).astype(np.int32)
        position = np.where(real, np.asarray(self.state.seqs.positions)[at], 0).astype(np.int32)
        if real.any():
            check_context(self.config, int(position[real].max()) + 1, "decode")
        self.state, report = self.allocator.append(self.state, seq_ids, tokens, donate=True)
        report = jax.tree_util.tree_map(np.asarray, report)
        rows = np.where(report.appended, seq_ids, INVALID).astype(np.int32)
        self.state, logits, *mass = _paged_forward(
            self.model, self.params, self.state, jnp.asarray(rows),
            jnp.asarray(np.asarray(tokens, np.int32)[:, None]), jnp.asarray(start),
            jnp.asarray(report.appended.astype(np.int32)), jnp.asarray(position[:, None]),
            last_only=True, pool_starts=self.pool_starts, record=self._record)
        self.last_mass = mass[0] if mass else None  # f32[B, L, Hkv, M * P] with record_attention
        return report, logits

    def decode_hlo(self, rows: int) -> str:
        """The compiled HLO text of one decode step of `rows` rows on this engine's state, under
        the mesh in context: what `kvquota.sharding.collectives` reads to count a step's
        collectives."""
        z = jnp.zeros((rows, 1), jnp.int32)
        return _paged_forward.lower(
            self.model, self.params, self.state, jnp.arange(rows, dtype=jnp.int32), z,
            jnp.zeros(rows, jnp.int32), jnp.ones(rows, jnp.int32), z, last_only=True,
            pool_starts=self.pool_starts).compile().as_text()

    def free(self, seq_ids):
        """Frees sequences (one reference dropped per block-table entry)."""
        seq_ids = np.asarray(seq_ids, np.int32)
        self.state, report = self.allocator.free(self.state, seq_ids, donate=True)
        return report

    # ---- hooks of _Engine ----------------------------------------------------------------
    def _prefill(self, prompts, tenants):
        if tenants is None:
            raise ValueError("the paged engine needs a tenant per prompt")
        report, last = self.admit(tenants, prompts)
        refused = np.array(
            ["" if ok else reason for ok, reason in zip(report.admitted, report.reasons())],
            dtype=object)
        ids = np.where(report.admitted, report.seq_id, INVALID).astype(np.int32)
        cached = np.where(report.admitted, report.cached_tokens, 0)
        return ids, cached, refused, jnp.asarray(last)

    def _decode(self, rows, tokens):
        report, logits = self.decode(rows, tokens)
        return report.appended | (rows < 0), report.reasons(), logits

    def _release(self, ids):
        if len(ids):
            self.free(ids)

    def _prefill_all(self, ids, tenant):
        if tenant is None:
            raise ValueError("the paged engine needs the tenant to score as")
        report, chunks = self.admit([tenant], [ids], last_only=False)
        if not report.admitted[0]:
            raise RuntimeError(f"scoring refused by the allocator: {report.reasons()[0]}")
        if report.cached_tokens[0]:
            raise RuntimeError("scoring needs every position computed; prefix cache hit "
                               f"{report.cached_tokens[0]} tokens (use a private tenant)")
        self.free(report.seq_id[:1])
        return chunks
