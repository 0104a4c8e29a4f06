//! ICMP errors about translated connections, reverse-translated as Linux's NAT does them
//! (nf_nat_icmp_reply_translation), so that PMTU discovery, port unreachable and traceroute work
//! through a service.
//!
//! `lb_ingress` finds the connection of an error that arrives in conntrack, as below; `lb_egress`
//! one the node itself sent about a packet it forwarded (a REJECT rule, fragmentation needed)
//! by the quoted intermediate tuple (intermediate.rs).
//!
//! An error (destination unreachable, fragmentation needed included; time exceeded; parameter
//! problem) quotes the IP header and at least 8 bytes of the packet it is about, as that packet
//! was when it failed: translated. The error goes where that packet's reply would, so its
//! connection is found as the reply would find it, by the quote turned around, in either
//! direction (an error from the backend side about the client's packets, or from the client side
//! about replies). The quote becomes the packet as its sender sent it (addresses, ports, IP
//! checksum, and the TCP/UDP checksum when it is quoted), and the outer header follows Linux: the
//! destination becomes the quoted packet's sender, and the source becomes the quoted packet's
//! destination when that was translated (so the client sees an error about the service address
//! from the service address, whichever hop sent it), else stays the hop that sent it.
//!
//! Every checksum inside the ICMP message is a plain field updated with RFC 1624 arithmetic: each
//! change is compensated within the message (the quote's checksums by the ICMP checksum, which
//! has no pseudo-header), so a CHECKSUM_COMPLETE skb's sum stays right without the skb helpers.
//! The ICMP checksum is updated, not verified: a corrupt error stays corrupt and its receiver
//! drops it.
use lb_common::{ConntrackKey, Counter, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    nat::{self, IP_DST_OFFSET, IP_SRC_OFFSET},
    packet::{Change, PacketAccess, udp_sent, updated},
    parse::{
        ETH_HLEN, ICMP_CHECK, ICMP_DEST_UNREACH, ICMP_HLEN, ICMP_QUOTED_PAYLOAD, IP_CHECK, IP_DST,
        IP_SRC, Ipv4Header, Packet, Ports, TCP_CHECK, UDP_CHECK,
    },
};

const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;

/// Reverse-translates the ICMP message `outer` if it is an error about a tracked connection:
/// `original_of` gives the packet a quote is of as its sender sent it (`None`: not of a live
/// connection). Returns the outer header's new tuple (protocol ICMP, ports 0), to forward it by.
/// `Err(Passed)`: other ICMP, or an error about a flow this node does not translate.
// Inlined: five arguments are the most BPF passes, and the callers' are few.
#[inline(always)]
pub fn reverse_error<P: PacketAccess>(
    ctx: &P,
    outer: &Packet,
    original_of: impl Fn(&ConntrackKey) -> Option<ConntrackKey>,
) -> Result<ConntrackKey, Counter> {
    let icmp_type: u8 = ctx.load(outer.l4).map_err(|_| Counter::PassedUnparsed)?;
    if !matches!(
        icmp_type,
        ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM
    ) {
        return Err(Counter::Passed);
    }
    let quote = outer.l4 + ICMP_HLEN;
    let ip: Ipv4Header = ctx.load(quote).map_err(|_| Counter::PassedUnparsed)?;
    if !ip.carries_ports() || !matches!(ip.proto, IPPROTO_TCP | IPPROTO_UDP) {
        return Err(Counter::Passed);
    }
    let l4 = quote + ip.header_len();
    let end = ETH_HLEN + usize::from(outer.tot_len);
    if l4 + ICMP_QUOTED_PAYLOAD > end {
        return Err(Counter::PassedUnparsed);
    }
    let ports: Ports = ctx.load(l4).map_err(|_| Counter::PassedUnparsed)?;
    let quoted = ip.tuple(ports);
    // As Linux's conntrack: an error is about a connection only if it goes to the quoted
    // packet's sender; otherwise a quote of any tracked flow would steer errors anywhere.
    if outer.tuple.dst_addr != quoted.src_addr {
        return Err(Counter::Passed);
    }
    let original = original_of(&quoted).ok_or(Counter::Passed)?;

    let mut sums = QuoteSums::load(ctx, outer.l4 + ICMP_CHECK, l4, quoted.proto, end)?;
    rewrite_quote(ctx, quote, &mut sums, &quoted, &original)?;
    sums.store_sums(ctx)?;

    let to = ConntrackKey {
        src_addr: error_source(outer.tuple.src_addr, quoted.dst_addr, original.dst_addr),
        dst_addr: original.src_addr,
        src_port: 0,
        dst_port: 0,
        proto: IPPROTO_ICMP,
        _pad0: 0,
        _pad1: 0,
    };
    // The ICMP checksum has no pseudo-header: only the IP checksum covers the outer addresses.
    if outer.tuple.src_addr != to.src_addr {
        nat::replace_addr(ctx, IP_SRC_OFFSET, None, outer.tuple.src_addr, to.src_addr)?;
    }
    if outer.tuple.dst_addr != to.dst_addr {
        nat::replace_addr(ctx, IP_DST_OFFSET, None, outer.tuple.dst_addr, to.dst_addr)?;
    }
    Ok(to)
}

