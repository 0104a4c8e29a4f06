//! IPv6 connection tracking, as conntrack.rs's for IPv4: two entries per connection in
//! `CONNTRACK6`, each keyed by the 5-tuple of one direction as it arrives and holding what that
//! direction is rewritten to; an entry's peer is keyed by its own rewrite turned around. The TCP
//! and UDP state machines and timeouts are lb_common's, shared with IPv4.
use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    macros::map,
    maps::PerCpuArray,
};
use lb_common::{
    Backend6, CT_F_REPLY, CT_UDP_UNREPLIED, CachedHop, Config, ConntrackEntry6, ConntrackKey6,
    Counter, IPPROTO_TCP, conntrack_timeout_ns,
    tcp::{self, Step, TcpWindow},
    udp_step,
};

use crate::{maps, parse6::Packet6};

/// This CPU's entry under construction (`track_new`).
#[map(name = "LB_CT6_SCRATCH_V1")]
static SCRATCH: PerCpuArray<ConntrackEntry6> = PerCpuArray::with_max_entries(1, 0);

/// `last_seen_ns` is refreshed at most this often, as IPv4's entries are.
const REFRESH_NS: u64 = 1_000_000_000;

/// The tuple a live connection's packet `packet` is rewritten to; `None` when it has none. Keeps
/// both entries fresh and in the same state. The entry of an expired connection, or of a closed
/// one the packet reopens, is deleted, and the new connection the caller opens takes its reply
/// entry over (`track_new`).
#[inline(always)]
pub fn lookup(packet: &Packet6, config: &Config, now: u64) -> Option<ConntrackKey6> {
    let proto = packet.tuple.proto;
    let entry = maps::conntrack6(&packet.tuple)?;
    let reply = entry.flags & CT_F_REPLY != 0;
    if now.saturating_sub(entry.last_seen_ns)
        > conntrack_timeout_ns(proto, entry.state, &config.timeouts)
        || proto == IPPROTO_TCP && tcp::reopens(entry.state, reply, packet.tcp_flags)
    {
        // Its peer is left to `track_new`: building the peer's key here takes stack the program
        // has not got.
        maps::conntrack6_remove(&packet.tuple);
        maps::count(Counter::ConntrackTakenOver);
        return None;
    }
    let state = if proto != IPPROTO_TCP {
        udp_step(entry.state, reply)
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
    // The entries are built in this CPU's scratch entry, not on the stack, which has no room for
    // them beside the packet (docs/ipv6.md).
    let scratch = SCRATCH.get_ptr_mut(0).ok_or(Counter::DropConntrackFull)?;
    // SAFETY: this CPU's own entry, valid until the program returns; tc programs are not
    // preempted while they run, and nothing else holds a reference to it.
    let entry = unsafe { &mut *scratch };
    entry.last_seen_ns = now;
    entry.service_id = service_id;
    entry.state = state;
    entry.hop_len = 0;
    entry.hop = CachedHop::default();
    entry.stats_slot = stats_slot;
    entry.stats_owner = stats_owner;
    entry.window = TcpWindow::default();
    // The reply entry: from the backend to the client, rewritten to frontend → client.
    entry.src_addr = tuple.dst_addr;
    entry.dst_addr = tuple.src_addr;
    entry.src_port = tuple.dst_port;
    entry.dst_port = tuple.src_port;
    entry.flags = CT_F_REPLY;
    let reply_key = reversed(&to);
    let created = maps::conntrack6_insert(&reply_key, entry, BPF_NOEXIST);
    if !created {
        match maps::conntrack6(&reply_key) {
            // The reply entry of this client tuple's previous connection (expired or closed, its
            // original entry deleted by `lookup`), or another CPU's of this same connection:
            // taken over, or written again alike.
            Some(theirs) if same_rewrite(theirs, entry) => {
                if !maps::conntrack6_insert(&reply_key, entry, BPF_ANY) {
                    return Err(Counter::DropConntrackFull);
                }
            }
            // Another client's connection (a client reaching two frontends of one backend from
            // one port): IPv4's source port remap is not done for IPv6 yet.
            Some(_) => return Err(Counter::DropTupleClash),
            None => return Err(Counter::DropConntrackFull),
        }
    }
    entry.src_addr = to.src_addr;
    entry.dst_addr = to.dst_addr;
    entry.src_port = to.src_port;
    entry.dst_port = to.dst_port;
    entry.flags = 0;
    if !maps::conntrack6_insert(tuple, entry, BPF_NOEXIST) {
        if created {
            maps::conntrack6_remove(&reply_key);
        }
        // Another CPU tracked the same client first: its connection is this one.
        let theirs = maps::conntrack6(tuple).ok_or(Counter::DropConntrackFull)?;
        return Ok(rewrite_of(theirs, tuple.proto));
    }
    maps::count(Counter::NewConnection);
    maps::count_backend_connection(stats_slot, bytes);
    Ok(to)
}

/// Whether `a` and `b` rewrite to the same tuple, field by field: tuples built to compare would
/// take stack.
fn same_rewrite(a: &ConntrackEntry6, b: &ConntrackEntry6) -> bool {
    a.src_addr == b.src_addr
        && a.dst_addr == b.dst_addr
        && a.src_port == b.src_port
        && a.dst_port == b.dst_port
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
