//! `lb services`: every frontend with its Service port, and the backends it sends new
//! connections to, with their traffic counters (`ipvsadm -Ln --stats`).
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use anyhow::Result;
use aya::maps::{HashMap, MapData, PerCpuArray};
use comfy_table::{Table, presets};
use lb_common::{
    Backend, Backend6, BackendKey, BackendStats, FRONTEND_F_LOCAL, FRONTEND_F_MASQUERADE,
    FRONTEND_F_PRESERVE_SOURCE, FRONTEND_F_SOURCE_RANGES, Frontend, FrontendKey, FrontendKey6,
    FrontendOrigin, LOCAL_SLOT, SCHED_FLOW_HASH, SCHED_RANDOM, SCHED_ROUND_ROBIN,
    SCHED_SOURCE_HASH, map_name,
};
use lb_user::error_chain;
use lb_user::maps::connections::protocol_name;
use lb_user::maps::pins;
use lb_user::maps::stats_slots::{self, PortEndpoint};
use lb_user::model::IpFamily;
use serde::Serialize;

use crate::cli::args::{Output, StatsArgs};

pub fn run(args: StatsArgs) -> Result<()> {
    let dir = pins::find(&args.bpffs, map_name::FRONTENDS)?;
    let rows = rows(&Pinned::read(&dir)?);
    match args.output {
        Output::Table => print!("{}", table(&rows)),
        Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
    }
    Ok(())
}

/// An endpoint whose masquerade ports ran out for some new connections, as `lb stats` lists it.
#[derive(Debug, Serialize)]
pub struct PortsExhausted {
    /// "namespace/name" of its Service ("" when its origin is not pinned).
    pub service: String,
    pub backend: SocketAddr,
    /// New connections dropped (`drop_snat_ports_exhausted` of this endpoint).
    pub connections: u64,
}

/// The endpoints of the maps pinned in `dir` whose masquerade ports ran out, once each (its
/// frontends share its counters).
pub fn ports_exhausted(dir: &Path) -> Result<Vec<PortsExhausted>> {
    let mut seen = BTreeMap::new();
    for row in rows(&Pinned::read(dir)?) {
        for backend in row.backends.iter().filter(|b| b.ports_exhausted > 0) {
            seen.entry((row.service_id, backend.address))
                .or_insert_with(|| PortsExhausted {
                    service: row.service.clone(),
                    backend: backend.address,
                    connections: backend.ports_exhausted,
                });
        }
    }
    Ok(seen.into_values().collect())
}

/// A frontend of either family: where it is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct FrontendAt {
    addr: IpAddr,
    /// Host byte order; 0: a ClusterIP's catch-all.
    port: u16,
    proto: u8,
}

impl From<FrontendKey> for FrontendAt {
    fn from(key: FrontendKey) -> Self {
        FrontendAt {
            addr: Ipv4Addr::from(key.addr.to_ne_bytes()).into(),
            port: u16::from_be(key.port),
            proto: key.proto,
        }
    }
}

impl From<FrontendKey6> for FrontendAt {
    fn from(key: FrontendKey6) -> Self {
        FrontendAt {
            addr: Ipv6Addr::from(key.addr.octets()).into(),
            port: u16::from_be(key.port),
            proto: key.proto,
        }
    }
}

/// An endpoint of either family in a backend slot.
#[derive(Debug, Clone, Copy)]
struct SlotBackend {
    address: SocketAddr,
    /// Its counter slot and the slot's owner when it counts this endpoint.
    counter: (u16, u32),
}

impl SlotBackend {
    fn v4(service_id: u32, backend: &Backend) -> Self {
        SlotBackend {
            address: socket(backend.addr, backend.port).into(),
            counter: (
                backend.stats_slot,
                PortEndpoint::new(service_id, backend).owner(),
            ),
        }
    }

    fn v6(service_id: u32, backend: &Backend6) -> Self {
        SlotBackend {
            address: SocketAddr::new(
                Ipv6Addr::from(backend.addr.octets()).into(),
                u16::from_be(backend.port),
            ),
            counter: (
                backend.stats_slot,
                PortEndpoint::new(service_id, backend).owner(),
            ),
        }
    }
}

/// What the pinned maps of both families hold, as `lb services` shows it.
#[derive(Debug, Default)]
struct Pinned {
    frontends: BTreeMap<FrontendAt, Frontend>,
    /// By family: both families' lists have the same keys (one service id space).
    backends: BTreeMap<(IpFamily, BackendKey), SlotBackend>,
    origins: BTreeMap<FrontendAt, FrontendOrigin>,
    /// The counter slots the backends refer to, summed over CPUs (`owner` as on CPU 0).
    stats: BTreeMap<u16, BackendStats>,
}

/// Every entry of the hash map pinned as `name` in `dir`.
fn pinned_entries<K: aya::Pod + Ord, V: aya::Pod>(
    dir: &Path,
    name: &str,
) -> Result<BTreeMap<K, V>> {
    pins::open::<HashMap<MapData, K, V>>(dir, name)?
        .iter()
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("reading {name}: {}", error_chain(&e)))
}

