//! The IPv6 translation of `lb_ingress6`, as translate.rs's for IPv4: parse, conntrack lookup,
//! and for a new connection the frontend, its endpoint list, backend selection and tracking.
//!
//! Done so far (docs/ipv6.md, step 2): connections whose source the backend sees unchanged
//! (ClusterIPs from pods), both directions rewritten here and handed to the stack to route. What
//! needs more is passed untouched: a connection that would be masqueraded, fragments, ICMPv6
//! errors; a service without endpoints is dropped (REJECT's ICMPv6 answer is a parity row).
use lb_common::{
    Addr6, BackendKey, CONFIG_F_MASQUERADE_ALL, CONFIG_F_READY, Config, Config6, ConntrackKey6,
    Counter, FRONTEND_F_LOCAL, FRONTEND_F_MASQUERADE, FRONTEND_F_PRESERVE_SOURCE, Frontend,
    FrontendKey6, LOCAL_SLOT, SCHED_ROUND_ROBIN,
};

use crate::{
    conntrack6, maps,
    packet::PacketAccess,
    parse::Fragment,
    parse6::{self, IPPROTO_ICMPV6, Packet6},
};

/// The packet and the tuple it is rewritten to; `Err` carries the counter of why it is not.
#[inline(always)]
pub fn translation<P: PacketAccess>(ctx: &P) -> Result<(Packet6, ConntrackKey6), Counter> {
    let packet = parse6::packet(ctx)?;
    if packet.tuple.proto == IPPROTO_ICMPV6 {
        return Err(Counter::Passed);
    }
    if packet.fragment != Fragment::Whole {
        return Err(Counter::PassedFragment);
    }
    let config = maps::config()
        .filter(|config| config.flags & CONFIG_F_READY != 0)
        .ok_or(Counter::Passed)?;
    let config6 = maps::config6().ok_or(Counter::Passed)?;
    // The stack answers an expiring packet (time exceeded) about the address the client used.
    if packet.hop_limit <= 1 {
        return Err(Counter::Passed);
    }
    let now = maps::now_ns(config);
    if let Some(to) = conntrack6::lookup(&packet, config, now) {
        maps::count(Counter::Translated);
        return Ok((packet, to));
    }
    let tuple = &packet.tuple;
    let frontend = frontend(tuple)?;
    let state = conntrack6::opening_state(&packet)?;
    let (service_id, base, count) = backends(config6, &frontend, &tuple.src_addr);
    if count == 0 {
        return Err(if frontend.backend_count != 0 {
            Counter::DropNoLocalBackend
        } else {
            Counter::DropNoBackend
        });
    }
    let pick = if frontend.scheduler == SCHED_ROUND_ROBIN {
        maps::round_robin(service_id)
    } else {
        maps::random()
    };
    let slot = base | pick.checked_rem(count).ok_or(Counter::DropNoBackend)?;
    let backend = maps::backend6(&BackendKey { service_id, slot }).ok_or(Counter::DropNoBackend)?;
    if masquerade_needed(config, config6, &frontend, &tuple.src_addr, &backend.addr) {
        return Err(Counter::Passed);
    }
    let to = conntrack6::track_new(tuple, service_id, &backend, state, packet.len, now)?;
    Ok((packet, to))
}

/// The frontend a new connection `tuple` is addressed to: its exact port, else the catch-all of
/// a ClusterIP.
pub fn frontend(tuple: &ConntrackKey6) -> Result<Frontend, Counter> {
    maps::frontend6(&FrontendKey6 {
        addr: tuple.dst_addr,
        port: tuple.dst_port,
        proto: tuple.proto,
        _pad: 0,
    })
    .or_else(|| maps::frontend6(&FrontendKey6::any_port(tuple.dst_addr)))
    .ok_or(Counter::Passed)
}

/// The endpoint list a new connection from `client` uses, as service::backends: its service id,
/// first slot and length.
pub fn backends(config6: &Config6, frontend: &Frontend, client: &Addr6) -> (u32, u32, u32) {
    let local = frontend.flags & FRONTEND_F_LOCAL != 0
        && !(in_cluster(config6, client) && frontend.flags & FRONTEND_F_PRESERVE_SOURCE != 0);
    if local {
        (frontend.service_id, LOCAL_SLOT, frontend.local_count)
    } else {
        (frontend.service_id, 0, frontend.backend_count)
    }
}

/// `client` is in the IPv6 --cluster-cidr (an unset one, all zero, holds every address).
fn in_cluster(config6: &Config6, client: &Addr6) -> bool {
    let (addr, mask) = (&config6.cluster_cidr_addr, &config6.cluster_cidr_mask);
    client.w0 & mask.w0 == addr.w0
        && client.w1 & mask.w1 == addr.w1
        && client.w2 & mask.w2 == addr.w2
        && client.w3 & mask.w3 == addr.w3
}

/// kube-proxy's KUBE-MARK-MASQ cases, as masquerade::needed.
fn masquerade_needed(
    config: &Config,
    config6: &Config6,
    frontend: &Frontend,
    client: &Addr6,
    backend: &Addr6,
) -> bool {
    let preserve = frontend.flags & FRONTEND_F_PRESERVE_SOURCE != 0;
    client == backend
        || !preserve
            && (config.flags & CONFIG_F_MASQUERADE_ALL != 0
                || frontend.flags & FRONTEND_F_MASQUERADE != 0
                || !in_cluster(config6, client))
}
