"""The root of kvquota's error hierarchy, and the errors of the presets.

It lives in `configs/`, the lowest layer, so that the format and model presets (imported by
`kernels/` and by `kvquota/`) raise errors of the same hierarchy as the state API;
`kvquota.errors` re-exports everything here.
"""


class KVQuotaError(ValueError):
    """Base class of every typed error raised by kvquota (presets, kernels' formats, state API,
    model, weights, tokenizer). A ValueError, so callers can also catch broadly."""


class ConfigError(KVQuotaError):
    """A static config (StateConfig, a model shape, a KV layout) with a size or option outside
    its range: the message names the field and the rule."""


class UnknownModelError(KVQuotaError):
    """A model preset name that is not registered."""


class UnknownFormatError(KVQuotaError):
    """A KV format name that is not registered."""


class FormatSpecError(KVQuotaError):
    """A format's layout does not fit the model shape (e.g. head_dim not a multiple of its
    quantization group)."""
