//! Connection tracking: two entries per connection, each keyed by the 5-tuple of one direction as
//! it arrives and holding what that direction is rewritten to. An entry's peer is keyed by its
//! own rewrite turned around.
use core::mem::MaybeUninit;

use aya_ebpf::bindings::{BPF_ANY, BPF_NOEXIST};
use lb_common::{
    Backend, CT_F_MASQUERADE, CT_F_REPLY, CT_F_UNCONFIRMED, CT_UDP_UNREPLIED, Config,
    ConntrackEntry, ConntrackKey, ConntrackTimeouts, Counter, IPPROTO_TCP, confirms,
    conntrack_timeout_ns,
    tcp::{self, Segment, Step, TcpWindow},
    udp_step,
};

use crate::{
    intermediate, maps,
    packet::PacketAccess,
    parse::{Fragment, Packet, TCP_ACK, TCP_SYN},
    tcp as tcp_header, zero,
};

/// `last_seen_ns` is refreshed at most this often, so that busy flows do not write the shared
/// cache line on every packet. Timeouts are tens of seconds and more.
const REFRESH_NS: u64 = 1_000_000_000;

/// A packet's live connection: its entry, and the tuple the packet is rewritten to.
///
/// `repr(C)` with the reference first, so that the niche of `Option<Tracked>` (a null reference)
/// is at offset 0: LLVM 22 writes an enum's BTF as a union that holds its discriminant at the
/// discriminant's offset, and the kernel refuses the object's whole BTF for a union member at
/// any other offset than 0.
#[repr(C)]
pub struct Tracked {
    pub entry: &'static mut ConntrackEntry,
    pub to: ConntrackKey,
}

/// The live connection of a packet; `None` when it has no live entry (or opens a new connection
/// on the tuple of a closed one). Keeps both entries of the connection fresh and in the same
/// state. A TCP RST or FIN must have passed `in_window` first.
pub fn lookup<P: PacketAccess>(
    ctx: &P,
    packet: &Packet,
    config: &Config,
    now: u64,
) -> Option<Tracked> {
    let entry = maps::conntrack(&packet.tuple)?;
    let proto = packet.tuple.proto;
    if expired(entry, proto, &config.timeouts, now) {
        return None;
    }
    let reply = entry.flags & CT_F_REPLY != 0;
    let to = rewrite_of(entry, proto);
    let state = if proto != IPPROTO_TCP {
        udp_step(entry.state, reply)
    } else if packet.fragment == Fragment::Later {
        // No TCP header: the first fragment told what there was to tell.
        entry.state
    } else {
        if tcp::reopens(entry.state, reply, packet.tcp_flags) {
            return None;
        }
        track_segment(ctx, packet, entry)
    };
    let refresh = now.saturating_sub(entry.last_seen_ns) > REFRESH_NS;
    // Only a connection not yet confirmed pays for the check. Not in XDP, whose 512-byte stack
    // has no room for the move: tc confirms the connection at the server's next packet
    // (`confirms` of an established connection's reply), which crosses tc on the pod side.
    let confirm = !P::IS_XDP
        && entry.flags & CT_F_UNCONFIRMED != 0
        && confirms(proto, entry.state, state, reply);
    if state != entry.state || refresh {
        update(entry, state, refresh, now);
        // The peer ages with this entry: a flow that only ever sends one way keeps its reply
        // path.
        if let Some(peer) = maps::conntrack(&reversed(&to)) {
            update(peer, state, refresh, now);
        }
    }
    let entry = if confirm {
        confirm_connection(&packet.tuple).unwrap_or(entry)
    } else {
        entry
    };
    Some(Tracked { entry, to })
}

