//! The translation core shared by `lb_ingress` (tc) and `lb_xdp`: parse, conntrack lookup, and
//! for a new connection the frontend, its endpoint list, backend selection and tracking. What
//! the packet becomes is decided here; rewriting and sending it is the programs' part. ICMP is
//! only told apart here: its errors are tc's (icmp.rs). Fragments follow their first (fragment.rs).
use lb_common::{
    CONFIG_F_READY, CT_F_MASQUERADE, Config, ConntrackKey, Counter, Frontend, IPPROTO_ICMP,
};

use crate::{
    conntrack::{self, Claim, Connection},
    family::Ipv4,
    forward::CachedRoute,
    fragment, intermediate, maps, masquerade,
    packet::PacketAccess,
    parse::{self, Fragment, Packet},
    service::{self, Backends},
};

pub enum Translation {
    /// Rewrite the packet to the tuple `to` (its connection is tracked); `route`: the one its
    /// conntrack entry caches (none for a new connection); `ct_flags`: its entry's `CT_F_*` (a
    /// byte, not a bool: a bool's niche would hold the enum's tag at an offset whose BTF the
    /// kernel refuses, see conntrack::Tracked).
    To {
        packet: Packet,
        to: ConntrackKey,
        route: Option<CachedRoute>,
        ct_flags: u8,
    },
    /// A new connection to a service without endpoints: kube-proxy answers it with REJECT.
    Reject(Packet),
    /// An ICMP message: an error about a tracked connection is reverse-translated (icmp.rs).
    Icmp(Packet),
}

/// `Err` carries the counter of why the packet is not translated.
// Inlined into each program, as are the functions it calls with many arguments: BPF passes at
// most five in registers and has no stack arguments.
#[inline(always)]
pub fn translation<P: PacketAccess>(ctx: &P) -> Result<Translation, Counter> {
    let mut packet = parse::packet(ctx)?;
    // XDP leaves fragments to tc: they are few, and one path is simpler to keep right.
    if P::IS_XDP && packet.fragment != Fragment::Whole {
        return Err(Counter::XdpPassed);
    }
    let config = maps::config()
        .filter(|config| config.flags & CONFIG_F_READY != 0)
        .ok_or(Counter::Passed)?;
    // The stack answers an expiring packet (ICMP time exceeded) about the address the client
    // used, so it must see the packet untranslated.
    if packet.ttl <= 1 {
        return Err(Counter::Passed);
    }
    if packet.tuple.proto == IPPROTO_ICMP {
        return Ok(Translation::Icmp(packet));
    }
    let now = maps::now_ns(config);
    fragment::follow(ctx, &mut packet, now)?;
    conntrack::in_window(ctx, &packet)?;
    if let Some(conntrack::Tracked { entry, to }) = conntrack::lookup(ctx, &packet, config, now) {
        maps::count(Counter::Translated);
        maps::count_backend(entry.stats_slot, entry.stats_owner, packet.tot_len);
        let route = CachedRoute::of(entry);
        let ct_flags = entry.flags;
        return Ok(Translation::To {
            packet,
            to,
            route,
            ct_flags,
        });
    }
    // Only a first fragment (or a whole datagram) can open a connection.
    if packet.fragment == Fragment::Later {
        return Err(Counter::PassedFragment);
    }
    let frontend = service::frontend(&packet.tuple)?;
    let state = conntrack::opening_state(&packet)?;
    let backends = service::backends(config, &frontend, packet.tuple.src_addr);
    if backends.count == 0 {
        // kube-proxy rejects when the service has no endpoints at all, and drops when traffic
        // policy Local finds none on this node.
        if frontend.backend_count != 0 {
            return Err(Counter::DropNoLocalBackend);
        }
        return Ok(Translation::Reject(packet));
    }
    // XDP opens no connection (what it can refuse, it has refused): tc, at the same packet, has
    // the stack that claiming a connection's tuples and the early drop of an unconfirmed
    // holder of a masquerade port need.
    if P::IS_XDP {
        return Err(Counter::XdpPassed);
    }
    let (to, ct_flags) = connect(ctx, config, &frontend, &backends, &packet, state, now)?;
    conntrack::opened(ctx, &packet);
    Ok(Translation::To {
        packet,
        to,
        route: Some(CachedRoute::NONE),
        ct_flags,
    })
}

/// A packet without a live connection to `frontend`: pick a backend of `backends` (not empty)
/// and track the new connection, opening in `state`. Returns the tuple to rewrite the packet
/// to, and the `CT_F_*` of its original entry (`CT_F_MASQUERADE` or 0).
#[inline(always)]
fn connect<P: PacketAccess>(
    ctx: &P,
    config: &Config,
    frontend: &Frontend,
    backends: &Backends<Ipv4>,
    packet: &Packet,
    state: u8,
    now: u64,
) -> Result<(ConntrackKey, u8), Counter> {
    let tuple = &packet.tuple;
    let (_, backend) = service::select_backend(frontend, backends, tuple, now)?;
    let masquerade = lb_common::masquerade::needed(config, frontend, tuple.src_addr, &backend);
    let connection = Connection::new(tuple, frontend.service_id, &backend, masquerade, state, now);
    // Not masqueraded, the backend sees the client's own source unless another connection's
    // translated tuple is the same (a client reaching two frontends of one backend from one
    // port); then, as for masquerade, a port of the range.
    let (src_addr, own_source) = if masquerade {
        (
            masquerade::source(ctx, config, tuple.src_addr, backend.addr),
            None,
        )
    } else {
        let own = (connection.claim_reply(tuple.src_addr, tuple.src_port, false)?
            == Claim::Claimed)
            .then(|| connection.translated(tuple.src_addr, tuple.src_port));
        (tuple.src_addr, own)
    };
    let to = match own_source {
        Some(to) => to,
        None => match masquerade::claim_source(config, &connection, src_addr)? {
            Some(to) => to,
            None if masquerade => {
                maps::count_backend_ports_exhausted(u32::from(backend.stats_slot));
                return Err(Counter::DropSnatPortsExhausted);
            }
            None => return Err(Counter::DropTupleClash),
        },
    };
    if !intermediate::claim(&connection, &to) {
        maps::unconfirmed_remove(&conntrack::reversed(&to));
        return Err(Counter::DropTupleClash);
    }
    // Also for a race lost to another CPU's entry: the same client, to the same frontend.
    let ct_flags = if masquerade { CT_F_MASQUERADE } else { 0 };
    match connection.track_original(&to)? {
        None => {
            maps::count(Counter::NewConnection);
            if masquerade {
                maps::count(Counter::Masqueraded);
            }
            maps::count_backend_connection(u32::from(backend.stats_slot), packet.tot_len);
            Ok((to, ct_flags))
        }
        Some(theirs) => {
            maps::count(Counter::Translated);
            Ok((theirs, ct_flags))
        }
    }
}
