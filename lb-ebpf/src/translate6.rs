//! The IPv6 translation of `lb_ingress6`, as translate.rs's for IPv4: parse, conntrack lookup,
//! and for a new connection the frontend, its endpoint list, backend selection and tracking.
//!
//! Done so far (docs/ipv6.md, step 2): new TCP/UDP connections to a frontend, masqueraded
//! (kube-proxy's KUBE-MARK-MASQ cases: hairpin, NodePorts, clients outside the cluster CIDR)
//! or not, both directions rewritten here in full and handed to the stack to route. IPv6 has no
//! martian source check, so unlike IPv4 (intermediate.rs) the masquerade source is written
//! before routing too. ICMPv6 errors about tracked connections are reverse-translated
//! (icmp6.rs). Passed untouched: fragments; a service without endpoints is dropped (REJECT's
//! ICMPv6 answer is a parity row).
use aya_ebpf::{macros::map, maps::PerCpuArray};
use lb_common::{
    Addr6, BackendKey, CONFIG_F_MASQUERADE_ALL, CONFIG_F_READY, Config, Config6, ConntrackKey6,
    Counter, FRONTEND_F_LOCAL, FRONTEND_F_MASQUERADE, FRONTEND_F_PRESERVE_SOURCE,
    FRONTEND_F_SOURCE_RANGES, Frontend, FrontendKey6, LOCAL_SLOT, SCHED_ROUND_ROBIN,
};

use crate::{
    conntrack6, icmp6, maps, masquerade, nat6,
    packet::PacketAccess,
    parse::Fragment,
    parse6::{self, IPPROTO_ICMPV6, Packet6},
};

/// This CPU's parsed packet, for `established` and `open`.
#[map(name = "LB_PACKET6_SCRATCH_V1")]
static PARSED: PerCpuArray<Packet6> = PerCpuArray::with_max_entries(1, 0);

/// Translates the packet in place (handed to the stack to route); `Err` carries the counter of
/// why it is not.
///
/// The parsed packet goes to a per-CPU scratch entry, and the translation proper runs in frames
/// of their own that read it from there: the verifier then follows them once rather than once
/// per shape of the packet the parser's extension header walk tells apart, and their frames do
/// not stack on the parser's.
#[inline(always)]
pub fn translation<P: PacketAccess>(ctx: &P) -> Result<(), Counter> {
    let packet = parse6::packet(ctx)?;
    if packet.fragment != Fragment::Whole {
        return Err(Counter::PassedFragment);
    }
    // The stack answers an expiring packet (time exceeded) about the address the client used.
    if packet.hop_limit <= 1 {
        return Err(Counter::Passed);
    }
    let icmp = packet.tuple.proto == IPPROTO_ICMPV6;
    let parsed = PARSED.get_ptr_mut(0).ok_or(Counter::Passed)?;
    // SAFETY: this CPU's own entry, valid until the program returns; tc programs are not
    // preempted while they run, and its readers read it only after this write.
    unsafe { *parsed = packet };
    if icmp {
        return icmp6::reverse_error(ctx);
    }
    if established(ctx)? {
        return Ok(());
    }
    open(ctx)
}

/// The packet parsed (`PARSED`).
pub fn parsed() -> Result<&'static Packet6, Counter> {
    // SAFETY: as in `translation`, which wrote it.
    Ok(unsafe { &*PARSED.get_ptr(0).ok_or(Counter::Passed)? })
}

/// Translates the packet (`PARSED`) of a live connection: `Ok(false)` when it has none.
#[inline(never)]
fn established<P: PacketAccess>(ctx: &P) -> Result<bool, Counter> {
    let packet = parsed()?;
    let config = maps::config()
        .filter(|config| config.flags & CONFIG_F_READY != 0)
        .ok_or(Counter::Passed)?;
    let Some(to) = conntrack6::lookup(packet, config, maps::now_ns(config)) else {
        return Ok(false);
    };
    maps::count(Counter::Translated);
    nat6::rewrite(ctx, packet, &to)?;
    Ok(true)
}

/// A packet (`PARSED`) without a live connection: the frontend it is addressed to, its endpoint
/// list, backend selection, the masquerade source, tracking and the rewrite.
#[inline(never)]
fn open<P: PacketAccess>(ctx: &P) -> Result<(), Counter> {
    let packet = parsed()?;
    let config = maps::config().ok_or(Counter::Passed)?;
    let config6 = maps::config6().ok_or(Counter::Passed)?;
    let tuple = &packet.tuple;
    let frontend = frontend(tuple)?;
    // Source ranges are not checked over IPv6 yet: such a frontend is not served rather than
    // served to every source.
    if frontend.flags & FRONTEND_F_SOURCE_RANGES != 0 {
        return Err(Counter::Passed);
    }
    let state = conntrack6::opening_state(packet)?;
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
    let masquerade = masquerade_needed(config, config6, &frontend, &tuple.src_addr, &backend.addr)
        .then(|| masquerade::source6(ctx, config6, &tuple.src_addr, &backend.addr));
    conntrack6::track_new(packet, service_id, &backend, state, masquerade.as_ref())?;
    nat6::rewrite(ctx, packet, &conntrack6::rewrite_of_new(tuple.proto)?)
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
