"""A free reads only the table columns its rows hold (`release.table_cols`): the same state
and report as reading every column, heirs and orphans included."""

import dataclasses

import numpy as np

from kvquota.core import release
from kvquota.sentinel import INVALID
from kvquota.validation import heir_rows
from tests.state.common import TINY, fresh, leaves_equal, snapshot

# 32 blocks per table, so a short sequence's 16 columns are a real cut of the table.
WIDE = dataclasses.replace(TINY, num_blocks=96, max_blocks_per_seq=32, compressed_pools=(),
                           host_blocks=0)


def _admit(alloc, state, tenant, ids):
    tok = np.zeros((1, WIDE.max_tokens_per_seq), np.int32)
    tok[0, : len(ids)] = ids
    state, rep = alloc.admit(state, np.asarray([tenant], np.int32), tok,
                             np.asarray([len(ids)], np.int32))
    assert bool(rep.admitted[0])
    return state, int(rep.seq_id[0])


def test_free_of_a_payer_reads_its_columns_and_passes_the_charge_as_a_full_read_does():
    alloc, state = fresh(WIDE, tenants=((1000, 96 * 1024, 0), (1000, 96 * 1024, 0)))
    shared = list(range(1, 21))  # 10 full blocks, the same salt (group 0): hits for tenant 1
    state, payer = _admit(alloc, state, 0, shared + [7])  # 11 blocks: 16 columns
    state, heir = _admit(alloc, state, 1, shared + list(range(30, 71)))  # 31 blocks
    alloc.check(state)
    rows = np.asarray([payer], np.int32)
    cols = release.table_cols(WIDE, state, rows)
    assert cols == 16 and release.table_cols(WIDE, state, np.asarray([heir], np.int32)) == 32
    assert bool(release.leaves_orphans(WIDE, state, rows, cols))  # tenant 1 inherits the prefix
    assert bool(release.leaves_orphans(WIDE, state, rows))
    heirs = heir_rows(WIDE, state, np.asarray(state.tenants.salt)[[0]], rows)
    before = snapshot(state)
    full, full_rep = release.drop_core(WIDE, before, rows, heirs, None, 0)
    cut, cut_rep = release.drop_core(WIDE, before, rows, heirs, None, 0, cols)
    assert leaves_equal(full, cut) and leaves_equal(full_rep, cut_rep)
    assert int(cut_rep.transferred_blocks) == 10
    freed, rep = alloc.free(state, np.asarray([payer, INVALID], np.int32))
    alloc.check(freed)
    assert leaves_equal(freed, full) and leaves_equal(rep, full_rep)
