"""KV storage formats: bytes per block against hand arithmetic (head_dim 64, block 16 unless noted)."""

import jax.numpy as jnp
import pytest

from configs.errors import FormatSpecError, KVQuotaError
from configs.formats import KV_FORMATS, UnknownFormatError, get_kv_format
from kernels.quantization import empty_quantized_pages, quantize_pages

# Hand arithmetic for one KV head, one layer, block of 16 tokens, head_dim 64 (K page + V page).
#   bf16/f16: 2 x 16*64*2 = 4096            f32: 8192          fp8: 2048
#   int8:  data 16*64 = 1024, scales 16 tokens x 1 x 2 B = 32      -> 2 x 1056 = 2112
#   int4:  data 16*64/2 = 512, scales 16 tokens x 1 group x 2 B = 32 -> 2 x 544 = 1088
#   kivi2: K data 16*64/4 = 256 + per-channel scale and zero 64 x 4 B = 256 -> 512
#          V data 256 + per token 2 groups of 32 x 4 B = 16 x 2 x 4 = 128 -> 384; total 896
#   kivi4: K 512 + 256 = 768, V 512 + 128 = 640; total 1408
#   kivi2-g16 / kivi4-g16: the same pages (the key group G sets which tokens share the stored
#          scale, not how many are stored: every block keeps its copy)
HAND_BYTES_D64_P16 = {
    "f32": 8192, "bf16": 4096, "f16": 4096, "fp8": 2048,
    "int8": 2112, "int4": 1088, "kivi2": 896, "kivi4": 1408, "kivi2-g16": 896, "kivi4-g16": 1408,
}


def test_every_format_is_covered():
    assert set(HAND_BYTES_D64_P16) == set(KV_FORMATS)


@pytest.mark.parametrize("name", sorted(HAND_BYTES_D64_P16))
def test_block_bytes_by_hand(name):
    assert get_kv_format(name).head_block_bytes(16, 64) == HAND_BYTES_D64_P16[name]


@pytest.mark.parametrize(
    "name, fraction", [("int8", 0.516), ("int4", 0.266), ("kivi2", 0.219), ("kivi4", 0.344)]
)
def test_fraction_of_bf16_matches_issue(name, fraction):
    assert round(get_kv_format(name).fraction_of_bf16(16, 64), 3) == fraction


def test_head_dim_128_groups():
    # int4 at D=128: two groups of 64 per token -> data 16*128/2 = 1024, scales 16*2*2 = 64.
    assert get_kv_format("int4").key_page_bytes(16, 128) == 1088
    # int4 at D=32: the group is capped at head_dim -> one scale per token.
    assert get_kv_format("int4").key_page_bytes(16, 32) == 16 * 32 // 2 + 16 * 2
    # kivi2 keys at D=128, block 32: data 32*128/4 = 1024 + 128 channels x (scale+zero) 4 B.
    assert get_kv_format("kivi2").key_page_bytes(32, 128) == 1024 + 512
    # kivi4 values at D=128, block 8: data 8*128/2 = 512 + 8 tokens x 4 groups x 4 B = 128.
    assert get_kv_format("kivi4").value_page_bytes(8, 128) == 640


@pytest.mark.parametrize("name", ["int8", "int4", "kivi2", "kivi4"])
def test_array_layout_matches_page_bytes(name):
    """The pool arrays the kernels store must hold exactly the bytes the ledger charges."""
    fmt = get_kv_format(name)
    heads, blocks, block_size, head_dim = 3, 5, 16, 64
    for spec, page_bytes in ((fmt.key, fmt.key_page_bytes), (fmt.value, fmt.value_page_bytes)):
        data = 1
        for size in spec.data_shape(heads, blocks, block_size, head_dim):
            data *= size
        scales = 1
        for size in spec.scale_shape(heads, blocks, block_size, head_dim):
            scales *= size
        total = data + scales * 2 * (2 if spec.asymmetric else 1)
        assert total == heads * blocks * page_bytes(block_size, head_dim)


def test_unknown_format_names_the_choices():
    with pytest.raises(UnknownFormatError, match="bf16.*int8.*kivi4"):
        get_kv_format("int3")


# head_dim that no per-token scale group divides: int4 groups 64 channels, kivi values 32.
UNGROUPABLE = [("int4", "key", 96), ("int4", "value", 80), ("kivi2", "value", 48),
               ("kivi4", "value", 80)]


@pytest.mark.parametrize("name,role,head_dim", UNGROUPABLE)
def test_partial_scale_group_is_rejected_by_the_accounting(name, role, head_dim):
    """No ceil(D / group) scale count: the bytes charged would describe a layout that
    quantization cannot produce."""
    fmt = get_kv_format(name)
    spec = fmt.key if role == "key" else fmt.value
    page_bytes = fmt.key_page_bytes if role == "key" else fmt.value_page_bytes
    calls = [lambda: spec.num_scales(16, head_dim), lambda: spec.page_bytes(16, head_dim),
             lambda: spec.scale_shape(2, 3, 16, head_dim), lambda: page_bytes(16, head_dim),
             lambda: fmt.head_block_bytes(16, head_dim),
             lambda: fmt.fraction_of_bf16(16, head_dim)]
    for call in calls:
        with pytest.raises(FormatSpecError, match=f"head_dim {head_dim} .*scale group"):
            call()


@pytest.mark.parametrize("name,role,head_dim", UNGROUPABLE)
def test_partial_scale_group_is_rejected_by_quantization(name, role, head_dim):
    """The same check, the same typed error, on the quantizing side (and for empty pools)."""
    with pytest.raises(FormatSpecError, match=f"head_dim {head_dim} .*scale group"):
        quantize_pages(jnp.ones((1, 2, 16, head_dim)), name, role)
    with pytest.raises(FormatSpecError, match=f"head_dim {head_dim} .*scale group"):
        empty_quantized_pages(name, role, 1, 2, 16, head_dim)


def test_whole_groups_and_small_head_dims_are_accepted():
    # a multiple of the group, or at most one group (capped at head_dim)
    assert get_kv_format("int4").value.num_scales(16, 192) == 16 * 3
    assert get_kv_format("int4").value.num_scales(16, 48) == 16
    assert get_kv_format("kivi2").value.num_scales(16, 96) == 16 * 3
    assert get_kv_format("kivi2").key.num_scales(16, 48) == 48  # per channel: any head_dim


def test_codes_must_fill_whole_bytes():
    with pytest.raises(FormatSpecError, match="whole number of bytes at 2 bits"):
        get_kv_format("kivi2").key_page_bytes(16, 6)
    with pytest.raises(FormatSpecError, match="whole number of bytes at 4 bits"):
        quantize_pages(jnp.ones((1, 1, 16, 5)), "int4", "key")


def test_format_errors_are_kvquota_errors():
    assert issubclass(FormatSpecError, KVQuotaError) and issubclass(FormatSpecError, ValueError)
