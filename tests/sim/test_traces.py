"""Traces (issue #13 part 2): determinism, the statistics the config promises (means, long tails,
Poisson vs bursty arrivals, tenant split), sessions, shared system prompts, event placement,
the JSONL round trip, every loader error, user traces with explicit prompts, and a config fuzz.

Statistical checks compare with the config within 4 standard errors of the sample (or a few
per cent where the brief asks for that); the traces are seeded, so they are deterministic.
"""

import dataclasses
import json
import math
import re
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquota as kq
from kvquota.errors import InvalidArgumentError
from kvquota.sim import (TenantSpec, Trace, TraceConfig, TraceEvent, TraceFormatError,
                         TraceRequest, generate_trace, load_trace, prompt_ids, save_trace,
                         system_prompt_ids, trace_summary)
from tests.conftest import REPO


@pytest.fixture(scope="module")
def poisson():
    return generate_trace(TraceConfig(seed=1))


@pytest.fixture(scope="module")
def bursty():
    return generate_trace(TraceConfig(seed=1, arrival="bursty"))


def _close(x, target, z=4.0):
    """|mean(x) - target| within z standard errors of the sample."""
    x = np.asarray(x, np.float64)
    se = x.std() / math.sqrt(len(x))
    assert abs(x.mean() - target) <= z * se + 1e-9, (x.mean(), target, se)


def _first_prompt_lengths(trace):
    sys_len = {g: len(system_prompt_ids(trace, g)) for g in range(trace.config["groups"])}
    return np.array([r.prompt_tokens + sys_len.get(r.system, 0)
                     for r in trace.requests if r.turn == 0])


def _check_structure(trace: Trace, cfg: TraceConfig):
    """What every generated trace satisfies, whatever the config."""
    reqs = trace.requests
    assert [r.id for r in reqs] == list(range(cfg.requests))
    assert [t.tenant for t in trace.tenants] == list(range(cfg.tenants))
    heads, last, starts = {}, {}, []
    for r in reqs:
        assert 0 <= r.tenant < cfg.tenants and r.prompt is None
        assert 1 <= r.output_tokens <= cfg.output_max and r.prompt_tokens >= 0
        if r.turn == 0:
            assert r.arrival_s is not None and r.think_s == 0.0 and r.arrival_s >= 0
            starts.append(r.arrival_s)
            group = trace.tenants[r.tenant].group
            assert r.system == (group if cfg.system_tokens else -1)
            assert 1 <= r.prompt_tokens + cfg.system_tokens * (r.system >= 0) <= cfg.prompt_max
        else:
            assert r.arrival_s is None and r.think_s >= 0 and r.system == -1
            assert r.session >= 0 and last[r.session] == (r.id - 1, r.turn - 1)  # consecutive
            assert r.tenant == heads[r.session].tenant
        if r.session >= 0:
            heads.setdefault(r.session, r)
            last[r.session] = (r.id, r.turn)
        else:
            assert r.turn == 0
    assert starts == sorted(starts)
    assert sorted(heads) == list(range(len(heads)))  # sessions numbered in arrival order
    assert sum(r.session >= 0 for r in reqs) == round(cfg.session_fraction * cfg.requests)
    context = {}
    for r in reqs:  # a session's context never outgrows context_max
        if r.session >= 0:
            context[r.session] = context.get(r.session, cfg.system_tokens) + \
                r.prompt_tokens + r.output_tokens
            assert context[r.session] <= cfg.context_max
    shares = [t.quota_share for t in trace.tenants]
    assert all(0 < s <= 1 for s in shares) and sum(shares) <= cfg.oversubscription + 1e-9
    assert [e.time_s for e in trace.events] == sorted(e.time_s for e in trace.events)
    expired = [e.tenant for e in trace.events if e.kind == "lease_expiry"]
    assert len(expired) == len(set(expired)) == cfg.lease_expiries
    assert sum(e.kind == "quota_cut" for e in trace.events) == cfg.quota_cuts
    lo, hi = min(starts), max(starts)
    for e in trace.events:
        assert lo <= e.time_s <= hi


