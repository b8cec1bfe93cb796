"""Bad shapes and dtypes raise ValueError naming both sides, before any kernel is traced."""

import numpy as np
import pytest

from kernels import paged_attention as pa
from kernels.quantization import quantize_kv
from tests.kernels.cases import make_case


@pytest.fixture(scope="module")
def case():
    return make_case(61, batch=3, q_heads=4, kv_heads=2, head_dim=64, page_size=16,
                     max_blocks=4, lengths=[1, 5, 9])


def _call(c, **over):
    args = dict(q=c.q, k_pages=c.k_pages, v_pages=c.v_pages, block_tables=c.block_tables,
                lengths=c.lengths)
    kw = {k: over.pop(k) for k in ("mass", "backend", "sm_scale") if k in over}
    args.update(over)
    return pa.decode(*args.values(), **kw)


@pytest.mark.parametrize("change,pattern", [
    (lambda c: dict(q=c.q[..., :32]), r"q head_dim 32 != k_pages/v_pages head_dim 64"),
    (lambda c: dict(q=c.q[:, :3]), r"q heads 3 is not a multiple of .* KV heads 2"),
    (lambda c: dict(v_pages=c.v_pages[:, :-1]), r"k_pages shape .* != v_pages shape"),
    (lambda c: dict(v_pages=c.v_pages.astype(np.float16)),
     r"k_pages dtype float32 != v_pages dtype float16"),
    (lambda c: dict(block_tables=c.block_tables.astype(np.int64)),
     r"block_tables dtype int64 != int32"),
    (lambda c: dict(block_tables=c.block_tables[:2]), r"block_tables batch 2 != q batch 3"),
    (lambda c: dict(lengths=c.lengths[:2]), r"lengths shape \(2,\) != \(q batch,\) = \(3,\)"),
    (lambda c: dict(lengths=c.lengths.astype(np.float32)), r"lengths dtype float32 != int32"),
    (lambda c: dict(q=c.q.astype(np.int32)), r"q dtype int32 is not floating"),
    (lambda c: dict(k_pages=c.k_pages[0], v_pages=c.v_pages[0]), r"k_pages must be \[Hkv, N, P, D\]"),
    (lambda c: dict(mass="layer"), r"mass must be one of"),
    (lambda c: dict(backend="cuda"), r"backend must be one of"),
])
def test_decode_rejects(case, change, pattern):
    with pytest.raises(ValueError, match=pattern):
        _call(case, **change(case))


def test_prefill_rejects_q_start_mismatch(case):
    q = np.stack([case.q, case.q], axis=1)  # [B, T=2, Hq, D]
    with pytest.raises(ValueError, match=r"q_start shape \(1,\) != \(q batch,\) = \(3,\)"):
        pa.prefill(q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                   np.zeros(1, np.int32))
    with pytest.raises(ValueError, match=r"prefill: q must be \[B, T, Hq, D\]"):
        pa.prefill(case.q, case.k_pages, case.v_pages, case.block_tables, case.lengths,
                   np.zeros(3, np.int32))


def test_quantized_pages_checked(case):
    k, v = quantize_kv(case.k_pages, case.v_pages, "int8")
    bad = k.replace(scales=k.scales[:, :, :1])
    with pytest.raises(ValueError, match=r"k_pages.scales shape .* != expected"):
        pa.decode(case.q, bad, v, case.block_tables, case.lengths)
    k4, _ = quantize_kv(case.k_pages[..., :32], case.v_pages[..., :32], "int4")
    with pytest.raises(ValueError, match=r"k_pages shape \(2, \d+, 16, 32\) != v_pages shape"):
        pa.decode(case.q, k4, v, case.block_tables, case.lengths)
