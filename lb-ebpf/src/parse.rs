//! Ethernet + IPv4 + TCP/UDP headers → the 5-tuple and the offsets the rewrite needs; an ICMP
//! message's IPv4 header, for the error translation (icmp.rs). A later IPv4 fragment has no
//! ports: its tuple's are filled in from its first fragment (fragment.rs).
//!
//! Malformed headers that Linux's IP input or conntrack hold invalid (`lb_common::valid`) are
//! refused here, before any lookup, so that they are neither translated nor tracked.
use core::mem;

use lb_common::{ConntrackKey, Counter, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP, valid};

use crate::packet::PacketAccess;

pub const ETH_HLEN: usize = 14;
const ETH_TYPE_OFFSET: usize = 12;
const ETH_P_IP: u16 = 0x0800;
pub const IPV4_MIN_HLEN: usize = 20;
/// More-fragments flag and fragment offset; either set means this is a fragment.
const IP_MF_AND_OFFSET: u16 = 0x3fff;
/// The fragment offset alone, in 8-byte units: zero in the first fragment, which carries the
/// ports.
pub const IP_OFFSET: u16 = 0x1fff;
/// IPv4 options: up to 40 bytes after the fixed header.
const IPV4_OPTION_WORDS: usize = 10;
const TCP_MIN_HLEN: usize = 20;
const UDP_HLEN: usize = 8;
pub const ICMP_HLEN: usize = 8;
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_CHECK: usize = 2;
/// What an ICMP error quotes of the failed packet's payload (RFC 792): its ports, and UDP's
/// checksum.
pub const ICMP_QUOTED_PAYLOAD: usize = 8;
/// Field offsets within an IPv4 header.
pub const IP_FRAG_OFF: usize = 6;
pub const IP_TTL: usize = 8;
pub const IP_CHECK: usize = 10;
pub const IP_SRC: usize = 12;
pub const IP_DST: usize = 16;
/// The checksum's offset within a TCP and a UDP header.
pub const TCP_CHECK: usize = 16;
pub const UDP_CHECK: usize = 6;
/// The data offset (high nibble) and the flags byte after it.
const TCP_OFFSET_AND_FLAGS: usize = 12;
const UDP_LEN_OFFSET: usize = 4;

pub use lb_common::valid::{TCP_ACK, TCP_SYN};

/// The fixed part of an IPv4 header, fields in network order.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv4Header {
    version_ihl: u8,
    tos: u8,
    tot_len: u16,
    id: u16,
    frag_off: u16,
    ttl: u8,
    pub proto: u8,
    pub check: u16,
    pub src_addr: u32,
    pub dst_addr: u32,
}

impl Ipv4Header {
    /// IHL * 4.
    pub fn header_len(&self) -> usize {
        usize::from(self.version_ihl & 0x0f) * 4
    }

    /// IPv4, a header length of at least 20, and the first (or only) fragment.
    pub fn carries_ports(&self) -> bool {
        self.version_ihl >> 4 == 4
            && self.header_len() >= IPV4_MIN_HLEN
            && u16::from_be(self.frag_off) & IP_OFFSET == 0
    }

    /// The sum of the fixed header's words, for the checksum check.
    fn sum(&self) -> u64 {
        // SAFETY: the fixed header is 20 bytes of plain old data, five 32-bit words.
        let words = unsafe { mem::transmute::<Ipv4Header, [u32; 5]>(*self) };
        words.iter().map(|&word| u64::from(word)).sum()
    }

    /// The 5-tuple of this header with the TCP/UDP `ports` after it.
    pub fn tuple(&self, ports: Ports) -> ConntrackKey {
        ConntrackKey {
            src_addr: self.src_addr,
            dst_addr: self.dst_addr,
            src_port: ports.src,
            dst_port: ports.dst,
            proto: self.proto,
            _pad0: 0,
            _pad1: 0,
        }
    }
}

/// Source and destination port, the first four bytes of both TCP and UDP.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ports {
    pub src: u16,
    pub dst: u16,
}

/// Where a packet sits in its datagram.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Fragment {
    /// Not fragmented.
    Whole,
    /// The first fragment: it carries the TCP/UDP header.
    First,
    /// A later fragment: payload only, its tuple's ports are 0 until resolved.
    Later,
}

/// A parsed IPv4 TCP/UDP packet, or an ICMP message (`tuple.proto` `IPPROTO_ICMP`, ports 0).
pub struct Packet {
    /// As the packet arrived: the conntrack key of its direction.
    pub tuple: ConntrackKey,
    /// Offset of the TCP/UDP (or ICMP) header (Ethernet + IHL * 4).
    pub l4: usize,
    /// TCP flags byte (0 for UDP).
    pub tcp_flags: u8,
    pub ttl: u8,
    pub tos: u8,
    /// IPv4 total length, host order.
    pub tot_len: u16,
    pub fragment: Fragment,
    /// IPv4 ID, network order: with the addresses and protocol it names a fragment's datagram.
    // Kept beside `fragment` rather than in it: the packet stays 32 bytes, which the programs'
    // stack (512 bytes, several copies of the packet) needs.
    pub ip_id: u16,
}

