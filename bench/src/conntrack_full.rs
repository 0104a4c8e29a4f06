//! B5: the datapath with a full conntrack map and with its masquerade ports exhausted. The
//! agent's pinned conntrack map is filled from here with synthetic live connections (the map ABI
//! of lb-common, batch writes); B2's connection rate (client pod → ClusterIP) is measured at 0%,
//! 50% and 100% of the map's size: the map is an LRU, so at 100% every new connection evicts.
//! Then every masquerade port of the measured Service's UDP backend is taken by live entries and
//! external clients send to its NodePort: each new flow must be dropped and counted
//! (drop_snat_ports_exhausted) while the pod's connection rate goes on.
use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    os::fd::{AsFd as _, BorrowedFd},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use aya::maps::{HashMap, IterableMap as _, Map, MapData};
use lb_common::{
    CT_F_MASQUERADE, CT_F_REPLY, ConntrackEntry, ConntrackKey, Counter, IPPROTO_TCP, IPPROTO_UDP,
    SNAT_PORT_MAX, SNAT_PORT_MIN, ipv4_be, map_name, port_be,
};
use lb_tests::topology::{NODE_IP, POD_GATEWAY};
use lb_user::{datapath::read_counters, maps::map_batch};
use nix::time::{ClockId, clock_gettime};
use serde::Serialize;

use crate::{
    Plan, Progress, interrupt,
    services::{NODE_PORT, ServiceSet, UDP_TARGET_PORT},
    traffic::{ConnectionRate, connection_rate},
    variants::{Deployment, Variant},
};

/// Synthetic connections come from 100.64.0.0/10 (no topology address) to a port no Service has.
const SYNTHETIC_SOURCE: u32 = u32::from_be_bytes([100, 64, 0, 0]);
const SYNTHETIC_PORT: u16 = 7;
/// New UDP flows sent to the NodePort while its masquerade ports are taken.
const EXHAUSTED_ATTEMPTS: u32 = 200;
const MAX_CONNECTIONS: u64 = 1_000_000;

type Conntrack = HashMap<MapData, ConntrackKey, ConntrackEntry>;

#[derive(Debug, Serialize)]
pub struct ConntrackPoint {
    /// `0%`, `50%`, `100%`, or `snat ports exhausted`.
    pub case: String,
    /// Entries the map held (synthetic and real) before the measurement, of `max_entries`.
    pub entries: usize,
    pub max_entries: u32,
    pub connections: ConnectionRate,
    /// Counter deltas over the case.
    pub drop_conntrack_full: u64,
    pub drop_snat_ports_exhausted: u64,
    /// New NodePort flows sent (the exhausted case), and how long sending them took.
    pub attempts: u32,
    pub attempts_seconds: f64,
}

pub fn run(
    plan: &Plan,
    deployments: &mut [Deployment],
    progress: Progress,
) -> Result<Vec<ConntrackPoint>> {
    let Some(deployment) = deployments.iter_mut().find(|d| d.variant == Variant::Tc) else {
        return Ok(Vec::new());
    };
    let set = ServiceSet::new(1, 1, deployment.topology.backend().ip);
    deployment.program(&set)?;
    let data = MapData::from_pin(deployment.pins().join(map_name::CONNTRACK))
        .context("the agent's pinned conntrack map")?;
    let max_entries = data.info()?.max_entries();
    let conntrack: Conntrack = HashMap::try_from(Map::LruHashMap(data))?;
    let map = conntrack.map().fd().as_fd();
    let mut points = Vec::new();
    let mut synthetic = Vec::new();
    for percent in [0, 50, 100] {
        interrupt::check()?;
        let wanted = max_entries as usize * percent / 100;
        let keys = synthetic_keys(synthetic.len(), wanted - synthetic.len());
        write_live(map, &keys, IPPROTO_TCP)?;
        synthetic.extend(keys);
        let point = measure(plan, deployment, &conntrack, format!("{percent}%"), 0)?;
        progress(&point.summary());
        points.push(point);
    }
    delete(map, &synthetic)?;

    interrupt::check()?;
    let taken = snat_ports_taken(deployment.topology.backend().ip);
    write_live(map, &taken, IPPROTO_UDP)?;
    let point = measure(
        plan,
        deployment,
        &conntrack,
        "snat ports exhausted".into(),
        EXHAUSTED_ATTEMPTS,
    );
    // Later phases use the NodePort: free its ports whatever the measurement did.
    delete(map, &taken)?;
    let point = point?;
    progress(&point.summary());
    if point.drop_snat_ports_exhausted < u64::from(point.attempts) {
        bail!(
            "{} of {} new flows were counted as dropped for exhausted masquerade ports",
            point.drop_snat_ports_exhausted,
            point.attempts
        );
    }
    points.push(point);
    Ok(points)
}