/// Moves the connection of entry `key` from the unconfirmed tables to the main ones, with its
/// intermediate tuples; returns its entry of `key` there. `None` when its other entry is gone from the unconfirmed table (evicted: it
/// stays there, unconfirmed). Inserted into the main table before it leaves the unconfirmed
/// one, so that another CPU always finds it.
// A frame of its own: the established path never calls it. The key only: a pointer to the
// caller's rewrite would pin that on the programs' stack, which is full.
#[inline(never)]
fn confirm_connection(key: &ConntrackKey) -> Option<&'static mut ConntrackEntry> {
    let entry = maps::unconfirmed(key)?;
    let to = rewrite_of(entry, key.proto);
    let reply = entry.flags & CT_F_REPLY != 0;
    let peer_key = reversed(&to);
    let Some(peer) = maps::unconfirmed(&peer_key) else {
        maps::count(Counter::ConntrackUnconfirmedEvicted);
        return None;
    };
    entry.flags &= !CT_F_UNCONFIRMED;
    peer.flags &= !CT_F_UNCONFIRMED;
    if !maps::conntrack_insert(&peer_key, peer, BPF_ANY)
        || !maps::conntrack_insert(key, entry, BPF_ANY)
    {
        entry.flags |= CT_F_UNCONFIRMED;
        peer.flags |= CT_F_UNCONFIRMED;
        return None;
    }
    maps::unconfirmed_remove(&peer_key);
    maps::unconfirmed_remove(key);
    intermediate::confirm(&intermediate::of(key, &to, reply), key);
    intermediate::confirm(
        &intermediate::of(&peer_key, &reversed(key), !reply),
        &peer_key,
    );
    maps::count(Counter::ConntrackConfirmed);
    maps::conntrack(key)
}

/// `Err(DropTcpOutOfWindow)` for a TCP RST or FIN of a tracked connection that lies outside
/// its window (Linux's `tcp_in_window`): it must not close the connection. Any other packet
/// passes without a look: the established path pays nothing for the check.
pub fn in_window<P: PacketAccess>(ctx: &P, packet: &Packet) -> Result<(), Counter> {
    if packet.tuple.proto != IPPROTO_TCP || !tcp::checks_window(packet.tcp_flags) {
        return Ok(());
    }
    if window_refuses(ctx, packet) {
        return Err(Counter::DropTcpOutOfWindow);
    }
    Ok(())
}

/// The window check of `in_window`, on the packet's entry and its peer's.
#[inline(never)]
fn window_refuses<P: PacketAccess>(ctx: &P, packet: &Packet) -> bool {
    let Some(entry) = maps::conntrack(&packet.tuple) else {
        return false;
    };
    let to = rewrite_of(entry, IPPROTO_TCP);
    let (Some(peer), Ok(segment)) = (
        maps::conntrack(&reversed(&to)),
        tcp_header::segment(ctx, packet),
    ) else {
        return false;
    };
    !entry.window.in_window(&peer.window, &segment)
}

/// Linux's TCP tracking of `packet`, a segment of `entry`'s direction: the state it moves the connection to (its own when none), with this direction's window
/// learned.
// A frame of its own, so that its segment and the peer lookup do not deepen the programs' own
// (the new connection path runs deepest).
#[inline(never)]
fn track_segment<P: PacketAccess>(ctx: &P, packet: &Packet, entry: &mut ConntrackEntry) -> u8 {
    // The parser checked that the header is in the packet.
    let Ok(segment) = &tcp_header::segment(ctx, packet) else {
        return entry.state;
    };
    let reply = entry.flags & CT_F_REPLY != 0;
    let (next, moves) = match tcp::step(entry.state, reply, segment.flags) {
        Step::To(state) => (state, true),
        Step::Ignore | Step::Invalid => (entry.state, false),
    };
    // An ACK that does not acknowledge the SYN-ACK changes nothing, as an invalid segment in
    // Linux: the connection stays unconfirmed and expires in the SYN timeout.
    if tcp::completes_handshake(entry.state, reply, next) && !acknowledges_peer(entry, segment) {
        return entry.state;
    }
    if segment.flags & TCP_SYN != 0 {
        // A SYN (again), a SYN-ACK, or a simultaneous open's SYN opens this direction's window.
        if moves {
            entry.window = TcpWindow::opened(segment, tcp_header::window_scale(ctx, packet));
            if segment.flags & TCP_ACK != 0
                && let Some(peer) = maps::conntrack(&reversed(&rewrite_of(entry, IPPROTO_TCP)))
            {
                TcpWindow::agree_scaling(&mut peer.window, &mut entry.window);
            }
        }
    } else {
        entry.window.learn(segment);
    }
    next
}

/// Whether `segment` of `entry`'s direction acknowledges what its peer entry's direction (the
/// SYN-ACK's) sent; true when the peer is gone.
fn acknowledges_peer(entry: &ConntrackEntry, segment: &Segment) -> bool {
    maps::conntrack(&reversed(&rewrite_of(entry, IPPROTO_TCP)))
        .is_none_or(|peer| TcpWindow::acknowledged_by(&peer.window, segment))
}

