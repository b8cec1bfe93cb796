"""Step executors of the serving scheduler: one jitted call and one small readback per step.

A step is the decode rows (each appends its pending token, runs the model on it and samples the
next) plus the prefill rows (a chunk of each one's context written into its pages; a row whose
chunk ends its context samples its first token). `kvquota.serving.scheduler.Scheduler` builds the
step as host arrays (`StepBatch`, fixed padded shapes so each executor compiles a handful of
variants), and an executor runs it:

  * `ModelExecutor`: the real model over the state's pages. Append (the allocator's core, validated
    by the scheduler against its host mirror, not by the facade), the decode forward, the prefill
    forward and sampling are fused in one jitted call that donates the state.
  * `CostModelExecutor`: a metadata-only state; the same append, no model. Its step time is
    modelled: weights and KV bytes read over the HBM bandwidth, prefill tokens at a prefill rate,
    host transfers over the host bandwidth (H200 defaults). It also runs a scheduling pass of K
    steps in one call (`run_pass`, multi-step scheduling: `Scheduler(steps_per_pass=K)`).

Both read back one int32 vector per step: the sampled tokens, the append outcome and the ledger
columns the metrics need (charged blocks per tenant and pool, used tokens, free blocks), so the
scheduler's per-step host work is O(batch + tenants), never O(pool). `syncs` counts the readbacks.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import ModelConfig
from kvquota.core.admission import append_core
from kvquota.core.scatter import clip
from kvquota.codes import SEQ_FREE, SEQ_RUNNING
from kvquota.errors import ConfigMismatchError, InvalidArgumentError, InvariantError
from kvquota.model.decoder import Decoder
from kvquota.policies.base import get_policy
from kvquota.sentinel import INVALID
from kvquota.serving.engine import _paged_forward
from kvquota.serving.sampling import Sampling
from kvquota.state import StateConfig, pool_of

# H200 SXM: 4.8 TB/s HBM3e, ~989 TFLOP/s dense bf16; host link: StateConfig.host_bandwidth.
H200_HBM_BANDWIDTH = 4.8e12
H200_BF16_FLOPS = 989e12
H200_NVLINK_BANDWIDTH = 450e9  # NVLink 4: 900 GB/s per GPU, both directions together
INF = float("inf")


def bucket(n: int, cap: int, floor: int = 16) -> int:
    """A power of two >= n (at least `floor`, at most `cap`): one compile per bucket."""
    return min(cap, max(floor, 1 << max(0, n - 1).bit_length()))


@dataclasses.dataclass
class StepBatch:
    """One step's rows, as host arrays of fixed padded shapes (INVALID rows are padding).

    dec_seq/dec_tok/dec_key: i32[Bd], i32[Bd], i32[Bd, 2]: decode rows, the pending token each
      appends, and its sampling key (request id, index of the token sampled).
    pre_seq/pre_start/pre_num/pre_key: i32[Bp] x 3, i32[Bp, 2]: prefill rows, the cache index of
      their chunk's first token, its real length, and the key of the token sampled after it.
    pre_tok/pre_pos: i32[Bp, T]: the chunk's token ids and their logical (RoPE) positions.
    host_bytes: bytes the host link moves in this step (restores, offloads; the scheduler's
      queue: what does not fit in a step spills into the next).
    row_pools: i32[Bd + Bp, POOLS]: each row's table entries in pools 1.. (column 0 unused),
      from the host mirror: what the cost model's KV read is made of beside pool 0.
    """

    dec_seq: np.ndarray
    dec_tok: np.ndarray
    dec_key: np.ndarray
    pre_seq: np.ndarray
    pre_tok: np.ndarray
    pre_start: np.ndarray
    pre_num: np.ndarray
    pre_pos: np.ndarray
    pre_key: np.ndarray
    host_bytes: int = 0
    row_pools: np.ndarray = None
    hbm_bytes: int = 0  # reclaim work on the device since the last step (compress, evict)
    plans: int = 0  # reclaim plans made since the last step

    has_prefill = property(lambda self: bool((self.pre_seq >= 0).any()))
    prefill_tokens = property(lambda self: int(np.where(self.pre_seq >= 0, self.pre_num, 0).sum()))


@functools.partial(jax.jit, static_argnames=("config",))
def _pool_entries(tables, *, config):
    """i32[S, POOLS]: each slot's table entries per pool (O(slots x MB), after reclaims only)."""
    entries = tables >= 0
    pools = pool_of(config, clip(tables))
    return jnp.stack([(entries & (pools == k)).sum(axis=1) for k in range(config.num_pools)],
                     axis=1).astype(jnp.int32)