# ---- determinism ---------------------------------------------------------------------------------
def test_same_seed_same_trace_other_seed_differs(poisson):
    cfg = TraceConfig(seed=1)
    assert generate_trace(cfg) == poisson
    other = generate_trace(dataclasses.replace(cfg, seed=2))
    assert other.requests != poisson.requests and other.events != poisson.events
    assert [r.arrival_s for r in other.requests[:100]] != \
        [r.arrival_s for r in poisson.requests[:100]]


def test_each_part_has_its_own_stream():
    base = TraceConfig(seed=3, requests=2000)
    more_events = dataclasses.replace(base, quota_cuts=7, lease_expiries=3, cut_to=0.25)
    assert generate_trace(more_events).requests == generate_trace(base).requests
    poisson, bursty = (generate_trace(dataclasses.replace(base, arrival=a)).requests
                       for a in ("poisson", "bursty"))
    key = lambda rs: [(r.session, r.turn, r.prompt_tokens, r.output_tokens) for r in rs]  # noqa
    assert sorted(key(poisson)) == sorted(key(bursty))  # lengths and sessions do not move


def test_structure_of_default_traces(poisson, bursty):
    _check_structure(poisson, TraceConfig(seed=1))
    _check_structure(bursty, TraceConfig(seed=1, arrival="bursty"))


# ---- statistics --------------------------------------------------------------------------------
def test_length_means_match_the_config(poisson):
    cfg = TraceConfig(seed=1)
    first = _first_prompt_lengths(poisson)
    later = [r.prompt_tokens for r in poisson.requests if r.turn > 0]
    outputs = [r.output_tokens for r in poisson.requests]
    for x, mean in ((first, cfg.prompt_mean), (later, cfg.followup_mean),
                    (outputs, cfg.output_mean)):
        _close(x, mean)
        assert abs(np.mean(x) / mean - 1) < 0.03


def test_lengths_are_long_tailed_and_clipped(poisson):
    cfg = TraceConfig(seed=1)
    first = _first_prompt_lengths(poisson)
    outputs = np.array([r.output_tokens for r in poisson.requests])
    for x, top in ((first, cfg.prompt_max), (outputs, cfg.output_max)):
        assert np.percentile(x, 99) > 4 * x.mean() > 4 * np.median(x)
        assert x.max() == top and x.min() >= 1  # the clip is reached, never passed


def test_heavily_clipped_lengths_keep_the_configured_mean():
    # With the clip at 2x the mean and sigma 1.5, a plain lognormal of that mean would lose
    # about a third of it to the clip: the location is solved for the clipped mean instead.
    cfg = TraceConfig(requests=20_000, groups=0, prompt_mean=300, prompt_max=600,
                      prompt_sigma=1.5, output_mean=50, output_max=100, output_sigma=1.5,
                      session_fraction=0)
    trace = generate_trace(cfg)
    for x, mean, top in (([r.prompt_tokens for r in trace.requests], 300, 600),
                         ([r.output_tokens for r in trace.requests], 50, 100)):
        _close(x, mean)
        assert abs(np.mean(x) / mean - 1) < 0.03 and max(x) == top


def test_sigma_zero_gives_fixed_lengths():
    cfg = TraceConfig(requests=500, prompt_sigma=0, output_sigma=0, followup_sigma=0,
                      output_mean=100, followup_mean=40)
    trace = generate_trace(cfg)
    assert set(_first_prompt_lengths(trace)) == {2048}
    assert {r.output_tokens for r in trace.requests} == {100}
    assert {r.prompt_tokens for r in trace.requests if r.turn} == {40}


def test_poisson_interarrivals_are_exponential(poisson):
    cfg = TraceConfig(seed=1)
    t0 = [r for r in poisson.requests if r.turn == 0]
    times = np.array([r.arrival_s for r in t0])
    rate_new = cfg.rate_per_s * len(t0) / cfg.requests  # new work: the rest follows it
    gaps = np.diff(times)
    _close(gaps, 1 / rate_new)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.03  # CV of an exponential: 1
    tenant = np.array([r.tenant for r in t0])
    for t in range(cfg.tenants):  # each tenant's own process is Poisson too
        g = np.diff(times[tenant == t])
        assert abs(g.std() / g.mean() - 1) < 6 / math.sqrt(len(g))
    assert abs(cfg.requests / (times[-1] - times[0]) / cfg.rate_per_s - 1) < 0.03


