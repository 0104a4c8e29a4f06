//! Flows that stick to an endpoint: sessionAffinity ClientIP, as kube-proxy's `recent` match (a
//! client's new connection goes to the endpoint of its previous one while it has been idle less
//! than the timeout), and the node's unconnected UDP sockets (sock.rs). Both families, keyed by
//! the client's address of its family.
use lb_common::{Frontend, sticky::Sticky};

use crate::{family::Family, service::Backends};

const SECOND_NS: u64 = 1_000_000_000;

/// The client's endpoint and its slot, if still valid (see [`reuse`]).
// Inlined, as `reuse`: a BPF function cannot return a result larger than a register (an IPv6
// endpoint's), which comes back through a pointer to the caller's stack.
#[inline(always)]
pub fn lookup<F: Family>(
    frontend: &Frontend,
    backends: &Backends<F>,
    client: &F::Addr,
    now: u64,
) -> Option<(u32, F::Backend)> {
    let entry = F::affinity(frontend.service_id, client)?;
    let timeout = u64::from(frontend.affinity_timeout_s) * SECOND_NS;
    reuse(entry, backends, timeout, now)
}

/// `entry`'s endpoint and slot if it was used less than `timeout_ns` ago and is still in the
/// slot of `backends` it was chosen from; refreshed (`Sticky::reuse`).
#[inline(always)]
pub fn reuse<F: Family>(
    entry: &mut F::Sticky,
    backends: &Backends<F>,
    timeout_ns: u64,
    now: u64,
) -> Option<(u32, F::Backend)> {
    entry.reuse(timeout_ns, now, |slot| {
        backends.contains(slot).then(|| backends.at(slot)).flatten()
    })
}

/// Remembers that the client's new connection went to `backend` in `slot`.
pub fn remember<F: Family>(
    frontend: &Frontend,
    client: &F::Addr,
    slot: u32,
    backend: &F::Backend,
    now: u64,
) {
    F::affinity_insert(
        frontend.service_id,
        client,
        &F::Sticky::new(slot, *backend, now),
    );
}
