"""RULER-style synthetic retrieval tasks, generated offline at run time (Hsieh et al., 2024,
"RULER: What's the Real Context Size of Your Long-Context Language Models?"; the task kinds
and the shape of their prompts follow the paper's; the code and the wording of the templates
are this project's).

Every probe is a context of exactly `length` tokens: filler text with the task's statements
inserted at depths drawn uniformly in (0, 1), and the QUESTION AT THE END OF THE CONTEXT (inside
what the means compresses, so a question-aware method such as SnapKV can use it); the
continuation is the answer's lead and the answer, teacher-forced, and the answer's tokens are
scored (a probe is retrieved when every one of them is the model's top-1). Pieces are encoded
separately and concatenated, so the answer's tokens in the continuation are exactly the tokens
that state it in the context (`needle`: their context indices).

* single_needle (RULER's NIAH single): one "special magic number" for a key.
* multikey_needle (NIAH multi-key): four keys, each with its number; one is asked for.
* multivalue (NIAH multi-value): four numbers for one key; all are asked for, in the order
  the context states them.
* variable_tracking (VT): a chain X1 = v, X2 = X1, ... of five assignments scattered in the
  filler; asked which variables hold v, answered in chain order.
* common_words (CWE): a numbered list of words, ten of them 30 times more frequent than the
  rest; asked for the ten, answered in order of first appearance (no filler, no depth, no
  single place that states the answer: `needle` is empty).
"""

from __future__ import annotations

import dataclasses

import numpy as np

NUMBER_DIGITS = 7  # RULER's magic numbers have seven digits
KEYS = ("apple", "river", "candle", "falcon", "marble", "harbor", "violet", "copper", "meadow",
        "lantern", "glacier", "orchid", "saddle", "thunder", "pepper", "willow", "basket",
        "cobalt", "ember", "quartz")
WORDS = ("table", "garden", "window", "silver", "forest", "pencil", "rocket", "button",
         "island", "ladder", "mirror", "engine", "blanket", "castle", "feather", "guitar",
         "helmet", "jacket", "kettle", "lemon", "magnet", "needle", "oyster", "pillow",
         "ribbon", "saucer", "tunnel", "umbrella", "velvet", "wagon", "anchor", "barrel",
         "cactus", "dragon", "eagle", "fabric", "goblet", "hammer", "igloo", "jungle")


@dataclasses.dataclass
class Probe:
    """One task probe, in tokens.

    context: the filler, the statements and the question (len = the requested length).
    continuation: the answer's lead and the answer (teacher-forced after the means).
    scored: bool[len(continuation)]: continuation tokens that are the answer's.
    needle: context indices of the tokens that state the answer (empty for common_words).
    question_at: context index where the question starts (SnapKV-noq's window ends there).
    depths: the drawn depth of each statement (fraction of the filler before it).
    placed: (context index, tokens) of each statement, in context order.
    """

    kind: str
    context: list
    continuation: list
    scored: np.ndarray
    needle: tuple
    question_at: int
    depths: tuple
    answer: str
    placed: tuple = ()


def _number(rng) -> str:
    return str(int(rng.integers(10 ** (NUMBER_DIGITS - 1), 10 ** NUMBER_DIGITS)))


def _place(filler, statements, length, question, rng):
    """Filler cut to fit `length` with the statements (token lists, each with the relative
    indices of its answer tokens) inserted at uniform depths in the given order, then the
    question. Returns (context, answer indices of each statement, depths, question_at,
    (start, length) of each statement)."""
    room = length - sum(len(s) for s, _ in statements) - len(question)
    if room < 1:
        raise ValueError(f"a task context of {length} tokens has no room for its statements")
    if len(filler) < room:
        raise ValueError(f"the filler has {len(filler)} tokens, fewer than the {room} needed")
    start = int(rng.integers(0, len(filler) - room + 1))
    body = list(filler[start:start + room])
    depths = np.sort(rng.uniform(0.0, 1.0, len(statements)))
    context, spans, placed, at = [], [], [], 0
    for (tokens, answer_at), depth in zip(statements, depths):
        cut = int(round(depth * room))
        context += body[at:cut]
        at = cut
        spans.append([len(context) + j for j in answer_at])
        placed.append((len(context), len(tokens)))
        context += tokens
    context += body[at:]
    question_at = len(context)
    return (context + list(question), spans, tuple(float(d) for d in depths), question_at,
            tuple(placed))


def _visible(tok, ids) -> list[bool]:
    """Which tokens show a character (a token of spaces alone is not part of an answer: the
    model may as well put a newline there)."""
    return [bool(tok.decode([t]).strip()) for t in ids]


def _statement(tok, head, value, tail):
    """(tokens of head + value + tail, indices of the value's visible tokens)."""
    a, v, b = tok.encode(head), tok.encode(value), tok.encode(tail)
    return a + v + b, [len(a) + j for j, shown in enumerate(_visible(tok, v)) if shown]


