r"""Several hosts for real: the sharded state and model under `jax.distributed`, as processes.

  python -m experiments.multihost [--num_processes=2] [--devices_per_process=4] [--json]

starts `--num_processes` copies of this module on this machine, each a JAX process with
`--devices_per_process` CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count`), joined
by `jax.distributed.initialize` through a coordinator on localhost and gloo CPU collectives: the
code path of several hosts, the network being the loopback. On N real hosts each host starts its
own worker instead (`--process_id`, `--coordinator_address`: docs/multihost.md).

Every process runs the same program (SPMD) on one `kq.sharding.make_mesh(kv=..., seq=...)` over
the global device list, each "kv" group inside one process: on the model's real weights
(SmolLM2-135M by default) it registers three tenants (two share a system prompt), admits six
prompts in two batches (the second takes the shared prompt's blocks from the prefix cache), forks
two sequences, pins the shared prompt, prefills in chunks of 16 tokens and decodes
`--decode_steps` greedy steps of 8 rows; a fork is freed at a quarter of the steps, tenant A's
byte quota is cut at half (`plan_reclaim(..., "tiered")` -> `apply_plan`: its newest sequences
are suspended to the host pool and leave the batch; a row whose append the new quota refuses
leaves too) and the pin is dropped at three quarters.

The reference is the same program on one device, no mesh: process 0 runs it after the sharded
run, on its first local device, and broadcasts its greedy tokens, its state's metadata and the
digest of its reclaim plan (`multihost_utils.broadcast_one_to_all`). Every process then compares
its own copy of the sharded result, read from its own devices, with them: the tokens and every
non-page leaf of the state exactly, the reclaim plan's digest, and `check_invariants` on its
copy. The verdicts are gathered, and process 0 prints the summary (with --json one line, ending
the output). It also prices the collectives of the compiled decode step from its HLO: per kind,
the ops (`kq.sharding.collectives`), their runs and result bytes per step (an op in the loop over
layers runs once a layer), and the part whose device groups span processes.

Failures: the launcher polls its workers; the first one to fail fails the run (exit 1, one line
on stderr naming the process, its status and its last line of stderr; the workers' logs are kept
and named), the others are killed, and so are all of them at --timeout_s. Workers also die with
the launcher (Linux), and a worker whose peer died stops at jax's heartbeat or collective timeout.
--kill_process / --kill_at_step make one worker SIGKILL itself mid-decode (a test of that path).
A mismatch with the reference is a failure too (exit 1), after the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils

import kvquota as kq
from experiments import cli

ks = kq.sharding

FLAGS = flags.FLAGS
REPO = pathlib.Path(__file__).resolve().parent.parent
MODELS = ("smollm2-135m", "tiny-qwen", "tiny-qwen-untied")  # the last two: random weights
BLOCK = 16  # tokens per block
CHUNK = 16  # prefill chunk: one compiled prefill shape
ROWS = 8  # decode rows (= max_seqs): A0, A0 fork, A1, B0, B1, C0, C0 fork, C1
CHILD_ENV = "KVQUOTA_MULTIHOST_CHILD"  # set by the launcher: workers log tracebacks to its files
NOISE = re.compile(r"^\[Gloo\]|^I\d{4} |^\s*$")  # gloo chatter, absl INFO lines


def define_flags():
    flags.DEFINE_integer("num_processes", 2, "JAX processes (hosts).", lower_bound=1,
                         upper_bound=64)
    flags.DEFINE_integer("devices_per_process", 4, "Devices of each process (forced CPU "
                         "devices when this program starts the processes).", lower_bound=1,
                         upper_bound=64)
    flags.DEFINE_integer("kv", None, "Size of the mesh's \"kv\" axis (KV heads split): must "
                         "divide --devices_per_process (a group inside one process) and the "
                         "model's KV heads. Default: their greatest common divisor (1 for "
                         "SmolLM2's 3 KV heads on 4 devices). \"seq\" takes the rest.",
                         lower_bound=1)
    flags.DEFINE_integer("decode_steps", 32, "Greedy decode steps.", lower_bound=4,
                         upper_bound=256)
    flags.DEFINE_enum("model", "smollm2-135m", list(MODELS), "smollm2-135m runs on its "
                      "packaged weights; the tiny presets on random weights (a quick check of "
                      "the plumbing).")
    flags.DEFINE_integer("timeout_s", 600, "The whole run's limit in seconds; also jax's "
                         "initialization and CPU collective timeouts.", lower_bound=10,
                         upper_bound=86400)
    flags.DEFINE_integer("process_id", None, "Run one worker, this process's id, instead of "
                         "starting them all here (one per host; needs the coordinator).",
                         lower_bound=0)
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator, "
                        "for --process_id (default: $JAX_COORDINATOR_ADDRESS).")
    flags.DEFINE_string("pids_file", None, "Write the workers' pids here, one a line, as they "
                        "start (for tests and operators).")
    flags.DEFINE_integer("kill_process", None, "Testing: this worker SIGKILLs itself at "
                         "--kill_at_step.", lower_bound=0)
    flags.DEFINE_integer("kill_at_step", 1, "Testing: the decode step of --kill_process.",
                         lower_bound=0)
    cli.define_json("Print the summary as one JSON object (the last line of stdout).")


# ---- checks across flags (before anything starts) ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """The resolved command line: every process gets the same one."""

    num_processes: int
    devices_per_process: int
    kv: int
    seq: int
    decode_steps: int
    model: str
    timeout_s: int
    json: bool
    kill_process: int | None
    kill_at_step: int

    @property
    def devices(self) -> int:
        return self.num_processes * self.devices_per_process


def resolve(values) -> Setup:
    """The Setup of the parsed flags (`values`: name -> value); cli.BadInput on a bad mix."""
    n, d = values["num_processes"], values["devices_per_process"]
    heads = kq.get_model_config(values["model"]).num_kv_heads
    kv = values["kv"] if values["kv"] is not None else math.gcd(d, heads)
    if d % kv:
        raise cli.BadInput(f"--kv={kv} must divide --devices_per_process={d}: each \"kv\" group "
                           "of devices sits inside one process")
    if heads % kv:
        raise cli.BadInput(f"--kv={kv} must divide {values['model']}'s {heads} KV heads")
    pid = values["process_id"]
    if pid is not None and pid >= n:
        raise cli.BadInput(f"--process_id={pid} must be below --num_processes={n}")
    if values["kill_process"] is not None and values["kill_process"] >= n:
        raise cli.BadInput(f"--kill_process={values['kill_process']} must be below "
                           f"--num_processes={n}")
    if values["kill_at_step"] >= values["decode_steps"]:
        raise cli.BadInput(f"--kill_at_step={values['kill_at_step']} must be below "
                           f"--decode_steps={values['decode_steps']}")
    return Setup(n, d, kv, n * d // kv, values["decode_steps"], values["model"],
                 values["timeout_s"], values["json"], values["kill_process"],
                 values["kill_at_step"])


# ---- the program every process runs ------------------------------------------------------------

SYSTEM = ("You are the support assistant of a cloud provider. Answer every question in one "
          "short, complete sentence. Be precise and plain.")
QUESTIONS = {  # name: (tenant, question); batch 1 then batch 2 (which hits A0's prompt blocks)
    "A0": (0, "What is a KV cache?"), "C0": (2, "What does a byte quota limit?"),
    "C1": (2, "What is a lease?"),
    "A1": (0, "Why do long prompts use more memory?"), "B0": (1, "What is a prefix cache?"),
    "B1": (1, "What is paged attention?"),
}
A, B, C = 0, 1, 2


@dataclasses.dataclass
class Scenario:
    """The model, its weights on the host, the state's config and the prompts."""

    config: object
    params: object
    sc: object
    prompts: dict  # name -> token ids
    shared_blocks: int  # full blocks of the shared system prompt (A0 pins them)


