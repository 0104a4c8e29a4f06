//! Rewriting an IPv6 packet's addresses and ports in place, as nat.rs does for IPv4. IPv6 has no
//! header checksum: an address is covered by the TCP/UDP checksum's pseudo-header only, updated a
//! 32-bit word at a time through `PacketAccess::replace_l4_checksum`, which for tc also keeps the
//! skb's checksum state right (see nat.rs).
use lb_common::{Addr6, ConntrackKey6, Counter};

use crate::{
    nat::{L4, replace_port},
    packet::{Change, PacketAccess},
    parse::{ETH_HLEN, Fragment},
    parse6::{IPV6_DST, IPV6_SRC, Packet6},
};

pub const IPV6_SRC_OFFSET: usize = ETH_HLEN + IPV6_SRC;
pub const IPV6_DST_OFFSET: usize = ETH_HLEN + IPV6_DST;

/// Rewrites `packet` (whose header fields are `packet.tuple`) to carry `to`.
#[inline(always)]
pub fn rewrite<P: PacketAccess>(
    ctx: &P,
    packet: &Packet6,
    to: &ConntrackKey6,
) -> Result<(), Counter> {
    let from = &packet.tuple;
    // A later fragment has no TCP/UDP header: its first fragment's update covers the datagram.
    let l4 = (packet.fragment != Fragment::Later).then(|| L4::at(packet.l4, from.proto));
    if from.src_addr != to.src_addr {
        replace_addr(
            ctx,
            IPV6_SRC_OFFSET,
            l4.as_ref(),
            &from.src_addr,
            &to.src_addr,
        )?;
    }
    if from.dst_addr != to.dst_addr {
        replace_addr(
            ctx,
            IPV6_DST_OFFSET,
            l4.as_ref(),
            &from.dst_addr,
            &to.dst_addr,
        )?;
    }
    let Some(l4) = l4 else {
        return Ok(());
    };
    if from.src_port != to.src_port {
        replace_port(ctx, packet.l4, &l4, from.src_port, to.src_port)?;
    }
    if from.dst_port != to.dst_port {
        replace_port(ctx, packet.l4 + 2, &l4, from.dst_port, to.dst_port)?;
    }
    Ok(())
}

/// `l4`: the checksum whose pseudo-header covers the address (TCP, UDP, ICMPv6); `None` for a
/// later fragment.
pub fn replace_addr<P: PacketAccess>(
    ctx: &P,
    offset: usize,
    l4: Option<&L4>,
    old: &Addr6,
    new: &Addr6,
) -> Result<(), Counter> {
    let words = [
        (old.w0, new.w0),
        (old.w1, new.w1),
        (old.w2, new.w2),
        (old.w3, new.w3),
    ];
    ctx.store(offset, new)
        .map_err(|_| Counter::DropRewriteFailed)?;
    let Some(l4) = l4 else {
        return Ok(());
    };
    let (check_offset, how) = l4.address_change();
    for (old, new) in words {
        if old != new {
            let change = Change { old, new, size: 4 };
            ctx.replace_l4_checksum(check_offset, change, how)
                .map_err(|_| Counter::DropRewriteFailed)?;
        }
    }
    Ok(())
}
