//! Rewriting addresses and ports in place, with incremental IPv4 and TCP/UDP checksum updates
//! (how each program type updates a checksum is in packet.rs). A later fragment has no TCP/UDP
//! header: only its addresses change, the first fragment's checksum update covers the datagram.
//!
//! For tc, the TCP/UDP checksum helper knows the skb's checksum state: with `BPF_F_PSEUDO_HDR` an
//! address change also fixes the pseudo-header sum of a CHECKSUM_PARTIAL skb (veth traffic) and
//! `skb->csum` of a CHECKSUM_COMPLETE one, which no hand-written checksum code could reach.
use lb_common::{ConntrackKey, Counter, IPPROTO_UDP};

use crate::{
    packet::{Change, L4Checksum, PacketAccess},
    parse::{
        ETH_HLEN, Fragment, ICMP_CHECK, IP_CHECK, IP_DST, IP_SRC, Packet, TCP_CHECK, UDP_CHECK,
    },
};

pub const IP_CHECK_OFFSET: usize = ETH_HLEN + IP_CHECK;
pub const IP_SRC_OFFSET: usize = ETH_HLEN + IP_SRC;
pub const IP_DST_OFFSET: usize = ETH_HLEN + IP_DST;

/// Where the TCP/UDP checksum of the packet is, and how it treats zero.
pub struct L4 {
    check_offset: usize,
    udp: bool,
}

impl L4 {
    /// The TCP or UDP (`proto`) header at offset `l4`.
    pub fn at(l4: usize, proto: u8) -> Self {
        let udp = proto == IPPROTO_UDP;
        Self {
            check_offset: l4 + if udp { UDP_CHECK } else { TCP_CHECK },
            udp,
        }
    }

    /// The ICMPv6 header at offset `l4`: its checksum covers a pseudo-header as TCP's does.
    pub fn icmpv6(l4: usize) -> Self {
        Self {
            check_offset: l4 + ICMP_CHECK,
            udp: false,
        }
    }

    /// How an address change reaches the checksum through its pseudo-header.
    pub fn address_change(&self) -> (usize, L4Checksum) {
        let how = L4Checksum {
            pseudo_header: true,
            zero_means_none: self.udp,
        };
        (self.check_offset, how)
    }
}

/// Rewrites `packet` (whose header fields are `packet.tuple`) to carry `to`.
pub fn rewrite<P: PacketAccess>(
    ctx: &P,
    packet: &Packet,
    to: &ConntrackKey,
) -> Result<(), Counter> {
    let from = &packet.tuple;
    let l4 = L4::at(packet.l4, from.proto);
    let later_fragment = packet.fragment == Fragment::Later;
    let l4_checksum = if later_fragment { None } else { Some(&l4) };
    if from.src_addr != to.src_addr {
        replace_addr(ctx, IP_SRC_OFFSET, l4_checksum, from.src_addr, to.src_addr)?;
    }
    if from.dst_addr != to.dst_addr {
        replace_addr(ctx, IP_DST_OFFSET, l4_checksum, from.dst_addr, to.dst_addr)?;
    }
    if later_fragment {
        return Ok(());
    }
    if from.src_port != to.src_port {
        replace_port(ctx, packet.l4, &l4, from.src_port, to.src_port)?;
    }
    if from.dst_port != to.dst_port {
        replace_port(ctx, packet.l4 + 2, &l4, from.dst_port, to.dst_port)?;
    }
    Ok(())
}

/// `l4`: `None` where no TCP/UDP checksum covers the address (a later fragment, an ICMP
/// message).
pub fn replace_addr<P: PacketAccess>(
    ctx: &P,
    offset: usize,
    l4: Option<&L4>,
    old: u32,
    new: u32,
) -> Result<(), Counter> {
    let change = Change { old, new, size: 4 };
    ctx.store(offset, &new)
        .and_then(|()| ctx.replace_l3_checksum(IP_CHECK_OFFSET, change))
        .and_then(|()| match l4 {
            Some(l4) => {
                let (check_offset, how) = l4.address_change();
                ctx.replace_l4_checksum(check_offset, change, how)
            }
            None => Ok(()),
        })
        .map_err(|_| Counter::DropRewriteFailed)
}

pub fn replace_port<P: PacketAccess>(
    ctx: &P,
    offset: usize,
    l4: &L4,
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
        zero_means_none: l4.udp,
    };
    ctx.store(offset, &new)
        .and_then(|()| ctx.replace_l4_checksum(l4.check_offset, change, how))
        .map_err(|_| Counter::DropRewriteFailed)
}
