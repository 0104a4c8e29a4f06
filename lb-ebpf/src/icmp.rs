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

    let l4_check = if quoted.proto == IPPROTO_UDP {
        l4 + UDP_CHECK
    } else {
        l4 + TCP_CHECK
    };
    let quote_at = QuoteOffsets {
        icmp_check: outer.l4 + ICMP_CHECK,
        ip: quote,
        l4,
        // A TCP checksum is beyond the 8 bytes a router must quote; Linux quotes more.
        l4_check: (l4_check + 2 <= end).then_some(l4_check),
    };
    rewrite_quote(ctx, &quote_at, &quoted, &original)?;

    let to = ConntrackKey {
        src_addr: if original.dst_addr != quoted.dst_addr {
            original.dst_addr
        } else {
            outer.tuple.src_addr
        },
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

/// Where the quote's fields are: absolute offsets.
struct QuoteOffsets {
    icmp_check: usize,
    /// The quoted IPv4 header.
    ip: usize,
    /// The quoted TCP/UDP header.
    l4: usize,
    /// The quoted TCP/UDP checksum, if the quote holds it.
    l4_check: Option<usize>,
}

/// The checksums covering the quote, as they are updated.
struct Checksums {
    icmp: u16,
    ip: u16,
    /// `None`: not quoted, or a UDP checksum of zero (none).
    l4: Option<u16>,
}

/// Rewrites the quoted packet from `from` to `to`, keeping its checksums and the ICMP checksum
/// right.
fn rewrite_quote<P: PacketAccess>(
    ctx: &P,
    at: &QuoteOffsets,
    from: &ConntrackKey,
    to: &ConntrackKey,
) -> Result<(), Counter> {
    let udp = from.proto == IPPROTO_UDP;
    let load = |offset| {
        ctx.load::<u16>(offset)
            .map_err(|_| Counter::DropRewriteFailed)
    };
    let ip_check = load(at.ip + IP_CHECK)?;
    let l4_check = match at.l4_check {
        Some(offset) => Some(load(offset)?).filter(|&check| !udp || check != 0),
        None => None,
    };
    let mut sums = Checksums {
        icmp: load(at.icmp_check)?,
        ip: ip_check,
        l4: l4_check,
    };
    let addr = |old: u32, new: u32| Change { old, new, size: 4 };
    let port = |old: u16, new: u16| Change {
        old: old.into(),
        new: new.into(),
        size: 2,
    };
    // The addresses are in the quoted IP header and, through the pseudo-header, the TCP/UDP
    // checksum; the ports only in the latter.
    store_field(
        ctx,
        at.ip + IP_SRC,
        addr(from.src_addr, to.src_addr),
        true,
        &mut sums,
    )?;
    store_field(
        ctx,
        at.ip + IP_DST,
        addr(from.dst_addr, to.dst_addr),
        true,
        &mut sums,
    )?;
    store_field(
        ctx,
        at.l4,
        port(from.src_port, to.src_port),
        false,
        &mut sums,
    )?;
    store_field(
        ctx,
        at.l4 + 2,
        port(from.dst_port, to.dst_port),
        false,
        &mut sums,
    )?;

    let store = |offset, check: &u16| {
        ctx.store(offset, check)
            .map_err(|_| Counter::DropRewriteFailed)
    };
    store(at.ip + IP_CHECK, &sums.ip)?;
    sums.icmp = updated(sums.icmp, port(ip_check, sums.ip));
    if let (Some(offset), Some(old), Some(new)) = (at.l4_check, l4_check, sums.l4) {
        let new = if udp { udp_sent(new) } else { new };
        store(offset, &new)?;
        sums.icmp = updated(sums.icmp, port(old, new));
    }
    store(at.icmp_check, &sums.icmp)
}

/// Stores `change` at `offset` of the quote and updates the sums that cover it: the ICMP one
/// always, the quoted IP header's for an address (`in_ip_header`), the TCP/UDP one for both.
fn store_field<P: PacketAccess>(
    ctx: &P,
    offset: usize,
    change: Change,
    in_ip_header: bool,
    sums: &mut Checksums,
) -> Result<(), Counter> {
    if change.old == change.new {
        return Ok(());
    }
    let stored = if change.size == 4 {
        ctx.store(offset, &change.new)
    } else {
        ctx.store(offset, &(change.new as u16))
    };
    stored.map_err(|_| Counter::DropRewriteFailed)?;
    sums.icmp = updated(sums.icmp, change);
    if in_ip_header {
        sums.ip = updated(sums.ip, change);
    }
    sums.l4 = sums.l4.map(|check| updated(check, change));
    Ok(())
}