def scenario(model: str, steps: int) -> Scenario:
    """SmolLM2 with its chat template, or a tiny preset on random weights and random prompts
    sharing a 40-token prefix; the state sized to hold every sequence to the end."""
    if model == "smollm2-135m":
        config, params = kq.load_pretrained(model, None)
        tok = kq.load_tokenizer(model, None)
        prompts = {name: tok.encode(tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]))
            for name, (_, q) in QUESTIONS.items()}
        shared = len(tok.encode(tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)))
    else:
        config = kq.get_model_config(model)
        params = kq.init_params(config, seed=5, scale=0.5)
        rng = np.random.default_rng(5)
        shared = 40
        prefix = [int(x) for x in rng.integers(0, config.vocab_size, shared)]
        prompts = {name: prefix + [int(x) for x in rng.integers(0, config.vocab_size, 8 + 3 * i)]
                   for i, name in enumerate(QUESTIONS)}
    per_seq = -(-(max(map(len, prompts.values())) + steps) // BLOCK) + 1
    sc = kq.StateConfig(config, num_blocks=ROWS * per_seq, block_size=BLOCK, max_seqs=ROWS,
                        max_blocks_per_seq=per_seq, num_tenants=3, kv_format="f32",
                        host_blocks=4 * per_seq, keep_cold_blocks=True)
    return Scenario(config, params, sc, prompts, max(1, shared // BLOCK))


@dataclasses.dataclass
class Outcome:
    """What one run of the program produced, on the host."""

    tokens: np.ndarray  # i32[steps, ROWS]: each row's greedy token per step, -1 once it left
    state: object  # KVState of NumPy arrays (this process's own copy)
    plan: object  # the ReclaimPlan
    report: object  # the ReclaimReport
    cut: int  # A's new byte quota
    charged_after: int  # A's device bytes charged after the reclaim
    step_seconds: list  # wall time of each decode step


def run_program(scen: Scenario, steps: int, mesh=None, kill=None, say=lambda _: None):
    """The program: tenants, admits, forks, a pin, prefill, `steps` greedy decode steps with a
    free, a reclaim and an unpin along the way. On `mesh` (sharded state and weights, the model
    step under `use_mesh`) or, without one, on the default device. `kill`: the step at which
    this process SIGKILLs itself. Returns (Outcome, the engine)."""
    sc, alloc = scen.sc, kq.Allocator(scen.sc)
    if mesh is None:
        state, params, ctx = alloc.init(), scen.params, contextlib.nullcontext()
    else:
        state = ks.init_sharded(sc, mesh)
        params = ks.shard_params(scen.params, mesh, scen.config)
        ctx = ks.use_mesh(mesh)
    eng = kq.PagedEngine(scen.config, params, sc, chunk_size=CHUNK, state=state,
                         backend="reference")

    def op(fn, *args, **kw):  # an allocator op on the engine's state (donated)
        eng.state, rep = fn(eng.state, *args, donate=True, **kw)
        return rep

    with ctx:
        eng.register_tenant(A, token_quota=10**6, byte_quota=10**9, share_group=1)
        eng.register_tenant(B, token_quota=10**6, byte_quota=10**9, share_group=1)
        eng.register_tenant(C, token_quota=10**6, byte_quota=10**9)
        seq, last = {}, {}
        for batch in (("A0", "C0", "C1"), ("A1", "B0", "B1")):
            rep, logits = eng.admit([QUESTIONS[n][0] for n in batch],
                                    [scen.prompts[n] for n in batch])
            if not rep.admitted.all():
                raise RuntimeError(f"admit refused: {rep.reasons()}")
            for i, name in enumerate(batch):
                seq[name], last[name] = int(rep.seq_id[i]), np.asarray(logits[i])
        say("prefill done")
        for name in ("A0", "C0"):  # forks share every block of their parent
            fork = op(alloc.fork, np.array([seq[name]], np.int32))
            seq[name + "f"], last[name + "f"] = int(np.asarray(fork.seq_id)[0]), last[name]
        op(alloc.pin_prefix, seq["A0"], scen.shared_blocks)
        names = ["A0", "A0f", "A1", "B0", "B1", "C0", "C0f", "C1"]
        rows = np.array([seq[n] for n in names], np.int32)
        nxt = np.argmax(np.stack([last[n] for n in names]), -1).astype(np.int32)
        tokens = np.full((steps, ROWS), -1, np.int32)
        plan = report = cut = None
        times = []
        for step in range(steps):
            if kill is not None and step == kill:
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == steps // 4:  # C0's fork finishes: its references are dropped
                at = names.index("C0f")
                op(alloc.free, rows[at:at + 1])
                rows[at] = kq.INVALID
            if step == steps // 2:  # A's quota is cut below what it holds
                plan, report, cut = _reclaim(alloc, eng, sc)
                for fate in report.fates:
                    if fate.fate != kq.FATE_UNTOUCHED:
                        rows[rows == fate.seq] = kq.INVALID  # suspended: leaves the batch
                say(f"reclaim at step {step}: " + ", ".join(
                    f"seq {f.seq} {f.fate_name}" for f in report.fates))
            if step == 3 * steps // 4:
                op(alloc.unpin_prefix, seq["A0"], scen.shared_blocks)
            tokens[step] = np.where(rows >= 0, nxt, -1)
            start = time.perf_counter()
            appended, logits = eng.decode(rows, np.where(rows >= 0, nxt, 0).astype(np.int32))
            nxt = np.argmax(np.asarray(logits), -1).astype(np.int32)
            rows = np.where(appended.appended, rows, kq.INVALID)  # refused (quota): it leaves
            times.append(time.perf_counter() - start)
            if (step + 1) % 8 == 0:
                say(f"decode step {step + 1}/{steps}")
    return Outcome(tokens, host_copy(eng.state), plan, report, cut, device_charge(eng, A),
                   times), eng


def device_charge(eng, tenant: int) -> int:
    """Bytes of device pools charged to `tenant` (what a quota cut bounds; host blocks are
    charged too, but not against the device quota)."""
    sc = eng.state_config
    blocks = np.asarray(eng.ledger().charged_blocks)[tenant]  # [pools]
    return int(sum(int(n) * b for n, b, dev in zip(blocks, sc.pool_bytes, sc.device_pools) if dev))


def _reclaim(alloc, eng, sc):
    """A's byte quota cut to two blocks below its device charge, answered by the tiered
    policy: plan, then apply. Returns (plan, report, the new quota)."""
    cut = device_charge(eng, A) - 2 * sc.pool_bytes[0]
    plan = alloc.plan_reclaim(eng.state, kq.ReclaimRequest.quota_cut(A, cut), "tiered")
    eng.state, report = alloc.apply_plan(eng.state, plan, donate=True)
    return plan, report, cut


def host_copy(tree):
    """Every leaf of `tree` as a NumPy copy read from this process's own devices. jax reads an
    array that spans other processes when this process holds all of it: a replicated leaf (one
    local shard), or the pages when each "kv" group sits inside one process (the local shards
    cover every head). A copy, so that no later donation can change it."""
    return jax.tree.map(np.array, jax.block_until_ready(tree))


def metadata(state) -> dict:
    """The state's non-page leaves by path (bool as uint8: a psum carries them)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        if not name.startswith(".pages"):
            leaf = np.asarray(leaf)
            out[name] = leaf.astype(np.uint8) if leaf.dtype == bool else leaf
    return out


def plan_digest(plan) -> np.ndarray:
    """16 bytes identifying a reclaim plan (its summary: steps, bytes, fates)."""
    text = json.dumps(plan.summary(), sort_keys=True, default=str).encode()
    return np.frombuffer(hashlib.blake2b(text, digest_size=16).digest(), np.uint8).copy()


def reclaim_holds(out: Outcome) -> bool:
    """The reclaim did what it planned: no shortfall, the bytes planned moved, A under its cut."""
    plan, rep = out.plan, out.report
    return (plan is not None and plan.shortfall_bytes == 0 and rep.shortfall_bytes == 0
            and rep.reclaimed_bytes == plan.planned_bytes >= plan.target_bytes > 0
            and out.charged_after <= out.cut)


# ---- the compiled decode step's collectives ----------------------------------------------------

_RESULT = re.compile(r"=\s*(.*?)\s+(" + "|".join(ks.COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[fsu]\d+|bf16)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}
_IOTA = r"\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?"
_GROUPS = re.compile(  # the three spellings of a collective's device groups in XLA's HLO text
    r"(?:replica_groups|source_target_pairs)=(?P<list>\{[\d,{} ]*\})"
    r"|replica_groups=(?P<iota>" + _IOTA + r")"
    r"|replica_groups=mesh\[(?P<axes>[^\]]*)\](?:, device_ids=\((?P<ids>" + _IOTA + r")\))?"
    r" \{(?P<over>[^}]*)\}")


def _iota(text: str) -> np.ndarray:
    """An iota tile assignment, `[d..]<=[r..]T(p..)` or `[r..]T(p..)`: arange reshaped to r,
    transposed by p, reshaped to d (returned as given by its first list)."""
    m = re.fullmatch(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", text)
    dims = [int(x) for x in m[1].split(",")]
    base = [int(x) for x in (m[2] or m[1]).split(",")]
    ids = np.arange(math.prod(base)).reshape(base)
    if m[3]:
        ids = ids.transpose([int(x) for x in m[3].split(",")])
    return ids.reshape(dims)


def device_groups(line: str, devices: int) -> list[list[int]] | None:
    """The device groups (logical ids) of one collective's HLO line: an explicit list
    (`{{0,1},{2,3}}`, or `source_target_pairs`), an iota list (`[2,4]<=[8]`: one group a row),
    or mesh axes (`mesh['a'=4,'b'=2], device_ids=(...) {'a'}`: the devices that differ only
    along the listed axes). None when the line names no groups (all `devices`, one group)."""
    m = _GROUPS.search(line)
    if m is None:
        return None
    if m["list"]:
        groups = [[int(x) for x in g.split(",") if x.strip()]
                  for g in re.findall(r"\{([\d, ]*)\}", m["list"])]
        return [g for g in groups if g] or None  # `{}`: every device, one group
    if m["iota"]:
        ids = _iota(m["iota"])
        return ids.reshape(ids.shape[0], -1).tolist()
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", m["axes"])]
    ids = (_iota(m["ids"]).reshape(-1) if m["ids"] else np.arange(devices))
    ids = ids.reshape([size for _, size in axes])
    over = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m["over"]]
    rest = [i for i in range(len(axes)) if i not in over]
    size = math.prod(axes[i][1] for i in over)
    return ids.transpose(rest + over).reshape(-1, size).tolist()


_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_CALLEE = re.compile(r"\b(body|calls)=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def runs_per_call(hlo: str) -> dict[str, int]:
    """How many times each computation of a compiled HLO text runs in one call of its entry:
    a while loop's body its `known_trip_count` times per run of the caller (the decoder's loop
    over layers), a called computation (fusion, async wrapper) once per run of the caller.
    A loop of unknown trip count counts once (none here: XLA knows the layer count)."""
    lines: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m[2]
            lines[current] = []
            entry = current if m[1] else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            lines[current].append(line)
    runs: dict[str, int] = {}

    def visit(name: str, n: int) -> None:
        runs[name] = runs.get(name, 0) + n
        for line in lines.get(name, ()):
            trip = _TRIP.search(line)
            for kind, callee in _CALLEE.findall(line):
                visit(callee, n * (int(trip[1]) if kind == "body" and trip else 1))

    if entry is not None:
        visit(entry, 1)
    return runs


def collective_costs(hlo: str, process_of: list[int]) -> dict:
    """Per collective kind of a compiled HLO text: `ops`, the collective instructions (as
    `kq.sharding.collectives` counts them: an async -start once); `runs`, how many run in one
    call (an op in the loop over layers once per layer: `runs_per_call`); `bytes`, their
    result bytes on one device summed over those runs; and `cross_process_runs` /
    `cross_process_bytes`, the same for the ops whose device groups span processes
    (`process_of[i]`: the process of logical device i, in the compiled program's order)."""
    runs = runs_per_call(hlo)
    costs: dict = {}
    current = None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head[2]
        m = _RESULT.search(line)
        if not m:
            continue
        size = sum(math.prod(int(x) for x in dims.split(",") if x)
                   * (_BITS.get(dtype) or int(re.sub(r"\D", "", dtype))) // 8
                   for dtype, dims in _ARRAY.findall(m.group(1)))
        groups = device_groups(line, len(process_of)) or [list(range(len(process_of)))]
        across = any(len({process_of[i] for i in grp}) > 1 for grp in groups)
        n = runs.get(current, 1)
        c = costs.setdefault(m.group(2), dict(ops=0, runs=0, bytes=0, cross_process_runs=0,
                                              cross_process_bytes=0))
        c["ops"] += 1
        c["runs"] += n
        c["bytes"] += n * size
        c["cross_process_runs"] += n if across else 0
        c["cross_process_bytes"] += n * size if across else 0
    return costs


def decode_collectives(eng, mesh) -> dict:
    """The collectives of the model's decode step (ROWS rows, one token each) compiled for
    `mesh`: per kind ops, runs and bytes (`collective_costs`, its op count checked against
    `kq.sharding.collectives`) and how many move page data (`kq.sharding.page_collectives`:
    none expected)."""
    with ks.use_mesh(mesh):
        hlo = eng.decode_hlo(ROWS)
    costs = collective_costs(hlo, [d.process_index for d in mesh.devices.flat])
    if sum(c["ops"] for c in costs.values()) != len(ks.collectives(hlo)):
        raise RuntimeError("the collective count disagrees with kq.sharding.collectives")
    return dict(by_kind=costs, page_data=len(ks.page_collectives(hlo, eng.state_config)))


# ---- one worker ----------------------------------------------------------------------------------


def worker(setup: Setup, process_id: int, coordinator: str) -> int:
    """One process of the run: join, run the program on the global mesh, compare with process
    0's one-device run, gather the verdicts; process 0 prints the summary. Exit status: 0, or 1
    when this process's run failed or the run differs from the reference."""
    started = time.perf_counter()
    say = (lambda msg: print(f"process 0: {msg}", flush=True)) if (
        process_id == 0 and not setup.json) else (lambda _: None)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, setup.num_processes, process_id,
                               initialization_timeout=setup.timeout_s,
                               heartbeat_timeout_seconds=min(60, setup.timeout_s),
                               shutdown_timeout_seconds=setup.timeout_s)
    if jax.local_device_count() != setup.devices_per_process:
        raise cli.BadInput(f"process {process_id} has {jax.local_device_count()} devices, not "
                           f"--devices_per_process={setup.devices_per_process} (on CPU: "
                           "XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    mesh = ks.make_mesh(kv=setup.kv, seq=setup.seq, devices=jax.devices())
    if any(len({d.process_index for d in group}) > 1 for group in mesh.devices):
        raise cli.BadInput("a \"kv\" group of the mesh spans processes")
    say(f"{jax.process_count()} processes, {jax.device_count()} {jax.default_backend()} "
        f"devices, mesh kv={setup.kv} x seq={setup.seq}; loading {setup.model}")
    scen = scenario(setup.model, setup.decode_steps)
    kill = setup.kill_at_step if setup.kill_process == process_id else None
    mine, eng = run_program(scen, setup.decode_steps, mesh, kill, say)
    hlo = decode_collectives(eng, mesh)
    del eng
    say("sharded run done; the one-device reference runs on process 0")

    own = dict(tokens=mine.tokens, plan=plan_digest(mine.plan), **metadata(mine.state))
    ref_outcome = None
    if process_id == 0:
        ref_outcome, _ = run_program(scen, setup.decode_steps)
        ref = dict(tokens=ref_outcome.tokens, plan=plan_digest(ref_outcome.plan),
                   **metadata(ref_outcome.state))
    else:
        ref = own  # shapes only: the broadcast replaces the values with process 0's
    ref = multihost_utils.broadcast_one_to_all(ref)

    tokens_equal = np.array_equal(own["tokens"], ref["tokens"])
    differing = [k for k in own if k not in ("tokens", "plan")
                 and not (own[k].shape == ref[k].shape and np.array_equal(own[k], ref[k]))]
    try:
        kq.check_invariants(scen.sc, mine.state)
        broken = None
    except kq.KVQuotaError as error:
        broken = " ".join(str(error).split())[:300]
    invariants = broken is None
    reclaim_ok = reclaim_holds(mine) and np.array_equal(own["plan"], ref["plan"])
    verdict = np.array([tokens_equal, not differing, reclaim_ok, invariants], np.int32)
    everyone = np.asarray(multihost_utils.process_allgather(verdict)).reshape(-1, 4)
    ok = everyone.all(axis=0)
    if process_id == 0:
        steps = np.asarray(mine.step_seconds[1:]) if len(mine.step_seconds) > 1 else \
            np.asarray(mine.step_seconds)
        ref_steps = np.asarray(ref_outcome.step_seconds[1:])
        summary = {
            "processes": jax.process_count(), "devices": jax.device_count(),
            "tokens_equal": bool(ok[0]), "state_equal": bool(ok[1]), "reclaim_ok": bool(ok[2]),
            "wall_seconds": round(time.perf_counter() - started, 1),
            "invariants_ok": bool(ok[3]), "model": setup.model,
            "mesh": {"kv": setup.kv, "seq": setup.seq},
            "reference": "the same program on one device (process 0, no mesh)",
            "decode_steps": setup.decode_steps,
            "decode_rows_live_at_end": int((mine.tokens[-1] >= 0).sum()),
            "state_leaves_compared": len(own) - 2,
            "decode_step_ms": {"sharded_median": round(1e3 * float(np.median(steps)), 2),
                               "one_device_median": round(1e3 * float(np.median(ref_steps)), 2)},
            "decode_collectives": hlo,
            "reclaim": {"target_bytes": mine.plan.target_bytes,
                        "reclaimed_bytes": mine.report.reclaimed_bytes,
                        "shortfall_bytes": mine.report.shortfall_bytes,
                        "fates": {str(f.seq): f.fate_name for f in mine.report.fates}},
        }
        if differing:
            summary["differing_leaves"] = differing
        if broken:
            summary["invariants_error"] = broken
        if setup.json:
            print(json.dumps(summary), flush=True)
        else:
            print(_human(summary), flush=True)
    if not verdict.all():  # this process's details, for the launcher's log
        print(f"process {process_id}: tokens_equal={tokens_equal} differing={differing} "
              f"invariants={broken} plan_equal={np.array_equal(own['plan'], ref['plan'])} "
              f"reclaimed={mine.report.reclaimed_bytes} planned={mine.plan.planned_bytes} "
              f"target={mine.plan.target_bytes} cut={mine.cut} charged={mine.charged_after}",
              file=sys.stderr, flush=True)
    if not ok.all():
        bad = [name for name, good in zip(("tokens_equal", "state_equal", "reclaim_ok",
                                           "invariants_ok"), ok) if not good]
        print(f"error: process {process_id}: the run differs from the one-device reference "
              f"({', '.join(bad)} false)", file=sys.stderr, flush=True)
        return 1
    return 0


def _human(s: dict) -> str:
    lines = [f"{s['processes']} processes x {s['devices'] // s['processes']} devices, mesh "
             f"kv={s['mesh']['kv']} x seq={s['mesh']['seq']}, {s['model']}, "
             f"{s['decode_steps']} decode steps",
             f"  greedy tokens equal to the one-device run: {s['tokens_equal']}",
             f"  state metadata equal ({s['state_leaves_compared']} leaves, exactly): "
             f"{s['state_equal']}; invariants hold on every process: {s['invariants_ok']}",
             f"  reclaim: {s['reclaim']['reclaimed_bytes']:,} of {s['reclaim']['target_bytes']:,}"
             f" B, fates {s['reclaim']['fates']}: ok {s['reclaim_ok']}",
             f"  decode step: {s['decode_step_ms']['sharded_median']} ms sharded, "
             f"{s['decode_step_ms']['one_device_median']} ms on one device (medians)",
             "  collectives of one compiled decode step (ops in the program; runs and result "
             "bytes per step; of which across processes):"]
    for kind, c in sorted(s["decode_collectives"]["by_kind"].items()):
        lines.append(f"    {kind}: {c['ops']} ops, {c['runs']} runs, {c['bytes']:,} B; across "
                     f"processes {c['cross_process_runs']} runs, {c['cross_process_bytes']:,} B")
    lines.append(f"  wall {s['wall_seconds']} s")
    return "\n".join(lines)


# ---- the launcher -------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on localhost now (the coordinator binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """In the child before exec (Linux): SIGKILL it when the launcher dies, so that a killed
    launcher leaves no worker behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _last_line(path: pathlib.Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()
             if not NOISE.search(ln)]
    return lines[-1] if lines else "no output on stderr"


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"status {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"status {code}"


class RunFailed(Exception):
    """The run failed: the message is the one line the launcher prints; `summary` is process
    0's JSON summary when it printed one (a mismatch with the reference fails after it)."""

    def __init__(self, message: str, summary: dict | None = None):
        super().__init__(message)
        self.summary = summary


def _summary(path: pathlib.Path) -> dict | None:
    """The JSON object on the last line of `path`, if there is one."""
    lines = path.read_text(errors="replace").strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, dict) else None


def launch(setup: Setup, argv_flags: list[str], pids_file: str | None) -> dict | None:
    """Starts the workers on this machine and watches them until all exit 0 (returns process
    0's summary with --json, its wall time the launcher's), one fails (RunFailed naming it,
    the others killed) or --timeout_s passes (RunFailed, all killed). Process 0's stdout is
    relayed as it comes (without --json). No worker outlives this call."""
    started = time.perf_counter()
    logs = pathlib.Path(tempfile.mkdtemp(prefix="kvquota-multihost-"))
    coordinator = f"localhost:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **{CHILD_ENV: "1"})
    env["XLA_FLAGS"] = " ".join(filter(None, [
        env.get("XLA_FLAGS", ""),
        f"--xla_force_host_platform_device_count={setup.devices_per_process}",
        f"--xla_cpu_collective_timeout_seconds={setup.timeout_s}"]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs, failed, pending = [], True, [b""]

    def relay(out):  # process 0's new complete lines, less gloo's chatter (it prints to stdout)
        pending[0] += out.read()
        *lines, pending[0] = pending[0].split(b"\n")
        lines = [ln.decode(errors="replace") for ln in lines]
        lines = [ln for ln in lines if not NOISE.search(ln)]
        if lines and not setup.json:
            print("\n".join(lines), flush=True)

    try:
        for i in range(setup.num_processes):
            cmd = [sys.executable, "-m", "experiments.multihost", *argv_flags,
                   f"--process_id={i}", f"--coordinator_address={coordinator}"]
            with open(logs / f"{i}.out", "wb") as out, open(logs / f"{i}.err", "wb") as err:
                procs.append(subprocess.Popen(
                    cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=REPO,
                    preexec_fn=_die_with_parent))
        if pids_file:
            pathlib.Path(pids_file).write_text("".join(f"{p.pid}\n" for p in procs))
        with open(logs / "0.out", "rb") as out:
            while True:
                relay(out)
                codes = [p.poll() for p in procs]
                bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if bad:  # a peer's abort follows a death: report the death
                    i = min(bad, key=lambda i: (codes[i] == -signal.SIGABRT, i))
                    relay(out)
                    raise RunFailed(f"process {i} exited with {_status(codes[i])}: "
                                    f"{_last_line(logs / f'{i}.err')} (logs: {logs})",
                                    _summary(logs / "0.out") if i == 0 else None)
                if all(c == 0 for c in codes):
                    relay(out)
                    break
                if time.perf_counter() - started > setup.timeout_s:
                    running = [str(i) for i, c in enumerate(codes) if c is None]
                    raise RunFailed(f"timed out after {setup.timeout_s} s with process"
                                    f"{'es' if len(running) > 1 else ''} "
                                    f"{', '.join(running)} still running (logs: {logs})")
                time.sleep(0.2)
        summary = _summary(logs / "0.out") if setup.json else {}
        if summary is None:
            raise RunFailed(f"process 0 printed no summary (logs: {logs})")
        failed = False
        if setup.json:
            summary["wall_seconds"] = round(time.perf_counter() - started, 1)
            return summary
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        if not failed:  # kept, and named in the error, when the run failed
            for path in logs.iterdir():
                path.unlink()
            logs.rmdir()


FLAG_NAMES = ("num_processes", "devices_per_process", "kv", "decode_steps", "model",
              "timeout_s", "process_id", "kill_process", "kill_at_step", "json")


def run_worker(setup: Setup, process_id: int) -> None:
    """`worker`, with every error as one line naming the process (exit 1; the traceback goes
    to the launcher's log only). Exits without jax's shutdown barrier on failure: the peers
    are gone or about to be."""
    coordinator = FLAGS.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    try:
        if not coordinator:
            raise cli.BadInput("--process_id needs --coordinator_address (or "
                               "$JAX_COORDINATOR_ADDRESS): process 0's host:port")
        code = worker(setup, process_id, coordinator)
    except Exception as error:  # noqa: BLE001 - reported as one line
        if os.environ.get(CHILD_ENV):
            traceback.print_exc()
        what = str(error) if isinstance(error, cli.BadInput) else f"{type(error).__name__}: {error}"
        print(f"error: process {process_id}: {' '.join(what.split())[:600]}", file=sys.stderr,
              flush=True)
        code = 1
    sys.stdout.flush()
    if code:
        os._exit(code)


def main(argv):
    del argv
    setup = resolve({name: FLAGS[name].value for name in FLAG_NAMES})
    if FLAGS.process_id is not None:
        return run_worker(setup, FLAGS.process_id)
    passed = [f"--{name}={getattr(setup, name)}" for name in (
        "num_processes", "devices_per_process", "kv", "decode_steps", "model", "timeout_s",
        "kill_at_step")]
    if setup.kill_process is not None:
        passed.append(f"--kill_process={setup.kill_process}")
    passed.append("--json" if setup.json else "--nojson")
    try:
        summary = launch(setup, passed, FLAGS.pids_file)
    except RunFailed as error:
        if error.summary is not None and setup.json:
            print(json.dumps(error.summary), flush=True)
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    if summary is not None:
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    cli.run(main, define_flags)
