//! UDP conntrack of endpoints that went away, removed as kube-proxy flushes it: UDP has no end
//! of connection, so a client that keeps its source port (a DNS resolver) would stay on its
//! entry, and a dead backend, until the entry times out.
use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use lb_common::{
    Addr6, Backend, Backend6, BackendKey, CT_F_REPLY, ConntrackEntry, ConntrackEntry6,
    ConntrackKey, ConntrackKey6, FrontendKey, IPPROTO_UDP,
};

use crate::maps::contents::{FamilyContents, MapFamily, Records};
use crate::maps::stats_slots::FamilyBackend;

/// An endpoint of one UDP service port, of either family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct UdpEndpoint {
    pub service_id: u32,
    /// Without its counter slot: a counter slot change is no removal.
    pub backend: FamilyBackend,
}

/// Every endpoint (of either list) of the UDP service ports in `contents`, of either family.
pub fn udp_endpoints<A: MapFamily, R: Records>(
    contents: &FamilyContents<A, R>,
) -> BTreeSet<UdpEndpoint>
where
    for<'b> &'b A::Backend: Into<FamilyBackend>,
{
    let udp: BTreeSet<u32> = contents
        .frontends
        .iter()
        .filter(|(key, _)| A::frontend_proto(key) == IPPROTO_UDP)
        .map(|(_, frontend)| frontend.service_id)
        .collect();
    contents
        .backends
        .iter()
        .filter(|(key, _)| udp.contains(&key.service_id))
        .map(|(key, backend)| UdpEndpoint {
            service_id: key.service_id,
            backend: backend.into(),
        })
        .collect()
}

/// [`udp_endpoints`] of the service ports that have a frontend among `frontends`.
pub fn udp_endpoints_of<'a, R: Records>(
    contents: &FamilyContents<Ipv4Addr, R>,
    frontends: impl IntoIterator<Item = &'a FrontendKey>,
) -> BTreeSet<UdpEndpoint> {
    let udp: BTreeSet<u32> = frontends
        .into_iter()
        .filter(|key| key.proto == IPPROTO_UDP)
        .filter_map(|key| contents.frontends.get(key))
        .map(|frontend| frontend.service_id)
        .collect();
    udp.into_iter()
        .flat_map(|service_id| {
            let slots = BackendKey {
                service_id,
                slot: 0,
            }..=BackendKey {
                service_id,
                slot: u32::MAX,
            };
            contents
                .backends
                .range(slots)
                .map(move |(_, backend)| UdpEndpoint {
                    service_id,
                    backend: backend.into(),
                })
        })
        .collect()
}

/// The conntrack keys of connections to `removed` endpoints, both directions: the original
/// one is rewritten to the endpoint, the reply one comes from it. Matched by service port
/// too, so the flows of another service with the same endpoint stay.
pub fn stale_entries<'a>(
    entries: impl IntoIterator<Item = (ConntrackKey, ConntrackEntry)> + 'a,
    removed: &'a BTreeSet<UdpEndpoint>,
) -> impl Iterator<Item = ConntrackKey> + 'a {
    entries.into_iter().filter_map(move |(key, entry)| {
        let (addr, port) = if entry.flags & CT_F_REPLY != 0 {
            (key.src_addr, key.src_port)
        } else {
            (entry.dst_addr, entry.dst_port)
        };
        let endpoint = UdpEndpoint {
            service_id: entry.service_id,
            backend: FamilyBackend::V4(Backend {
                addr,
                port,
                stats_slot: 0,
            }),
        };
        (key.proto == IPPROTO_UDP && removed.contains(&endpoint)).then_some(key)
    })
}

