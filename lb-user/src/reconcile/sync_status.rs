//! Whether the service maps hold what the agent wants, per Service port, readable without the
//! agent: at every sync the agent records a checksum and the counts of each port's desired
//! entries in the pinned `SERVICE_STATUS` map (with the writes that failed), and `lb status`
//! computes the same of what the maps hold and compares. Both go through [`tallies`], so the
//! two sides cannot count differently. A port's entries of both families count together: its
//! service id is the same in the IPv4 and the IPv6 maps.
use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, Ipv6Addr};

use bytemuck::bytes_of as bytes;
use ipnet::{Ipv4Net, Ipv6Net};
use lb_common::{
    Backend, Backend6, FrontendKey, FrontendKey6, KIND_CLUSTER_IP, ServiceStatus, field_text,
    ipv4_be, text_field,
};

use crate::maps::contents::{FamilyContents, MapContents, MapContents6, MapFamily};
use crate::maps::writer::WriteFailure;
use crate::model::ServicePortId;

/// A service port's entries in a [`MapContents`], summed up: a checksum and how many of each.
/// A port's entries are its frontends, the catch-all of its ClusterIP, its backend slots, its
/// source ranges and the origins of its frontends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub digest: u32,
    pub frontends: u32,
    pub backends: u32,
    pub source_ranges: u32,
    pub origins: u32,
}

/// One port's entries being summed up: a checksum of each map's entries, in key order, and
/// their counts.
#[derive(Default)]
struct PortSum {
    frontends: (crc32fast::Hasher, u32),
    backends: (crc32fast::Hasher, u32),
    source_ranges: (crc32fast::Hasher, u32),
    origins: (crc32fast::Hasher, u32),
    /// The catch-alls of its IPv6 ClusterIP frontends.
    catch_alls6: Vec<FrontendKey6>,
}

fn add(sum: &mut (crc32fast::Hasher, u32), parts: &[&[u8]]) {
    for part in parts {
        sum.0.update(part);
    }
    sum.1 += 1;
}

/// A family's service map entries as [`tallies`] sums them up.
pub trait Tallied: MapFamily {
    /// The bytes of a source range's entry.
    fn range_bytes(net: &Self::Net) -> Vec<u8>;
    /// The bytes of a frontend key or a backend value.
    fn key_bytes(key: &Self::FrontendKey) -> &[u8];
    fn backend_bytes(backend: &Self::Backend) -> &[u8];
    /// The catch-all of the ClusterIP frontend `key`, when the port's own entries say it:
    /// IPv6's (an IPv4 port's is its record's `cluster_ip`).
    fn catch_all6(key: &Self::FrontendKey) -> Option<FrontendKey6>;
}

impl Tallied for Ipv4Addr {
    fn range_bytes(net: &Ipv4Net) -> Vec<u8> {
        [net.addr().octets().as_slice(), &[net.prefix_len()]].concat()
    }
    fn key_bytes(key: &FrontendKey) -> &[u8] {
        bytes(key)
    }
    fn backend_bytes(backend: &Backend) -> &[u8] {
        bytes(backend)
    }
    fn catch_all6(_: &FrontendKey) -> Option<FrontendKey6> {
        None
    }
}

impl Tallied for Ipv6Addr {
    fn range_bytes(net: &Ipv6Net) -> Vec<u8> {
        [net.addr().octets().as_slice(), &[net.prefix_len()]].concat()
    }
    fn key_bytes(key: &FrontendKey6) -> &[u8] {
        bytes(key)
    }
    fn backend_bytes(backend: &Backend6) -> &[u8] {
        bytes(backend)
    }
    fn catch_all6(key: &FrontendKey6) -> Option<FrontendKey6> {
        Some(FrontendKey6::any_port(key.addr))
    }
}

