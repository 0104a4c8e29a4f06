//! The connections the datapath tracks, for `lb conntrack`: one per pair of conntrack entries
//! (original and reply direction, see `lb_common::ConntrackEntry`), read from the pinned maps
//! of both families.
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::time::Duration;

use aya::maps::{Array, HashMap, Map, MapData, MapError};
use lb_common::{
    Addr6, CT_F_MASQUERADE, CT_F_REPLY, Config, ConntrackEntry, ConntrackEntry6, ConntrackKey,
    ConntrackKey6, ConntrackTimeouts, IPPROTO_TCP, IPPROTO_UDP, conntrack_state_name,
    conntrack_timeout_ns, map_name,
};
use nix::libc::ENOENT;
use nix::time::{ClockId, clock_gettime};

/// The key of a conntrack entry of either family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TupleKey {
    V4(ConntrackKey),
    V6(ConntrackKey6),
}

/// A conntrack entry of either family, as the join reads it: the packet's tuple (`src`, `dst`)
/// and what it is rewritten to (`to_src`, `to_dst`).
#[derive(Clone, Copy, Debug)]
pub struct Tracked {
    pub key: TupleKey,
    pub proto: u8,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub to_src: SocketAddr,
    pub to_dst: SocketAddr,
    pub last_seen_ns: u64,
    pub state: u8,
    pub flags: u8,
}

impl From<(ConntrackKey, ConntrackEntry)> for Tracked {
    fn from((key, entry): (ConntrackKey, ConntrackEntry)) -> Self {
        Tracked {
            key: TupleKey::V4(key),
            proto: key.proto,
            src: socket(key.src_addr, key.src_port).into(),
            dst: socket(key.dst_addr, key.dst_port).into(),
            to_src: socket(entry.src_addr, entry.src_port).into(),
            to_dst: socket(entry.dst_addr, entry.dst_port).into(),
            last_seen_ns: entry.last_seen_ns,
            state: entry.state,
            flags: entry.flags,
        }
    }
}

impl From<(ConntrackKey6, ConntrackEntry6)> for Tracked {
    fn from((key, entry): (ConntrackKey6, ConntrackEntry6)) -> Self {
        Tracked {
            key: TupleKey::V6(key),
            proto: key.proto,
            src: socket6(key.src_addr, key.src_port),
            dst: socket6(key.dst_addr, key.dst_port),
            to_src: socket6(entry.src_addr, entry.src_port),
            to_dst: socket6(entry.dst_addr, entry.dst_port),
            last_seen_ns: entry.last_seen_ns,
            state: entry.state,
            flags: entry.flags,
        }
    }
}

/// One connection, joined from the entries of its two directions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connection {
    pub proto: u8,
    pub client: SocketAddr,
    /// The frontend the client reached (ClusterIP, node address of a NodePort, ...).
    pub service: SocketAddr,
    pub backend: SocketAddr,
    /// The source the backend sees, when it is not the client (masquerade).
    pub masquerade: Option<SocketAddr>,
    /// `tcp::*` or `CT_UDP_*` (`conntrack_state_name`).
    pub state: u8,
    /// When the connection expires unless a packet comes, in the datapath's clock (ns).
    pub expires_ns: u64,
    /// The keys of its entries: client → service, and backend → the source the backend saw.
    /// Either may be missing (being created, or removed behind the datapath's back).
    pub original: Option<TupleKey>,
    pub reply: Option<TupleKey>,
}

fn socket(addr: u32, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from(addr.to_ne_bytes()), u16::from_be(port))
}

fn socket6(addr: Addr6, port: u16) -> SocketAddr {
    SocketAddr::new(
        IpAddr::V6(Ipv6Addr::from(addr.octets())),
        u16::from_be(port),
    )
}

/// What identifies a connection in either of its entries: protocol, client, service, backend
/// and the source the backend sees.
type Identity = (u8, SocketAddr, SocketAddr, SocketAddr, SocketAddr);

fn identity(entry: &Tracked) -> Identity {
    if entry.flags & CT_F_REPLY == 0 {
        // client → service, rewritten to seen source → backend.
        (
            entry.proto,
            entry.src,
            entry.dst,
            entry.to_dst,
            entry.to_src,
        )
    } else {
        // backend → seen source, rewritten to service → client.
        (
            entry.proto,
            entry.to_dst,
            entry.to_src,
            entry.src,
            entry.dst,
        )
    }
}

