r"""Generation on the paged KV cache.

  python -m experiments.generate --model=smollm2-135m --prompt="..." --max_new_tokens=N [--chat]

prints the continuation (with --chat, the prompt is wrapped in the model's chat template as a
user message). Greedy by default; --temperature > 0 samples, seeded by --seed. Everything is
checked before the weights load: the flags, and the prompt plus --max_new_tokens against the
preset's context.
"""

from __future__ import annotations

import json
import sys

from absl import flags

import kvquota as kq
from experiments import cli

FLAGS = flags.FLAGS


def define_flags():
    cli.define_model_source()
    flags.DEFINE_string("prompt", None, "The prompt text (not empty).", required=True)
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.", lower_bound=1)
    flags.DEFINE_boolean("chat", False, "Apply the model's chat template.")
    flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampling temperature.",
                       lower_bound=0.0)
    flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).",
                         lower_bound=0)
    flags.DEFINE_integer("seed", 0, "Sampling seed.", lower_bound=0)
    cli.define_json("Print one JSON object instead of the text.")


def run(model: str, prompt: str, max_new_tokens: int, *, chat: bool = False, weights_path=None,
        sampling: kq.Sampling = kq.Sampling(), kv_format: str = "f32",
        keep_recent: int | None = None,
        evict_policy: str | None = None, budget_tokens: int | None = None) -> dict:
    """Generates a continuation of `prompt` (the library call behind the CLI); the input is
    checked (cli.BadInput, a ValueError) before the weights load."""
    if not prompt:
        raise cli.BadInput("--prompt is empty: nothing to continue")
    if max_new_tokens < 1:
        raise cli.BadInput(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    cli.check_model_source(model, weights_path)
    pool0, policy = cli.cache_policy(kv_format, keep_recent, evict_policy, budget_tokens)
    preset = kq.get_model_config(model)
    tok = kq.load_tokenizer(model, weights_path)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    if len(ids) + max_new_tokens > preset.max_context:
        raise cli.BadInput(f"the prompt ({len(ids):,} tokens) plus --max_new_tokens="
                           f"{max_new_tokens:,} exceed {model}'s context of "
                           f"{preset.max_context:,} tokens")
    cli.stage(f"loading {model}")
    config, params = kq.load_pretrained(model, weights_path)
    cli.stage(f"generating up to {max_new_tokens} tokens after a prompt of {len(ids)}")
    if policy.lossless:
        out = kq.generate(config, params, [ids], max_new_tokens, sampling=sampling,
                          stop_ids=tok.stop_ids(), kv_format=pool0)[0]
        held = None
    else:  # the policy applied after the prefill and after every decode step
        outs, held = kq.generate_streaming(config, params, [ids], max_new_tokens, policy,
                                           sampling=sampling, stop_ids=tok.stop_ids(),
                                           kv_format=pool0)
        out = outs[0]
    record = {
        "model": model,
        "prompt_ids": ids,
        "token_ids": out.tokens,
        "text": tok.decode(out.tokens),
        "finish": out.finish,
    }
    if held is not None:
        record["cache_bytes_by_pool"] = held
    return record


def main(argv):
    del argv
    record = run(FLAGS.model, FLAGS.prompt, FLAGS.max_new_tokens, chat=FLAGS.chat,
                 weights_path=FLAGS.weights, kv_format=FLAGS.kv_format,
                 keep_recent=FLAGS.keep_recent, evict_policy=FLAGS.evict_policy,
                 budget_tokens=FLAGS.budget_tokens,
                 sampling=kq.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.seed))
    if FLAGS.json:
        json.dump(record, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(record["text"])


if __name__ == "__main__":
    cli.run(main, define_flags)
