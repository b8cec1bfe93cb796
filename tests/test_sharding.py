"""`kvquota.sharding` on 8 forced CPU devices as a 2 x 4 mesh (KV heads x sequences).

Each multidevice snippet runs the same work twice in one process, on one device and on the mesh,
and compares: logits within the suite's f32 tolerances, greedy tokens and every integer leaf of
the state exactly, and every leaf's sharding after every step. The compiled HLO of the model
step and of every allocator core must move no page data between devices. Typed errors for bad
meshes are checked here (one device) and in the snippets (the KV-head split). Slow: the op
script compared with one device, and the serving scheduler on the mesh.
"""

import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec

import kvquota as kq
from kvquota import sharding as ks

# Shared by the snippets: the state's block count (40) is a dimension no activation has, so
# `page_collectives` can tell page data from the rest.
COMMON = """
import numpy as np, jax, jax.numpy as jnp
import kvquota as kq
from kvquota.core.jit import DonatingJit
from kvquota import sharding as ks
from tests.kernels.cases import TOLERANCES
TOL = TOLERANCES["float32"]
cfg = kq.get_model_config("tiny-qwen")  # 2 KV heads, 4 query heads
sc = kq.StateConfig(model=cfg, num_blocks=40, block_size=8, max_seqs=8, max_blocks_per_seq=8,
                    num_tenants=2, kv_format="f32", compressed_pools=(("int8", 24),),
                    host_blocks=32, scrub_on_free=True, keep_cold_blocks=True)
mesh = ks.make_mesh(kv=2, seq=4)
want = jax.tree_util.tree_leaves(ks.state_shardings(sc, mesh),
                                 is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))

def wrong_shardings(state):
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return [jax.tree_util.keystr(p) for (p, a), w in zip(leaves, want)
            if not (a.sharding.is_equivalent_to(w, a.ndim)
                    and a.sharding.memory_kind == w.memory_kind)]

def compare_states(a, b):
    a, b = jax.device_get(a), jax.device_get(b)
    for (p, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)):
        if jax.tree_util.keystr(p) == ".meta.version":
            continue  # folds in each op's inputs bit for bit: the recorded attention mass too,
                      # which the two layouts give equal only within TOL
        if np.dtype(x.dtype).kind in "iub":
            np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(p))
        else:
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                       err_msg=jax.tree_util.keystr(p), **TOL)
"""

