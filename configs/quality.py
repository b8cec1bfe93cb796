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
QUANT_METHODS = ("fp8", "int8", "int4", "kivi2", "kivi4")
EVICT_METHODS = ("streamingllm", "h2o", "snapkv", "tova", "knorm", "random")
TIERED_METHODS = ("tiered",)
METHODS = QUANT_METHODS + EVICT_METHODS + TIERED_METHODS
CONTROL = "none"  # the untouched cache run again: every difference from the reference must be 0


class UnknownPresetError(KVQuotaError):
    """A quality preset name that is not registered, or a preset whose sizes do not fit."""


@dataclasses.dataclass(frozen=True)
class QualityPreset:
    """One sweep of the quality experiment.

    Attributes:
      name: preset name.
      num_docs: documents (windows of the text) scored; fewer when the text is too short for
        them, but at least `min_docs`.
      min_docs: the fewest documents a run accepts.
      context_tokens: C, tokens prefilled before the means runs.
      continuation_tokens: T, tokens teacher-forced after it (T - 1 of them are predicted).
      block_size: tokens per KV block (the unit of bytes freed).
      window: W, the newest context tokens every method keeps in full precision: the KIVI
        residual window of the quantizers, the recent window of the eviction policies and the
        observation window whose decode-step attention H2O, SnapKV and TOVA score on.
      budgets: kept fraction of the context's tokens for the eviction policies (each layer and
        KV head keeps its own tokens: variant "oneshot").
      global_budgets: budgets (of `budgets`) at which the eviction policies also run with one
        kept set for the whole model, scored on the statistics summed over layers and heads
        (variant "global": what this project did before per-head selection).
      methods: the methods run (names of METHODS).
      streaming: also run the quantizers compressing as the cache fills.
      passkey_probes: passkey probes (a key hidden in filler text, asked at the end).
      passkey_depths: depths (fraction of the filler before the key) the probes cycle through.
      probe_context: tokens of a probe's context (filler and key, or the chat's turns).
      chat_probes: multi-turn chat probes (a fact told in the first turn, asked in the last).
      probe_budgets: eviction budgets the probes run at (the quantizers run once).
      tiered_targets: byte quota of each document's tenant after the cut, as a fraction of its
        bytes before (the `tiered` method).
      bootstrap: resamples of the 95 % bootstrap intervals over documents.
      seed: seed of the bootstrap, of the `random` policy and of the probes' keys.
    """

    name: str
    num_docs: int
    context_tokens: int
    continuation_tokens: int
    min_docs: int = 1
    block_size: int = 16
    window: int = 32
    budgets: tuple[float, ...] = (0.25, 0.5, 0.75)
    global_budgets: tuple[float, ...] = (0.5,)
    methods: tuple[str, ...] = METHODS
    streaming: bool = True
    passkey_probes: int = 24
    passkey_depths: tuple[float, ...] = (0.1, 0.25, 0.4, 0.55, 0.7, 0.85)
    probe_context: int = 448
    chat_probes: int = 12
    probe_budgets: tuple[float, ...] = (0.5,)
    tiered_targets: tuple[float, ...] = (0.25, 0.5, 0.75)
    bootstrap: int = 2000
    seed: int = 0

    def __post_init__(self):
        c, p, w = self.context_tokens, self.block_size, self.window
        for field in ("num_docs", "min_docs", "context_tokens", "block_size", "bootstrap"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise UnknownPresetError(f"{self.name}: {field} must be a positive integer")
        if self.continuation_tokens < 2:
            raise UnknownPresetError(f"{self.name}: continuation_tokens must be >= 2 (one "
                                     "token predicted from another)")
        if w < 1 or w % p or c < w + p or self.probe_context < w + p:
            raise UnknownPresetError(
                f"{self.name}: window {w} must be a positive multiple of block_size {p}, and "
                "each context at least one block longer than it")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise UnknownPresetError(f"{self.name}: unknown methods {unknown}; known: "
                                     f"{', '.join(METHODS)}")
        if not set(self.global_budgets) <= set(self.budgets):
            raise UnknownPresetError(f"{self.name}: global_budgets {self.global_budgets} must "
                                     f"be among the budgets {self.budgets}")
        for what in ("budgets", "global_budgets", "probe_budgets", "tiered_targets"):
            values = getattr(self, what)
            if any(not 0 < f < 1 for f in values) or list(values) != sorted(set(values)):
                raise UnknownPresetError(f"{self.name}: {what} must be increasing fractions "
                                         f"in (0, 1), got {values}")
        if any(f * c < w for f in self.budgets):
            raise UnknownPresetError(f"{self.name}: every budget must keep at least the "
                                     f"window of {w} tokens of {c}")
        if any(not 0 < d < 1 for d in self.passkey_depths) or not self.passkey_depths:
            raise UnknownPresetError(f"{self.name}: passkey depths must be in (0, 1)")


PRESETS: dict[str, QualityPreset] = {p.name: p for p in (
    # The tests' preset (seconds on a tiny model; also runs on SmolLM2 in well under a minute).
    QualityPreset(name="tiny", num_docs=3, context_tokens=48, continuation_tokens=16,
                  block_size=8, window=8, budgets=(0.25, 0.5, 0.75), passkey_probes=2,
                  passkey_depths=(0.25, 0.5), probe_context=256, chat_probes=1,
                  tiered_targets=(0.25, 0.5), bootstrap=200),
    # Any text of >= 500 tokens, every method, in under two minutes on two cores.
    QualityPreset(name="quick", num_docs=4, context_tokens=384, continuation_tokens=96,
                  budgets=(0.25, 0.5), passkey_probes=2, chat_probes=2,
                  passkey_depths=(0.3, 0.7), probe_context=384,
                  tiered_targets=(0.5,), streaming=False, bootstrap=1000),
    # The committed sweep (results/quality): under ten minutes on two cores.
    QualityPreset(name="default", num_docs=16, min_docs=16, context_tokens=512,
                  continuation_tokens=96, budgets=(0.125, 0.25, 0.5, 0.75), chat_probes=8),
)}


def get_quality_preset(name: str) -> QualityPreset:
    """The preset called `name`, or UnknownPresetError listing the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(f"unknown quality preset {name!r}; valid choices: "
                                 f"{', '.join(PRESETS)}") from None
