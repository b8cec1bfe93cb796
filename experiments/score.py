r"""Teacher-forced scoring of a text file on the paged KV cache.

  python -m experiments.score --model=smollm2-135m --text_file=F --max_tokens=N --json

prints one JSON object (other tools read it): `token_ids` (the text's tokens truncated to the
first N, as fed to the model), `nll` (natural-log negative log-likelihood of each token after the
first: len(token_ids) - 1 values) and `ppl` (exp of their mean), plus the run's settings.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

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
    flags.DEFINE_string("text_file", None, "UTF-8 text to score.", required=True)
    flags.DEFINE_integer("max_tokens", 512, "Score the first N tokens (0: all).")
    flags.DEFINE_integer("chunk_size", 256, "Prefill chunk length.")
    flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
    flags.DEFINE_string("kv_format", "f32", "KV page format (f32, bf16, ...).")
    flags.DEFINE_boolean("json", False, "Print one JSON object.")


def run(model: str, text: str, max_tokens: int, *, weights_path=None, chunk_size: int = 256,
        block_size: int = 16, kv_format: str = "f32") -> dict:
    """The score record for `text` (the library call behind the CLI)."""
    config, params = kq.load_pretrained(model, weights_path)
    tok = kq.load_tokenizer(model, weights_path)
    ids = tok.encode(text)
    if max_tokens:
        ids = ids[:max_tokens]
    start = time.perf_counter()
    result = kq.score(config, params, ids, chunk_size=chunk_size, block_size=block_size,
                          kv_format=kv_format)
    return {
        "model": model,
        "num_tokens": len(ids),
        "token_ids": result.token_ids,
        "nll": [float(x) for x in result.nll],
        "ppl": result.ppl,
        "kv_format": kv_format,
        "block_size": block_size,
        "chunk_size": chunk_size,
        "seconds": time.perf_counter() - start,
    }


def main(argv):
    del argv
    try:
        text = pathlib.Path(FLAGS.text_file).read_text(encoding="utf-8")
        record = run(FLAGS.model, text, FLAGS.max_tokens, weights_path=FLAGS.weights,
                     chunk_size=FLAGS.chunk_size, block_size=FLAGS.block_size,
                     kv_format=FLAGS.kv_format)
    except (OSError, ValueError, kq.WeightsError) as error:  # bad input: say it, exit 2
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.json:
        json.dump(record, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"{record['model']}: {record['num_tokens']} tokens, ppl {record['ppl']:.4f} "
              f"({record['seconds']:.1f} s, paged cache, {record['kv_format']} pages)")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
