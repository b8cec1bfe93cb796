r"""Generation on the paged KV cache.

  python -m experiments.generate --model=smollm2-135m --prompt="..." --max_new_tokens=N [--chat]

prints the continuation (with --chat, the prompt is wrapped in the model's chat template as a
user message). Greedy by default; --temperature > 0 samples, seeded by --seed.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

import kvquota as kq

FLAGS = flags.FLAGS


def _define_flags():
    """Defined only when run as a program, so tests can import this module beside other
    experiments whose flags share names (absl forbids defining a flag twice)."""
    flags.DEFINE_string("model", "smollm2-135m", "Model preset name.")
    flags.DEFINE_string(
        "weights", None,
        "A .gguf file or Hugging Face checkpoint dir (default: the packaged SmolLM2).")
    flags.DEFINE_string("prompt", None, "The prompt text.", required=True)
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
    flags.DEFINE_boolean("chat", False, "Apply the model's chat template.")
    flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampling temperature.")
    flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_string("kv_format", "f32", "KV page format (f32, bf16, ...).")
    flags.DEFINE_boolean("json", False, "Print one JSON object instead of the text.")


def run(model: str, prompt: str, max_new_tokens: int, *, chat: bool = False, weights_path=None,
        sampling: kq.Sampling = kq.Sampling(), kv_format: str = "f32") -> dict:
    """Generates a continuation of `prompt` (the library call behind the CLI)."""
    config, params = kq.load_pretrained(model, weights_path)
    tok = kq.load_tokenizer(model, weights_path)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    out = kq.generate(config, params, [ids], max_new_tokens, sampling=sampling,
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
    try:
        record = run(FLAGS.model, FLAGS.prompt, FLAGS.max_new_tokens, chat=FLAGS.chat,
                     weights_path=FLAGS.weights, kv_format=FLAGS.kv_format,
                     sampling=kq.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.seed))
    except (OSError, ValueError, kq.WeightsError) as error:  # bad input: say it, exit 2
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.json:
        json.dump(record, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(record["text"])


if __name__ == "__main__":
    _define_flags()
    app.run(main)
