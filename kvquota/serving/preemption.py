"""Which running requests the appends refused at a step preempt (DESIGN.md §1.6).

As vLLM's scheduler does, the youngest running request is preempted until the refused appends
would fit: of the refused rows' tenant for a quota refusal (tokens or bytes), of any tenant when
pool 0 is full. One victim per refused row, the rule up to release 0.14.0, over-preempted
whenever several rows of a tenant were refused at once (their block boundaries in one step, or
in one pass of multi-step scheduling): each row took a victim before any victim's room was
counted, though one victim's blocks usually cover them all.

The scheduler works in rounds (`Scheduler._refused_appends`): read the room, ask `shortfalls`
which groups of refused rows still do not fit, ask `choose_victims` for this round's victims,
preempt them, read again. A round takes, youngest first, only as many victims as could close the
shortfall if each freed everything it holds (its tokens, its table's blocks at the largest unit):
an upper bound on what it frees, or until every refused row of the group is a victim itself. So,
for a group alone, the rounds preempt exactly the requests that preempting one at a time and
reading the room after each would (a hypothesis test checks it), in fewer device calls. A
group whose only running request is its own refused row cannot make room: that request ends
("alone").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvquota.codes import REFUSED_POOL_FULL

POOL = -1  # the group of the rows refused for pool 0's room (victims: any tenant's requests)


@dataclasses.dataclass(frozen=True)
class Room:
    """What the refused appends may take now: token_room i64[T] (token quota - used tokens),
    unit_room i64[T] (byte quota - device units charged; no limit for a growing tenant, whose
    appends go past its byte quota), pool0 (blocks allocatable in pool 0: stack + cold)."""

    token_room: np.ndarray
    unit_room: np.ndarray
    pool0: int


@dataclasses.dataclass(frozen=True)
class Geometry:
    """block_size (tokens per block), unit0 (device units of a pool-0 block), max_unit (the
    largest device units of a block in any pool: a victim's upper bound per table entry)."""

    block_size: int
    unit0: int
    max_unit: int

    @classmethod
    def of(cls, config) -> "Geometry":
        units = [u for u, dev in zip(config.pool_units, config.device_pools) if dev]
        return cls(config.block_size, config.pool_units[0], max(units))


def group_of(tenant: int, reason: int) -> int:
    """Whose room a refused row waits for: pool 0's (POOL) or its tenant's quota."""
    return POOL if reason == REFUSED_POOL_FULL else tenant


def _at_boundary(r, length, geo: Geometry) -> int:
    """1 if request r's next token starts a block (its append needs one), else 0."""
    return int(length[r.seq] % geo.block_size == 0)


def _needs(rows, length, geo: Geometry):
    """{group: (tokens, units or blocks)} the refused rows [(request, reason)] need: one token
    each, and one block (pool 0's units for a quota group) at a block boundary."""
    need = {}
    for r, reason in rows:
        g = group_of(r.tenant, reason)
        boundary = _at_boundary(r, length, geo)
        tokens, blocks = need.get(g, (0, 0))
        need[g] = (tokens + 1, blocks + boundary * (1 if g == POOL else geo.unit0))
    return need


def shortfalls(rows, room: Room, length, geo: Geometry) -> dict:
    """{group: (tokens short, units short; for POOL: 0, blocks short)} of the groups whose
    refused rows [(running request, reason)] do not all fit the room (`length`: each slot's
    cached tokens)."""
    out = {}
    for g, (tokens, units) in _needs(rows, length, geo).items():
        if g == POOL:
            short = (0, units - room.pool0)
        else:
            short = (tokens - int(room.token_room[g]), units - int(room.unit_room[g]))
        if max(short) > 0:
            out[g] = tuple(max(0, s) for s in short)
    return out


def choose_victims(short: dict, rows, running, length, geo: Geometry):
    """(victims, alone) for one round: `short` from `shortfalls`, `rows` the refused rows
    [(request, reason)], `running` the running requests. A group's victims are its youngest
    running requests (admission stamp), never its oldest, taken until their upper bounds cover
    its shortfall or all its refused rows are victims; alone: the refused rows of the groups
    with one running request."""
    victims, alone = [], []
    own = {r: (group_of(r.tenant, reason), _at_boundary(r, length, geo))
           for r, reason in rows}  # a refused victim's own need goes with it
    for g, (tokens, units) in short.items():
        pool = sorted((q for q in running if g == POOL or q.tenant == g),
                      key=lambda q: -q.admitted)
        if len(pool) <= 1:
            alone.extend(q for q in pool if own.get(q, (None,))[0] == g)
            continue
        left = sum(group == g for group, _ in own.values())  # the group's refused rows
        for q in pool[:-1]:  # the oldest stays; a victim of another group counts here too
            if (tokens <= 0 and units <= 0) or left == 0:
                break
            if q not in victims:
                victims.append(q)
            held = int(length[q.seq])
            entries = -(-held // geo.block_size)
            group, boundary = own.get(q, (None, 0))
            mine = group == g
            left -= mine
            tokens -= held + mine
            units -= (entries + mine * boundary if g == POOL
                      else entries * geo.max_unit + mine * boundary * geo.unit0)
    return victims, alone