impl Pinned {
    fn read(dir: &Path) -> Result<Self> {
        let read = |name: &str, e: aya::maps::MapError| {
            anyhow::anyhow!("reading {name}: {}", error_chain(&e))
        };
        let frontends4: BTreeMap<FrontendKey, Frontend> = pinned_entries(dir, map_name::FRONTENDS)?;
        let frontends6: BTreeMap<FrontendKey6, Frontend> =
            pinned_entries(dir, map_name::FRONTENDS6)?;
        let backends4: BTreeMap<BackendKey, Backend> = pinned_entries(dir, map_name::BACKENDS)?;
        let backends6: BTreeMap<BackendKey, Backend6> = pinned_entries(dir, map_name::BACKENDS6)?;
        let origins4: BTreeMap<FrontendKey, FrontendOrigin> =
            pinned_entries(dir, map_name::FRONTEND_ORIGINS)?;
        let origins6: BTreeMap<FrontendKey6, FrontendOrigin> =
            pinned_entries(dir, map_name::FRONTEND_ORIGINS6)?;
        let frontends = (frontends4.into_iter().map(|(k, f)| (k.into(), f)))
            .chain(frontends6.into_iter().map(|(k, f)| (k.into(), f)))
            .collect();
        let origins = (origins4.into_iter().map(|(k, o)| (k.into(), o)))
            .chain(origins6.into_iter().map(|(k, o)| (k.into(), o)))
            .collect();
        let name = map_name::BACKEND_STATS;
        let array: PerCpuArray<MapData, BackendStats> = pins::open(dir, name)?;
        // Only the slots in use: the array is mostly free slots, each as many values as CPUs.
        let slots4 = backends4.values().map(|b| b.stats_slot);
        let stats = stats_slots::in_use(slots4.chain(backends6.values().map(|b| b.stats_slot)))
            .into_iter()
            .filter(|&slot| u32::from(slot) < array.len())
            .map(|slot| {
                let per_cpu = array.get(&u32::from(slot), 0)?;
                Ok((slot, BackendStats::sum(per_cpu.iter())))
            })
            .collect::<Result<_, _>>()
            .map_err(|e| read(name, e))?;
        let backends = backends4
            .iter()
            .map(|(k, b)| ((IpFamily::V4, *k), SlotBackend::v4(k.service_id, b)))
            .chain(
                backends6
                    .iter()
                    .map(|(k, b)| ((IpFamily::V6, *k), SlotBackend::v6(k.service_id, b))),
            )
            .collect();
        Ok(Pinned {
            frontends,
            backends,
            origins,
            stats,
        })
    }
}

/// One frontend as `-o json` prints it.
#[derive(Debug, Serialize)]
struct Row {
    /// "IP:PORT", "[IPv6]:PORT".
    frontend: String,
    protocol: String,
    /// ClusterIP, NodePort, externalIP or LoadBalancer.
    kind: &'static str,
    /// "namespace/name"; "" for a frontend whose origin is not pinned (written by an agent
    /// before `lb services` existed, until the next agent rewrites it).
    service: String,
    namespace: String,
    name: String,
    port_name: String,
    service_id: u32,
    scheduler: &'static str,
    /// The traffic policy this frontend applies: internalTrafficPolicy for a ClusterIP,
    /// externalTrafficPolicy for the others.
    traffic_policy: &'static str,
    flags: Vec<&'static str>,
    /// sessionAffinity ClientIP timeout; 0: none.
    affinity_timeout_s: u32,
    backends: Vec<BackendRow>,
}

#[derive(Debug, Serialize)]
struct BackendRow {
    address: SocketAddr,
    /// Its first slot in the list (a Maglev table gives an endpoint many).
    slot: u32,
    /// Slots it fills in the list.
    slots: u32,
    /// "ready" in the Cluster list, "local" in the list of this node's endpoints (traffic
    /// policy Local).
    state: &'static str,
    /// Whether the endpoint has a counter slot (false: all were in use; its counters are 0).
    counted: bool,
    /// The service port's counters of this endpoint (shared by the port's frontends).
    connections: u64,
    packets: u64,
    bytes: u64,
    /// New connections to it dropped for want of a free masquerade port.
    ports_exhausted: u64,
}

fn socket(addr: u32, port: u16) -> std::net::SocketAddrV4 {
    std::net::SocketAddrV4::new(Ipv4Addr::from(addr.to_ne_bytes()), u16::from_be(port))
}

fn scheduler_name(scheduler: u32) -> &'static str {
    match scheduler {
        SCHED_RANDOM => "random",
        SCHED_ROUND_ROBIN => "rr",
        SCHED_SOURCE_HASH => "sh",
        SCHED_FLOW_HASH => "maglev",
        _ => "unknown",
    }
}

