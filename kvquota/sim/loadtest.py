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
from kvquota.serving.executors import (H200_BF16_FLOPS, H200_HBM_BANDWIDTH,
                                       H200_NVLINK_BANDWIDTH, CostModelExecutor, weight_count)
from kvquota.serving.requests import Event, Request, RequestStatus, Session
from kvquota.serving.scheduler import Scheduler
from kvquota.sim.traces import Trace, prompt_ids, system_prompt_ids
from kvquota.state import StateConfig

POLICIES = tuple(PRESETS)  # tiered, preempt-all, swap-all, evict-first, grow-no-admit
H200_HBM_BYTES = 141e9  # H200 SXM: 141 GB HBM3e


@dataclasses.dataclass(frozen=True)
class CostConstants:
    """Every constant of the cost model (H200 SXM by default; `CostModelExecutor` has the
    formula). Per device: HBM bandwidth and size (usable: `hbm_usable` of it, the rest for
    activations and the runtime), host link bandwidth, peak dense bf16 FLOP/s at `mfu` for
    prefill (2 FLOPs per weight per token), NVLink bandwidth and the latency of one all-reduce
    (two per layer under tensor parallelism); host_step_s: the host link's share of one step (a
    transfer larger than that spills into the next steps); plan_s: the modelled cost of one
    reclaim plan (default: the host plan's measured 16.9 ms for a tiered cut at 2^20 blocks on
    this project's CPU, CHANGELOG 0.19.0: a constant, so runs stay deterministic).
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
    nvlink_bandwidth: float = H200_NVLINK_BANDWIDTH
    allreduce_latency_s: float = 10e-6
    host_step_s: float = 0.02
    plan_s: float = 0.0169

    def __post_init__(self):
        positive = (self.hbm_bandwidth, self.hbm_bytes, self.host_bandwidth, self.peak_flops,
                    self.nvlink_bandwidth, self.host_step_s)
        if min(positive) <= 0 or not (0 < self.hbm_usable <= 1 and 0 < self.mfu <= 1) or \
                min(self.step_overhead_s, self.allreduce_latency_s, self.plan_s) < 0 or \
                (self.weight_bytes or 0) < 0 or \
                (self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s <= 0):
            raise InvalidArgumentError(f"bad cost constants: {self}")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """The load test's deployment, pool, scheduler sizes and SLOs. `replicas` replicas of `tp`
    tensor-parallel devices each, each with its own state and scheduler (`Replay`); per
    replica, pools: pool 0 of `blocks` (None: what the replica's HBM holds beside the weights,
    `blocks_that_fit`), a compressed pool (`compress_format`) of blocks * compressed_fraction,
    a host pool of blocks * host_fraction; max_seqs sequence slots.
    patience_s: a client cancels a request that has waited this long without being admitted
    (refused "timed out"; `Replay._abandon`); None: clients wait for ever.
    sessions_end_with_trace: clients send nothing after the trace's last arrival (a session's
    later turn due after it is never sent, so the run ends as the trace does); False: sessions
    run to their last turn. steps_per_pass > 1: multi-step scheduling
    (`kvquota.serving.scheduler`; the drift check then comes at the first pass end at or after
    every drift_every-th step). quiet_steps > 0: a stretch of steps that
    can only decode runs as one pass of up to that many steps (exact: `Scheduler`)."""

    model: str = "qwen2.5-72b"
    kv_format: str = "bf16"
    blocks: Optional[int] = None
    block_size: int = 16
    tp: int = 8
    replicas: int = 2
    max_seqs: int = 4096
    max_blocks_per_seq: int = 2080  # 33,280 tokens: the trace's longest conversation + output
    num_tenants: int = 16
    compress_format: str = "int8"
    compressed_fraction: float = 0.125
    host_fraction: float = 0.5
    token_budget: int = 32768
    max_admit: int = 64
    steps_per_pass: int = 1
    quiet_steps: int = 0
    prefill_rows: int = 16
    chunk_size: int = 4096
    slo_ttft_s: float = 30.0
    slo_tpot_s: float = 0.25
    jitter_window: int = 32
    drift_every: int = 1000
    max_steps: int = 1_000_000
    patience_s: Optional[float] = None
    sessions_end_with_trace: bool = False
    cost: CostConstants = CostConstants()

    def __post_init__(self):
        for name in ("block_size", "tp", "replicas", "max_seqs", "max_blocks_per_seq", "num_tenants",
                     "token_budget", "max_admit", "steps_per_pass", "prefill_rows",
                     "chunk_size", "jitter_window", "drift_every", "max_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.quiet_steps, int) or self.quiet_steps < 0:
            raise InvalidArgumentError(f"quiet_steps must be an int >= 0, got "
                                       f"{self.quiet_steps!r}")
        if self.blocks is not None and (not isinstance(self.blocks, int) or self.blocks < 1):
            raise InvalidArgumentError(f"blocks must be None or an int >= 1: {self.blocks!r}")
        if not (0 <= self.compressed_fraction <= 1 and 0 <= self.host_fraction <= 4) or \
                min(self.slo_ttft_s, self.slo_tpot_s) <= 0:
            raise InvalidArgumentError("fractions in [0, 1] (host: [0, 4]) and SLOs > 0")
        if self.patience_s is not None and not 0 < self.patience_s < math.inf:
            raise InvalidArgumentError(f"patience_s must be None or finite and > 0: "
                                       f"{self.patience_s!r}")


def blocks_that_fit(cfg: LoadConfig) -> int:
    """Pool-0 blocks of one replica when its tp devices' usable HBM holds the weights, pool 0
    and the compressed pool (compressed_fraction of pool 0's blocks), nothing else."""
    one = dataclasses.replace(cfg, blocks=1)
    sc = state_config(one, compressed=0)
    per_block = sc.pool_bytes[0] + cfg.compressed_fraction * _compressed_block_bytes(cfg)
    room = cfg.tp * cfg.cost.hbm_bytes * cfg.cost.hbm_usable - weight_bytes(cfg)
    if room < per_block:
        raise InvalidArgumentError(f"--tp={cfg.tp} devices do not hold the weights "
                                   f"({weight_bytes(cfg) / 1e9:.0f} GB) and a block")
    return int(room // per_block)


def _compressed_block_bytes(cfg: LoadConfig) -> int:
    sc = StateConfig(get_model_config(cfg.model), num_blocks=8, block_size=cfg.block_size,
                     max_seqs=1, max_blocks_per_seq=1, num_tenants=1, kv_format=cfg.kv_format,
                     compressed_pools=((cfg.compress_format, 8),), with_pages=False)
    return sc.pool_bytes[1]


def replica_blocks(cfg: LoadConfig) -> int:
    return cfg.blocks if cfg.blocks is not None else blocks_that_fit(cfg)


def state_config(cfg: LoadConfig, compressed: Optional[int] = None) -> StateConfig:
    """One replica's state config (metadata only)."""
    blocks = replica_blocks(cfg)
    comp = int(blocks * cfg.compressed_fraction) if compressed is None else compressed
    return StateConfig(get_model_config(cfg.model), num_blocks=blocks,
                       block_size=cfg.block_size, max_seqs=cfg.max_seqs,
                       max_blocks_per_seq=cfg.max_blocks_per_seq, num_tenants=cfg.num_tenants,
                       kv_format=cfg.kv_format,
                       compressed_pools=((cfg.compress_format, comp),) if comp else (),
                       host_blocks=int(blocks * cfg.host_fraction), with_pages=False,
                       keep_cold_blocks=True, host_bandwidth=cfg.cost.host_bandwidth)


def weight_bytes(cfg: LoadConfig) -> int:
    c = cfg.cost
    return 2 * weight_count(get_model_config(cfg.model)) if c.weight_bytes is None else \
        c.weight_bytes


def device_bytes(sc: StateConfig) -> int:
    """Bytes of the device pools (pool 0 and the compressed ones; the host pool is not HBM)."""
    host = sc.host_pool
    return sum(b * n for i, (b, n) in enumerate(zip(sc.pool_bytes, sc.pool_sizes)) if i != host)


def hbm_needed(cfg: LoadConfig) -> float:
    """Share of one replica's usable HBM that its device pools and the weights take."""
    need = device_bytes(state_config(cfg)) + weight_bytes(cfg)
    return need / (cfg.tp * cfg.cost.hbm_bytes * cfg.cost.hbm_usable)


def executor(cfg: LoadConfig, sc: Optional[StateConfig] = None) -> CostModelExecutor:
    """One replica's executor (every replica has the same; it keeps no state between steps)."""
    c, sc = cfg.cost, sc or state_config(cfg)
    return CostModelExecutor(
        sc, hbm_bandwidth=c.hbm_bandwidth, host_bandwidth=c.host_bandwidth,
        weight_bytes=weight_bytes(cfg), prefill_tokens_per_s=c.prefill_tokens_per_s,
        mfu=c.mfu, peak_flops=c.peak_flops, step_overhead_s=c.step_overhead_s,
        tp=cfg.tp, nvlink_bandwidth=c.nvlink_bandwidth,
        allreduce_latency_s=c.allreduce_latency_s, host_step_s=c.host_step_s, plan_s=c.plan_s,
        prefill_rows=cfg.prefill_rows, chunk_size=cfg.chunk_size, chunk_floor=cfg.chunk_size)


def quotas(sc: StateConfig, share: float) -> dict:
    """A tenant's quotas for a share of pool 0: bytes (whole blocks) and tokens alike."""
    blocks = int(share * sc.num_blocks)
    return dict(byte_quota=blocks * sc.pool_bytes[0], token_quota=blocks * sc.block_size)


# ---- the replay ---------------------------------------------------------------------------------

def ended(r: Request) -> bool:
    """Finished or refused, its sequence slot freed (a session's next turn, if any, was built
    from it): the scheduler reads nothing of it any more."""
    return r.status in (RequestStatus.FINISHED, RequestStatus.REFUSED) and r.seq == INVALID


def load_of(s: Scheduler) -> int:
    """A replica's outstanding requests (arrived or not, queued, admitted): what least-loaded
    routing compares (as a least-request router does)."""
    return len(s.live) + len(s.waiting.pending) + sum(len(q) for q in s.waiting.queues.values())


class Replay:
    """One policy's replay of a trace over `cfg.replicas` replicas (see the module docstring).
    Each replica is its own state, scheduler and clock; they advance together: the replica
    whose clock is the furthest behind steps next, and the fleet's time (`now`) is that clock.
    A request (a session's first turn) arriving at `now` goes to the least-loaded replica
    (`load_of`; ties to the lowest index; a session's later turns stay on its replica: prefix
    affinity); an event reaches every replica, with the quota split evenly over them.
    `on_step(sample)` gets a compact record of each step, `run()` returns every replica's
    requests (replica by replica)."""

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
        self.scheds = [Scheduler(self.ex, policy=policy, token_budget=cfg.token_budget,
                                 max_admit=cfg.max_admit, steps_per_pass=cfg.steps_per_pass,
                                 quiet_steps=cfg.quiet_steps)
                       for _ in range(cfg.replicas)]
        self.clock_at = [[0.0] for _ in self.scheds]  # each replica's clock at each step start
        for s in self.scheds:
            for t in trace.tenants:
                s.register_tenant(t.tenant, share_group=None if t.salt_group < 0 else
                                  t.salt_group, **quotas(self.sc, t.quota_share))
        self.on_step, self.samples, self.drift = on_step, [], []
        self.arrivals, self.turns = self._items()
        self.sessions_end_s = (self.arrivals[-1].arrival_s if cfg.sessions_end_with_trace and
                               self.arrivals and step_clock is None else None)
        self.trace_id = {}  # (replica, scheduler request id) -> trace request id
        self._compacted = [0] * len(self.scheds)  # requests before these are ended, compacted
        self._next = [0, 0]  # the next arrival (of `arrivals`) and trace event to hand over
        self._deadlines, self._watched = [], [0] * len(self.scheds)  # heap of (deadline, k, id)
        self._stepped_out = False  # the stepping is over (`run` then only finishes)

    @property
    def sched(self) -> Scheduler:
        """The first replica's scheduler (the only one when replicas = 1)."""
        return self.scheds[0]

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
        k = min(range(len(self.scheds)), key=lambda i: load_of(self.scheds[i]))
        sched = self.scheds[k]
        if r.session < 0:
            req = sched.submit(Request(r.tenant, self._ids(r), r.output_tokens,
                                       arrival_s=self._arrival(r), arrival=sched.t,
                                       name=str(r.id)))
            self.trace_id[k, req.id] = r.id
            return
        turns = self.turns[r.session]
        s = sched.submit_session(Session(
            r.tenant, [self._ids(t) for t in turns], turns[0].output_tokens,
            name=str(r.session), arrival_s=self._arrival(r), arrival=sched.t,
            think_s=[t.think_s for t in turns], turn_new_tokens=[t.output_tokens for t in turns],
            end_s=self.sessions_end_s))
        s.trace_ids = [t.id for t in turns]

    def _time(self, s: Scheduler) -> float:
        return s.clock if self.step_clock is None else s.t * self.step_clock

    def now(self) -> float:
        """The trace's time: the clock of the replica furthest behind, or (step_clock set: a
        replay whose schedule must not depend on the executor's speed) its step count x
        step_clock seconds, with arrivals by step and a session's next turn one step after
        the last."""
        return min(self._time(s) for s in self.scheds)

    def _arrival(self, r):
        return r.arrival_s if self.step_clock is None else None

    def _event(self, e):
        kw = {} if e.kind == "lease_expiry" else dict(byte_quota=quotas(
            self.sc, e.quota_share)["byte_quota"])
        for s in self.scheds:
            s.add_event(Event(s.t, e.kind, e.tenant, **kw))

    def _check_drift(self, why: str, k: int):
        s = self.scheds[k]
        d = metrics.ledger_drift(self.sc, s.state)
        self.drift.append({"step": s.t, "replica": k, "why": why, "bytes": d["bytes"],
                           "tokens": d["tokens"]})

    @property
    def requests(self) -> list:
        return [r for s in self.scheds for r in s.requests]

    def run(self, until_first_event: bool = False) -> Optional[list]:
        """Replay to the end (returns the replicas' requests) or, `until_first_event`, up to
        the step the first trace event would be handed over (returns None; see `fork`)."""
        if not self._stepped_out and self._steps(until_first_event):
            return None
        self._stepped_out = True
        if until_first_event:  # the trace ended before any event: `run()` just finishes it
            return None
        for k, s in enumerate(self.scheds):
            s.release_finished()
            self._check_drift("end", k)
        self.steps_capped = any(s.t >= self.cfg.max_steps for s in self.scheds)
        return self.requests

    def _steps(self, until_first_event: bool) -> bool:
        """Step the replicas; True where it paused before the first trace event, False where
        the replay is over (all done, stalled for good, or max_steps)."""
        cfg, scheds = self.cfg, self.scheds
        items, events = self.arrivals, self.trace.events
        stalled = [False] * len(scheds)  # idle until something new arrives
        while True:
            live = [k for k, s in enumerate(scheds) if s.t < cfg.max_steps and not stalled[k]]
            if not live:
                return False
            k = min(live, key=lambda i: self._time(scheds[i]))
            s, now = scheds[k], self.now()
            i, j = self._next
            if until_first_event and j < len(events) and events[j].time_s <= now:
                return True
            while i < len(items) and items[i].arrival_s <= now:
                self._submit(items[i])
                i += 1
            while j < len(events) and events[j].time_s <= now:
                self._event(events[j])
                j += 1
            if self._next != [i, j]:
                stalled = [False] * len(scheds)  # new work: every replica may have some
            self._next = [i, j]
            nxt = min(items[i].arrival_s if i < len(items) else math.inf,
                      events[j].time_s if j < len(events) else math.inf)
            deadline = self._abandon()
            wake_s = min(nxt, deadline) if self.step_clock is None else math.inf
            if all(q.done for q in scheds) and nxt == math.inf:
                return False
            t0 = s.t
            rec = s.step(cfg.max_steps - t0, wake_s=wake_s)  # a pass of steps_per_pass, at most
            for r in s.records[t0:]:
                self._sample(r, k)
            if s.records[t0]["events"]:
                self._check_drift("event", k)
            elif s.t // cfg.drift_every > t0 // cfg.drift_every:
                self._check_drift("every", k)
                self._compact(k)
            if not (rec["decode_rows"] or rec["prefill_rows"] or s.progressed):
                later = min(nxt, s.next_arrival_s, wake_s)  # stalled until the next arrival
                if later == math.inf or self.step_clock is not None and not s.has_pending and \
                        i == len(items) and j == len(events):
                    stalled[k] = True  # nothing will come to it but routed work
                elif self.step_clock is None:
                    s.advance_clock(later)

    def _abandon(self) -> float:
        """Clients out of patience (`LoadConfig.patience_s`, counted from arrival, in `now`'s
        time) cancel their requests that wait without a token: pending or queued, never
        admitted (one admitted has its first token coming, and a client reading a stream does
        not give up). Returns the next deadline."""
        if self.cfg.patience_s is None:
            return math.inf
        heap = self._deadlines
        for k, s in enumerate(self.scheds):
            for r in s.requests[self._watched[k]:]:
                arrived = r.arrival_s if r.arrival_s is not None else r.arrival * self.step_clock
                heapq.heappush(heap, (arrived + self.cfg.patience_s, k, r.id))
            self._watched[k] = len(s.requests)
        while heap:  # due or no longer waiting: off the heap (admitted ones never come back)
            due, k, rid = heap[0]
            s = self.scheds[k]
            r = s.requests[rid]
            waiting = r.status in (RequestStatus.PENDING, RequestStatus.QUEUED) and not r.tokens
            if waiting and due > self._time(s):
                return due
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
        only shortens its checks) are shared; the states and the schedulers' requests, queues
        and records are copied. The copy's samples so far are this replay's, under `policy`'s
        name; `on_step` gets the steps from here on. `copy=False`: this replay itself goes on
        under `policy` (the last policy of a worker: a copy holds a second copy of the
        requests and states)."""
        if self._next[1]:
            raise InvalidArgumentError("a replay forks only before its first trace event")
        shared = (self.cfg, self.trace, self.ex, self.sc, self.arrivals, self.turns,
                  *(s.alloc for s in self.scheds))
        twin = _copy.deepcopy(self, {id(x): x for x in shared}) if copy else self
        twin.policy, twin.on_step = policy, on_step
        for s in twin.scheds:
            s.policy = get_reclaim_policy(policy)
        for p in twin.samples:
            p["policy"] = policy
        return twin

    def _compact(self, k: int):
        """Ended requests keep their token ids as arrays (10^5 requests of 2K-token prompts as
        Python lists filled 6 GB per worker a third of the way through the default run)."""
        reqs = self.scheds[k].requests
        while self._compacted[k] < len(reqs) and ended(reqs[self._compacted[k]]):
            reqs[self._compacted[k]].compact()
            self._compacted[k] += 1
        for r in reqs[self._compacted[k]:]:
            if ended(r) and isinstance(r.prompt, list):
                r.compact()

    def _sample(self, rec: dict, k: int):
        tiers = dict.fromkeys(metrics.TIERS, 0)
        for row in rec["bytes"].values():
            for name, v in row.items():
                tiers[name] += v
        out = {"policy": self.policy, "replica": k, "step": rec["step"],
               "clock_s": rec["clock_s"], "step_s": rec["step_s"],
               "reclaim_s": rec.get("reclaim_s", 0.0), "decode_rows": rec["decode_rows"],
               "prefill_rows": rec["prefill_rows"], "events": rec["events"],
               "running": rec["running"], "suspended": rec["suspended"],
               "queued": sum(rec["queue"].values()), "preemptions": rec["preemptions"],
               "refusals": rec["refusals"], "bytes": tiers,
               "host_queue_bytes": rec.get("host_queue_bytes", 0),
               "fragmentation_bytes": rec["slack_tokens"] * self.token_bytes,
               "wall_s": rec["wall_s"]}
        self.clock_at[k].append(rec["clock_s"])
        self.samples.append(out)
        if self.on_step is not None:
            self.on_step(out)

    def request_records(self) -> list[dict]:
        """One JSON-ready record per scheduler request (trace id, latencies in seconds)."""
        out = []
        for k, s in enumerate(self.scheds):
            clock_at = self.clock_at[k]
            for r in s.requests:
                tid = (r.session.trace_ids[r.turn] if r.session is not None
                       else self.trace_id[k, r.id])
                n = len(r.tokens)
                arrived = (r.arrival_s if r.arrival_s is not None else
                           clock_at[min(r.arrival, len(clock_at) - 1)])
                ttft = r.first_token_s - arrived if r.first_token_s >= 0 else None
                tpot = ((r.finish_s - r.first_token_s) / (n - 1)
                        if r.status == RequestStatus.FINISHED and n > 1 else None)
                out.append({"policy": self.policy, "replica": k, "id": tid, "tenant": r.tenant,
                            "turn": r.turn, "status": str(r.status), "finish": r.finish,
                            "prompt_tokens": len(r.prompt), "output_tokens": n,
                            "max_new_tokens": r.max_new_tokens, "arrival_s": arrived,
                            "ttft_s": ttft, "tpot_s": tpot,
                            "finish_s": r.finish_s if r.finish_s >= 0 else None,
                            "cached_tokens": r.cached_tokens, "preemptions": r.preemptions,
                            "suspensions": r.suspensions,
                            **{name: getattr(r, name) for name in metrics.RESUME_FIELDS},
                            "lossy": r.lossy, "refusals": r.refusals})
        return out

    def event_records(self) -> list[dict]:
        """One record per event and replica: its plan (target, planned, shortfall), what
        apply_plan reclaimed, its fates by kind, the resume costs the plan expects and what the
        requests it reached paid (every resumption of theirs, this event's or a later one's),
        and its device work (`CostModelExecutor.reclaim_work`)."""
        out = []
        for k, s in enumerate(self.scheds):
            for order, e in enumerate(s.event_log):  # every replica gets every trace event
                if "plan" not in e:
                    continue
                plan, rep = e["plan"], e["report"]
                fates = collections.Counter(f["fate"] for f in rep["fates"])
                seq_req = e["seq_requests"]
                reached = [s.requests[seq_req[str(f["seq"])]] for f in rep["fates"]
                           if str(f["seq"]) in seq_req]
                out.append({
                    "policy": self.policy, "replica": k, "order": order, "step": e["step"],
                    "clock_s": self.clock_at[k][min(e["step"], len(self.clock_at[k]) - 1)],
                    "kind": e["kind"], "tenant": e["tenant"],
                    "target_bytes": plan["target_bytes"], "planned_bytes": plan["planned_bytes"],
                    "reclaimed_bytes": rep["reclaimed_bytes"],
                    "shortfall_bytes": rep["shortfall_bytes"], "by_means": rep["by_means"],
                    "fates": dict(fates),
                    "planned_resume_tokens": sum(f["resume_tokens"] for f in plan["fates"]),
                    "planned_resume_bytes": sum(f["resume_bytes"] for f in plan["fates"]),
                    "paid_resume_tokens": sum(r.paid_resume_tokens for r in reached),
                    "paid_resume_bytes": sum(r.paid_resume_bytes for r in reached),
                    "work": e.get("work", {})})
        return out
