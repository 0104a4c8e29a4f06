//! IPv6 connection tracking, as conntrack.rs's for IPv4: two entries per connection in
//! `CONNTRACK6`, each keyed by the 5-tuple of one direction as it arrives and holding what that
//! direction is rewritten to; an entry's peer is keyed by its own rewrite turned around. The TCP
//! and UDP state machines and timeouts are lb_common's, shared with IPv4.
use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    cty::c_void,
    helpers::bpf_loop,
    macros::map,
    maps::PerCpuArray,
};
use lb_common::{
    Addr6, Backend6, CT_F_MASQUERADE, CT_F_REPLY, CT_UDP_UNREPLIED, CachedHop, Config,
    ConntrackEntry6, ConntrackKey6, Counter, IPPROTO_TCP, conntrack_timeout_ns,
    masquerade::PortSearch,
    tcp::{self, Step, TcpWindow},
    udp_step,
};

use crate::{maps, parse6::Packet6};

/// This CPU's entry under construction (`track_new`, `scratch`).
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
    if expired(entry, proto, config, now)
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

/// The packet the quote `quoted` of an ICMPv6 error is of, as its sender sent it, if `quoted`
/// is of a live connection, as conntrack::related: the quote turned around is the tuple a reply
/// to it arrives with, whose entry's rewrite turned around is the packet before translation.
pub fn related(quoted: &ConntrackKey6, config: &Config, now: u64) -> Option<ConntrackKey6> {
    let entry = maps::conntrack6(&reversed(quoted))?;
    if expired(entry, quoted.proto, config, now) {
        return None;
    }
    Some(reversed(&rewrite_of(entry, quoted.proto)))
}

fn expired(entry: &ConntrackEntry6, proto: u8, config: &Config, now: u64) -> bool {
    // Saturating: another CPU may have stored a later timestamp than our `now`.
    now.saturating_sub(entry.last_seen_ns)
        > conntrack_timeout_ns(proto, entry.state, &config.timeouts)
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

/// Tracks the new connection `packet` opens to `backend` of service `service_id`, opening in
/// `state`, the backend seeing it from `masquerade` (the masquerade address) or else from the
/// client's own address. Its reply entry goes first, from the client's own port, or
/// (masqueraded, or that reply tuple another connection's) from a port of the SNAT range no live
/// connection uses with that address (`claim_source`), so that a clash is refused before the
/// original entry is written. The scratch entry holds the original entry the packet is
/// rewritten by once it returns (`rewrite_of_new`): this connection's, or a copy of that of
/// another CPU's that tracked the same tuple first.
// A frame of its own: the new connection path's deepest, beside the rewrite's.
#[inline(never)]
pub fn track_new(
    packet: &Packet6,
    service_id: u32,
    backend: &Backend6,
    state: u8,
    masquerade: Option<&Addr6>,
) -> Result<(), Counter> {
    let tuple = &packet.tuple;
    let now = maps::now_ns(maps::config().ok_or(Counter::Passed)?);
    let stats_slot = u32::from(backend.stats_slot);
    let stats_owner = maps::backend_stats_owner(stats_slot);
    let masquerade_flag = if masquerade.is_some() {
        CT_F_MASQUERADE
    } else {
        0
    };
    let entry = scratch()?;
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
    entry.flags = CT_F_REPLY | masquerade_flag;
    let reply = reply_claim()?;
    reply.backend = backend.addr;
    reply.backend_port = backend.port;
    reply.source = *masquerade.unwrap_or(&tuple.src_addr);
    reply.proto = tuple.proto;
    reply.now = now;
    let own = match masquerade {
        Some(_) => Claim::Held,
        None => claim_reply(tuple.src_port)?,
    };
    let (src_port, created) = match own {
        Claim::Created => (tuple.src_port, true),
        Claim::Reused => (tuple.src_port, false),
        Claim::Held => match claim_source()? {
            Some(claimed) => claimed,
            None if masquerade.is_some() => {
                maps::count_backend_ports_exhausted(stats_slot);
                return Err(Counter::DropSnatPortsExhausted);
            }
            None => return Err(Counter::DropTupleClash),
        },
    };
    // The original entry: from the client, rewritten to source → backend.
    let entry = scratch()?;
    entry.src_addr = reply.source;
    entry.dst_addr = backend.addr;
    entry.src_port = src_port;
    entry.dst_port = backend.port;
    entry.flags = masquerade_flag;
    if !maps::conntrack6_insert(tuple, entry, BPF_NOEXIST) {
        if created {
            maps::conntrack6_remove(&reversed(&rewrite_of(entry, tuple.proto)));
        }
        // Another CPU tracked the same client first: its connection is this one.
        let theirs = maps::conntrack6(tuple).ok_or(Counter::DropConntrackFull)?;
        entry.src_addr = theirs.src_addr;
        entry.dst_addr = theirs.dst_addr;
        entry.src_port = theirs.src_port;
        entry.dst_port = theirs.dst_port;
        return Ok(());
    }
    maps::count(Counter::NewConnection);
    if masquerade.is_some() {
        maps::count(Counter::Masqueraded);
    }
    maps::count_backend_connection(stats_slot, packet.len);
    Ok(())
}

/// The tuple the packet that `track_new` tracked is rewritten to.
pub fn rewrite_of_new(proto: u8) -> Result<ConntrackKey6, Counter> {
    Ok(rewrite_of(scratch()?, proto))
}

/// This CPU's entry under construction. The entries are built here, not on the stack, which has
/// no room for them beside the packet (docs/ipv6.md).
fn scratch() -> Result<&'static mut ConntrackEntry6, Counter> {
    let scratch = SCRATCH.get_ptr_mut(0).ok_or(Counter::DropConntrackFull)?;
    // SAFETY: this CPU's own entry, valid until the program returns; tc programs are not
    // preempted while they run, and each user takes it afresh rather than holding it.
    Ok(unsafe { &mut *scratch })
}

