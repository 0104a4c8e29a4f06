//! ICMP destination unreachable errors the datapath answers itself: the packet is turned in place
//! into the error (RFC 792: the original IP header and the first 8 bytes of its payload quoted,
//! as the client sent them), from the address the client tried, and sent back out the interface
//! it came in on, towards the hop it came from. The client's kernel matches the quote to its
//! socket.
//! - REJECT, as kube-proxy answers a connection to a service without endpoints: port
//!   unreachable; connect() fails with ECONNREFUSED, a connected UDP socket reports it.
//! - Fragmentation needed (RFC 1191), as a router answers a DF packet too big for the egress
//!   link: the client's kernel lowers its path MTU to the service address and resends.
use core::ptr;

use aya_ebpf::{
    bindings::{__sk_buff, BPF_F_RECOMPUTE_CSUM},
    helpers::{
        bpf_csum_diff, bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes, bpf_skb_store_bytes,
    },
    programs::TcContext,
};
use lb_common::{Counter, IPPROTO_ICMP};

use crate::{
    packet::{PacketAccess, folded},
    parse::{
        ETH_HLEN, ICMP_CHECK, ICMP_DEST_UNREACH, ICMP_HLEN, ICMP_QUOTED_PAYLOAD, IP_CHECK, IP_DST,
        IP_SRC, IPV4_MIN_HLEN, Packet,
    },
};

const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
/// The longest IPv4 header (IHL 15) and the payload bytes quoted after it.
const QUOTE_MAX: usize = 60 + ICMP_QUOTED_PAYLOAD;
/// Internetwork control precedence, as the kernel's own ICMP errors carry.
const TOS_INTERNETWORK_CONTROL: u8 = 0xc0;
const TTL: u8 = 64;
/// Every store keeps `skb->csum` of a CHECKSUM_COMPLETE packet right.
const STORE_FLAGS: u64 = BPF_F_RECOMPUTE_CSUM as u64;

/// Rewrites `packet` into the port unreachable about it and redirects it back to its sender.
pub fn port_unreachable(ctx: &TcContext, packet: &Packet) -> Result<i32, Counter> {
    unreachable(ctx, packet, ICMP_PORT_UNREACH, 0)
}

/// Rewrites `packet` into the fragmentation needed about it, announcing the next hop's `mtu`,
/// and redirects it back to its sender.
pub fn fragmentation_needed(ctx: &TcContext, packet: &Packet, mtu: u16) -> Result<i32, Counter> {
    unreachable(ctx, packet, ICMP_FRAG_NEEDED, mtu)
}

/// Rewrites `packet` into the destination unreachable with `code` about it (`next_hop_mtu`, or 0:
/// the header's last 16 bits) and redirects it back to its sender.
// A frame of its own: its buffers would otherwise add to the classifier's, which with the
// deepest call below it must stay within BPF's 512-byte stack.
#[inline(never)]
fn unreachable(
    ctx: &TcContext,
    packet: &Packet,
    code: u8,
    next_hop_mtu: u16,
) -> Result<i32, Counter> {
    let quote_len = packet.l4 - ETH_HLEN + ICMP_QUOTED_PAYLOAD;
    // Spelled out for the verifier, which needs the bounds of every helper's length.
    if !(IPV4_MIN_HLEN + ICMP_QUOTED_PAYLOAD..=QUOTE_MAX).contains(&quote_len) {
        return Err(Counter::DropRewriteFailed);
    }
    // The ICMP header and the quote, contiguous: one checksum, one store.
    let mut icmp = [0u8; ICMP_HLEN + QUOTE_MAX];
    icmp[0] = ICMP_DEST_UNREACH;
    icmp[1] = code;
    icmp[6..8].copy_from_slice(&next_hop_mtu.to_be_bytes());
    let icmp_len = ICMP_HLEN + quote_len;
    let skb = ctx.skb.skb;
    // SAFETY: `icmp` has room for `quote_len` bytes past the ICMP header; the parser checked that
    // the packet holds the IP header and 8 bytes past it.
    let loaded = unsafe {
        bpf_skb_load_bytes(
            skb.cast(),
            ETH_HLEN as u32,
            icmp.as_mut_ptr().add(ICMP_HLEN).cast(),
            quote_len as u32,
        )
    };
    if loaded != 0 {
        return Err(Counter::DropRewriteFailed);
    }
    // SAFETY: `icmp` is initialised stack memory of at least `icmp_len` bytes, a multiple of 4
    // (IHL * 4 + 16); the helper only reads it.
    let sum = unsafe {
        bpf_csum_diff(
            ptr::null_mut(),
            0,
            icmp.as_mut_ptr().cast(),
            icmp_len as u32,
            0,
        )
    };
    let sum = u32::try_from(sum).map_err(|_| Counter::DropRewriteFailed)?;
    icmp[ICMP_CHECK..ICMP_CHECK + 2].copy_from_slice(&folded(sum).to_ne_bytes());

    let macs: [u8; 12] = ctx.load(0).map_err(|_| Counter::DropRewriteFailed)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    let ip = ip_header(
        (IPV4_MIN_HLEN + icmp_len) as u16,
        packet.tuple.dst_addr,
        packet.tuple.src_addr,
    );

    // SAFETY: the context's skb, resized to exactly the error's length; the quote was read
    // before.
    if unsafe { bpf_skb_change_tail(skb, (ETH_HLEN + IPV4_MIN_HLEN + icmp_len) as u32, 0) } != 0 {
        return Err(Counter::DropRewriteFailed);
    }
    ctx.store(0, &swapped, STORE_FLAGS)
        .and_then(|()| ctx.store(ETH_HLEN, &ip, STORE_FLAGS))
        .map_err(|_| Counter::DropRewriteFailed)?;
    // SAFETY: `icmp` holds `icmp_len` initialised bytes and the packet is that long past the IP
    // header.
    if unsafe { store(skb, ETH_HLEN + IPV4_MIN_HLEN, &icmp, icmp_len) } != 0 {
        return Err(Counter::DropRewriteFailed);
    }
    // SAFETY: the helper only records the target; flags 0 means egress.
    Ok(unsafe { bpf_redirect(ctx.ingress_ifindex(), 0) } as i32)
}

/// # Safety
/// `len` must not exceed `from.len()`.
unsafe fn store(skb: *mut __sk_buff, offset: usize, from: &[u8], len: usize) -> i64 {
    // SAFETY: per the contract, `from` has `len` readable bytes.
    unsafe {
        bpf_skb_store_bytes(
            skb,
            offset as u32,
            from.as_ptr().cast(),
            len as u32,
            STORE_FLAGS,
        )
    }
}

fn ip_header(tot_len: u16, src_addr: u32, dst_addr: u32) -> [u8; IPV4_MIN_HLEN] {
    let mut ip = [0u8; IPV4_MIN_HLEN];
    ip[0] = 0x45;
    ip[1] = TOS_INTERNETWORK_CONTROL;
    ip[2..4].copy_from_slice(&tot_len.to_be_bytes());
    ip[8] = TTL;
    ip[9] = IPPROTO_ICMP;
    ip[IP_SRC..IP_SRC + 4].copy_from_slice(&src_addr.to_ne_bytes());
    ip[IP_DST..IP_DST + 4].copy_from_slice(&dst_addr.to_ne_bytes());
    let mut sum = 0u32;
    for word in ip.chunks_exact(2) {
        sum += u32::from(u16::from_ne_bytes([word[0], word[1]]));
    }
    ip[IP_CHECK..IP_CHECK + 2].copy_from_slice(&folded(sum).to_ne_bytes());
    ip
}