class HostMirror:
    """The scheduler's host copy of every slot's cached length, logical position, status and
    tenant (i32[S] / i8[S] NumPy arrays), kept exact by the scheduler after each op, and
    re-read from the state (one sync, O(slots)) after ops it does not model (reclaims). With
    `config`, also each slot's table entries per pool (`pools` i32[S, POOLS]): only a reclaim
    (compress, evict, offload) or a restore moves entries out of pool 0, and a new sequence
    starts in pool 0 (only full-precision device blocks are prefix-cache hits)."""

    def __init__(self, state, config: StateConfig | None = None):
        self.config = config
        self.refresh(state)

    def refresh(self, state):
        s = state.seqs
        got = jax.device_get((s.seq_lens, s.positions, s.seq_status, s.seq_tenant))
        self.length, self.position, self.status, self.tenant = (np.array(a) for a in got)
        self.pools = None if self.config is None else np.array(jax.device_get(
            _pool_entries(s.block_tables, config=self.config)))

    def set(self, seqs, *, length=0, status=SEQ_FREE, tenant=INVALID):
        q = np.asarray(seqs, np.int64)
        self.length[q] = self.position[q] = length
        self.status[q], self.tenant[q] = status, tenant
        if self.pools is not None:
            self.pools[q] = 0

    def restored(self, seq: int):
        """A restore brought the slot's host entries back to pool 0."""
        if self.pools is not None and self.config.host_pool is not None:
            self.pools[seq, self.config.host_pool] = 0

    def check_decode(self, config: StateConfig, seqs):
        """What the facade's append would check, on the mirror: RUNNING, table not full,
        position inside the model's context, each row once."""
        seqs = np.asarray(seqs, np.int32)
        ok = ((self.status[seqs] == SEQ_RUNNING).all() and len(set(seqs.tolist())) == len(seqs)
              and (self.length[seqs] < config.max_tokens_per_seq).all()
              and (self.position[seqs] < config.model.max_context).all())
        if not ok:
            raise InvariantError([f"decode rows the host mirror does not allow: {seqs.tolist()}"])


def build_batch(executor, dec, pre, mirror: HostMirror, host_bytes: int = 0) -> StepBatch:
    """The StepBatch of decode requests `dec` and prefill (request, chunk length) pairs `pre`,
    padded to the executor's fixed shapes, checked against the host mirror (the chunk's RoPE
    positions start at the slot's position - length)."""
    # seq, pending token, request id, tokens so far: one pass, one conversion
    rows = np.array([x for r in dec for x in (r.seq, r.tokens[-1], r.id, len(r.tokens))],
                    np.int32).reshape(len(dec), 4)
    mirror.check_decode(executor.state_config, rows[:, 0])
    m_len, m_pos = mirror.length, mirror.position
    bd, bp = executor.decode_width(len(dec)), executor.prefill_rows
    width = executor.chunk_width(max((n for _, n in pre), default=1))
    b = StepBatch(np.full(bd, INVALID, np.int32), np.zeros(bd, np.int32),
                  np.zeros((bd, 2), np.int32), np.full(bp, INVALID, np.int32),
                  np.zeros((bp, width), np.int32), np.zeros(bp, np.int32),
                  np.zeros(bp, np.int32), np.zeros((bp, width), np.int32),
                  np.zeros((bp, 2), np.int32), host_bytes)
    n = len(dec)
    b.dec_seq[:n], b.dec_tok[:n], b.dec_key[:n] = rows[:, 0], rows[:, 1], rows[:, 2:]
    if mirror.pools is not None:
        b.row_pools = np.zeros((bd + bp, mirror.pools.shape[1]), np.int32)
        b.row_pools[: len(dec)] = mirror.pools[b.dec_seq[: len(dec)]]
        b.row_pools[bd: bd + len(pre)] = mirror.pools[[r.seq for r, _ in pre]]
    for i, (r, n) in enumerate(pre):
        b.pre_seq[i], b.pre_start[i], b.pre_num[i] = r.seq, r.prefilled, n
        b.pre_tok[i, :n] = r.context_ids()[r.prefilled: r.prefilled + n]  # converted once
        b.pre_pos[i] = m_pos[r.seq] - m_len[r.seq] + r.prefilled + np.arange(width)
        b.pre_key[i] = (r.id, len(r.tokens))
    return b


