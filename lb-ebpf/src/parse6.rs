//! Ethernet + IPv6 + extension headers + TCP/UDP → the 5-tuple and the offsets the rewrite needs,
//! as parse.rs does for IPv4. The extension headers (hop-by-hop, routing, destination options,
//! fragment) are walked in a bounded loop; a chain the loop does not finish (longer than
//! `MAX_EXTENSION_HEADERS`, truncated, beyond the pulled headers, or AH/ESP before the transport
//! header) is counted `PassedIpv6ExtensionHeader` and passes untouched.
//!
//! A fragment's identification and offset are kept for fragment6.rs, which follows its datagram.
//! The walk ends at a fragment header: the fragments of a datagram are followed only when its
//! transport header comes right after the fragment header, as a later fragment tells no more
//! than that header's next header (an extension header in the fragmentable part: passed).
//!
//! ICMPv6 informational messages, neighbour discovery among them, are not service traffic:
//! they pass untouched. An ICMPv6 error is parsed as IPv4's ICMP is, for the error translation.
use lb_common::{Addr6, ConntrackKey6, Counter, IPPROTO_TCP, IPPROTO_UDP, valid};

use crate::{
    packet::PacketAccess,
    parse::{ETH_HLEN, Fragment, Ports},
};

pub const IPV6_HLEN: usize = 40;
pub const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_ESP: u8 = 50;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;
/// As many as a real chain holds (hop-by-hop, destination options, routing, fragment,
/// destination options again) and one more; each costs the verifier a walk of the loop body.
pub const MAX_EXTENSION_HEADERS: usize = 6;
/// Field offsets within the IPv6 header.
pub const IPV6_SRC: usize = 8;
pub const IPV6_DST: usize = 24;
const TCP_MIN_HLEN: usize = 20;
const UDP_HLEN: usize = 8;
pub const ICMPV6_HLEN: usize = 8;
/// ICMPv6 types from 128 on are informational (RFC 4443), neighbour discovery (133-137) included.
const ICMPV6_INFORMATIONAL: u8 = 128;
/// The data offset (high nibble) and the flags byte after it.
const TCP_OFFSET_AND_FLAGS: usize = 12;
const UDP_LEN_OFFSET: usize = 4;
/// The fragment offset in a fragment header's 16-bit field (host order), and its M flag.
const FRAG_OFFSET_MASK: u16 = 0xfff8;
const FRAG_MORE: u16 = 0x0001;

/// The fixed IPv6 header, fields in network order.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv6Header {
    version_class_flow: u32,
    payload_len: u16,
    pub next_header: u8,
    hop_limit: u8,
    pub src_addr: Addr6,
    pub dst_addr: Addr6,
}

impl Ipv6Header {
    /// The 5-tuple of this header with the `proto` header carrying `ports` after it.
    pub fn tuple(&self, proto: u8, ports: Ports) -> ConntrackKey6 {
        ConntrackKey6 {
            src_addr: self.src_addr,
            dst_addr: self.dst_addr,
            src_port: ports.src,
            dst_port: ports.dst,
            proto,
            _pad0: 0,
            _pad1: 0,
        }
    }
}

/// The fragment extension header (RFC 8200 4.5).
#[repr(C)]
#[derive(Clone, Copy)]
struct FragmentHeader {
    next_header: u8,
    _reserved: u8,
    offset_and_more: u16,
    id: u32,
}

/// A parsed IPv6 TCP/UDP packet, or an ICMPv6 error (`tuple.proto` `IPPROTO_ICMPV6`, ports 0).
pub struct Packet6 {
    /// As the packet arrived: the conntrack key of its direction.
    pub tuple: ConntrackKey6,
    /// Offset of the TCP/UDP (or ICMPv6) header, after the extension headers.
    pub l4: usize,
    /// TCP flags byte (0 for UDP).
    pub tcp_flags: u8,
    pub hop_limit: u8,
    /// The packet from the IPv6 header on (payload length + 40), as IPv4's total length.
    pub len: u16,
    pub fragment: Fragment,
    /// The fragment header's, of a fragment (`Fragment::First`, `Later`); 0 otherwise.
    pub fragment_place: FragmentPlace,
}

/// Where a fragment lies in its datagram.
#[derive(Clone, Copy, Default)]
pub struct FragmentPlace {
    /// The datagram's identification, network order.
    pub id: u32,
    /// Where the fragment's data starts in the datagram's fragmentable part, in bytes.
    pub offset: u16,
}

/// Where the extension header chain ends.
struct Chain {
    /// The transport protocol.
    proto: u8,
    /// Its header's offset.
    l4: usize,
    fragment: Fragment,
    fragment_place: FragmentPlace,
}

