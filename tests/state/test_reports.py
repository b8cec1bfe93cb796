"""Report and ledger paths of the public API that no other test reaches, worked out by hand on the
tiny pool (8 blocks of 2 tokens, 1024 B per block; lowest ids popped first):
`Allocator.unpin_prefix`, `FreeReport.quota_bytes_released_by_tenant` (and the byte figures
beside it), `Ledger.summary()`, the reports' `reasons()` and their being printable pytrees.
Integer figures compare exactly."""

import json

import jax
import numpy as np
import pytest

from configs.models import get_model_config
from kvquota import codes
from kvquota import errors as E
from kvquota.allocator import Allocator
from kvquota.sentinel import INVALID
from kvquota.state import StateConfig
from tests.state.common import BLOCK, TINY, fresh, leaves_equal, prompts, snapshot

UNIT = TINY.unit_bytes


def _ints(x):
    return np.asarray(x).tolist()


# ---- unpin_prefix -----------------------------------------------------------------------------
def test_unpin_prefix_drops_one_pin_per_block():
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # blocks 0, 1, 2
    s, r = alloc.pin_prefix(s, 0, 2)
    s, r = alloc.pin_prefix(s, 0, 3)
    assert _ints(r.pin_count) == [2, 2, 1] and _ints(s.blocks.pin_count[:3]) == [2, 2, 1]
    s, r = alloc.unpin_prefix(s, 0, 3)
    alloc.check(s)
    assert _ints(s.blocks.pin_count[:3]) == [1, 1, 0]
    # Still referenced by the running sequence: nothing returns, no charge moves.
    assert int(r.unpinned_blocks) == 3 and r.pool_bytes_returned == 0
    assert r.quota_bytes_released == 0 and int(r.transferred_blocks) == 0
    assert int(alloc.ledger(s).pinned_bytes[0]) == 2 * BLOCK
    s, r = alloc.unpin_prefix(s, 0, 2)
    alloc.check(s)
    assert _ints(s.blocks.pin_count[:3]) == [0, 0, 0] and int(alloc.ledger(s).pinned_bytes[0]) == 0
    # A block that is not pinned, a prefix past the sequence, a free slot: typed errors, the
    # state untouched.
    before = snapshot(s)
    for error, call in ((E.BlockStateError, lambda: alloc.unpin_prefix(s, 0, 1)),
                        (E.BlockStateError, lambda: alloc.unpin_prefix(s, 0, 4)),
                        (E.BlockStateError, lambda: alloc.unpin_prefix(s, 0, 0)),
                        (E.UnknownSequenceError, lambda: alloc.unpin_prefix(s, 1, 1))):
        with pytest.raises(error):
            call()
        assert leaves_equal(before, s)


def test_unpin_prefix_returns_blocks_once_unreferenced_and_passes_shared_charges():
    """t0 and t1 share group 5. t0's [1 2 | 3 4 | 5] = blocks 0, 1, 2, its first two blocks
    pinned; t1's [1 2 | 3 4 | 6] hits 0, 1 (new 3). t0's sequence goes: 0 and 1 stay t0's
    (pinned), 2 returns. Unpinning t1's prefix (the same two blocks) drops the pins: t0 holds
    no reference any more, so the charge of both passes to t1 -- quota released by t0, none
    returned to the pool."""
    alloc, s = fresh(tenants=((100, 8 * BLOCK, 5), (100, 3 * BLOCK, 5)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))
    s, _ = alloc.pin_prefix(s, 0, 2)
    s, _ = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 6])]))
    s, r = alloc.free(s, [0])
    assert r.pool_bytes_returned == BLOCK and int(r.transferred_blocks) == 0
    assert _ints(s.blocks.payer[:2]) == [0, 0]
    s, r = alloc.unpin_prefix(s, 1, 2)
    alloc.check(s)
    assert _ints(s.blocks.payer[:4]) == [1, 1, INVALID, 1]
    assert int(r.unpinned_blocks) == 2 and int(r.transferred_blocks) == 2
    assert r.pool_bytes_returned == 0 and _ints(r.blocks_returned) == [0, 0, 0]
    by_tenant = r.quota_bytes_released_by_tenant
    assert by_tenant.dtype == np.int64 and by_tenant.tolist() == [2 * BLOCK, 0]
    assert r.quota_bytes_released == 2 * BLOCK == int(by_tenant.sum())
    assert _ints(r.inherited_bytes) == [0, 2 * BLOCK]
    assert _ints(r.heir_over_quota) == [False, False]  # t1: 3 blocks of 3
    led = alloc.ledger(s)
    assert _ints(led.charged_bytes) == [0, 3 * BLOCK] and _ints(led.pinned_bytes) == [0, 0]


