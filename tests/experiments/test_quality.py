"""experiments.quality on the tiny preset and a tiny random Qwen2 checkpoint: the records'
invariants (bytes freed recomputed here from the block counts, the untouched cache exactly 0,
bytes freed monotone in the budget), the summary's JSON contract, files drawn from files, a
rerun byte-identical, the probes built as specified, and bad invocations refused in one line
before any weights load. The tiny preset runs twice in this process (the second run reuses the
compiled programs), through `execute`, the call behind the CLI."""

import concurrent.futures
import contextlib
import csv
import io
import json
import math

import numpy as np
import pytest

import kvquota as kq
from configs import quality as qc
from experiments import quality as q
from experiments import runs
from tests.experiments.common import TINY_MODEL, run_cli, tiny_checkpoint

SUMMARY_KEYS = ("budget_fraction", "bytes_freed", "delta_ppl", "delta_ppl_rel", "kl_mean",
                "top1_agreement", "retrieval_accuracy")
POINT_KEYS = ("method", "budget_fraction", "bytes_freed", "delta_ppl", "delta_ppl_rel",
              "kl_mean", "top1_agreement", "retrieval_accuracy")
PRESET = qc.get_quality_preset("tiny")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def twice(ckpt, tmp_path_factory):
    """Two runs of the tiny preset into two run roots: (summary, run dir, stdout) each."""
    root = tmp_path_factory.mktemp("runs")
    config = q.resolve("tiny", model=TINY_MODEL, model_dir=str(ckpt))
    out = []
    for name in ("first", "second"):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            summary = q.execute(config, runs_dir=str(root / name), print_json=True,
                                progress=False, out_dir=str(root / f"{name}_results"))
        run_dir = next((root / name).glob("quality-*"))
        out.append((summary, run_dir, buffer.getvalue()))
    return out


@pytest.fixture(scope="module")
def points(twice):
    return runs.read_points(twice[0][1])


def _state_config():
    """The bytes of one block in each pool of the experiment's states, from the library."""
    formats = tuple((f, 1) for f in qc.QUANT_METHODS)
    return kq.StateConfig(model=kq.get_model_config(TINY_MODEL), num_blocks=1,
                          block_size=PRESET.block_size, max_seqs=1, max_blocks_per_seq=1,
                          num_tenants=1, kv_format="f32", compressed_pools=formats)


def test_json_contract_last_line(twice):
    summary, _, stdout = twice[0]
    printed = json.loads(stdout.strip().splitlines()[-1])
    assert printed == json.loads(json.dumps(summary))
    assert set(printed["methods"]) == set(qc.METHODS) | {qc.CONTROL}
    for rows in printed["methods"].values():
        for row in rows:
            assert all(key in row for key in SUMMARY_KEYS), row
    for key in ("versions", "device", "seed", "git_commit", "config", "command"):
        assert key in printed
    assert "time_utc" not in printed and "load_average_1_5_15" not in printed["device"]
    assert printed["skipped"] == {} and printed["control_exact"] is True
    assert printed["documents"] == PRESET.num_docs
    assert printed["probes"] == {"passkey": PRESET.passkey_probes, "chat": PRESET.chat_probes}


def test_every_record_carries_the_fields(points):
    kinds = {"text", "passkey", "chat"}
    assert {p["kind"] for p in points} == kinds
    for p in points:
        assert all(key in p for key in POINT_KEYS), p
        assert (p["delta_ppl"] is None) == (p["kind"] != "text")
        assert (p["retrieval_accuracy"] is None) == (p["kind"] == "text")
        assert 0.0 <= p["removed_mass"] <= 1.0 + 1e-6 and 0.0 <= p["compressed_mass"] <= 1.0
        if p["method"] in qc.EVICT_METHODS:
            assert p["removed_mass"] > 0 and p["compressed_mass"] == 0
        if p["method"] in qc.QUANT_METHODS:
            assert p["compressed_mass"] > 0 and p["removed_mass"] == 0
        if p["kind"] != "text":  # where the context states the answer: cached or evicted
            assert 0.0 <= p["answer_kept"] <= 1.0
            assert p["answer_kept"] == 1.0 or p["method"] in qc.EVICT_METHODS


