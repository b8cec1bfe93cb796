"""Typed presets (the lowest layer): model shapes, KV storage formats, the root error."""

from configs.errors import FormatSpecError, KVQuotaError, UnknownFormatError, UnknownModelError
from configs.formats import KV_FORMATS, KVFormat, QuantSpec, get_kv_format
from configs.models import MODELS, ModelConfig, get_model_config
from configs.quality import PRESETS as QUALITY_PRESETS
from configs.quality import QualityPreset, UnknownPresetError, get_quality_preset