# ---- quota_bytes_released_by_tenant -----------------------------------------------------------
def test_quota_bytes_released_by_tenant_on_release_and_free():
    alloc, s = fresh(tenants=((100, 8 * BLOCK, 5), (100, 8 * BLOCK, 5)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # 0, 1, 2 (t0)
    s, _ = alloc.admit(s, *prompts([(1, [1, 2, 7])]))  # hits 0; new 3 (t1)
    s, _ = alloc.admit(s, *prompts([(1, [8, 8, 8])]))  # 4, 5 (t1)
    # Release t0: blocks 1, 2 return (2 blocks); block 0 passes to t1 (released, not returned).
    s2, r = alloc.release_tenant(s, 0)
    alloc.check(s2)
    assert r.quota_bytes_released_by_tenant.tolist() == [3 * BLOCK, 0]
    assert r.pool_bytes_returned == 2 * BLOCK and r.quota_bytes_released == 3 * BLOCK
    assert _ints(r.inherited_bytes) == [0, BLOCK] and _ints(r.tokens_released) == [5, 0]
    # Release t1 instead: 3, 4, 5 return; block 0 is t0's, t1 only drops a reference.
    s3, r = alloc.release_tenant(s, 1)
    alloc.check(s3)
    assert r.quota_bytes_released_by_tenant.tolist() == [0, 3 * BLOCK]
    assert r.pool_bytes_returned == 3 * BLOCK and _ints(r.inherited_bytes) == [0, 0]
    assert int(r.seqs_freed) == 2 and _ints(r.tokens_released) == [0, 6]
    # Both sequences of t1 and t0's in one free: everything returns, each payer its own.
    s4, r = alloc.free(s, [0, 1, 2])
    alloc.check(s4)
    assert r.quota_bytes_released_by_tenant.tolist() == [3 * BLOCK, 3 * BLOCK]
    assert r.pool_bytes_returned == 6 * BLOCK and int(r.transferred_blocks) == 0


def test_quota_bytes_released_by_tenant_is_exact_past_int32():
    """Qwen2.5-72B blocks of 16 tokens are 5 MiB: releasing 420 of them is 2.2 GB, past int32.
    The per-tenant figure is exact int64 bytes (state counters are int32 byte units)."""
    model = get_model_config("qwen2.5-72b")
    cfg = StateConfig(model, num_blocks=512, block_size=16, max_seqs=2, max_blocks_per_seq=512,
                      num_tenants=2, kv_format="bf16", with_pages=False)
    per_block = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2 * 16
    assert cfg.pool_bytes == (per_block,) and per_block == 5 * 2**20
    alloc = Allocator(cfg)
    s = alloc.init()
    s, _ = alloc.register_tenant(s, 1, token_quota=10**6, byte_quota=512 * per_block)
    n = 420 * 16
    s, r = alloc.admit(s, np.array([1], np.int32), np.arange(n, dtype=np.int32)[None] % 1000,
                       np.array([n], np.int32))
    assert _ints(r.new_blocks) == [420]
    assert int(alloc.ledger(s).charged_bytes[1]) == 420 * per_block
    s, r = alloc.release_tenant(s, 1)
    alloc.check(s)
    want = 420 * per_block  # 2_202_009_600 > 2**31
    assert want > 2**31
    assert r.quota_bytes_released_by_tenant.tolist() == [0, want]
    assert r.quota_bytes_released == want and r.pool_bytes_returned == want


# ---- Ledger.summary -------------------------------------------------------------------------
def test_ledger_summary_in_plain_python_numbers():
    # t0: token quota 20, byte quota 5 blocks + 31 B (rounded down to 5 blocks of units);
    # t1: 30 tokens, 4 blocks; both in group 3.
    alloc, s = fresh(tenants=((20, 5 * BLOCK + UNIT - 1, 3), (30, 4 * BLOCK, 3)))
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3, 4, 5])]))  # 0, 1, 2: 5 tokens in 6 slots
    s, _ = alloc.admit(s, *prompts([(1, [1, 2, 3, 4, 6, 7])]))  # hits 0, 1; new 3 (full)
    s, _ = alloc.pin_prefix(s, 0, 1)  # block 0 pinned (t0)
    led = alloc.ledger(s)
    want = {
        0: {"used_tokens": 5, "token_quota": 20, "byte_quota": 5 * BLOCK,
            "charged_bytes": 3 * BLOCK, "device_bytes": 3 * BLOCK, "host_bytes": 0,
            "pinned_bytes": BLOCK, "shared_bytes": 0,
            # reclaimable: charged, unpinned, referenced only by t0 -> block 2 (1 is t1's too)
            "reclaimable_bytes": BLOCK, "fragmentation_tokens": 1, "preemptions": 0,
            "growing": False},
        1: {"used_tokens": 6, "token_quota": 30, "byte_quota": 4 * BLOCK,
            "charged_bytes": BLOCK, "device_bytes": BLOCK, "host_bytes": 0,
            "pinned_bytes": 0, "shared_bytes": 2 * BLOCK,
            "reclaimable_bytes": BLOCK, "fragmentation_tokens": 0, "preemptions": 0,
            "growing": False},
    }
    summary = led.summary()
    assert summary == want
    assert led.summary(1) == {1: want[1]}
    assert all(type(v) is (bool if k == "growing" else int)
               for row in summary.values() for k, v in row.items())
    assert json.loads(json.dumps(summary)) == {str(t): row for t, row in want.items()}
    assert _ints(led.byte_quota) == [5 * BLOCK, 4 * BLOCK]
    assert _ints(led.bytes("charged_blocks")) == [3 * BLOCK, BLOCK]


