"""Traces of multi-tenant workloads and the metadata-only load test (DESIGN.md §2 `sim/`)."""

# ---- traces: generation, token ids, summary; the JSONL format ------------------------------------
from kvquota.sim.trace_io import TraceFormatError, load_trace, save_trace, trace_summary
from kvquota.sim.traces import (
    TenantSpec,
    Trace,
    TraceConfig,
    TraceEvent,
    TraceRequest,
    generate_trace,
    prompt_ids,
    system_prompt_ids,
)

__all__ = [
    "TraceConfig", "TenantSpec", "TraceRequest", "TraceEvent", "Trace", "generate_trace",
    "prompt_ids", "system_prompt_ids", "trace_summary", "save_trace", "load_trace",
    "TraceFormatError",
]

# ---- the metadata-only load test: a trace replayed under each reclaim policy --------------------
from kvquota.sim import azure, figures, loadtest, loadtest_io, realcheck  # noqa: E402
from kvquota.sim.azure import convert_azure_csv  # noqa: E402
from kvquota.sim.figures import summarize  # noqa: E402
from kvquota.sim.loadtest import (  # noqa: E402
    POLICIES,
    CostConstants,
    LoadConfig,
    Replay,
    blocks_that_fit,
)

__all__ += ["azure", "convert_azure_csv", "figures", "loadtest", "loadtest_io", "realcheck", "POLICIES", "CostConstants", "LoadConfig",
            "Replay", "blocks_that_fit", "summarize"]