def test_bursty_arrivals_keep_the_rate_and_cluster(bursty):
    cfg = TraceConfig(seed=1, arrival="bursty")
    times = np.array([r.arrival_s for r in bursty.requests if r.turn == 0])
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() > 2  # clearly burstier than Poisson (1)
    counts = np.bincount((times // 10).astype(int))[:-1]  # whole 10 s windows
    assert counts.var() / counts.mean() > 10  # index of dispersion (Poisson: 1)
    assert abs(cfg.requests / (times[-1] - times[0]) / cfg.rate_per_s - 1) < 0.1


def test_tenant_split_follows_weights(poisson):
    cfg = TraceConfig(seed=1)
    w = 1 / np.arange(1, 9) ** cfg.tenant_skew
    share = np.bincount([r.tenant for r in poisson.requests if r.turn == 0]) / \
        sum(r.turn == 0 for r in poisson.requests)
    np.testing.assert_allclose(share, w / w.sum(), atol=0.01)
    np.testing.assert_allclose([t.quota_share for t in poisson.tenants],
                               np.minimum(1, cfg.oversubscription * w / w.sum()))
    weights = (1, 1, 2, 4)
    trace = generate_trace(TraceConfig(requests=8000, tenants=4, groups=1,
                                       tenant_weights=weights))
    got = np.bincount([r.tenant for r in trace.requests if r.turn == 0], minlength=4)
    np.testing.assert_allclose(got / got.sum(), np.array(weights) / 8, atol=0.03)


# ---- sessions ----------------------------------------------------------------------------------
def test_sessions_turns_and_think_times(poisson):
    cfg = TraceConfig(seed=1)
    turns = np.bincount([r.session for r in poisson.requests if r.session >= 0])
    assert turns.min() >= 1 and turns.max() <= cfg.turns_max
    _close(turns, cfg.turns_mean)
    think = [r.think_s for r in poisson.requests if r.turn > 0]
    _close(think, cfg.think_time_mean_s)
    assert abs(np.std(think) / np.mean(think) - 1) < 0.05  # exponential


def test_sessions_end_before_outgrowing_the_context():
    cfg = TraceConfig(requests=3000, session_fraction=1.0, prompt_mean=600, prompt_max=1024,
                      output_mean=100, output_max=256, followup_mean=200, context_max=1600,
                      turns_mean=8)
    trace = generate_trace(cfg)
    _check_structure(trace, cfg)
    turns = np.bincount([r.session for r in trace.requests])
    assert turns.mean() < cfg.turns_mean - 2  # the cap binds: sessions end early


# ---- token ids ---------------------------------------------------------------------------------
def test_system_prompts_are_shared_within_a_group_and_differ_across(poisson):
    cfg = TraceConfig(seed=1)
    a, b = system_prompt_ids(poisson, 0), system_prompt_ids(poisson, 1)
    assert a.dtype == np.int32 and len(a) == len(b) == cfg.system_prompt_tokens
    np.testing.assert_array_equal(a, system_prompt_ids(generate_trace(TraceConfig(
        seed=1, requests=10)), 0))  # a function of (seed, group) only
    assert (a != b).mean() > 0.99
    assert 1 <= min(a.min(), b.min()) and max(a.max(), b.max()) < cfg.vocab_size
    by_group = {}
    for t in poisson.tenants:
        assert t.salt_group == t.group  # a group shares one prefix-cache salt
        by_group.setdefault(t.group, []).append(t.tenant)
    assert sorted(by_group) == [0, 1] and all(len(v) == 4 for v in by_group.values())
    systems = {(r.tenant, r.system) for r in poisson.requests if r.turn == 0}
    assert systems == {(t.tenant, t.group) for t in poisson.tenants}
    with pytest.raises(InvalidArgumentError, match="group 2"):
        system_prompt_ids(poisson, 2)


def test_no_groups_no_system_prompts():
    trace = generate_trace(TraceConfig(requests=300, groups=0))
    assert {r.system for r in trace.requests} == {-1}
    assert {(t.group, t.salt_group) for t in trace.tenants} == {(-1, -1)}
    _check_structure(trace, TraceConfig(requests=300, groups=0))
    with pytest.raises(InvalidArgumentError):
        system_prompt_ids(trace, 0)


def test_prompt_ids_are_deterministic_per_request(poisson):
    r0, r1 = poisson.requests[:2]
    ids = prompt_ids(poisson, r0)
    assert ids.dtype == np.int32 and len(ids) == r0.prompt_tokens
    assert ids.min() >= 1 and ids.max() < poisson.config["vocab_size"]
    np.testing.assert_array_equal(ids, prompt_ids(poisson, r0))
    other = prompt_ids(poisson, r1)
    n = min(len(ids), len(other))
    assert (ids[:n] != other[:n]).mean() > 0.99
    reseeded = generate_trace(TraceConfig(seed=2, requests=10))
    assert not np.array_equal(prompt_ids(reseeded, dataclasses.replace(r0))[:n], ids[:n])
    longer = dataclasses.replace(r0, prompt_tokens=r0.prompt_tokens + 5)
    np.testing.assert_array_equal(prompt_ids(poisson, longer)[:len(ids)], ids)  # one stream


# ---- events ------------------------------------------------------------------------------------
def test_events_are_placed_inside_the_trace_and_compound():
    cfg = TraceConfig(seed=5, requests=4000, tenants=4, quota_cuts=12, cut_to=0.5,
                      lease_expiries=3)
    trace = generate_trace(cfg)
    _check_structure(trace, cfg)
    times = [r.arrival_s for r in trace.requests if r.turn == 0]
    lo, hi = min(times), max(times)
    expiry = {e.tenant: e.time_s for e in trace.events if e.kind == "lease_expiry"}
    assert len(expiry) == 3
    share = {t.tenant: t.quota_share for t in trace.tenants}
    for e in trace.events:
        assert lo + 0.05 * (hi - lo) <= e.time_s <= lo + 0.95 * (hi - lo)
        if e.kind == "quota_cut":
            assert e.time_s < expiry.get(e.tenant, math.inf)  # no cut after the expiry
            share[e.tenant] *= cfg.cut_to
            assert e.quota_share == pytest.approx(share[e.tenant], rel=1e-12)
        else:
            assert e.quota_share is None
    with pytest.raises(InvalidArgumentError, match="never expire every tenant"):
        TraceConfig(tenants=4, lease_expiries=4)


def test_expire_lightest_expires_the_smallest_shares_and_changes_nothing_else():
    base = TraceConfig(seed=3, requests=2000, tenants=6, quota_cuts=4, lease_expiries=2)
    plain, light = generate_trace(base), generate_trace(
        dataclasses.replace(base, expire_lightest=True))
    assert light.requests == plain.requests and light.tenants == plain.tenants
    share = sorted((t.quota_share, t.tenant) for t in light.tenants)
    expired = sorted(e.tenant for e in light.events if e.kind == "lease_expiry")
    assert expired == sorted(t for _, t in share[:2])
    assert sorted(e.time_s for e in light.events if e.kind == "lease_expiry") == sorted(
        e.time_s for e in plain.events if e.kind == "lease_expiry")
    with pytest.raises(InvalidArgumentError, match="expire_lightest"):
        TraceConfig(expire_lightest=1)


# ---- config validation ------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("requests", 0), ("requests", 2.5), ("requests", True), ("tenants", 0), ("seed", -1),
    ("groups", 9), ("arrival", "uniform"), ("rate_per_s", 0), ("rate_per_s", math.inf),
    ("burst_factor", 0.5), ("session_fraction", 1.5), ("cut_to", 1.0), ("cut_to", -0.1),
    ("turns_mean", 1.5), ("turns_mean", 40), ("prompt_mean", 512), ("prompt_mean", 16384),
    ("output_mean", 5000), ("prompt_sigma", -1), ("context_max", 20000),
    ("tenant_weights", (1, 2)), ("tenant_weights", (1, 1, 1, 1, 1, 1, 1, 0)),
    ("think_time_mean_s", "20"), ("vocab_size", 1),
])
def test_bad_config_is_a_typed_error_quoting_the_value(field, value):
    pattern = re.escape(f"TraceConfig.{field} must be ") + ".*" + re.escape(f", got {value!r}")
    with pytest.raises(InvalidArgumentError, match=pattern):
        TraceConfig(**{field: value})


