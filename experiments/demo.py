r"""The main job, in small: tenants sharing a system prompt through the prefix cache, on SmolLM2.

  python -m experiments.demo [--max_new_tokens=40] [--json]

Three tenants run chat requests on one paged KV cache (bf16 pages, blocks of 16 tokens).
"acme" and "globex" opted into sharing (one salt), "initech" did not. acme's request fills the
prefix cache with the system prompt's full blocks; globex's request then takes them by reference
(cached tokens > 0), initech's recomputes them (a private salt never hits another tenant's
blocks). The ledger is printed in bytes after each step; freeing acme's sequence shows the
difference between bytes returned to the pool and quota bytes released (the shared blocks' charge
passes to globex instead of being freed).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from absl import flags

import kvquota as kq
from experiments import cli


SYSTEM = (
    "You are the support assistant of a cloud provider. Answer in one or two short sentences. "
    "Be precise, do not invent product names, and if you do not know, say so plainly."
)
TENANTS = {0: ("acme", 1), 1: ("globex", 1), 2: ("initech", None)}  # id: (name, share group)
QUESTIONS = {
    0: "What is a KV cache in a language model?",
    1: "Why do long prompts use more GPU memory?",
    2: "What does a quota limit?",
}

FLAGS = flags.FLAGS
# The demo's sequences hold 16 blocks of 16 tokens; the longest prompt takes 63 of them.
MAX_NEW_TOKENS = 192


def define_flags():
    flags.DEFINE_integer("max_new_tokens", 40, "Tokens generated per request at most.",
                         lower_bound=1, upper_bound=MAX_NEW_TOKENS)
    cli.define_json("Print the results as one JSON object.")
    cli.define_progress()


def _ledger_rows(engine) -> list[dict]:
    summary = engine.ledger().summary()
    return [{"tenant": TENANTS[t][0], **summary[t]} for t in TENANTS]


def _print_ledger(title: str, rows: list[dict]):
    print(f"\n  ledger — {title}")
    print(f"  {'tenant':8} {'tokens':>7} {'charged':>10} {'shared':>10} {'reclaimable':>12}"
          f" {'byte quota':>11}")
    kib = lambda b: f"{b / 1024:.0f} KiB"  # noqa: E731
    for r in rows:
        print(f"  {r['tenant']:8} {r['used_tokens']:>7} {kib(r['charged_bytes']):>10} "
              f"{kib(r['shared_bytes']):>10} {kib(r['reclaimable_bytes']):>12} "
              f"{kib(r['byte_quota']):>11}")


def run(max_new_tokens: int = 40, verbose: bool = True) -> dict:
    """Runs the demo; returns what it printed, as data."""
    say = print if verbose else (lambda *a, **k: None)
    start = time.perf_counter()
    cli.stage("loading SmolLM2-135M")
    config, params = kq.load_smollm2()
    tok = kq.from_gguf(kq.smollm2_gguf_path())
    state_config = kq.StateConfig(model=config, num_blocks=128, block_size=16, max_seqs=8,
                               max_blocks_per_seq=16, num_tenants=len(TENANTS), kv_format="bf16")
    engine = kq.PagedEngine(config, params, state_config, chunk_size=128)
    block_bytes = state_config.layout().bytes_per_block
    for t, (name, group) in TENANTS.items():  # quotas: 1024 tokens, 24 blocks' bytes each
        engine.register_tenant(t, token_quota=1024, byte_quota=24 * block_bytes,
                               share_group=group)
    prompts = {
        t: tok.encode(tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]))
        for t, q in QUESTIONS.items()
    }
    system_len = len(tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)))
    layout = state_config.layout()
    say(f"SmolLM2-135M on a paged KV cache: {state_config.num_blocks} blocks of "
        f"{state_config.block_size} tokens, bf16 pages, {layout.bytes_per_block // 1024} KiB per "
        f"block ({layout.bytes_per_token:,} B per token)")
    say(f"system prompt: {system_len} tokens; acme and globex share a salt, initech is private")

    record = {"requests": [], "ledgers": {}}

    def serve(tenants):
        outs = engine.generate([prompts[t] for t in tenants], max_new_tokens, tenants=tenants,
                               stop_ids=tok.stop_ids(), release=False)
        for t, out in zip(tenants, outs):
            answer = tok.decode(out.tokens).strip()
            say(f"\n  [{TENANTS[t][0]}] {QUESTIONS[t]}\n  prompt {len(prompts[t])} tokens, "
                f"{out.cached_tokens} from the prefix cache; {len(out.tokens)} generated "
                f"({out.finish})\n  -> {answer}")
            record["requests"].append({
                "tenant": TENANTS[t][0], "seq_id": out.seq_id, "prompt_tokens": len(prompts[t]),
                "cached_tokens": out.cached_tokens, "generated": len(out.tokens),
                "finish": out.finish, "answer": answer})
        return outs

    cli.stage("serving the requests (step 1: acme; step 2: globex and initech)")
    say("\nstep 1: acme's request fills the prefix cache")
    (acme,) = serve([0])
    say("\nstep 2: globex (same salt) and initech (private) arrive together")
    serve([1, 2])
    record["ledgers"]["after requests"] = _ledger_rows(engine)
    if verbose:
        _print_ledger("all three requests cached", record["ledgers"]["after requests"])

    report = engine.free(np.array([acme.seq_id], np.int32))
    freed = {"pool_bytes_returned": report.pool_bytes_returned,
             "quota_bytes_released": report.quota_bytes_released,
             "blocks_passed_to_heir": int(report.transferred_blocks)}
    record["free_acme"] = freed
    say(f"\nstep 3: acme's sequence is freed: {freed['quota_bytes_released'] // 1024} KiB of "
        f"quota released, {freed['pool_bytes_returned'] // 1024} KiB returned to the pool; "
        f"{freed['blocks_passed_to_heir']} shared blocks now charged to globex")
    record["ledgers"]["after freeing acme"] = _ledger_rows(engine)
    if verbose:
        _print_ledger("after freeing acme", record["ledgers"]["after freeing acme"])
    engine.allocator.check(engine.state)
    for t in (1, 2):
        engine.state, _ = engine.allocator.release_tenant(engine.state, t, donate=True)
    engine.allocator.check(engine.state)
    free_blocks = int(np.asarray(engine.state.free.free_count)[0])
    record["free_blocks_at_end"] = free_blocks
    record["seconds"] = time.perf_counter() - start
    say(f"\nall tenants released: {free_blocks}/{state_config.num_blocks} blocks free, "
        f"invariants hold ({record['seconds']:.0f} s)")
    return record


def main(argv):
    del argv
    record = run(FLAGS.max_new_tokens, verbose=not FLAGS.json)
    if FLAGS.json:
        json.dump(record, sys.stdout)
        sys.stdout.write("\n")


if __name__ == "__main__":
    cli.run(main, define_flags)