def _answer(tok, lead, values, sep=""):
    """(continuation tokens, scored mask): the lead, then each value (the same tokens as where
    the context states it; its visible ones scored) joined by `sep`."""
    tokens = list(tok.encode(lead))
    mask = [False] * len(tokens)
    for i, v in enumerate(values):
        if i and sep:
            s = tok.encode(sep)
            tokens += s
            mask += [False] * len(s)
        t = tok.encode(v)
        tokens += t
        mask += _visible(tok, t)
    return tokens, np.array(mask, bool)


def make_probe(kind: str, tok, filler, length: int, rng) -> Probe:
    """One probe of `kind` of `length` context tokens; `tok` the tokenizer (encode, decode),
    `filler` token ids, `rng` a numpy Generator (everything drawn from it)."""
    enc = tok.encode
    keys = [str(k) for k in rng.choice(KEYS, 4, replace=False)]
    if kind in ("single_needle", "multikey_needle", "multivalue"):
        n_keys, n_values = {"single_needle": (1, 1), "multikey_needle": (4, 1),
                            "multivalue": (1, 4)}[kind]
        pairs = [(k, _number(rng)) for k in keys[:n_keys] for _ in range(n_values)]
        order = rng.permutation(len(pairs))  # the asked key is not always the first stated
        pairs = [pairs[i] for i in order]
        asked = keys[0]
        statements = [_statement(tok, f"\nOne of the special magic numbers for {k} is:",
                                 f" {v}", ".\n") for k, v in pairs]
        what = "numbers" if n_values > 1 else "number"
        asks = "are all the special magic numbers" if n_values > 1 else \
            "is the special magic number"
        question = enc(f"\nWhat {asks} for {asked} mentioned in the provided text?")
        values = [f" {v}" for k, v in pairs if k == asked]
        lead = f"\nThe special magic {what} for {asked} mentioned in the provided text:"
        sep = ","
        keep = [i for i, (k, _) in enumerate(pairs) if k == asked]
    elif kind == "variable_tracking":
        value = _number(rng)
        names = [f"X{int(x)}" for x in rng.choice(np.arange(10, 100), 5, replace=False)]
        statements = [_statement(tok, "\nVAR", f" {names[0]}", f" = {value}\n")]
        statements += [_statement(tok, "\nVAR", f" {b}", f" = {a}\n")
                       for a, b in zip(names, names[1:])]
        question = enc(f"\nQuestion: Find all variables that are assigned the value {value} "
                       "in the text above.")
        values = [f" {n}" for n in names]
        lead = f"\nAnswer: The variables assigned the value {value} are:"
        sep = ""
        keep = list(range(len(statements)))
    elif kind == "common_words":
        return _common_words(tok, length, rng)
    else:
        raise ValueError(f"unknown task kind {kind!r}")
    context, spans, depths, question_at, placed = _place(filler, statements, length,
                                                         question, rng)
    needle = tuple(j for s in keep for j in spans[s])  # the asked statements' answer tokens
    continuation, scored = _answer(tok, lead, values, sep)
    return Probe(kind, context, continuation, scored, needle, question_at, depths,
                 "".join(values).strip(), placed)


def _common_words(tok, length, rng) -> Probe:
    """A numbered word list of at most `length` tokens with the question (short by less than
    one entry): ten common words r >= 3 times each (the largest r that fits), then as many
    rare words, once each, as still fit (at most 30), in a random order."""
    enc = tok.encode
    words = [str(w) for w in rng.permutation(WORDS)]
    common, rare = words[:10], words[10:]
    question = enc("\nQuestion: What are the 10 most common words in the above list?")
    lead = "\nAnswer: The 10 words that appear most often in the list are:"

    def pieces(seq):
        return [enc(f"\n{i + 1}. {w}") for i, w in enumerate(seq)]

    def fits(seq):
        return sum(len(x) for x in pieces(seq)) + len(question) <= length

    repeats = 3
    if not fits(common * repeats):
        raise ValueError(f"a common-words context of {length} tokens cannot hold ten words "
                         "three times each")
    while fits(common * (repeats + 1)):
        repeats += 1
    k = 0
    while k < len(rare) and fits(common * repeats + rare[:k + 1]):
        k += 1
    seq = [str(w) for w in rng.permutation(common * repeats + rare[:k])]
    while not fits(seq):  # numbering of another order can take a token more: drop a rare one
        seq.remove(next(w for w in reversed(seq) if w in rare))
    context = [t for x in pieces(seq) for t in x]
    question_at = len(context)
    context += question
    seen = list(dict.fromkeys(w for w in seq if w in common))
    continuation, scored = _answer(tok, lead, [f" {w}" for w in seen], ",")
    return Probe("common_words", context, continuation, scored, (), question_at, (),
                 ",".join(seen))


def make_probes(kinds, per_kind: int, tok, filler, length: int, seed: int) -> list[Probe]:
    """`per_kind` probes of each kind, drawn from one seeded generator per kind and length (a
    kind's probes do not change when another kind is added)."""
    out = []
    for k, kind in enumerate(kinds):
        rng = np.random.default_rng([seed, length, k])
        out += [make_probe(kind, tok, filler, length, rng) for _ in range(per_kind)]
    return out
