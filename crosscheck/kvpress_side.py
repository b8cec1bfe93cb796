"""The NVIDIA kvpress half of the kvpress cross-check (issue 46, item 3).

    .venv-kvpress/bin/python crosscheck/kvpress_side.py --request=REQ.json --out=OUT.npz

Run by `experiments/crosscheck_kvpress.py` inside its own environment (`make
crosscheck-kvpress`: torch, transformers, kvpress 0.5.5); it imports nothing of kvquota, and the
two sides exchange files only. The request (JSON) names the GGUF file, the documents' token ids
(our tokenizer's), the context length C and the presses; for each document and press this script

  * prefills the C context tokens under the press (`with press(model): model(ctx, cache)`, as
    kvpress's pipeline does), so kvpress prunes each layer's cache at the end of its prefill;
  * reads which positions each (layer, KV head) kept by matching the pruned cache's keys to the
    keys of an unpressed prefill (kvpress gathers the kept keys in score order, not position
    order), and keeps the press's own scores (its `score` method, captured as `compress` calls
    it);
  * teacher-forces the next T tokens on the pruned cache at positions C..C+T-1 (the pipeline's
    `position_ids`) and records -log p of each continuation token from the one before it.

Output: OUT.npz with, per condition key "<press>@<budget>", `<key>/kept` bool[n, L, Hkv, C],
`<key>/scores` f32[n, L, Hkv, C] and `<key>/nll` f32[n, T-1], plus `full/nll` (no press); and
OUT.json with the versions, the model's shapes and each press's repr.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars: noise in a log

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import kvpress

# Our method names -> the kvpress press, built from the compression ratio (1 - budget).
PRESSES = {
    "streamingllm": lambda ratio: kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4),
    "snapkv": lambda ratio: kvpress.SnapKVPress(compression_ratio=ratio, window_size=32,
                                                kernel_size=7),
    "knorm": lambda ratio: kvpress.KnormPress(compression_ratio=ratio),
    "tova": lambda ratio: kvpress.TOVAPress(compression_ratio=ratio),
}


def load_model(gguf: pathlib.Path):
    """HF transformers' model from the GGUF file (dequantized to float32), in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    return model.eval()


def prefill(model, context: torch.Tensor, press=None) -> DynamicCache:
    """The cache after the context's prefill, pruned by `press` when one is given."""
    cache = DynamicCache()
    if press is None:
        model(input_ids=context[None], past_key_values=cache)
    else:
        with press(model):
            model(input_ids=context[None], past_key_values=cache)
    return cache


def continuation_nll(model, cache: DynamicCache, continuation: torch.Tensor, start: int):
    """f32[T - 1]: -log p(continuation[j + 1]) from position j, on `cache`, positions from
    `start` (the context's length: the pruned cache is shorter than the positions it holds)."""
    positions = torch.arange(start, start + len(continuation))[None]
    logits = model(input_ids=continuation[None], past_key_values=cache,
                   position_ids=positions).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return -logp.gather(-1, continuation[1:, None])[:, 0].numpy()


def layer_keys(cache: DynamicCache) -> list[torch.Tensor]:
    """Each layer's cached keys, [Hkv, T, D] (batch 1)."""
    return [layer.keys[0] for layer in cache.layers]


def kept_positions(full: list[torch.Tensor], pruned: list[torch.Tensor]):
    """bool[L, Hkv, C]: which context positions each (layer, head) kept, found by matching each
    pruned key to the unpressed prefill's keys. Returns (kept, the largest match distance)."""
    kept = np.zeros((len(full), *full[0].shape[:2]), bool)
    worst = 0.0
    for layer, (f, p) in enumerate(zip(full, pruned)):
        # [Hkv, kept, C]; the direct form: the matmul form is off by ~1e-2 at these norms.
        distance = torch.cdist(p, f, compute_mode="donot_use_mm_for_euclid_dist")
        best = distance.min(dim=-1)
        worst = max(worst, float(best.values.max()))
        for head in range(f.shape[0]):
            index = best.indices[head].numpy()
            if len(set(index.tolist())) != len(index):
                raise RuntimeError(f"layer {layer} head {head}: two pruned keys match one key")
            kept[layer, head, index] = True
    return kept, worst


def capture_scores(press, n_layers: int):
    """Wraps the press's `score` so each layer's scores f32[Hkv, C] are kept in the returned
    list (kvpress's `compress` calls `self.score`)."""
    scores = [None] * n_layers
    score = press.score

    def recording(module, *args, **kwargs):
        out = score(module, *args, **kwargs)
        scores[module.layer_idx] = out[0].float().numpy()
        return out

    press.score = recording
    return scores


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--request", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args(argv)
    request = json.loads(args.request.read_text())
    unknown = [m for m in request["methods"] if m not in PRESSES]
    if unknown:
        parser.error(f"no kvpress press for {unknown}; known: {', '.join(PRESSES)}")
    torch.manual_seed(0)
    torch.set_num_threads(int(request.get("threads", 2)))
    model = load_model(pathlib.Path(request["gguf"]))
    c = int(request["context_tokens"])
    ids = [torch.tensor(doc, dtype=torch.long) for doc in request["ids"]]
    out: dict[str, np.ndarray] = {}
    record = {"versions": {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__")
                           else _version("kvpress"), "transformers": transformers.__version__,
                           "torch": torch.__version__, "numpy": np.__version__,
                           "gguf": _version("gguf"), "python": sys.version.split()[0]},
              "model": {k: getattr(model.config, k) for k in (
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "hidden_size", "head_dim", "rms_norm_eps", "rope_parameters", "dtype")
                  if hasattr(model.config, k)},
              "attn_implementation": model.config._attn_implementation,
              "presses": {}, "max_key_match_distance": 0.0}
    record["model"] = {k: str(v) if k == "dtype" else v for k, v in record["model"].items()}
    with torch.no_grad():
        full_keys, full_nll = [], []
        for doc in ids:
            cache = prefill(model, doc[:c])
            full_keys.append(layer_keys(cache))
            full_nll.append(continuation_nll(model, cache, doc[c:], c))
        out["full/nll"] = np.stack(full_nll)
        for method in request["methods"]:
            for budget in request["budgets"]:
                key = f"{method}@{budget:g}"
                kept, scores, nll = [], [], []
                for doc, keys in zip(ids, full_keys):
                    press = PRESSES[method](1.0 - budget)
                    captured = capture_scores(press, len(keys))
                    cache = prefill(model, doc[:c], press)
                    mask, worst = kept_positions(keys, layer_keys(cache))
                    record["max_key_match_distance"] = max(record["max_key_match_distance"],
                                                           worst)
                    kept.append(mask)
                    scores.append(np.stack(captured))
                    nll.append(continuation_nll(model, cache, doc[c:], c))
                record["presses"][key] = repr(press)
                out[f"{key}/kept"] = np.stack(kept)
                out[f"{key}/scores"] = np.stack(scores).astype(np.float32)
                out[f"{key}/nll"] = np.stack(nll)
                print(f"kvpress {key}: done", file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