/// The reverse-translated error's source, as Linux's: the quoted packet's destination as its
/// sender sent it (`original_dst`) when that was translated (so the client sees an error about
/// the service address from the service address), else the hop that sent the error.
pub fn error_source<A: PartialEq>(outer_src: A, quoted_dst: A, original_dst: A) -> A {
    if original_dst != quoted_dst {
        original_dst
    } else {
        outer_src
    }
}

/// Rewrites the quoted IPv4 header and ports from `from` to `to`, the quoted IPv4 header's
/// checksum with them; `sums` follow every change.
fn rewrite_quote<P: PacketAccess>(
    ctx: &P,
    ip: usize,
    sums: &mut QuoteSums,
    from: &ConntrackKey,
    to: &ConntrackKey,
) -> Result<(), Counter> {
    let ip_check: u16 = ctx
        .load(ip + IP_CHECK)
        .map_err(|_| Counter::DropRewriteFailed)?;
    let mut new_ip_check = ip_check;
    // The addresses are in the quoted IP header and, through the pseudo-header, the TCP/UDP
    // checksum. One at a time, not in a loop over both: an array of them takes stack that
    // `lb_ingress` has not got.
    let src = Change {
        old: from.src_addr,
        new: to.src_addr,
        size: 4,
    };
    if sums.store(ctx, ip + IP_SRC, src)? {
        new_ip_check = updated(new_ip_check, src);
    }
    let dst = Change {
        old: from.dst_addr,
        new: to.dst_addr,
        size: 4,
    };
    if sums.store(ctx, ip + IP_DST, dst)? {
        new_ip_check = updated(new_ip_check, dst);
    }
    sums.store_ports(
        ctx,
        (from.src_port, from.dst_port),
        (to.src_port, to.dst_port),
    )?;
    ctx.store(ip + IP_CHECK, &new_ip_check)
        .map_err(|_| Counter::DropRewriteFailed)?;
    sums.icmp = updated(sums.icmp, halfword(ip_check, new_ip_check));
    Ok(())
}

fn halfword(old: u16, new: u16) -> Change {
    Change {
        old: old.into(),
        new: new.into(),
        size: 2,
    }
}

