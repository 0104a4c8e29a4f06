//! IPv4 fragments of translated flows. Only the first fragment carries the ports, so its ports
//! are remembered by the datagram's identity (addresses, protocol, IP ID) and a later fragment
//! takes them up to find the same connection, and so the same endpoint. Nothing is reassembled:
//! each fragment is translated as it comes (as Cilium does; kube-proxy's conntrack reassembles
//! first). A later fragment that comes before its first is not translated.
//!
//! Linux's reassembly discards a datagram whose fragments overlap; a fragment that overlaps the
//! first one (which alone decides the connection) is dropped here, so that a datagram's
//! fragments never reach two connections, nor a header other than the one its first was
//! checked and tracked with.
use lb_common::{Counter, FRAGMENT_TIMEOUT_NS, FirstFragment, FragmentKey};

use crate::{
    maps,
    packet::PacketAccess,
    parse::{ETH_HLEN, Fragment, IP_FRAG_OFF, IP_OFFSET, Packet},
};

/// Keeps a first fragment's ports for the fragments that follow it, and fills them into a later
/// fragment: `Err(PassedFragment)` when its first was not seen, `Err(DropFragmentOverlap)` when
/// it overlaps its first. Every first fragment is kept, not only translated ones: fragments are
/// rare, and one map access per packet keeps this cheap on the programs' stack.
// A frame of its own, off the stack of the paths that open connections.
#[inline(never)]
pub fn follow<P: PacketAccess>(ctx: &P, packet: &mut Packet, now: u64) -> Result<(), Counter> {
    match packet.fragment {
        Fragment::Whole => {}
        Fragment::First => {
            let first = FirstFragment {
                seen_ns: now,
                src_port: packet.tuple.src_port,
                dst_port: packet.tuple.dst_port,
                end: packet.tot_len - (packet.l4 - ETH_HLEN) as u16,
                _pad: 0,
            };
            let key = key(packet);
            // Another first fragment of this datagram (a duplicate is the same again).
            if let Some(earlier) = live(&key, now)
                && (earlier.src_port, earlier.dst_port, earlier.end)
                    != (first.src_port, first.dst_port, first.end)
            {
                return Err(Counter::DropFragmentOverlap);
            }
            maps::remember_first_fragment(&key, &first);
        }
        Fragment::Later => {
            let first = live(&key(packet), now).ok_or(Counter::PassedFragment)?;
            let frag_off: u16 = ctx
                .load(ETH_HLEN + IP_FRAG_OFF)
                .map_err(|_| Counter::PassedUnparsed)?;
            if (u16::from_be(frag_off) & IP_OFFSET) * 8 < first.end {
                return Err(Counter::DropFragmentOverlap);
            }
            packet.tuple.src_port = first.src_port;
            packet.tuple.dst_port = first.dst_port;
        }
    }
    Ok(())
}

/// The first fragment of the datagram `key`, unless it was seen too long ago to be of this one.
fn live(key: &FragmentKey, now: u64) -> Option<FirstFragment> {
    maps::first_fragment(key)
        .filter(|first| now.saturating_sub(first.seen_ns) <= FRAGMENT_TIMEOUT_NS)
}

fn key(packet: &Packet) -> FragmentKey {
    FragmentKey {
        src_addr: packet.tuple.src_addr,
        dst_addr: packet.tuple.dst_addr,
        id: packet.ip_id,
        proto: packet.tuple.proto,
        _pad: 0,
    }
}
