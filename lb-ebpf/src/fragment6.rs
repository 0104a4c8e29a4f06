//! IPv6 fragments of translated flows, followed as IPv4's (fragment.rs, whose record and checks
//! they share): a first fragment's ports are kept by its datagram's identity (addresses,
//! protocol, the fragment header's 32-bit identification) in `LB_FRAGMENT6_V1`, and a later
//! fragment takes them up to find its first's connection. Only addresses change in a later
//! fragment: IPv6 has no header checksum, and the first fragment's TCP/UDP checksum update
//! covers the whole datagram through the pseudo-header.
use lb_common::{Counter, FirstFragment, FragmentKey6};

use crate::{
    family::Ipv6,
    fragment::{first_of, remember},
    maps,
    parse::{ETH_HLEN, Fragment},
    parse6::Packet6,
};

/// As fragment::follow: keeps a first fragment's ports, fills them into a later fragment;
/// `Err(PassedFragment)` when a later fragment's first was not seen, `Err(DropFragmentOverlap)`
/// when it overlaps its first.
// A frame of its own, off the stack of the paths that open connections.
#[inline(never)]
pub fn follow(packet: &mut Packet6) -> Result<(), Counter> {
    if packet.fragment == Fragment::Whole {
        return Ok(());
    }
    let now = maps::now_ns(maps::config().ok_or(Counter::Passed)?);
    let key = FragmentKey6 {
        src_addr: packet.tuple.src_addr,
        dst_addr: packet.tuple.dst_addr,
        id: packet.fragment_place.id,
        proto: packet.tuple.proto,
        _pad0: 0,
        _pad1: 0,
    };
    if packet.fragment == Fragment::First {
        let first = FirstFragment {
            seen_ns: now,
            src_port: packet.tuple.src_port,
            dst_port: packet.tuple.dst_port,
            // The transport header comes right after the fragment header (parse6.rs).
            end: packet.len - (packet.l4 - ETH_HLEN) as u16,
            _pad: 0,
        };
        return remember::<Ipv6>(&key, &first);
    }
    let first = first_of::<Ipv6>(&key, packet.fragment_place.offset, now)?;
    packet.tuple.src_port = first.src_port;
    packet.tuple.dst_port = first.dst_port;
    Ok(())
}