/// The checksums covering a quoted TCP/UDP packet (the error's ICMP or ICMPv6 checksum, the
/// quoted TCP/UDP checksum), updated as the quote is rewritten (`store`, `store_ports`) with
/// RFC 1624 arithmetic and stored at the end (`store_sums`). Shared by both families: the
/// quoted IP header is the family's own.
pub struct QuoteSums {
    // Offsets as u16 (all are below `packet::MAX_HEADER_OFFSET`): the sums live on the stack of
    // `lb_ingress`, which has little to spare.
    icmp_at: u16,
    /// The quoted TCP/UDP header.
    l4: u16,
    /// The quoted TCP/UDP checksum's offset; 0 where the quote ends before it (a TCP checksum is
    /// beyond the 8 bytes a router must quote; Linux quotes more), or for a UDP checksum of zero
    /// (none).
    l4_check_at: u16,
    /// The quoted TCP/UDP checksum as loaded.
    l4_check: u16,
    /// The quoted TCP/UDP checksum as updated.
    l4_sum: u16,
    icmp: u16,
    udp: bool,
}

impl QuoteSums {
    /// The sums of an error whose ICMP checksum is at `icmp_at`, quoting a `proto` (TCP or UDP)
    /// header at `l4`, the message ending at `end`.
    pub fn load<P: PacketAccess>(
        ctx: &P,
        icmp_at: usize,
        l4: usize,
        proto: u8,
        end: usize,
    ) -> Result<Self, Counter> {
        let udp = proto == IPPROTO_UDP;
        let load = |offset| {
            ctx.load::<u16>(offset)
                .map_err(|_| Counter::DropRewriteFailed)
        };
        let mut l4_check_at = l4 + if udp { UDP_CHECK } else { TCP_CHECK };
        let mut l4_check = 0;
        if l4_check_at + 2 <= end {
            l4_check = load(l4_check_at)?;
        }
        if l4_check_at + 2 > end || udp && l4_check == 0 {
            l4_check_at = 0;
        }
        Ok(Self {
            icmp_at: icmp_at as u16,
            l4: l4 as u16,
            l4_check_at: l4_check_at as u16,
            l4_check,
            l4_sum: l4_check,
            icmp: load(icmp_at)?,
            udp,
        })
    }

    /// Stores `change` at `offset` of the quote (an address word, covered by the TCP/UDP
    /// checksum through its pseudo-header, or a port) and updates the sums. `Ok(false)`: no
    /// change.
    pub fn store<P: PacketAccess>(
        &mut self,
        ctx: &P,
        offset: usize,
        change: Change,
    ) -> Result<bool, Counter> {
        if change.old == change.new {
            return Ok(false);
        }
        let stored = if change.size == 4 {
            ctx.store(offset, &change.new)
        } else {
            ctx.store(offset, &(change.new as u16))
        };
        stored.map_err(|_| Counter::DropRewriteFailed)?;
        self.icmp = updated(self.icmp, change);
        self.l4_sum = updated(self.l4_sum, change);
        Ok(true)
    }

    /// Rewrites the quoted ports (source, destination; network order) from `from` to `to`.
    pub fn store_ports<P: PacketAccess>(
        &mut self,
        ctx: &P,
        from: (u16, u16),
        to: (u16, u16),
    ) -> Result<(), Counter> {
        let l4 = usize::from(self.l4);
        self.store(ctx, l4, halfword(from.0, to.0))?;
        self.store(ctx, l4 + 2, halfword(from.1, to.1))?;
        Ok(())
    }

    /// Stores the quoted TCP/UDP checksum (if quoted) and the ICMP checksum, which covers it.
    pub fn store_sums<P: PacketAccess>(mut self, ctx: &P) -> Result<(), Counter> {
        let store = |offset, check: &u16| {
            ctx.store(offset, check)
                .map_err(|_| Counter::DropRewriteFailed)
        };
        if self.l4_check_at != 0 {
            let new = if self.udp {
                udp_sent(self.l4_sum)
            } else {
                self.l4_sum
            };
            store(usize::from(self.l4_check_at), &new)?;
            self.icmp = updated(self.icmp, halfword(self.l4_check, new));
        }
        store(usize::from(self.icmp_at), &self.icmp)
    }
}