# ---- reports are data: reasons, pytrees, printable ----------------------------------------------
def test_reports_name_their_reasons_and_are_printable_pytrees():
    alloc, s = fresh(tenants=((4, 8 * BLOCK, None), (100, BLOCK, None)))
    s, r = alloc.admit(s, *prompts([(0, [1, 2, 3]), (1, [4, 5, 6])]))
    assert r.reasons() == [codes.REASONS[codes.OK], codes.REASONS[codes.REFUSED_BYTE_QUOTA]]
    s, a = alloc.append(s, [0, INVALID], [7, 0])
    s, a = alloc.append(s, [0, INVALID], [7, 0])
    assert a.reasons() == ["over token quota", "padding row"]
    s, f = alloc.fork(s, [0])
    assert f.reasons() == ["over token quota"]
    s, p = alloc.pin_blocks(s, [0])
    assert p.pool_bytes_returned == 0
    s, t = alloc.set_quota(s, 0, token_quota=1, byte_quota=BLOCK)
    assert int(t.tokens_over) == 3 and t.bytes_over == BLOCK  # 4 tokens, 2 blocks charged
    s, fr = alloc.release_tenant(s, 0, unpin=True)
    for report in (r, a, f, p, t, fr, alloc.ledger(s)):
        leaves = jax.tree_util.tree_leaves(report)
        assert leaves and all(hasattr(x, "shape") for x in leaves)
        host = jax.tree_util.tree_map(np.asarray, report)  # plottable / JSON-able as host data
        assert type(host) is type(report)
        assert type(report).__name__ in repr(report)
    assert fr.pool_bytes_returned == 2 * BLOCK and int(fr.unpinned_blocks) == 1
    alloc.check(s)


def test_free_report_bytes_under_a_mixed_pool_config():
    """unit_bytes is the gcd of the pools' block bytes: 32 B for TINY (1024 B f32 blocks beside
    288 B int8 ones). Quota figures in units convert back to exact bytes."""
    assert TINY.unit_bytes == 32 and TINY.pool_units == (32, 9, 32)
    alloc, s = fresh()
    s, _ = alloc.admit(s, *prompts([(0, [1, 2, 3])]))
    s, r = alloc.free(s, [0])
    assert _ints(r.quota_units_released) == [64, 0]
    assert r.quota_bytes_released_by_tenant.tolist() == [2 * BLOCK, 0]
