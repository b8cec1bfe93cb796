"""Benchmark: release one tenant of a metadata-only Qwen2.5-72B-scale state.

    python -m experiments.bench_reclaim --json [--out=results/bench_reclaim.json]
    python -m experiments.bench_reclaim --log2_blocks=16 --scaling=14,16 --repeats=4  # quick

Builds (vectorised, `kq.build_state`) a metadata-only state: 2^20 blocks of 16 tokens,
8,192 sequences over 64 tenants, each tenant's sequences sharing a system-prompt prefix and 16
tenants in 4 sharing groups. Releases one private tenant (~1/64 of the pool) through the public
`Allocator.release_tenant(..., donate=True)`, and the same release with a straightforward
per-block Python loop (the way a Python block pool frees: walk the tenant's tables, decrement,
push to a free list) on the same data; checks that both end in the same state; reports their
times and ratio, the time for a tenant whose shared prefix passes to an heir, and the jitted time
at 2^16, 2^18 and 2^20 blocks; and reclaim in one action (plan_reclaim + apply_plan: a quota
cut of one tenant to half its bytes under tiered, swap-all and preempt-all, and a lease expiry),
each against a plain donated release of the same tenant from the same state
(`plan_apply_over_release` is the tiered cut's ratio). The state has a host pool of 1/8 of pool
0 for swap-all. Writes a run directory (experiments/runs.py): one point per release, per reclaim
action and per scaling size, the summary, and two plots.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

import kvquota as kq
from experiments import cli, runs

FLAGS = flags.FLAGS
MIN_LOG2, MAX_LOG2 = 13, 24  # 2^13 blocks: one sequence per tenant; 2^24: 16M blocks


def define_flags():
    flags.DEFINE_integer("log2_blocks", 20, "Pool size of the headline point, as a power of two.",
                         lower_bound=MIN_LOG2, upper_bound=MAX_LOG2)
    cli.define_int_list("scaling", [16, 18, 20], "log2 pool sizes of the scaling sweep",
                        lower=MIN_LOG2, upper=MAX_LOG2)
    flags.DEFINE_integer("repeats", 24, "Private tenants released in turn (median reported).",
                         lower_bound=1, upper_bound=47)  # tenants 62 .. 16 are private
    flags.DEFINE_integer("seed", 0, "Seed of the synthetic state.", lower_bound=0)
    runs.define_flags()


MODEL = "qwen2.5-72b"
BLOCK_SIZE = 16
TENANTS = 64
BLOCKS_PER_SEQ = 128  # 2^20 blocks / 8,192 sequences
PRIVATE_TENANT = TENANTS - 1  # outside every sharing group
HOST_FRACTION = 8  # a host pool of 1/8 of pool 0's blocks: room for swap-all's offloads
SHARED_TENANT = 0  # creator (payer) of group 0's prefix


def setup(log2_blocks: int, seed: int):
    blocks = 1 << log2_blocks
    config = kq.StateConfig(
        kq.get_model_config(MODEL), num_blocks=blocks, block_size=BLOCK_SIZE,
        max_seqs=blocks // BLOCKS_PER_SEQ, max_blocks_per_seq=2 * BLOCKS_PER_SEQ,
        num_tenants=TENANTS, kv_format="bf16", with_pages=False,
        host_blocks=blocks // HOST_FRACTION,
    )
    spec = kq.SyntheticSpec(num_seqs=config.max_seqs, prefix_blocks=4, group_size=4, num_groups=4,
                         pool_fill=0.9, seed=seed)
    return config, kq.build_state(config, spec)


def _copy(state):
    return jax.tree_util.tree_map(jnp.copy, state)


def jitted_chain(config, state, tenants, warmup_tenant):
    """Release `tenants` one after another through the public `Allocator.release_tenant(...,
    donate=True)`, each on the state the previous release returned (the steady state of a serving
    loop: buffers produced by earlier donated ops). Returns per-tenant seconds (the facade's
    host-side checks and planning included), the final state and the reports. One untimed
    release of `warmup_tenant` compiles and primes the buffers."""
    alloc = kq.Allocator(config)
    x = _copy(state)
    seconds, reports = [], []
    for i, t in enumerate([warmup_tenant] + list(tenants)):
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        x, rep = alloc.release_tenant(x, t, donate=True)
        jax.block_until_ready((x, rep))
        if i:
            seconds.append(time.perf_counter() - t0)
            reports.append(rep)
    return seconds, x, reports


class PythonPool:
    """A straightforward Python block pool over the same data (lists, a hash dict, a free list):
    release walks the tenant's tables entry by entry, decrements, and pushes to the free list."""

    def __init__(self, config, host):
        self.p = config.block_size
        self.ref = host.blocks.ref_count.tolist()
        self.payer_refs = host.blocks.payer_refs.tolist()
        self.payer = host.blocks.payer.tolist()
        self.pin = host.blocks.pin_count.tolist()
        self.fill = host.blocks.fill.tolist()
        self.generation = host.blocks.generation.tolist()
        self.charged = host.tenants.charged_blocks[:, 0].tolist()
        self.used = host.tenants.used_tokens.tolist()
        self.seq_tenant = host.seqs.seq_tenant.tolist()
        self.seq_lens = host.seqs.seq_lens.tolist()
        self.salt = host.tenants.salt.tolist()
        self.tables = host.seqs.block_tables.tolist()
        self.free_list = host.free.free_list[: int(host.free.free_count[0])].tolist()
        ids = np.flatnonzero(host.blocks.hashed)
        h = host.blocks.block_hash[ids]
        self.block_key = dict(zip(ids.tolist(), zip(h[:, 0].tolist(), h[:, 1].tolist())))
        self.cache = {k: b for b, k in self.block_key.items()}
        self.seqs_of = {}
        for s, t in enumerate(self.seq_tenant):
            if t >= 0:
                self.seqs_of.setdefault(t, []).append(s)

    def release(self, tenant):
        p, ref, payer, payer_refs = self.p, self.ref, self.payer, self.payer_refs
        orphans = []
        for s in self.seqs_of.pop(tenant, []):
            row = self.tables[s]
            for k in range((self.seq_lens[s] + p - 1) // p):
                b = row[k]
                ref[b] -= 1
                if payer[b] == tenant:
                    payer_refs[b] -= 1
                if ref[b] == 0 and self.pin[b] == 0:
                    self.free_list.append(b)
                    self.charged[payer[b]] -= 1
                    payer[b], payer_refs[b], self.fill[b] = -1, 0, 0
                    self.generation[b] += 1
                    key = self.block_key.pop(b, None)
                    if key is not None and self.cache.get(key) == b:
                        del self.cache[key]
                elif self.pin[b] == 0 and payer_refs[b] == 0 and payer[b] == tenant:
                    orphans.append(b)
                row[k] = -1
            self.used[tenant] -= self.seq_lens[s]
            self.seq_lens[s], self.seq_tenant[s] = 0, -1
        if orphans:  # pass charges on: lowest-id remaining referencer among same-salt tenants
            want = set(orphans)
            heir, heir_refs = {}, {}
            for owner, seqs in self.seqs_of.items():
                if self.salt[owner] != self.salt[tenant]:
                    continue
                for s in seqs:
                    for b in self.tables[s][: (self.seq_lens[s] + p - 1) // p]:
                        if b in want:
                            if b not in heir or owner < heir[b]:
                                heir[b], heir_refs[b] = owner, 0
                            if owner == heir[b]:
                                heir_refs[b] += 1
            for b in orphans:
                self.charged[tenant] -= 1
                self.charged[heir[b]] += 1
                payer[b], payer_refs[b] = heir[b], heir_refs[b]


def loop_chain(config, host, tenants, warmup_tenant):
    pool = PythonPool(config, host)
    pool.release(warmup_tenant)
    seconds = []
    for t in tenants:
        t0 = time.perf_counter()
        pool.release(t)
        seconds.append(time.perf_counter() - t0)
    return seconds, dict(ref=pool.ref, payer=pool.payer, payer_refs=pool.payer_refs,
                         free=sorted(pool.free_list), charged=pool.charged, used=pool.used)


# The reclaim actions timed against a plain release of the same tenant: (policy, request kind).
ACTIONS = {
    "tiered_quota_cut": ("tiered", "quota_cut"),
    "swap_all_quota_cut": ("swap-all", "quota_cut"),
    "preempt_all_quota_cut": ("preempt-all", "quota_cut"),
    "lease_expiry": ("tiered", "lease_expiry"),
}


def _figures(steps):
    return [(st.means, st.seqs, st.quota_bytes, st.pool_bytes, st.host_bytes) for st in steps]


def reclaim_vs_release(config, state, tenants, policy, kind):
    """Reclaim in one action through the public API against a plain release, tenant by tenant:
    on its own copy of `state`, `plan_reclaim` (a quota cut to half the tenant's device bytes,
    or its lease expiry) then `apply_plan(..., donate=True)`; on another copy, a donated
    `release_tenant` of the same tenant. The first tenant is an untimed warm-up of both.
    Returns seconds per timed tenant {"plan", "apply", "release"}, the plans, and whether every
    apply measured exactly what its plan said."""
    alloc = kq.Allocator(config)
    seconds, plans, exact = {"plan": [], "apply": [], "release": []}, [], True
    for i, t in enumerate(tenants):
        x = _copy(state)
        request = (kq.ReclaimRequest.quota_cut(t, int(alloc.ledger(x).device_bytes[t]) // 2)
                   if kind == "quota_cut" else kq.ReclaimRequest.lease_expiry(t))
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        plan = alloc.plan_reclaim(x, request, policy)
        t1 = time.perf_counter()
        x, report = alloc.apply_plan(x, plan, donate=True)
        jax.block_until_ready(x)
        t2 = time.perf_counter()
        exact &= _figures(report.steps) == _figures(plan.steps)
        del x
        y = _copy(state)
        jax.block_until_ready(y)
        t3 = time.perf_counter()
        y, _ = alloc.release_tenant(y, t, donate=True)
        jax.block_until_ready(y)
        t4 = time.perf_counter()
        del y
        if i:
            seconds["plan"].append(t1 - t0)
            seconds["apply"].append(t2 - t1)
            seconds["release"].append(t4 - t3)
            plans.append(plan)
    return seconds, plans, exact


TOP_UP_BLOCKS = 64  # a top-up prompt of 64 full blocks (1,024 tokens)
FILL_ROWS = 64  # filler prompts admitted per call while pool 0 is filled


class TooFewSlots(RuntimeError):
    """The state has too few free sequence slots to fill pool 0 (small pools: one sequence per
    tenant at 2^13 blocks); the top-up latency is then not measured, and the summary says so."""


def _admit_rows(alloc, state, tenant, blocks, rng):
    """Admit one prompt of `blocks[i]` full blocks of fresh random tokens per row (no prefix
    hits) for `tenant`, donated; returns (state, report)."""
    width = alloc.config.max_tokens_per_seq
    lengths = np.asarray(blocks, np.int32) * BLOCK_SIZE
    tokens = rng.integers(0, alloc.config.model.vocab_size, (len(blocks), width)).astype(np.int32)
    tenants = np.full(len(blocks), tenant, np.int32)
    return alloc.admit(state, tenants, tokens, lengths, donate=True)


def fill_pool0(alloc, state, tenant, leave, rng):
    """Admit filler prompts for `tenant` until fewer than `leave` pool-0 blocks are allocatable
    (the load a top-up meets when the pool is full)."""
    mb = alloc.config.max_blocks_per_seq
    while (free := int(alloc.allocatable_blocks(state)[0])) >= leave:
        want = free - leave + 1  # blocks still to take
        blocks = [min(mb, want - i * mb) for i in range(min(FILL_ROWS, -(-want // mb)))]
        state, rep = _admit_rows(alloc, state, tenant, blocks, rng)
        if not np.asarray(rep.admitted).any():
            raise TooFewSlots(f"filling pool 0 ran out of sequence slots ({free} blocks free, "
                              f"{rep.reasons()[0]})")
    return state


def top_up_latency(config, state, tenants, filler):
    """Refused -> reclaim -> admitted: for each tenant in turn, pool 0 filled (by `filler`,
    untimed), a top-up of TOP_UP_BLOCKS blocks refused (pool full), a tiered make-room plan made
    and applied (donated), and the same top-up admitted. The first tenant is an untimed
    warm-up. Returns seconds per timed tenant of each phase and the plans."""
    alloc = kq.Allocator(config)
    rng = np.random.default_rng(0)
    x = _copy(state)
    seconds = {"refused": [], "plan": [], "apply": [], "admitted": []}
    plans = []
    for i, t in enumerate(tenants):
        x = fill_pool0(alloc, x, filler, TOP_UP_BLOCKS, rng)  # a reclaim frees whole sequences
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        x, rep = _admit_rows(alloc, x, t, [TOP_UP_BLOCKS], rng)
        if rep.reasons()[0] == "no sequence slot":
            raise TooFewSlots("no sequence slot left for the top-up")
        if rep.reasons()[0] != "pool full":
            raise RuntimeError(f"bench_reclaim: the top-up was not refused by the pool "
                               f"({rep.reasons()[0]})")
        t1 = time.perf_counter()
        need = TOP_UP_BLOCKS * config.pool_bytes[0]
        plan = alloc.plan_reclaim(x, kq.ReclaimRequest.make_room(t, need), "tiered")
        t2 = time.perf_counter()
        x, _ = alloc.apply_plan(x, plan, donate=True)
        jax.block_until_ready(x)
        t3 = time.perf_counter()
        x, rep = _admit_rows(alloc, x, t, [TOP_UP_BLOCKS], rng)
        jax.block_until_ready(x)
        t4 = time.perf_counter()
        if rep.reasons()[0] == "no sequence slot":  # suspended sequences keep their slots
            raise TooFewSlots("no sequence slot left for the top-up after the reclaim")
        if not bool(rep.admitted[0]):
            raise RuntimeError(f"bench_reclaim: the top-up was refused after the reclaim "
                               f"({rep.reasons()[0]})")
        if i:
            for name, a, b in (("refused", t0, t1), ("plan", t1, t2), ("apply", t2, t3),
                               ("admitted", t3, t4)):
                seconds[name].append(b - a)
            plans.append(plan)
    return seconds, plans


def _top_up_summary(result, config, secs, plans, tenants, on_point):
    """result["top_up"] and one point per timed top-up."""
    total = [sum(parts) for parts in zip(*secs.values())]
    for t, parts, pl in zip(tenants, zip(*secs.values()), plans):
        on_point({"kind": "top_up", "blocks": config.num_blocks, "tenant": t,
                  **{f"{k}_seconds": v for k, v in zip(secs, parts)}, "seconds": sum(parts),
                  "steps": [st.means for st in pl.steps],
                  "sequences": sum(len(st.seqs) for st in pl.steps)})
    result["top_up"] = {
        "policy": "tiered", "request": "make_room", "prompt_blocks": TOP_UP_BLOCKS,
        "tenants": tenants, "seconds": statistics.median(total),
        **{f"{k}_seconds": statistics.median(v) for k, v in secs.items()},
        "steps": sorted({st.means for pl in plans for st in pl.steps}),
        "timing": "a top-up refused on a full pool 0, a tiered make-room plan + apply (donated), "
                  "the same top-up admitted; median over tenants after one untimed warm-up",
    }


def same_result(jitted_state, loop):
    s = jax.device_get(jitted_state)
    free = np.sort(s.free.free_list[: int(s.free.free_count[0])]).tolist()
    return (
        s.blocks.ref_count.tolist() == loop["ref"]
        and s.blocks.payer.tolist() == loop["payer"]
        and s.blocks.payer_refs.tolist() == loop["payer_refs"]
        and free == loop["free"]
        and s.tenants.charged_blocks[:, 0].tolist() == loop["charged"]
        and s.tenants.used_tokens.tolist() == loop["used"]
    )


def run(log2_blocks, scaling, repeats, seed, on_point=lambda point: None) -> dict:
    """The whole benchmark; `on_point(dict)` receives each measured point as it is measured."""
    config, state = setup(log2_blocks, seed)
    host = jax.device_get(state)
    logging.info("built %d blocks, %d sequences", config.num_blocks, config.max_seqs)
    # Private tenants (no sharing group) released in turn; then the 4 group-prefix creators,
    # whose shared prefix blocks pass to an heir.
    private = list(range(PRIVATE_TENANT - 1, PRIVATE_TENANT - 1 - repeats, -1))
    creators = [0, 4, 8, 12]
    tenants = private + creators
    jit_s, final, reports = jitted_chain(config, state, tenants, PRIVATE_TENANT)
    loop_s, loop = loop_chain(config, host, tenants, PRIVATE_TENANT)
    match = same_result(final, loop)
    n = len(private)
    med = statistics.median
    first = reports[0]
    returned = [int(np.asarray(r.blocks_returned).sum()) for r in reports]
    for i, tenant in enumerate(tenants):
        on_point({"kind": "release", "blocks": config.num_blocks, "tenant": tenant,
                  "shared_prefix": i >= n, "seconds": jit_s[i], "loop_seconds": loop_s[i],
                  "blocks_returned": returned[i],
                  "transferred_blocks": int(reports[i].transferred_blocks)})
    returned = returned[:n]
    result = {
        "blocks": config.num_blocks,
        "seconds": med(jit_s[:n]),
        "loop_seconds": med(loop_s[:n]),
        "speedup": med(loop_s[:n]) / med(jit_s[:n]),
        "results_match": bool(match),
        "seconds_all": jit_s[:n],
        "loop_seconds_all": loop_s[:n],
        "released": {
            "tenants": private,
            "sequences_per_tenant": config.max_seqs // TENANTS,
            "median_blocks_returned": med(returned),
            "median_fraction_of_pool": med(returned) / config.num_blocks,
            "first_pool_bytes_returned": first.pool_bytes_returned,
            "first_quota_bytes_released": first.quota_bytes_released,
        },
        "shared_prefix_release": {
            "tenants": creators,
            "seconds": med(jit_s[n:]),
            "loop_seconds": med(loop_s[n:]),
            "speedup": med(loop_s[n:]) / med(jit_s[n:]),
            "transferred_blocks": [int(r.transferred_blocks) for r in reports[n:]],
            "pool_bytes_returned": [r.pool_bytes_returned for r in reports[n:]],
            "quota_bytes_released": [r.quota_bytes_released for r in reports[n:]],
        },
        "scaling": [],
        "timing": "median over releases of different tenants, each on the state returned by the "
                  "previous donated release (steady state); one untimed warm-up release; the "
                  "Python loop runs the same releases in the same order on Python lists",
        "setup": {
            "model": MODEL, "block_size": BLOCK_SIZE, "bytes_per_block": config.pool_bytes[0],
            "sequences": config.max_seqs, "tenants": TENANTS, "max_blocks_per_seq":
            config.max_blocks_per_seq, "prefix_blocks": 4, "sharing_groups": "4 x 4 tenants",
            "pool_fill": 0.9, "metadata_only": True, "seed": seed,
        },
    }
    action_tenants = list(range(PRIVATE_TENANT - 1 - repeats, PRIVATE_TENANT - 1 - repeats - 9, -1))
    result["reclaim_actions"] = {}
    for name, (policy, kind) in ACTIONS.items():
        secs, plans, exact = reclaim_vs_release(config, final, action_tenants, policy, kind)
        total = [a + b for a, b in zip(secs["plan"], secs["apply"])]
        for t, ps, ap, rs, pl in zip(action_tenants[1:], secs["plan"], secs["apply"],
                                     secs["release"], plans):
            on_point({"kind": "reclaim_action", "action": name, "blocks": config.num_blocks,
                      "tenant": t, "plan_seconds": ps, "apply_seconds": ap, "seconds": ps + ap,
                      "release_seconds": rs, "target_bytes": pl.target_bytes,
                      "planned_bytes": pl.planned_bytes, "steps": [st.means for st in pl.steps],
                      "sequences": sum(len(st.seqs) for st in pl.steps)})
        result["reclaim_actions"][name] = {
            "policy": policy, "request": kind, "tenants": action_tenants[1:],
            "plan_seconds": med(secs["plan"]), "apply_seconds": med(secs["apply"]),
            "seconds": med(total), "release_seconds": med(secs["release"]),
            "over_release": med(total) / med(secs["release"]),
            "plan_equals_apply": bool(exact),
            "steps": sorted({st.means for pl in plans for st in pl.steps}),
            "median_target_bytes": med([pl.target_bytes for pl in plans]),
            "median_shortfall_bytes": med([pl.shortfall_bytes for pl in plans]),
        }
    # The figure: plan + apply of a tiered cut to half over a release of the same tenant.
    result["plan_apply_over_release"] = result["reclaim_actions"]["tiered_quota_cut"]["over_release"]
    # Top-ups on a full pool, by released tenants (their slots are free), the filler the first.
    released = tenants[:5]
    try:
        secs, plans = top_up_latency(config, final, released[1:], released[0])
    except TooFewSlots as err:
        result["top_up"] = {"skipped": str(err)}
    else:
        _top_up_summary(result, config, secs, plans, released[2:], on_point)
    del state, final
    for lg in scaling:
        if lg == log2_blocks:
            point = {"blocks": config.num_blocks, "sequences": config.max_seqs,
                     "seconds": result["seconds"]}
        else:
            c2, s2 = setup(lg, seed)
            t2, _, _ = jitted_chain(c2, s2, private, PRIVATE_TENANT)
            point = {"blocks": c2.num_blocks, "sequences": c2.max_seqs, "seconds": med(t2)}
            del s2
            logging.info("scaling 2^%d: %.3f ms", lg, med(t2) * 1e3)
        result["scaling"].append(point)
        on_point({"kind": "scaling", **point})
    result["scaling"].sort(key=lambda r: r["blocks"])
    return result


def plot(points, metrics, out_dir) -> list[str]:
    """release_times.png (each release, jitted vs loop) and scaling.png (jitted time vs pool
    size), from the run's files."""
    import matplotlib.pyplot as plt

    names = []
    releases = [p for p in points if p["kind"] == "release"]
    if releases:
        fig, ax = plt.subplots(figsize=(7, 4))
        x = np.arange(len(releases))
        ax.semilogy(x, [1e3 * p["seconds"] for p in releases], "o-", label="jitted (donated)")
        ax.semilogy(x, [1e3 * p["loop_seconds"] for p in releases], "s-", label="Python loop")
        shared = [i for i, p in enumerate(releases) if p["shared_prefix"]]
        if shared:
            ax.axvspan(shared[0] - 0.5, shared[-1] + 0.5, color="0.9",
                       label="prefix passes to an heir")
        ax.set_xlabel("release (in order)")
        ax.set_ylabel("ms per tenant release")
        ax.set_title(f"release_tenant at {releases[0]['blocks']:,} blocks "
                     f"(median speedup {metrics['speedup']:.3g}x)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "release_times.png", dpi=120)
        plt.close(fig)
        names.append("release_times.png")
    scaling = sorted((p for p in points if p["kind"] == "scaling"), key=lambda p: p["blocks"])
    if scaling:
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.loglog([p["blocks"] for p in scaling], [1e3 * p["seconds"] for p in scaling], "o-",
                  base=2)
        ax.set_xlabel("blocks in the pool")
        ax.set_ylabel("ms per tenant release (median)")
        ax.set_title("jitted release vs pool size")
        fig.tight_layout()
        fig.savefig(out_dir / "scaling.png", dpi=120)
        plt.close(fig)
        names.append("scaling.png")
    return names


def describe(summary: dict) -> str:
    lines = [f"release of 1 tenant at {summary['blocks']:,} blocks: jitted "
             f"{summary['seconds'] * 1e3:.3f} ms, loop {summary['loop_seconds'] * 1e3:.3f} ms, "
             f"speedup {summary['speedup']:.1f}x (results match: {summary['results_match']})",
             "reclaim in one action (plan + apply) against a release of the same tenant:"]
    for name, a in summary["reclaim_actions"].items():
        lines.append(f"  {name:<22} {a['seconds'] * 1e3:8.1f} ms (plan "
                     f"{a['plan_seconds'] * 1e3:.1f}, apply {a['apply_seconds'] * 1e3:.1f}) = "
                     f"{a['over_release']:.1f}x the release's {a['release_seconds'] * 1e3:.2f} ms;"
                     f" plan == apply: {a['plan_equals_apply']}")
    lines.append(f"plan_apply_over_release (tiered cut to half): "
                 f"{summary['plan_apply_over_release']:.1f}")
    if "seconds" in summary.get("top_up", {}):
        u = summary["top_up"]
        lines.append(f"top-up of {u['prompt_blocks']} blocks on a full pool, refused -> tiered "
                     f"make room -> admitted: {u['seconds'] * 1e3:.1f} ms (plan "
                     f"{u['plan_seconds'] * 1e3:.1f}, apply {u['apply_seconds'] * 1e3:.1f})")
    return "\n".join(lines)


def main(argv):
    del argv
    config = {"log2_blocks": FLAGS.log2_blocks, "scaling": sorted(set(cli.int_list("scaling"))),
              "repeats": FLAGS.repeats, "seed": FLAGS.seed}
    runs.execute("bench_reclaim", config, lambda add_point: run(**config, on_point=add_point),
                 seed=FLAGS.seed, plot=plot, describe=describe)


if __name__ == "__main__":
    cli.run(main, define_flags)