/// The connections of `entries` that have a live entry at `now` (the datapath's clock, ns) with
/// the datapath's `timeouts`: the datapath ignores expired entries, which stay in the LRU map
/// until it needs the room. Sorted by protocol, client, service and backend.
pub fn join<T: Into<Tracked>>(
    entries: impl IntoIterator<Item = T>,
    now: u64,
    timeouts: &ConntrackTimeouts,
) -> Vec<Connection> {
    let mut connections: BTreeMap<Identity, Connection> = BTreeMap::new();
    for entry in entries {
        let entry: Tracked = entry.into();
        let expires_ns = entry.last_seen_ns.saturating_add(conntrack_timeout_ns(
            entry.proto,
            entry.state,
            timeouts,
        ));
        if expires_ns < now {
            continue;
        }
        let id = identity(&entry);
        let (proto, client, service, backend, seen) = id;
        let connection = connections.entry(id).or_insert_with(|| Connection {
            proto,
            client,
            service,
            backend,
            masquerade: (entry.flags & CT_F_MASQUERADE != 0).then_some(seen),
            state: entry.state,
            expires_ns,
            original: None,
            reply: None,
        });
        // Both entries age and change state together; the later one is the latest word.
        if expires_ns > connection.expires_ns {
            connection.expires_ns = expires_ns;
            connection.state = entry.state;
        }
        if entry.flags & CT_F_REPLY == 0 {
            connection.original = Some(entry.key);
        } else {
            connection.reply = Some(entry.key);
        }
    }
    connections.into_values().collect()
}

/// Which connections to show or delete; `None` matches any.
#[derive(Clone, Copy, Debug, Default)]
pub struct Filter {
    pub service: Option<SocketAddr>,
    pub backend: Option<SocketAddr>,
    pub client: Option<IpAddr>,
}

impl Filter {
    pub fn matches(&self, connection: &Connection) -> bool {
        self.service.is_none_or(|s| s == connection.service)
            && self.backend.is_none_or(|b| b == connection.backend)
            && self.client.is_none_or(|c| c == connection.client.ip())
    }
}

pub fn protocol_name(proto: u8) -> String {
    match proto {
        IPPROTO_TCP => "tcp".into(),
        IPPROTO_UDP => "udp".into(),
        other => other.to_string(),
    }
}

/// Linux's name of the state (`conntrack -L`), in lower case.
pub fn state_name(proto: u8, state: u8) -> &'static str {
    conntrack_state_name(proto, state)
}

/// Whole seconds from `now` to `expires_ns` (the datapath's clock).
pub fn expires_in_s(expires_ns: u64, now: u64) -> u64 {
    Duration::from_nanos(expires_ns.saturating_sub(now)).as_secs()
}

/// The datapath's clock now (`lb_common::Clock`, in ns). It counts jiffies, which is
/// CLOCK_MONOTONIC at tick resolution lagging by a fraction of a second: expiries read from it
/// are early by that much at most.
pub fn datapath_now() -> Result<u64, nix::Error> {
    let now = Duration::from(clock_gettime(ClockId::CLOCK_MONOTONIC_COARSE)?);
    Ok(u64::try_from(now.as_nanos()).unwrap_or(u64::MAX))
}

/// The conntrack timeouts the running datapath applies: the agent's flags, from the pinned
/// config in `pin_dir`.
pub fn pinned_timeouts(pin_dir: &Path) -> Result<ConntrackTimeouts, MapError> {
    let data = MapData::from_pin(pin_dir.join(map_name::CONFIG))?;
    let config: Array<MapData, Config> = Array::try_from(Map::from_map_data(data)?)?;
    Ok(config.get(&0, 0)?.timeouts)
}

/// The pinned conntrack maps in `pin_dir`: the main table and the unconfirmed connections', of
/// both families.
pub struct ConntrackMap {
    maps: Vec<HashMap<MapData, ConntrackKey, ConntrackEntry>>,
    maps6: Vec<HashMap<MapData, ConntrackKey6, ConntrackEntry6>>,
}

/// A removal of a key that is not there is no failure.
fn removed(result: Result<(), MapError>) -> Result<(), MapError> {
    match result {
        Err(MapError::SyscallError(err)) if err.io_error.raw_os_error() == Some(ENOENT) => Ok(()),
        other => other,
    }
}

