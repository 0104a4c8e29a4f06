//! Frontend lookup, which endpoint list a new connection uses, and backend selection.
use lb_common::{
    Backend, BackendKey, Config, ConntrackKey, Counter, FRONTEND_F_LOCAL,
    FRONTEND_F_PRESERVE_SOURCE, FRONTEND_F_SOURCE_RANGES, Frontend, FrontendKey, LOCAL_SLOT,
    SCHED_FLOW_HASH, SCHED_ROUND_ROBIN, SCHED_SOURCE_HASH, flow_hash, source_hash,
};

use crate::{affinity, maps};

/// The frontend a new connection `tuple` is addressed to: its exact port, else the catch-all of
/// a ClusterIP. `Err(Passed)` when there is none; `Err(DropSourceRange)` when it is a
/// LoadBalancer IP whose loadBalancerSourceRanges do not hold the source (kube-proxy's firewall
/// chain drops those).
pub fn frontend(tuple: &ConntrackKey) -> Result<Frontend, Counter> {
    let frontend = maps::frontend(&FrontendKey {
        addr: tuple.dst_addr,
        port: tuple.dst_port,
        proto: tuple.proto,
        _pad: 0,
    })
    .or_else(|| maps::frontend(&FrontendKey::any_port(tuple.dst_addr)))
    .ok_or(Counter::Passed)?;
    if frontend.flags & FRONTEND_F_SOURCE_RANGES != 0
        && !maps::source_range_contains(frontend.service_id, tuple.src_addr)
    {
        return Err(Counter::DropSourceRange);
    }
    Ok(frontend)
}

/// One endpoint list of a service port: slots `base..base + count`.
pub struct Backends {
    pub service_id: u32,
    pub base: u32,
    pub count: u32,
}

impl Backends {
    pub fn contains(&self, slot: u32) -> bool {
        slot & LOCAL_SLOT == self.base && slot & !LOCAL_SLOT < self.count
    }

    pub fn at(&self, slot: u32) -> Option<Backend> {
        maps::backend(&BackendKey {
            service_id: self.service_id,
            slot,
        })
    }
}

/// The list a new connection from `client` uses: Local for traffic policy Local, except pod
/// traffic to an externalTrafficPolicy Local NodePort, which kube-proxy sends to the Cluster
/// list.
pub fn backends(config: &Config, frontend: &Frontend, client: u32) -> Backends {
    let pod = client & config.cluster_cidr_mask == config.cluster_cidr_addr;
    let local = frontend.flags & FRONTEND_F_LOCAL != 0
        && !(pod && frontend.flags & FRONTEND_F_PRESERVE_SOURCE != 0);
    let (base, count) = if local {
        (LOCAL_SLOT, frontend.local_count)
    } else {
        (0, frontend.backend_count)
    };
    Backends {
        service_id: frontend.service_id,
        base,
        count,
    }
}

/// The backend of a new connection `tuple` among `backends` (not empty), and its slot: its affine
/// one if the service has sessionAffinity and it is still valid, else the scheduler's pick.
pub fn select_backend(
    frontend: &Frontend,
    backends: &Backends,
    tuple: &ConntrackKey,
    now: u64,
) -> Result<(u32, Backend), Counter> {
    let client = tuple.src_addr;
    let affine = frontend.affinity_timeout_s != 0;
    if affine && let Some(chosen) = affinity::lookup(frontend, backends, client, now) {
        return Ok(chosen);
    }
    let pick = match frontend.scheduler {
        SCHED_ROUND_ROBIN => maps::round_robin(frontend.service_id),
        SCHED_SOURCE_HASH => source_hash(client),
        SCHED_FLOW_HASH => flow_hash(tuple),
        // Random, as kube-proxy's iptables chains; the modulo bias is below 2^-32 * count.
        _ => maps::random(),
    };
    let slot = backends.base
        | pick
            .checked_rem(backends.count)
            .ok_or(Counter::DropNoBackend)?;
    let backend = backends.at(slot).ok_or(Counter::DropNoBackend)?;
    if affine {
        affinity::remember(frontend, client, slot, &backend, now);
    }
    Ok((slot, backend))
}
