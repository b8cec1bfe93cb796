"""What every loader shares: the params type and the check of a checkpoint against a preset."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from configs.models import ModelConfig, get_model_config
from kvquota.errors import ConfigMismatchError

Params = dict[str, Any]


def check_preset(config: ModelConfig, preset: ModelConfig | None, source: str) -> ModelConfig:
    """Returns `preset` after checking that the checkpoint's shapes match it (max_context aside)."""
    if preset is None:
        return config
    fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("name",)]
    wrong = []
    for field in fields:
        got, want = getattr(config, field), getattr(preset, field)
        if field in ("rope_theta", "rms_eps"):
            same = np.isclose(got, want, rtol=1e-6, atol=0.0)
        else:
            same = got == want
        if not same:
            wrong.append(f"{field}: checkpoint {got!r} vs preset {want!r}")
    if wrong:
        raise ConfigMismatchError(
            f"{source} does not match preset {preset.name!r}: " + "; ".join(wrong)
        )
    return preset


def resolve_preset(preset: ModelConfig | str | None) -> ModelConfig | None:
    return get_model_config(preset) if isinstance(preset, str) else preset
