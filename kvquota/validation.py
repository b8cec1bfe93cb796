"""Host-side checks of the facade's inputs: integer arrays and scalars, never cast silently, and
the padding of row lists to power-of-two sizes (so a jitted core compiles once per bucket)."""

from __future__ import annotations

import jax
import numpy as np

from kvquota.codes import INT32_MAX, INT32_MIN
from kvquota.errors import InputDtypeError, InputShapeError, QuotaValueError
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
