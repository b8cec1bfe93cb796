"""The tenant ledger: registering a tenant, its quotas and lease (validated, then one jitted
core), and the ledger view recomputed from the tables."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvquota.codes import INT32_MAX
from kvquota.core.cold import allocatable
from kvquota.core.jit import donating_jit
from kvquota.core.scatter import charged_units
from kvquota.errors import QuotaValueError, TenantExistsError
from kvquota.hashing import group_salt, private_salt
from kvquota.reports import Ledger, TenantReport
from kvquota.state import KVState, StateConfig, pool_of
from kvquota.validation import int_scalar, tenant_id, tenant_row


@donating_jit
def set_tenant_core(config: StateConfig, state: KVState, tenant, token_quota, byte_quota_units,
               lease_expiry, salt, growing):
    """Write one tenant's ledger settings (register, quota change, lease change): every
    setting is given, so a caller keeps what it does not change by passing the current value."""
    t = tenant
    s = state
    state = s.update(
        registered=s.tenants.registered.at[t].set(True),
        token_quota=s.tenants.token_quota.at[t].set(token_quota),
        byte_quota=s.tenants.byte_quota.at[t].set(byte_quota_units),
        lease_expiry=s.tenants.lease_expiry.at[t].set(lease_expiry),
        salt=s.tenants.salt.at[t].set(salt),
        growing=s.tenants.growing.at[t].set(growing),
    )
    report = TenantReport(
        tokens_over=jnp.maximum(state.tenants.used_tokens[t] - token_quota, 0),
        units_over=jnp.maximum(charged_units(config, state)[t] - byte_quota_units, 0),
        unit_bytes=config.unit_bytes,
    )
    return state, report


def quota_units(config: StateConfig, byte_quota) -> int:
    """A byte quota in whole byte units (a cap, so rounded down)."""
    b = int_scalar("byte_quota", byte_quota)
    if b < 0:
        raise QuotaValueError(f"byte_quota must be >= 0, got {b}")
    units = b // config.unit_bytes
    if units > INT32_MAX:
        raise QuotaValueError(f"byte_quota {b} exceeds the largest representable "
                              f"{INT32_MAX * config.unit_bytes} B")
    return units


def nonneg(name: str, value, top: int = INT32_MAX) -> int:
    """An integer setting in [0, top]."""
    v = int_scalar(name, value)
    if not 0 <= v <= top:
        raise QuotaValueError(f"{name} must be in [0, {top}], got {v}")
    return v


def register_tenant(config: StateConfig, state: KVState, tenant, *, token_quota, byte_quota,
                    lease_expiry=INT32_MAX, share_group: Optional[int] = None, donate=False):
    """Allocator.register_tenant: a private salt unless `share_group` is given."""
    t = tenant_id(config, state, tenant, registered=False)
    tq = nonneg("token_quota", token_quota)
    units = quota_units(config, byte_quota)
    lease = nonneg("lease_expiry", lease_expiry)
    if share_group is None:
        salt = private_salt(t)
    else:
        salt = group_salt(nonneg("share_group", share_group, 2**31 - 1))
    if np.asarray(state.tenants.registered)[t]:
        raise TenantExistsError(f"tenant {t} is already registered")
    return set_tenant_core(config, state, t, tq, units, lease, np.uint32(salt), np.bool_(False),
                           donate=donate)


def set_quota(config: StateConfig, state: KVState, tenant, *, token_quota=None, byte_quota=None,
              donate=False):
    """Allocator.set_quota: a new quota ends grow-no-admit; lease and salt are kept."""
    t = tenant_id(config, state, tenant)
    row = tenant_row(state, t)
    tq = row["token_quota"] if token_quota is None else nonneg("token_quota", token_quota)
    units = row["byte_quota"] if byte_quota is None else quota_units(config, byte_quota)
    return set_tenant_core(config, state, t, tq, units, row["lease_expiry"], row["salt"],
                           np.bool_(False), donate=donate)


def set_lease(config: StateConfig, state: KVState, tenant, lease_expiry, *, donate=False):
    """Allocator.set_lease: quotas, salt and the grow-no-admit flag are kept."""
    t = tenant_id(config, state, tenant)
    lease = nonneg("lease_expiry", lease_expiry)
    row = tenant_row(state, t)
    return set_tenant_core(config, state, t, row["token_quota"], row["byte_quota"], lease,
                           row["salt"], row["growing"], donate=donate)


def expired_tenants(config: StateConfig, state: KVState, step: int) -> np.ndarray:
    """Registered tenants whose lease_expiry <= step."""
    step = int_scalar("step", step)
    return np.flatnonzero(np.asarray(state.tenants.registered)
                          & (np.asarray(state.tenants.lease_expiry) <= step))


# ---- ledger view ------------------------------------------------------------------------------
def ledger(config: StateConfig, state: KVState) -> Ledger:
    """The per-tenant ledger, including the columns recomputed on demand from the tables:
    distinct blocks referenced but paid by others, reclaimable blocks, fragmentation."""
    nb, ntn, npools, p = config.total_blocks, config.num_tenants, config.num_pools, config.block_size
    s = state
    # Distinct (tenant, block) references: one flag per (block, tenant), set from every table
    # entry (repeats write the same True), then the flags whose block another tenant pays for.
    ten = jnp.broadcast_to(s.seqs.seq_tenant[:, None], s.seqs.block_tables.shape).ravel()
    blk = s.seqs.block_tables.ravel()
    live = (blk >= 0) & (ten >= 0)
    refs = jnp.zeros((nb, ntn), bool).at[jnp.where(live, blk, nb), jnp.clip(ten, 0, ntn - 1)].set(
        True, mode="drop")
    others = refs & (s.blocks.payer[:, None] != jnp.arange(ntn, dtype=jnp.int32)[None, :])
    shared = jnp.stack([others[start:start + size].sum(axis=0, dtype=jnp.int32)
                        for start, size in zip(config.pool_starts, config.pool_sizes)], axis=1)

    pools = pool_of(config, jnp.arange(nb))
    charged = s.blocks.payer >= 0
    recl = charged & (s.blocks.pin_count == 0) & (s.blocks.ref_count == s.blocks.payer_refs)
    seg = jnp.where(recl, s.blocks.payer * npools + pools, ntn * npools)
    reclaim = jax.ops.segment_sum(recl.astype(jnp.int32), seg, num_segments=ntn * npools + 1)
    reclaim = reclaim[:-1].reshape(ntn, npools)

    device = jnp.asarray(config.device_pools)[pools]
    slack = jnp.where(charged & device, p - s.blocks.fill, 0)
    frag = jax.ops.segment_sum(slack, jnp.where(charged & device, s.blocks.payer, ntn),
                               num_segments=ntn + 1)[:-1]
    return Ledger(
        used_tokens=s.tenants.used_tokens,
        token_quota=s.tenants.token_quota,
        byte_quota_units=s.tenants.byte_quota,
        charged_blocks=s.tenants.charged_blocks,
        pinned_blocks=s.tenants.pinned_blocks,
        shared_blocks=shared,
        reclaimable_blocks=reclaim,
        fragmentation=frag,
        free_blocks=allocatable(config, s),
        cold_blocks=s.free.cold_count,
        pool_fragmentation=slack.sum().astype(jnp.int32),
        growing=s.tenants.growing,
        preemptions=s.tenants.preemptions,
        pool_bytes=config.pool_bytes,
        unit_bytes=config.unit_bytes,
        pool_sizes=config.pool_sizes,
        host_pool=config.host_pool,
        host_watermark=config.host_watermark,
    )


ledger_view = jax.jit(ledger, static_argnums=(0,))
