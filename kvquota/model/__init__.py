"""The Qwen2/Llama-family decoder on the paged cache, its weight loaders and its tokenizer."""

from kvquota.model.caches import ChunkMeta, DenseKV, PagedKV, PoolTables, init_dense_cache, pool_tables
from kvquota.model.decoder import Decoder, apply_rope, init_params, rope_tables
from kvquota.model.tokenizer import Tokenizer, from_gguf, from_hf_dir, load_tokenizer
from kvquota.model.weights import (
    cached_f32_gguf,
    gguf_architecture,
    load_gguf,
    load_pretrained,
    load_safetensors,
    load_smollm2,
    save_safetensors,
    smollm2_gguf_path,
)

__all__ = [
    "ChunkMeta", "Decoder", "DenseKV", "PagedKV", "PoolTables", "pool_tables", "apply_rope", "init_dense_cache", "init_params",
    "rope_tables", "Tokenizer", "from_gguf", "from_hf_dir", "load_tokenizer", "cached_f32_gguf",
    "gguf_architecture", "load_gguf", "load_pretrained", "load_safetensors", "load_smollm2",
    "save_safetensors", "smollm2_gguf_path",
]
