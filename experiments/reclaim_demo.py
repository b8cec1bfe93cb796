r"""The main job: three tenants decode on SmolLM2 while one's quota is cut and another's lease ends.

  python -m experiments.reclaim_demo [--policy=tiered] [--max_new_tokens=48] [--json]

Tenants A and B share a system prompt (one share group; A's first request pins its full blocks),
C is private. All of them decode on one paged KV cache (f32 pages, blocks of 16 tokens) through
the multi-tenant scheduler (`kq.serving.Scheduler`: one jitted step and one readback per step).
At step S1 A's byte quota is cut below what it holds, and the reclaim runs while A's requests
decode (`plan_reclaim` -> `apply_plan` under `--policy`); at S1 - 1 C tops up (a new request
and a higher quota), and pool 0 is sized so that the top-up is refused then (pool full) and fits
right after A's reclaim. At S2 B's lease expires. The same requests first run once with no
event on a roomy pool: that run sizes the pool and is the reference each survivor's tokens are
compared with. Printed: the ledger before and after each event, the plan, every survivor's fate
and resume cost, the bytes that pins and other tenants held back, the answers and their token
agreement. The run directory (experiments/runs.py) holds the step metrics (points.jsonl), the
event log (events.jsonl), the summary and timeline.png; --json prints the summary as one line.
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import flags

import kvquota as kq
from experiments import cli, runs

FLAGS = flags.FLAGS
NAMES = {0: "A", 1: "B", 2: "C"}
BLOCK = 16  # tokens per block
SYSTEM = ("You are the support assistant of a cloud provider. Answer every question in one "
          "short, complete sentence. Be precise and plain, do not invent product names, and if "
          "you do not know the answer, say so.")
QUESTIONS = {  # name: (tenant, user message, arrival step); A0 pins the system prompt
    "A0": (0, "Summarize in one sentence:\n{doc0}", 0),
    "A1": (0, "Summarize in one sentence:\n{doc1}", 1),
    "B0": (1, "What is a KV cache in a language model?", 1),
    "B1": (1, "Why do long prompts use more GPU memory?", 1),
    "C0": (2, "What does a byte quota limit?", 0),
}
TOPUP = "C1", (2, "What is a lease?", 0)
MEANS_TIER = {"drop_cold": "free", "drop_idle": "free", "preempt": "free", "release": "free",
              "offload_idle": "offload", "suspend_running": "offload", "compress": "compress",
              "evict": "evict"}


def define_flags():
    cli.define_model(extra_help="Weights ship only for smollm2-135m; others need --weights.")
    flags.DEFINE_string("weights", None, "A .gguf file or Hugging Face checkpoint directory "
                        "(default: the packaged SmolLM2 weights).")
    flags.DEFINE_enum("policy", "tiered", list(kq.reclaim.PRESETS), "Reclaim policy preset.")
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per request at most.",
                         lower_bound=4, upper_bound=128)
    runs.define_flags()


def _prompts(tok) -> dict:
    from pydoc_data.topics import topics

    docs = {"doc0": " ".join(topics["break"].split()[:60]),
            "doc1": " ".join(topics["assert"].split()[:60])}
    out = {}
    for name, (tenant, text, arrival) in list(QUESTIONS.items()) + [TOPUP]:
        ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": text.format(**docs)}]))
        out[name] = (tenant, ids, arrival)
    sys_ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                 add_generation_prompt=False))
    # A0 pins all but the last full block of the system prompt: B's requests share them all
    return out, max(1, len(sys_ids) // BLOCK - 1)


def _serve(config, params, sc, prompts, pins, stop, max_new, events, policy, quotas, **kw):
    """One scheduler run of the scenario's requests (C's top-up arrives by a burst event).
    A chunk holds a whole prompt (one prefill step each; chunk_floor = chunk_size: two
    compiles of the step, decode only and mixed), one prompt per step beside the decodes."""
    chunk = 1 << (max(len(ids) for _, ids, _ in prompts.values()) - 1).bit_length()
    ex = kq.serving.ModelExecutor(config, params, sc, prefill_rows=2, chunk_size=chunk,
                                  chunk_floor=chunk)
    s = kq.serving.Scheduler(ex, events=events, policy=policy, token_budget=chunk + sc.max_seqs,
                             **kw)
    for t, quota in quotas.items():
        s.register_tenant(t, token_quota=10**6, byte_quota=quota, share_group=1 if t < 2 else None)
    reqs = {}
    for name, (tenant, ids, arrival) in prompts.items():
        if name != TOPUP[0]:
            reqs[name] = s.submit(kq.serving.Request(tenant, ids, max_new, stop_ids=stop,
                                                     name=name, arrival=arrival,
                                                     pin_blocks=pins if name == "A0" else 0))
    return s, reqs


def lane_state(r) -> str:
    """What a request is doing after a step, for its lane in the timeline: its status, with a
    release (its tenant's lease), a preemption (queued to recompute) and a lossy cache told
    apart."""
    status = str(r.status)
    if status == "finished" and r.finish.startswith("released"):
        return "released"
    if status == "queued" and r.resuming:
        return "preempted"
    if status == "running" and r.lossy:
        return "lossy"
    return status


def measure(model: str, weights, policy: str, max_new: int, on_point, on_event) -> dict:
    cli.stage(f"loading {model}")
    config, params = kq.load_pretrained(model, weights)
    tok = kq.load_tokenizer(model, weights)
    prompts, pins = _prompts(tok)
    stop = tuple(tok.stop_ids())
    longest = max(len(ids) for _, ids, _ in prompts.values()) + max_new + BLOCK
    per_seq = -(-longest // BLOCK)
    big = kq.StateConfig(config, num_blocks=8 * per_seq, block_size=BLOCK, max_seqs=8,
                         max_blocks_per_seq=per_seq, num_tenants=3, kv_format="f32",
                         keep_cold_blocks=True)
    block_bytes = big.pool_bytes[0]
    huge = 2 * big.num_blocks * block_bytes  # more than any run holds
    topup = kq.serving.Request(2, prompts[TOPUP[0]][1], max_new, stop_ids=stop, name=TOPUP[0])

    # 1. The reference: the same requests, no event, a roomy pool. It sizes the real run.
    cli.stage("the reference run (no events, a roomy pool: it sizes the pool and gives each "
              "request's unreclaimed tokens)")
    ref, ref_reqs = _serve(config, params, big, prompts, pins, stop, max_new, [], policy,
                           {t: huge for t in NAMES})
    while any(r.status in ("pending", "queued", "prefill") for r in ref_reqs.values()):
        ref.step()  # every first request prefilled: the cut comes 3 steps later
    s1 = ref.t + 3
    topup.arrival = s1 - 1
    ref.submit(topup)
    ref.run(progress=cli.progress_on())
    ref_reqs[TOPUP[0]] = topup
    held = [sum(b["device"] for b in r["bytes"].values()) // block_bytes for r in ref.records]
    c0, c1 = prompts["C0"][1], topup.prompt  # C1 hits C0's full blocks (its private salt)
    same = next((i for i, (a, b) in enumerate(zip(c0, c1)) if a != b), min(len(c0), len(c1)))
    need = -(-len(c1) // BLOCK) - min(same // BLOCK, (len(c1) - 1) // BLOCK)
    growth = held[s1 - 1] - held[s1 - 2] - need  # blocks the step before the cut allocated
    a_bytes = ref.records[s1 - 1]["bytes"]["0"]["device"]
    cut = a_bytes - (need + max(growth, 0) + 1) * block_bytes
    b_done = min(r.finished_step for name, r in ref_reqs.items() if name[0] == "B")
    s2 = s1 + max(2, (b_done - s1) // 2)  # B's lease ends while it decodes
    sc = kq.StateConfig(config, num_blocks=held[s1 - 2] + need - 1, block_size=BLOCK,
                        max_seqs=8, max_blocks_per_seq=per_seq, num_tenants=3, kv_format="f32",
                        host_blocks=a_bytes // block_bytes + 4, keep_cold_blocks=True)

    # 2. The real run: C tops up at S1 - 1, A's quota is cut at S1, B's lease ends at S2.
    topup2 = kq.serving.Request(2, prompts[TOPUP[0]][1], max_new, stop_ids=stop, name=TOPUP[0])
    events = [kq.serving.Event(s1 - 1, "burst", 2, byte_quota=huge,
                               requests=(topup2,)),
              kq.serving.Event(s1, "quota_cut", 0, byte_quota=cut),
              kq.serving.Event(s2, "lease_expiry", 1)]
    c_blocks = ref.records[s1 - 2]["bytes"]["2"]["device"] // block_bytes
    quota = {0: huge, 1: huge, 2: (c_blocks + 2) * block_bytes}  # C's top-up raises it
    lanes = {}  # request name -> Request, each step's record carries their lane states
    s, reqs = _serve(config, params, sc, prompts, pins, stop, max_new, events, policy, quota,
                     drift_every=1, on_event=on_event, on_step=lambda rec: on_point(
                         {**rec, "requests": {n: lane_state(r) for n, r in lanes.items()}}))
    reqs[TOPUP[0]] = topup2
    lanes.update(reqs)
    cli.stage(f"the run with events (C tops up at step {s1 - 1}, A's quota is cut at step {s1}, "
              f"B's lease ends at step {s2})")
    s.run(progress=cli.progress_on())
    return _summarize(s, reqs, ref_reqs, tok, dict(
        model=config.name, policy=policy, pool_blocks=sc.num_blocks, host_blocks=sc.host_blocks,
        block_bytes=block_bytes, cut_step=s1, lease_step=s2, topup_blocks=need,
        pinned_blocks=pins, cut_byte_quota=cut, a_bytes_at_cut=a_bytes))


def _summarize(s, reqs, ref_reqs, tok, setup) -> dict:
    by_id = {r.id: name for name, r in reqs.items()}
    target = shortfall = pinned = shared = 0
    tiers = dict.fromkeys(("free", "offload", "compress", "evict"), 0)
    fates, agreement, events = [], {}, []
    for ev in s.event_log:
        events.append({k: v for k, v in ev.items() if k != "seq_requests"})
        if "plan" not in ev:
            continue
        plan, report = ev["plan"], ev["report"]
        target += plan["target_bytes"]
        shortfall += report["shortfall_bytes"]
        pinned += plan["pinned_bytes_held"]
        shared += plan["shared_bytes_held"]
        for step in report["steps"]:
            tiers[MEANS_TIER[step["means"]]] += step["quota_bytes"]
        for f in report["fates"]:
            name = by_id.get(ev["seq_requests"].get(str(f["seq"])))
            fates.append({"seq": f["seq"], "tenant": f["tenant"], "fate": f["fate"],
                          "planned_resume_tokens": f["resume_tokens"],
                          "planned_resume_bytes": f["resume_bytes"],
                          "request": name, "event": ev["kind"], "step": ev["step"]})
            if name is not None and f["fate"] != "released":
                key = str(f["seq"]) if str(f["seq"]) not in agreement else f"{f['seq']}#{name}"
                agreement[key] = _agreement(reqs[name].tokens, ref_reqs[name].tokens)
    c1, cut = reqs[TOPUP[0]], setup["cut_step"]
    topup_ok = bool(c1.first_refused == cut - 1 and c1.admitted_step == cut
                    and "pool full" in c1.refusals)  # kvquota.codes REFUSED_POOL_FULL
    answers = [{**r.summary(), "text": tok.decode(r.tokens).strip(),
                **_compared(r, ref_reqs[name].tokens)} for name, r in reqs.items()]
    summary = s.summary()
    return {
        "target_bytes": int(target), "reclaimed_bytes_by_tier": tiers,
        "shortfall_bytes": int(shortfall), "pinned_bytes_held": int(pinned),
        "shared_bytes_held": int(shared), "fates": fates, "preemptions": summary["preemptions"],
        "ledger_drift_bytes_max": max((r.get("drift_bytes", 0) for r in s.records), default=0),
        "topup_ok": topup_ok, "token_agreement": agreement, "setup": setup, "events": events,
        "answers": answers, "scheduler": summary}


def _agreement(got, want) -> float:
    """Fraction of the unreclaimed run's tokens this run reproduced, position by position."""
    return sum(a == b for a, b in zip(got, want)) / len(want) if want else 1.0


def _compared(r, want) -> dict:
    """An answer against the run without events: the agreement of a request that ran to its
    end; for one released (its tenant's lease ended) the step, and how many of the tokens it had
    by then are the reference's (agreement would count the tokens it never got to generate)."""
    if r.finish.startswith("released"):
        return {"agreement": None, "released_step": r.finished_step,
                "tokens_as_reference": sum(a == b for a, b in zip(r.tokens, want))}
    return {"agreement": _agreement(r.tokens, want), "released_step": None}


# ---- printing and plotting (from the summary and the run's files only) -----------------------

def _ledger(title, table) -> list[str]:
    kib = lambda b: f"{b / 1024:,.0f} KiB"  # noqa: E731
    lines = [f"    ledger {title}:  {'tenant':6} {'device':>11} {'host':>11} {'pinned':>10} "
             f"{'shared':>10} {'byte quota':>12}"]
    for t, row in table.items():
        if int(t) in NAMES:
            lines.append(f"    {'':{len(title) + 8}} {NAMES[int(t)]:6} {kib(row['device_bytes']):>11} "
                         f"{kib(row['host_bytes']):>11} {kib(row['pinned_bytes']):>10} "
                         f"{kib(row['shared_bytes']):>10} {kib(row['byte_quota']):>12}")
    return lines


def describe(m: dict) -> str:
    st = m["setup"]
    out = [f"{st['model']} on a paged KV cache: pool 0 of {st['pool_blocks']} blocks of {BLOCK} "
           f"tokens (f32, {st['block_bytes'] // 1024} KiB each), host pool {st['host_blocks']} "
           f"blocks; policy {st['policy']!r}",
           "A and B share a system prompt (A pins its first "
           f"{st['pinned_blocks']} blocks), C is private; C tops up at step {st['cut_step'] - 1}, "
           f"A's quota is cut at step {st['cut_step']}, B's lease ends at step "
           f"{st['lease_step']}"]
    for ev in m["events"]:
        out.append(f"\nstep {ev['step']}: {ev['kind'].replace('_', ' ')} of tenant "
                   f"{NAMES.get(ev['tenant'], ev['tenant'])}")
        if ev["kind"] == "burst":
            c1 = next(a for a in m["answers"] if a["name"] == TOPUP[0])
            out.append(f"    C's top-up ({st['topup_blocks']} blocks): refused at step "
                       f"{c1['first_refused']} ({', '.join(c1['refusals']) or 'never'}), "
                       f"admitted at step {c1['admitted_step']}: top-up "
                       f"{'OK' if m['topup_ok'] else 'NOT as designed'}")
            continue
        out += _ledger("before", ev["ledger_before"])
        out += ["    " + line for line in ev["plan_text"].splitlines()]
        out.append(f"    held back: pins {ev['plan']['pinned_bytes_held']:,} B, other tenants "
                   f"{ev['plan']['shared_bytes_held']:,} B")
        out += _ledger("after ", ev["ledger_after"])
    out.append("\nanswers (agreement = tokens equal to the run without events; resume costs "
               "as paid, and as planned: a plan assumes the prefix cache still holds the "
               "blocks it counted when the request comes back):")
    for a in m["answers"]:
        if a.get("released_step") is not None:
            why = a["finish"].partition(": ")[2].replace("_", " ")
            outcome = (f"released at step {a['released_step']} ({why}) after "
                       f"{len(a['tokens'])} tokens ({a['tokens_as_reference']} as in the run "
                       "without events)")
        else:
            outcome = f"{a['finish']}, {len(a['tokens'])} tokens, agreement {a['agreement']:.2f}"
        out.append(f"  [{a['name']}] {outcome}; preempted {a['preemptions']}x, suspended "
                   f"{a['suspensions']}x, recomputed {a['paid_resume_tokens']} tokens "
                   f"(planned {a['planned_resume_tokens']}), restored "
                   f"{a['paid_resume_bytes']:,} B (planned {a['planned_resume_bytes']:,} B)"
                   f"\n      -> {a['text']}")
    s = m["scheduler"]
    out.append(f"\n{s['steps']} steps, {s['generated_tokens']} tokens, {m['preemptions']} "
               f"preemptions; reclaimed {m['reclaimed_bytes_by_tier']} of a "
               f"{m['target_bytes']:,} B target (shortfall {m['shortfall_bytes']:,} B); ledger "
               f"drift max {m['ledger_drift_bytes_max']} B; host syncs per decode step "
               f"{s['syncs_per_decode_step']}")
    return "\n".join(out)


LANES = {  # a request's state after a step -> (colour, legend label)
    "queued": ("#cccccc", "queued (waiting for room)"),
    "prefill": ("#9ecae1", "prefill"),
    "running": ("#3182bd", "decoding"),
    "lossy": ("#fd8d3c", "decoding, cache compressed / evicted"),
    "suspended": ("#9e9ac8", "suspended (its KV on host)"),
    "preempted": ("#de2d26", "preempted (queued to recompute)"),
}
ACTIONS = {  # reclaim action -> (marker, colour); one row each in the timeline
    "offload": ("v", "#756bb1"), "restore": ("^", "#31a354"), "preempt": ("X", "#de2d26"),
    "free": ("o", "#636363"), "compress": ("s", "#fd8d3c"), "evict": ("D", "#a63603"),
}
MIB = 2**20


def _event_label(ev: dict) -> str:
    who = NAMES.get(ev["tenant"], ev["tenant"])
    if ev["kind"] == "quota_cut":
        quota = ev["ledger_after"][str(ev["tenant"])]["byte_quota"]
        return f"{ev['step']}: {who}'s byte quota cut to {quota / MIB:.1f} MiB"
    if ev["kind"] == "lease_expiry":
        return f"{ev['step']}: {who}'s lease ends"
    if ev["kind"] == "burst":
        return f"{ev['step']}: {who} tops up (a request, a higher quota)"
    return f"{ev['step']}: {ev['kind'].replace('_', ' ')} of tenant {who}"


def place_labels(ax, items, fontsize: float = 8) -> list:
    """Writes each (x, text) of `items` in `ax` (x in data units) in the lowest row where it
    overlaps no label already written, left-aligned at x, or right-aligned where it would run
    past the right edge; sets the rows as the axes' y range. Returns the Text artists."""
    renderer = ax.figure.canvas.get_renderer()
    x0, x1 = ax.get_xlim()
    rows, texts = [], []  # rows: per row, the (left, right) display spans taken
    for x, label in sorted(items, key=lambda item: item[0]):
        text = ax.text(x, 0, label, fontsize=fontsize, va="center", ha="left", clip_on=False)
        box = text.get_window_extent(renderer)
        if box.x1 > ax.transData.transform((x1, 0))[0]:
            text.set_horizontalalignment("right")
            box = text.get_window_extent(renderer)
        span = (box.x0 - 4, box.x1 + 4)
        row = next((i for i, taken in enumerate(rows)
                    if all(span[1] <= a or b <= span[0] for a, b in taken)), len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append(span)
        text.set_y(row)
        texts.append(text)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first row on top
    ax.set_xlim(x0, x1)
    return texts


def _step_actions(points, metrics) -> dict:
    """{action: {step: bytes}}: what reclaim moved in each step. offload / free / compress /
    evict from the events' reports (their bytes by means), restore from the bytes each step
    restored, preempt from each step's preemptions (the bytes freed by them count in free); a
    step holding several actions (an offload and a restore of one swap) has them all."""
    out = {name: {} for name in ACTIONS}
    tier_action = {"free": "free", "offload": "offload", "compress": "compress",
                   "evict": "evict"}
    for ev in metrics["events"]:
        for st in ev.get("report", {}).get("steps", []):
            action = tier_action[MEANS_TIER[st["means"]]]
            moved = st["host_bytes"] if action == "offload" else st["pool_bytes"]
            out[action][ev["step"]] = out[action].get(ev["step"], 0) + moved
    for p in points:
        if p["paid_resume_bytes"]:
            out["restore"][p["step"]] = p["paid_resume_bytes"]
        if p["preemptions"]:
            out["preempt"][p["step"]] = p["preemptions"]
        if p["suspensions"] and p["step"] not in out["offload"]:
            out["offload"][p["step"]] = 0  # suspended outside an event: bytes not reported
    return out


def plot(points, metrics, out_dir) -> list[str]:
    """timeline.png, from the run's points and summary only. Top to bottom: the events (labels
    that never overlap); the reclaim actions of each step (offload, restore, preempt, free,
    compress, evict: one row each, so several actions in one step all show); device bytes per
    tenant, stacked, with pool 0's capacity and each tenant's byte quota (it caps device bytes;
    a quota above the plot is not drawn); host bytes per tenant with the host pool's capacity;
    one lane per request, coloured by what it does after each step, with its end marked."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    st = metrics["setup"]
    steps = [p["step"] for p in points]
    xlim = (min(steps) - 1, max(steps) + 1)
    actions = {k: v for k, v in _step_actions(points, metrics).items()
               if v or k in ("offload", "restore", "preempt", "free")}
    names = sorted({n for p in points for n in p.get("requests", {})})
    fig = plt.figure(figsize=(11, 11.5))
    heights = [1.0, 0.3 * len(actions), 1.8, 1.8, 1.1, 0.35 * max(len(names), 1)]
    grid = fig.add_gridspec(6, 1, height_ratios=heights, left=0.12, right=0.75, top=0.95,
                            bottom=0.05, hspace=0.12)
    ax_ev, ax_act, ax_dev, ax_quota, ax_host, ax_lane = [fig.add_subplot(grid[i])
                                                         for i in range(6)]
    panels = (ax_act, ax_dev, ax_quota, ax_host, ax_lane)
    for ax in panels:
        ax.sharex(ax_ev)
    ax_ev.set_xlim(*xlim)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    # the events, their steps marked through every panel
    ax_ev.axis("off")
    labels = place_labels(ax_ev, [(ev["step"], _event_label(ev)) for ev in metrics["events"]])
    heights[0] = 0.22 * (1 + max((t.get_position()[1] for t in labels), default=0))
    grid.set_height_ratios(heights)  # a row per line of labels
    for ev in metrics["events"]:
        for ax in panels:
            ax.axvline(ev["step"], color="k", lw=0.7, ls=":", zorder=0)

    # reclaim actions per step
    for row, (name, by_step) in enumerate(actions.items()):
        marker, colour = ACTIONS[name]
        ax_act.scatter(list(by_step), [row] * len(by_step), marker=marker, color=colour, s=40)
    ax_act.set_yticks(range(len(actions)), [
        f"{name} ({sum(v.values())} req.)" if name == "preempt"
        else f"{name} ({sum(v.values()) / MIB:.1f} MiB)" for name, v in actions.items()],
        fontsize=8)
    ax_act.set_ylim(len(actions) - 0.5, -0.5)
    ax_act.set_title("reclaim actions per step (one row each: actions in one step all show)",
                     fontsize=8, loc="left")

    # the pools: bytes per tenant, stacked, against each pool's capacity
    for ax, tiers, capacity, label, cap_label in (
            (ax_dev, ("device", "compressed"), st["pool_blocks"] * st["block_bytes"],
             "device MiB\n(stacked)", "pool 0 capacity"),
            (ax_host, ("host",), st["host_blocks"] * st["block_bytes"], "host MiB\n(stacked)",
             "host pool capacity")):
        ys = [_tenant_mib(points, t, tiers) for t in NAMES]
        ax.stackplot(steps, ys, step="post", colors=colours[:len(NAMES)],
                     labels=[f"tenant {n}" for n in NAMES.values()])
        ax.axhline(capacity / MIB, color="k", lw=1.2, label=cap_label)
        ax.set_ylim(0, 1.12 * max(capacity / MIB, max(map(sum, zip(*ys)), default=0)))
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))

    # each tenant's device bytes against its own byte quota (a quota off the scale: not drawn)
    quotas, top = _quota_steps(metrics, steps), 0.0
    for t, n in NAMES.items():
        mine = _tenant_mib(points, t, ("device", "compressed"))
        ax_quota.step(steps, mine, where="post", color=colours[t], lw=1.6, label=f"tenant {n}")
        top = max(top, max(mine, default=0))
    top *= 1.25
    for t, n in NAMES.items():
        if min(quotas[t]) / MIB < top:
            ax_quota.step(steps, [q / MIB for q in quotas[t]], where="post", ls="--", lw=1.2,
                          color=colours[t], label=f"{n}'s byte quota")
    ax_quota.set_ylim(0, top)
    ax_quota.set_ylabel("device MiB\nper tenant")
    ax_quota.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))

    # one lane per request
    for y, name in enumerate(names):
        states = [p.get("requests", {}).get(name, "pending") for p in points]
        start = 0
        for i in range(1, len(states) + 1):
            if i == len(states) or states[i] != states[start]:
                if states[start] in LANES:
                    ax_lane.broken_barh([(steps[start], steps[i - 1] + 1 - steps[start])],
                                        (y - 0.35, 0.7), color=LANES[states[start]][0])
                start = i
        end = next((i for i, state in enumerate(states) if state in
                    ("finished", "released", "refused")), None)
        if end is not None and states[end] == "released":
            ax_lane.plot(steps[end], y, "kX", ms=7)
            ax_lane.text(steps[end] + 1.5, y, f"released at step {steps[end]}", fontsize=7,
                         va="center")
        elif end is not None:
            ax_lane.plot(steps[end], y, "k|", ms=9, mew=2)
    fated = {"suspended": "suspended", "preempted": "preempted", "compressed": "lossy",
             "evicted": "lossy"}  # a fate shows even when the same step undoes it (a restore)
    for f in metrics["fates"]:
        if f["request"] in names and f["fate"] in fated:
            ax_lane.plot(f["step"], names.index(f["request"]), "D", ms=6, mec="k", mew=0.8,
                         color=LANES[fated[f["fate"]]][0])
    ax_lane.set_yticks(range(len(names)), names, fontsize=8)
    ax_lane.set_ylim(max(len(names), 1) - 0.5, -0.5)
    ax_lane.set_xlabel("step")
    ax_lane.legend(handles=[Patch(color=c, label=label) for c, label in LANES.values()] + [
        Line2D([], [], color="k", marker="|", ls="", ms=9, mew=2, label="finished"),
        Line2D([], [], color="k", marker="X", ls="", ms=7, label="released (lease)"),
        Line2D([], [], color="w", marker="D", mec="k", ls="", ms=6,
               label="a reclaim's fate (its colour)")],
        fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in (ax_ev, *panels[:-1]):
        ax.tick_params(labelbottom=False)
    fig.suptitle(f"{st['model']}, policy {st['policy']}: pool 0 of {st['pool_blocks']} blocks "
                 f"({st['block_bytes'] // 1024} KiB each), host pool of {st['host_blocks']} blocks",
                 fontsize=10)
    fig.savefig(pathlib.Path(out_dir) / "timeline.png", dpi=110)
    plt.close(fig)
    return ["timeline.png"]


def _tenant_mib(points, tenant: int, tiers) -> list[float]:
    """Tenant's MiB in `tiers` after each step."""
    return [sum(p["bytes"].get(str(tenant), {}).get(k, 0) for k in tiers) / MIB for p in points]


def _quota_steps(metrics, steps) -> dict:
    """{tenant: [byte quota after each step]}, from the ledgers before and after each event."""
    events = sorted(metrics["events"], key=lambda ev: ev["step"])
    quotas = {}
    for t in NAMES:
        before = events[0]["ledger_before"][str(t)]["byte_quota"] if events else 0
        quotas[t] = [next((ev["ledger_after"][str(t)]["byte_quota"] for ev in reversed(events)
                           if ev["step"] <= step), before) for step in steps]
    return quotas


def main(argv):
    del argv
    cli.check_model_source(FLAGS.model, FLAGS.weights)
    config = {"model": FLAGS.model, "weights": FLAGS.weights, "policy": FLAGS.policy,
              "max_new_tokens": FLAGS.max_new_tokens}
    run = runs.open_run("reclaim_demo", "experiments.reclaim_demo", config, seed=None,
                        root=FLAGS.runs_dir, overwrite=FLAGS.overwrite)
    if run.complete:
        runs.replay_note(run)
        summary = run.stored_summary()
    else:
        events = kq.serving.JsonLines(run.path / "events.jsonl")
        summary = run.finish(measure(FLAGS.model, FLAGS.weights, FLAGS.policy,
                                     FLAGS.max_new_tokens, run.add_point, events), plot)
    if FLAGS.out:
        pathlib.Path(FLAGS.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(FLAGS.out).write_text(json.dumps(summary, indent=2) + "\n")
    if FLAGS.json:
        print(json.dumps(summary), flush=True)
    else:
        print(describe(summary))
        print(f"\nrun directory: {run.path}", file=sys.stdout)


if __name__ == "__main__":
    cli.run(main, define_flags)
