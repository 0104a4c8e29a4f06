//! Rewriting an IPv6 packet's addresses and ports in place, as nat.rs does for IPv4. IPv6 has no
//! header checksum: an address is covered by the TCP/UDP checksum's pseudo-header only, updated a
//! 32-bit word at a time through `PacketAccess::replace_l4_checksum`, which for tc also keeps the
//! skb's checksum state right (see nat.rs).
use lb_common::{Addr6, ConntrackKey6, Counter, IPPROTO_UDP};

use crate::{
    packet::{Change, L4Checksum, PacketAccess},
    parse::{ETH_HLEN, Fragment, TCP_CHECK, UDP_CHECK},
    parse6::{IPV6_DST, IPV6_SRC, Packet6},
};

const IPV6_SRC_OFFSET: usize = ETH_HLEN + IPV6_SRC;
const IPV6_DST_OFFSET: usize = ETH_HLEN + IPV6_DST;

/// Rewrites `packet` (whose header fields are `packet.tuple`) to carry `to`.
#[inline(always)]
pub fn rewrite<P: PacketAccess>(
    ctx: &P,
    packet: &Packet6,
    to: &ConntrackKey6,
) -> Result<(), Counter> {
    let from = &packet.tuple;
    // A later fragment has no TCP/UDP header: its first fragment's update covers the datagram.
    let check = (packet.fragment != Fragment::Later).then(|| {
        let udp = from.proto == IPPROTO_UDP;
        let offset = packet.l4 + if udp { UDP_CHECK } else { TCP_CHECK };
        (offset, udp)
    });
    if from.src_addr != to.src_addr {
        replace_addr(ctx, IPV6_SRC_OFFSET, check, &from.src_addr, &to.src_addr)?;
    }
    if from.dst_addr != to.dst_addr {
        replace_addr(ctx, IPV6_DST_OFFSET, check, &from.dst_addr, &to.dst_addr)?;
    }
    let Some(check) = check else {
        return Ok(());
    };
    if from.src_port != to.src_port {
        replace_port(ctx, packet.l4, check, from.src_port, to.src_port)?;
    }
    if from.dst_port != to.dst_port {
        replace_port(ctx, packet.l4 + 2, check, from.dst_port, to.dst_port)?;
    }
    Ok(())
}

/// `check`: the TCP/UDP checksum's offset and whether it is UDP's; `None` for a later fragment.
fn replace_addr<P: PacketAccess>(
    ctx: &P,
    offset: usize,
    check: Option<(usize, bool)>,
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
    let Some((check_offset, udp)) = check else {
        return Ok(());
    };
    let how = L4Checksum {
        pseudo_header: true,
        zero_means_none: udp,
    };
    for (old, new) in words {
        if old != new {
            let change = Change { old, new, size: 4 };
            ctx.replace_l4_checksum(check_offset, change, how)
                .map_err(|_| Counter::DropRewriteFailed)?;
        }
    }
    Ok(())
}

fn replace_port<P: PacketAccess>(
    ctx: &P,
    offset: usize,
    (check_offset, udp): (usize, bool),
    old: u16,
    new: u16,
) -> Result<(), Counter> {
    let change = Change {
        old: old.into(),
        new: new.into(),
        size: 2,
    };
    let how = L4Checksum {
        pseudo_header: false,
        zero_means_none: udp,
    };
    ctx.store(offset, &new)
        .and_then(|()| ctx.replace_l4_checksum(check_offset, change, how))
        .map_err(|_| Counter::DropRewriteFailed)
}
