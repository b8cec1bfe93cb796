"""The metadata-only load test: a trace replayed through the serving scheduler on a modelled clock.

`LoadConfig` fixes the pool (Qwen2.5-72B geometry by default, metadata only), the scheduler's
sizes, the SLOs and every constant of the cost model (`CostConstants`, H200 figures). For each
reclaim policy `Replay` builds a fresh state, scheduler and `CostModelExecutor`, and drives the
trace through it on the scheduler's clock (each step moves it by its modelled seconds), or
`Replay.fork` copies one stopped before the trace's first event (the same steps, replayed once):

* a single request or a session's first turn is submitted when the clock passes its arrival_s;
  a session's turn k > 0 arrives think_s after turn k - 1 finished (the scheduler's `Session`:
  prompt = the conversation so far + the new message, the idle sequence hit in the prefix cache);
* a trace event (quota cut to a share of the pool's bytes, lease expiry) becomes a scheduler
  `Event` at the step the clock passes it: plan_reclaim -> apply_plan under the policy;
* the ledger drift (`kvquota.serving.metrics.ledger_drift`: the ledger against an independent
  recomputation from the block tables) is measured after every event, every `drift_every` steps
  and at the end.

What a replay reports per policy, and how each figure is defined: `kvquota.sim.figures`.
"""

from __future__ import annotations

import collections
import copy as _copy
import dataclasses
import heapq
import math
from typing import Callable, Optional

import numpy as np

from configs.models import get_model_config
from kvquota.errors import InvalidArgumentError
from kvquota.reclaim.plan import PRESETS, get_reclaim_policy
from kvquota.sentinel import INVALID
from kvquota.serving import metrics
from kvquota.serving.executors import (H200_BF16_FLOPS, H200_HBM_BANDWIDTH, CostModelExecutor,
                                       weight_count)
from kvquota.serving.requests import Event, Request, RequestStatus, Session
from kvquota.serving.scheduler import Scheduler
from kvquota.sim.traces import Trace, prompt_ids, system_prompt_ids
from kvquota.state import StateConfig

POLICIES = tuple(PRESETS)  # tiered, preempt-all, swap-all, evict-first, grow-no-admit
H200_HBM_BYTES = 141e9  # H200 SXM: 141 GB HBM3e


