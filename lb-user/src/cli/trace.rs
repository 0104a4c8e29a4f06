//! `lb trace`: what the datapath does now with one packet, and why.
//!
//! The real `lb_ingress` runs on a crafted packet (BPF_PROG_TEST_RUN) in a second instance of the
//! agent's object. The maps the datapath only reads (frontends, backends, source ranges, config)
//! are the pinned ones; every map it writes (conntrack, affinity, round-robin cursors,
//! counters, fragments, socket maps) is a private, unpinned copy holding only what this packet can
//! read from the pinned one. The run therefore decides exactly as the datapath would, writes only
//! into the copies, and tells from them why: the counters it moved give the reason, the entry it
//! created or found gives the backend and the route. Nothing in lb-ebpf knows about tracing, so
//! the real path pays nothing for it.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use anyhow::{Context as _, Result, bail};
use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray};
use aya::programs::{SchedClassifier, TestRun as _, TestRunOptions};
use aya::{Ebpf, EbpfLoader};
use etherparse::PacketBuilder;
use futures::TryStreamExt as _;
use lb_common::{
    Addr6, AffinityKey, AffinityKey6, Backend, Backend6, BackendKey, Config, Config6,
    ConntrackEntry, ConntrackEntry6, ConntrackKey, ConntrackKey6, Counter, FRONTEND_F_LOCAL,
    FRONTEND_F_PRESERVE_SOURCE, FRONTEND_F_SOURCE_RANGES, Frontend, IPPROTO_TCP, IPPROTO_UDP,
    LOCAL_SLOT, SCHED_FLOW_HASH, SCHED_ROUND_ROBIN, SCHED_SOURCE_HASH, StickyBackend,
    StickyBackend6, ipv4_be, map_name, port_be, program_name,
};
use lb_user::datapath;
use lb_user::maps::contents::MapFamily;
use lb_user::maps::pins;
use rtnetlink::RouteMessageBuilder;
use rtnetlink::packet_route::route::{RouteAttribute, RouteMessage};
use serde::Serialize;

use crate::cli::args::{Output, Proto, TraceArgs};

/// The pinned maps the datapath only reads: the trace instance uses the pinned ones. (XDP
/// egress, never pinned, is only `lb_xdp`'s; `lb_ingress` and `lb_ingress6` are the ones
/// traced.)
const SHARED_MAPS: [&str; 8] = [
    map_name::FRONTENDS,
    map_name::BACKENDS,
    map_name::SOURCE_RANGES,
    map_name::CONFIG,
    map_name::FRONTENDS6,
    map_name::BACKENDS6,
    map_name::SOURCE_RANGES6,
    map_name::CONFIG6,
];

/// Entries of each private map: a run writes a handful.
const PRIVATE_MAP_SIZE: u32 = 1024;

/// tc verdicts (uapi/linux/pkt_cls.h).
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

/// Offset of `ingress_ifindex` in `struct __sk_buff`; the kernel zero-fills what follows.
const SKB_INGRESS_IFINDEX: usize = 36;

/// What `lb trace -o json` prints.
#[derive(Debug, Serialize)]
struct Trace {
    /// "forwarded" (translated and sent on: redirected, or with stack forwarding handed to the
    /// stack to route), "passed" (untranslated), "REJECT" or "drop".
    verdict: &'static str,
    /// The frontend matched ("IP:PORT", or "IP:*" for a ClusterIP's catch-all; IPv6 in
    /// brackets), null for none.
    frontend: Option<String>,
    /// The backend the packet goes to; null when the scheduler picks one of `candidates` at
    /// random or in turn, or when there is none.
    backend: Option<String>,
    reason: String,
    policy: Option<Policy>,
    /// The endpoint list a new connection chooses from ("IP:PORT").
    candidates: Vec<String>,
    /// "existing" (its conntrack entry decides) or "new".
    conntrack: &'static str,
    translation: Option<Translation>,
    /// The interface the packet is forwarded out of, when known.
    interface: Option<String>,
    /// The datapath counters the packet moves.
    counters: Vec<&'static str>,
}

