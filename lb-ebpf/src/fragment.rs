//! IPv4 fragments of translated flows, and the record of a datagram's first fragment both
//! families keep (fragment6.rs follows IPv6's). Only the first fragment carries the ports, so
//! its ports are remembered by the datagram's identity (addresses, protocol, IP ID) and a later
//! fragment takes them up to find the same connection, and so the same endpoint. Nothing is
//! reassembled: each fragment is translated as it comes (as Cilium does; kube-proxy's conntrack
//! reassembles first). A later fragment that comes before its first is not translated.
//!
//! Linux's reassembly discards a datagram whose fragments overlap; a fragment that overlaps the
//! first one (which alone decides the connection) is dropped here, so that a datagram's
//! fragments never reach two connections, nor a header other than the one its first was
//! checked and tracked with.
use lb_common::{Counter, FRAGMENT_TIMEOUT_NS, FirstFragment, FragmentKey};

use crate::{
    family::{Family, Ipv4},
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
            remember::<Ipv4>(&key(packet), &first)?;
        }
        Fragment::Later => {
            let frag_off: u16 = ctx
                .load(ETH_HLEN + IP_FRAG_OFF)
                .map_err(|_| Counter::PassedUnparsed)?;
            let start = (u16::from_be(frag_off) & IP_OFFSET) * 8;
            let first = first_of::<Ipv4>(&key(packet), start, now)?;
            packet.tuple.src_port = first.src_port;
            packet.tuple.dst_port = first.dst_port;
        }
    }
    Ok(())
}

/// Keeps `first`, the first fragment of datagram `key`, for the fragments that follow it:
/// `Err(DropFragmentOverlap)` when another first fragment of it (other ports, another length)
/// was seen (a duplicate is the same again).
#[inline(always)]
pub fn remember<F: Family>(key: &F::FragmentKey, first: &FirstFragment) -> Result<(), Counter> {
    if let Some(earlier) = live::<F>(key, first.seen_ns)
        && (earlier.src_port, earlier.dst_port, earlier.end)
            != (first.src_port, first.dst_port, first.end)
    {
        return Err(Counter::DropFragmentOverlap);
    }
    F::remember_first_fragment(key, first);
    Ok(())
}

/// The first fragment of datagram `key`, for its later fragment whose data starts `start` bytes
/// into the datagram's payload: `Err(PassedFragment)` when it was not seen,
/// `Err(DropFragmentOverlap)` when the later fragment overlaps it.
#[inline(always)]
pub fn first_of<F: Family>(
    key: &F::FragmentKey,
    start: u16,
    now: u64,
) -> Result<FirstFragment, Counter> {
    let first = live::<F>(key, now).ok_or(Counter::PassedFragment)?;
    if start < first.end {
        return Err(Counter::DropFragmentOverlap);
    }
    Ok(first)
}

/// The first fragment of the datagram `key`, unless it was seen too long ago to be of this one.
fn live<F: Family>(key: &F::FragmentKey, now: u64) -> Option<FirstFragment> {
    F::first_fragment(key).filter(|first| now.saturating_sub(first.seen_ns) <= FRAGMENT_TIMEOUT_NS)
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
