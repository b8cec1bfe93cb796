"""Paged attention over block tables: decode and chunked prefill, GQA, quantized pages.

Public API:
  decode, prefill                 the entry points (backend "auto" | "pallas" | "reference");
                                  `layer=` reads a pool of every layer [L, Hkv, N, P, D] at one
  AttentionAux                    lse and attention mass returned beside the output
  merge_attention                 merges per-pool results by log-sum-exp
  decode_reference, prefill_reference, dense_attention_reference   plain-JAX semantics
  QuantizedPages, quantize_pages, quantize_kv, dequantize_pages     (from kernels.quantization)
"""

from kernels.paged_attention.attention import decode, prefill, resolve_backend
from kernels.paged_attention.merge import merge_attention
from kernels.paged_attention.reference import (
    AttentionAux,
    decode_reference,
    dense_attention_reference,
    prefill_reference,
)
from kernels.quantization import (
    QuantizedPages,
    dequantize_pages,
    quantize_kv,
    quantize_pages,
)

__all__ = [
    "AttentionAux",
    "QuantizedPages",
    "decode",
    "decode_reference",
    "dense_attention_reference",
    "dequantize_pages",
    "merge_attention",
    "prefill",
    "prefill_reference",
    "quantize_kv",
    "quantize_pages",
    "resolve_backend",
]