/// The tally of every service port in `contents` and `contents6`, by service id: a port's
/// entries of both families count together (its service id is the same in both).
/// `cluster_ip` gives a port's IPv4 ClusterIP (network byte order), whose catch-all is counted
/// with it; None: no catch-all. An IPv6 port's catch-all is that of the address of its
/// ClusterIP frontend (by its origin). One pass over the maps, without copies: it runs on every
/// full sync.
pub fn tallies(
    contents: &MapContents,
    contents6: &MapContents6,
    cluster_ip: impl Fn(u32) -> Option<u32>,
) -> BTreeMap<u32, Tally> {
    let mut ports: HashMap<u32, PortSum> = HashMap::new();
    add_family(&mut ports, contents);
    add_family(&mut ports, contents6);
    ports
        .into_iter()
        .map(|(service_id, mut sum)| {
            let catch_all = cluster_ip(service_id)
                .map(FrontendKey::any_port)
                .and_then(|key| contents.frontends.get_key_value(&key));
            if let Some((key, frontend)) = catch_all {
                add(&mut sum.frontends, &[bytes(key), bytes(frontend)]);
            }
            for key in &sum.catch_alls6 {
                if let Some((key, frontend)) = contents6.frontends.get_key_value(key) {
                    add(&mut sum.frontends, &[bytes(key), bytes(frontend)]);
                }
            }
            (service_id, tally(sum))
        })
        .collect()
}

/// Adds the entries of one family's `contents` to the sums of their ports.
fn add_family<A: Tallied>(ports: &mut HashMap<u32, PortSum>, contents: &FamilyContents<A>) {
    // Service id 0: the catch-alls, which belong to every port of their ClusterIP.
    for (key, frontend) in contents.frontends.iter().filter(|(_, f)| f.service_id != 0) {
        let port = ports.entry(frontend.service_id).or_default();
        add(&mut port.frontends, &[A::key_bytes(key), bytes(frontend)]);
        if let Some(origin) = contents.origins.get(key) {
            add(&mut port.origins, &[A::key_bytes(key), bytes(origin)]);
            if origin.kind == KIND_CLUSTER_IP {
                port.catch_alls6.extend(A::catch_all6(key));
            }
        }
    }
    // A port's slots are consecutive keys: its sum is looked up once per port, not per slot
    // (500k slots at 50k Services).
    let mut backends = contents.backends.iter().peekable();
    while let Some((key, _)) = backends.peek() {
        let service_id = key.service_id;
        let port = ports.entry(service_id).or_default();
        while let Some((key, backend)) = backends.next_if(|(k, _)| k.service_id == service_id) {
            add(&mut port.backends, &[bytes(key), A::backend_bytes(backend)]);
        }
    }
    for range in &contents.source_ranges {
        let port = ports.entry(range.service_id).or_default();
        add(&mut port.source_ranges, &[&A::range_bytes(&range.net)]);
    }
}

fn tally(sum: PortSum) -> Tally {
    let mut digest = crc32fast::Hasher::new();
    for (part, _) in [
        &sum.frontends,
        &sum.backends,
        &sum.source_ranges,
        &sum.origins,
    ] {
        digest.update(&part.clone().finalize().to_ne_bytes());
    }
    Tally {
        digest: digest.finalize(),
        frontends: sum.frontends.1,
        backends: sum.backends.1,
        source_ranges: sum.source_ranges.1,
        origins: sum.origins.1,
    }
}

/// The record of service port `port` (of IPv4 ClusterIP `cluster_ip`; None: IPv6 only) whose
/// desired entries tally `desired`, and whose writes in the sync failed as `failure` says.
pub fn record(
    port: &ServicePortId,
    cluster_ip: Option<Ipv4Addr>,
    desired: Tally,
    failure: Option<&WriteFailure>,
) -> ServiceStatus {
    ServiceStatus {
        namespace: text_field(&port.service.namespace),
        name: text_field(&port.service.name),
        port_name: text_field(&port.port_name),
        cluster_ip: cluster_ip.map_or(0, |ip| ipv4_be(ip.octets())),
        proto: u32::from(port.protocol.ipproto()),
        digest: desired.digest,
        frontends: desired.frontends,
        backends: desired.backends,
        source_ranges: desired.source_ranges,
        origins: desired.origins,
        failed_writes: failure.map_or(0, |f| f.writes as u32),
        error: text_field(failure.map_or("", |f| &f.error)),
    }
}