#[derive(Debug, Serialize)]
struct Policy {
    source_ranges: bool,
    /// "Cluster" or "Local" (the list the packet's source uses; topology hints are already
    /// applied to the lists by the agent).
    traffic_policy: &'static str,
    /// sessionAffinity ClientIP timeout; 0 without affinity.
    affinity_timeout_s: u32,
    scheduler: &'static str,
}

#[derive(Debug, Serialize)]
struct Translation {
    /// The destination the packet is rewritten to.
    dnat: String,
    /// The source the backend sees when it is not the client's; for a new masqueraded connection
    /// "ADDRESS:a port from MIN-MAX", the address the run's route lookup picked (its port is
    /// not reserved).
    masquerade: Option<String>,
}

/// What a conntrack entry rewrites its packets to, in either family.
struct Rewrite {
    src: SocketAddr,
    dst: SocketAddr,
    /// The interface of the route the datapath cached for the entry.
    hop_ifindex: Option<u32>,
}

/// One family's side of a trace: the program its packets run, its maps and their layouts.
trait Traced: MapFamily<Backend: aya::Pod, FrontendKey: aya::Pod> + Into<IpAddr> {
    type Key: aya::Pod;
    type Entry: aya::Pod;
    type AffinityKey: aya::Pod;
    type Sticky: aya::Pod;
    /// `lb_ingress` itself for IPv4. IPv6 runs `lb_ingress6`, which `lb_ingress` tail-calls: the
    /// trace instance's program array is empty, so the jump is taken here.
    const PROGRAM: &'static str;
    const FRONTENDS: &'static str;
    const BACKENDS: &'static str;
    /// The main conntrack table and the unconfirmed one.
    const CONNTRACK: [&'static str; 2];
    const AFFINITY: &'static str;
    const ICMP: &'static str;
    fn tuple(from: (Self, u16), to: (Self, u16), proto: u8) -> Self::Key;
    fn rewrite(entry: &Self::Entry) -> Rewrite;
    /// The key of the packets that answer `entry`'s rewrite: its peer entry's.
    fn answer_key(entry: &Self::Entry, proto: u8) -> Self::Key;
    fn affinity_key(service_id: u32, client: Self) -> Self::AffinityKey;
    /// `client` is in this family's --cluster-cidr.
    fn in_cluster(dir: &Path, client: Self) -> Result<bool>;
    fn endpoint(backend: &Self::Backend) -> SocketAddr;
}

impl Traced for Ipv4Addr {
    type Key = ConntrackKey;
    type Entry = ConntrackEntry;
    type AffinityKey = AffinityKey;
    type Sticky = StickyBackend;
    const PROGRAM: &'static str = program_name::INGRESS;
    const FRONTENDS: &'static str = map_name::FRONTENDS;
    const BACKENDS: &'static str = map_name::BACKENDS;
    const CONNTRACK: [&'static str; 2] = [map_name::CONNTRACK, map_name::CONNTRACK_UNCONFIRMED];
    const AFFINITY: &'static str = map_name::AFFINITY;
    const ICMP: &'static str = "ICMP";
    fn tuple((src, sport): (Self, u16), (dst, dport): (Self, u16), proto: u8) -> ConntrackKey {
        ConntrackKey {
            src_addr: ipv4_be(src.octets()),
            dst_addr: ipv4_be(dst.octets()),
            src_port: port_be(sport),
            dst_port: port_be(dport),
            proto,
            ..Default::default()
        }
    }
    fn rewrite(e: &ConntrackEntry) -> Rewrite {
        Rewrite {
            src: socket_v4(e.src_addr, e.src_port),
            dst: socket_v4(e.dst_addr, e.dst_port),
            hop_ifindex: (e.hop_len != 0).then_some(e.hop.ifindex),
        }
    }
    fn answer_key(e: &ConntrackEntry, proto: u8) -> ConntrackKey {
        ConntrackKey {
            src_addr: e.dst_addr,
            dst_addr: e.src_addr,
            src_port: e.dst_port,
            dst_port: e.src_port,
            proto,
            ..Default::default()
        }
    }
    fn affinity_key(service_id: u32, client: Self) -> AffinityKey {
        AffinityKey {
            service_id,
            client_addr: ipv4_be(client.octets()),
        }
    }
    fn in_cluster(dir: &Path, client: Self) -> Result<bool> {
        let config: Config = pinned_array(dir, map_name::CONFIG)?;
        Ok(ipv4_be(client.octets()) & config.cluster_cidr_mask == config.cluster_cidr_addr)
    }
    fn endpoint(b: &Backend) -> SocketAddr {
        socket_v4(b.addr, b.port)
    }
}

impl Traced for Ipv6Addr {
    type Key = ConntrackKey6;
    type Entry = ConntrackEntry6;
    type AffinityKey = AffinityKey6;
    type Sticky = StickyBackend6;
    const PROGRAM: &'static str = program_name::INGRESS6;
    const FRONTENDS: &'static str = map_name::FRONTENDS6;
    const BACKENDS: &'static str = map_name::BACKENDS6;
    const CONNTRACK: [&'static str; 2] = [map_name::CONNTRACK6, map_name::CONNTRACK6_UNCONFIRMED];
    const AFFINITY: &'static str = map_name::AFFINITY6;
    const ICMP: &'static str = "ICMPv6";
    fn tuple((src, sport): (Self, u16), (dst, dport): (Self, u16), proto: u8) -> ConntrackKey6 {
        ConntrackKey6 {
            src_addr: Addr6::from_octets(src.octets()),
            dst_addr: Addr6::from_octets(dst.octets()),
            src_port: port_be(sport),
            dst_port: port_be(dport),
            proto,
            ..Default::default()
        }
    }
    fn rewrite(e: &ConntrackEntry6) -> Rewrite {
        Rewrite {
            src: socket_v6(&e.src_addr, e.src_port),
            dst: socket_v6(&e.dst_addr, e.dst_port),
            hop_ifindex: (e.hop_len != 0).then_some(e.hop.ifindex),
        }
    }
    fn answer_key(e: &ConntrackEntry6, proto: u8) -> ConntrackKey6 {
        ConntrackKey6 {
            src_addr: e.dst_addr,
            dst_addr: e.src_addr,
            src_port: e.dst_port,
            dst_port: e.src_port,
            proto,
            ..Default::default()
        }
    }
    fn affinity_key(service_id: u32, client: Self) -> AffinityKey6 {
        AffinityKey6 {
            service_id,
            client_addr: Addr6::from_octets(client.octets()),
        }
    }
    fn in_cluster(dir: &Path, client: Self) -> Result<bool> {
        let config: Config6 = pinned_array(dir, map_name::CONFIG6)?;
        let (addr, mask) = (
            config.cluster_cidr_addr.octets(),
            config.cluster_cidr_mask.octets(),
        );
        Ok(client
            .octets()
            .iter()
            .zip(mask.iter().zip(addr))
            .all(|(c, (m, a))| c & m == a))
    }
    fn endpoint(b: &Backend6) -> SocketAddr {
        socket_v6(&b.addr, b.port)
    }
}

pub fn run(args: TraceArgs) -> Result<()> {
    let dir = pins::find(&args.bpffs, map_name::FRONTENDS)?;
    let ingress_ifindex = match &args.in_interface {
        Some(name) => nix::net::if_::if_nametoindex(name.as_str())
            .with_context(|| format!("interface {name}"))?,
        None => 1,
    };
    let trace = match (args.from.ip(), args.to.ip()) {
        (IpAddr::V4(from), IpAddr::V4(to)) => trace(&dir, &args, (from, to), ingress_ifindex)?,
        (IpAddr::V6(from), IpAddr::V6(to)) => trace(&dir, &args, (from, to), ingress_ifindex)?,
        _ => bail!(
            "--from {} and --to {} are of different families",
            args.from,
            args.to
        ),
    };
    match args.output {
        Output::Table => print!("{}", trace.text()),
        Output::Json => println!("{}", serde_json::to_string_pretty(&trace)?),
    }
    Ok(())
}

fn trace<F: Traced>(
    dir: &Path,
    args: &TraceArgs,
    (from, to): (F, F),
    ingress_ifindex: u32,
) -> Result<Trace> {
    let proto = match args.proto {
        Proto::Tcp => IPPROTO_TCP,
        Proto::Udp => IPPROTO_UDP,
    };
    let tuple = F::tuple((from, args.from.port()), (to, args.to.port()), proto);
    let mut ebpf = load(dir)?;
    let config: Config = pinned_array(dir, map_name::CONFIG)?;
    let frontend = lookup_frontend(dir, to, args.to.port(), proto)?;
    let existing = seed::<F>(
        dir,
        &mut ebpf,
        (&tuple, proto, from),
        frontend.as_ref().map(|(_, f)| f),
    )?;

    let program: &mut SchedClassifier = ebpf
        .program_mut(F::PROGRAM)
        .with_context(|| format!("{} not in the eBPF object", F::PROGRAM))?
        .try_into()?;
    datapath::load_program(|| program.load()).with_context(|| format!("loading {}", F::PROGRAM))?;
    let packet = build_packet(args, existing.is_some())?;
    let mut out = vec![0; packet.len() + 256];
    let mut skb = [0u8; SKB_INGRESS_IFINDEX + 4];
    skb[SKB_INGRESS_IFINDEX..].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    let result = program
        .test_run(TestRunOptions {
            data_in: Some(&packet),
            data_out: Some(&mut out),
            ctx_in: Some(&skb),
            ..Default::default()
        })
        .with_context(|| format!("BPF_PROG_TEST_RUN of {}", F::PROGRAM))?;
    out.truncate(result.data_size_out as usize);

    let counters = moved_counters(&mut ebpf)?;
    let moved = |c: Counter| counters.contains(&c);
    let entry = private_entry::<F>(&mut ebpf, &tuple)?;
    let mut trace = Trace {
        verdict: "passed",
        frontend: frontend.as_ref().map(|(key, _)| frontend_name::<F>(key)),
        backend: None,
        reason: String::new(),
        policy: None,
        candidates: Vec::new(),
        conntrack: if existing.is_some() {
            "existing"
        } else {
            "new"
        },
        translation: None,
        interface: None,
        counters: counters.iter().map(|c| c.name()).collect(),
    };
    if let Some((_, frontend)) = &frontend {
        let list = backend_list(frontend, F::in_cluster(dir, from)?);
        trace.policy = Some(policy(frontend, list.0 == LOCAL_SLOT));
        trace.candidates = candidates::<F>(dir, frontend.service_id, list)?;
    }
    let drop_reason = counters.iter().find_map(|c| c.drop_reason());
    match result.return_value {
        _ if moved(Counter::Rejected) => {
            trace.verdict = "REJECT";
            trace.reason = format!("the service has no endpoints: {} port unreachable", F::ICMP);
        }
        TC_ACT_SHOT => {
            trace.verdict = "drop";
            trace.reason = drop_reason.unwrap_or("dropped").into();
        }
        TC_ACT_OK | TC_ACT_REDIRECT => {
            // Translated: by its connection, or by one it opened (or, racing, joined).
            let translated = moved(Counter::Translated) || moved(Counter::NewConnection);
            if let Some(entry) = &entry {
                let rewrite = F::rewrite(entry);
                let masqueraded = rewrite.src.ip() != args.from.ip()
                    || (existing.is_some() && rewrite.src.port() != args.from.port());
                let masquerade = masqueraded.then(|| {
                    if existing.is_some() {
                        rewrite.src.to_string()
                    } else {
                        format!(
                            "{}:a port from {}-{}",
                            host(rewrite.src.ip()),
                            config.snat_port_min,
                            config.snat_port_max
                        )
                    }
                });
                trace.translation = Some(Translation {
                    dnat: rewrite.dst.to_string(),
                    masquerade,
                });
                let exact = existing.is_some()
                    || frontend.as_ref().is_some_and(|(_, f)| {
                        f.affinity_timeout_s != 0
                            || matches!(f.scheduler, SCHED_SOURCE_HASH | SCHED_FLOW_HASH)
                    });
                if exact {
                    trace.backend = Some(rewrite.dst.to_string());
                }
                trace.reason = if existing.is_some() {
                    "its conntrack entry holds the backend".into()
                } else if exact {
                    "the scheduler's pick for this flow".into()
                } else {
                    "the scheduler picks one of the candidates".into()
                };
                trace.interface = if let Some(ifindex) = rewrite.hop_ifindex {
                    interface_name(ifindex)
                } else if translated {
                    // Redirected, or routed by the stack: the same route either way.
                    route_interface(rewrite.dst.ip())?
                } else {
                    None
                };
            } else {
                trace.reason = counters
                    .first()
                    .map_or("not service traffic", |c| c.meaning())
                    .into();
            }
            trace.verdict = if result.return_value == TC_ACT_REDIRECT || translated {
                "forwarded"
            } else {
                "passed"
            };
        }
        other => bail!("{} returned {other}", F::PROGRAM),
    }
    Ok(trace)
}

/// A second instance of the agent's object: the read-only maps from the pins, the others
/// private and small.
fn load(dir: &Path) -> Result<Ebpf> {
    let mut loader = EbpfLoader::new();
    for name in SHARED_MAPS {
        let path = dir.join(name);
        // A missing pin would be created (and pinned) by the loader: a trace creates nothing.
        let pinned = MapData::from_pin(&path)
            .and_then(|m| m.info())
            .with_context(|| format!("pinned map {}", path.display()))?;
        loader.map_pin_path(name, path);
        loader.map_max_entries(name, pinned.max_entries());
    }
    for name in map_name::ALL {
        if !SHARED_MAPS.contains(&name) && name != map_name::COUNTERS {
            loader.map_max_entries(name, PRIVATE_MAP_SIZE);
        }
    }
    loader
        .load(datapath::EBPF_OBJECT)
        .context("loading the eBPF object")
}

fn pinned_array<V: aya::Pod>(dir: &Path, name: &str) -> Result<V> {
    let array: Array<MapData, V> = pins::open(dir, name)?;
    Ok(array.get(&0, 0)?)
}

/// The frontend the datapath would match (service.rs: the exact port, else the catch-all).
fn lookup_frontend<F: Traced>(
    dir: &Path,
    addr: F,
    port: u16,
    proto: u8,
) -> Result<Option<(F::FrontendKey, Frontend)>> {
    let frontends = pins::open::<HashMap<MapData, F::FrontendKey, Frontend>>(dir, F::FRONTENDS)?;
    for key in [F::frontend_key(addr, port, proto), F::any_port(addr)] {
        if let Ok(frontend) = frontends.get(&key, 0) {
            return Ok(Some((key, frontend)));
        }
    }
    Ok(None)
}

/// Copies into the private maps what the packet's run may read from the pinned ones: the
/// conntrack entries of its connection, its client's affinity and the service's round-robin
/// cursor. Returns the connection's entry, if it has one.
fn seed<F: Traced>(
    dir: &Path,
    ebpf: &mut Ebpf,
    (tuple, proto, client): (&F::Key, u8, F),
    frontend: Option<&Frontend>,
) -> Result<Option<F::Entry>> {
    // A connection is in the main table or, its handshake not complete, the unconfirmed one.
    let mut existing = None;
    for name in F::CONNTRACK {
        let pinned = pins::open::<HashMap<MapData, F::Key, F::Entry>>(dir, name)?;
        let mut private: HashMap<_, F::Key, F::Entry> = private_map(ebpf, name)?;
        let Ok(entry) = pinned.get(tuple, 0) else {
            continue;
        };
        private.insert(tuple, entry, 0)?;
        let peer = F::answer_key(&entry, proto);
        if let Ok(peer_entry) = pinned.get(&peer, 0) {
            private.insert(peer, peer_entry, 0)?;
        }
        existing.get_or_insert(entry);
    }
    let Some(frontend) = frontend else {
        return Ok(existing);
    };
    let affinity_key = F::affinity_key(frontend.service_id, client);
    let pinned = pins::open::<HashMap<MapData, F::AffinityKey, F::Sticky>>(dir, F::AFFINITY)?;
    if let Ok(sticky) = pinned.get(&affinity_key, 0) {
        let mut private: HashMap<_, F::AffinityKey, F::Sticky> = private_map(ebpf, F::AFFINITY)?;
        private.insert(affinity_key, sticky, 0)?;
    }
    let pinned = pins::open::<HashMap<MapData, u32, u32>>(dir, map_name::ROUND_ROBIN)?;
    if let Ok(cursor) = pinned.get(&frontend.service_id, 0) {
        let mut private: HashMap<_, u32, u32> = private_map(ebpf, map_name::ROUND_ROBIN)?;
        private.insert(frontend.service_id, cursor, 0)?;
    }
    Ok(existing)
}

fn private_map<'a, T>(ebpf: &'a mut Ebpf, name: &str) -> Result<T>
where
    T: TryFrom<&'a mut Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .map_mut(name)
        .with_context(|| format!("map {name} not in the eBPF object"))?;
    T::try_from(map).with_context(|| format!("map {name}"))
}

/// The conntrack entry of the packet's tuple after the run: found or created.
fn private_entry<F: Traced>(ebpf: &mut Ebpf, tuple: &F::Key) -> Result<Option<F::Entry>> {
    for name in F::CONNTRACK {
        let private: HashMap<_, F::Key, F::Entry> = private_map(ebpf, name)?;
        if let Ok(entry) = private.get(tuple, 0) {
            return Ok(Some(entry));
        }
    }
    Ok(None)
}

/// The counters the run moved (the private ones started at zero).
fn moved_counters(ebpf: &mut Ebpf) -> Result<Vec<Counter>> {
    let counters: PerCpuArray<_, u64> = private_map(ebpf, map_name::COUNTERS)?;
    let mut moved = Vec::new();
    for counter in Counter::ALL {
        if counters.get(&(counter as u32), 0)?.iter().any(|&v| v != 0) {
            moved.push(counter);
        }
    }
    Ok(moved)
}

/// The slot base and length of the list a new connection uses (service.rs), its source a pod
/// (in the --cluster-cidr) or not.
fn backend_list(frontend: &Frontend, pod: bool) -> (u32, u32) {
    let local = frontend.flags & FRONTEND_F_LOCAL != 0
        && !(pod && frontend.flags & FRONTEND_F_PRESERVE_SOURCE != 0);
    if local {
        (LOCAL_SLOT, frontend.local_count)
    } else {
        (0, frontend.backend_count)
    }
}

fn candidates<F: Traced>(
    dir: &Path,
    service_id: u32,
    (base, count): (u32, u32),
) -> Result<Vec<String>> {
    let backends = pins::open::<HashMap<MapData, BackendKey, F::Backend>>(dir, F::BACKENDS)?;
    Ok((0..count)
        .filter_map(|i| {
            let key = BackendKey {
                service_id,
                slot: base | i,
            };
            backends.get(&key, 0).ok()
        })
        .map(|b| F::endpoint(&b).to_string())
        .collect())
}

fn policy(frontend: &Frontend, local: bool) -> Policy {
    Policy {
        source_ranges: frontend.flags & FRONTEND_F_SOURCE_RANGES != 0,
        traffic_policy: if local { "Local" } else { "Cluster" },
        affinity_timeout_s: frontend.affinity_timeout_s,
        scheduler: match frontend.scheduler {
            SCHED_ROUND_ROBIN => "rr",
            SCHED_SOURCE_HASH => "sh",
            SCHED_FLOW_HASH => "maglev",
            _ => "random",
        },
    }
}

/// The packet as it arrives on the wire: Ethernet, IPv4 (TTL 64, checksums right) or IPv6 (hop
/// limit 64), TCP (an ACK on a live connection, else a SYN) or UDP with a few bytes of payload.
fn build_packet(args: &TraceArgs, existing: bool) -> Result<Vec<u8>> {
    const PAYLOAD: &[u8] = b"lb trace";
    let ethernet = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
    let ip = match (args.from.ip(), args.to.ip()) {
        (IpAddr::V4(from), IpAddr::V4(to)) => ethernet.ipv4(from.octets(), to.octets(), 64),
        (IpAddr::V6(from), IpAddr::V6(to)) => ethernet.ipv6(from.octets(), to.octets(), 64),
        _ => bail!("--from and --to are of different families"),
    };
    let mut packet = Vec::new();
    match args.proto {
        Proto::Tcp => {
            let tcp = ip.tcp(args.from.port(), args.to.port(), 1, 64_240);
            let tcp = if existing { tcp.ack(1) } else { tcp.syn() };
            tcp.write(&mut packet, &[])?;
        }
        Proto::Udp => ip
            .udp(args.from.port(), args.to.port())
            .write(&mut packet, PAYLOAD)?,
    }
    Ok(packet)
}

fn socket_v4(addr: u32, port: u16) -> SocketAddr {
    SocketAddr::new(
        Ipv4Addr::from(addr.to_ne_bytes()).into(),
        u16::from_be(port),
    )
}

fn socket_v6(addr: &Addr6, port: u16) -> SocketAddr {
    SocketAddr::new(Ipv6Addr::from(addr.octets()).into(), u16::from_be(port))
}

/// An address as it stands before the port of a socket address: IPv6 in brackets.
fn host(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

fn frontend_name<F: Traced>(key: &F::FrontendKey) -> String {
    let addr = F::frontend_addr(key).into();
    if F::frontend_port(key) == 0 && F::frontend_proto(key) == 0 {
        // The catch-all of a ClusterIP.
        format!("{}:*", host(addr))
    } else {
        SocketAddr::new(addr, F::frontend_port(key)).to_string()
    }
}

/// The interface the kernel routes `dst` out of (`ip route get DST`): where the run redirected a
/// packet whose route it did not cache (its neighbour not resolved yet).
fn route_interface(dst: IpAddr) -> Result<Option<String>> {
    let request: RouteMessage = match dst {
        IpAddr::V4(v4) => RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(v4, 32)
            .build(),
        IpAddr::V6(v6) => RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(v6, 128)
            .build(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let (connection, handle, _) = rtnetlink::new_connection().context("rtnetlink")?;
        tokio::spawn(connection);
        let mut routes = handle.route().get(request).execute();
        while let Some(route) = routes
            .try_next()
            .await
            .with_context(|| format!("route to {dst}"))?
        {
            let oif = route.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(ifindex) => Some(*ifindex),
                _ => None,
            });
            if let Some(oif) = oif {
                return Ok(interface_name(oif));
            }
        }
        Ok(None)
    })
}