@dataclasses.dataclass(frozen=True)
class CostConstants:
    """Every constant of the cost model (H200 SXM by default). Per device: HBM bandwidth and
    size (usable: `hbm_usable` of it, the rest for activations and the runtime), host link
    bandwidth, peak dense bf16 FLOP/s at `mfu` for prefill (2 FLOPs per weight per token).
    weight_bytes None: bf16 weights of the model; prefill_tokens_per_s None: from the FLOPs."""

    hbm_bandwidth: float = H200_HBM_BANDWIDTH
    hbm_bytes: float = H200_HBM_BYTES
    hbm_usable: float = 0.9
    host_bandwidth: float = 50e9
    peak_flops: float = H200_BF16_FLOPS
    mfu: float = 0.5
    step_overhead_s: float = 0.005
    weight_bytes: Optional[int] = None
    prefill_tokens_per_s: Optional[float] = None

    def __post_init__(self):
        positive = (self.hbm_bandwidth, self.hbm_bytes, self.host_bandwidth, self.peak_flops)
        if min(positive) <= 0 or not (0 < self.hbm_usable <= 1 and 0 < self.mfu <= 1) or \
                self.step_overhead_s < 0 or (self.weight_bytes or 0) < 0 or \
                (self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s <= 0):
            raise InvalidArgumentError(f"bad cost constants: {self}")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """The load test's pool, scheduler sizes and SLOs. Pools: pool 0 of `blocks`, a compressed
    pool (`compress_format`) of blocks * compressed_fraction, a host pool of blocks *
    host_fraction. devices None: as many as hold the pool and the weights (`devices_needed`).
    patience_s: a client cancels a request that has waited this long without being admitted
    (refused "timed out"; `Replay._abandon`); None: clients wait for ever. steps_per_pass > 1:
    multi-step scheduling (`kvquota.serving.scheduler`; the drift check then comes at the first
    pass end at or after every drift_every-th step)."""

    model: str = "qwen2.5-72b"
    kv_format: str = "bf16"
    blocks: int = 1 << 20
    block_size: int = 16
    devices: Optional[int] = None
    max_seqs: int = 4096
    max_blocks_per_seq: int = 2080  # 33,280 tokens: the trace's longest conversation + output
    num_tenants: int = 16
    compress_format: str = "int8"
    compressed_fraction: float = 0.125
    host_fraction: float = 0.5
    token_budget: int = 32768
    max_admit: int = 64
    steps_per_pass: int = 1
    prefill_rows: int = 16
    chunk_size: int = 4096
    slo_ttft_s: float = 30.0
    slo_tpot_s: float = 0.25
    jitter_window: int = 32
    drift_every: int = 1000
    max_steps: int = 1_000_000
    patience_s: Optional[float] = None
    cost: CostConstants = CostConstants()

    def __post_init__(self):
        for name in ("blocks", "block_size", "max_seqs", "max_blocks_per_seq", "num_tenants",
                     "token_budget", "max_admit", "steps_per_pass", "prefill_rows",
                     "chunk_size", "jitter_window", "drift_every", "max_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        if self.devices is not None and (not isinstance(self.devices, int) or self.devices < 1):
            raise InvalidArgumentError(f"devices must be None or an int >= 1: {self.devices!r}")
        if not (0 <= self.compressed_fraction <= 1 and 0 <= self.host_fraction <= 4) or \
                min(self.slo_ttft_s, self.slo_tpot_s) <= 0:
            raise InvalidArgumentError("fractions in [0, 1] (host: [0, 4]) and SLOs > 0")
        if self.patience_s is not None and not 0 < self.patience_s < math.inf:
            raise InvalidArgumentError(f"patience_s must be None or finite and > 0: "
                                       f"{self.patience_s!r}")


def state_config(cfg: LoadConfig) -> StateConfig:
    comp = int(cfg.blocks * cfg.compressed_fraction)
    return StateConfig(get_model_config(cfg.model), num_blocks=cfg.blocks,
                       block_size=cfg.block_size, max_seqs=cfg.max_seqs,
                       max_blocks_per_seq=cfg.max_blocks_per_seq, num_tenants=cfg.num_tenants,
                       kv_format=cfg.kv_format,
                       compressed_pools=((cfg.compress_format, comp),) if comp else (),
                       host_blocks=int(cfg.blocks * cfg.host_fraction), with_pages=False,
                       keep_cold_blocks=True, host_bandwidth=cfg.cost.host_bandwidth)


def weight_bytes(cfg: LoadConfig) -> int:
    c = cfg.cost
    return 2 * weight_count(get_model_config(cfg.model)) if c.weight_bytes is None else \
        c.weight_bytes


def device_bytes(sc: StateConfig) -> int:
    """Bytes of the device pools (pool 0 and the compressed ones; the host pool is not HBM)."""
    host = sc.host_pool
    return sum(b * n for i, (b, n) in enumerate(zip(sc.pool_bytes, sc.pool_sizes)) if i != host)


def devices_needed(cfg: LoadConfig) -> int:
    """ceil((device pool bytes + weight bytes) / usable HBM per device)."""
    need = device_bytes(state_config(cfg)) + weight_bytes(cfg)
    return max(1, math.ceil(need / (cfg.cost.hbm_bytes * cfg.cost.hbm_usable)))


def executor(cfg: LoadConfig, sc: Optional[StateConfig] = None) -> CostModelExecutor:
    c, sc = cfg.cost, sc or state_config(cfg)
    return CostModelExecutor(
        sc, hbm_bandwidth=c.hbm_bandwidth, host_bandwidth=c.host_bandwidth,
        weight_bytes=weight_bytes(cfg), prefill_tokens_per_s=c.prefill_tokens_per_s,
        mfu=c.mfu, peak_flops=c.peak_flops, step_overhead_s=c.step_overhead_s,
        devices=cfg.devices or devices_needed(cfg), prefill_rows=cfg.prefill_rows,
        chunk_size=cfg.chunk_size, chunk_floor=cfg.chunk_size)


def quotas(sc: StateConfig, share: float) -> dict:
    """A tenant's quotas for a share of pool 0: bytes (whole blocks) and tokens alike."""
    blocks = int(share * sc.num_blocks)
    return dict(byte_quota=blocks * sc.pool_bytes[0], token_quota=blocks * sc.block_size)


# ---- the replay ---------------------------------------------------------------------------------

def ended(r: Request) -> bool:
    """Finished or refused, its sequence slot freed (a session's next turn, if any, was built
    from it): the scheduler reads nothing of it any more."""
    return r.status in (RequestStatus.FINISHED, RequestStatus.REFUSED) and r.seq == INVALID


class Replay:
    """One policy's replay of a trace (see the module docstring). `on_step(sample)` gets a
    compact record of each step, `run()` returns the scheduler's requests mapped to trace ids."""

    def __init__(self, cfg: LoadConfig, trace: Trace, policy: str, *, ex=None,
                 on_step: Optional[Callable[[dict], None]] = None, vocab: Optional[int] = None,
                 step_clock: Optional[float] = None):
        if len(trace.tenants) > cfg.num_tenants:
            raise InvalidArgumentError(f"the trace has {len(trace.tenants)} tenants, the "
                                       f"state {cfg.num_tenants} slots (--num_tenants)")
        self.cfg, self.trace, self.policy = cfg, trace, policy
        self.ex = ex if ex is not None else executor(cfg)
        self.sc = self.ex.state_config
        self.vocab, self.step_clock = vocab, step_clock  # step_clock: see `now`
        self.token_bytes = self.sc.pool_bytes[0] // self.sc.block_size
        self.clock_at = [0.0]  # the clock at the start of each step
        self.sched = Scheduler(self.ex, policy=policy, token_budget=cfg.token_budget,
                               max_admit=cfg.max_admit, steps_per_pass=cfg.steps_per_pass)
        for t in trace.tenants:
            self.sched.register_tenant(t.tenant, share_group=None if t.salt_group < 0 else
                                       t.salt_group, **quotas(self.sc, t.quota_share))
        self.on_step, self.samples, self.drift = on_step, [], []
        self.arrivals, self.turns = self._items()
        self.trace_id = {}  # scheduler request -> trace request id
        self._compacted = 0  # requests before this index are ended and compacted
        self._next = [0, 0]  # the next arrival (of `arrivals`) and trace event to hand over
        self._deadlines, self._watched = [], 0  # heap of (arrival + patience, request id)
        self._stepped_out = False  # the stepping is over (`run` then only finishes)

    def _ids(self, r) -> list:
        ids = prompt_ids(self.trace, r)
        if r.system >= 0:
            ids = np.concatenate([system_prompt_ids(self.trace, r.system), ids])
        if self.vocab is not None:
            ids = ids % self.vocab
        return ids.tolist()

    def _items(self):
        """New work in arrival order: (arrival_s, trace request, later turns or None)."""
        by_session = collections.defaultdict(list)
        for r in self.trace.requests:
            if r.session >= 0:
                by_session[r.session].append(r)
        items = [r for r in self.trace.requests if r.turn == 0 or r.session < 0]
        items.sort(key=lambda r: (r.arrival_s, r.id))
        return items, {s: sorted(rs, key=lambda r: r.turn) for s, rs in by_session.items()}

    def _submit(self, r):
        if r.session < 0:
            req = self.sched.submit(Request(r.tenant, self._ids(r), r.output_tokens,
                                            arrival_s=self._arrival(r), arrival=self.sched.t,
                                            name=str(r.id)))
            self.trace_id[req.id] = r.id
            return
        turns = self.turns[r.session]
        s = self.sched.submit_session(Session(
            r.tenant, [self._ids(t) for t in turns], turns[0].output_tokens,
            name=str(r.session), arrival_s=self._arrival(r), arrival=self.sched.t,
            think_s=[t.think_s for t in turns], turn_new_tokens=[t.output_tokens for t in turns]))
        s.trace_ids = [t.id for t in turns]

    def now(self) -> float:
        """The trace's time: the scheduler's clock, or (step_clock set: a replay whose schedule
        must not depend on the executor's speed) the step count x step_clock seconds, with
        arrivals by step and a session's next turn one step after the last."""
        return self.sched.clock if self.step_clock is None else self.sched.t * self.step_clock

    def _arrival(self, r):
        return r.arrival_s if self.step_clock is None else None

    def _event(self, e):
        kw = {} if e.kind == "lease_expiry" else dict(byte_quota=quotas(
            self.sc, e.quota_share)["byte_quota"])
        self.sched.add_event(Event(self.sched.t, e.kind, e.tenant, **kw))

    def _check_drift(self, why: str):
        d = metrics.ledger_drift(self.sc, self.sched.state)
        self.drift.append({"step": self.sched.t, "why": why, "bytes": d["bytes"],
                           "tokens": d["tokens"]})

    def run(self, until_first_event: bool = False) -> Optional[list]:
        """Replay to the end (returns the scheduler's requests) or, `until_first_event`, up to
        the step the first trace event would be handed over (returns None; see `fork`)."""
        if not self._stepped_out and self._steps(until_first_event):
            return None
        self._stepped_out = True
        if until_first_event:  # the trace ended before any event: `run()` just finishes it
            return None
        s = self.sched
        s.release_finished()
        self._check_drift("end")
        self.steps_capped = s.t >= self.cfg.max_steps
        return s.requests

    def _steps(self, until_first_event: bool) -> bool:
        """Step the scheduler; True where it paused before the first trace event, False where
        the replay is over (all done, stalled for good, or max_steps)."""
        s, cfg = self.sched, self.cfg
        items, events = self.arrivals, self.trace.events
        while s.t < cfg.max_steps:
            i, j = self._next
            if until_first_event and j < len(events) and events[j].time_s <= self.now():
                return True
            while i < len(items) and items[i].arrival_s <= self.now():
                self._submit(items[i])
                i += 1
            while j < len(events) and events[j].time_s <= self.now():
                self._event(events[j])
                j += 1
            self._next = [i, j]
            nxt = min(items[i].arrival_s if i < len(items) else math.inf,
                      events[j].time_s if j < len(events) else math.inf)
            deadline = self._abandon()
            wake_s = min(nxt, deadline) if self.step_clock is None else math.inf
            if s.done and nxt == math.inf:
                return False
            t0 = s.t
            rec = s.step(cfg.max_steps - t0, wake_s=wake_s)  # a pass of steps_per_pass, at most
            for r in s.records[t0:]:
                self._sample(r)
            if s.records[t0]["events"]:
                self._check_drift("event")
            elif s.t // cfg.drift_every > t0 // cfg.drift_every:
                self._check_drift("every")
                self._compact()
            if not (rec["decode_rows"] or rec["prefill_rows"] or s.progressed):
                later = min(nxt, s.next_arrival_s, wake_s)  # stalled until the next arrival
                if later == math.inf or self.step_clock is not None and not s.has_pending and \
                        i == len(items) and j == len(events):
                    return False
                if self.step_clock is None:
                    s.advance_clock(later)
        return False

    def _abandon(self) -> float:
        """Clients out of patience (`LoadConfig.patience_s`, counted from arrival, in `now`'s
        time) cancel their requests that wait without a token: pending or queued, never
        admitted (one admitted has its first token coming, and a client reading a stream does
        not give up). Returns the next deadline."""
        if self.cfg.patience_s is None:
            return math.inf
        s, heap = self.sched, self._deadlines
        for r in s.requests[self._watched:]:
            arrived = r.arrival_s if r.arrival_s is not None else r.arrival * self.step_clock
            heapq.heappush(heap, (arrived + self.cfg.patience_s, r.id))
        self._watched = len(s.requests)
        while heap:  # due or no longer waiting: off the heap (admitted ones never come back)
            r = s.requests[heap[0][1]]
            waiting = r.status in (RequestStatus.PENDING, RequestStatus.QUEUED) and not r.tokens
            if waiting and heap[0][0] > self.now():
                return heap[0][0]
            heapq.heappop(heap)
            if waiting:
                s.cancel(r, "timed out")
        return math.inf

    def fork(self, policy: str, on_step: Optional[Callable[[dict], None]] = None, *,
             copy: bool = True) -> Replay:
        """This replay, stopped before the trace's first event (`run(until_first_event=True)`),
        copied to go on under `policy`. Until an event no policy has acted (the scheduler reads
        its policy only to plan an event's reclaim), so each policy's replay from the start is
        this one's up to here, step for step; the load test replays that stretch once per
        worker process instead of once per policy. The trace, configs, executor and allocator
        (read-only or stateless between steps; the allocator's weak reference to its last state
        only shortens its checks) are shared; the state and the scheduler's
        requests, queues and records are copied. The copy's samples so far are this replay's,
        under `policy`'s name; `on_step` gets the steps from here on. `copy=False`: this replay
        itself goes on under `policy` (the last policy of a worker: a copy of the default
        trace's replay at its first event takes ~8 s, results/loadtest/last_fork.json, and holds
        a second copy of its requests and state)."""
        if self._next[1]:
            raise InvalidArgumentError("a replay forks only before its first trace event")
        shared = (self.cfg, self.trace, self.ex, self.sched.alloc, self.sc, self.arrivals,
                  self.turns)
        twin = _copy.deepcopy(self, {id(x): x for x in shared}) if copy else self
        twin.policy, twin.sched.policy, twin.on_step = policy, get_reclaim_policy(policy), on_step
        for p in twin.samples:
            p["policy"] = policy
        return twin

    def _compact(self):
        """Ended requests keep their token ids as arrays (10^5 requests of 2K-token prompts as
        Python lists filled 6 GB per worker a third of the way through the default run)."""
        reqs = self.sched.requests
        while self._compacted < len(reqs) and ended(reqs[self._compacted]):
            reqs[self._compacted].compact()
            self._compacted += 1
        for r in reqs[self._compacted:]:
            if ended(r) and isinstance(r.prompt, list):
                r.compact()

    def _sample(self, rec: dict):
        tiers = dict.fromkeys(metrics.TIERS, 0)
        for row in rec["bytes"].values():
            for k, v in row.items():
                tiers[k] += v
        out = {"policy": self.policy, "step": rec["step"], "clock_s": rec["clock_s"],
               "step_s": rec["step_s"], "decode_rows": rec["decode_rows"],
               "prefill_rows": rec["prefill_rows"], "events": rec["events"],
               "running": rec["running"], "suspended": rec["suspended"],
               "queued": sum(rec["queue"].values()), "preemptions": rec["preemptions"],
               "refusals": rec["refusals"], "bytes": tiers,
               "fragmentation_bytes": rec["slack_tokens"] * self.token_bytes,
               "wall_s": rec["wall_s"]}
        self.clock_at.append(rec["clock_s"])
        self.samples.append(out)
        if self.on_step is not None:
            self.on_step(out)

    def request_records(self) -> list[dict]:
        """One JSON-ready record per scheduler request (trace id, latencies in seconds)."""
        out = []
        for r in self.sched.requests:
            tid = (r.session.trace_ids[r.turn] if r.session is not None
                   else self.trace_id[r.id])
            n = len(r.tokens)
            arrived = (r.arrival_s if r.arrival_s is not None else
                       self.clock_at[min(r.arrival, len(self.clock_at) - 1)])
            ttft = r.first_token_s - arrived if r.first_token_s >= 0 else None
            tpot = ((r.finish_s - r.first_token_s) / (n - 1)
                    if r.status == RequestStatus.FINISHED and n > 1 else None)
            out.append({"policy": self.policy, "id": tid, "tenant": r.tenant, "turn": r.turn,
                        "status": str(r.status), "finish": r.finish, "prompt_tokens": len(r.prompt),
                        "output_tokens": n, "max_new_tokens": r.max_new_tokens,
                        "arrival_s": arrived, "ttft_s": ttft, "tpot_s": tpot,
                        "finish_s": r.finish_s if r.finish_s >= 0 else None,
                        "cached_tokens": r.cached_tokens, "preemptions": r.preemptions,
                        "suspensions": r.suspensions,
                        **{name: getattr(r, name) for name in metrics.RESUME_FIELDS},
                        "lossy": r.lossy,
                        "refusals": r.refusals})
        return out