/// How a service port's entries in the maps compare with what the agent wants.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SyncState {
    InSync,
    /// Entries are there that the agent does not want: more than it wants, or of a port it
    /// does not know.
    Extra,
    /// Entries the agent wants are not there (or not as it wants them).
    Missing,
    /// The agent's writes of the port failed in its last sync: the error.
    Failed(String),
}

impl SyncState {
    pub fn name(&self) -> &'static str {
        match self {
            SyncState::InSync => "in sync",
            SyncState::Extra => "extra",
            SyncState::Missing => "missing",
            SyncState::Failed(_) => "failed",
        }
    }
}

/// One service port as `lb status` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortStatus {
    pub service_id: u32,
    /// None: the maps hold entries of a port the agent has no record of.
    pub record: Option<ServiceStatus>,
    /// What the agent wants (from its record).
    pub desired: Tally,
    /// What the maps hold.
    pub actual: Tally,
    pub state: SyncState,
}

/// Every port of `records` (what the agent wants, by service id) and every other port with
/// entries in `actual` or `actual6` (what the maps hold), in service id order.
pub fn compare(
    records: &BTreeMap<u32, ServiceStatus>,
    actual: &MapContents,
    actual6: &MapContents6,
) -> Vec<PortStatus> {
    let cluster_ip = |id| records.get(&id).map(|r| r.cluster_ip).filter(|&ip| ip != 0);
    let mut actual = tallies(actual, actual6, cluster_ip);
    let mut ports: Vec<PortStatus> = records
        .iter()
        .map(|(&service_id, record)| {
            let desired = Tally {
                digest: record.digest,
                frontends: record.frontends,
                backends: record.backends,
                source_ranges: record.source_ranges,
                origins: record.origins,
            };
            // A port without frontends and slots (all of them lost) has no tally.
            let actual = actual.remove(&service_id).unwrap_or_default();
            let state = if record.failed_writes > 0 {
                SyncState::Failed(field_text(&record.error).to_owned())
            } else {
                state(desired, actual)
            };
            PortStatus {
                service_id,
                record: Some(*record),
                desired,
                actual,
                state,
            }
        })
        .collect();
    ports.extend(actual.into_iter().map(|(service_id, actual)| PortStatus {
        service_id,
        record: None,
        desired: Tally::default(),
        actual,
        state: SyncState::Extra,
    }));
    ports.sort_by_key(|p| p.service_id);
    ports
}

/// In sync when the maps hold exactly the desired entries; missing when fewer of any map are
/// there, or as many but not the same (a desired entry is not there as desired); else extra.
fn state(desired: Tally, actual: Tally) -> SyncState {
    if desired == actual {
        return SyncState::InSync;
    }
    let counts = |t: Tally| [t.frontends, t.backends, t.source_ranges, t.origins];
    let (desired, actual) = (counts(desired), counts(actual));
    let fewer = desired.iter().zip(&actual).any(|(d, a)| a < d);
    if fewer || desired == actual {
        SyncState::Missing
    } else {
        SyncState::Extra
    }
}

#[cfg(test)]
mod tests {
    use lb_common::{
        Backend, BackendKey, Frontend, FrontendOrigin, KIND_CLUSTER_IP, KIND_NODE_PORT, port_be,
    };

    use super::*;
    use crate::maps::contents::SourceRange;
    use crate::model::{Protocol, ServiceName};

