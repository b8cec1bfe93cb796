"""Seeded multi-tenant workload traces: who sends what, when, and which quota events happen.

A trace is plain data (`Trace`: tenants, requests, events) that a replay (the load test) turns
into scheduler work. It fixes everything that does not depend on how fast the server is:
arrival times of new work, prompt and output lengths, multi-turn sessions and their think
times, shared system prompts, quota cuts and lease expiries. What depends on the server stays
open: a session's turn k > 0 arrives `think_s` after turn k - 1 finished, which only the replay
knows, so its `arrival_s` is None.

The model of the workload (every number a `TraceConfig` field):
* Tenants send at rates split by `tenant_weights` (or a Zipf-like skew, weight of tenant t
  proportional to 1 / (t + 1) ** tenant_skew). Each tenant's new work is its own process:
  Poisson, or bursty (an on-off Markov-modulated Poisson process: ON periods of mean
  `burst_mean_s` at `burst_factor` times the tenant's mean rate, OFF periods silent, so the
  mean rate is kept). `rate_per_s` is the overall request rate in the long run, later turns
  included: new work (single requests and sessions' first turns) arrives at
  rate_per_s x (new work / requests).
* Lengths are lognormal (long tails: p99 ~6x the mean at sigma 1), clipped, with the location
  solved so that the mean of the clipped lengths is the configured mean. A first prompt
  (system prompt + new tokens) has mean `prompt_mean`; a later turn's new user message
  `followup_mean`; outputs (max_new_tokens) `output_mean`.
* A share `session_fraction` of the requests belongs to multi-turn sessions of
  1 + Geometric(1 / (turns_mean - 1)) turns (at most `turns_max`), with exponential think times;
  a conversation that would outgrow `context_max` tokens ends early (as does the last one, to
  make the count exact), so a few sessions have fewer turns, even one.
* Tenants fall into `groups` tenant groups (contiguous ids); a group's tenants share one system
  prompt (fixed token ids, `system_prompt_tokens` long) and one prefix-cache salt, so their
  first prompts hit each other's system-prompt blocks. Quota shares (fractions of the pool's
  bytes) are `oversubscription` x the tenant's weight, capped at 1: they may sum to more than 1.
* Events at seeded times in the middle 90 % of the span of arrivals: `quota_cuts` cuts of seeded
  tenants to `cut_to` of their current share, `lease_expiries` expiries of distinct tenants
  (never all of them; a tenant's cuts come before its expiry; `expire_lightest`: the tenants of
  the smallest quota shares, so that an expiry does not take the bulk of the load away). A
  tenant's requests keep arriving
  after its lease expired (its clients do not know): the replay refuses them.

Each part draws from its own child of the seed (`np.random.SeedSequence(seed).spawn`), so e.g.
adding events leaves the requests unchanged. Token ids are not stored: `prompt_ids` and
`system_prompt_ids` regenerate them from (seed, request id) or (seed, group). Saving and loading
(JSONL, also for traces users bring) and `trace_summary` live in `kvquota.sim.trace_io`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional

import numpy as np

from kvquota.errors import InvalidArgumentError

ARRIVALS = ("poisson", "bursty")
EVENT_KINDS = ("quota_cut", "lease_expiry")
_PROMPT_STREAM, _SYSTEM_STREAM = 1, 2  # token-id streams, apart from the generator's children

# Validated ranges: ints (lowest value), positive floats, non-negative floats, fractions.
_INTS = {"seed": 0, "requests": 1, "tenants": 1, "groups": 0, "system_prompt_tokens": 0,
         "prompt_max": 1, "output_max": 1, "turns_max": 1, "context_max": 2, "vocab_size": 2,
         "quota_cuts": 0, "lease_expiries": 0}
_POSITIVE = ("rate_per_s", "burst_mean_s", "prompt_mean", "output_mean", "followup_mean",
             "oversubscription", "turns_mean")
_NON_NEGATIVE = ("prompt_sigma", "output_sigma", "followup_sigma", "tenant_skew",
                 "think_time_mean_s", "session_fraction", "cut_to")


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """How a trace is generated (module docstring: the model). Lengths are in tokens, times in
    seconds; every field is checked on construction (InvalidArgumentError quoting the value).

    `tenant_weights` (one positive number per tenant, normalised) overrides `tenant_skew`.
    `prompt_mean` includes the system prompt (its new part has mean prompt_mean - system);
    `prompt_max` caps the whole first prompt, `prompt_max + output_max <= context_max`.
    """

    seed: int = 0
    requests: int = 100_000
    tenants: int = 8
    groups: int = 2
    system_prompt_tokens: int = 512
    arrival: str = "poisson"
    rate_per_s: float = 50.0
    burst_factor: float = 4.0
    burst_mean_s: float = 5.0
    tenant_weights: Optional[tuple] = None
    tenant_skew: float = 1.0
    oversubscription: float = 1.2
    prompt_mean: float = 2048.0
    prompt_sigma: float = 1.0
    prompt_max: int = 16384
    output_mean: float = 256.0
    output_sigma: float = 1.0
    output_max: int = 4096
    session_fraction: float = 0.3
    turns_mean: float = 4.0
    turns_max: int = 32
    followup_mean: float = 256.0
    followup_sigma: float = 1.0
    think_time_mean_s: float = 20.0
    context_max: int = 32768
    vocab_size: int = 152064
    quota_cuts: int = 2
    cut_to: float = 0.5
    lease_expiries: int = 1
    expire_lightest: bool = False

    def __post_init__(self):
        def bad(name, want):
            raise InvalidArgumentError(f"TraceConfig.{name} must be {want}, got "
                                       f"{getattr(self, name)!r}")

        for name, low in _INTS.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                bad(name, f"an int >= {low}")
        for name in _POSITIVE + _NON_NEGATIVE + ("burst_factor",):
            v = getattr(self, name)
            if not _is_number(v) or (v <= 0 if name in _POSITIVE else v < 0):
                bad(name, "a finite number " + (">" if name in _POSITIVE else ">=") + " 0")
        if not isinstance(self.expire_lightest, bool):
            bad("expire_lightest", "a bool")
        if self.arrival not in ARRIVALS:
            bad("arrival", f"one of {ARRIVALS}")
        if self.burst_factor < 1:
            bad("burst_factor", ">= 1 (ON rate / mean rate)")
        if self.session_fraction > 1:
            bad("session_fraction", "<= 1")
        if self.cut_to >= 1:
            bad("cut_to", "< 1 (the fraction of the current share kept)")
        if self.groups > self.tenants:
            bad("groups", f"<= tenants ({self.tenants})")
        if not 2 <= self.turns_mean <= self.turns_max:
            bad("turns_mean", f"in [2, turns_max={self.turns_max}]")
        if self.lease_expiries >= self.tenants and self.lease_expiries:
            bad("lease_expiries", f"< tenants ({self.tenants}): never expire every tenant")
        if self.tenant_weights is not None:
            w = self.tenant_weights
            if not isinstance(w, (tuple, list)) or len(w) != self.tenants or \
                    not all(_is_number(x) and x > 0 for x in w):
                bad("tenant_weights", f"None or {self.tenants} positive numbers")
            object.__setattr__(self, "tenant_weights", tuple(float(x) for x in w))
        sys_new = self.prompt_mean - self.system_tokens
        if sys_new < 1:
            bad("prompt_mean", f">= system_prompt_tokens + 1 ({self.system_tokens + 1})")
        for mean, sigma, top in (("prompt_mean", "prompt_sigma", "prompt_max"),
                                 ("followup_mean", "followup_sigma", "prompt_max"),
                                 ("output_mean", "output_sigma", "output_max")):
            if getattr(self, mean) > getattr(self, top) or (
                    getattr(self, sigma) > 0 and getattr(self, mean) >= getattr(self, top)):
                bad(mean, f"below {top} ({getattr(self, top)}; equal only at {sigma} 0)")
        if self.prompt_max + self.output_max > self.context_max:
            bad("context_max", f">= prompt_max + output_max "
                               f"({self.prompt_max + self.output_max})")

    @property
    def system_tokens(self) -> int:
        """Tokens of the system prompt that starts every first prompt (0 without groups)."""
        return self.system_prompt_tokens if self.groups else 0

    def to_dict(self) -> dict:
        """The fields as JSON values (tuples as lists): what `Trace.config` records."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict) -> "TraceConfig":
        """The config a `Trace.config` (or a dict of some fields) describes."""
        names = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(d) - names)
        if extra:
            raise InvalidArgumentError(f"unknown TraceConfig field(s) {extra}")
        return cls(**d)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclasses.dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant: its group (-1: none), quota share (fraction of the pool's bytes; the shares
    may sum to > 1, oversubscription) and prefix-cache salt group (-1: private salt; else
    register the tenant with share_group=salt_group, so a group's tenants share prefixes)."""

    tenant: int
    group: int
    quota_share: float
    salt_group: int


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request. `arrival_s`: seconds from the trace's start for turn 0 (and single
    requests), None for a session's turn k > 0, which arrives `think_s` after turn k - 1
    finished. `system`: the group whose system prompt starts the prompt (-1: none; always -1 on
    turn k > 0, whose conversation so far already starts with it). `prompt_tokens`: new tokens
    after the system prompt (turn k > 0: the new user message only; the replay prepends the
    conversation so far). `output_tokens`: max_new_tokens. `prompt`: explicit token ids (user
    traces), else None and `prompt_ids` regenerates them."""

    id: int
    tenant: int
    arrival_s: Optional[float]
    session: int
    turn: int
    think_s: float
    system: int
    prompt_tokens: int
    output_tokens: int
    prompt: Optional[tuple] = None


@dataclasses.dataclass(frozen=True, slots=True)
class TraceEvent:
    """A quota event at `time_s`: "quota_cut" (to `quota_share` of the pool's bytes) or
    "lease_expiry" (quota_share None)."""

    time_s: float
    kind: str
    tenant: int
    quota_share: Optional[float] = None


@dataclasses.dataclass
class Trace:
    """A workload: `config` (the generating TraceConfig as a dict, or a user's metadata),
    tenants by id, requests in (arrival_s, id) order (a session's later turns right after the
    turn before, sorted as their turn 0), events by time, and explicit system prompts
    {group: token ids} (user traces; generated ones regenerate them)."""

    config: dict
    tenants: list
    requests: list
    events: list
    system_prompts: dict = dataclasses.field(default_factory=dict)


# ---- generation ----------------------------------------------------------------------------------
def _clipped_lognormal_mu(mean: float, sigma: float, lo: float, hi: float) -> float:
    """mu such that E[clip(X, lo, hi)] = mean for X ~ lognormal(mu, sigma) (bisection)."""
    if sigma == 0:
        return math.log(mean)
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731

    def clipped_mean(mu):
        a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
        m = math.exp(mu + sigma * sigma / 2)
        return lo * phi(a) + m * (phi(b - sigma) - phi(a - sigma)) + hi * (1 - phi(b))

    low, high = math.log(lo) - 12 * sigma - 12, math.log(hi) + 12
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if clipped_mean(mid) < mean else (low, mid)
    return (low + high) / 2


def _lengths(rng, n: int, mean: float, sigma: float, hi: int) -> np.ndarray:
    """n integer lengths in [1, hi], lognormal with the mean of the clipped values = mean."""
    mu = _clipped_lognormal_mu(mean, sigma, 1.0, float(hi))
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, hi).astype(np.int64)


def _tenant_times(rng, cfg: TraceConfig, rate: float, horizon: float) -> np.ndarray:
    """Arrival times in [0, horizon) of one tenant's process of mean rate `rate`."""
    if cfg.arrival == "poisson" or cfg.burst_factor == 1:
        return np.sort(rng.uniform(0, horizon, rng.poisson(rate * horizon)))
    b, on_mean = cfg.burst_factor, cfg.burst_mean_s
    cycle = on_mean * b  # ON fraction 1 / b at rate b x rate keeps the mean rate
    k = int(horizon / cycle * 1.5) + 16
    while True:
        on = rng.exponential(on_mean, k)
        off = rng.exponential(on_mean * (b - 1), k)
        first_off = off[-1] if rng.random() >= 1 / b else 0.0  # the stationary state at 0
        starts = first_off + np.concatenate([[0.0], np.cumsum(on + off)[:-1]])
        if starts[-1] >= horizon:
            break
        k *= 2
    counts = rng.poisson(b * rate * on)
    t = np.repeat(starts, counts) + rng.uniform(0, 1, counts.sum()) * np.repeat(on, counts)
    return np.sort(t[t < horizon])


def _arrivals(rng, cfg: TraceConfig, rates: np.ndarray, n: int):
    """The first n arrivals of the tenants' independent processes: (times, tenants)."""
    horizon = n / rates.sum() * 1.25 + 10 * cfg.burst_mean_s * (cfg.arrival == "bursty")
    while True:
        parts = [_tenant_times(rng, cfg, r, horizon) for r in rates]
        if sum(len(p) for p in parts) >= n:
            break
        horizon *= 2
    times = np.concatenate(parts)
    owner = np.repeat(np.arange(len(rates)), [len(p) for p in parts])
    order = np.lexsort((owner, times))[:n]
    return times[order], owner[order]


def _sessions(rng, cfg: TraceConfig, target: int):
    """Turn counts, new prompt and output lengths (flat, session-major) of sessions holding
    exactly `target` requests; turns past `context_max` are dropped."""
    p = 1.0 / (cfg.turns_mean - 1)
    turns, prompts, outputs, have = [], [], [], 0
    while have < target:
        k = int((target - have) / cfg.turns_mean * 1.2) + 16
        want = np.minimum(1 + rng.geometric(p, k), cfg.turns_max)
        total = int(want.sum())
        sess = np.repeat(np.arange(k), want)
        first = np.concatenate([[0], np.cumsum(want)[:-1]])
        is_first = np.zeros(total, bool)
        is_first[first] = True
        new = np.where(is_first,
                       _lengths(rng, total, cfg.prompt_mean - cfg.system_tokens,
                                cfg.prompt_sigma, cfg.prompt_max - cfg.system_tokens),
                       _lengths(rng, total, cfg.followup_mean, cfg.followup_sigma,
                                cfg.prompt_max))
        out = _lengths(rng, total, cfg.output_mean, cfg.output_sigma, cfg.output_max)
        run = np.cumsum(new + out)
        context = cfg.system_tokens + run - (run - new - out)[first][sess]
        keep = context <= cfg.context_max  # a prefix of every session: context only grows
        got = np.bincount(sess[keep], minlength=k)
        turns.append(got)
        prompts.append(new[keep])
        outputs.append(out[keep])
        have += int(got.sum())
    turns, prompts, outputs = (np.concatenate(x) for x in (turns, prompts, outputs))
    cum = np.cumsum(turns)
    last = int(np.searchsorted(cum, target))  # the session that reaches the target
    turns = turns[:last + 1].copy()
    turns[-1] -= int(cum[last]) - target  # the last session may end early (even at 1 turn)
    return turns, prompts[:target], outputs[:target]


def _tenant_weights(cfg: TraceConfig) -> np.ndarray:
    w = np.asarray(cfg.tenant_weights if cfg.tenant_weights is not None else
                   1.0 / np.arange(1, cfg.tenants + 1) ** cfg.tenant_skew, np.float64)
    return w / w.sum()


def generate_trace(config: TraceConfig) -> Trace:
    """The trace `config` describes: seeded, deterministic, vectorised."""
    if not isinstance(config, TraceConfig):
        raise InvalidArgumentError(f"expected a TraceConfig, got {type(config).__name__}")
    cfg, n = config, config.requests
    r_sess, r_len, r_arr, r_kind, r_think, r_ev = (
        np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(6))
    weights = _tenant_weights(cfg)
    group = np.arange(cfg.tenants) * cfg.groups // cfg.tenants if cfg.groups else \
        np.full(cfg.tenants, -1)
    share = np.minimum(1.0, cfg.oversubscription * weights)
    tenants = [TenantSpec(t, int(g), float(s), int(g))
               for t, (g, s) in enumerate(zip(group.tolist(), share.tolist()))]

    # What arrives: single requests and sessions (their turns consecutive), in arrival order.
    n_sess_req = int(round(cfg.session_fraction * n))
    if n_sess_req:
        s_turns, s_prompt, s_output = _sessions(r_sess, cfg, n_sess_req)
    else:
        s_turns = s_prompt = s_output = np.zeros(0, np.int64)
    n_single = n - n_sess_req
    n_new = n_single + len(s_turns)
    times, owner = _arrivals(r_arr, cfg, weights * cfg.rate_per_s * n_new / n, n_new)
    is_session = np.zeros(n_new, bool)
    is_session[r_kind.choice(n_new, len(s_turns), replace=False)] = True
    per_new = np.ones(n_new, np.int64)
    per_new[is_session] = s_turns
    which = np.repeat(np.arange(n_new), per_new)  # the new work each request belongs to
    turn = np.arange(n) - np.repeat(np.cumsum(per_new) - per_new, per_new)
    in_session = is_session[which]
    prompt = np.empty(n, np.int64)
    output = np.empty(n, np.int64)
    prompt[in_session], output[in_session] = s_prompt, s_output
    prompt[~in_session] = _lengths(r_len, n_single, cfg.prompt_mean - cfg.system_tokens,
                                   cfg.prompt_sigma, cfg.prompt_max - cfg.system_tokens)
    output[~in_session] = _lengths(r_len, n_single, cfg.output_mean, cfg.output_sigma,
                                   cfg.output_max)
    session = np.where(in_session, np.cumsum(is_session)[which] - 1, -1)
    think = np.where(turn > 0, r_think.exponential(cfg.think_time_mean_s, n), 0.0)
    tenant = owner[which]
    system = np.where((turn == 0) & (cfg.system_tokens > 0), group[tenant], -1)
    arrival = times[which]
    requests = [TraceRequest(i, te, a if k == 0 else None, s, k, th, sy, p, o)
                for i, te, a, s, k, th, sy, p, o in zip(
                    range(n), tenant.tolist(), arrival.tolist(), session.tolist(),
                    turn.tolist(), think.tolist(), system.tolist(), prompt.tolist(),
                    output.tolist())]
    span = (float(times[0]), float(times[-1]))
    return Trace(cfg.to_dict(), tenants, requests, _events(r_ev, cfg, share, span))


def _events(rng, cfg: TraceConfig, share: np.ndarray, span) -> list:
    """Lease expiries of distinct tenants and quota cuts (each before its tenant's expiry) at
    seeded times in the middle 90 % of the span of arrivals."""
    lo = span[0] + 0.05 * (span[1] - span[0])
    hi = span[0] + 0.95 * (span[1] - span[0])
    expired = rng.choice(cfg.tenants, cfg.lease_expiries, replace=False)
    if cfg.expire_lightest:  # drawn all the same: the other events' draws stay as they were
        expired = np.argsort(share, kind="stable")[:cfg.lease_expiries]
    expiry_at = np.full(cfg.tenants, hi)
    expiry_at[expired] = rng.uniform(lo, hi, cfg.lease_expiries)
    cut_tenant = rng.integers(0, cfg.tenants, cfg.quota_cuts)
    cut_at = lo + rng.uniform(0, 1, cfg.quota_cuts) * (expiry_at[cut_tenant] - lo)
    events = [TraceEvent(float(expiry_at[t]), "lease_expiry", int(t)) for t in expired]
    current = share.copy()
    for i in np.argsort(cut_at, kind="stable"):
        t = int(cut_tenant[i])
        current[t] *= cfg.cut_to
        events.append(TraceEvent(float(cut_at[i]), "quota_cut", t, float(current[t])))
    return sorted(events, key=lambda e: e.time_s)


# ---- token ids -------------------------------------------------------------------------------
def _generator(trace: Trace, what: str):
    c = trace.config
    if not all(isinstance(c.get(k), int) for k in ("seed", "vocab_size")):
        raise InvalidArgumentError(f"{what} has no explicit token ids and the trace has no "
                                   "generator config (int seed and vocab_size) to make them")
    return c["seed"], c["vocab_size"]


def prompt_ids(trace: Trace, request: TraceRequest) -> np.ndarray:
    """i32[prompt_tokens]: the token ids of the request's new prompt part (after the system
    prompt): the explicit `prompt`, or ids in [1, vocab_size) drawn from (seed, request id)."""
    if request.prompt is not None:
        return np.asarray(request.prompt, np.int32)
    seed, vocab = _generator(trace, f"request {request.id}")
    rng = np.random.default_rng([seed, _PROMPT_STREAM, request.id])
    return rng.integers(1, vocab, request.prompt_tokens, dtype=np.int32)


def system_prompt_ids(trace: Trace, group: int) -> np.ndarray:
    """i32[system_prompt_tokens]: the system prompt of tenant group `group` (explicit in the
    trace, or drawn from (seed, group)); the same array for every tenant of the group."""
    if group in trace.system_prompts:
        return np.asarray(trace.system_prompts[group], np.int32)
    seed, vocab = _generator(trace, f"system prompt {group}")
    groups, length = trace.config.get("groups", 0), trace.config.get("system_prompt_tokens", 0)
    if not (isinstance(group, int) and 0 <= group < groups and length > 0):
        raise InvalidArgumentError(f"no system prompt for group {group!r} (the trace has "
                                   f"{groups} group(s) of {length} system tokens)")
    rng = np.random.default_rng([seed, _SYSTEM_STREAM, group])
    return rng.integers(1, vocab, length, dtype=np.int32)