def test_bytes_freed_equal_the_ledger_change_recomputed_from_block_counts(points):
    sc = _state_config()
    pb = dict(zip(sc.precisions, sc.pool_bytes))
    c, p, w = PRESET.context_tokens, PRESET.block_size, PRESET.window
    text = [x for x in points if x["kind"] == "text"]
    held = math.ceil(c / p)  # 6 blocks of 8 tokens after the 48-token context
    squeezed = (c - w) // p  # full blocks wholly outside the 8-token window: 5
    for x in text:
        assert x["bytes_before"] == held * pb["f32"]
        assert x["bytes_freed"] == x["bytes_before"] - x["bytes_after"]
        assert x["budget_bytes"] == x["bytes_after"]
        m = x["method"]
        if m == qc.CONTROL:
            want = x["bytes_before"]
        elif m in qc.QUANT_METHODS:
            fmt = kq.get_kv_format(m)  # KIVI compresses whole key groups (G = 32: 4 blocks)
            group = fmt.key.pages_per_group(p) if fmt.quantized else 1
            n = squeezed // group * group
            want = (held - n) * pb["f32"] + n * pb[m]
            assert x["budget_fraction"] == pytest.approx(want / x["bytes_before"], abs=1e-9)
        elif m in qc.EVICT_METHODS:
            keep = max(round(x["budget"] * c), w)
            assert x["budget_tokens"] == keep
            want = math.ceil(keep / p) * pb["f32"]  # survivors packed into full blocks
        else:  # tiered: preempted (all back), or k blocks compressed into int8
            assert x["fate"] in ("preempted", "compressed"), x["fate"]
            if x["fate"] == "preempted":
                want = 0
            else:
                k = (x["bytes_before"] - x["bytes_after"]) // (pb["f32"] - pb["int8"])
                want = (held - k) * pb["f32"] + k * pb["int8"]
                assert 1 <= k <= squeezed and want <= x["budget"] * x["bytes_before"]
        assert x["bytes_after"] == want, (m, x["budget"])


def test_the_untouched_cache_gives_exactly_zero(points):
    control = [x for x in points if x["method"] == qc.CONTROL]
    assert len(control) == PRESET.num_docs + PRESET.passkey_probes + PRESET.chat_probes
    for x in control:
        if x["kind"] == "text":
            assert x["delta_ppl"] == 0.0 and x["delta_ppl_rel"] == 0.0
            assert x["kl_mean"] == 0.0 and x["kl_p90"] == 0.0 and x["kl_p99"] == 0.0
            assert x["top1_agreement"] == 1.0 and x["ppl"] == x["ppl_full"]
        assert x["bytes_freed"] == 0 and x["removed_mass"] == 0 and x["compressed_mass"] == 0
    lossy = [x for x in points if x["kind"] == "text" and x["method"] in ("int4", "kivi2")]
    assert all(x["kl_mean"] > 0 for x in lossy)  # the metric can tell a difference


def test_bytes_freed_are_monotone_in_the_budget(points):
    text = [x for x in points if x["kind"] == "text"]
    for m in qc.EVICT_METHODS + qc.TIERED_METHODS:
        for doc in range(PRESET.num_docs):
            mine = sorted((x["budget"], x["bytes_freed"]) for x in text
                          if x["method"] == m and x["item"] == doc)
            freed = [b for _, b in mine]
            assert len(freed) >= 2 and freed == sorted(freed, reverse=True), (m, mine)


def test_a_rerun_gives_a_byte_identical_metrics_file(twice):
    (_, first, _), (_, second, _) = twice
    assert first != second
    a, b = ((d / "metrics.json").read_bytes() for d in (first, second))
    commits = [runs.read_config(d)["git_commit"] for d in (first, second)]
    if commits[0] != commits[1]:  # another session committed between the runs: same bytes
        a, b = (json.dumps({k: v for k, v in json.loads(x).items()  # but the commit's
                            if k not in ("git_commit", "git_dirty")}).encode() for x in (a, b))
    assert a == b
    assert (first / q.CSV_NAME).read_bytes() == (second / q.CSV_NAME).read_bytes()


