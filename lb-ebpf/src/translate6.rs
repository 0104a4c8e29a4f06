//! The IPv6 translation of `lb_ingress6`, as translate.rs's for IPv4: parse, conntrack lookup,
//! and for a new connection the frontend, its endpoint list, backend selection and tracking.
//!
//! Backend selection (sessionAffinity, the schedulers) is IPv4's: service.rs's, generic over
//! the family (docs/ipv6.md, step 3).
//!
//! Done so far (docs/ipv6.md, step 2): new TCP/UDP connections to a frontend, masqueraded
//! (kube-proxy's KUBE-MARK-MASQ cases: hairpin, NodePorts, clients outside the cluster CIDR)
//! or not, both directions rewritten in full (`rewrite`, once the caller has decided where the
//! packet goes: XDP decides before touching it) and routed by the stack or redirected (ipv6.rs).
//! IPv6 has no martian source check, so unlike IPv4 (intermediate.rs) the masquerade source is
//! written before the stack routes too. A service without endpoints is rejected (reject6.rs), a source outside a
//! LoadBalancer IP's loadBalancerSourceRanges dropped, as over IPv4. ICMPv6 errors about tracked
//! connections are reverse-translated (icmp6.rs). Fragments follow their first (fragment6.rs).
use aya_ebpf::{macros::map, maps::PerCpuArray};
use lb_common::{
    Addr6, CONFIG_F_MASQUERADE_ALL, CONFIG_F_READY, Config, Config6, ConntrackKey6, Counter,
    FRONTEND_F_MASQUERADE, FRONTEND_F_PRESERVE_SOURCE, FRONTEND_F_SOURCE_RANGES, Frontend,
    FrontendKey6,
};

use crate::{
    conntrack6,
    family::Ipv6,
    fragment6, icmp6, maps, masquerade, nat6,
    packet::PacketAccess,
    parse::Fragment,
    parse6::{self, IPPROTO_ICMPV6, Packet6},
    service::{self, Backends},
};

/// This CPU's parsed packet, for `established` and `open`.
#[map(name = "LB_PACKET6_SCRATCH_V1")]
static PARSED: PerCpuArray<Packet6> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's packet's translation (the tuple it is rewritten to), for `rewrite`: an IPv6 tuple
/// is too big for a BPF function to return.
#[map(name = "LB_REWRITE6_SCRATCH_V1")]
static REWRITE: PerCpuArray<ConntrackKey6> = PerCpuArray::with_max_entries(1, 0);

/// What `translation` made of a packet.
pub enum Translation6 {
    /// A TCP/UDP packet of a tracked connection (new or not), to be rewritten to `rewrite_to`
    /// (`rewrite`).
    Tracked,
    /// An ICMPv6 error about a tracked connection, reverse-translated in place.
    Icmp,
    /// A new connection to a service without endpoints (the packet `parsed`): kube-proxy
    /// answers it with REJECT.
    Reject,
}

/// Translates the packet in place, or tells it is to be rejected; `Err` carries the counter of
/// why it is neither.
///
/// The parsed packet goes to a per-CPU scratch entry, and the translation proper runs in frames
/// of their own that read it from there: the verifier then follows them once rather than once
/// per shape of the packet the parser's extension header walk tells apart, and their frames do
/// not stack on the parser's.
#[inline(always)]
pub fn translation<P: PacketAccess>(ctx: &P) -> Result<Translation6, Counter> {
    if parse(ctx)? == IPPROTO_ICMPV6 {
        return icmp6::reverse_error(ctx).map(|()| Translation6::Icmp);
    }
    connection(ctx)
}

/// The connection of the TCP/UDP packet `parse` parsed: `Tracked` (its translation in
/// `REWRITE`, the packet untouched) or `Reject`.
#[inline(always)]
pub fn connection<P: PacketAccess>(ctx: &P) -> Result<Translation6, Counter> {
    fragment6::follow(parsed_mut()?)?;
    if established()? {
        return Ok(Translation6::Tracked);
    }
    open(ctx)
}

/// Parses the packet into `PARSED` and returns its protocol, or why it is not translated. A
/// frame of its own: the parsed packet is on the stack only until it is stored, not under the
/// translation's frames (the program's stack is 512 bytes for the deepest chain of frames).
#[inline(never)]
pub fn parse<P: PacketAccess>(ctx: &P) -> Result<u8, Counter> {
    let packet = parse6::packet(ctx)?;
    // The stack answers an expiring packet (time exceeded) about the address the client used.
    if packet.hop_limit <= 1 {
        return Err(Counter::Passed);
    }
    let proto = packet.tuple.proto;
    *parsed_mut()? = packet;
    Ok(proto)
}

/// The packet parsed (`PARSED`).
pub fn parsed() -> Result<&'static Packet6, Counter> {
    // SAFETY: as in `parsed_mut`.
    Ok(unsafe { &*PARSED.get_ptr(0).ok_or(Counter::Passed)? })
}

