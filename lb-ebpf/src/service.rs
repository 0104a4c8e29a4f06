//! Frontend lookup and backend selection.
use lb_common::{Backend, BackendKey, ConntrackKey, Counter, Frontend, FrontendKey};

use crate::maps;

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

/// A uniformly random backend, as kube-proxy's iptables `statistic --mode random` chain picks one.
/// The modulo bias is below 2^-32 * backend_count.
pub fn select_backend(frontend: &Frontend) -> Result<Backend, Counter> {
    let slot = maps::random()
        .checked_rem(frontend.backend_count)
        .ok_or(Counter::DropNoBackend)?;
    maps::backend(&BackendKey {
        service_id: frontend.service_id,
        slot,
    })
    .ok_or(Counter::DropNoBackend)
}
