"""The Azure LLM inference trace converter (issue 47 part 5): a small CSV in the trace's columns,
written here, becomes a JSONL trace that loads back and replays; bad files are typed errors."""

import numpy as np
import pytest

import kvquota as kq
from kvquota.sim import azure
from kvquota.sim import loadtest as lt

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,300,10
2023-11-16 18:15:46.1805900,40,0
2023-11-16 18:15:47.6805900,9000,5000
2023-11-16 18:15:49.1805900,64,32
"""


def test_rows_become_requests_in_arrival_order(tmp_path):
    src = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    src.write_text(CSV)
    trace = azure.convert_azure_csv(src, tmp_path / "t.jsonl", tenants=2, seed=3,
                                    context_max=4096, output_max=512, time_scale=2.0)
    got = [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace.requests]
    # sorted by time, gaps halved; 0 generated -> 1; 5000 -> output_max; the prompt clipped so
    # prompt + output fits context_max
    assert got == [(0.0, 40, 1), (pytest.approx(0.25), 300, 10),
                   (pytest.approx(0.75), 4096 - 512, 512), (pytest.approx(1.5), 64, 32)]
    assert [r.id for r in trace.requests] == [0, 1, 2, 3]
    assert {r.tenant for r in trace.requests} <= {0, 1}
    assert [t.quota_share for t in trace.tenants] == [0.6, 0.6]
    back = kq.sim.load_trace(tmp_path / "t.jsonl")
    assert back.requests == trace.requests and back.tenants == trace.tenants
    assert len(kq.sim.prompt_ids(back, back.requests[2])) == 4096 - 512


def test_a_converted_trace_replays_with_zero_drift(tmp_path):
    src = tmp_path / "a.csv"
    src.write_text(CSV.replace(",9000,5000", ",90,50"))
    made = azure.convert_azure_csv(src, tmp_path / "t.jsonl", tenants=2, output_max=64,
                                   context_max=700, events=[
                                       kq.sim.TraceEvent(0.7, "quota_cut", 0, 0.01)])
    cfg = lt.LoadConfig(blocks=256, max_seqs=8, max_blocks_per_seq=48, num_tenants=4,
                        token_budget=256, max_admit=4, prefill_rows=2, chunk_size=128,
                        replicas=1, tp=8)
    trace = kq.sim.load_trace(tmp_path / "t.jsonl")
    assert trace.events == made.events
    rp = lt.Replay(cfg, trace, "tiered")
    reqs = rp.run()
    kq.check_invariants(rp.sc, rp.sched.state)
    assert len(reqs) == 4 and all(d["bytes"] == 0 == d["tokens"] for d in rp.drift)
    assert [e["kind"] for e in rp.event_records()] == ["quota_cut"]


@pytest.mark.parametrize("text, message", [
    ("time,in,out\n1,2,3\n", "expected the header"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no request rows"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", "not a date"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,2\n", "integers"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,-1,2\n", ">= 0"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1\n", "3 columns"),
])
def test_bad_files_are_typed_errors_naming_the_line(tmp_path, text, message):
    src = tmp_path / "bad.csv"
    src.write_text(text)
    out = tmp_path / "never.jsonl"
    with pytest.raises(kq.errors.TraceFormatError, match=message):
        azure.convert_azure_csv(src, out)
    assert not out.exists()


def test_bad_arguments_are_typed():
    rows = [(0.0, 10, 2)]
    for kw in (dict(tenants=0), dict(time_scale=0), dict(tenant_weights=[1, 2]),
               dict(output_max=5000, context_max=4096)):
        with pytest.raises(kq.errors.InvalidArgumentError):
            azure.azure_trace(rows, **kw)
    w = azure.azure_trace([(float(i), 10, 2) for i in range(2000)], tenants=4,
                          tenant_weights=[4, 2, 1, 1], seed=1)
    share = np.bincount([r.tenant for r in w.requests], minlength=4) / 2000
    assert np.abs(share - [0.5, 0.25, 0.125, 0.125]).max() < 0.05
