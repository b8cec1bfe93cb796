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


def measure(model: str, weights, policy: str, max_new: int, on_point, on_event) -> dict:
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
    ref, ref_reqs = _serve(config, params, big, prompts, pins, stop, max_new, [], policy,
                           {t: huge for t in NAMES})
    while any(r.status in ("pending", "queued", "prefill") for r in ref_reqs.values()):
        ref.step()  # every first request prefilled: the cut comes 3 steps later
    s1 = ref.t + 3
    topup.arrival = s1 - 1
    ref.submit(topup)
    ref.run()
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
    s, reqs = _serve(config, params, sc, prompts, pins, stop, max_new, events, policy, quota,
                     drift_every=1, on_step=on_point, on_event=on_event)
    s.run(progress=True)
    reqs[TOPUP[0]] = topup2
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
                "agreement": _agreement(r.tokens, ref_reqs[name].tokens)}
               for name, r in reqs.items()]
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
        out.append(f"  [{a['name']}] {a['finish']}, {len(a['tokens'])} tokens, agreement "
                   f"{a['agreement']:.2f}; preempted {a['preemptions']}x, suspended "
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


def plot(points, metrics, out_dir) -> list[str]:
    """timeline.png: device and host bytes per tenant over the steps, stacked, events marked."""
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in points]
    fig, axes = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for ax, tiers, label in ((axes[0], ("device", "compressed"), "device MiB"),
                             (axes[1], ("host",), "host MiB")):
        ys = [[sum(p["bytes"].get(str(t), {}).get(k, 0) for k in tiers) / 2**20 for p in points]
              for t in NAMES]
        ax.stackplot(steps, ys, labels=[f"tenant {n}" for n in NAMES.values()])
        ax.set_ylabel(label)
        for p in points:
            for kind in p["events"]:
                ax.axvline(p["step"], color="k", lw=0.8, ls="--")
                if ax is axes[0]:
                    ax.text(p["step"], ax.get_ylim()[1] * 0.95, kind.replace("_", " "),
                            rotation=90, va="top", fontsize=7)
    axes[0].legend(fontsize=7, loc="upper right")
    axes[1].set_xlabel("step")
    axes[0].set_title(f"{metrics['setup']['model']}, policy {metrics['setup']['policy']}")
    fig.tight_layout()
    fig.savefig(pathlib.Path(out_dir) / "timeline.png", dpi=110)
    plt.close(fig)
    return ["timeline.png"]


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