/// `Err(Passed)` for traffic that is not IPv4 TCP/UDP/ICMP, `Err(PassedUnparsed)` for ICMP
/// fragments and truncated or inconsistent headers; the other `Err`s for headers Linux holds
/// invalid (see their counters).
// Inlined into each program: as a subprogram, its `Result`'s BTF (the tag at the niche's offset,
// see conntrack::Tracked) makes the kernel refuse the object's BTF.
#[inline(always)]
pub fn packet<P: PacketAccess>(ctx: &P) -> Result<Packet, Counter> {
    let ether_type: u16 = ctx
        .load(ETH_TYPE_OFFSET)
        .map_err(|_| Counter::PassedUnparsed)?;
    if u16::from_be(ether_type) != ETH_P_IP {
        return Err(Counter::Passed);
    }
    let ip: Ipv4Header = ctx.load(ETH_HLEN).map_err(|_| Counter::PassedUnparsed)?;
    let header_len = ip.header_len();
    let tot_len = usize::from(u16::from_be(ip.tot_len));
    let available = ctx.len().saturating_sub(ETH_HLEN);
    if ip.version_ihl >> 4 != 4
        || header_len < IPV4_MIN_HLEN
        || tot_len < header_len
        || tot_len > available
    {
        return Err(Counter::PassedUnparsed);
    }
    let frag_off = u16::from_be(ip.frag_off);
    let fragment = if frag_off & IP_MF_AND_OFFSET == 0 {
        Fragment::Whole
    } else if frag_off & IP_OFFSET == 0 {
        Fragment::First
    } else {
        Fragment::Later
    };
    let min_l4_len = match ip.proto {
        IPPROTO_TCP => TCP_MIN_HLEN,
        IPPROTO_UDP => UDP_HLEN,
        // ICMP errors are not fragmented (RFC 1812 caps them at 576 bytes).
        IPPROTO_ICMP if fragment == Fragment::Whole => ICMP_HLEN,
        IPPROTO_ICMP => return Err(Counter::PassedUnparsed),
        _ => return Err(Counter::Passed),
    };
    // The stack (ip_rcv) checks it only after tc ingress.
    if !valid::checksum(ip.sum() + options_sum(ctx)?) {
        return Err(Counter::PassedBadIpChecksum);
    }
    let l4 = ETH_HLEN + header_len;
    if fragment == Fragment::Later {
        return Ok(Packet {
            tuple: ip.tuple(Ports { src: 0, dst: 0 }),
            l4,
            tcp_flags: 0,
            ttl: ip.ttl,
            tos: ip.tos,
            tot_len: tot_len as u16,
            fragment,
            ip_id: ip.id,
        });
    }
    let l4_len = tot_len - header_len;
    if l4_len < min_l4_len {
        return Err(Counter::PassedUnparsed);
    }
    let ports = if ip.proto == IPPROTO_ICMP {
        Ports { src: 0, dst: 0 }
    } else {
        ctx.load(l4).map_err(|_| Counter::PassedUnparsed)?
    };
    let mut tcp_flags = 0;
    if ip.proto == IPPROTO_TCP {
        let [data_offset, flags]: [u8; 2] = ctx
            .load(l4 + TCP_OFFSET_AND_FLAGS)
            .map_err(|_| Counter::PassedUnparsed)?;
        // A first fragment must hold the whole TCP header (RFC 1858's tiny fragments).
        if !valid::tcp_data_offset(data_offset >> 4, l4_len) {
            return Err(Counter::DropBadTcpHeader);
        }
        if !valid::tcp_flags(flags) {
            return Err(Counter::DropBadTcpFlags);
        }
        tcp_flags = flags;
    } else if ip.proto == IPPROTO_UDP {
        let udp_len: u16 = ctx
            .load(l4 + UDP_LEN_OFFSET)
            .map_err(|_| Counter::PassedUnparsed)?;
        if !valid::udp_length(u16::from_be(udp_len), l4_len, fragment == Fragment::Whole) {
            return Err(Counter::DropBadUdpLength);
        }
    }
    Ok(Packet {
        tuple: ip.tuple(ports),
        l4,
        tcp_flags,
        ttl: ip.ttl,
        tos: ip.tos,
        tot_len: tot_len as u16,
        fragment,
        ip_id: ip.id,
    })
}

/// The sum of the words of the IPv4 options, for the checksum check.
// A function of its own that reads the IHL again, rather than taking it: the verifier follows
// each of the loop's exits, and had it compared the caller's header length, each would carry
// another range of it into the rest of the program, which the verifier then walks again for each.
#[inline(never)]
fn options_sum<P: PacketAccess>(ctx: &P) -> Result<u64, Counter> {
    let version_ihl: u8 = ctx.load(ETH_HLEN).map_err(|_| Counter::PassedUnparsed)?;
    let header_len = usize::from(version_ihl & 0x0f) * 4;
    let mut sum = 0;
    for word in 0..IPV4_OPTION_WORDS {
        let offset = IPV4_MIN_HLEN + word * 4;
        if offset >= header_len {
            break;
        }
        let value: u32 = ctx
            .load(ETH_HLEN + offset)
            .map_err(|_| Counter::PassedUnparsed)?;
        sum += u64::from(value);
    }
    Ok(sum)
}