fn interface_name(ifindex: u32) -> Option<String> {
    nix::net::if_::if_indextoname(ifindex)
        .ok()
        .and_then(|name| name.into_string().ok())
}

impl Trace {
    fn text(&self) -> String {
        let or_none = |s: &Option<String>| s.clone().unwrap_or_else(|| "none".into());
        let mut text = format!(
            "verdict:     {}\nreason:      {}\nfrontend:    {}\n",
            self.verdict,
            self.reason,
            or_none(&self.frontend)
        );
        if let Some(p) = &self.policy {
            text += &format!(
                "policy:      scheduler {}, traffic policy {}, affinity {} s, source ranges {}\n",
                p.scheduler,
                p.traffic_policy,
                p.affinity_timeout_s,
                if p.source_ranges { "on" } else { "off" }
            );
            text += &format!("candidates:  {}\n", self.candidates.join(", "));
        }
        text += &format!(
            "conntrack:   {}\nbackend:     {}\n",
            self.conntrack,
            match (&self.backend, self.candidates.is_empty()) {
                (Some(b), _) => b.clone(),
                (None, false) if self.translation.is_some() => "one of the candidates".into(),
                (None, _) => "none".into(),
            }
        );
        if let Some(t) = &self.translation {
            text += &format!(
                "translation: DNAT to {}, masquerade {}\n",
                t.dnat,
                t.masquerade.as_deref().unwrap_or("none")
            );
        }
        text += &format!(
            "interface:   {}\ncounters:    {}\n",
            or_none(&self.interface),
            self.counters.join(",")
        );
        text
    }
}