fn flag_names(flags: u32) -> Vec<&'static str> {
    [
        (FRONTEND_F_MASQUERADE, "masquerade"),
        (FRONTEND_F_LOCAL, "local"),
        (FRONTEND_F_PRESERVE_SOURCE, "preserve-source"),
        (FRONTEND_F_SOURCE_RANGES, "source-ranges"),
    ]
    .into_iter()
    .filter(|(bit, _)| flags & bit != 0)
    .map(|(_, name)| name)
    .collect()
}

/// Every frontend of both families but the ClusterIPs' catch-alls (which only reject), sorted
/// by address (IPv4 first), port and protocol; under each, the endpoints of the list its traffic policy uses, in slot order.
fn rows(pinned: &Pinned) -> Vec<Row> {
    pinned
        .frontends
        .iter()
        .filter(|(key, _)| key.port != 0)
        .map(|(key, frontend)| {
            let local = frontend.flags & FRONTEND_F_LOCAL != 0;
            let (base, count, state) = if local {
                (LOCAL_SLOT, frontend.local_count, "local")
            } else {
                (0, frontend.backend_count, "ready")
            };
            let family = IpFamily::of(key.addr);
            let mut backends: Vec<BackendRow> = Vec::new();
            for slot in 0..count {
                let key = BackendKey {
                    service_id: frontend.service_id,
                    slot: base + slot,
                };
                let Some(backend) = pinned.backends.get(&(family, key)) else {
                    continue;
                };
                let address = backend.address;
                if let Some(row) = backends.iter_mut().find(|b| b.address == address) {
                    row.slots += 1;
                    continue;
                }
                // A slot that counts another endpoint (its claim is being rewritten) is none.
                let (counter_slot, owner) = backend.counter;
                let stats = pinned
                    .stats
                    .get(&counter_slot)
                    .filter(|stats| stats.owner == owner)
                    .copied();
                let counted = stats.is_some();
                let stats = stats.unwrap_or_default();
                backends.push(BackendRow {
                    address,
                    slot,
                    slots: 1,
                    state,
                    counted,
                    connections: stats.connections,
                    packets: stats.packets,
                    bytes: stats.bytes,
                    ports_exhausted: u64::from(stats.ports_exhausted),
                });
            }
            let origin = pinned.origins.get(key);
            let text = |field: fn(&FrontendOrigin) -> &[u8]| {
                origin.map_or(String::new(), |o| FrontendOrigin::text(field(o)).to_owned())
            };
            let (namespace, name) = (text(|o| &o.namespace), text(|o| &o.name));
            Row {
                frontend: SocketAddr::new(key.addr, key.port).to_string(),
                protocol: protocol_name(key.proto),
                kind: origin.map_or("unknown", FrontendOrigin::kind_name),
                service: if origin.is_some() {
                    format!("{namespace}/{name}")
                } else {
                    String::new()
                },
                namespace,
                name,
                port_name: text(|o| &o.port_name),
                service_id: frontend.service_id,
                scheduler: scheduler_name(frontend.scheduler),
                traffic_policy: if local { "Local" } else { "Cluster" },
                flags: flag_names(frontend.flags),
                affinity_timeout_s: frontend.affinity_timeout_s,
                backends,
            }
        })
        .collect()
}

/// A frontend's line, then one indented line per backend, as ipvsadm prints them.
fn table(rows: &[Row]) -> Table {
    let mut table = Table::new();
    table.load_style(presets::NOTHING).set_header([
        "FRONTEND / BACKEND",
        "PROTO",
        "KIND",
        "SERVICE",
        "PORT",
        "SCHED",
        "POLICY",
        "FLAGS",
        "SLOT",
        "STATE",
        "CONNS",
        "PACKETS",
        "BYTES",
    ]);
    let or_dash = |s: &str| {
        if s.is_empty() {
            "-".to_owned()
        } else {
            s.to_owned()
        }
    };
    for row in rows {
        table.add_row([
            row.frontend.clone(),
            row.protocol.clone(),
            row.kind.to_owned(),
            or_dash(&row.service),
            or_dash(&row.port_name),
            row.scheduler.to_owned(),
            row.traffic_policy.to_owned(),
            or_dash(&row.flags.join(",")),
            String::new(),
            String::new(),
            row.backends
                .iter()
                .map(|b| b.connections)
                .sum::<u64>()
                .to_string(),
            row.backends
                .iter()
                .map(|b| b.packets)
                .sum::<u64>()
                .to_string(),
            row.backends
                .iter()
                .map(|b| b.bytes)
                .sum::<u64>()
                .to_string(),
        ]);
        for backend in &row.backends {
            let mut line = vec![format!("  -> {}", backend.address)];
            line.extend(std::iter::repeat_n(String::new(), 7));
            let count = |n: u64| {
                if backend.counted {
                    n.to_string()
                } else {
                    "-".to_owned()
                }
            };
            line.extend([
                backend.slot.to_string(),
                backend.state.to_owned(),
                count(backend.connections),
                count(backend.packets),
                count(backend.bytes),
            ]);
            table.add_row(line);
        }
    }
    table
}
