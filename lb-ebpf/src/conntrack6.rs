//! IPv6 connection tracking, as conntrack.rs's for IPv4: two entries per connection in
//! `CONNTRACK6`, each keyed by the 5-tuple of one direction as it arrives and holding what that
//! direction is rewritten to; an entry's peer is keyed by its own rewrite turned around. The TCP
//! and UDP state machines and timeouts are lb_common's, shared with IPv4.
use aya_ebpf::bindings::BPF_NOEXIST;
use lb_common::{
    Backend6, CT_F_REPLY, CT_UDP_UNREPLIED, Config, ConntrackEntry6, ConntrackKey6, Counter,
    IPPROTO_TCP, conntrack_timeout_ns,
    tcp::{self, Step},
    udp_step,
};

use crate::{maps, parse6::Packet6};

/// `last_seen_ns` is refreshed at most this often, as IPv4's entries are.
const REFRESH_NS: u64 = 1_000_000_000;

/// The tuple a live connection's packet `packet` is rewritten to; `None` when it has none (or
/// opens a new connection on the tuple of a closed one). Keeps both entries fresh and in the
/// same state.
#[inline(always)]
pub fn lookup(packet: &Packet6, config: &Config, now: u64) -> Option<ConntrackKey6> {
    let proto = packet.tuple.proto;
    let entry = maps::conntrack6(&packet.tuple)?;
    if now.saturating_sub(entry.last_seen_ns)
        > conntrack_timeout_ns(proto, entry.state, &config.timeouts)
    {
        return None;
    }
    let reply = entry.flags & CT_F_REPLY != 0;
    let state = if proto != IPPROTO_TCP {
        udp_step(entry.state, reply)
    } else if tcp::reopens(entry.state, reply, packet.tcp_flags) {
        return None;
    } else {
        match tcp::step(entry.state, reply, packet.tcp_flags) {
            Step::To(next) => next,
            Step::Ignore | Step::Invalid => entry.state,
        }
    };
    let to = rewrite_of(entry, proto);
    let refresh = now.saturating_sub(entry.last_seen_ns) > REFRESH_NS;
    if state != entry.state || refresh {
        update(entry, state, refresh, now);
        if let Some(peer) = maps::conntrack6(&reversed(&to)) {
            update(peer, state, refresh, now);
        }
    }
    maps::count_backend(entry.stats_slot, entry.stats_owner, packet.len);
    Some(to)
}

fn update(entry: &mut ConntrackEntry6, state: u8, refresh: bool, now: u64) {
    entry.state = state;
    if refresh {
        entry.last_seen_ns = now;
    }
}

/// The state a connection opened by `packet` starts in. `Err(PassedTcpNoConnection)` for a TCP
/// segment that opens none (RST, FIN, SYN-ACK).
pub fn opening_state(packet: &Packet6) -> Result<u8, Counter> {
    if packet.tuple.proto != IPPROTO_TCP {
        return Ok(CT_UDP_UNREPLIED);
    }
    tcp::opening_state(packet.tcp_flags).ok_or(Counter::PassedTcpNoConnection)
}

/// Tracks the new connection `tuple` to `backend` of service `service_id`, opening in `state`
/// with a first packet of `bytes`: its reply entry first, so that a clash with another
/// connection's reply tuple (a client reaching two frontends of one backend from one port) is
/// refused before anything is written. Returns the tuple the packet is rewritten to: this
/// connection's, or that of another CPU's that tracked the same tuple first.
#[inline(always)]
pub fn track_new(
    tuple: &ConntrackKey6,
    service_id: u32,
    backend: &Backend6,
    state: u8,
    bytes: u16,
    now: u64,
) -> Result<ConntrackKey6, Counter> {
    let to = ConntrackKey6 {
        dst_addr: backend.addr,
        dst_port: backend.port,
        ..*tuple
    };
    let stats_slot = u32::from(backend.stats_slot);
    let stats_owner = maps::backend_stats_owner(stats_slot);
    let entry = |rewrite: &ConntrackKey6, flags: u8| ConntrackEntry6 {
        last_seen_ns: now,
        src_addr: rewrite.src_addr,
        dst_addr: rewrite.dst_addr,
        src_port: rewrite.src_port,
        dst_port: rewrite.dst_port,
        service_id,
        state,
        flags,
        stats_slot,
        stats_owner,
        ..ConntrackEntry6::default()
    };
    let reply_key = reversed(&to);
    if !maps::conntrack6_insert(
        &reply_key,
        &entry(&reversed(tuple), CT_F_REPLY),
        BPF_NOEXIST,
    ) {
        // Another connection's live reply tuple, or the map refused it.
        return match maps::conntrack6(&reply_key) {
            Some(theirs) if rewrite_of(theirs, tuple.proto) == reversed(tuple) => {
                Ok(reversed(&reply_key))
            }
            Some(_) => Err(Counter::DropTupleClash),
            None => Err(Counter::DropConntrackFull),
        };
    }
    if !maps::conntrack6_insert(tuple, &entry(&to, 0), BPF_NOEXIST) {
        maps::conntrack6_remove(&reply_key);
        // Another CPU tracked the same client first: its connection is this one.
        let theirs = maps::conntrack6(tuple).ok_or(Counter::DropConntrackFull)?;
        return Ok(rewrite_of(theirs, tuple.proto));
    }
    maps::count(Counter::NewConnection);
    maps::count_backend_connection(stats_slot, bytes);
    Ok(to)
}

pub fn rewrite_of(entry: &ConntrackEntry6, proto: u8) -> ConntrackKey6 {
    ConntrackKey6 {
        src_addr: entry.src_addr,
        dst_addr: entry.dst_addr,
        src_port: entry.src_port,
        dst_port: entry.dst_port,
        proto,
        _pad0: 0,
        _pad1: 0,
    }
}

pub fn reversed(tuple: &ConntrackKey6) -> ConntrackKey6 {
    ConntrackKey6 {
        src_addr: tuple.dst_addr,
        dst_addr: tuple.src_addr,
        src_port: tuple.dst_port,
        dst_port: tuple.src_port,
        proto: tuple.proto,
        _pad0: 0,
        _pad1: 0,
    }
}