def test_config_round_trips_through_its_dict():
    cfg = TraceConfig(tenants=3, groups=1, tenant_weights=[1, 2, 3], arrival="bursty")
    assert cfg.tenant_weights == (1.0, 2.0, 3.0)
    assert TraceConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(InvalidArgumentError, match="nonsense"):
        TraceConfig.from_dict({"nonsense": 1})
    with pytest.raises(InvalidArgumentError, match="TraceConfig"):
        generate_trace({"seed": 0})


# ---- files ---------------------------------------------------------------------------------------
def test_save_load_round_trip_is_exact(tmp_path, bursty):
    small = generate_trace(TraceConfig(seed=4, requests=3000, arrival="bursty"))
    for trace in (small, bursty):
        save_trace(trace, tmp_path / "t.jsonl")
        back = load_trace(tmp_path / "t.jsonl")
        assert back == trace
    assert TraceConfig.from_dict(back.config) == TraceConfig(seed=1, arrival="bursty")
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"kind": "header", "format": "kvquota-trace", "version": 1,
                                    "config": bursty.config}
    assert len(lines) == 1 + 8 + 100_000 + len(bursty.events)
    assert "prompt" not in json.loads(lines[9])  # ids are regenerated, never stored


def _user_lines():
    """A small user trace: explicit prompts, one system prompt, a session, two events."""
    return [
        {"kind": "header", "format": "kvquota-trace", "version": 1, "config": {"note": "mine"}},
        {"kind": "tenant", "tenant": 0, "group": 0, "quota_share": 0.5, "salt_group": 0},
        {"kind": "tenant", "tenant": 1, "group": -1, "quota_share": 1, "salt_group": -1},
        {"kind": "system", "group": 0, "prompt": [9, 8, 7, 6]},
        {"kind": "request", "id": 10, "tenant": 1, "arrival_s": 2.0, "session": -1, "turn": 0,
         "think_s": 0, "system": -1, "prompt_tokens": 2, "output_tokens": 5, "prompt": [4, 5]},
        {"kind": "request", "id": 3, "tenant": 0, "arrival_s": 1, "session": 7, "turn": 0,
         "think_s": 0.0, "system": 0, "prompt_tokens": 3, "output_tokens": 4,
         "prompt": [1, 2, 3]},
        {"kind": "request", "id": 4, "tenant": 0, "arrival_s": None, "session": 7, "turn": 1,
         "think_s": 1.5, "system": -1, "prompt_tokens": 1, "output_tokens": 2, "prompt": [0]},
        {"kind": "event", "time_s": 3.0, "event": "lease_expiry", "tenant": 1,
         "quota_share": None},
        {"kind": "event", "time_s": 1.5, "event": "quota_cut", "tenant": 0, "quota_share": 0.25},
    ]


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def test_user_trace_with_explicit_prompts(tmp_path):
    trace = load_trace(_write(tmp_path / "user.jsonl", _user_lines()))
    assert trace.config == {"note": "mine"}
    assert [r.id for r in trace.requests] == [3, 4, 10]  # by arrival, a session's turns after
    assert [e.kind for e in trace.events] == ["quota_cut", "lease_expiry"]
    assert trace.tenants[1] == TenantSpec(1, -1, 1.0, -1)
    assert trace.requests[0] == TraceRequest(3, 0, 1.0, 7, 0, 0.0, 0, 3, 4, (1, 2, 3))
    np.testing.assert_array_equal(prompt_ids(trace, trace.requests[0]), [1, 2, 3])
    assert prompt_ids(trace, trace.requests[1]).dtype == np.int32
    np.testing.assert_array_equal(system_prompt_ids(trace, 0), [9, 8, 7, 6])
    summary = trace_summary(trace)
    assert summary["first_prompt_tokens"]["max"] == 7 and summary["sessions"] == 1
    save_trace(trace, tmp_path / "again.jsonl")
    assert load_trace(tmp_path / "again.jsonl") == trace
    with pytest.raises(InvalidArgumentError, match="no explicit token ids"):
        prompt_ids(trace, dataclasses.replace(trace.requests[0], prompt=None))


