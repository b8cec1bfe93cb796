"""Test-case factory for paged attention: a pool with scattered, NaN-poisoned pages.

Every page and slot no sequence owns holds NaN (in a real pool it holds another sequence's or
tenant's stale data), so a stray read shows as NaN in the output. Block tables are random
permutations of the pool; entries past a sequence's length hold the sentinel or arbitrary
(possibly NaN-filled) blocks.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvquota.sentinel import INVALID

# Per-dtype tolerances (atol, rtol) for kernel vs reference. bf16: the kernel rounds the
# probabilities to bf16 before the value product (as flash attention does) while the reference
# keeps them in f32; bf16 has an 8-bit mantissa (2^-8 = 3.9e-3 relative).
TOLERANCES = {
    "float32": dict(atol=2e-5, rtol=2e-5),
    "bfloat16": dict(atol=1.5e-2, rtol=1.5e-2),
}


@dataclasses.dataclass
class Case:
    """Arrays of one test case (numpy), plus the dense view of the valid tokens."""

    q: np.ndarray  # [B, Hq, D] (decode) or [B, T, Hq, D] (prefill)
    k_pages: np.ndarray  # [Hkv, N, P, D], NaN where no sequence owns the slot
    v_pages: np.ndarray  # [Hkv, N, P, D]
    block_tables: np.ndarray  # i32[B, M]
    lengths: np.ndarray  # i32[B]
    k_dense: np.ndarray  # f32[B, M*P, Hkv, D]: the sequence's tokens in order, zeros after
    v_dense: np.ndarray  # f32[B, M*P, Hkv, D]
    owned: np.ndarray  # bool[N, P]: the slot holds a valid token of some sequence

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def fill(self) -> np.ndarray:
        """i32[N] tokens stored in each page (the state's per-block `fill`): what quantizing
        must be told so the NaN slots past it reach no scale. Owned slots are a prefix."""
        fill = self.owned.sum(axis=1).astype(np.int32)
        prefix = np.arange(self.page_size)[None, :] < fill[:, None]
        assert np.array_equal(prefix, self.owned), "owned slots are not a prefix of each page"
        return fill


def make_case(
    seed: int,
    *,
    batch: int = 3,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    max_blocks: int = 6,
    lengths=None,
    dtype=np.float32,
    past_length: str = "sentinel",  # or "arbitrary"
    spare_blocks: int = 3,
    query_len: int | None = None,  # None: decode q [B, Hq, D]; else prefill q [B, T, Hq, D]
    nan_fill: bool = True,
) -> Case:
    """Builds a case; `lengths` defaults to a spread with 0, 1, a page multiple and the maximum."""
    rng = np.random.default_rng(seed)
    cap = max_blocks * page_size
    if lengths is None:
        pool = [0, 1, page_size, cap, page_size + 1, cap - 1, 2 * page_size]
        lengths = [pool[i % len(pool)] for i in range(batch)]
    lengths = np.asarray(lengths, np.int32)
    used = [int(-(-n // page_size)) for n in lengths]
    num_blocks = sum(used) + spare_blocks
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.empty((batch, max_blocks), np.int32)
    offset = 0
    for b in range(batch):
        tables[b, : used[b]] = perm[offset: offset + used[b]]
        offset += used[b]
        if past_length == "sentinel":
            tables[b, used[b]:] = INVALID
        else:  # arbitrary real blocks, possibly another sequence's or an unused (NaN) one
            tables[b, used[b]:] = rng.integers(0, num_blocks, max_blocks - used[b])
    shape = (kv_heads, num_blocks, page_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    # Round to the storage dtype once, so the dense view holds exactly the stored values.
    k = k.astype(dtype).astype(np.float32)
    v = v.astype(dtype).astype(np.float32)
    owned = np.zeros((num_blocks, page_size), bool)
    k_dense = np.zeros((batch, cap, kv_heads, head_dim), np.float32)
    v_dense = np.zeros_like(k_dense)
    for b in range(batch):
        for s in range(lengths[b]):
            blk, slot = tables[b, s // page_size], s % page_size
            owned[blk, slot] = True
            k_dense[b, s] = k[:, blk, slot]
            v_dense[b, s] = v[:, blk, slot]
    if nan_fill:
        k[:, ~owned] = np.nan
        v[:, ~owned] = np.nan
    q_shape = (batch, q_heads, head_dim) if query_len is None else (
        batch, query_len, q_heads, head_dim)
    q = rng.standard_normal(q_shape).astype(np.float32).astype(dtype)
    return Case(q=q, k_pages=k.astype(dtype), v_pages=v.astype(dtype), block_tables=tables,
                lengths=lengths, k_dense=k_dense, v_dense=v_dense, owned=owned)


def assert_close(actual, expected, dtype, what=""):
    """Compares under the dtype's tolerance; NaN anywhere fails."""
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    assert not np.isnan(actual).any(), f"{what}: NaN in result"
    np.testing.assert_allclose(actual, expected, err_msg=what, **TOLERANCES[np.dtype(dtype).name])
