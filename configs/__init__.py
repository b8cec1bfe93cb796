"""Typed presets: model shapes and experiment settings."""

from configs.models import MODELS, ModelConfig, UnknownModelError, get_model_config
