//! Flows that stick to an endpoint: sessionAffinity ClientIP, as kube-proxy's `recent` match (a
//! client's new connection goes to the endpoint of its previous one while it has been idle less
//! than the timeout), and the node's unconnected UDP sockets (sock.rs).
use lb_common::{AffinityKey, Backend, Frontend, StickyBackend};

use crate::{maps, service::Backends};

const SECOND_NS: u64 = 1_000_000_000;

fn key(frontend: &Frontend, client: u32) -> AffinityKey {
    AffinityKey {
        service_id: frontend.service_id,
        client_addr: client,
    }
}

/// The client's endpoint and its slot, if still valid (see [`reuse`]).
pub fn lookup(
    frontend: &Frontend,
    backends: &Backends,
    client: u32,
    now: u64,
) -> Option<(u32, Backend)> {
    let entry = maps::affinity(&key(frontend, client))?;
    let timeout = u64::from(frontend.affinity_timeout_s) * SECOND_NS;
    reuse(entry, backends, timeout, now)
}

/// `entry`'s endpoint and slot if it was used less than `timeout_ns` ago and is still in the
/// slot of `backends` it was chosen from; refreshed.
pub fn reuse(
    entry: &mut StickyBackend,
    backends: &Backends,
    timeout_ns: u64,
    now: u64,
) -> Option<(u32, Backend)> {
    // Saturating: another CPU may have stored a later timestamp than our `now`.
    if now.saturating_sub(entry.last_seen_ns) > timeout_ns || !backends.contains(entry.slot) {
        return None;
    }
    let current = backends.at(entry.slot)?;
    // By endpoint: one whose counter slot changed (an agent upgrade gives every endpoint one)
    // keeps its flows.
    if current.endpoint() != entry.backend.endpoint() {
        return None;
    }
    entry.last_seen_ns = now;
    Some((entry.slot, current))
}

/// What remembers that a flow went to `backend` in `slot`.
pub fn remembered(slot: u32, backend: &Backend, now: u64) -> StickyBackend {
    StickyBackend {
        last_seen_ns: now,
        backend: *backend,
        slot,
        _pad: 0,
    }
}

/// Remembers that the client's new connection went to `backend` in `slot`.
pub fn remember(frontend: &Frontend, client: u32, slot: u32, backend: &Backend, now: u64) {
    maps::affinity_insert(&key(frontend, client), &remembered(slot, backend, now));
}
