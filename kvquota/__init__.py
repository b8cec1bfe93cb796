"""kvquota: a paged KV cache shared by tenants under quotas, as pure JAX transformations."""

from kvquota.accounting import Footprint, KVLayout, tenant_footprint
from kvquota.formats import (
    KV_FORMATS,
    KVFormat,
    QuantSpec,
    UnknownFormatError,
    get_kv_format,
)
from kvquota.sentinel import INVALID, is_invalid, is_valid