def test_csv_plots_and_exported_results(twice, tmp_path):
    summary, run_dir, _ = twice[0]
    rows = list(csv.DictReader(open(run_dir / q.CSV_NAME)))
    assert len(rows) == sum(len(r) for r in summary["methods"].values())
    assert set(rows[0]) == set(q.CSV_COLUMNS)
    order = list(dict.fromkeys(r["method"] for r in rows))
    assert order == [qc.CONTROL, *qc.METHODS]  # not metrics.json's sorted keys
    for name in q.PLOTS:
        assert (run_dir / name).stat().st_size > 0, name
    # Plots come from the files alone.
    for name in (*q.PLOTS, q.CSV_NAME):
        (run_dir / name).unlink()
    assert sorted(runs.replot(run_dir)) == sorted(q.PLOTS)
    assert list(csv.DictReader(open(run_dir / q.CSV_NAME))) == rows
    results = run_dir.parent.parent / "first_results"
    assert (results / "metrics.json").read_bytes() == (run_dir / "metrics.json").read_bytes()
    assert "python -m experiments.quality" in (results / "command.txt").read_text()
    with pytest.raises(ValueError, match="--overwrite"):
        q.export(run_dir, results, overwrite=False)


def test_summary_means_and_intervals_come_from_the_points(twice, points):
    summary = twice[0][0]
    row = next(r for r in summary["methods"]["h2o"]
               if r["budget"] == 0.5 and r["variant"] == "oneshot")
    text = [x for x in points if x["method"] == "h2o" and x["budget"] == 0.5
            and x["variant"] == "oneshot" and x["kind"] == "text"]
    assert row["n_docs"] == len(text) == PRESET.num_docs
    assert row["delta_ppl"] == pytest.approx(np.mean([x["delta_ppl"] for x in text]), abs=1e-8)
    lo, hi = row["delta_ppl_ci"]
    assert lo <= row["delta_ppl"] <= hi
    probes = [x for x in points if x["method"] == "h2o" and x["budget"] == 0.5
              and x["variant"] == "oneshot" and x["kind"] != "text"]
    assert row["retrieval_accuracy"] == pytest.approx(
        np.mean([x["retrieval_accuracy"] for x in probes]))


def test_probes_are_built_as_specified(ckpt):
    tok = kq.load_tokenizer(TINY_MODEL, ckpt)
    filler = tok.encode(q.pydoc_text())[:20000]
    keys = set()
    for item in q.passkey_probes(tok, filler, PRESET):
        assert len(item.context) == PRESET.probe_context
        assert tok.decode(item.continuation).endswith(f"pass key is {item.answer}")
        # The scored predictions are exactly the key's digits.
        scored = [item.continuation[j + 1] for j in np.flatnonzero(item.scored)]
        assert tok.decode(scored) == item.answer
        text = tok.decode(item.context)
        at = text.index(f"The pass key is {item.answer}")
        assert abs(at / len(text) - item.depth) < 0.2
        assert tok.decode([item.context[j] for j in item.needle]) == item.answer * 2
        keys.add(item.answer)
    assert len(keys) == PRESET.passkey_probes
    (chat,) = q.chat_probes(tok, filler, PRESET)
    fact, question, _, answer = q.FACTS[0]
    assert fact in tok.decode(chat.context) and question in tok.decode(chat.continuation)
    assert abs(len(chat.context) - PRESET.probe_context) < PRESET.block_size
    scored = [chat.continuation[j + 1] for j in np.flatnonzero(chat.scored)]
    assert tok.decode(scored).strip() == answer.strip()
    assert tok.decode([chat.context[j] for j in chat.needle]).strip() == answer.strip()


