//! Frontend lookup, which endpoint list a new connection uses, and backend selection, the last
//! two for both families.
use core::marker::PhantomData;

use lb_common::{
    BackendKey, Config, ConntrackKey, Counter, FRONTEND_F_LOCAL, FRONTEND_F_PRESERVE_SOURCE,
    FRONTEND_F_SOURCE_RANGES, Frontend, FrontendKey, LOCAL_SLOT, SCHED_FLOW_HASH,
    SCHED_ROUND_ROBIN, SCHED_SOURCE_HASH,
};

use crate::{
    affinity,
    family::{Family, Ipv4},
    maps,
};

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

/// One endpoint list of a service port in family `F`'s backends: slots `base..base + count`.
pub struct Backends<F> {
    pub service_id: u32,
    pub base: u32,
    pub count: u32,
    family: PhantomData<F>,
}

impl<F: Family> Backends<F> {
    /// The list a new connection uses: Local for traffic policy Local, except pod traffic
    /// (`from_pod`) to an externalTrafficPolicy Local NodePort, which kube-proxy sends to the
    /// Cluster list.
    pub fn of(frontend: &Frontend, from_pod: bool) -> Self {
        let local = frontend.flags & FRONTEND_F_LOCAL != 0
            && !(from_pod && frontend.flags & FRONTEND_F_PRESERVE_SOURCE != 0);
        let (base, count) = if local {
            (LOCAL_SLOT, frontend.local_count)
        } else {
            (0, frontend.backend_count)
        };
        Backends {
            service_id: frontend.service_id,
            base,
            count,
            family: PhantomData,
        }
    }

    /// The list of node-local traffic (the socket hooks), which kube-proxy treats as pod
    /// traffic: every endpoint of an externalTrafficPolicy Local NodePort (its local-traffic
    /// short circuit), the local ones of an internalTrafficPolicy Local ClusterIP.
    pub fn of_node(frontend: &Frontend) -> Self {
        Self::of(frontend, true)
    }

    pub fn contains(&self, slot: u32) -> bool {
        slot & LOCAL_SLOT == self.base && slot & !LOCAL_SLOT < self.count
    }

    pub fn at(&self, slot: u32) -> Option<F::Backend> {
        F::backend(&BackendKey {
            service_id: self.service_id,
            slot,
        })
    }
}

/// The IPv4 list a new connection from `client` uses ([`Backends::of`]).
pub fn backends(config: &Config, frontend: &Frontend, client: u32) -> Backends<Ipv4> {
    Backends::of(
        frontend,
        client & config.cluster_cidr_mask == config.cluster_cidr_addr,
    )
}

/// The backend of a new connection `tuple` among `backends` (not empty), and its slot: its affine
/// one if the service has sessionAffinity and it is still valid, else the scheduler's pick.
#[inline(always)]
pub fn select_backend<F: Family>(
    frontend: &Frontend,
    backends: &Backends<F>,
    tuple: &F::Tuple,
    now: u64,
) -> Result<(u32, F::Backend), Counter> {
    let mut chosen = (0, F::Backend::default());
    choose(frontend, backends, tuple, now, &mut chosen)?;
    Ok(chosen)
}

/// `select_backend`'s choice, written to `chosen` (slot, backend). Not returned: a result larger
/// than a register comes back through a pointer to the caller's stack, which the verifier does
/// not let a BPF function return (and its pointer would be a sixth argument, one too many).
fn choose<F: Family>(
    frontend: &Frontend,
    backends: &Backends<F>,
    tuple: &F::Tuple,
    now: u64,
    chosen: &mut (u32, F::Backend),
) -> Result<(), Counter> {
    let client = F::client(tuple);
    let affine = frontend.affinity_timeout_s != 0;
    if affine && let Some(affine_choice) = affinity::lookup(frontend, backends, client, now) {
        *chosen = affine_choice;
        return Ok(());
    }
    let pick = match frontend.scheduler {
        SCHED_ROUND_ROBIN => maps::round_robin(frontend.service_id),
        SCHED_SOURCE_HASH => F::source_hash(client),
        SCHED_FLOW_HASH => F::flow_hash(tuple),
        // Random, as kube-proxy's iptables chains; the modulo bias is below 2^-32 * count.
        _ => maps::random(),
    };
    let slot = backends.base
        | pick
            .checked_rem(backends.count)
            .ok_or(Counter::DropNoBackend)?;
    let backend = backends.at(slot).ok_or(Counter::DropNoBackend)?;
    if affine {
        affinity::remember::<F>(frontend, client, slot, &backend, now);
    }
    *chosen = (slot, backend);
    Ok(())
}