/// `Err(Passed)` for what is not IPv6 TCP/UDP or an ICMPv6 error, `Err(PassedUnparsed)` for a
/// truncated or inconsistent fixed or transport header, `Err(PassedIpv6ExtensionHeader)` for an
/// extension header chain it does not walk; the other `Err`s for headers Linux holds invalid.
#[inline(always)]
pub fn packet<P: PacketAccess>(ctx: &P) -> Result<Packet6, Counter> {
    let ip: Ipv6Header = ctx.load(ETH_HLEN).map_err(|_| Counter::PassedUnparsed)?;
    let payload_len = usize::from(u16::from_be(ip.payload_len));
    let available = ctx.len().saturating_sub(ETH_HLEN + IPV6_HLEN);
    // A jumbogram (payload length 0, RFC 2675) is not walked either.
    if u32::from_be(ip.version_class_flow) >> 28 != 6 || payload_len == 0 || payload_len > available
    {
        return Err(Counter::PassedUnparsed);
    }
    let chain = extension_headers(ctx, ip.next_header)?;
    let l4_len = (ETH_HLEN + IPV6_HLEN + payload_len)
        .checked_sub(chain.l4)
        .ok_or(Counter::PassedIpv6ExtensionHeader)?;
    let len = (IPV6_HLEN + payload_len) as u16;
    let tuple = |ports: Ports| ip.tuple(chain.proto, ports);
    let no_ports = Ports { src: 0, dst: 0 };
    if chain.fragment == Fragment::Later {
        if chain.proto == IPPROTO_ICMPV6 {
            return Err(Counter::PassedUnparsed);
        }
        return Ok(Packet6 {
            tuple: tuple(no_ports),
            l4: chain.l4,
            tcp_flags: 0,
            hop_limit: ip.hop_limit,
            len,
            fragment: chain.fragment,
            fragment_place: chain.fragment_place,
        });
    }
    let min_l4_len = match chain.proto {
        IPPROTO_TCP => TCP_MIN_HLEN,
        IPPROTO_UDP => UDP_HLEN,
        IPPROTO_ICMPV6 if chain.fragment == Fragment::Whole => ICMPV6_HLEN,
        IPPROTO_ICMPV6 => return Err(Counter::PassedUnparsed),
        _ => return Err(Counter::Passed),
    };
    if l4_len < min_l4_len {
        return Err(Counter::PassedUnparsed);
    }
    let mut tcp_flags = 0;
    let ports = match chain.proto {
        IPPROTO_ICMPV6 => {
            let icmp_type: u8 = ctx.load(chain.l4).map_err(|_| Counter::PassedUnparsed)?;
            if icmp_type >= ICMPV6_INFORMATIONAL {
                return Err(Counter::Passed);
            }
            no_ports
        }
        IPPROTO_TCP => {
            let [data_offset, flags]: [u8; 2] = ctx
                .load(chain.l4 + TCP_OFFSET_AND_FLAGS)
                .map_err(|_| Counter::PassedUnparsed)?;
            if !valid::tcp_data_offset(data_offset >> 4, l4_len) {
                return Err(Counter::DropBadTcpHeader);
            }
            if !valid::tcp_flags(flags) {
                return Err(Counter::DropBadTcpFlags);
            }
            tcp_flags = flags;
            ctx.load(chain.l4).map_err(|_| Counter::PassedUnparsed)?
        }
        _ => {
            let udp_len: u16 = ctx
                .load(chain.l4 + UDP_LEN_OFFSET)
                .map_err(|_| Counter::PassedUnparsed)?;
            let whole = chain.fragment == Fragment::Whole;
            if !valid::udp_length(u16::from_be(udp_len), l4_len, whole) {
                return Err(Counter::DropBadUdpLength);
            }
            ctx.load(chain.l4).map_err(|_| Counter::PassedUnparsed)?
        }
    };
    Ok(Packet6 {
        tuple: tuple(ports),
        l4: chain.l4,
        tcp_flags,
        hop_limit: ip.hop_limit,
        len,
        fragment: chain.fragment,
        fragment_place: chain.fragment_place,
    })
}

/// Walks the extension headers from the fixed header's `next_header` to the transport header.
#[inline(always)]
fn extension_headers<P: PacketAccess>(ctx: &P, next_header: u8) -> Result<Chain, Counter> {
    let mut proto = next_header;
    let mut offset = ETH_HLEN + IPV6_HLEN;
    let mut fragment = Fragment::Whole;
    let mut fragment_place = FragmentPlace::default();
    for _ in 0..MAX_EXTENSION_HEADERS {
        match proto {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                // Next header, then the length in 8-byte units beyond the first 8.
                let [next, len]: [u8; 2] = ctx
                    .load(offset)
                    .map_err(|_| Counter::PassedIpv6ExtensionHeader)?;
                proto = next;
                offset += (usize::from(len) + 1) * 8;
            }
            IPPROTO_FRAGMENT => {
                let header: FragmentHeader = ctx
                    .load(offset)
                    .map_err(|_| Counter::PassedIpv6ExtensionHeader)?;
                let offset_and_more = u16::from_be(header.offset_and_more);
                fragment = if offset_and_more & FRAG_OFFSET_MASK != 0 {
                    Fragment::Later
                } else if offset_and_more & FRAG_MORE != 0 {
                    Fragment::First
                } else {
                    // An atomic fragment (RFC 6946): the whole datagram.
                    Fragment::Whole
                };
                proto = header.next_header;
                offset += core::mem::size_of::<FragmentHeader>();
                if fragment != Fragment::Whole {
                    fragment_place = FragmentPlace {
                        id: header.id,
                        offset: offset_and_more & FRAG_OFFSET_MASK,
                    };
                    break;
                }
            }
            _ => break,
        }
    }
    match proto {
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_FRAGMENT | IPPROTO_AH
        | IPPROTO_ESP => Err(Counter::PassedIpv6ExtensionHeader),
        // A later fragment's payload is not a header: the first fragment's chain named it.
        _ if fragment == Fragment::Later => Ok(Chain {
            proto,
            l4: offset,
            fragment,
            fragment_place,
        }),
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_ICMPV6 => {
            // The transport header must lie within the headers `pull_headers` makes linear.
            ctx.load::<u32>(offset)
                .map_err(|_| Counter::PassedIpv6ExtensionHeader)?;
            Ok(Chain {
                proto,
                l4: offset,
                fragment,
                fragment_place,
            })
        }
        _ => Err(Counter::Passed),
    }
}