def test_documents_are_disjoint_windows_spread_over_the_text():
    ids = list(range(1000))
    preset = qc.get_quality_preset("tiny")  # 3 documents of 48 + 16 tokens
    docs = q.documents(ids, preset, "t")
    starts = [d.context[0] for d in docs]
    assert starts == [0, 468, 936]
    assert all(d.context + d.continuation == ids[s:s + 64] for d, s in zip(docs, starts))
    with pytest.raises(ValueError, match="needs at least 16"):
        q.documents(ids, qc.get_quality_preset("default"), "t")


def test_an_ordering_that_fails_is_reported_with_its_numbers():
    row = dict(variant="oneshot", retrieval_accuracy=None)
    methods = {"int8": [dict(row, budget=None, delta_ppl_rel=0.02)],
               "kivi4": [dict(row, budget=None, delta_ppl=0.5)],
               "kivi2": [dict(row, budget=None, delta_ppl=0.4)],
               "streamingllm": [dict(row, budget=0.5, delta_ppl=0.3)],
               "random": [dict(row, budget=0.5, delta_ppl=0.2)]}
    got = q.orderings(methods)
    assert got["int8_rel_below_0.01"]["holds"] is False
    assert got["kivi4_best_le_kivi2_best"] == {"holds": False,
                                               "best_delta_ppl": {"kivi4": 0.5, "kivi2": 0.4}}
    assert got["streamingllm_below_random_near_0.5"]["holds"] is False
    assert got["attention_aware_retrieval_ge_streamingllm"]["holds"] is None  # not measured


# ---- the command line: refused in one line, before any weights load ------------------------

BAD = [
    (["--budgets=0.5,0.25"], "increasing fractions"),
    (["--budgets=1.5"], "increasing fractions"),
    (["--methods=int8,h3o"], "unknown methods ['h3o']"),
    (["--preset=huge"], "value should be one of"),
    (["--model=qwen2.5-7b"], "needs --model_dir"),
    (["--model_dir={missing}"], "no such directory"),
    (["--text_file={missing}"], "no such file"),
    (["--text_file={short}", "--preset=quick"], "needs at least 1"),
    (["--context_tokens=8", "--preset=quick"], "window 32"),
    (["stray"], "unexpected positional argument stray"),
]


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "short.txt").write_text("Too short to make one document.\n", encoding="utf-8")
    paths = dict(missing=tmp / "missing", short=tmp / "short.txt")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run_cli, "quality", *[a.format(**paths) for a in args],
                               f"--runs_dir={tmp / 'runs'}", cwd=tmp, timeout=120)
                   for args, _ in BAD]
        return [f.result() for f in futures]


@pytest.mark.parametrize("index", range(len(BAD)), ids=[" ".join(a) for a, _ in BAD])
def test_bad_invocations_fail_in_one_line(bad_runs, index):
    result, message = bad_runs[index], BAD[index][1]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert result.returncode == 2 and result.stdout == ""


@pytest.mark.slow
def test_cli_tiny_run_from_another_directory(ckpt, tmp_path):
    result = run_cli("quality", "--preset=tiny", f"--model={TINY_MODEL}",
                     f"--model_dir={ckpt}", "--json", f"--runs_dir={tmp_path / 'runs'}",
                     cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["control_exact"] is True and set(summary["methods"]) >= set(qc.METHODS)


def test_eviction_runs_per_head_and_with_one_set_for_the_whole_model(twice):
    """Every eviction method has its per-head rows (variant "oneshot") at every budget and a
    "global" row at each of the preset's global budgets, over the same documents."""
    summary = twice[0][0]
    for method in qc.EVICT_METHODS:
        rows = summary["methods"][method]
        assert sorted(r["budget"] for r in rows if r["variant"] == "oneshot") == \
            list(PRESET.budgets)
        glob = [r for r in rows if r["variant"] == "global"]
        assert [r["budget"] for r in glob] == list(PRESET.global_budgets)
        assert all(r["n_docs"] == PRESET.num_docs for r in glob)