MODEL = COMMON + """
import contextlib
from kernels import paged_attention as pa
from kvquota.serving.engine import _paged_forward

params = kq.init_params(cfg, seed=3)
rng = np.random.default_rng(0)
shared = list(rng.integers(0, cfg.vocab_size, 16))
prompts = [shared + list(rng.integers(0, cfg.vocab_size, n)) for n in (3, 9, 5)]
prompts.append(list(rng.integers(0, cfg.vocab_size, 20)))

def run(sharded):
    state, p = kq.Allocator(sc).init(), params
    if sharded:
        state, p = ks.shard_state(state, mesh), ks.shard_params(params, mesh, cfg)
    eng = kq.PagedEngine(cfg, p, sc, chunk_size=8, state=state, backend="reference")
    ctx = ks.use_mesh(mesh) if sharded else contextlib.nullcontext()
    logits, tokens, checks = [], [], []

    def check():
        kq.check_invariants(sc, eng.state)
        checks.append(wrong_shardings(eng.state) if sharded else [])

    def decode(ids, steps, last):
        for _ in range(steps):
            nxt = np.argmax(np.asarray(last), -1).astype(np.int32)
            tokens.append(nxt)
            _, last = eng.decode(ids, nxt)
            logits.append(np.asarray(last))
            check()
        return last

    with ctx:
        eng.register_tenant(0, token_quota=10**6, byte_quota=10**9)
        rep, last = eng.admit([0] * 4, prompts)  # B = 4: rows split over "seq"
        logits.append(np.asarray(last)); check()
        ids = rep.seq_id
        last = decode(ids, 3, last)
        # Mixed pools: seq 0's old blocks into the int8 pool, then decode reads both pools.
        eng.state, _ = eng.allocator.compress(eng.state, ids[:1], kv_format="int8",
                                              keep_recent=8, donate=True)
        check()
        last = decode(ids, 2, last)
        # The attention-mass path (per-head decode over both pools) recorded into the state.
        rec = kq.PagedEngine(cfg, p, sc, chunk_size=8, state=eng.state, backend="reference",
                             record_attention=True)
        nxt = np.argmax(logits[-1], -1).astype(np.int32)
        _, last = rec.decode(ids, nxt)
        logits.append(np.asarray(last)); logits.append(np.asarray(rec.last_mass))
        eng.state = rec.state; check()
    return eng, logits, tokens, checks

e1, l1, t1, _ = run(False)
e2, l2, t2, checks = run(True)
diffs = [float(np.abs(a - b).max()) for a, b in zip(l1, l2)]
for a, b in zip(l1, l2):
    np.testing.assert_allclose(b, a, **TOL)
for a, b in zip(t1, t2):
    np.testing.assert_array_equal(a, b)
compare_states(e1.state, e2.state)
pages = e2.state.pages[0].k
local_heads = pages.addressable_shards[0].data.shape[1]

# The compiled model step (prefill chunk, decode, decode recording mass) moves no page data.
B = 4
hlo = {}
for name, t, record in (("prefill", 8, None), ("decode", 1, None), ("decode_mass", 1, sc)):
    args = (e2.model, e2.params, e2.state, jnp.arange(B, dtype=jnp.int32),
            jnp.zeros((B, t), jnp.int32), jnp.zeros(B, jnp.int32), jnp.full(B, t, jnp.int32),
            jnp.zeros((B, t), jnp.int32))
    with ks.use_mesh(mesh):
        text = _paged_forward.lower(*args, last_only=True, pool_starts=e2.pool_starts,
                                    record=record).compile().as_text()
    hlo[name] = dict(collectives=sorted({op for op, _ in ks.collectives(text)}),
                     page=ks.page_collectives(text, sc))

# The kernels alone under shard_map, on the final pages: Pallas (interpreted on CPU) decode with
# rows split over "seq", and prefill with the query chunk split instead (B = 2 rows over 4).
tables, lens = np.asarray(e1.state.seqs.block_tables), np.asarray(e1.state.seqs.seq_lens)
rows = [i for i in range(sc.max_seqs)  # sequences held in pool 0 alone
        if lens[i] and (tables[i][tables[i] >= 0] < sc.num_blocks).all()]
assert len(rows) == 3, rows
rows.append(rows[0])
tables, lens = tables[rows], lens[rows]
pool0, pool0_split = e1.state.pages[0], ks.shard_state(e1.state, mesh).pages[0]
kernels = {}
for name, backend, b, t in (("decode", "pallas", 4, None), ("prefill", "reference", 2, 8)):
    q = rng.standard_normal((b,) + ((t,) if t else ()) + (cfg.num_q_heads, cfg.head_dim))
    args = (jnp.asarray(q, jnp.float32), tables[:b], lens[:b]) + (
        (np.maximum(lens[:b] - t, 0).astype(np.int32),) if t else ())
    kw = dict(layer=jnp.int32(1), backend=backend, mass="block", return_lse=True)
    fn = getattr(pa, name)
    want = fn(args[0], pool0.k, pool0.v, *args[1:], **kw)
    got = ks.sharded_attention(fn, args[0], pool0_split.k, pool0_split.v, *args[1:], mesh=mesh,
                               **kw)
    for a, g in ((want[0], got[0]), (want[1].lse, got[1].lse), (want[1].mass, got[1].mass)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(a), **TOL)
    kernels[f"{name}-{backend}-{b}"] = len(got[0].sharding.device_set)
report(max_logit_diff=max(diffs), checks=checks, local_heads=local_heads, hlo=hlo,
       steps=len(l1), kernels=kernels)
"""


