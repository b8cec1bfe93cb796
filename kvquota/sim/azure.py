"""A converter from the Azure LLM inference trace's CSV to the load test's JSONL trace format.

The Azure public traces (github.com/Azure/AzurePublicDataset: `AzureLLMInferenceTrace_code.csv`
and `_conv.csv`, 2023, Patel et al., "Splitwise", ISCA 2024; the 2024 week-long traces of
Stojkovic et al., "DynamoLLM", HPCA 2025) have one row per request and three columns:

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,4808,10

(the arrival time, the prompt's tokens, the tokens generated). They carry no tenant, no session
and no token ids, so the conversion says what it adds (every choice an argument, recorded in
the trace header's `config`):

* arrival_s: seconds since the first row (rows are sorted by time; `time_scale` divides the
  gaps: 2.0 replays the trace twice as fast);
* tenants: `tenants` tenants, each request drawn by `tenant_weights` (default: equal) from
  `seed`, each with quota share oversubscription x its weight; no system prompt, private salts;
* prompt_tokens: ContextTokens clipped to [1, context_max - output]; output_tokens:
  GeneratedTokens clipped to [1, output_max] (the trace's rows of 0 generated tokens become 1);
* token ids: regenerated from (seed, request id) like a generated trace's (no prefix sharing);
* events: none unless given (`events`: `kvquota.sim.TraceEvent`s, e.g. a quota cut).

`convert_azure_csv(csv_path, out_path, ...)` writes the JSONL file (`kvquota.sim.save_trace`)
and returns the `Trace`; replay it with `python -m experiments.loadtest --trace=out.jsonl`.
"""

from __future__ import annotations

import csv
import datetime
from typing import Optional, Sequence

import numpy as np

from kvquota.errors import InvalidArgumentError, TraceFormatError
from kvquota.sim.trace_io import FORMAT, save_trace
from kvquota.sim.traces import TenantSpec, Trace, TraceEvent, TraceRequest

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
VOCAB = 152064  # Qwen2.5's vocabulary: the ids regenerated for the prompts


def _seconds(stamp: str, where: str) -> float:
    """Seconds since the epoch of "YYYY-MM-DD HH:MM:SS[.fffffff]" (7-digit fractions cut to
    microseconds, which `datetime` holds)."""
    text = stamp.strip()
    if "." in text:
        head, frac = text.split(".", 1)
        text = f"{head}.{(frac + '000000')[:6]}"
    try:
        t = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise TraceFormatError(f"{where}: TIMESTAMP {stamp!r} is not a date and time") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp()


def read_azure_csv(path) -> list[tuple[float, int, int]]:
    """[(arrival seconds since the epoch, context tokens, generated tokens)] of the CSV's rows,
    sorted by arrival (TraceFormatError naming the file and line on a bad header or row)."""
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != COLUMNS:
            raise TraceFormatError(f"{path}:1: expected the header {','.join(COLUMNS)}, got "
                                   f"{header!r}")
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            where = f"{path}:{line}"
            if len(row) != 3:
                raise TraceFormatError(f"{where}: expected 3 columns, got {len(row)}")
            try:
                context, generated = int(row[1]), int(row[2])
            except ValueError:
                raise TraceFormatError(f"{where}: token counts must be integers: {row[1:]}") \
                    from None
            if context < 0 or generated < 0:
                raise TraceFormatError(f"{where}: token counts must be >= 0: {row[1:]}")
            rows.append((_seconds(row[0], where), context, generated))
    if not rows:
        raise TraceFormatError(f"{path}: no request rows")
    rows.sort(key=lambda r: r[0])
    return rows


def azure_trace(rows: Sequence[tuple[float, int, int]], *, tenants: int = 1,
                tenant_weights: Optional[Sequence[float]] = None, oversubscription: float = 1.2,
                seed: int = 0, time_scale: float = 1.0, context_max: int = 32768,
                output_max: int = 4096, limit: Optional[int] = None,
                events: Sequence[TraceEvent] = (), source: str = "") -> Trace:
    """The `Trace` of `read_azure_csv` rows (the module docstring says what is added)."""
    if not (isinstance(tenants, int) and tenants >= 1) or time_scale <= 0 or \
            oversubscription <= 0 or output_max < 1 or context_max <= output_max:
        raise InvalidArgumentError(f"need tenants >= 1 ({tenants}), time_scale > 0 "
                                   f"({time_scale}), oversubscription > 0 ({oversubscription}),"
                                   f" 1 <= output_max ({output_max}) < context_max "
                                   f"({context_max})")
    w = np.ones(tenants) if tenant_weights is None else np.asarray(tenant_weights, float)
    if w.shape != (tenants,) or (w <= 0).any():
        raise InvalidArgumentError(f"tenant_weights: {tenants} positive numbers, got "
                                   f"{tenant_weights!r}")
    w = w / w.sum()
    rows = list(rows)[:limit]
    who = np.random.default_rng([seed, 3]).choice(tenants, size=len(rows), p=w)
    t0 = rows[0][0]
    requests = []
    for i, ((t, context, generated), tenant) in enumerate(zip(rows, who.tolist())):
        out = min(max(generated, 1), output_max)
        requests.append(TraceRequest(
            id=i, tenant=tenant, arrival_s=(t - t0) / time_scale, session=-1, turn=0,
            think_s=0.0, system=-1, prompt_tokens=min(max(context, 1), context_max - out),
            output_tokens=out))
    config = {"source": source or "azure-llm-inference-trace", "requests": len(requests),
              "seed": seed, "vocab_size": VOCAB, "groups": 0, "system_prompt_tokens": 0,
              "tenants": tenants, "tenant_weights": w.tolist(),
              "oversubscription": oversubscription, "time_scale": time_scale,
              "context_max": context_max, "output_max": output_max, "converted_by": FORMAT}
    specs = [TenantSpec(t, -1, min(1.0, oversubscription * float(w[t])), -1)
             for t in range(tenants)]
    return Trace(config, specs, requests, sorted(events, key=lambda e: e.time_s))


def convert_azure_csv(csv_path, out_path, **kwargs) -> Trace:
    """Read the Azure CSV at `csv_path`, write its JSONL trace at `out_path` (`azure_trace`'s
    keyword arguments), return the trace."""
    trace = azure_trace(read_azure_csv(csv_path), source=str(csv_path), **kwargs)
    save_trace(trace, out_path)
    return trace
