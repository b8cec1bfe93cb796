"""Python-side checks of decode/prefill inputs: shapes and dtypes only, so they also run under jit.

A bad call raises ValueError naming both sides of the disagreement, before anything is traced
into a kernel whose error would be far less readable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels.paged_attention.layered import page_shape
from kernels.quantization import QuantizedPages

MASS_KINDS = (None, "block", "token")
BACKENDS = ("auto", "pallas", "reference")


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _check_pages(name: str, pages, layered: bool = False) -> tuple[int, ...]:
    """-> the pages' logical shape: [Hkv, N, P, D], or [L, Hkv, N, P, D] with `layered`."""
    rank = 5 if layered else 4
    lead = "L, " if layered else ""
    if isinstance(pages, QuantizedPages):
        if pages.data.ndim != rank:
            hint = ("" if layered or pages.data.ndim != 5 else
                    "; a pool with a leading [L] axis needs layer=")
            raise ValueError(f"{name}.data must be [{lead}Hkv, N, P, D*bits/8], got shape "
                             f"{pages.data.shape}{hint}")
        h, n, p, d = page_shape(pages)
        layers = pages.data.shape[:1] if layered else ()
        want = layers + pages.spec.scale_shape(h, n, p, d)
        if pages.scales.shape != want:
            raise ValueError(f"{name}.scales shape {pages.scales.shape} != expected {want} for "
                             f"{pages.kv_format.name} {pages.role}s of data shape {pages.data.shape}")
        if pages.spec.asymmetric and (pages.zeros is None or pages.zeros.shape != want):
            got = None if pages.zeros is None else pages.zeros.shape
            raise ValueError(f"{name}.zeros shape {got} != expected {want} ({pages.kv_format.name})")
        if pages.data.dtype != jnp.dtype(pages.spec.data_dtype):
            raise ValueError(f"{name}.data dtype {pages.data.dtype} != format dtype "
                             f"{pages.spec.data_dtype} ({pages.kv_format.name})")
        return layers + (h, n, p, d)
    if getattr(pages, "ndim", None) != rank:
        got = getattr(pages, "shape", type(pages))
        if layered:
            raise ValueError(f"{name} must be [L, Hkv, N, P, D] (or QuantizedPages with a leading "
                             f"[L] axis) with layer=, got shape {got}")
        hint = ("; a [L, Hkv, N, P, D] pool needs layer="
                if getattr(pages, "ndim", None) == 5 else "")
        raise ValueError(f"{name} must be [Hkv, N, P, D] or QuantizedPages, got shape "
                         f"{got}{hint}")
    if not _is_float(pages.dtype):
        raise ValueError(f"{name} dtype {pages.dtype} is not floating (quantized pages must be "
                         "passed as QuantizedPages)")
    return tuple(pages.shape)


def _check_layer(layer, num_layers: int) -> None:
    """`layer`: a Python int or an integer array of shape () (traced allowed), in [0, L) when
    its value is known here (a traced one is clamped by the kernels)."""
    if isinstance(layer, (bool, np.bool_)):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    if not isinstance(layer, (int, np.integer)):
        shape, dtype = getattr(layer, "shape", None), getattr(layer, "dtype", None)
        if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"layer must be an integer scalar (int or int32[], traced "
                             f"allowed), got {type(layer).__name__} shape {shape} dtype {dtype}")
        if isinstance(layer, jax.core.Tracer):
            return
    if not 0 <= int(layer) < num_layers:
        raise ValueError(f"layer {int(layer)} is out of range for a pool of {num_layers} layers")


def validate(
    kind: str, q, k_pages, v_pages, block_tables, lengths, q_start=None, *, mass=None,
    backend="auto", sm_scale=None, layer=None,
) -> None:
    """Raises ValueError for inconsistent decode ("decode") or prefill ("prefill") inputs.

    With `layer`, k_pages/v_pages are pools of every layer, [L, Hkv, N, P, D] (QuantizedPages:
    arrays with a leading [L] axis), read at that layer; without it, one layer's [Hkv, N, P, D].
    """
    q_rank = 3 if kind == "decode" else 4
    q_desc = "[B, Hq, D]" if kind == "decode" else "[B, T, Hq, D]"
    if getattr(q, "ndim", None) != q_rank:
        raise ValueError(f"{kind}: q must be {q_desc}, got shape {getattr(q, 'shape', None)}")
    if not _is_float(q.dtype):
        raise ValueError(f"{kind}: q dtype {q.dtype} is not floating")
    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    layered = layer is not None
    k_shape = _check_pages("k_pages", k_pages, layered)
    v_shape = _check_pages("v_pages", v_pages, layered)
    if k_shape != v_shape:
        raise ValueError(f"k_pages shape {k_shape} != v_pages shape {v_shape}")
    if layered:
        _check_layer(layer, k_shape[0])
    if not isinstance(k_pages, QuantizedPages) and not isinstance(v_pages, QuantizedPages):
        if k_pages.dtype != v_pages.dtype:
            raise ValueError(f"k_pages dtype {k_pages.dtype} != v_pages dtype {v_pages.dtype}")
    hkv, _, _, dk = k_shape[-4:]
    if dk != d:
        raise ValueError(f"q head_dim {d} != k_pages/v_pages head_dim {dk}")
    if hq % hkv:
        raise ValueError(f"q heads {hq} is not a multiple of k_pages/v_pages KV heads {hkv}")
    if getattr(block_tables, "ndim", None) != 2:
        raise ValueError(f"block_tables must be [B, max_blocks], got shape "
                         f"{getattr(block_tables, 'shape', None)}")
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables dtype {block_tables.dtype} != int32")
    if block_tables.shape[0] != b:
        raise ValueError(f"block_tables batch {block_tables.shape[0]} != q batch {b}")
    for name, arr in (("lengths", lengths), ("q_start", q_start)):
        if arr is None:
            continue
        if getattr(arr, "shape", None) != (b,):
            raise ValueError(f"{name} shape {getattr(arr, 'shape', None)} != (q batch,) = ({b},)")
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name} dtype {arr.dtype} != int32")
    if kind == "prefill" and q_start is None:
        raise ValueError("prefill: q_start is required")
    if mass not in MASS_KINDS:
        raise ValueError(f"mass must be one of {MASS_KINDS}, got {mass!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if sm_scale is not None and not isinstance(sm_scale, (int, float)):
        raise ValueError(f"sm_scale must be a Python number (static), got {type(sm_scale)}")
