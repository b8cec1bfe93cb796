"""Benchmark: prompt admission through the prefix cache's hash index vs the brute-force lookup.

    python -m experiments.bench_prefix --json [--out=results/bench_prefix.json]
    python -m experiments.bench_prefix --log2_blocks=14 --prompts=64 --brute_prompts=16 \\
        --scaling=13,14 --scaling_prompts=32 --prompt_tokens=512 --system_tokens=128  # quick

A metadata-only state at Qwen2.5-72B geometry (`configs.models` "qwen2.5-72b", blocks of 16
tokens) is built half full (`kq.build_state`: sequences of 16 tenants in 4 sharing groups, every
full block hashed and indexed). Then --prompts prompts of --prompt_tokens tokens are admitted in
batches of --batch through the public `Allocator.admit(..., donate=True)`, each on the state the
previous call returned: each prompt is one of its group's two system prompts (--system_tokens)
followed by its own random tokens, so later prompts of a group hit the system prompt's blocks.
The first --brute_prompts of those prompts are admitted again, from the same built state, with
`StateConfig(prefix_index=False)` (every lookup a join over all blocks: O(prompt blocks x pool)),
in the same batches; both runs must end in the same state (`results_match`). The ratio is the
brute force's median time per prompt over the index's. Finally, at each --scaling pool size, the
same procedure (a half-full state, then --scaling_prompts prompts; the sizes take turns call by
call, so load drift on a shared machine hits them alike) gives the index's time per prompt,
which should not grow with the pool.

Times are per admit call (block_until_ready), medians over the calls; one untimed call of
distinct prompts first compiles each configuration. Writes a run directory (experiments/runs.py):
one point per call, the summary, and two plots.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

import kvquota as kq
from experiments import cli, runs

FLAGS = flags.FLAGS
MODEL = "qwen2.5-72b"
BLOCK_SIZE = 16
TENANTS, GROUPS, GROUP_SIZE = 16, 4, 4  # every tenant in a sharing group
SYSTEMS_PER_GROUP = 2
PREFILL = 0.5  # fraction of the pool the built state occupies
PREFIX_BLOCKS = 4  # the built state's sequences start with a shared prefix of this many blocks
# A prompt needs more blocks than that prefix: the smallest --prompt_tokens (80).
MIN_PROMPT_TOKENS = (PREFIX_BLOCKS + 1) * BLOCK_SIZE
MIN_LOG2, MAX_LOG2 = 10, 22


def define_flags():
    flags.DEFINE_integer("log2_blocks", 20, "Pool size of the headline run, as a power of two.",
                         lower_bound=MIN_LOG2, upper_bound=MAX_LOG2)
    flags.DEFINE_integer("prompts", 1024, "Prompts admitted through the index.", lower_bound=1)
    flags.DEFINE_integer("brute_prompts", 64, "The first prompts admitted again through the "
                         "brute-force lookup.", lower_bound=1)
    flags.DEFINE_integer("batch", 8, "Prompts per admit call.", lower_bound=1, upper_bound=256)
    flags.DEFINE_integer("prompt_tokens", 2048, f"Tokens per prompt: a multiple of the block "
                         f"size {BLOCK_SIZE}, at least {MIN_PROMPT_TOKENS} (more than the built "
                         f"state's {PREFIX_BLOCKS}-block prefix) and above --system_tokens.",
                         lower_bound=MIN_PROMPT_TOKENS)
    flags.DEFINE_integer("system_tokens", 512, "Tokens of each shared system prompt (a multiple "
                         "of 16, below --prompt_tokens).", lower_bound=BLOCK_SIZE)
    cli.define_int_list("scaling", [16, 17, 18, 19, 20], "log2 pool sizes of the scaling sweep",
                        lower=MIN_LOG2, upper=MAX_LOG2)
    flags.DEFINE_integer("scaling_prompts", 192, "Prompts admitted at each scaling size.",
                         lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Seed of the built state and the prompts.", lower_bound=0)
    runs.define_flags()


def prompt_blocks(prompt_tokens: int) -> int:
    return prompt_tokens // BLOCK_SIZE


def check_sizes(log2_blocks, prompts, brute_prompts, batch, prompt_tokens, system_tokens,
                scaling, scaling_prompts):
    """Refuse, before any work, sizes that do not divide or do not fit the pool."""
    for name, v in (("prompt_tokens", prompt_tokens), ("system_tokens", system_tokens)):
        if v % BLOCK_SIZE:
            raise cli.BadInput(f"--{name}={v} is not a multiple of the block size {BLOCK_SIZE}")
    if system_tokens >= prompt_tokens:
        raise cli.BadInput(f"--system_tokens={system_tokens} must be below --prompt_tokens="
                           f"{prompt_tokens}")
    if prompt_tokens < MIN_PROMPT_TOKENS:
        raise cli.BadInput(f"--prompt_tokens={prompt_tokens} is below {MIN_PROMPT_TOKENS}: a "
                           f"prompt needs more than {PREFIX_BLOCKS} blocks (the built state's "
                           f"sequences start with a {PREFIX_BLOCKS}-block prefix)")
    if brute_prompts > prompts:
        raise cli.BadInput(f"--brute_prompts={brute_prompts} exceeds --prompts={prompts}")
    for lg, n in [(log2_blocks, prompts)] + [(lg, scaling_prompts) for lg in scaling]:
        room = int((1 - PREFILL) * (1 << lg)) - batch * prompt_blocks(prompt_tokens)
        need = n * prompt_blocks(prompt_tokens)
        if need > room:
            raise cli.BadInput(f"{n} prompts of {prompt_tokens} tokens need {need} blocks; a "
                               f"half-full pool of 2^{lg} blocks has room for {room} beside the "
                               "warm-up batch")


def make_config(log2_blocks, prompts, batch, prompt_tokens, prefix_index=True):
    """The state config: `prompts` + `batch` sequence slots beside the built state's."""
    blocks = 1 << log2_blocks
    mb = prompt_blocks(prompt_tokens)
    prefilled = prefill_seqs(blocks, mb)
    return kq.StateConfig(
        kq.get_model_config(MODEL), num_blocks=blocks, block_size=BLOCK_SIZE,
        max_seqs=prefilled + prompts + batch, max_blocks_per_seq=mb, num_tenants=TENANTS,
        kv_format="bf16", with_pages=False, prefix_index=prefix_index)