def test_model_on_a_sharded_state_matches_one_device(multidevice):
    """Chunked prefill and decode (rows split over "seq"), a compressed pool mixed in, and the
    attention-mass path on a 2 x 4 mesh give the one-device logits, tokens and state; the
    compiled steps gather no page data; the kernels under shard_map (Pallas decode; prefill
    with the query chunk split when the batch does not divide) agree with the plain calls."""
    result = multidevice(MODEL)
    assert result["steps"] == 8  # prefill, 5 decodes, the mass step and its mass
    assert result["kernels"] == {"decode-pallas-4": 8, "prefill-reference-2": 8}
    assert result["local_heads"] == 1  # 2 KV heads over the 2-way "kv" axis
    assert all(bad == [] for bad in result["checks"]), result["checks"]
    for name, h in result["hlo"].items():
        assert h["page"] == [], (name, h)
        # tensor parallel: the projections' partial sums are all-reduced (activations only)
        assert "all-reduce" in h["collectives"], (name, h)


OPS = COMMON + """
alloc = kq.Allocator(sc)
records = []
run_core = DonatingJit.__call__

def spy(op, config, state, *args, donate=False):
    # sharded states: the core compiled ahead of time, its HLO read, then run (one compile)
    if len(jax.tree_util.tree_leaves(state)[0].sharding.device_set) == 1:
        return run_core(op, config, state, *args, donate=donate)
    compiled = op.jitted(donate).lower(config, state, *args).compile()
    static = {i - 2 for i in op.static_argnums}  # positions past (config, state)
    out = compiled(state, *(a for i, a in enumerate(args) if i not in static))
    records.append(dict(op=op.name, donate=bool(donate), wrong=wrong_shardings(out[0]),
                        collectives=ks.collectives(compiled.as_text())))
    return out

DonatingJit.__call__ = spy

def script(s):
    steps = []
    def step(fn, *a, **k):
        nonlocal s
        s, rep = fn(s, *a, **k)
        kq.check_invariants(sc, s)
        steps.append(jax.device_get(s))  # a host copy: the next op may donate `s`
        return rep
    step(alloc.register_tenant, 0, token_quota=10**6, byte_quota=10**9)
    step(alloc.register_tenant, 1, token_quota=10**6, byte_quota=10**9, share_group=1)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 256, (4, 40)).astype(np.int32)
    toks[1, :16] = toks[0, :16]
    lens = np.array([40, 17, 33, 24], np.int32)
    ids = np.asarray(step(alloc.admit, np.array([0, 0, 1, 1], np.int32), toks, lens).seq_id)
    step(alloc.append, ids, np.array([1, 2, 3, 4], np.int32), donate=True)
    fork = np.asarray(step(alloc.fork, ids[:1]).seq_id)
    step(alloc.pin_prefix, int(ids[0]), 2)
    step(alloc.unpin_prefix, int(ids[0]), 2, donate=True)
    step(alloc.compress, ids[2:3], kv_format="int8", keep_recent=8)
    step(alloc.set_idle, ids[3:4])
    step(alloc.offload, ids[3:4], donate=True)
    step(alloc.restore, ids[3:4])
    step(alloc.evict, ids[1:2], policy="oldest", keep_tokens=10)
    step(alloc.free, fork[:1], donate=True)
    step(alloc.preempt, ids[1:2])
    step(alloc.rebalance, cold_blocks=1)
    plan = alloc.plan_reclaim(s, kq.ReclaimRequest.quota_cut(0, 0))
    step(alloc.apply_plan, plan)
    step(alloc.release_tenant, 1, donate=True)
    return steps, s

# made on the mesh, shard by shard: equal to the one-device state placed there
made, placed = ks.init_sharded(sc, mesh), ks.shard_state(alloc.init(), mesh)
assert wrong_shardings(made) == [] and wrong_shardings(placed) == []
compare_states(made, placed)
split, final = script(made)
if COMPARE:  # the same script on one device: equal states (integers exactly)
    plain, _ = script(alloc.init())
    assert len(plain) == len(split)
    for a, b in zip(plain, split):
        compare_states(a, b)
host = final.pages[sc.host_pool].k

# Typed errors: a "kv" axis that does not divide the 2 KV heads, a mesh of the wrong size.
errors = {}
for name, fn in (
        ("state_shardings", lambda: ks.state_shardings(sc, ks.make_mesh(kv=4, seq=2))),
        ("shard_state", lambda: ks.shard_state(alloc.init(), ks.make_mesh(kv=8))),
        ("shard_params", lambda: ks.shard_params(kq.init_params(cfg), ks.make_mesh(kv=4, seq=2),
                                                 cfg)),
        ("make_mesh", lambda: ks.make_mesh(kv=3, seq=2))):
    try:
        fn()
        errors[name] = None
    except ks.ShardingError as e:
        errors[name] = str(e)

meta = kq.StateConfig(model=cfg, num_blocks=40, block_size=8, with_pages=False)
meta_state = ks.shard_state(kq.Allocator(meta).init(), mesh)
page_bytes = [ks.local_bytes(final.pages),
              sum(a.nbytes for a in jax.tree_util.tree_leaves(final.pages))]
report(records=records, errors=errors, host_kind=host.sharding.memory_kind,
       page_bytes=page_bytes, host_local_heads=host.addressable_shards[0].data.shape[1],
       meta_specs=sorted({str(a.sharding.spec) for a in jax.tree_util.tree_leaves(meta_state)}))
"""