@dataclasses.dataclass
class StepOutput:
    """What one step read back (host arrays) and how long it took.

    dec_next i32[Bd], appended bool[Bd], reason i32[Bd] (kvquota.codes), pre_next i32[Bp];
    charged i32[T, POOLS], used_tokens i32[T], free_blocks i32[POOLS] after the step;
    block_reads i32[POOLS]: table entries the step's rows attend over (cost model only, else 0).
    slack_tokens: unused token slots in the blocks of the step's rows (table entries x block
      size - cached length, summed; cost model only, else 0): the partly filled blocks' waste.
    seconds: wall time (ModelExecutor) or modelled time (CostModelExecutor).
    """

    dec_next: np.ndarray
    appended: np.ndarray
    reason: np.ndarray
    pre_next: np.ndarray
    charged: np.ndarray
    used_tokens: np.ndarray
    free_blocks: np.ndarray
    block_reads: np.ndarray
    seconds: float
    slack_tokens: int = 0


def _ledger_tail(config: StateConfig, state, reads):
    return [state.tenants.charged_blocks.ravel(), state.tenants.used_tokens,
            state.free.free_count, reads]


def unpack_step(config: StateConfig, flat, bd: int, bp: int, seconds: float) -> StepOutput:
    t, pools = config.num_tenants, config.num_pools
    at = [0]

    def take(n):
        at[0] += n
        return flat[at[0] - n: at[0]]

    return StepOutput(dec_next=take(bd), appended=take(bd).astype(bool), reason=take(bd),
                      pre_next=take(bp), charged=take(t * pools).reshape(t, pools),
                      used_tokens=take(t), free_blocks=take(pools), block_reads=take(pools),
                      slack_tokens=int(take(1)[0]), seconds=seconds)