def prefill_seqs(blocks, mb) -> int:
    """Sequences of the built state: about mb / 2 blocks each fill half the pool."""
    return max(TENANTS, int(PREFILL * blocks) // max(1, mb // 2))


def build(config, seed):
    spec = kq.SyntheticSpec(num_seqs=prefill_seqs(config.num_blocks, config.max_blocks_per_seq),
                            prefix_blocks=PREFIX_BLOCKS, group_size=GROUP_SIZE, num_groups=GROUPS,
                            pool_fill=PREFILL, seed=seed)
    return kq.build_state(config, spec)


def make_prompts(config, n, prompt_tokens, system_tokens, seed):
    """(tenants i32[n], tokens i32[n, prompt_tokens]): prompt i belongs to tenant i % 16 and
    starts with one of its group's system prompts; the rest is its own."""
    rng = np.random.default_rng(seed + 1)
    vocab = config.model.vocab_size
    systems = rng.integers(0, vocab, size=(GROUPS, SYSTEMS_PER_GROUP, system_tokens),
                           dtype=np.int32)
    i = np.arange(n)
    tenants = (i % TENANTS).astype(np.int32)
    which = (i // TENANTS) % SYSTEMS_PER_GROUP
    tokens = rng.integers(0, vocab, size=(n, prompt_tokens), dtype=np.int32)
    tokens[:, :system_tokens] = systems[tenants // GROUP_SIZE, which]
    return tenants, tokens


class Admitter:
    """Admit calls of `batch` prompts through the public facade, donated, each on the state the
    previous call returned (a copy of `state` to start with), after one untimed warm-up call of
    the prompts `warmup` (compiles)."""

    def __init__(self, config, state, batch, warmup):
        self.alloc, self.batch = kq.Allocator(config), batch
        self.state = jax.tree_util.tree_map(jnp.copy, state)
        self.admit(*warmup)

    def admit(self, tenants, tokens):
        """(seconds, host report) of one call (rows past len(tenants) are padding)."""
        b, n = self.batch, len(tenants)
        ten = np.full(b, kq.INVALID, np.int32)
        tok = np.zeros((b, tokens.shape[1]), np.int32)
        ten[:n], tok[:n] = tenants, tokens
        lengths = np.where(ten >= 0, tokens.shape[1], 0).astype(np.int32)
        jax.block_until_ready(self.state)
        t0 = time.perf_counter()
        self.state, rep = self.alloc.admit(self.state, ten, tok, lengths, donate=True)
        jax.block_until_ready((self.state, rep))
        return time.perf_counter() - t0, jax.device_get(rep)


def admit_all(config, state, tenants, tokens, batch, warmup, snapshot_after=None):
    """Admit the prompts in calls of `batch`. Returns (seconds per call, reports, a host
    snapshot of the state after `snapshot_after` calls or None, the final state)."""
    run = Admitter(config, state, batch, warmup)
    seconds, reports, snap = [], [], None
    for j, start in enumerate(range(0, len(tenants), batch)):
        sec, rep = run.admit(tenants[start:start + batch], tokens[start:start + batch])
        seconds.append(sec)
        reports.append(rep)
        if snapshot_after is not None and j + 1 == snapshot_after:
            snap = jax.device_get(run.state)
    return seconds, reports, snap, run.state


def scaling_sweep(sizes, slots, batch, prompt_tokens, system_tokens, prompts, seed):
    """The index's admission time at each pool size: one half-full state per size, then the
    same `prompts`, one call per size in turn (interleaved, so load drift on a shared machine
    hits every size alike). Returns one point per size."""
    runs_, points = [], []
    for lg in sizes:
        c = make_config(lg, slots, batch, prompt_tokens)
        s = build(c, seed)
        points.append({"blocks": c.num_blocks,
                       "hashed_blocks_before": int(np.asarray(s.blocks.hashed).sum())})
        runs_.append((Admitter(c, s, batch, _warmup(c, batch, prompt_tokens, seed)),
                      make_prompts(c, prompts, prompt_tokens, system_tokens, seed)))
        del s
    seconds = [[] for _ in sizes]
    for start in range(0, prompts, batch):
        for k, (adm, (ten, tok)) in enumerate(runs_):
            seconds[k].append(adm.admit(ten[start:start + batch], tok[start:start + batch])[0])
    for point, sec in zip(points, seconds):
        point.update(_summary(sec, batch, prompts))
        logging.info("scaling %d blocks: %.3f ms per prompt", point["blocks"],
                     point["ms_per_prompt_median"])
    return points


def _warmup(config, batch, prompt_tokens, seed):
    """A batch of prompts that share nothing with the measured ones (compiles the call)."""
    rng = np.random.default_rng(seed + 2)
    tok = rng.integers(0, config.model.vocab_size, size=(batch, prompt_tokens), dtype=np.int32)
    return (np.arange(batch, dtype=np.int32) % TENANTS), tok


def same_state(host_a, host_b) -> bool:
    la, ta = jax.tree_util.tree_flatten(host_a)
    lb, tb = jax.tree_util.tree_flatten(host_b)
    return ta == tb and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(la, lb))


def _summary(seconds, batch, prompts):
    med = statistics.median(seconds)
    q = np.quantile(seconds, [0.1, 0.9])
    return {"calls": len(seconds), "prompts": prompts, "ms_per_call_median": 1e3 * med,
            "ms_per_call_p10": 1e3 * float(q[0]), "ms_per_call_p90": 1e3 * float(q[1]),
            "ms_per_prompt_median": 1e3 * med / batch}


def run(log2_blocks, prompts, brute_prompts, batch, prompt_tokens, system_tokens, scaling,
        scaling_prompts, seed, on_point=lambda point: None) -> dict:
    slots = max(prompts, scaling_prompts)  # one config per pool size (the headline's is reused)
    config = make_config(log2_blocks, slots, batch, prompt_tokens)
    state = build(config, seed)
    logging.info("built %d blocks, %d hashed", config.num_blocks,
                 int(np.asarray(state.blocks.hashed).sum()))
    tenants, tokens = make_prompts(config, prompts, prompt_tokens, system_tokens, seed)
    warm = _warmup(config, batch, prompt_tokens, seed)
    brute_calls = -(-brute_prompts // batch)
    idx_s, idx_rep, idx_snap, final = admit_all(config, state, tenants, tokens, batch, warm,
                                                snapshot_after=brute_calls)
    hit_blocks = sum(int(r.hit_blocks.sum()) for r in idx_rep)
    admitted = sum(int(r.admitted.sum()) for r in idx_rep)
    occupied = int(final.index.occupied)
    del final
    for j, s in enumerate(idx_s):
        on_point({"kind": "index", "blocks": config.num_blocks, "call": j, "seconds": s,
                  "hit_blocks": int(idx_rep[j].hit_blocks.sum())})
    brute_config = dataclasses.replace(config, prefix_index=False)
    nb = brute_calls * batch
    br_s, br_rep, br_snap, final = admit_all(brute_config, state, tenants[:nb], tokens[:nb],
                                             batch, warm, snapshot_after=brute_calls)
    del final
    for j, s in enumerate(br_s):
        on_point({"kind": "brute_force", "blocks": config.num_blocks, "call": j, "seconds": s,
                  "hit_blocks": int(br_rep[j].hit_blocks.sum())})
    match = same_state(idx_snap, br_snap) and all(
        same_state(a, b) for a, b in zip(idx_rep[:brute_calls], br_rep))
    del state, idx_snap, br_snap
    index = _summary(idx_s, batch, prompts)
    index_same = _summary(idx_s[:brute_calls], batch, nb)
    brute = _summary(br_s, batch, nb)
    result = {
        "blocks": config.num_blocks,
        "index": {**index, "admitted": admitted, "hit_blocks": hit_blocks,
                  "hit_fraction": hit_blocks / max(1, admitted * prompt_blocks(prompt_tokens)),
                  "index_occupied_slots_at_end": occupied},
        "brute_force": brute,
        "index_on_the_brute_force_prompts": index_same,
        "ratio": brute["ms_per_prompt_median"] / index["ms_per_prompt_median"],
        "ratio_same_prompts": brute["ms_per_prompt_median"] / index_same["ms_per_prompt_median"],
        "results_match": bool(match),
        "scaling": [],
        "timing": "per admit call of --batch prompts (facade included, donated, each on the "
                  "state the previous call returned), block_until_ready; medians over the "
                  "calls; one untimed warm-up call of other prompts compiles each config",
        "setup": {"model": MODEL, "block_size": BLOCK_SIZE, "metadata_only": True,
                  "prompt_tokens": prompt_tokens, "system_tokens": system_tokens,
                  "batch": batch, "tenants": TENANTS, "sharing_groups": f"{GROUPS} x {GROUP_SIZE}",
                  "system_prompts_per_group": SYSTEMS_PER_GROUP, "prefill": PREFILL,
                  "lookup_candidates": config.lookup_candidates, "seed": seed},
    }
    result["scaling"] = scaling_sweep(scaling, slots, batch, prompt_tokens, system_tokens,
                                      scaling_prompts, seed)
    for point in result["scaling"]:
        on_point({"kind": "scaling", **point})
    per = [p["ms_per_prompt_median"] for p in result["scaling"]]
    result["scaling_max_over_min"] = max(per) / min(per)
    return result


def plot(points, metrics, out_dir) -> list[str]:
    """admit_calls.png (each call: index vs brute force) and scaling.png (index time per prompt
    vs pool size), from the run's files."""
    import matplotlib.pyplot as plt

    names = []
    idx = [p for p in points if p["kind"] == "index"]
    brute = [p for p in points if p["kind"] == "brute_force"]
    if idx:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.semilogy([p["call"] for p in idx], [1e3 * p["seconds"] for p in idx], ".",
                    label="hash index")
        if brute:
            ax.semilogy([p["call"] for p in brute], [1e3 * p["seconds"] for p in brute], "s",
                        label="brute force")
        ax.set_xlabel("admit call (in order)")
        ax.set_ylabel("ms per admit call")
        ax.set_title(f"admission at {idx[0]['blocks']:,} blocks "
                     f"(brute force / index per prompt: {metrics.get('ratio', float('nan')):.3g}x)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "admit_calls.png", dpi=120)
        plt.close(fig)
        names.append("admit_calls.png")
    scaling = sorted((p for p in points if p["kind"] == "scaling"), key=lambda p: p["blocks"])
    if scaling:
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.semilogx([p["blocks"] for p in scaling], [p["ms_per_prompt_median"] for p in scaling],
                    "o-", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("blocks in the pool")
        ax.set_ylabel("ms per prompt (median)")
        ax.set_title("admission through the index vs pool size")
        fig.tight_layout()
        fig.savefig(out_dir / "scaling.png", dpi=120)
        plt.close(fig)
        names.append("scaling.png")
    return names


def describe(summary: dict) -> str:
    sc = ", ".join(f"2^{int(np.log2(p['blocks']))}: {p['ms_per_prompt_median']:.3f}"
                   for p in summary["scaling"])
    return (f"admission at {summary['blocks']:,} blocks: index "
            f"{summary['index']['ms_per_prompt_median']:.3f} ms/prompt "
            f"({summary['index']['ms_per_call_median']:.2f} ms per call), brute force "
            f"{summary['brute_force']['ms_per_prompt_median']:.1f} ms/prompt: "
            f"{summary['ratio']:.0f}x (results match: {summary['results_match']}); index ms per "
            f"prompt by pool size: {sc}")


def main(argv):
    del argv
    config = {"log2_blocks": FLAGS.log2_blocks, "prompts": FLAGS.prompts,
              "brute_prompts": FLAGS.brute_prompts, "batch": FLAGS.batch,
              "prompt_tokens": FLAGS.prompt_tokens, "system_tokens": FLAGS.system_tokens,
              "scaling": sorted(set(cli.int_list("scaling"))),
              "scaling_prompts": FLAGS.scaling_prompts, "seed": FLAGS.seed}
    check_sizes(**{k: v for k, v in config.items() if k != "seed"})
    runs.execute("bench_prefix", config, lambda add_point: run(**config, on_point=add_point),
                 seed=FLAGS.seed, plot=plot, describe=describe)


if __name__ == "__main__":
    cli.run(main, define_flags)