/// What the packet quoted by an ICMP error (`quoted`, as it was when it failed) becomes,
/// reverse-translated; `None` when it is not of a live connection. The error travels as the
/// quoted packet's reply would, so it is looked up as that reply arrives: by the quote turned
/// around. Neither entry is refreshed, as Linux's conntrack leaves a connection alone for the
/// errors related to it.
pub fn related(
    quoted: &ConntrackKey,
    timeouts: &ConntrackTimeouts,
    now: u64,
) -> Option<ConntrackKey> {
    let entry = maps::conntrack(&reversed(quoted))?;
    if expired(entry, quoted.proto, timeouts, now) {
        return None;
    }
    Some(reversed(&rewrite_of(entry, quoted.proto)))
}

pub fn expired(entry: &ConntrackEntry, proto: u8, timeouts: &ConntrackTimeouts, now: u64) -> bool {
    // Saturating: another CPU may have stored a later timestamp than our `now`.
    now.saturating_sub(entry.last_seen_ns) > conntrack_timeout_ns(proto, entry.state, timeouts)
}

/// A client's SYN on the tuple of a closed connection (TIME_WAIT, CLOSE) is a new connection, as
/// Linux's conntrack treats it: it gets a new endpoint, not the old one, which may have been
/// removed since. Clients reuse a port that soon when they close with RST, or with
/// tcp_tw_reuse.
fn closed(entry: &ConntrackEntry, proto: u8) -> bool {
    proto == IPPROTO_TCP && tcp::reopens(entry.state, false, TCP_SYN)
}

/// A refresh also drops the cached route: the next packet asks the FIB, so a route or neighbour
/// change reaches a connection within about REFRESH_NS.
fn update(entry: &mut ConntrackEntry, state: u8, refresh: bool, now: u64) {
    entry.state = state;
    if refresh {
        entry.last_seen_ns = now;
        entry.hop_len = 0;
    }
}

pub fn rewrite_of(entry: &ConntrackEntry, proto: u8) -> ConntrackKey {
    ConntrackKey {
        src_addr: entry.src_addr,
        dst_addr: entry.dst_addr,
        src_port: entry.src_port,
        dst_port: entry.dst_port,
        proto,
        _pad0: 0,
        _pad1: 0,
    }
}

/// Whether `a` and `b` rewrite to the same tuple. Field by field from the entries themselves: a
/// tuple built to compare with would keep its fields live across helper calls, on the stack.
fn same_rewrite(a: &ConntrackEntry, b: &ConntrackEntry) -> bool {
    a.src_addr == b.src_addr
        && a.dst_addr == b.dst_addr
        && a.src_port == b.src_port
        && a.dst_port == b.dst_port
}

/// The same flow seen from the other end.
pub fn reversed(tuple: &ConntrackKey) -> ConntrackKey {
    ConntrackKey {
        src_addr: tuple.dst_addr,
        dst_addr: tuple.src_addr,
        src_port: tuple.dst_port,
        dst_port: tuple.src_port,
        proto: tuple.proto,
        _pad0: 0,
        _pad1: 0,
    }
}

/// The state a connection opened by `packet` starts in. `Err(PassedTcpNoConnection)` for a TCP
/// segment that opens none (RST, FIN, SYN-ACK).
pub fn opening_state(packet: &Packet) -> Result<u8, Counter> {
    if packet.tuple.proto != IPPROTO_TCP {
        return Ok(CT_UDP_UNREPLIED);
    }
    tcp::opening_state(packet.tcp_flags).ok_or(Counter::PassedTcpNoConnection)
}

/// The original entry of the connection `packet` has just opened (keyed by its tuple), with the
/// client's window learned from that first segment. Learned once the entries are in, rather
/// than carried into them: the new connection path is the programs' deepest on the stack.
#[inline(never)]
pub fn opened<P: PacketAccess>(ctx: &P, packet: &Packet) -> Option<&'static ConntrackEntry> {
    let entry = maps::conntrack(&packet.tuple)?;
    if packet.tuple.proto == IPPROTO_TCP
        && let Ok(segment) = tcp_header::segment(ctx, packet)
    {
        if segment.flags & TCP_SYN != 0 {
            entry.window = TcpWindow::opened(&segment, tcp_header::window_scale(ctx, packet));
        } else {
            // Picked up mid-stream: the window scale was in a SYN we did not see.
            entry.window.learn(&segment);
        }
    }
    Some(entry)
}

