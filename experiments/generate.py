r"""Generation on the paged KV cache.

  python -m experiments.generate --model=smollm2-135m --prompt="..." --max_new_tokens=N [--chat]

prints the continuation (with --chat, the prompt is wrapped in the model's chat template as a
user message). Greedy by default; --temperature > 0 samples, seeded by --seed.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from kvquota import engine, tokenizer, weights

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model preset name.")
_WEIGHTS = flags.DEFINE_string(
    "weights", None, "A .gguf file or Hugging Face checkpoint dir (default: the packaged SmolLM2).")
_PROMPT = flags.DEFINE_string("prompt", None, "The prompt text.", required=True)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
_CHAT = flags.DEFINE_boolean("chat", False, "Apply the model's chat template.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampling temperature.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_KV_FORMAT = flags.DEFINE_string("kv_format", "f32", "KV page format (f32, bf16, ...).")
_JSON = flags.DEFINE_boolean("json", False, "Print one JSON object instead of the text.")


def run(model: str, prompt: str, max_new_tokens: int, *, chat: bool = False, weights_path=None,
        sampling: engine.Sampling = engine.Sampling(), kv_format: str = "f32") -> dict:
    """Generates a continuation of `prompt` (the library call behind the CLI)."""
    config, params = weights.load_pretrained(model, weights_path)
    tok = tokenizer.load_tokenizer(model, weights_path)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    out = engine.generate(config, params, [ids], max_new_tokens, sampling=sampling,
                          stop_ids=tok.stop_ids(), kv_format=kv_format)[0]
    return {
        "model": model,
        "prompt_ids": ids,
        "token_ids": out.tokens,
        "text": tok.decode(out.tokens),
        "finish": out.finish,
    }


def main(argv):
    del argv
    record = run(_MODEL.value, _PROMPT.value, _MAX_NEW.value, chat=_CHAT.value,
                 weights_path=_WEIGHTS.value, kv_format=_KV_FORMAT.value,
                 sampling=engine.Sampling(_TEMPERATURE.value, _TOP_K.value, _SEED.value))
    if _JSON.value:
        json.dump(record, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(record["text"])


if __name__ == "__main__":
    app.run(main)
