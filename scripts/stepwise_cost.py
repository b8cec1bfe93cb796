"""What stepwise eviction costs on CPU: SmolLM2-135M, ROWS 512-token pydoc texts (default 1)
decoded side by side, budget 256 (0.5), teacher-forced past the budget one token at a time. Each variant runs in this one process
(ratios side by side): plain decode steps (attention recorded, nothing evicted), stepwise TOVA at
stride 1 (the paper) and at the given larger strides, and one-shot TOVA (one eviction at the
end, for scale). Wall per step split into the decode, the driver's keep mask and the eviction.
Prints one JSON object.

  python scripts/stepwise_cost.py [--rows=ROWS] [STRIDE ...]    # default: 1 row; 1 8 32
"""

import json
import os
import sys
import time

import jax
import numpy as np
import pydoc_data.topics

import kvquota as kq
from kvquota.serving import stepwise

CONTEXT, BUDGET = 512, 256


def _timed(fn):
    """Wraps a method so each call is waited for and its wall added to fn.seconds."""
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        jax.block_until_ready(out)
        run.seconds += time.perf_counter() - t0
        return out
    run.seconds = 0.0
    return run


def variant(cfg, params, ids, stride, steps):
    """Wall of `steps` steps past the budget with eviction every `stride` steps (None: none)."""
    rows = len(ids)
    sc = stepwise.stepwise_state_config(cfg, rows, BUDGET if stride else CONTEXT, stride or 0)
    eng = kq.PagedEngine(cfg, params, sc, chunk_size=256, record_attention=True)
    eng.register_tenant(0, token_quota=10**6, byte_quota=eng.max_byte_quota)
    report, _ = eng.admit([0] * rows, [d[:BUDGET] for d in ids])
    seq = report.seq_id.astype(np.int32)
    eng.decode = _timed(eng.decode)
    eng.allocator.keep_mask = _timed(eng.allocator.keep_mask)
    eng.allocator.evict = _timed(eng.allocator.evict)
    driver = stepwise.StepwiseEviction(eng, seq, budget_tokens=BUDGET, stride=stride) \
        if stride else None
    t0 = time.perf_counter()
    for t in range(BUDGET, BUDGET + steps):
        tok = np.array([d[t] for d in ids], np.int32)
        jax.block_until_ready(driver.step(tok) if driver else eng.decode(seq, tok))
    wall = time.perf_counter() - t0
    ms = lambda s: round(1e3 * s / steps, 2)  # noqa: E731
    out = {"steps": steps, "wall_s": round(wall, 2), "ms_per_step": ms(wall),
           "decode_ms_per_step": ms(eng.decode.seconds),
           "keep_mask_ms_per_step": ms(eng.allocator.keep_mask.seconds),
           "evict_ms_per_step": ms(eng.allocator.evict.seconds),
           "evictions": driver.evictions if driver else 0}
    if stride is None:  # one-shot TOVA on the full cache at the end: one eviction, for scale
        t0 = time.perf_counter()
        eng.allocator.evict(eng.state, seq, policy="tova", keep_tokens=BUDGET,
                            attention=np.asarray(eng.last_mass), donate=True)
        out["one_shot_evict_s"] = round(time.perf_counter() - t0, 3)
    return out


def main():
    args = sys.argv[1:]
    rows = int(args.pop(0).split("=", 1)[1]) if args and args[0].startswith("--rows=") else 1
    strides = [int(s) for s in args] or [1, 8, 32]
    cfg, params = kq.load_smollm2()
    tok = kq.load_tokenizer("smollm2-135m")
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tok.encode(text)
    ids = [ids[r * CONTEXT:(r + 1) * CONTEXT] for r in range(rows)]
    result = {"model": cfg.name, "context": CONTEXT, "budget": BUDGET, "rows": rows,
              "device": str(jax.devices()[0]), "cpus": os.cpu_count(),
              "load_avg_1min_at_start": round(os.getloadavg()[0], 2)}
    for s in [None] + strides:  # each variant first run short (compiles), then timed
        variant(cfg, params, ids, s, 2 * (s or 1) + 1)
        result[f"tova_stride_{s}" if s else "no_eviction"] = variant(cfg, params, ids, s,
                                                                       CONTEXT - BUDGET)
    result["load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
