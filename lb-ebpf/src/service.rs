//! Frontend lookup and backend selection.
use lb_common::{Backend, BackendKey, ConntrackKey, Counter, Frontend, FrontendKey};

use crate::{affinity, maps};

/// The frontend `tuple` is addressed to: its exact port, else the catch-all of a ClusterIP.
pub fn frontend(tuple: &ConntrackKey) -> Option<Frontend> {
    maps::frontend(&FrontendKey {
        addr: tuple.dst_addr,
        port: tuple.dst_port,
        proto: tuple.proto,
        _pad: 0,
    })
    .or_else(|| maps::frontend(&FrontendKey::any_port(tuple.dst_addr)))
}

/// The backend of a new connection from `client`: its affine one if the service has
/// sessionAffinity and it is still valid, else a uniformly random one, as kube-proxy's iptables
/// `statistic --mode random` chain picks it. The modulo bias is below 2^-32 * backend_count.
pub fn select_backend(frontend: &Frontend, client: u32, now: u64) -> Result<Backend, Counter> {
    let affine = frontend.affinity_timeout_s != 0;
    if affine && let Some(backend) = affinity::lookup(frontend, client, now) {
        return Ok(backend);
    }
    let slot = maps::random()
        .checked_rem(frontend.backend_count)
        .ok_or(Counter::DropNoBackend)?;
    let backend = maps::backend(&BackendKey {
        service_id: frontend.service_id,
        slot,
    })
    .ok_or(Counter::DropNoBackend)?;
    if affine {
        affinity::remember(frontend, client, slot, &backend, now);
    }
    Ok(backend)
}