/// What `Connection::claim_reply` found at a source.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Claim {
    /// The source is the new connection's now.
    Claimed,
    /// A live confirmed connection of another flow holds it.
    Held,
    /// A live unconfirmed connection of another flow holds it.
    HeldUnconfirmed,
}

/// A new connection from `tuple` (client → frontend) to `backend`, before it is tracked.
pub struct Connection {
    tuple: ConntrackKey,
    backend: Backend,
    service_id: u32,
    now: u64,
    /// The owner of the backend's counter slot (`backend.stats_slot`) as the connection opens.
    stats_owner: u32,
    /// `CT_F_MASQUERADE` or 0, for both entries.
    flags: u8,
    /// Both entries' first state.
    state: u8,
}

impl Connection {
    pub fn new(
        tuple: &ConntrackKey,
        service_id: u32,
        backend: &Backend,
        masquerade: bool,
        state: u8,
        now: u64,
    ) -> Self {
        Self {
            tuple: *tuple,
            backend: *backend,
            service_id,
            now,
            stats_owner: maps::backend_stats_owner(u32::from(backend.stats_slot)),
            flags: if masquerade { CT_F_MASQUERADE } else { 0 },
            state,
        }
    }

    /// Whether `entry`, found where this connection's would go, is of a connection no longer
    /// live. The timeouts are read here rather than kept: the programs' stack is tight.
    fn outlived(&self, entry: &ConntrackEntry) -> bool {
        maps::config()
            .is_none_or(|config| expired(entry, self.tuple.proto, &config.timeouts, self.now))
    }

    /// The client's packet that opens the connection.
    pub fn client(&self) -> &ConntrackKey {
        &self.tuple
    }

    /// The datapath's clock as the connection opens.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// The tuple the client's packets get when the backend sees them from `src_addr:src_port`.
    pub fn translated(&self, src_addr: u32, src_port: u16) -> ConntrackKey {
        ConntrackKey {
            src_addr,
            dst_addr: self.backend.addr,
            src_port,
            dst_port: self.backend.port,
            proto: self.tuple.proto,
            _pad0: 0,
            _pad1: 0,
        }
    }