@pytest.mark.parametrize("compare", [
    False, pytest.param(True, marks=pytest.mark.slow, id="against-one-device")])
def test_allocator_ops_keep_the_sharding_and_gather_nothing(multidevice, compare):
    """Every op (donated or not) on a sharded state keeps every leaf's sharding (the host pool
    split in pinned memory too), passes check_invariants and compiles to a program with no
    collective at all; bad meshes raise ShardingError. Slow variant: the same script on one
    device gives equal states."""
    result = multidevice(f"COMPARE = {compare}\n" + OPS)
    ops = {r["op"] for r in result["records"]}
    assert {"admit", "append", "fork", "pin", "unpin", "compress", "offload", "restore",
            "evict_tokens", "drop_sequences", "preempt", "recycle", "drop_cold"} <= ops, ops
    assert any(r["donate"] for r in result["records"])
    for r in result["records"]:
        assert r["collectives"] == [], r
        assert r["wrong"] == [], r
    assert result["host_local_heads"] == 1
    local, total = result["page_bytes"]
    assert 2 * local == total  # each device holds half of every pool (1 of 2 KV heads)
    assert result["host_kind"] == ("pinned_host" if kq.host_sharding() is not None else "device")
    assert result["meta_specs"] == [str(PartitionSpec())]
    for name, message in result["errors"].items():
        assert message is not None, name
    assert "KV heads" in result["errors"]["state_shardings"]
    assert "needs 6 devices" in result["errors"]["make_mesh"]


# ---- typed errors on this process's one device -------------------------------------------------


def test_bad_meshes_raise_typed_errors():
    import jax

    dev = jax.devices()[:1]
    assert issubclass(ks.ShardingError, kq.KVQuotaError)
    for kwargs, match in ((dict(kv=0), "positive"), (dict(kv=True), "positive"),
                          (dict(seq=1.5), "positive"), (dict(kv=2), "needs 2 devices"),
                          (dict(kv=1, seq=2, devices=dev * 2), "twice")):
        with pytest.raises(ks.ShardingError, match=match):
            ks.make_mesh(**kwargs)
    cfg = kq.get_model_config("tiny-qwen")
    sc = kq.StateConfig(model=cfg, num_blocks=8, block_size=4)
    with pytest.raises(ks.ShardingError, match="jax.sharding.Mesh"):
        ks.state_shardings(sc, "kv")
    with pytest.raises(ks.ShardingError, match="lack 'kv'"):
        ks.state_shardings(sc, Mesh(np.array(dev), ("data",)))
    explicit = Mesh(np.array(dev).reshape(1, 1), ("seq", "kv"),
                    axis_types=(AxisType.Explicit, AxisType.Explicit))
    with pytest.raises(ks.ShardingError, match="AxisType.Auto"):
        ks.shard_state(kq.Allocator(sc).init(), explicit)
    with pytest.raises(ks.ShardingError, match="AxisType.Auto"):
        ks.use_mesh(explicit)


