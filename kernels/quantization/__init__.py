"""Quantized KV pages (the layout of `configs.formats`) and their quantize/dequantize helpers."""

from kernels.quantization.pages import (
    QuantizedPages,
    dequantize_pages,
    dequantize_tile,
    empty_quantized_pages,
    quantize_kv,
    quantize_pages,
    unpack_codes,
)

__all__ = [
    "QuantizedPages",
    "dequantize_pages",
    "dequantize_tile",
    "empty_quantized_pages",
    "quantize_kv",
    "quantize_pages",
    "unpack_codes",
]
