//! ICMPv6 errors about translated connections, reverse-translated as icmp.rs does IPv4's ICMP
//! errors (Linux's nf_nat_icmpv6_reply_translation), so that path MTU discovery (Packet Too
//! Big), port unreachable and traceroute work through an IPv6 service.
//!
//! An error (destination unreachable, packet too big, time exceeded, parameter problem) quotes
//! the packet it is about as that packet was when it failed: translated. Its connection is found
//! as icmp.rs finds it, by the quote turned around, in either direction; the quote becomes the
//! packet as its sender sent it (addresses, ports, the quoted TCP/UDP checksum when it is
//! quoted), the outer destination the quoted packet's sender, the outer source as icmp.rs's
//! (`icmp::error_source`). The error is then handed to the stack, which routes it as it routes
//! the translated packets of `lb_ingress6`.
//!
//! The quote's changes are compensated within the message with RFC 1624 arithmetic
//! (`icmp::QuoteSums`, shared with IPv4). Unlike ICMP's, the ICMPv6 checksum covers a
//! pseudo-header: the outer addresses are rewritten through the tc helper, as TCP/UDP ones are
//! (nat6.rs), which also keeps the skb's checksum state right. A quote with extension headers
//! before its TCP/UDP header is not walked: its error passes untouched.
use lb_common::{ConntrackKey6, Counter, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    conntrack6, icmp, maps,
    nat::L4,
    nat6::{self, IPV6_DST_OFFSET, IPV6_SRC_OFFSET},
    packet::{Change, PacketAccess},
    parse::{ETH_HLEN, ICMP_CHECK, ICMP_QUOTED_PAYLOAD, Ports},
    parse6::{ICMPV6_HLEN, IPV6_DST, IPV6_HLEN, IPV6_SRC, Ipv6Header},
    translate6,
};

const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PACKET_TOO_BIG: u8 = 2;
const ICMPV6_TIME_EXCEEDED: u8 = 3;
const ICMPV6_PARAMETER_PROBLEM: u8 = 4;

/// Reverse-translates the ICMPv6 message parsed (`translate6::parsed`) if it is an error about
/// a tracked connection. `Err(Passed)`: another message, or an error about a flow this node does
/// not translate; `Err(PassedUnparsed)`: a quote too short to hold the ports.
// A frame of its own, beside the translation's: the quote's tuples take stack.
#[inline(never)]
pub fn reverse_error<P: PacketAccess>(ctx: &P) -> Result<(), Counter> {
    let outer = translate6::parsed()?;
    let icmp_type: u8 = ctx.load(outer.l4).map_err(|_| Counter::PassedUnparsed)?;
    if !matches!(
        icmp_type,
        ICMPV6_DEST_UNREACH
            | ICMPV6_PACKET_TOO_BIG
            | ICMPV6_TIME_EXCEEDED
            | ICMPV6_PARAMETER_PROBLEM
    ) {
        return Err(Counter::Passed);
    }
    let quote = outer.l4 + ICMPV6_HLEN;
    let ip: Ipv6Header = ctx.load(quote).map_err(|_| Counter::PassedUnparsed)?;
    if !matches!(ip.next_header, IPPROTO_TCP | IPPROTO_UDP) {
        return Err(Counter::Passed);
    }
    let l4 = quote + IPV6_HLEN;
    let end = ETH_HLEN + usize::from(outer.len);
    if l4 + ICMP_QUOTED_PAYLOAD > end {
        return Err(Counter::PassedUnparsed);
    }
    let ports: Ports = ctx.load(l4).map_err(|_| Counter::PassedUnparsed)?;
    let quoted = ip.tuple(ip.next_header, ports);
    // As icmp.rs: an error is about a connection only if it goes to the quoted packet's sender.
    if outer.tuple.dst_addr != quoted.src_addr {
        return Err(Counter::Passed);
    }
    let config = maps::config().ok_or(Counter::Passed)?;
    let original =
        conntrack6::related(&quoted, config, maps::now_ns(config)).ok_or(Counter::Passed)?;

    let mut sums = icmp::QuoteSums::load(ctx, outer.l4 + ICMP_CHECK, l4, quoted.proto, end)?;
    rewrite_quote(ctx, quote, &mut sums, &quoted, &original)?;
    sums.store_sums(ctx)?;

    // After the quote: the helper updates the ICMPv6 checksum as it then is.
    let icmp = L4::icmpv6(outer.l4);
    let src_addr = icmp::error_source(&outer.tuple.src_addr, &quoted.dst_addr, &original.dst_addr);
    if outer.tuple.src_addr != *src_addr {
        nat6::replace_addr(
            ctx,
            IPV6_SRC_OFFSET,
            Some(&icmp),
            &outer.tuple.src_addr,
            src_addr,
        )?;
    }
    if outer.tuple.dst_addr != original.src_addr {
        nat6::replace_addr(
            ctx,
            IPV6_DST_OFFSET,
            Some(&icmp),
            &outer.tuple.dst_addr,
            &original.src_addr,
        )?;
    }
    maps::count(Counter::IcmpErrorTranslated);
    Ok(())
}

/// Rewrites the quoted IPv6 header's addresses and the ports after it from `from` to `to`;
/// `sums` follow every change (IPv6 has no header checksum of its own).
fn rewrite_quote<P: PacketAccess>(
    ctx: &P,
    ip: usize,
    sums: &mut icmp::QuoteSums,
    from: &ConntrackKey6,
    to: &ConntrackKey6,
) -> Result<(), Counter> {
    for (at, old, new) in [
        (ip + IPV6_SRC, &from.src_addr, &to.src_addr),
        (ip + IPV6_DST, &from.dst_addr, &to.dst_addr),
    ] {
        for (word, old, new) in [
            (0, old.w0, new.w0),
            (4, old.w1, new.w1),
            (8, old.w2, new.w2),
            (12, old.w3, new.w3),
        ] {
            sums.store(ctx, at + word, Change { old, new, size: 4 })?;
        }
    }
    sums.store_ports(
        ctx,
        (from.src_port, from.dst_port),
        (to.src_port, to.dst_port),
    )
}