def test_one_device_mesh_is_the_plain_run():
    """A 1 x 1 mesh: shardings are every leaf's (pages on "kv", the rest replicated), and the
    state placed on it is equal to the input."""
    import jax

    cfg = kq.get_model_config("tiny-qwen")
    sc = kq.StateConfig(model=cfg, num_blocks=8, block_size=4, host_blocks=4)
    mesh = ks.make_mesh()
    specs = jax.tree_util.tree_flatten_with_path(
        ks.state_shardings(sc, mesh), is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    for path, sharding in specs:
        is_page = jax.tree_util.keystr(path).startswith(".pages")
        assert tuple(sharding.spec) == ((None, "kv") if is_page else ()), path
    state = kq.Allocator(sc).init()
    placed = ks.shard_state(state, mesh)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(placed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kq.check_invariants(sc, placed)


SCHEDULER = """
import contextlib
import numpy as np, jax
import kvquota as kq
from kvquota import sharding as ks
from kvquota.serving import Event, ModelExecutor, Request, Scheduler

cfg = kq.get_model_config("tiny-qwen")
sc = kq.StateConfig(cfg, num_blocks=48, block_size=4, max_seqs=4, max_blocks_per_seq=16,
                    num_tenants=3, kv_format="f32", host_blocks=32, keep_cold_blocks=True)
block = sc.pool_bytes[0]
params = kq.init_params(cfg, seed=0, scale=0.1)
mesh = ks.make_mesh(kv=2, seq=4)

def serve(sharded):
    p = ks.shard_params(params, mesh, cfg) if sharded else params
    state = ks.shard_state(kq.Allocator(sc).init(), mesh) if sharded else None
    cut = [Event(5, "quota_cut", 0, byte_quota=0), Event(9, "burst", 0, byte_quota=40 * block)]
    s = Scheduler(ModelExecutor(cfg, p, sc, prefill_rows=2, chunk_size=16), state=state,
                  events=cut, policy="swap-all", drift_every=1, check_every=1)
    for t in range(2):
        s.register_tenant(t, token_quota=10**6, byte_quota=40 * block)
    rng = np.random.default_rng(1)
    reqs = [s.submit(Request(i % 2, [int(x) for x in rng.integers(0, 256, 9)], 20))
            for i in range(4)]
    with ks.use_mesh(mesh) if sharded else contextlib.nullcontext():
        summary = s.run(max_steps=100)
    return [r.tokens for r in reqs], summary, s.state

want, plain, _ = serve(False)
got, split, state = serve(True)
report(equal=got == want, suspensions=[plain["suspensions"], split["suspensions"]],
       drift=split["ledger_drift_max"],
       specs=sorted({str(a.sharding.spec) for a in jax.tree_util.tree_leaves(state)}))
"""


@pytest.mark.slow
def test_scheduler_on_a_sharded_state_matches_one_device(multidevice):
    """The serving scheduler (fused append + forward + sample, a quota cut that suspends
    tenant 0's requests to the host pool and a top-up that restores them, check_invariants
    every step) gives the one-device greedy tokens on the 2 x 4 mesh, the state still split."""
    result = multidevice(SCHEDULER, timeout=600)
    assert result["equal"], result
    assert result["suspensions"] == [2, 2] and result["drift"] == 0
    assert result["specs"] == sorted({str(PartitionSpec()), str(PartitionSpec(None, "kv"))})
