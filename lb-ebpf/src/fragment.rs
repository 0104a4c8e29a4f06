//! IPv4 fragments of translated flows. Only the first fragment carries the ports, so its ports
//! are remembered by the datagram's identity (addresses, protocol, IP ID) and a later fragment
//! takes them up to find the same connection, and so the same endpoint. Nothing is reassembled:
//! each fragment is translated as it comes (as Cilium does; kube-proxy's conntrack reassembles
//! first). A later fragment that comes before its first is not translated.
use lb_common::{Counter, FragmentKey, FragmentPorts};

use crate::{
    maps,
    parse::{Fragment, Packet},
};

/// Keeps a first fragment's ports for the fragments that follow it, and fills them into a later
/// fragment: `Err(PassedFragment)` when its first was not seen. Every first fragment is kept, not
/// only translated ones: fragments are rare, and one map access per packet keeps this cheap on
/// the programs' stack.
pub fn follow(packet: &mut Packet) -> Result<(), Counter> {
    match packet.fragment {
        Fragment::Whole => {}
        Fragment::First => {
            let ports = FragmentPorts {
                src_port: packet.tuple.src_port,
                dst_port: packet.tuple.dst_port,
            };
            maps::remember_fragment_ports(&key(packet), &ports);
        }
        Fragment::Later => {
            let ports = maps::fragment_ports(&key(packet)).ok_or(Counter::PassedFragment)?;
            packet.tuple.src_port = ports.src_port;
            packet.tuple.dst_port = ports.dst_port;
        }
    }
    Ok(())
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