def _set(i, **fields):
    def edit(lines):
        lines[i] = {**lines[i], **fields}
        return lines
    return edit


def _drop(i, *keys):
    def edit(lines):
        lines[i] = {k: v for k, v in lines[i].items() if k not in keys} if keys else None
        return [x for x in lines if x is not None]
    return edit


# (edit of _user_lines, 1-based line of the error, words of the message)
BAD = {
    "unknown kind": (_set(1, kind="tenants"), 2, "unknown kind 'tenants'"),
    "missing field": (_drop(4, "output_tokens"), 5, "lacks field 'output_tokens'"),
    "extra field": (_set(4, colour="red"), 5, "unexpected field(s) ['colour']"),
    "string for int": (_set(4, tenant="1"), 5, "'tenant' must be an integer"),
    "bool for int": (_set(4, output_tokens=True), 5, "'output_tokens' must be an integer"),
    "float for int": (_set(4, prompt_tokens=2.0), 5, "'prompt_tokens' must be an integer"),
    "string for float": (_set(2, quota_share="1"), 3, "'quota_share' must be a finite number"),
    "negative prompt": (_set(4, prompt_tokens=-1), 5, "'prompt_tokens' must be >= 0"),
    "zero output": (_set(4, output_tokens=0), 5, "'output_tokens' must be >= 1"),
    "negative arrival": (_set(4, arrival_s=-1.0), 5, "'arrival_s' must be >= 0"),
    "negative think": (_set(6, think_s=-1.0), 7, "'think_s' must be >= 0"),
    "negative share": (_set(8, quota_share=-0.5), 9, "'quota_share' must be >= 0"),
    "duplicate id": (_set(4, id=3), 6, "duplicate request id 3"),
    "duplicate tenant": (_set(2, tenant=0), 3, "duplicate tenant 0"),
    "turn 0 missing": (_drop(5), 6, "turns out of order (turn 1 where turn 0"),
    "turns out of order": (lambda l: l[:5] + [l[6], l[5]] + l[7:], 6, "out of order"),
    "turn repeated": (_set(6, turn=0, arrival_s=1.0, think_s=0.0, system=0), 7,
                      "turn 0 where turn 1"),
    "no arrival on turn 0": (_set(5, arrival_s=None), 6, "turn 0 needs an arrival_s"),
    "arrival on turn 1": (_set(6, arrival_s=2.0), 7, "arrival_s null"),
    "think on turn 0": (_set(5, think_s=1.0), 6, "turn 0 needs an arrival_s and think_s 0"),
    "single with turns": (_set(4, turn=1, arrival_s=None, think_s=1.0), 5, "single request"),
    "session changes tenant": (_set(6, tenant=1), 7, "session 7 changes tenant"),
    "request unknown tenant": (_set(4, tenant=5), 5, "unknown tenant 5"),
    "event unknown tenant": (_set(7, tenant=3), 8, "event for unknown tenant 3"),
    "unknown event": (_set(7, event="holiday"), 8, "unknown event 'holiday'"),
    "cut without share": (_set(8, quota_share=None), 9, "quota_cut event needs a quota_share"),
    "expiry with share": (_set(7, quota_share=0.1), 8, "lease_expiry event has quota_share null"),
    "prompt length": (_set(4, prompt_tokens=3), 5, "prompt has 2 ids, prompt_tokens says 3"),
    "negative token id": (_set(4, prompt=[-1, 2]), 5, "a list of token ids"),
    "token past vocab": (_set(0, config={"vocab_size": 5}), 4,
                         "token id >= the header's vocab_size 5"),
    "no prompt, no generator": (_drop(4, "prompt"), 5, "no prompt and the header's config"),
    "unknown system": (_set(5, system=1), 6, "no system prompt for group 1"),
    "empty first prompt": (_set(4, prompt_tokens=0, prompt=[]), 5, "empty first prompt"),
    "no header": (lambda l: l[1:], 1, "first line must be the header"),
    "second header": (lambda l: l + [l[0]], 10, "a second header"),
    "wrong version": (_set(0, version=2), 1, "version 2"),
    "wrong format": (_set(0, format="csv"), 1, "format 'csv'"),
    "duplicate system": (lambda l: l[:4] + [l[3]] + l[4:], 5, "system group 0"),
    "blank line": (lambda l: l[:3] + [""] + l[3:], 4, "blank line"),
    "not json": (lambda l: l[:3] + ["{oops"] + l[3:], 4, "not JSON"),
    "nan": (lambda l: l[:3] + ['{"kind": "tenant", "tenant": 4, "group": 0, "quota_share": '
                               'NaN, "salt_group": 0}'] + l[3:], 4, "not finite: NaN"),
    "not an object": (lambda l: l[:3] + ["[1, 2]"] + l[3:], 4, "expected a JSON object"),
    "empty file": (lambda l: [], 1, "no header line"),
    # Errors at the header (line 1), where the request count is claimed.
    "no requests": (lambda l: l[:4] + l[7:], 1, "no request lines"),
    "no requests of the 300 claimed": (
        lambda l: _set(0, config={"requests": 300})(l[:4] + l[7:]), 1,
        "no request lines: a trace needs at least one request (the header's config says 300)"),
    "fewer requests than claimed": (_set(0, config={"requests": 4}), 1,
                                    "the header's config says 4 requests, the file has 3"),
    "more requests than claimed": (_set(0, config={"requests": 2}), 1,
                                   "the header's config says 2 requests, the file has 3"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_loader_errors_name_file_line_and_problem(tmp_path, case):
    edit, line, words = BAD[case]
    path = _write(tmp_path / "bad.jsonl", edit(_user_lines()))
    if case == "empty file":
        path.write_text("")
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    assert isinstance(err.value, InvalidArgumentError)
    assert str(err.value).startswith(f"{path}:{line}: "), str(err.value)
    assert words in str(err.value)


def test_a_generated_trace_cut_short_is_refused_and_committed_traces_load(tmp_path):
    """A file's request lines must be as many as its header's config.requests says: a generated
    trace cut short neither loads nor saves; the traces committed under results/ load."""
    trace = generate_trace(TraceConfig(seed=2, requests=50, tenants=2, groups=1))
    path = tmp_path / "t.jsonl"
    save_trace(trace, path)
    lines = path.read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "request")
    _write(path, lines[:last] + lines[last + 1:])
    with pytest.raises(TraceFormatError, match=re.escape(
            f"{path}:1: the header's config says 50 requests, the file has 49 request lines")):
        load_trace(path)
    cut = dataclasses.replace(trace, requests=trace.requests[:-1])
    with pytest.raises(TraceFormatError, match="says 50 requests, the file has 49"):
        save_trace(cut, tmp_path / "cut.jsonl")
    committed = sorted((REPO / "results").glob("**/trace.jsonl"))
    assert committed
    for path in committed:
        back = load_trace(path)
        assert len(back.requests) == back.config["requests"]


def test_load_of_a_missing_file_is_typed(tmp_path):
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")


def test_save_refuses_a_trace_the_loader_would_reject(tmp_path):
    good = load_trace(_write(tmp_path / "user.jsonl", _user_lines()))
    bad = dataclasses.replace(good, events=good.events + [TraceEvent(9.0, "quota_cut", 6, 0.1)])
    with pytest.raises(TraceFormatError, match="unknown tenant 6"):
        save_trace(bad, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()
    with pytest.raises(TraceFormatError, match="not JSON data"):
        save_trace(dataclasses.replace(good, config={"x": object()}), tmp_path / "out.jsonl")
    with pytest.raises(InvalidArgumentError):
        save_trace([], tmp_path / "out.jsonl")


# ---- summary -----------------------------------------------------------------------------------
def test_summary_figures(poisson):
    s = trace_summary(poisson)
    assert json.loads(json.dumps(s)) == s
    assert s["requests"] == 100_000 and s["single_requests"] + s["session_requests"] == 100_000
    assert s["sessions"] == 1 + max(r.session for r in poisson.requests)
    assert sum(s["requests_per_tenant"].values()) == 100_000
    assert s["first_prompt_tokens"]["mean"] == pytest.approx(_first_prompt_lengths(
        poisson).mean())
    assert s["output_tokens"]["p99"] > s["output_tokens"]["mean"] > s["output_tokens"]["p50"]
    assert s["events_by_kind"] == {"quota_cut": 2, "lease_expiry": 1}
    assert s["span_s"] == pytest.approx(100_000 / 50, rel=0.03)


# ---- fuzz ----------------------------------------------------------------------------------------
@st.composite
def configs(draw):
    tenants = draw(st.integers(1, 5))
    system = draw(st.sampled_from([0, 4, 32]))
    prompt_max = draw(st.integers(system + 8, 400))
    output_max = draw(st.integers(1, 64))
    output_sigma = 0.0 if output_max == 1 else draw(st.floats(0, 2))
    output_mean = draw(st.floats(1, output_max, exclude_max=output_sigma > 0))
    turns_max = draw(st.integers(2, 8))
    return TraceConfig(
        seed=draw(st.integers(0, 2**31)), requests=draw(st.integers(1, 250)), tenants=tenants,
        groups=draw(st.integers(0, tenants)), system_prompt_tokens=system,
        arrival=draw(st.sampled_from(["poisson", "bursty"])),
        rate_per_s=draw(st.floats(0.1, 100)), burst_factor=draw(st.floats(1, 10)),
        burst_mean_s=draw(st.floats(0.1, 10)), tenant_skew=draw(st.floats(0, 2)),
        prompt_mean=draw(st.floats(system + 1, prompt_max - 1)),
        prompt_sigma=draw(st.floats(0, 2)), prompt_max=prompt_max,
        output_mean=output_mean, output_sigma=output_sigma, output_max=output_max,
        session_fraction=draw(st.floats(0, 1)), turns_mean=draw(st.floats(2, turns_max)),
        turns_max=turns_max, followup_mean=draw(st.floats(1, prompt_max - 1)),
        think_time_mean_s=draw(st.floats(0, 30)),
        context_max=draw(st.integers(prompt_max + output_max, 2 * (prompt_max + output_max))),
        vocab_size=draw(st.integers(2, 1000)), quota_cuts=draw(st.integers(0, 4)),
        cut_to=draw(st.floats(0, 0.99)), lease_expiries=draw(st.integers(0, tenants - 1)))


@settings(max_examples=60, deadline=None)
@given(configs())
def test_fuzzed_configs_give_valid_traces_that_round_trip(cfg):
    trace = generate_trace(cfg)
    _check_structure(trace, cfg)
    assert generate_trace(cfg) == trace
    for r in trace.requests[:5]:
        ids = prompt_ids(trace, r)
        assert len(ids) == r.prompt_tokens and (len(ids) == 0 or 1 <= ids.min() <= ids.max()
                                                < cfg.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        save_trace(trace, f"{tmp}/t.jsonl")
        assert load_trace(f"{tmp}/t.jsonl") == trace
    assert trace_summary(trace)["requests"] == cfg.requests


def test_public_api_is_reachable_from_kvquota():
    assert kq.sim.generate_trace is generate_trace and kq.sim.TraceFormatError is \
        TraceFormatError
    assert set(kq.sim.__all__) >= {"TraceConfig", "Trace", "TraceRequest", "TraceEvent",
                                   "TenantSpec", "generate_trace", "prompt_ids",
                                   "system_prompt_ids", "save_trace", "load_trace",
                                   "trace_summary", "TraceFormatError"}