/// This CPU's `ReplyClaim` (`track_new`), kept off the stack as the scratch entry is: the port
/// search runs at the new connection path's deepest.
#[map(name = "LB_CT6_REPLY_CLAIM_V1")]
static REPLY_CLAIM: PerCpuArray<ReplyClaim> = PerCpuArray::with_max_entries(1, 0);

fn reply_claim() -> Result<&'static mut ReplyClaim, Counter> {
    let claim = REPLY_CLAIM
        .get_ptr_mut(0)
        .ok_or(Counter::DropConntrackFull)?;
    // SAFETY: as `scratch`.
    Ok(unsafe { &mut *claim })
}

/// Where a new connection's reply entry (the scratch entry) goes: replies from `backend` to
/// `source` and a port.
struct ReplyClaim {
    backend: Addr6,
    /// Network byte order.
    backend_port: u16,
    source: Addr6,
    proto: u8,
    now: u64,
}

/// What `claim_reply` found at a reply tuple.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Claim {
    /// Free: the scratch entry is in.
    Created,
    /// An entry of this same flow (a connection it reopens, or another CPU's of this first
    /// packet) or an expired one: overwritten with the scratch entry.
    Reused,
    /// A live connection of another flow holds it.
    Held,
}

/// Puts the scratch entry (a reply entry) at the reply tuple of `REPLY_CLAIM` and `port` unless a live
/// connection of another flow holds it. Looked up before the insert: an insert into a full LRU
/// map evicts an entry whether or not it succeeds, and probing a held port must not evict one.
// A frame of its own: called for the client's port and from `try_port`.
#[inline(never)]
fn claim_reply(port: u16) -> Result<Claim, Counter> {
    let reply = reply_claim()?;
    let key = ConntrackKey6 {
        src_addr: reply.backend,
        dst_addr: reply.source,
        src_port: reply.backend_port,
        dst_port: port,
        proto: reply.proto,
        _pad0: 0,
        _pad1: 0,
    };
    let entry = scratch()?;
    if let Some(held) = maps::conntrack6(&key) {
        let expired = maps::config().is_none_or(|config| {
            reply.now.saturating_sub(held.last_seen_ns)
                > conntrack_timeout_ns(reply.proto, held.state, &config.timeouts)
        });
        if !expired && !same_rewrite(held, entry) {
            return Ok(Claim::Held);
        }
        if expired {
            maps::count(Counter::ConntrackTakenOver);
        }
        return if maps::conntrack6_insert(&key, entry, BPF_ANY) {
            Ok(Claim::Reused)
        } else {
            Err(Counter::DropConntrackFull)
        };
    }
    if maps::conntrack6_insert(&key, entry, BPF_NOEXIST) {
        Ok(Claim::Created)
    } else if maps::conntrack6(&key).is_some() {
        // Another CPU's connection took it since the lookup.
        Ok(Claim::Held)
    } else {
        Err(Counter::DropConntrackFull)
    }
}

/// The port of the SNAT range whose reply tuple `claim_reply` got, and whether it created its
/// entry; `Ok(None)` when none of the ports tried was free. Ports are searched as IPv4's
/// `masquerade::claim_source` searches them (`PortSearch`), in a `bpf_loop`, so that the verifier
/// follows one try. No early drop: IPv6 connections are not held unconfirmed yet.
fn claim_source() -> Result<Option<(u16, bool)>, Counter> {
    let config = maps::config().ok_or(Counter::Passed)?;
    let Some(ports) = PortSearch::new(config.snat_port_min, config.snat_port_max, maps::random())
    else {
        return Ok(None);
    };
    let mut search = Search {
        ports,
        port: 0,
        created: false,
        conntrack_full: false,
    };
    // SAFETY: `try_port` is a bpf_loop callback, and `search` outlives the loop.
    unsafe {
        bpf_loop(
            ports.tries(),
            try_port as *const () as *mut c_void,
            (&raw mut search).cast(),
            0,
        );
    }
    if search.conntrack_full {
        return Err(Counter::DropConntrackFull);
    }
    Ok((search.port != 0).then_some((search.port, search.created)))
}

/// The state of `claim_source`'s search, shared with each try.
struct Search {
    ports: PortSearch,
    /// The port claimed (network byte order); 0: none yet (the range starts above 0).
    port: u16,
    /// `claim_reply` created the entry of `port`.
    created: bool,
    /// A try found the conntrack table full.
    conntrack_full: bool,
}

/// Try `index` of a `Search` (`search`): 1 (stop) once it has an outcome.
extern "C" fn try_port(index: u64, search: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes claim_source's `search`, live and not otherwise borrowed.
    let search = unsafe { &mut *search.cast::<Search>() };
    let port = search.ports.port(index as u32).to_be();
    match claim_reply(port) {
        Ok(Claim::Held) => 0,
        Ok(claim) => {
            search.port = port;
            search.created = claim == Claim::Created;
            1
        }
        Err(_) => {
            search.conntrack_full = true;
            1
        }
    }
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
