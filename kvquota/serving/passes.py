"""Multi-step scheduling for the cost model: a scheduling pass of up to K executor steps in one
jitted call (vLLM's `num_scheduler_steps` idea, DESIGN.md §1.6).

A `Scheduler` with steps_per_pass K > 1 frees, runs events and admits once, then plans K steps
on the host (`planning.compose_pass`: each running request decodes up to K tokens, the prefills
take chunks at every step under the token budget), runs them in one call (`run_pass`:
`_cost_pass` scans the cost model's step over them, so the state is exactly what K single steps
with those rows leave) and absorbs them step by step (`PassSteps._run_pass`), one record per
step. What ends inside the pass (a finish, an append refused) is seen at its end: frees, events,
admissions and preemptions wait for the next pass, and a row that finishes its prefill decodes
from the next pass on. The point is the wall: the per-step host work and device calls of a load
test's step happen once per pass.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvquota.codes import REASONS, REFUSED_POOL_FULL, REFUSED_SEQ_FULL
from kvquota.errors import InvalidArgumentError
from kvquota.sentinel import INVALID
from kvquota.serving.executors import cost_step_core, fake_tokens, unpack_step
from kvquota.serving.metrics import Request
from kvquota.serving.planning import PassBatch, compose_pass
from kvquota.serving.preemption import POOL, Room, choose_victims, group_of, shortfalls


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def _cost_pass(state, dec_seq, dec_tok, dec_key, dec_count, dec_pools, pre_seq, pre_key,
               pre_pools, *, config):
    """K cost-model steps in one call (K = pre_seq.shape[0]; a scheduling pass): at step j the
    decode rows with dec_count > j that no earlier step refused append a token (at j = 0 their
    pending `dec_tok`, after that the token step j - 1 sampled for them, as K separate steps
    would), and the prefill rows pre_seq[j] are read. Returns (state, i32[K, L]: each step's
    vector, see `unpack_step`)."""
    vocab = config.model.vocab_size

    def step(carry, xs):
        state, stopped = carry
        j, p_seq, p_key, p_pools = xs
        active = (dec_count > j) & ~stopped
        seq = jnp.where(active, dec_seq, INVALID)
        key = dec_key.at[:, 1].add(j)
        tok = jnp.where(j == 0, dec_tok, fake_tokens(key.at[:, 1].add(-1), vocab))
        state, appended, flat = cost_step_core(config, state, seq, tok, key, p_seq, p_key,
                                              jnp.concatenate([dec_pools, p_pools]))
        return (state, stopped | (active & ~appended)), flat

    k = pre_seq.shape[0]
    xs = (jnp.arange(k, dtype=jnp.int32), pre_seq, pre_key, pre_pools)
    (state, _), flats = jax.lax.scan(step, (state, jnp.zeros(dec_seq.shape, bool)), xs)
    return state, flats


def run_pass(executor, state, batch: PassBatch):
    """A CostModelExecutor's pass in one call (donates `state`) -> (state, [StepOutput] of the
    steps with rows, each with its modelled seconds; step 0's counts the host bytes). One
    readback."""
    b, bd = batch.first, len(batch.first.dec_seq)
    state, flats = _cost_pass(state, b.dec_seq, b.dec_tok, b.dec_key, batch.dec_count,
                              b.row_pools[:bd], batch.pre_seq, batch.pre_key,
                              batch.pre_pools, config=executor.state_config)
    flats, outs = executor.read(flats), []
    for j in range(batch.steps):
        out = unpack_step(executor.state_config, flats[j], bd, batch.pre_seq.shape[1], 0.0)
        out.seconds = executor.modelled_seconds(out.block_reads, int(batch.pre_num[j].sum()),
                                                b.host_bytes if j == 0 else 0)
        outs.append(out)
    return state, outs


class PassSteps:
    """The Scheduler's side of a pass (a mixin, like `Intake`): run it and absorb its steps,
    and the absorption shared with single steps (a chunk prefilled, appends refused)."""

    @staticmethod
    def _steps_per_pass(executor, k) -> int:  # the Scheduler's argument, checked
        if not (isinstance(k, int) and k >= 1) or (k > 1 and not executor.cost_model):
            raise InvalidArgumentError(f"steps_per_pass must be an int >= 1 (> 1 only with the "
                                       f"cost model), got {k!r}")
        return k

    def _pass(self, max_steps, kinds, marks):
        """Plan and run a pass (at most max_steps steps) -> its last record, or None when no
        row would run (the caller's single step then records the idle step)."""
        plan = compose_pass(self.executor, self.live, self.token_budget, self.m, self._host_bytes,
                            self.steps_per_pass,
                            min(self.steps_per_pass, max(1, max_steps or self.steps_per_pass)))
        return None if plan[0] is None else self._run_pass(*plan, kinds, marks)

    def _run_pass(self, batch, dec, counts, pres, kinds, marks) -> dict:
        """Run a pass (`compose_pass`) and absorb it step by step: each step's finishes and
        completed prefills at its own step and clock, then its record; the appends refused are
        handled at the pass's end (in its last step), as `_absorb` handles a step's."""
        self.state, outs = run_pass(self.executor, self.state, batch)
        self._progress, self._dirty, m = True, False, self.m
        self.quota.stepped(outs[-1].charged, outs[-1].used_tokens)
        nd, t0 = len(dec), self.t
        clocks = self.clock + np.cumsum([o.seconds for o in outs])
        appended = np.stack([o.appended[:nd] for o in outs])  # [steps, rows]
        got = appended.sum(axis=0)
        seqs = np.fromiter((r.seq for r in dec), np.int64, nd)
        m.length[seqs] += got
        m.position[seqs] += got
        sampled = np.stack([o.dec_next[:nd] for o in outs], axis=1).tolist()
        ends, refused = [[] for _ in outs], []
        for i, (r, n, a) in enumerate(zip(dec, counts.tolist(), got.tolist())):
            r.tokens.extend(sampled[i][:a])
            if a < n:  # refused at step a
                refused.append((r, int(outs[a].reason[i])))
            elif why := self._why(r, sampled[i][a - 1]):
                ends[a - 1].append((r, why))
        rows, last = np.arange(nd), len(outs) - 1
        for j, out in enumerate(outs):
            self.t, self.clock = t0 + j, float(clocks[j])
            for r, why in ends[j]:
                self._finish(r, why)
            self.counters.add("generated_tokens", int(appended[j].sum()))
            for i, (r, n) in enumerate(pres[j]):
                self._prefilled(r, n, int(out.pre_next[i]))
            decoding = [dec[i] for i in rows[(counts > j) & (got >= j)]]
            charged = out.charged
            if j == last:
                self._refused_appends(refused)
                if self._dirty:
                    charged = self._read(self.state.tenants.charged_blocks)
            rec = self._record(out, decoding, pres[j], charged, kinds if j == 0 else [], marks)
            marks = (time.perf_counter(), self.syncs, self.executor.syncs, self.facade_calls)
        return rec

    def _prefilled(self, r: Request, n: int, token: int):
        """A chunk of n tokens of r's context was prefilled; the last one samples `token`."""
        r.prefilled += n
        self.counters.add("prefill_tokens", n)
        if r.prefilled == len(r.context):
            r.status = "running"
            if r.pin_blocks and not r.preemptions and not r.turn:  # pinned once, written
                self._op("pin_prefix", r.seq, r.pin_blocks)
            self._took(r, token)
            self.counters.add("generated_tokens")

    def _refused_appends(self, refused):
        """Appends refused ([(request, reason)]): a full table ends its request; for the rest,
        rounds of preemption until they would fit (`preemption`: the youngest running request
        of the tenant, of anyone's for the pool), then their tenants, and the victims' tenants,
        are parked: the room is for the running rows to grow."""
        rows, victims_of = [], set()  # the victims' tenants
        for r, reason in refused:
            self.counters.refused(reason)
            if reason == REFUSED_SEQ_FULL:
                self._finish(r, "table full")
            else:
                rows.append((r, reason))
        while rows:
            short = shortfalls(rows, self._room(rows), self.m.length, self._geometry)
            if not short:
                break
            victims, alone = choose_victims(short, rows, [q for q in self.live
                                                          if q.status == "running"],
                                            self.m.length, self._geometry)
            for r in alone:  # nothing of its own to give up
                self._finish(r, f"append refused: {REASONS[dict(rows)[r]]}")
            if victims:
                self._preempt(victims)
                victims_of.update(q.tenant for q in victims)
            elif not alone:
                break
            rows = [(r, reason) for r, reason in rows if r.status == "running"]
        for r, reason in refused:
            self.parked.refused(r.tenant, reason)
        for t in victims_of - {r.tenant for r, _ in refused}:  # another tenant's room, for the
            self.parked.refused(t, REFUSED_POOL_FULL)  # pool: not to be re-admitted into

    def _room(self, rows) -> Room:
        """The refused appends' room now: the tenants' (a device read if stale) and, only when
        a row was refused for the pool, pool 0's (one more)."""
        tokens, units, reads = self.quota.room(self.state)
        pool0 = 0
        if any(group_of(r.tenant, reason) == POOL for r, reason in rows):
            pool0, reads = int(self.alloc.allocatable_blocks(self.state)[0]), reads + 1
        self.syncs += reads
        return Room(token_room=tokens, unit_room=units, pool0=pool0)