fn measure(
    plan: &Plan,
    deployment: &Deployment,
    conntrack: &Conntrack,
    case: String,
    attempts: u32,
) -> Result<ConntrackPoint> {
    // Synthetic and real entries (a walk of the keys).
    let entries = conntrack.keys().count();
    let max_entries = conntrack.map().info()?.max_entries();
    let pins = deployment.pins();
    let before = read_counters(pins)?;
    let started = Instant::now();
    if attempts > 0 {
        let to: SocketAddr = (NODE_IP, NODE_PORT).into();
        deployment.topology.inner.client.run(move || {
            for _ in 0..attempts {
                // A socket per flow: a new source port, a new connection for the datapath.
                UdpSocket::bind("0.0.0.0:0")?.send_to(&[1], to)?;
            }
            std::io::Result::Ok(())
        })??;
    }
    let attempts_seconds = started.elapsed().as_secs_f64();
    let set = ServiceSet::new(1, 1, deployment.topology.backend().ip);
    let connections = connection_rate(
        &deployment.topology.client_pod().ns,
        deployment.target(&set),
        plan.point_duration,
        MAX_CONNECTIONS,
    )?;
    let after = read_counters(pins)?;
    let delta = |counter| counter_delta(&before, &after, counter);
    Ok(ConntrackPoint {
        case,
        entries,
        max_entries,
        connections,
        drop_conntrack_full: delta(Counter::DropConntrackFull),
        drop_snat_ports_exhausted: delta(Counter::DropSnatPortsExhausted),
        attempts,
        attempts_seconds,
    })
}

impl ConntrackPoint {
    pub fn summary(&self) -> String {
        format!(
            "  conntrack {:<21} ({:>6} of {} entries): {:>8.0} conn/s ({} failed), drops: \
             conntrack full {}, snat ports exhausted {} of {} new NodePort flows ({:.3} s)",
            self.case,
            self.entries,
            self.max_entries,
            self.connections.per_second,
            self.connections.failures,
            self.drop_conntrack_full,
            self.drop_snat_ports_exhausted,
            self.attempts,
            self.attempts_seconds
        )
    }
}

/// `count` keys of distinct synthetic connections, numbered from `first`.
fn synthetic_keys(first: usize, count: usize) -> Vec<ConntrackKey> {
    (first..first + count)
        .map(|i| ConntrackKey {
            src_addr: (SYNTHETIC_SOURCE + (i >> 16) as u32).to_be(),
            dst_addr: ipv4_be([10, 96, 0, 1]),
            src_port: port_be(i as u16),
            dst_port: port_be(SYNTHETIC_PORT),
            proto: IPPROTO_TCP,
            _pad0: 0,
            _pad1: 0,
        })
        .collect()
}

/// The reply-direction keys that claim every masquerade port of `backend`'s UDP sink: what the
/// datapath looks up before it takes a port (backend → masquerade address:port). The masquerade
/// address is the one routing picks towards the backend: the node's pod-side address.
fn snat_ports_taken(backend: Ipv4Addr) -> Vec<ConntrackKey> {
    (SNAT_PORT_MIN..=SNAT_PORT_MAX)
        .map(|port| ConntrackKey {
            src_addr: ipv4_be(backend.octets()),
            dst_addr: ipv4_be(POD_GATEWAY.octets()),
            src_port: port_be(UDP_TARGET_PORT),
            dst_port: port_be(port),
            proto: IPPROTO_UDP,
            _pad0: 0,
            _pad1: 0,
        })
        .collect()
}

/// Writes `keys` as established connections seen now (the datapath's clock is CLOCK_MONOTONIC
/// within a second, `lb_common::Clock`), so none is expired for the datapath.
fn write_live(map: BorrowedFd<'_>, keys: &[ConntrackKey], proto: u8) -> Result<()> {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC).context("clock_gettime")?;
    let now_ns = Duration::from(now).as_nanos() as u64;
    let flags = if proto == IPPROTO_UDP {
        CT_F_REPLY | CT_F_MASQUERADE
    } else {
        0
    };
    let values: Vec<ConntrackEntry> = keys
        .iter()
        .map(|key| ConntrackEntry {
            last_seen_ns: now_ns,
            src_addr: key.dst_addr,
            dst_addr: key.src_addr,
            src_port: key.dst_port,
            dst_port: key.src_port,
            state: lb_common::tcp::ESTABLISHED,
            flags,
            ..Default::default()
        })
        .collect();
    match map_batch::update_all(map, keys, &values).first() {
        Some((index, err)) => bail!("conntrack write of entry {index}: {err}"),
        None => Ok(()),
    }
}

fn delete(map: BorrowedFd<'_>, keys: &[ConntrackKey]) -> Result<()> {
    match map_batch::delete_all(map, keys).first() {
        Some((index, err)) => bail!("conntrack delete of entry {index}: {err}"),
        None => Ok(()),
    }
}

/// How much `counter` grew from `before` to `after` (two `read_counters` readings).
pub fn counter_delta(before: &[(Counter, u64)], after: &[(Counter, u64)], counter: Counter) -> u64 {
    let value = |counters: &[(Counter, u64)]| {
        counters
            .iter()
            .find(|(c, _)| *c == counter)
            .map_or(0, |(_, v)| *v)
    };
    value(after) - value(before)
}
