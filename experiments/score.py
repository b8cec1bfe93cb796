r"""Teacher-forced scoring of a text file on the paged KV cache.

  python -m experiments.score --model=smollm2-135m --text_file=F --max_tokens=N --json

prints one JSON object (other tools read it): `token_ids` (the text's tokens truncated to the
first N, as fed to the model), `nll` (natural-log negative log-likelihood of each token after the
first: len(token_ids) - 1 values) and `ppl` (exp of their mean), plus the run's settings. With
a compressed --kv_format (or --evict_policy) the text is scored one block at a time, the cache
compressed (or evicted) before each block attends, and the record adds `cache_bytes_by_pool`.

Everything is checked before the weights load: the flags, the text (at least 2 tokens, at most
the preset's context).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from absl import flags

import kvquota as kq
from experiments import cli

FLAGS = flags.FLAGS
MAX_BLOCK_SIZE = 1024  # one block's pages are allocated whole: 10^5 tokens per block is gigabytes


def define_flags():
    cli.define_model_source()
    flags.DEFINE_string("text_file", None, "UTF-8 text to score.", required=True)
    flags.DEFINE_integer("max_tokens", 512, "Score the first N tokens (0: all).", lower_bound=0)
    flags.DEFINE_integer("chunk_size", 256, "Prefill chunk length.", lower_bound=1)
    flags.DEFINE_integer("block_size", 16, "Tokens per KV block.", lower_bound=1,
                         upper_bound=MAX_BLOCK_SIZE)
    cli.define_json("Print one JSON object.")


def token_ids(tok, text: str, max_tokens: int, config, source: str = "the text") -> list[int]:
    """The tokens to score: `text` (not blank) encoded, truncated to `max_tokens` (0: all); raises
    cli.BadInput unless there are 2 to config.max_context of them."""
    ids = tok.encode(text)
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise cli.BadInput(f"{source} gives {len(ids)} token; scoring needs at least 2")
    if len(ids) > config.max_context:
        raise cli.BadInput(f"{source} gives {len(ids):,} tokens, more than {config.name}'s context "
                           f"of {config.max_context:,}; pass --max_tokens={config.max_context} "
                           "or fewer")
    return ids


def run(model: str, text: str, max_tokens: int, *, weights_path=None, chunk_size: int = 256,
        block_size: int = 16, kv_format: str = "f32", keep_recent: int | None = None,
        evict_policy: str | None = None, budget_tokens: int | None = None,
        source: str = "the text") -> dict:
    """The score record for `text` (the library call behind the CLI); the input is checked
    (cli.BadInput, a ValueError) before the weights load."""
    if max_tokens < 0:
        raise cli.BadInput(f"max_tokens must be >= 0 (0: all), got {max_tokens}")
    if not text.strip():
        raise cli.BadInput(f"{source} is empty: nothing to score")
    cli.check_model_source(model, weights_path)
    pool0, policy = cli.cache_policy(kv_format, keep_recent, evict_policy, budget_tokens,
                                     block_size)
    tok = kq.load_tokenizer(model, weights_path)
    ids = token_ids(tok, text, max_tokens, kq.get_model_config(model), source)
    cli.stage(f"loading {model}")
    config, params = kq.load_pretrained(model, weights_path)
    cli.stage(f"scoring {len(ids)} tokens")
    start = time.perf_counter()
    if policy.lossless:  # every position in full precision: chunked prefill
        result = kq.score(config, params, ids, chunk_size=chunk_size, block_size=block_size,
                          kv_format=pool0)
        held = None
    else:  # one block at a time, the policy applied before each block attends
        result, held = kq.score_streaming(config, params, ids, policy, block_size=block_size,
                                          kv_format=pool0)
    record = {
        "model": model,
        "num_tokens": len(ids),
        "token_ids": result.token_ids,
        "nll": [float(x) for x in result.nll],
        "ppl": result.ppl,
        "kv_format": kv_format,
        "block_size": block_size,
        "chunk_size": chunk_size if policy.lossless else block_size,
        "seconds": time.perf_counter() - start,
    }
    if not policy.lossless:
        record.update(keep_recent=policy.keep_recent, evict_policy=evict_policy,
                      budget_tokens=budget_tokens, pool0_format=pool0, cache_bytes_by_pool=held)
    return record


def main(argv):
    del argv
    cli.check_model_source(FLAGS.model, FLAGS.weights)
    path = pathlib.Path(FLAGS.text_file)
    text = path.read_text(encoding="utf-8")
    record = run(FLAGS.model, text, FLAGS.max_tokens, weights_path=FLAGS.weights,
                 chunk_size=FLAGS.chunk_size, block_size=FLAGS.block_size,
                 kv_format=FLAGS.kv_format, keep_recent=FLAGS.keep_recent,
                 evict_policy=FLAGS.evict_policy, budget_tokens=FLAGS.budget_tokens,
                 source=f"--text_file={path}")
    if FLAGS.json:
        json.dump(record, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"{record['model']}: {record['num_tokens']} tokens, ppl {record['ppl']:.4f} "
              f"({record['seconds']:.1f} s, paged cache, {record['kv_format']} pages)")


if __name__ == "__main__":
    cli.run(main, define_flags)
