"""Shared small configs and helpers for the state tests.

All tests use a few fixed configs and fixed batch shapes so each jitted core compiles once per
process (jit caches on the static config), which keeps the default suite fast.
"""

import dataclasses

import jax
import numpy as np

from configs.models import get_model_config
from kvquota.allocator import Allocator
from kvquota.sentinel import INVALID
from kvquota.state import KVState, StateConfig

TINY_MODEL = get_model_config("tiny-qwen")  # 2 layers, 2 KV heads, head_dim 16, vocab 256

# The hand-checked pool: 8 device blocks of 2 tokens, 2 tenants, 4 sequences of <= 4 blocks.
# In f32 one block is K+V x 2 layers x 2 heads x 2 tokens x 16 x 4 B = 1024 B. An idle int8 pool
# and host pool exist so the free lists and ledger of several pools are checked too.
TINY = StateConfig(
    TINY_MODEL, num_blocks=8, block_size=2, max_seqs=4, max_blocks_per_seq=4, num_tenants=2,
    kv_format="f32", compressed_pools=(("int8", 4),), host_blocks=4, scrub_on_free=True,
)
BLOCK = 1024
assert TINY.pool_bytes[0] == BLOCK

ADMIT_B, ADMIT_T = 2, TINY.max_tokens_per_seq  # fixed admit batch shape: [2, 8]


def leaves_equal(a, b) -> bool:
    """Every leaf of two states equal exactly (same structure, dtype and values), except the
    version (`meta.version`): it records which operations made a state, not what it holds, so a
    refused op or another path to the same content changes it (tests/state/test_version.py)."""
    a, b = (_without_version(x) for x in (a, b))
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        return False
    return all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb)
    )


def _without_version(x):
    if isinstance(x, KVState):
        return x.replace(meta=x.meta.replace(version=np.zeros(2, np.uint32)))
    return x


def snapshot(state):
    """A host copy of every leaf (survives donation of `state`)."""
    return jax.tree_util.tree_map(lambda x: np.array(x), state)


def prompts(rows, width=ADMIT_T):
    """(tenants, tokens[B, width], lengths) from [(tenant, [tok, ...]), ...] padded to ADMIT_B."""
    ten = np.full(ADMIT_B, INVALID, np.int32)
    tok = np.zeros((ADMIT_B, width), np.int32)
    lens = np.zeros(ADMIT_B, np.int32)
    for i, (t, ids) in enumerate(rows):
        ten[i], lens[i] = t, len(ids)
        tok[i, : len(ids)] = ids
    return ten, tok, lens


def seq_tokens(state, seq, p):
    """The token ids a sequence's table spells out (reads blocks through the table)."""
    n = int(state.seqs.seq_lens[seq])
    table = np.asarray(state.seqs.block_tables[seq])
    toks = np.asarray(state.blocks.token_ids)
    return [int(toks[table[i // p], i % p]) for i in range(n)]


def fresh(config=TINY, tenants=((100, 8 * BLOCK, None), (100, 8 * BLOCK, None))):
    """An allocator and a state with tenants registered as (token_quota, byte_quota, group)."""
    alloc = Allocator(config)
    state = alloc.init()
    for t, (tq, bq, group) in enumerate(tenants):
        state, _ = alloc.register_tenant(state, t, token_quota=tq, byte_quota=bq, share_group=group)
    alloc.check(state)
    return alloc, state


def with_tenants(config, n):
    return dataclasses.replace(config, num_tenants=n)


def whole_array_copies(hlo_text: str, leading) -> list[str]:
    """Lines of compiled HLO that copy a whole array whose leading dimensions are one of
    `leading` (e.g. the pool's block count, or "37,29" for a [S, MB] table): what a donated
    core must not do. An array with no elements (a metadata-only state's head_mass,
    [NB, P, 0, 0]) moves no bytes and is left out."""
    import re

    big = re.compile(r"= \w+\[(%s)[\],].*\bcopy\(" % "|".join(map(str, leading)))
    empty = re.compile(r"= \w+\[[\d,]*\b0\b[\d,]*\]")
    return [line.strip() for line in hlo_text.splitlines()
            if big.search(line) and not empty.search(line)]
