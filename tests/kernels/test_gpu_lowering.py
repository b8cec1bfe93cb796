"""The Pallas kernel lowers to Triton IR for CUDA, checked on any machine.

`jax.export` lowers for a platform that is not present; for a Pallas GPU call that runs the whole
Pallas -> Triton (TTIR) lowering in Python, so an op the Triton lowering does not support, a
non-power-of-two block or a bad dot shape fails here without a GPU. (PTX compilation and the
numbers themselves still need the GPU: scripts/device_check.sh.)

The Triton lowering needs a target GPU. jax 0.10 falls back to compute capability 9.0 when no
GPU is present; jax 0.11 removed that fallback and takes the target from an abstract device
(`jax.sharding.AbstractDevice` in an abstract mesh) instead. Which of the two this jax can do is
probed once by lowering a one-line Pallas kernel (capability, not version); where neither works,
the tests skip with the reason, except on jax < 0.11, where lowering without a GPU must work.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.paged_attention import pallas_kernel as pk
from kernels.quantization import quantize_kv

TRITON_CALL = "xla.gpu.triton"
TARGET_GPU = "NVIDIA H200"  # the GPU of scripts/device_check.sh; compute capability 9.0


def _abstract_gpu():
    """A context in which lowering targets TARGET_GPU without one being present (jax >= 0.11)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    device = AbstractDevice(device_kind=TARGET_GPU, num_cores=1, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    return use_abstract_mesh(mesh)


def _export_for_cuda(fn, *args) -> str:
    exp = export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(f"__gpu${TRITON_CALL}")],
    )(*args)
    return exp.mlir_module()


def _probe_kernel(x):
    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    return pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=plgpu.CompilerParams())(x)


@functools.cache
def _lowering_context():
    """-> (context factory or None, what failed): how this jax lowers Pallas Triton for CUDA."""
    failures = []
    for how, context in (("without a GPU", contextlib.nullcontext),
                         (f"on an abstract {TARGET_GPU}", _abstract_gpu)):
        try:
            with context():
                text = _export_for_cuda(_probe_kernel, jax.ShapeDtypeStruct((16,), jnp.float32))
            if TRITON_CALL in text:
                return context, ()
            failures.append(f"{how}: no {TRITON_CALL} call in the module")
        except Exception as e:  # noqa: BLE001 - any failure means "cannot lower here"
            failures.append(f"{how}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return None, tuple(failures)


def _jax_before_0_11() -> bool:
    major, minor = (int(part) for part in jax.__version__.split(".")[:2])
    return (major, minor) < (0, 11)


@pytest.fixture(scope="module")
def cuda_lowering():
    context, failures = _lowering_context()
    if context is None:
        if _jax_before_0_11():
            pytest.fail(f"jax {jax.__version__} should lower for CUDA without a GPU: {failures}")
        pytest.skip(f"jax {jax.__version__} cannot lower a Pallas Triton call for CUDA on this "
                    f"machine ({jax.default_backend()}, no usable GPU target): "
                    + "; ".join(failures))
    return context


def test_lowering_capability_where_it_must_exist():
    """jax 0.10 lowers without a GPU, and any jax with a GPU present does: never a skip there."""
    context, failures = _lowering_context()
    if _jax_before_0_11() or jax.default_backend() == "gpu":
        assert context is not None, failures


@pytest.fixture
def lower_for_cuda(cuda_lowering):
    def lower(fn, *args) -> str:
        with cuda_lowering():
            return _export_for_cuda(fn, *args)

    return lower


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
def test_decode_with_mass_lowers_to_triton(lower_for_cuda, dtype, batch, blocks, cols):
    q, pages, tables, lengths = _shapes(dtype=dtype, batch=batch, blocks=blocks, cols=cols)
    text = lower_for_cuda(
        lambda q, k, v, t, l: pk.decode_pallas(q, k, v, t, l, mass="block"),
        q, pages, pages, tables, lengths)
    assert text.count(TRITON_CALL) == 2  # attention kernel + mass kernel


def test_prefill_lowers_to_triton(lower_for_cuda):
    q, pages, tables, lengths = _shapes(t=7, q_heads=9, kv_heads=3, d=64, page=8)
    text = lower_for_cuda(
        lambda q, k, v, t, l, s: pk.prefill_pallas(q, k, v, t, l, s, mass="token"),
        q, pages, pages, tables, lengths, lengths)
    assert text.count(TRITON_CALL) == 2


@pytest.mark.parametrize("name", ["int8", "int4", "kivi2", "kivi4"])
def test_quantized_decode_lowers_to_triton(lower_for_cuda, name):
    q, _, tables, lengths = _shapes()
    zeros = jnp.zeros((4, 64, 16, 128), jnp.float32)
    k, v = quantize_kv(zeros, zeros, name)
    k, v = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (k, v))
    text = lower_for_cuda(lambda q, k, v, t, l: pk.decode_pallas(q, k, v, t, l),
                           q, k, v, tables, lengths)
    assert text.count(TRITON_CALL) == 1


def test_decode_lowers_on_an_abstract_gpu():
    """The jax >= 0.11 route (an abstract target device) also works for our kernel on this jax,
    so the skip above only ever hides a jax that can do neither."""
    q, pages, tables, lengths = _shapes(batch=2, q_heads=8, kv_heads=2, d=64, blocks=8, cols=4)
    try:
        context = _abstract_gpu()
    except (ImportError, TypeError) as e:  # a jax without abstract devices
        pytest.skip(f"jax {jax.__version__} has no usable jax.sharding.AbstractDevice: {e}")
    with context:
        text = _export_for_cuda(lambda q, k, v, t, l: pk.decode_pallas(q, k, v, t, l),
                                q, pages, pages, tables, lengths)
    assert text.count(TRITON_CALL) == 1


@pytest.mark.parametrize("name", [None, "kivi4"])
def test_layered_pool_lowers_to_triton(lower_for_cuda, name):
    """A pool of every layer read at a traced layer (the model's scan index): the layer is an
    operand offsetting the page loads, with no layer slice outside the kernel."""
    q, pages, tables, lengths = _shapes()
    layers = 3
    if name is None:
        k = v = jax.ShapeDtypeStruct((layers, *pages.shape), pages.dtype)
    else:
        zeros = jnp.zeros(pages.shape, jnp.float32)
        k, v = quantize_kv(zeros, zeros, name)
        k, v = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct((layers, *a.shape), a.dtype), (k, v))
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    text = lower_for_cuda(
        lambda q, k, v, t, l, layer: pk.decode_pallas(q, k, v, t, l, mass="block", layer=layer),
        q, k, v, tables, lengths, layer)
    assert text.count(TRITON_CALL) == 2  # attention kernel + mass kernel
    assert "dynamic_slice" not in text  # the pool is passed whole, never sliced to a layer


def test_layered_prefill_lowers_to_triton(lower_for_cuda):
    q, pages, tables, lengths = _shapes(t=7, q_heads=9, kv_heads=3, d=64, page=8)
    pool = jax.ShapeDtypeStruct((2, *pages.shape), pages.dtype)
    text = lower_for_cuda(
        lambda q, k, v, t, l, s, layer: pk.prefill_pallas(q, k, v, t, l, s, layer=layer),
        q, pool, pool, tables, lengths, lengths, jax.ShapeDtypeStruct((), jnp.int32))
    assert text.count(TRITON_CALL) == 1
