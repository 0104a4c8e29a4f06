//! REJECT over IPv6, as reject.rs's over IPv4: a new connection to a service without endpoints is
//! answered with ICMPv6 destination unreachable, port unreachable (RFC 4443 3.1: type 1, code 4),
//! from the address the client tried, quoting the packet as the client sent it, as much of it as
//! keeps the error within the IPv6 minimum MTU (1280). The quote is up to 1232 bytes, more than
//! the stack holds: the error is built in a per-CPU scratch entry. `--forwarding redirect`'s
//! Packet Too Big (RFC 4443 3.2: type 2, code 0, the MTU) is built the same way.
use core::hint::black_box;

use aya_ebpf::{helpers::bpf_skb_load_bytes, macros::map, maps::PerCpuArray, programs::TcContext};
use lb_common::Counter;

use crate::{
    packet::folded,
    parse::ETH_HLEN,
    parse6::{IPPROTO_ICMPV6, IPV6_DST, IPV6_HLEN, IPV6_SRC, Packet6},
    reject::{self, CSUM_CHUNK, TTL},
};

const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
const ICMPV6_PKT_TOOBIG: u8 = 2;
const ICMPV6_HLEN: usize = 8;
const ICMPV6_CHECK: usize = 2;
/// RFC 8200 5: every link carries 1280 bytes.
const IPV6_MIN_MTU: usize = 1280;
/// The error's headers, before the quote.
const HEADERS: usize = IPV6_HLEN + ICMPV6_HLEN;
const QUOTE_MAX: usize = IPV6_MIN_MTU - HEADERS;
/// The checksum covers the error from its addresses on (the rest of the pseudo-header is added
/// to the sum), in as many chunks as `bpf_csum_diff` takes.
const SUMMED_FROM: usize = IPV6_SRC;
const CHUNKS: usize = (IPV6_MIN_MTU - SUMMED_FROM).div_ceil(CSUM_CHUNK);
/// The bound the verifier sees on the quote's length: `QUOTE_MAX` rounded up to a mask.
const QUOTE_MASK: usize = QUOTE_MAX.next_power_of_two() - 1;
/// Room for every chunk whole, so that the verifier needs no bound on a chunk beyond its own, and
/// for a quote of `QUOTE_MASK + 1` bytes and its padding.
const SCRATCH_LEN: usize = max(
    SUMMED_FROM + CHUNKS * CSUM_CHUNK,
    HEADERS + QUOTE_MASK + 1 + 4,
);

const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

/// This CPU's error under construction: the IPv6 header, the ICMPv6 header, the quote and the
/// zero padding that rounds the checksummed length up to 4 bytes.
#[map(name = "LB_REJECT6_SCRATCH_V1")]
static SCRATCH: PerCpuArray<[u8; SCRATCH_LEN]> = PerCpuArray::with_max_entries(1, 0);

/// Rewrites `packet` into the port unreachable about it and sends it back to its sender.
pub fn port_unreachable(ctx: &TcContext, packet: &Packet6) -> Result<i32, Counter> {
    error(ctx, packet, [ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH], 0)
}

/// Rewrites `packet` into the Packet Too Big about it, announcing the next hop's `mtu`, and sends
/// it back to its sender.
pub fn packet_too_big(ctx: &TcContext, packet: &Packet6, mtu: u16) -> Result<i32, Counter> {
    error(ctx, packet, [ICMPV6_PKT_TOOBIG, 0], u32::from(mtu))
}