def _sample(logits, keys, *, temperature: float, top_k: int, seed: int):
    """Next token per row: greedy, or drawn with the row's own key fold_in(fold_in(key(seed),
    request), index), so a replayed request draws what it drew before."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    base = jax.random.key(seed)

    def one(row, key):
        k = jax.random.fold_in(jax.random.fold_in(base, key[0]), key[1])
        scaled = row.astype(jnp.float32) / temperature
        if top_k:
            scaled = jnp.where(scaled >= jax.lax.top_k(scaled, top_k)[0][-1], scaled, -jnp.inf)
        return jax.random.categorical(k, scaled).astype(jnp.int32)

    return jax.vmap(one)(logits, keys)


@functools.partial(jax.jit, static_argnames=("model", "config", "pool_starts", "sampling",
                                             "prefill"), donate_argnames=("state",))
def _model_step(model, params, state, dec_seq, dec_tok, dec_key, pre_seq, pre_tok, pre_start,
                pre_num, pre_pos, pre_key, *, config, pool_starts, sampling, prefill):
    """Append + decode forward + sample, and (static `prefill`) a prefill forward + sample, in
    one call that donates `state`. Returns (state, i32 vector: see `unpack_step`)."""
    valid = dec_seq >= 0
    at = clip(dec_seq)
    start = jnp.where(valid, state.seqs.seq_lens[at], 0)  # cache index of the appended token
    position = jnp.where(valid, state.seqs.positions[at], 0)
    state, rep = append_core.fn(config, state, dec_seq, dec_tok)
    rows = jnp.where(rep.appended, dec_seq, INVALID)
    state, logits = _paged_forward(model, params, state, rows, dec_tok[:, None], start,
                                   rep.appended.astype(jnp.int32), position[:, None],
                                   last_only=True, pool_starts=pool_starts)
    knobs = dict(temperature=sampling.temperature, top_k=sampling.top_k, seed=sampling.seed)
    parts = [_sample(logits, dec_key, **knobs), rep.appended.astype(jnp.int32), rep.reason]
    if prefill:
        state, plogits = _paged_forward(model, params, state, pre_seq, pre_tok, pre_start,
                                        pre_num, pre_pos, last_only=True,
                                        pool_starts=pool_starts)
        parts.append(_sample(plogits, pre_key, **knobs))
    else:
        parts.append(jnp.zeros(pre_seq.shape, jnp.int32))
    reads = jnp.zeros((config.num_pools + 1,), jnp.int32)
    return state, jnp.concatenate(parts + _ledger_tail(config, state, reads))


def fake_tokens(keys, vocab: int):
    """Deterministic stand-in tokens of the cost model: a hash of (request, index) mod vocab."""
    k = keys.astype(jnp.uint32)
    h = k[:, 0] * jnp.uint32(2654435761) ^ (k[:, 1] + jnp.uint32(0x9E3779B9)) * jnp.uint32(40503)
    return (h % jnp.uint32(vocab)).astype(jnp.int32)


def cost_step_core(config, state, dec_seq, dec_tok, dec_key, pre_seq, pre_key, row_pools):
    """The cost model's step: append only, plus the table entries each row attends over per pool
    (the modelled KV read): ceil(cached / P) per row, those in pools 1.. from `row_pools` (the
    host mirror). O(batch) work. Returns (state, appended bool[Bd], i32 vector: `unpack_step`)."""
    state, rep = append_core.fn(config, state, dec_seq, dec_tok)
    rows = jnp.concatenate([jnp.where(rep.appended, dec_seq, INVALID), pre_seq])
    lens = jnp.where(rows >= 0, state.seqs.seq_lens[clip(rows)], 0)
    entries = -(-lens // config.block_size)
    other = jnp.where((rows >= 0)[:, None], row_pools, 0).at[:, 0].set(0)
    reads = other.sum(axis=0).at[0].set((entries - other.sum(axis=1)).sum())
    slack = (entries * config.block_size - lens).sum()
    reads = jnp.concatenate([reads, slack[None]]).astype(jnp.int32)
    vocab = config.model.vocab_size
    parts = [fake_tokens(dec_key, vocab), rep.appended.astype(jnp.int32), rep.reason,
             fake_tokens(pre_key, vocab)]
    return state, rep.appended, jnp.concatenate(parts + _ledger_tail(config, state, reads))


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def _cost_step(state, *rows, config):  # one cost-model step in one call that donates `state`
    state, _, flat = cost_step_core(config, state, *rows)
    return state, flat


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def _cost_pass(state, dec_seq, dec_tok, dec_key, dec_count, dec_pools, pre_seq, pre_key,
               pre_pools, *, config):
    """K cost-model steps in one call (K = pre_seq.shape[0]; a scheduling pass of multi-step
    scheduling, vLLM's `num_scheduler_steps` idea): at step j the
    decode rows with dec_count > j that no earlier step refused append a token (at j = 0 their
    pending `dec_tok`, after that the token step j - 1 sampled for them, as K separate steps
    would), and the prefill rows pre_seq[j] are read. Returns (state, i32[K, L]: each step's
    vector, see `unpack_step`)."""
    vocab = config.model.vocab_size

    def step(carry, xs):
        state, stopped = carry
        j, p_seq, p_key, p_pools = xs
        active = (dec_count > j) & ~stopped
        seq = jnp.where(active, dec_seq, INVALID)
        key = dec_key.at[:, 1].add(j)
        tok = jnp.where(j == 0, dec_tok, fake_tokens(key.at[:, 1].add(-1), vocab))
        state, appended, flat = cost_step_core(config, state, seq, tok, key, p_seq, p_key,
                                              jnp.concatenate([dec_pools, p_pools]))
        return (state, stopped | (active & ~appended)), flat

    k = pre_seq.shape[0]
    xs = (jnp.arange(k, dtype=jnp.int32), pre_seq, pre_key, pre_pools)
    (state, _), flats = jax.lax.scan(step, (state, jnp.zeros(dec_seq.shape, bool)), xs)
    return state, flats


class _Executor:
    """Shapes and sync counting shared by both executors.

    Args (both): max_batch: decode rows per step (default: every sequence slot); prefill_rows:
    prefill rows per step; chunk_size: the longest prefill chunk (tokens per row per step);
    chunk_floor: the narrowest padded chunk (chunk widths are powers of two from it to
    chunk_size: each one compile; chunk_floor=chunk_size compiles one); sampling: Sampling.
    """

    def __init__(self, state_config: StateConfig, *, max_batch=None, prefill_rows=4,
                 chunk_size=128, chunk_floor=16, sampling: Sampling = Sampling()):
        if not isinstance(state_config, StateConfig):
            raise InvalidArgumentError("state_config must be a kvquota StateConfig")
        self.state_config = state_config
        self.max_batch = state_config.max_seqs if max_batch is None else int(max_batch)
        self.prefill_rows, self.chunk_size = int(prefill_rows), int(chunk_size)
        self.chunk_floor = min(int(chunk_floor), self.chunk_size)
        if not (1 <= self.max_batch <= state_config.max_seqs and self.prefill_rows >= 1
                and self.chunk_floor >= 1):
            raise InvalidArgumentError(
                f"need 1 <= max_batch ({self.max_batch}) <= max_seqs ({state_config.max_seqs}), "
                f"prefill_rows >= 1 ({self.prefill_rows}) and chunk sizes >= 1")
        if not isinstance(sampling, Sampling):
            raise InvalidArgumentError("sampling must be a kvquota Sampling")
        self.sampling = sampling
        self.syncs = 0  # device-to-host readbacks made by step()

    def decode_width(self, rows: int) -> int:
        """Decode rows of a step's padded batch: max_batch (one compile of the model)."""
        return self.max_batch

    def chunk_width(self, longest: int) -> int:
        """The padded chunk width T for a step whose longest chunk is `longest` tokens."""
        return bucket(longest, self.chunk_size, floor=self.chunk_floor)

    def read(self, array) -> np.ndarray:  # one counted readback
        self.syncs += 1
        return np.asarray(jax.device_get(array))


class ModelExecutor(_Executor):
    """The real model (kvquota.model.Decoder) over the pages of `state_config`'s state.

    Args: config and params: the model and its weights; backend: the paged-attention backend
    ("auto": Pallas on GPU, the plain-JAX reference on CPU); see `_Executor` for the rest.
    """

    cost_model = False

    def __init__(self, config: ModelConfig, params, state_config: StateConfig, *,
                 backend: str = "auto", **kwargs):
        super().__init__(state_config, **kwargs)
        if state_config.model != config:
            raise ConfigMismatchError(f"state_config.model is {state_config.model.name!r}, the "
                                      f"model is {config.name!r}")
        if not state_config.with_pages:
            raise InvalidArgumentError("ModelExecutor needs a state with pages (with_pages=True)")
        self.config = config
        self.params = jax.device_put(params)
        self.model = Decoder(config, backend=backend)
        self.pool_starts = state_config.pool_starts[: 1 + len(state_config.compressed_pools)]

    def step(self, state, batch: StepBatch):
        """Runs one step (donates `state`) -> (state, StepOutput). One readback."""
        start = time.perf_counter()
        state, flat = _model_step(
            self.model, self.params, state, batch.dec_seq, batch.dec_tok, batch.dec_key,
            batch.pre_seq, batch.pre_tok, batch.pre_start, batch.pre_num, batch.pre_pos,
            batch.pre_key, config=self.state_config, pool_starts=self.pool_starts,
            sampling=self.sampling, prefill=batch.has_prefill)
        flat = self.read(flat)
        return state, unpack_step(self.state_config, flat, len(batch.dec_seq),
                                  len(batch.pre_seq), time.perf_counter() - start)


def weight_count(config: ModelConfig) -> int:
    """Parameters of a Qwen2/Llama decoder of this shape (embeddings once if tied)."""
    h, d, f = config.hidden_size, config.head_dim, config.ffn_size
    q, kv = config.num_q_heads * d, config.num_kv_heads * d
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if config.qkv_bias else 0)
    layer = attn + 3 * h * f + 2 * h
    head = 0 if config.tie_embeddings else config.vocab_size * h
    return config.vocab_size * h + config.num_layers * layer + h + head


