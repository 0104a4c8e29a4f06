//! Rewriting addresses and ports in place, with incremental IPv4 and TCP/UDP checksum updates.
//!
//! The checksum helpers know the skb's checksum state: with `BPF_F_PSEUDO_HDR` an address change
//! also fixes the pseudo-header sum of a CHECKSUM_PARTIAL skb (veth traffic) and `skb->csum` of a
//! CHECKSUM_COMPLETE one, which no hand-written checksum code could reach.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use lb_common::{ConntrackKey, Counter, IPPROTO_UDP};

use crate::parse::{ETH_HLEN, Packet};

pub const IP_CHECK_OFFSET: usize = ETH_HLEN + 10;
const IP_SRC_OFFSET: usize = ETH_HLEN + 12;
const IP_DST_OFFSET: usize = ETH_HLEN + 16;
const TCP_CHECK_OFFSET: usize = 16;
const UDP_CHECK_OFFSET: usize = 6;

/// Rewrites `packet` (whose header fields are `packet.tuple`) to carry `to`.
pub fn rewrite(ctx: &TcContext, packet: &Packet, to: &ConntrackKey) -> Result<(), Counter> {
    let from = &packet.tuple;
    let (l4_check, l4_flags) = if from.proto == IPPROTO_UDP {
        // A zero UDP checksum means "none": MANGLED_0 keeps it zero, and turns a computed zero
        // into 0xffff.
        (
            packet.l4 + UDP_CHECK_OFFSET,
            u64::from(BPF_F_MARK_MANGLED_0),
        )
    } else {
        (packet.l4 + TCP_CHECK_OFFSET, 0)
    };
    if from.src_addr != to.src_addr {
        replace_addr(
            ctx,
            IP_SRC_OFFSET,
            l4_check,
            l4_flags,
            from.src_addr,
            to.src_addr,
        )?;
    }
    if from.dst_addr != to.dst_addr {
        replace_addr(
            ctx,
            IP_DST_OFFSET,
            l4_check,
            l4_flags,
            from.dst_addr,
            to.dst_addr,
        )?;
    }
    if from.src_port != to.src_port {
        replace_port(
            ctx,
            packet.l4,
            l4_check,
            l4_flags,
            from.src_port,
            to.src_port,
        )?;
    }
    if from.dst_port != to.dst_port {
        replace_port(
            ctx,
            packet.l4 + 2,
            l4_check,
            l4_flags,
            from.dst_port,
            to.dst_port,
        )?;
    }
    Ok(())
}

fn replace_addr(
    ctx: &TcContext,
    offset: usize,
    l4_check: usize,
    l4_flags: u64,
    old: u32,
    new: u32,
) -> Result<(), Counter> {
    let (old, new_sum) = (u64::from(old), u64::from(new));
    ctx.store(offset, &new, 0)
        .and_then(|()| ctx.l3_csum_replace(IP_CHECK_OFFSET, old, new_sum, 4))
        .and_then(|()| {
            let flags = l4_flags | u64::from(BPF_F_PSEUDO_HDR) | 4;
            ctx.l4_csum_replace(l4_check, old, new_sum, flags)
        })
        .map_err(|_| Counter::DropRewriteFailed)
}

fn replace_port(
    ctx: &TcContext,
    offset: usize,
    l4_check: usize,
    l4_flags: u64,
    old: u16,
    new: u16,
) -> Result<(), Counter> {
    ctx.store(offset, &new, 0)
        .and_then(|()| ctx.l4_csum_replace(l4_check, old.into(), new.into(), l4_flags | 2))
        .map_err(|_| Counter::DropRewriteFailed)
}