    /// The entry that rewrites to `to`, with no route cached yet and its window unknown, built
    /// in `slot`: a zeroed entry returned by value becomes a memset call.
    fn entry<'a>(
        &self,
        to: &ConntrackKey,
        flags: u8,
        slot: &'a mut MaybeUninit<ConntrackEntry>,
    ) -> &'a ConntrackEntry {
        // SAFETY: ConntrackEntry is plain old data; all-zero has no route cached.
        let entry = unsafe { zero::zeroed(slot) };
        entry.last_seen_ns = self.now;
        entry.src_addr = to.src_addr;
        entry.dst_addr = to.dst_addr;
        entry.src_port = to.src_port;
        entry.dst_port = to.dst_port;
        entry.service_id = self.service_id;
        entry.state = self.state;
        entry.flags = flags | CT_F_UNCONFIRMED;
        entry.stats_slot = u32::from(self.backend.stats_slot);
        entry.stats_owner = self.stats_owner;
        entry.window.wscale = tcp::WSCALE_UNKNOWN;
        entry
    }

    /// Tracks the reply direction with the backend seeing the client as `src_addr:port`, unless
    /// a live connection of another flow is seen from there: a flow never overwrites another's
    /// entry, or that one's replies would come back translated as this one's (Linux's NAT
    /// remaps such a clash). An expired entry is taken over, and so is one of this same flow: a
    /// connection it reopens, or the one another CPU seeing its first packet at the same time
    /// wrote. `early_drop`: a live unconfirmed connection of another flow is dropped and its
    /// source taken too (`masquerade::claim_source`, once every port tried was held).
    /// `Claim::Claimed`: the connection is translated to `translated(src_addr, port)`.
    // A frame of its own: masquerade::claim_source's loop runs deepest on the 512-byte stack,
    // and a small outcome rather than the tuple keeps its callers' frames small.
    #[inline(never)]
    pub fn claim_reply(
        &self,
        src_addr: u32,
        port: u16,
        early_drop: bool,
    ) -> Result<Claim, Counter> {
        let key = reversed(&self.translated(src_addr, port));
        let mut slot = MaybeUninit::uninit();
        // Replies come back as if from the frontend.
        let entry = self.entry(&reversed(&self.tuple), self.flags | CT_F_REPLY, &mut slot);
        // Looked up before the insert: an insert into a full LRU map evicts an entry whether or
        // not it succeeds, and probing a live connection's port must not evict another.
        if let Some(held) = maps::conntrack(&key) {
            let ours = same_rewrite(held, entry);
            if self.outlived(held) || ours && closed(held, self.tuple.proto) {
                take_over(&key);
            } else if ours {
                // This flow's, which another CPU seeing its first packet at the same time wrote.
                return Ok(Claim::Claimed);
            } else if held.flags & CT_F_UNCONFIRMED == 0 {
                return Ok(Claim::Held);
            } else if !early_drop {
                return Ok(Claim::HeldUnconfirmed);
            } else {
                // Its original entry goes with it: the whole connection is dropped.
                maps::unconfirmed_remove(&reversed(&rewrite_of(held, self.tuple.proto)));
                maps::unconfirmed_remove(&key);
                maps::count(Counter::ConntrackEarlyDrop);
            }
        }
        Ok(if self.insert(&key, entry)? {
            Claim::Claimed
        } else {
            Claim::Held
        })
    }

    /// Tracks the original direction, rewritten to `to`, once its reply entry is in place.
    /// `Ok(Some(theirs))`: another CPU saw the flow's first packet at the same time and won the
    /// insert; this packet follows its connection (rewritten to `theirs`), so that one flow is
    /// one connection with one endpoint.
    // A frame of its own, as claim_reply's: inlined, its entry would deepen every program's.
    #[inline(never)]
    pub fn track_original(&self, to: &ConntrackKey) -> Result<Option<ConntrackKey>, Counter> {
        let mut slot = MaybeUninit::uninit();
        let entry = self.entry(to, self.flags, &mut slot);
        let proto = self.tuple.proto;
        let winner = match maps::conntrack(&self.tuple) {
            // A closed entry is here only when this packet reopens it (`lookup`): a racing CPU's
            // connection would be new.
            Some(held) if !self.outlived(held) && !closed(held, proto) => Some(held),
            held => {
                if held.is_some() {
                    take_over(&self.tuple);
                }
                match self.insert(&self.tuple, entry) {
                    Ok(true) => return Ok(None),
                    Ok(false) => maps::conntrack(&self.tuple),
                    Err(_) => None,
                }
            }
        };
        // Another CPU saw the flow's first packet at the same time and tracked it first: this
        // packet follows its connection, so that one flow is one connection with one endpoint.
        // Our reply entry goes, unless both chose the same backend and source and so wrote the
        // same one.
        let theirs = winner.map(|winner| rewrite_of(winner, proto));
        if theirs != Some(*to) {
            maps::unconfirmed_remove(&reversed(to));
        }
        match theirs {
            Some(theirs) => Ok(Some(theirs)),
            None => Err(Counter::DropConntrackFull),
        }
    }

    /// Inserts `entry` of this new connection into the unconfirmed table unless an entry of
    /// `key` is there by then: `Ok(false)` when another CPU's insert came first.
    fn insert(&self, key: &ConntrackKey, entry: &ConntrackEntry) -> Result<bool, Counter> {
        if maps::unconfirmed_insert(key, entry, BPF_NOEXIST) {
            return Ok(true);
        }
        match maps::conntrack(key) {
            Some(_) => Ok(false),
            // The insert failed for want of room, not because the key was taken.
            None => Err(Counter::DropConntrackFull),
        }
    }
}

/// Deletes the entry of `key`, an expired connection's (or the closed one a new connection
/// reopens), which a new connection takes over. Its insert that follows is `BPF_NOEXIST`: of two
/// CPUs taking one entry over at once, only one gets it.
fn take_over(key: &ConntrackKey) {
    maps::conntrack_remove(key);
    maps::count(Counter::ConntrackTakenOver);
}