/// The packet parsed, to write: by `parse`, and by `fragment6::follow` before the translation
/// reads it.
fn parsed_mut() -> Result<&'static mut Packet6, Counter> {
    let parsed = PARSED.get_ptr_mut(0).ok_or(Counter::Passed)?;
    // SAFETY: this CPU's own entry, valid until the program returns; tc programs are not
    // preempted while they run, and each user takes it afresh rather than holding it.
    Ok(unsafe { &mut *parsed })
}

/// The tuple the packet is rewritten to, written by `connection`.
pub fn rewrite_to() -> Result<&'static ConntrackKey6, Counter> {
    // SAFETY: as in `parsed`.
    Ok(unsafe { &*REWRITE.get_ptr(0).ok_or(Counter::Passed)? })
}

fn set_rewrite_to(to: &ConntrackKey6) -> Result<(), Counter> {
    let rewrite = REWRITE.get_ptr_mut(0).ok_or(Counter::Passed)?;
    // SAFETY: as in `parsed_mut`.
    unsafe { *rewrite = *to };
    Ok(())
}

/// Rewrites the packet (`PARSED`) to its translation (`REWRITE`). A frame of its own, called
/// once the translation's frames have returned.
#[inline(never)]
pub fn rewrite<P: PacketAccess>(ctx: &P) -> Result<(), Counter> {
    nat6::rewrite(ctx, parsed()?, rewrite_to()?)
}

/// Finds the translation of the packet (`PARSED`) of a live connection: `Ok(false)` when it has
/// none.
#[inline(never)]
fn established() -> Result<bool, Counter> {
    let packet = parsed()?;
    let config = maps::config()
        .filter(|config| config.flags & CONFIG_F_READY != 0)
        .ok_or(Counter::Passed)?;
    let Some(to) = conntrack6::lookup(packet, config, maps::now_ns(config)) else {
        return Ok(false);
    };
    maps::count(Counter::Translated);
    set_rewrite_to(&to)?;
    Ok(true)
}

/// A packet (`PARSED`) without a live connection: the frontend it is addressed to, its endpoint
/// list, backend selection (sessionAffinity and the schedulers, as IPv4's), the masquerade
/// source, tracking and the translation.
#[inline(never)]
fn open<P: PacketAccess>(ctx: &P) -> Result<Translation6, Counter> {
    let packet = parsed()?;
    // Only a first fragment (or a whole datagram) can open a connection.
    if packet.fragment == Fragment::Later {
        return Err(Counter::PassedFragment);
    }
    let config = maps::config().ok_or(Counter::Passed)?;
    let config6 = maps::config6().ok_or(Counter::Passed)?;
    let tuple = &packet.tuple;
    let frontend = frontend(tuple)?;
    let state = conntrack6::opening_state(packet)?;
    let backends = backends(config6, &frontend, &tuple.src_addr);
    if backends.count == 0 {
        // As over IPv4: kube-proxy rejects when the service has no endpoints at all, and drops
        // when traffic policy Local finds none on this node.
        if frontend.backend_count != 0 {
            return Err(Counter::DropNoLocalBackend);
        }
        return Ok(Translation6::Reject);
    }
    let (_, backend) = service::select_backend(&frontend, &backends, tuple, maps::now_ns(config))?;
    let masquerade = masquerade_needed(config, config6, &frontend, &tuple.src_addr, &backend.addr)
        .then(|| masquerade::source6(ctx, config6, &tuple.src_addr, &backend.addr));
    conntrack6::track_new(
        packet,
        frontend.service_id,
        &backend,
        state,
        masquerade.as_ref(),
    )?;
    set_rewrite_to(&conntrack6::rewrite_of_new(tuple.proto)?)?;
    Ok(Translation6::Tracked)
}

/// The frontend a new connection `tuple` is addressed to: its exact port, else the catch-all of
/// a ClusterIP. As service::frontend: `Err(Passed)` when there is none, `Err(DropSourceRange)`
/// when it is a LoadBalancer IP whose loadBalancerSourceRanges do not hold the source.
pub fn frontend(tuple: &ConntrackKey6) -> Result<Frontend, Counter> {
    let frontend = maps::frontend6(&FrontendKey6 {
        addr: tuple.dst_addr,
        port: tuple.dst_port,
        proto: tuple.proto,
        _pad: 0,
    })
    .or_else(|| maps::frontend6(&FrontendKey6::any_port(tuple.dst_addr)))
    .ok_or(Counter::Passed)?;
    if frontend.flags & FRONTEND_F_SOURCE_RANGES != 0
        && !maps::source_range6_contains(frontend.service_id, &tuple.src_addr)
    {
        return Err(Counter::DropSourceRange);
    }
    Ok(frontend)
}

/// The IPv6 list a new connection from `client` uses (`Backends::of`).
pub fn backends(config6: &Config6, frontend: &Frontend, client: &Addr6) -> Backends<Ipv6> {
    Backends::of(frontend, in_cluster(config6, client))
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
