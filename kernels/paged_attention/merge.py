"""Merging partial attention results by their log-sum-exp.

Attention over a set of keys does not depend on their order, so a sequence whose blocks sit in
several pools (full precision, int8, ...) is attended per pool and merged: with per-pool outputs
o_i and log-sum-exps l_i, the union is sum_i exp(l_i - L) o_i with L = logsumexp_i l_i
(the same rescaling flash attention uses between key blocks; Dao et al., 2022).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def merge_attention(
    outs: Sequence[jax.Array],  # each [..., D]
    lses: Sequence[jax.Array],  # each [...], f32; -inf where a part attended to nothing
) -> tuple[jax.Array, jax.Array]:
    """Merges attention over disjoint key sets -> (out [..., D] in outs[0].dtype, lse [...]).

    Rows where every part has lse = -inf give zeros and -inf, as attention over no keys does.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"need as many outputs as lses (>= 1), got {len(outs)} and {len(lses)}")
    for i, (o, l) in enumerate(zip(outs, lses)):
        if o.shape[:-1] != l.shape or o.shape != outs[0].shape:
            raise ValueError(
                f"part {i}: out shape {o.shape} does not match lse shape {l.shape} "
                f"(or part 0's out shape {outs[0].shape})"
            )
    lse = jnp.stack([l.astype(jnp.float32) for l in lses])  # [n, ...]
    top = jnp.max(lse, axis=0)
    top_safe = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top_safe[None])  # parts with lse = -inf weigh 0
    total = jnp.sum(w, axis=0)
    has = total > 0
    norm = jnp.where(has[None], w / jnp.where(has, total, 1.0)[None], 0.0)  # [n, ...]
    # where, not a product, keeps a NaN of an empty part (which has weight 0) out of the result
    out = sum(
        jnp.where(norm[i][..., None] > 0, norm[i][..., None] * o.astype(jnp.float32), 0.0)
        for i, o in enumerate(outs)
    )
    merged_lse = jnp.where(has, top_safe + jnp.log(jnp.where(has, total, 1.0)), -jnp.inf)
    return out.astype(outs[0].dtype), merged_lse