    const WEB: u32 = 7;
    const DNS: u32 = 8;
    const WEB_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
    const DNS_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);

    fn fk(ip: Ipv4Addr, port: u16) -> FrontendKey {
        FrontendKey {
            addr: ipv4_be(ip.octets()),
            port: port_be(port),
            proto: 6,
            _pad: 0,
        }
    }

    fn frontend(service_id: u32, backends: u32) -> Frontend {
        Frontend {
            service_id,
            backend_count: backends,
            ..Frontend::default()
        }
    }

    fn backend(last: u8) -> Backend {
        Backend {
            addr: ipv4_be([10, 244, 1, last]),
            port: port_be(8080),
            stats_slot: u16::from(last),
        }
    }

    fn port(name: &str) -> ServicePortId {
        ServicePortId {
            service: ServiceName {
                namespace: "default".into(),
                name: name.into(),
            },
            port_name: "http".into(),
            protocol: Protocol::Tcp,
        }
    }

    /// web: a ClusterIP and a NodePort frontend, two slots, a source range; dns: one frontend,
    /// one slot; each with its ClusterIP's catch-all.
    fn desired() -> MapContents {
        let mut c = MapContents::default();
        let node_port = fk(Ipv4Addr::new(198, 51, 100, 1), 30080);
        for (key, value, kind, name) in [
            (fk(WEB_IP, 80), frontend(WEB, 2), KIND_CLUSTER_IP, "web"),
            (node_port, frontend(WEB, 2), KIND_NODE_PORT, "web"),
            (fk(DNS_IP, 53), frontend(DNS, 1), KIND_CLUSTER_IP, "dns"),
        ] {
            c.frontends.insert(key, value);
            let origin = FrontendOrigin::new("default", name, "http", kind);
            c.origins.insert(key, origin);
        }
        for ip in [WEB_IP, DNS_IP] {
            let catch_all = FrontendKey::any_port(ipv4_be(ip.octets()));
            c.frontends.insert(catch_all, Frontend::default());
        }
        for (service_id, slot, last) in [(WEB, 0, 2), (WEB, 1, 3), (DNS, 0, 4)] {
            c.backends
                .insert(BackendKey { service_id, slot }, backend(last));
        }
        c.source_ranges.insert(SourceRange {
            service_id: WEB,
            net: "203.0.113.0/24".parse().unwrap(),
        });
        c
    }

    /// What the agent records for `desired`, with `failures`.
    fn records(
        desired: &MapContents,
        failures: &BTreeMap<u32, WriteFailure>,
    ) -> BTreeMap<u32, ServiceStatus> {
        let ports = [(WEB, port("web"), WEB_IP), (DNS, port("dns"), DNS_IP)];
        let ip = |sid| {
            ports
                .iter()
                .find(|p| p.0 == sid)
                .map(|p| ipv4_be(p.2.octets()))
        };
        let tallies = tallies(desired, &MapContents6::default(), ip);
        ports
            .iter()
            .map(|(sid, port, ip)| {
                let record = record(port, Some(*ip), tallies[sid], failures.get(sid));
                (*sid, record)
            })
            .collect()
    }

    /// The state of each port `compare` lists, by service id.
    fn states(
        records: &BTreeMap<u32, ServiceStatus>,
        actual: &MapContents,
    ) -> Vec<(u32, SyncState)> {
        compare(records, actual, &MapContents6::default())
            .into_iter()
            .map(|p| (p.service_id, p.state))
            .collect()
    }

    #[test]
    fn the_maps_holding_what_was_recorded_are_in_sync() {
        let desired = desired();
        let records = records(&desired, &BTreeMap::new());
        let web = &records[&WEB];
        assert_eq!(
            (web.frontends, web.backends, web.source_ranges, web.origins),
            (3, 2, 1, 2),
            "the catch-all counts as web's"
        );
        assert_eq!(field_text(&web.name), "web");
        let ports = compare(&records, &desired, &MapContents6::default());
        assert_eq!(ports.len(), 2);
        for port in &ports {
            assert_eq!(port.state, SyncState::InSync, "{port:?}");
            assert_eq!(port.desired, port.actual);
        }
    }

    #[test]
    fn lost_changed_and_stray_entries_name_their_port_missing_or_extra() {
        use SyncState::{Extra, InSync, Missing};
        let desired = desired();
        let records = records(&desired, &BTreeMap::new());
        let with = |change: &dyn Fn(&mut MapContents)| {
            let mut actual = desired.clone();
            change(&mut actual);
            states(&records, &actual)
        };
        let web_key = fk(WEB_IP, 80);
        // Lost: a frontend (with or without its origin), the catch-all, a slot, a range.
        assert_eq!(
            with(&|c| {
                c.frontends.remove(&web_key);
            }),
            [(WEB, Missing), (DNS, InSync)]
        );
        assert_eq!(
            with(&|c| {
                c.frontends
                    .remove(&FrontendKey::any_port(ipv4_be(DNS_IP.octets())));
            }),
            [(WEB, InSync), (DNS, Missing)]
        );
        assert_eq!(
            with(&|c| {
                c.origins.remove(&web_key);
            }),
            [(WEB, Missing), (DNS, InSync)]
        );
        assert_eq!(
            with(&|c| {
                c.backends.clear();
                c.source_ranges.clear();
            }),
            [(WEB, Missing), (DNS, Missing)]
        );
        // Changed: as many entries, not as desired.
        assert_eq!(
            with(&|c| {
                c.backends.insert(
                    BackendKey {
                        service_id: DNS,
                        slot: 0,
                    },
                    backend(9),
                );
            }),
            [(WEB, InSync), (DNS, Missing)]
        );
        assert_eq!(
            with(&|c| {
                c.frontends.insert(web_key, frontend(WEB, 1));
            }),
            [(WEB, Missing), (DNS, InSync)]
        );
        // Stray: a slot more, a range more, a port no record covers.
        assert_eq!(
            with(&|c| {
                let slot = BackendKey {
                    service_id: DNS,
                    slot: 1,
                };
                c.backends.insert(slot, backend(5));
            }),
            [(WEB, InSync), (DNS, Extra)]
        );
        assert_eq!(
            with(&|c| {
                c.source_ranges.insert(SourceRange {
                    service_id: WEB,
                    net: "198.51.100.0/24".parse().unwrap(),
                });
            }),
            [(WEB, Extra), (DNS, InSync)]
        );
        let stray = with(&|c| {
            c.frontends
                .insert(fk(Ipv4Addr::new(10, 96, 0, 12), 80), frontend(9, 0));
        });
        assert_eq!(stray, [(WEB, InSync), (DNS, InSync), (9, Extra)]);
        // Lost and stray at once: missing first.
        assert_eq!(
            with(&|c| {
                c.frontends.remove(&web_key);
                let slot = BackendKey {
                    service_id: WEB,
                    slot: 2,
                };
                c.backends.insert(slot, backend(5));
            }),
            [(WEB, Missing), (DNS, InSync)]
        );
        // A port without entries at all.
        assert_eq!(
            with(&|c| *c = MapContents::default()),
            [(WEB, Missing), (DNS, Missing)]
        );
    }

    #[test]
    fn failed_writes_are_reported_with_their_error() {
        let desired = desired();
        let failure = WriteFailure {
            writes: 2,
            error: "backend insert: No space left on device (os error 28)".into(),
        };
        let records = records(&desired, &BTreeMap::from([(DNS, failure.clone())]));
        assert_eq!(records[&DNS].failed_writes, 2);
        let mut actual = desired.clone();
        actual.backends.retain(|k, _| k.service_id != DNS);
        assert_eq!(
            states(&records, &actual),
            [
                (WEB, SyncState::InSync),
                (DNS, SyncState::Failed(failure.error))
            ]
        );
    }
}