class CostModelExecutor(_Executor):
    """A metadata-only state under a modelled step time (no model runs): one replica of `tp`
    tensor-parallel devices (KV heads and weights split evenly over them), every means priced:

    step seconds = (weight_bytes + KV bytes read + reclaim HBM bytes) / tp / hbm_bandwidth
                 + prefill tokens / (tp x prefill_tokens_per_s)     (recompute included)
                 + all-reduce: 2 per layer (attention and MLP outputs, Megatron-style), each
                   allreduce_latency_s + 2 (tp - 1) / tp x tokens x hidden x 2 B / nvlink_bandwidth
                 + host bytes moved / (tp x host_bandwidth)          (one host link each)
                 + plans x plan_s                                    (a modelled constant)
                 + step_overhead_s.
    KV bytes read: every table entry a row attends over, at its pool's bytes per block.
    Reclaim HBM bytes (`reclaim_work`): compress reads the full-precision blocks and writes the
    compressed ones; evict reads the victims' keys to score them and copies the kept blocks
    (read + write). Host bytes (offloads and restores) go through the scheduler's host-link
    queue: a step moves at most `host_step_bytes` (host_step_s of the link), the rest spills
    into the next steps. A preemption costs its recompute: the prefill of its context when it
    is re-admitted. The plan costs `plan_s` per reclaim (never the measured host time: runs
    stay deterministic).
    Defaults: one device; H200 HBM bandwidth; bf16 weights of the state's model; the state
    config's host bandwidth; prefill per device at `mfu` of the H200's dense bf16 FLOP/s, 2 FLOPs
    per weight per token (attention FLOPs left out). Sampled tokens are a hash of (request,
    index): requests end at max_new_tokens.
    """

    cost_model = True

    def __init__(self, state_config: StateConfig, *, hbm_bandwidth: float = H200_HBM_BANDWIDTH,
                 host_bandwidth: float | None = None, weight_bytes: int | None = None,
                 prefill_tokens_per_s: float | None = None, mfu: float = 0.5,
                 peak_flops: float = H200_BF16_FLOPS, step_overhead_s: float = 0.0,
                 tp: int = 1, nvlink_bandwidth: float = H200_NVLINK_BANDWIDTH,
                 allreduce_latency_s: float = 0.0, host_step_s: float = INF,
                 plan_s: float = 0.0, evict_keep_tokens: int = 64, **kwargs):
        super().__init__(state_config, **kwargs)
        weights = weight_count(state_config.model)
        self.hbm_bandwidth = float(hbm_bandwidth)
        self.host_bandwidth = float(host_bandwidth or state_config.host_bandwidth)
        self.weight_bytes = 2 * weights if weight_bytes is None else int(weight_bytes)
        self.prefill_tokens_per_s = (mfu * peak_flops / (2 * weights)
                                     if prefill_tokens_per_s is None else prefill_tokens_per_s)
        self.step_overhead_s = float(step_overhead_s)
        if not (isinstance(tp, int) and tp >= 1):
            raise InvalidArgumentError(f"tp must be an int >= 1, got {tp!r}")
        self.tp = tp
        self.nvlink_bandwidth, self.allreduce_latency_s = float(nvlink_bandwidth), \
            float(allreduce_latency_s)
        self.host_step_s, self.plan_s = float(host_step_s), float(plan_s)
        self.evict_keep_blocks = -(-int(evict_keep_tokens) // state_config.block_size)
        self._pool_bytes = np.asarray(state_config.pool_bytes, np.int64)
        if min(self.hbm_bandwidth, self.host_bandwidth, self.prefill_tokens_per_s,
               self.nvlink_bandwidth, self.host_step_s) <= 0 or self.weight_bytes < 0 or \
                min(self.step_overhead_s, self.allreduce_latency_s, self.plan_s) < 0:
            raise InvalidArgumentError("bandwidths, the prefill rate and host_step_s must be > 0; "
                                       "weight bytes, latencies, plan_s and the step overhead "
                                       ">= 0")

    @property
    def host_step_bytes(self) -> float:
        """Bytes the host links (one per device) move in one step's share of them."""
        return self.host_step_s * self.tp * self.host_bandwidth

    def decode_width(self, rows: int) -> int:
        """A power of two >= rows (64 .. max_batch): a step costs its rows, not max_batch
        (each width compiles once; a metadata step compiles in about a second)."""
        return bucket(rows, self.max_batch, floor=min(64, self.max_batch))

    def reclaim_work(self, report) -> tuple[int, int]:
        """(host-link bytes, HBM bytes read + written) of an `apply_plan` report's steps:
        offload / suspend move their host bytes; compress reads each block at pool 0's size and
        writes it at the compressed pool's; evict reads the victims' scores (the key half of
        each block for a scorer that needs key norms, else the f32 attention mass per layer,
        KV head and token that decode accumulated) and copies the blocks it keeps (read +
        write: the per-head compaction); free, drop and preempt move nothing here (a
        preemption pays its recompute at re-admission, a suspension its restore)."""
        b0, m = int(self._pool_bytes[0]), self.state_config.model
        host = hbm = 0
        for st in report.steps:
            host += int(st.host_bytes)
            if st.means == "compress" and len(self._pool_bytes) > 1:
                hbm += int(st.blocks) * (b0 + int(self._pool_bytes[1]))
            elif st.means == "evict":
                scorer = get_policy(report.plan.policy.evict_policy)
                per_block = b0 // 2 if "key_norm" in scorer.needs else \
                    4 * m.num_layers * m.num_kv_heads * self.state_config.block_size
                kept = self.evict_keep_blocks * len(st.seqs)
                hbm += (int(st.blocks) + kept) * per_block + 2 * kept * b0
        return host, hbm

    def allreduce_seconds(self, tokens: int) -> float:
        """Two ring all-reduces per layer of tokens x hidden bf16 activations over NVLink."""
        if self.tp == 1 or tokens <= 0:
            return 0.0
        m = self.state_config.model
        payload = 2 * (self.tp - 1) / self.tp * tokens * m.hidden_size * 2
        return 2 * m.num_layers * (self.allreduce_latency_s + payload / self.nvlink_bandwidth)

    def modelled_seconds(self, block_reads, prefill_tokens: int, host_bytes: int,
                         decode_tokens: int = 0, hbm_bytes: int = 0, plans: int = 0) -> float:
        kv = int((np.asarray(block_reads, np.int64) * self._pool_bytes).sum())
        d = self.tp
        return ((self.weight_bytes + kv + hbm_bytes) / d / self.hbm_bandwidth
                + prefill_tokens / (d * self.prefill_tokens_per_s)
                + self.allreduce_seconds(decode_tokens + prefill_tokens)
                + host_bytes / (d * self.host_bandwidth) + plans * self.plan_s
                + self.step_overhead_s)

    def reclaim_seconds(self, hbm_bytes: int, plans: int, host_bytes: int) -> float:
        """Of a step's modelled seconds, what its reclaim work costs (HBM, plans, host link)."""
        return (hbm_bytes / self.tp / self.hbm_bandwidth + plans * self.plan_s
                + host_bytes / (self.tp * self.host_bandwidth))

    def step(self, state, batch: StepBatch):
        """Runs one step (donates `state`) -> (state, StepOutput). One readback."""
        pools = batch.row_pools
        if pools is None:  # a batch built without a pool-counting mirror: count on device
            pools = _pool_entries(state.seqs.block_tables[clip(np.concatenate(
                [batch.dec_seq, batch.pre_seq]))], config=self.state_config)
        state, flat = _cost_step(state, batch.dec_seq, batch.dec_tok, batch.dec_key,
                                 batch.pre_seq, batch.pre_key, pools, config=self.state_config)
        flat = self.read(flat)
        out = unpack_step(self.state_config, flat, len(batch.dec_seq), len(batch.pre_seq), 0.0)
        out.seconds = self.modelled_seconds(
            out.block_reads, batch.prefill_tokens, batch.host_bytes,
            int(out.appended.sum()), batch.hbm_bytes, batch.plans)
        return state, out

    def run_pass(self, state, batch):
        """A pass of K steps (a `planning.PassBatch`) in one call (donates `state`; `_cost_pass`
        scans this executor's step over them, so the state is exactly what K single steps with
        those rows leave) -> (state, [StepOutput] of the steps with rows, each with its modelled seconds; step 0's
        counts the host bytes). One readback."""
        b, bd = batch.first, len(batch.first.dec_seq)
        state, flats = _cost_pass(state, b.dec_seq, b.dec_tok, b.dec_key, batch.dec_count,
                                  b.row_pools[:bd], batch.pre_seq, batch.pre_key,
                                  batch.pre_pools, config=self.state_config)
        flats, outs = self.read(flats), []
        for j in range(batch.steps):
            out = unpack_step(self.state_config, flats[j], bd, batch.pre_seq.shape[1], 0.0)
            first = j == 0
            out.seconds = self.modelled_seconds(
                out.block_reads, int(batch.pre_num[j].sum()), b.host_bytes if first else 0,
                int(out.appended.sum()), b.hbm_bytes if first else 0, b.plans if first else 0)
            outs.append(out)
        return state, outs