/// Rewrites `packet` into the ICMPv6 error of `type_code` about it (`word`: the header's last 32
/// bits) and sends it back to its sender.
// A frame of its own, called once the translation's frames have returned.
#[inline(never)]
fn error(ctx: &TcContext, packet: &Packet6, type_code: [u8; 2], word: u32) -> Result<i32, Counter> {
    // The parser checked that the packet holds the IPv6 header and the transport header past it.
    let quote_len = usize::from(packet.len).min(QUOTE_MAX);
    if quote_len < IPV6_HLEN + ICMPV6_HLEN {
        return Err(Counter::DropRewriteFailed);
    }
    // The same length, bounded as the verifier reads it (every helper's length needs bounds, and
    // a non-zero one): a mask, and one more. Opaque to LLVM, which would otherwise drop the mask
    // as redundant.
    let quote_len = (black_box(quote_len).wrapping_sub(1) & QUOTE_MASK) + 1;
    let error = SCRATCH.get_ptr_mut(0).ok_or(Counter::DropRewriteFailed)?;
    // SAFETY: this CPU's own entry, valid until the program returns; tc programs are not
    // preempted while they run, and nothing else holds it.
    let error = unsafe { &mut *error };
    // SAFETY: `error` has room for `quote_len` bytes past the headers.
    let loaded = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb.cast(),
            ETH_HLEN as u32,
            error.as_mut_ptr().add(HEADERS).cast(),
            quote_len as u32,
        )
    };
    if loaded != 0 {
        return Err(Counter::DropRewriteFailed);
    }
    let len = HEADERS + quote_len;
    // The padding: whatever a previous error left there would be summed.
    // SAFETY: `len + 4` is within `SCRATCH_LEN`.
    unsafe {
        error
            .as_mut_ptr()
            .add(len)
            .cast::<[u8; 4]>()
            .write_unaligned([0; 4])
    };
    headers(error, (ICMPV6_HLEN + quote_len) as u16, type_code, word);
    let summed = (len - SUMMED_FROM).next_multiple_of(4);
    let check = folded(checksum(error, summed, (ICMPV6_HLEN + quote_len) as u16)?);
    error[IPV6_HLEN + ICMPV6_CHECK..IPV6_HLEN + ICMPV6_CHECK + 2]
        .copy_from_slice(&check.to_ne_bytes());
    reject::turn_around(ctx, ETH_HLEN + len)?;
    // SAFETY: `error` holds `len` initialised bytes and the packet is that long past the
    // Ethernet header.
    if unsafe { reject::store(ctx, ETH_HLEN, error.as_ptr(), len) } != 0 {
        return Err(Counter::DropRewriteFailed);
    }
    Ok(reject::send_back(ctx))
}

/// Writes the error's IPv6 and ICMPv6 headers before the quote in `error`, whose addresses they
/// turn around; `payload_len`: the ICMPv6 message's length, `type_code` and `word` its header's.
fn headers(error: &mut [u8; SCRATCH_LEN], payload_len: u16, type_code: [u8; 2], word: u32) {
    let quoted = HEADERS;
    error.copy_within(quoted + IPV6_DST..quoted + IPV6_DST + 16, IPV6_SRC);
    error.copy_within(quoted + IPV6_SRC..quoted + IPV6_SRC + 16, IPV6_DST);
    error[..4].copy_from_slice(&[0x60, 0, 0, 0]);
    error[4..6].copy_from_slice(&payload_len.to_be_bytes());
    error[6] = IPPROTO_ICMPV6;
    error[7] = TTL;
    error[IPV6_HLEN..IPV6_HLEN + 2].copy_from_slice(&type_code);
    error[IPV6_HLEN + 2..IPV6_HLEN + 4].copy_from_slice(&[0, 0]);
    error[IPV6_HLEN + 4..HEADERS].copy_from_slice(&word.to_be_bytes());
}

/// The sum of the ICMPv6 pseudo-header (RFC 8200 8.1: the addresses in `error`, `payload_len`,
/// the next header) and of the `summed` bytes of `error` from its addresses on.
fn checksum(error: &[u8; SCRATCH_LEN], summed: usize, payload_len: u16) -> Result<u32, Counter> {
    // The 32-bit length and the next header, as 16-bit words in memory order; the addresses are
    // in `error`.
    let mut sum = u32::from(u16::from_ne_bytes(payload_len.to_be_bytes()))
        + u32::from(u16::from_ne_bytes([0, IPPROTO_ICMPV6]));
    for chunk in 0..CHUNKS {
        let start = chunk * CSUM_CHUNK;
        let len = summed.saturating_sub(start).min(CSUM_CHUNK);
        // SAFETY: the chunk lies within `error` (`SCRATCH_LEN`), its length a multiple of 4 at
        // most `CSUM_CHUNK`.
        sum = unsafe { reject::sum(error.as_ptr().add(SUMMED_FROM + start), len, sum) }?;
    }
    Ok(sum)
}