impl ConntrackMap {
    /// A table not pinned (by an agent of before it: the unconfirmed one, IPv6's) is left out.
    pub fn open(pin_dir: &Path) -> Result<Self, MapError> {
        fn open<K: aya::Pod, V: aya::Pod>(
            pin_dir: &Path,
            names: &[&str],
        ) -> Result<Vec<HashMap<MapData, K, V>>, MapError> {
            names
                .iter()
                .filter(|name| pin_dir.join(name).exists())
                .map(|name| {
                    let data = MapData::from_pin(pin_dir.join(name))?;
                    HashMap::try_from(Map::from_map_data(data)?)
                })
                .collect()
        }
        // The main table must be there: opened whether pinned or not, so that its absence is an
        // error.
        let main = MapData::from_pin(pin_dir.join(map_name::CONNTRACK))?;
        let mut maps = vec![HashMap::try_from(Map::from_map_data(main)?)?];
        maps.extend(open(pin_dir, &[map_name::CONNTRACK_UNCONFIRMED])?);
        let maps6 = open(
            pin_dir,
            &[map_name::CONNTRACK6, map_name::CONNTRACK6_UNCONFIRMED],
        )?;
        Ok(ConntrackMap { maps, maps6 })
    }

    /// Every entry of the tables; those the datapath replaces or moves during the walk may be
    /// missed or seen twice.
    pub fn entries(&self) -> Result<Vec<Tracked>, MapError> {
        let v4 = self
            .maps
            .iter()
            .flat_map(|map| map.iter())
            .map(|entry| entry.map(Tracked::from));
        let v6 = self
            .maps6
            .iter()
            .flat_map(|map| map.iter())
            .map(|entry| entry.map(Tracked::from));
        v4.chain(v6).collect()
    }

