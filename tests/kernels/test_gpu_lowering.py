"""The Pallas kernel lowers to Triton IR for CUDA, checked on any machine.

`jax.export` lowers for a platform that is not present; for a Pallas GPU call that runs the whole
Pallas -> Triton (TTIR) lowering in Python, so an op the Triton lowering does not support, a
non-power-of-two block or a bad dot shape fails here without a GPU. (PTX compilation and the
numbers themselves still need the GPU: scripts/device_check.sh.)
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export

from kernels.paged_attention import pallas_kernel as pk
from kernels.quantization import quantize_kv

TRITON_CALL = "xla.gpu.triton"


def _lower_for_cuda(fn, *args) -> str:
    exp = export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(f"__gpu${TRITON_CALL}")],
    )(*args)
    return exp.mlir_module()


def _shapes(batch=2, t=None, q_heads=28, kv_heads=4, d=128, page=16, blocks=64, cols=16,
            dtype=jnp.bfloat16):
    q_shape = (batch, q_heads, d) if t is None else (batch, t, q_heads, d)
    return (jax.ShapeDtypeStruct(q_shape, dtype),
            jax.ShapeDtypeStruct((kv_heads, blocks, page, d), dtype),
            jax.ShapeDtypeStruct((batch, cols), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))


@pytest.mark.parametrize("dtype,batch,blocks,cols", [
    (jnp.bfloat16, 2, 64, 16),
    (jnp.float32, 3, 50, 13),  # nothing a power of two but the block dims
])
def test_decode_with_mass_lowers_to_triton(dtype, batch, blocks, cols):
    q, pages, tables, lengths = _shapes(dtype=dtype, batch=batch, blocks=blocks, cols=cols)
    text = _lower_for_cuda(
        lambda q, k, v, t, l: pk.decode_pallas(q, k, v, t, l, mass="block"),
        q, pages, pages, tables, lengths)
    assert text.count(TRITON_CALL) == 2  # attention kernel + mass kernel


def test_prefill_lowers_to_triton():
    q, pages, tables, lengths = _shapes(t=7, q_heads=9, kv_heads=3, d=64, page=8)
    text = _lower_for_cuda(
        lambda q, k, v, t, l, s: pk.prefill_pallas(q, k, v, t, l, s, mass="token"),
        q, pages, pages, tables, lengths, lengths)
    assert text.count(TRITON_CALL) == 2


@pytest.mark.parametrize("name", ["int8", "int4", "kivi2", "kivi4"])
def test_quantized_decode_lowers_to_triton(name):
    q, _, tables, lengths = _shapes()
    zeros = jnp.zeros((4, 64, 16, 128), jnp.float32)
    k, v = quantize_kv(zeros, zeros, name)
    k, v = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (k, v))
    text = _lower_for_cuda(lambda q, k, v, t, l: pk.decode_pallas(q, k, v, t, l),
                           q, k, v, tables, lengths)
    assert text.count(TRITON_CALL) == 1
