"""Public decode/prefill entry points: validate, pick a backend, run.

`backend="auto"` runs the Pallas kernel on GPU and the plain-JAX reference elsewhere (Pallas on
CPU only interprets, far slower than XLA); `"pallas"` forces the kernel, interpreted off GPU.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from kernels.paged_attention import reference
from kernels.paged_attention.validation import validate


def resolve_backend(backend: str) -> str:
    """"auto" -> "pallas" on GPU, "reference" elsewhere."""
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return backend


def interpret_mode() -> bool:
    """Pallas GPU kernels lower only on GPU; everywhere else they run interpreted."""
    return jax.default_backend() != "gpu"


_STATIC = ("sm_scale", "mass", "chunk_pages", "pool_dot")
_decode_reference = jax.jit(reference.decode_reference, static_argnames=_STATIC)
_prefill_reference = jax.jit(reference.prefill_reference, static_argnames=_STATIC)


def _layer_kwargs(layer) -> dict:
    """No keyword at all without a layer, so those calls trace exactly as before layer= was."""
    return {} if layer is None else {"layer": jnp.asarray(layer, jnp.int32)}


def decode(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None, return_lse=False,
           mass=None, backend="auto", layer=None):
    """Paged decode attention: one query token per sequence.

    Args:
      q: [B, Hq, D] queries (Hq a multiple of Hkv).
      k_pages, v_pages: [Hkv, N, P, D] pages, or `kernels.quantization.QuantizedPages`; with
        `layer`, the pool of every layer, [L, Hkv, N, P, D] (QuantizedPages: arrays with a
        leading [L] axis).
      block_tables: i32[B, max_blocks]; entries past a sequence's length are never used (they
        may hold `kvquota.sentinel.INVALID`).
      lengths: i32[B] cached tokens per sequence (the query sits at position length - 1).
      sm_scale: logit scale, default 1/sqrt(D).
      return_lse: also return `AttentionAux` (lse [B, Hq]).
      mass: None, "block" ([B, Hkv, max_blocks]) or "token" ([B, Hkv, max_blocks * P]).
      backend: "auto", "pallas" or "reference".
      layer: None, or the layer (int, or i32[] traced allowed: a scan's loop index) of pools
        with a layer axis to attend over, as the call on `k_pages[layer]` would (the reference
        bitwise) without slicing the pool. A traced layer outside [0, L) is clamped.

    Returns:
      out [B, Hq, D] in q.dtype (zeros for length 0), or (out, AttentionAux) with return_lse/mass.
    """
    validate("decode", q, k_pages, v_pages, block_tables, lengths, mass=mass, backend=backend,
             sm_scale=sm_scale, layer=layer)
    if resolve_backend(backend) == "reference":
        out, aux = _decode_reference(q, k_pages, v_pages, block_tables, lengths,
                                     sm_scale=sm_scale, mass=mass, **_layer_kwargs(layer))
    else:
        from kernels.paged_attention import pallas_kernel
        out, aux = pallas_kernel.decode_pallas(q, k_pages, v_pages, block_tables, lengths,
                                               sm_scale=sm_scale, mass=mass,
                                               interpret=interpret_mode(),
                                               **_layer_kwargs(layer))
    return (out, aux) if (return_lse or mass is not None) else out


def prefill(q, k_pages, v_pages, block_tables, lengths, q_start, *, sm_scale=None,
            return_lse=False, mass=None, backend="auto", layer=None):
    """Chunked prefill over paged K/V: a chunk of T queries per sequence.

    The chunk's tokens sit at cache positions q_start .. lengths - 1 (their K/V already in the
    pages); row t attends to every cached position <= q_start + t. Rows t >= lengths - q_start
    are padding and give zeros (lse -inf).

    Args:
      q: [B, T, Hq, D]; q_start: i32[B]; the rest as in `decode`.
      return_lse: also return `AttentionAux` (lse [B, T, Hq]).
      mass: as in `decode`, summed over the chunk's valid query rows.
      layer: as in `decode`.

    Returns:
      out [B, T, Hq, D] in q.dtype, or (out, AttentionAux).
    """
    validate("prefill", q, k_pages, v_pages, block_tables, lengths, q_start, mass=mass,
             backend=backend, sm_scale=sm_scale, layer=layer)
    if resolve_backend(backend) == "reference":
        out, aux = _prefill_reference(q, k_pages, v_pages, block_tables, lengths, q_start,
                                      sm_scale=sm_scale, mass=mass, **_layer_kwargs(layer))
    else:
        from kernels.paged_attention import pallas_kernel
        out, aux = pallas_kernel.prefill_pallas(q, k_pages, v_pages, block_tables, lengths,
                                                q_start, sm_scale=sm_scale, mass=mass,
                                                interpret=interpret_mode(),
                                                **_layer_kwargs(layer))
    return (out, aux) if (return_lse or mass is not None) else out