    /// Deletes both entries of `connection`, from either table; entries already gone are no
    /// failure.
    pub fn delete(&mut self, connection: &Connection) -> Result<(), MapError> {
        for key in [connection.original, connection.reply].iter().flatten() {
            match key {
                TupleKey::V4(key) => {
                    for map in &mut self.maps {
                        removed(map.remove(key))?;
                    }
                }
                TupleKey::V6(key) => {
                    for map in &mut self.maps6 {
                        removed(map.remove(key))?;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{CT_UDP_STREAM, ipv4_be, port_be, tcp};

    const SECOND: u64 = 1_000_000_000;
    const TIMEOUTS: ConntrackTimeouts = ConntrackTimeouts::KUBE_PROXY;
    const TCP_ESTABLISHED_NS: u64 = TIMEOUTS.tcp_established_s as u64 * SECOND;
    const UDP_STREAM_NS: u64 = TIMEOUTS.udp_stream_s as u64 * SECOND;

    fn join(
        entries: impl IntoIterator<Item = (ConntrackKey, ConntrackEntry)>,
        now: u64,
    ) -> Vec<Connection> {
        super::join(entries, now, &TIMEOUTS)
    }

    fn addr(s: &str) -> SocketAddrV4 {
        s.parse().unwrap()
    }

    fn at(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn key(src: SocketAddrV4, dst: SocketAddrV4, proto: u8) -> ConntrackKey {
        ConntrackKey {
            src_addr: ipv4_be(src.ip().octets()),
            dst_addr: ipv4_be(dst.ip().octets()),
            src_port: port_be(src.port()),
            dst_port: port_be(dst.port()),
            proto,
            _pad0: 0,
            _pad1: 0,
        }
    }

    fn entry(to: ConntrackKey, flags: u8, state: u8, last_seen_ns: u64) -> ConntrackEntry {
        ConntrackEntry {
            last_seen_ns,
            src_addr: to.src_addr,
            dst_addr: to.dst_addr,
            src_port: to.src_port,
            dst_port: to.dst_port,
            service_id: 7,
            state,
            flags,
            ..ConntrackEntry::default()
        }
    }

    /// Both entries of a connection as the datapath writes them.
    fn entries(
        proto: u8,
        client: &str,
        service: &str,
        backend: &str,
        masquerade: Option<&str>,
        last_seen_ns: u64,
    ) -> [(ConntrackKey, ConntrackEntry); 2] {
        let (client, service, backend) = (addr(client), addr(service), addr(backend));
        let seen = masquerade.map_or(client, addr);
        let masq = if masquerade.is_some() {
            CT_F_MASQUERADE
        } else {
            0
        };
        let state = if proto == IPPROTO_TCP {
            tcp::ESTABLISHED
        } else {
            CT_UDP_STREAM
        };
        [
            (
                key(client, service, proto),
                entry(key(seen, backend, proto), masq, state, last_seen_ns),
            ),
            (
                key(backend, seen, proto),
                entry(
                    key(service, client, proto),
                    CT_F_REPLY | masq,
                    state,
                    last_seen_ns,
                ),
            ),
        ]
    }

    #[test]
    fn both_directions_make_one_connection() {
        let now = 100 * SECOND;
        let mut all: Vec<_> = [
            entries(
                IPPROTO_TCP,
                "198.51.100.2:40000",
                "198.51.100.1:30080",
                "10.244.1.3:8080",
                Some("198.51.100.1:61000"),
                now - SECOND,
            ),
            entries(
                IPPROTO_UDP,
                "10.244.1.2:40001",
                "10.96.0.10:53",
                "10.244.1.4:53",
                None,
                now - 2 * SECOND,
            ),
        ]
        .into_iter()
        .flatten()
        .collect();
        // A reply entry alone (its original removed) is still the connection.
        let [_, orphan] = entries(
            IPPROTO_UDP,
            "10.244.1.2:40002",
            "10.96.0.10:53",
            "10.244.1.4:53",
            None,
            now,
        );
        all.push(orphan);
        // The map's order is a hash's: interleave.
        all.swap(0, 3);

        let connections = join(all.clone(), now);
        assert_eq!(connections.len(), 3, "{connections:#?}");
        let tcp = &connections[0];
        assert_eq!(tcp.proto, IPPROTO_TCP);
        assert_eq!(tcp.client, at("198.51.100.2:40000"));
        assert_eq!(tcp.service, at("198.51.100.1:30080"));
        assert_eq!(tcp.backend, at("10.244.1.3:8080"));
        assert_eq!(tcp.masquerade, Some(at("198.51.100.1:61000")));
        assert_eq!(tcp.state, tcp::ESTABLISHED);
        assert_eq!(tcp.expires_ns, now - SECOND + TCP_ESTABLISHED_NS);
        let tcp_keys: Vec<_> = all[..4]
            .iter()
            .filter(|(k, _)| k.proto == IPPROTO_TCP)
            .map(|(k, _)| TupleKey::V4(*k))
            .collect();
        assert!(tcp_keys.contains(&tcp.original.unwrap()));
        assert!(tcp_keys.contains(&tcp.reply.unwrap()));
        assert_ne!(tcp.original, tcp.reply);

        let udp = &connections[1];
        assert_eq!(udp.client, at("10.244.1.2:40001"));
        assert_eq!(udp.masquerade, None);
        assert!(udp.original.is_some() && udp.reply.is_some());
        assert_eq!(
            expires_in_s(udp.expires_ns, now),
            (UDP_STREAM_NS - 2 * SECOND) / SECOND
        );
        let orphan = &connections[2];
        assert_eq!(orphan.client, at("10.244.1.2:40002"));
        assert_eq!(orphan.backend, at("10.244.1.4:53"));
        assert_eq!((orphan.original, orphan.reply.is_some()), (None, true));
    }

    #[test]
    fn ipv6_entries_make_a_connection_of_ipv6_addresses() {
        let key6 = |src: &str, dst: &str| {
            let (src, dst) = (at(src), at(dst));
            let addr = |a: SocketAddr| match a.ip() {
                IpAddr::V6(ip) => Addr6::from_octets(ip.octets()),
                IpAddr::V4(_) => unreachable!("IPv6 test addresses"),
            };
            ConntrackKey6 {
                src_addr: addr(src),
                dst_addr: addr(dst),
                src_port: port_be(src.port()),
                dst_port: port_be(dst.port()),
                proto: IPPROTO_TCP,
                ..ConntrackKey6::default()
            }
        };
        let entry6 = |to: ConntrackKey6, flags: u8| ConntrackEntry6 {
            last_seen_ns: SECOND,
            src_addr: to.src_addr,
            dst_addr: to.dst_addr,
            src_port: to.src_port,
            dst_port: to.dst_port,
            state: tcp::ESTABLISHED,
            flags,
            ..ConntrackEntry6::default()
        };
        let (client, service) = ("[2001:db8:1::2]:40000", "[2001:db8:96::10]:80");
        let (backend, node) = ("[2001:db8:244::b]:8080", "[2001:db8:100::10]:61000");
        let original = key6(client, service);
        let reply = key6(backend, node);
        let connections = super::join(
            [
                (original, entry6(key6(node, backend), CT_F_MASQUERADE)),
                (
                    reply,
                    entry6(key6(service, client), CT_F_REPLY | CT_F_MASQUERADE),
                ),
            ],
            2 * SECOND,
            &TIMEOUTS,
        );
        assert_eq!(connections.len(), 1, "{connections:#?}");
        let c = &connections[0];
        assert_eq!(
            (c.client, c.service, c.backend, c.masquerade),
            (at(client), at(service), at(backend), Some(at(node)))
        );
        assert_eq!(
            (c.original, c.reply),
            (Some(TupleKey::V6(original)), Some(TupleKey::V6(reply)))
        );
    }

    #[test]
    fn expired_connections_are_left_out() {
        let udp = entries(
            IPPROTO_UDP,
            "10.244.1.2:40001",
            "10.96.0.10:53",
            "10.244.1.4:53",
            None,
            SECOND,
        );
        assert_eq!(join(udp, SECOND + UDP_STREAM_NS).len(), 1);
        assert!(join(udp, 2 * SECOND + UDP_STREAM_NS).is_empty());
    }

    #[test]
    fn filters_select_by_service_backend_and_client() {
        let now = 10 * SECOND;
        let all = join(
            [
                entries(
                    IPPROTO_TCP,
                    "198.51.100.2:40000",
                    "10.96.0.10:80",
                    "10.244.1.3:8080",
                    None,
                    now,
                ),
                entries(
                    IPPROTO_TCP,
                    "198.51.100.2:40001",
                    "10.96.0.10:80",
                    "10.244.1.4:8080",
                    None,
                    now,
                ),
                entries(
                    IPPROTO_TCP,
                    "198.51.100.3:40000",
                    "10.96.0.11:80",
                    "10.244.1.3:8080",
                    None,
                    now,
                ),
            ]
            .into_iter()
            .flatten(),
            now,
        );
        let clients = |filter: Filter| -> Vec<String> {
            all.iter()
                .filter(|c| filter.matches(c))
                .map(|c| c.client.to_string())
                .collect()
        };
        assert_eq!(clients(Filter::default()).len(), 3);
        let service = Some(at("10.96.0.10:80"));
        let backend = Some(at("10.244.1.3:8080"));
        assert_eq!(
            clients(Filter {
                service,
                ..Filter::default()
            }),
            ["198.51.100.2:40000", "198.51.100.2:40001"]
        );
        assert_eq!(
            clients(Filter {
                backend,
                ..Filter::default()
            }),
            ["198.51.100.2:40000", "198.51.100.3:40000"]
        );
        assert_eq!(
            clients(Filter {
                client: Some("198.51.100.3".parse().unwrap()),
                ..Filter::default()
            }),
            ["198.51.100.3:40000"]
        );
        assert_eq!(
            clients(Filter {
                service,
                backend,
                client: None
            }),
            ["198.51.100.2:40000"]
        );
        let wrong_port = Some(at("10.244.1.3:8081"));
        assert!(
            clients(Filter {
                backend: wrong_port,
                ..Filter::default()
            })
            .is_empty()
        );
    }

    #[test]
    fn names() {
        assert_eq!(protocol_name(IPPROTO_TCP), "tcp");
        assert_eq!(protocol_name(IPPROTO_UDP), "udp");
        assert_eq!(state_name(IPPROTO_TCP, tcp::SYN_RECV), "syn_recv");
        assert_eq!(state_name(IPPROTO_TCP, tcp::TIME_WAIT), "time_wait");
        assert_eq!(state_name(IPPROTO_UDP, CT_UDP_STREAM), "stream");
        assert_eq!(expires_in_s(10 * SECOND + 999_999_999, 0), 10);
        assert_eq!(expires_in_s(SECOND, 2 * SECOND), 0);
    }
}