/// [`stale_entries`] of the IPv6 conntrack table.
pub fn stale_entries6<'a>(
    entries: impl IntoIterator<Item = (ConntrackKey6, ConntrackEntry6)> + 'a,
    removed: &'a BTreeSet<UdpEndpoint>,
) -> impl Iterator<Item = ConntrackKey6> + 'a {
    entries.into_iter().filter_map(move |(key, entry)| {
        let (addr, port): (Addr6, u16) = if entry.flags & CT_F_REPLY != 0 {
            (key.src_addr, key.src_port)
        } else {
            (entry.dst_addr, entry.dst_port)
        };
        let endpoint = UdpEndpoint {
            service_id: entry.service_id,
            backend: FamilyBackend::V6(Backend6 {
                addr,
                port,
                stats_slot: 0,
            }),
        };
        (key.proto == IPPROTO_UDP && removed.contains(&endpoint)).then_some(key)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::contents::MapContents;
    use lb_common::{
        BackendKey, CT_F_MASQUERADE, Frontend, FrontendKey, IPPROTO_TCP, ipv4_be, port_be,
    };

    fn backend(last: u8) -> Backend {
        Backend {
            addr: ipv4_be([10, 244, 1, last]),
            port: port_be(53),
            stats_slot: 0,
        }
    }

    fn key(src: (u32, u16), dst: (u32, u16), proto: u8) -> ConntrackKey {
        ConntrackKey {
            src_addr: src.0,
            dst_addr: dst.0,
            src_port: src.1,
            dst_port: dst.1,
            proto,
            _pad0: 0,
            _pad1: 0,
        }
    }

    /// Both entries of a connection from `client` to service `service_id` at `vip`, served
    /// by `backend` and seen by it from `seen`.
    fn connection(
        service_id: u32,
        proto: u8,
        client: (u32, u16),
        vip: (u32, u16),
        backend: Backend,
        seen: (u32, u16),
    ) -> [(ConntrackKey, ConntrackEntry); 2] {
        let entry = |to: ConntrackKey, flags| ConntrackEntry {
            src_addr: to.src_addr,
            dst_addr: to.dst_addr,
            src_port: to.src_port,
            dst_port: to.dst_port,
            service_id,
            flags,
            ..ConntrackEntry::default()
        };
        let b = (backend.addr, backend.port);
        [
            (key(client, vip, proto), entry(key(seen, b, proto), 0)),
            (
                key(b, seen, proto),
                entry(key(vip, client, proto), CT_F_REPLY | CT_F_MASQUERADE),
            ),
        ]
    }

    #[test]
    fn udp_endpoints_are_those_of_udp_frontends() {
        let mut contents = MapContents::default();
        for (sid, proto) in [(1, IPPROTO_UDP), (2, IPPROTO_TCP)] {
            let key = FrontendKey {
                addr: ipv4_be([10, 96, 0, sid as u8]),
                port: port_be(53),
                proto,
                _pad: 0,
            };
            let frontend = Frontend {
                service_id: sid,
                ..Frontend::default()
            };
            contents.frontends.insert(key, frontend);
            let slot = BackendKey {
                service_id: sid,
                slot: 0,
            };
            // Counted: the endpoint is the same without its counter slot.
            let counted = Backend {
                stats_slot: 5,
                ..backend(2)
            };
            contents.backends.insert(slot, counted);
        }
        // A catch-all frontend (protocol 0) makes nothing UDP.
        contents.frontends.insert(
            FrontendKey::any_port(ipv4_be([10, 96, 0, 2])),
            Frontend::default(),
        );
        let want = BTreeSet::from([UdpEndpoint {
            service_id: 1,
            backend: FamilyBackend::V4(backend(2)),
        }]);
        assert_eq!(udp_endpoints(&contents), want);
        let keys: Vec<FrontendKey> = contents.frontends.keys().copied().collect();
        assert_eq!(udp_endpoints_of(&contents, &keys), want);
        assert!(
            udp_endpoints_of(&contents, &keys[1..]).is_empty(),
            "TCP only"
        );
    }

    #[test]
    fn both_directions_of_connections_to_removed_udp_endpoints_are_stale() {
        let vip = (ipv4_be([10, 96, 0, 10]), port_be(53));
        let node = ipv4_be([198, 51, 100, 1]);
        let client = (ipv4_be([10, 244, 1, 9]), port_be(40000));
        let external = (ipv4_be([198, 51, 100, 2]), port_be(40001));
        let masq = (node, port_be(61000));
        let (b, c) = (backend(2), backend(3));
        let entries: Vec<_> = [
            // To the removed endpoint b of service 7: pod client (not masqueraded) and an
            // external one (masqueraded: the reply entry holds its SNAT port).
            connection(7, IPPROTO_UDP, client, vip, b, client),
            connection(7, IPPROTO_UDP, external, vip, b, masq),
            // To c, which stays.
            connection(7, IPPROTO_UDP, (client.0, port_be(40002)), vip, c, client),
            // b serving another service, and TCP with b's address and port.
            connection(8, IPPROTO_UDP, (client.0, port_be(40003)), vip, b, client),
            connection(7, IPPROTO_TCP, (client.0, port_be(40004)), vip, b, client),
        ]
        .into_iter()
        .flatten()
        .collect();
        let removed = BTreeSet::from([UdpEndpoint {
            service_id: 7,
            backend: FamilyBackend::V4(b),
        }]);
        let stale: Vec<ConntrackKey> = stale_entries(entries.clone(), &removed).collect();
        let want: Vec<ConntrackKey> = entries[..4].iter().map(|(k, _)| *k).collect();
        assert_eq!(stale, want);
        assert_eq!(stale_entries(entries, &BTreeSet::new()).count(), 0);
    }
}
