//! ICMP destination unreachable errors the datapath answers itself: the packet is turned in place
//! into the error (RFC 792: the original IP header and the first 8 bytes of its payload quoted,
//! as the client sent them), from the address the client tried, and sent back out the interface
//! it came in on, towards the hop it came from. The client's kernel matches the quote to its
//! socket.
//! - REJECT, as kube-proxy answers a connection to a service without endpoints: port
//!   unreachable; connect() fails with ECONNREFUSED, a connected UDP socket reports it.
//! - Fragmentation needed (RFC 1191), as a router answers a DF packet too big for the egress
//!   link: the client's kernel lowers its path MTU to the service address and resends.
//!
//! The rate limit, the checksum, the resize and the send back serve ICMPv6's REJECT too
//! (reject6.rs).
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
    maps,
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
/// The TTL (IPv4) or hop limit (IPv6) of the errors: the kernel's default.
pub const TTL: u8 = 64;
/// Every store keeps `skb->csum` of a CHECKSUM_COMPLETE packet right.
const STORE_FLAGS: u64 = BPF_F_RECOMPUTE_CSUM as u64;
/// The most `bpf_csum_diff` sums in one call (its scratch space, before Linux 6.13).
pub const CSUM_CHUNK: usize = 512;

/// As the kernel's REJECT, within the node's ICMP error rate: `Ok` (counted `Rejected`) when the
/// error may be sent now, else `Err(DropRejectRateLimited)`; either way the packet is dropped.
pub fn allowed() -> Result<(), Counter> {
    let config = maps::config().ok_or(Counter::Passed)?;
    if !maps::reject_allowed(config) {
        return Err(Counter::DropRejectRateLimited);
    }
    maps::count(Counter::Rejected);
    Ok(())
}

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
    // SAFETY: `icmp` holds at least `icmp_len` initialised bytes, a multiple of 4 (IHL * 4 + 16)
    // and within `CSUM_CHUNK`.
    let sum = unsafe { sum(icmp.as_ptr(), icmp_len, 0) }?;
    icmp[ICMP_CHECK..ICMP_CHECK + 2].copy_from_slice(&folded(sum).to_ne_bytes());
    let ip = ip_header(
        (IPV4_MIN_HLEN + icmp_len) as u16,
        packet.tuple.dst_addr,
        packet.tuple.src_addr,
    );
    // The quote was read before.
    turn_around(ctx, ETH_HLEN + IPV4_MIN_HLEN + icmp_len)?;
    ctx.store(ETH_HLEN, &ip, STORE_FLAGS)
        .map_err(|_| Counter::DropRewriteFailed)?;
    // SAFETY: `icmp` holds `icmp_len` initialised bytes and the packet is that long past the IP
    // header.
    if unsafe { store(ctx, ETH_HLEN + IPV4_MIN_HLEN, icmp.as_ptr(), icmp_len) } != 0 {
        return Err(Counter::DropRewriteFailed);
    }
    Ok(send_back(ctx))
}

/// The 32-bit ones' complement sum of the `len` bytes at `bytes`, added to `seed`.
///
/// # Safety
/// `bytes` must point to `len` readable bytes; `len` a multiple of 4, at most `CSUM_CHUNK`.
pub unsafe fn sum(bytes: *const u8, len: usize, seed: u32) -> Result<u32, Counter> {
    // SAFETY: per the contract; the helper only reads `bytes`.
    let sum = unsafe {
        bpf_csum_diff(
            ptr::null_mut(),
            0,
            bytes.cast_mut().cast(),
            len as u32,
            seed,
        )
    };
    u32::try_from(sum).map_err(|_| Counter::DropRewriteFailed)
}

/// Resizes the packet to `len` bytes from the Ethernet header on and turns its Ethernet header
/// around, towards the hop it came from; what follows is the caller's to write. Whatever the
/// caller quotes it reads before.
pub fn turn_around(ctx: &TcContext, len: usize) -> Result<(), Counter> {
    let macs: [u8; 12] = ctx.load(0).map_err(|_| Counter::DropRewriteFailed)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    // SAFETY: the context's skb, resized to exactly the error's length.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, len as u32, 0) } != 0 {
        return Err(Counter::DropRewriteFailed);
    }
    ctx.store(0, &swapped, STORE_FLAGS)
        .map_err(|_| Counter::DropRewriteFailed)
}

/// Sends the packet back out the interface it came in on: the verdict.
pub fn send_back(ctx: &TcContext) -> i32 {
    // SAFETY: the helper only records the target; flags 0 means egress.
    unsafe { bpf_redirect(ctx.ingress_ifindex(), 0) as i32 }
}

/// Writes the `len` bytes at `from` into the packet at `offset`; non-zero on failure.
///
/// # Safety
/// `from` must point to `len` readable bytes.
pub unsafe fn store(ctx: &TcContext, offset: usize, from: *const u8, len: usize) -> i64 {
    // SAFETY: per the contract; the helper only reads `from`.
    unsafe {
        bpf_skb_store_bytes(
            ctx.skb.skb.cast::<__sk_buff>(),
            offset as u32,
            from.cast(),
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
