"""Host-side checks of the facade's inputs: integer arrays and scalars, never cast silently; the
padding of row lists to power-of-two sizes (so a jitted core compiles once per bucket); and the
checks against the state that several ops share (tenants, sequence batches, heir rows)."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from kvquota.codes import INT32_MAX, INT32_MIN, SEQ_RUNNING, STATUS_NAMES
from kvquota.errors import (DuplicateIdError, InputDtypeError, InputShapeError, QuotaValueError,
                            UnknownSequenceError, UnknownTenantError)
from kvquota.sentinel import INVALID


def bucket(n: int) -> int:
    """Smallest power of two >= max(n, 1): bounds recompiles to log2(max_seqs) sizes."""
    return 1 << max(0, int(n) - 1).bit_length()


def pad(ids, size: int) -> np.ndarray:
    out = np.full(size, INVALID, np.int32)
    out[: len(ids)] = ids
    return out


def int_array(name: str, value, ndim: int) -> np.ndarray:
    """An integer array of rank `ndim` as int32; floats/bools/objects are rejected, not cast.
    Only values that do not fit int32 are refused here: what an argument's values mean (a
    tenant, a token id, INVALID padding) is checked by its caller, with the error of that rule."""
    if isinstance(value, (list, tuple)):
        try:
            value = np.asarray(value)
        except ValueError as err:  # ragged nested lists
            raise InputShapeError(f"{name} must be a rectangular integer array: {err}") from None
        if value.size == 0:
            value = value.astype(np.int32)
    if not isinstance(value, (np.ndarray, jax.Array)):
        raise InputDtypeError(f"{name} must be an integer array, got {type(value).__name__}")
    if value.dtype == bool or not np.issubdtype(value.dtype, np.integer):
        raise InputDtypeError(f"{name} must have an integer dtype, got {value.dtype}")
    if value.ndim != ndim:
        raise InputShapeError(f"{name} must have rank {ndim}, got shape {tuple(value.shape)}")
    arr = np.asarray(value)
    if arr.size and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
        raise InputDtypeError(f"{name} has values that do not fit int32 "
                              f"[{INT32_MIN}, {INT32_MAX}]")
    return arr.astype(np.int32)


def int_scalar(name: str, value, error=QuotaValueError) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise error(f"{name} must be an integer, got {value!r}")
    return int(value)


# ---- checks against the state (small host reads), shared by the facade ops in kvquota.core ----
def tenant_id(config, state, tenant, *, registered: bool = True) -> int:
    """`tenant` as an int in [0, num_tenants), registered unless `registered=False`."""
    t = int_scalar("tenant", tenant, UnknownTenantError)
    if not 0 <= t < config.num_tenants:
        raise UnknownTenantError(f"tenant {t} outside [0, {config.num_tenants})")
    if registered and not np.asarray(state.tenants.registered)[t]:
        raise UnknownTenantError(f"tenant {t} is not registered")
    return t


def tenant_row(state, t: int) -> dict:
    """One tenant's ledger settings as Python values (one host read of the [T] columns)."""
    host = jax.device_get((state.tenants.token_quota, state.tenants.byte_quota,
                           state.tenants.lease_expiry, state.tenants.salt,
                           state.tenants.growing))
    tq, bq, lease, salt, growing = (column[t] for column in host)
    return dict(token_quota=int(tq), byte_quota=int(bq), lease_expiry=int(lease),
                salt=np.uint32(salt), growing=np.bool_(growing))


def live_ids(config, state, seq_ids, what: str, error=UnknownSequenceError,
             allowed=(SEQ_RUNNING,)) -> np.ndarray:
    """The real (non-padding) ids of `seq_ids`, each in range and in an `allowed` status."""
    ids = seq_ids[seq_ids != INVALID]
    bad = ids[(ids < 0) | (ids >= config.max_seqs)]
    if bad.size:
        raise error(f"{what}: sequence id {int(bad[0])} outside [0, {config.max_seqs})")
    if ids.size:
        status = np.asarray(state.seqs.seq_status)[ids]
        wrong = ~np.isin(status, allowed)
        if wrong.any():
            names = " or ".join(STATUS_NAMES[a] for a in allowed)
            raise error(f"{what}: sequence {int(ids[wrong][0])} is "
                        f"{STATUS_NAMES.get(int(status[wrong][0]), 'unknown')}, not {names}")
    return ids


def seq_batch(config, state, seq_ids, what: str, allowed) -> tuple[np.ndarray, np.ndarray]:
    """(validated input rows i32[B], their real ids): every real id in range, in an `allowed`
    status, at most once. Reports follow the input rows."""
    ids = int_array("seq_ids", seq_ids, 1)
    if ids.size == 0:
        raise InputShapeError("seq_ids must have at least one row")
    real = live_ids(config, state, ids, what, allowed=allowed)
    if len(np.unique(real)) != len(real):
        raise DuplicateIdError(f"{what}: a sequence appears twice in one call")
    return ids, real


def heir_rows(config, state, salts, exclude) -> Optional[tuple]:
    """The table entries of the live sequence slots of tenants whose salt is in `salts` (the only
    possible heirs of a dropped payer): (rows, cols) i32[S] naming each of their ceil(len / P)
    entries, padded with INVALID to a power of two; None when there are none (the core then
    reads no other row). Listing entries, not rows x MB, keeps a core's cost at the entries
    held."""
    ten = np.asarray(state.seqs.seq_tenant)
    salt = np.asarray(state.tenants.salt)
    live = ten >= 0
    rows = np.flatnonzero(live & np.isin(salt[np.maximum(ten, 0)], np.asarray(salts)))
    rows = np.setdiff1d(rows, exclude)
    p = config.block_size
    n = (np.asarray(state.seqs.seq_lens)[rows].astype(np.int64) + p - 1) // p
    if not n.sum():
        return None
    size = bucket(int(n.sum()))
    starts = np.cumsum(n) - n
    cols = np.arange(int(n.sum())) - np.repeat(starts, n)
    return pad(np.repeat(rows, n), size), pad(cols, size)


def heirs_of_rows(config, state, real) -> Optional[tuple]:
    """`heir_rows` for dropping the sequences `real`: the live entries of their tenants' salts."""
    ten = np.asarray(state.seqs.seq_tenant)[real]
    return heir_rows(config, state, np.asarray(state.tenants.salt)[ten], real)
