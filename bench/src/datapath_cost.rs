//! B1: the tc program's cost per packet, from BPF_PROG_TEST_RUN on a private copy of the object,
//! minus an empty classifier's cost measured the same way.
//!
//! Each run is its own syscall with `repeat = 1`: the program rewrites the packet in place, so
//! the kernel's repeat loop would feed it its own output (an already translated packet) from the
//! second iteration on. The kernel's per-run duration includes its timer and the skb around the
//! program; the empty program carries the same, so the difference is the program's own work.
//!
//! The runs happen in a namespace of their own where the packets "arrive" on a veth (the
//! context's ingress ifindex) and the client and backend are neighbours with known MACs, so the
//! FIB lookup resolves and the program takes its forwarding path, as on a node.
//!
//! IPv6 packets take `lb_ingress`'s tail call into `lb_ingress6`, as on a node: their cost
//! includes it, so that the IPv6 / IPv4 ratio is what a node pays per family.
use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    os::fd::{AsFd as _, BorrowedFd},
};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf, EbpfLoader, Pod,
    maps::{Array, HashMap, PerCpuArray, PerCpuValues},
    programs::SchedClassifier,
};
use lb_common::{
    Addr6, Backend, Backend6, BackendKey, BackendStats, CONFIG_F_READY, CONFIG_F_STACK_FORWARDING,
    Config, Config6, Frontend, FrontendKey, FrontendKey6, IPPROTO_TCP, SNAT_PORT_MAX,
    SNAT_PORT_MIN, default_size, ipv4_be, map_name, port_be, program_name,
};
use lb_tests::netns::{self, Netns};
use serde::Serialize;

use crate::{
    Plan, Progress, bpf, interrupt,
    packet::{Frame, TCP_ACK, TCP_SYN},
    services::{Family, SERVICE_PORT, TCP_TARGET_PORT, cluster_ip, cluster_ip6},
    traffic::{SERVER_CPU, pin},
};

const NODE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const BACKEND: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 2), TCP_TARGET_PORT);
/// New connections come from 10.244.128.0/17, one source port after the other.
const FIRST_CLIENT: u32 = u32::from_be_bytes([10, 244, 128, 0]);
const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 4), 40000);
const NOT_A_SERVICE: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 3), 9000);
/// The IPv6 twins of the addresses above, in the pod network fd00:10:244::/56.
const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 1);
const BACKEND6: SocketAddrV6 = v6(Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2), 9000);
const CLIENT6: SocketAddrV6 = v6(Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 4), 40000);
const NOT_A_SERVICE6: SocketAddrV6 = v6(Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 3), 9000);
/// New IPv6 connections come from fd00:10:244:80::/64.
const FIRST_CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 0x80, 0, 0, 0, 0);
const CLUSTER_CIDR6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0);
const CLUSTER_CIDR6_MASK: Ipv6Addr = Ipv6Addr::new(0xffff, 0xffff, 0xffff, 0xff00, 0, 0, 0, 0);
/// The veth the packets arrive on, in B1's namespace.
const INTERFACE: &str = "b1in";
/// Offset of `ingress_ifindex` in struct __sk_buff.
const SKB_INGRESS_IFINDEX: usize = 36;

#[derive(Debug, Serialize)]
pub struct DatapathCost {
    pub services: usize,
    /// `ipv4` or `ipv6`: the packets' family.
    pub family: &'static str,
    /// `--forwarding`: `stack` (lb_ingress's half: the destination; lb_egress translates the
    /// source after routing) or `redirect` (the whole translation and the redirect).
    pub forwarding: &'static str,
    pub case: &'static str,
    pub runs: u32,
    /// Mean kernel-measured ns per run.
    pub mean_ns: f64,
    /// `mean_ns` minus the empty program's.
    pub net_ns: f64,
}

pub fn measure(plan: &Plan, progress: Progress) -> Result<Vec<DatapathCost>> {
    let (runs, counts) = (plan.datapath_runs, plan.datapath_counts.clone());
    std::thread::scope(|scope| {
        scope
            .spawn(|| measure_pinned(runs, &counts, progress))
            .join()
            .map_err(|_| anyhow::anyhow!("B1 thread panicked"))?
    })
}

/// A mode B1 measures: a family and a forwarding mode, with its config flag.
struct Mode {
    family: Family,
    forwarding: &'static str,
    flags: u32,
}

/// IPv6 is measured in the default mode only: its redirect path is not written yet (lb_ingress6
/// hands every packet it translates to the stack).
const MODES: [Mode; 3] = [
    Mode {
        family: Family::Ipv4,
        forwarding: "stack",
        flags: CONFIG_F_STACK_FORWARDING,
    },
    Mode {
        family: Family::Ipv4,
        forwarding: "redirect",
        flags: 0,
    },
    Mode {
        family: Family::Ipv6,
        forwarding: "stack",
        flags: CONFIG_F_STACK_FORWARDING,
    },
];

/// What B1 measures for each count and mode, in this order; the first is what the others are net of.
const CASES: [&str; 5] = [
    "empty program",
    "non-service",
    "new connection",
    "established",
    "reply",
];

fn measure_pinned(runs: u32, counts: &[usize], progress: Progress) -> Result<Vec<DatapathCost>> {
    pin(SERVER_CPU)?;
    let node = routed_node()?;
    netns::enter(&format!("/run/netns/{}", node.name()))?;
    let ifindex = nix::net::if_::if_nametoindex(INTERFACE).context(INTERFACE)?;
    // struct __sk_buff up to ingress_ifindex.
    let mut ctx = [0u8; SKB_INGRESS_IFINDEX + 4];
    ctx[SKB_INGRESS_IFINDEX..].copy_from_slice(&ifindex.to_ne_bytes());
    let empty = bpf::load_return_only(bpf::BPF_PROG_TYPE_SCHED_CLS, bpf::TC_ACT_OK)
        .context("load the empty classifier (run as root)")?;
    // Two passes, the counts in order and then reversed, half the runs each: a drift of the
    // machine over the measurement (other load) then weighs on every count alike.
    let half = (runs / 2).max(1);
    let mut sums = vec![[[0.0; CASES.len()]; MODES.len()]; counts.len()];
    let order = (0..counts.len()).chain((0..counts.len()).rev());
    for (n, index) in order.enumerate() {
        for (m, mode) in MODES.iter().enumerate() {
            interrupt::check()?;
            let services = counts[index];
            let means = measure_count(services, mode, half, empty.as_fd(), &ctx)?;
            progress(&format!(
                "  pass {} {services:>6} services, {} {:<8}: {}",
                n / counts.len() + 1,
                mode.family.name(),
                mode.forwarding,
                CASES[1..]
                    .iter()
                    .zip(&means[1..])
                    .map(|(case, ns)| format!("{case} {:.0} ns", ns - means[0]))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            for (sum, mean) in sums[index][m].iter_mut().zip(means) {
                *sum += mean;
            }
        }
    }
    let mut costs = Vec::new();
    for (&services, modes) in counts.iter().zip(&sums) {
        for (mode, sums) in MODES.iter().zip(modes) {
            let empty_ns = sums[0] / 2.0;
            for (&case, sum) in CASES.iter().zip(sums) {
                costs.push(DatapathCost {
                    services,
                    family: mode.family.name(),
                    forwarding: mode.forwarding,
                    case,
                    runs: 2 * half,
                    mean_ns: sum / 2.0,
                    net_ns: sum / 2.0 - empty_ns,
                });
            }
        }
    }
    Ok(costs)
}

/// The mean ns of each of CASES over `runs` runs, on a fresh datapath with `services` Services,
/// in `mode`.
fn measure_count(
    services: usize,
    mode: &Mode,
    runs: u32,
    empty: BorrowedFd<'_>,
    ctx: &[u8],
) -> Result<[f64; CASES.len()]> {
    let run = |fd: BorrowedFd<'_>, data: &[u8]| run_once(fd, data, ctx);
    let datapath = Datapath::load(services, mode, runs)?;
    let mut packets = Packets::new(mode.family, services - 1);
    let fd = datapath.fd()?;
    let empty_ns = mean(runs, |_| run(empty, &packets.syn.bytes))?;
    let other_ns = mean(runs, |_| run(fd, &packets.other.bytes))?;
    let new_ns = mean(runs, |i| {
        packets.next_new_connection(i);
        run(fd, &packets.new.bytes)
    })?;
    // CLIENT's own connection: opened, answered once, then measured both ways.
    run(fd, &packets.syn.bytes)?;
    run(fd, &packets.reply.bytes)?;
    let established_ns = mean(runs, |_| run(fd, &packets.established.bytes))?;
    let reply_ns = mean(runs, |_| run(fd, &packets.reply.bytes))?;
    // What was measured includes the backend counters: CLIENT's packets were all counted.
    let counted = datapath.counted_packets()?;
    anyhow::ensure!(
        counted >= 2 * u64::from(runs),
        "the backend counted {counted} packets of {} measured",
        2 * runs
    );
    Ok([empty_ns, other_ns, new_ns, established_ns, reply_ns])
}

/// The packets of one measurement: the client's connection to the measured service, the new
/// connections from other clients, and a packet to no service.
struct Packets {
    family: Family,
    syn: Frame,
    new: Frame,
    reply: Frame,
    established: Frame,
    other: Frame,
}

impl Packets {
    /// The packets of `family` to the service of index `service`.
    fn new(family: Family, service: usize) -> Self {
        let tcp = |src: SocketAddr, dst: SocketAddr, flags: u8| match (src, dst) {
            (SocketAddr::V4(src), SocketAddr::V4(dst)) => Frame::tcp(src, dst, flags),
            (SocketAddr::V6(src), SocketAddr::V6(dst)) => Frame::tcp6(src, dst, flags),
            _ => unreachable!("one family per connection"),
        };
        let (client, backend, other, frontend): (SocketAddr, SocketAddr, SocketAddr, SocketAddr) =
            match family {
                Family::Ipv4 => (
                    CLIENT.into(),
                    BACKEND.into(),
                    NOT_A_SERVICE.into(),
                    SocketAddrV4::new(cluster_ip(service), SERVICE_PORT).into(),
                ),
                Family::Ipv6 => (
                    CLIENT6.into(),
                    BACKEND6.into(),
                    NOT_A_SERVICE6.into(),
                    v6(cluster_ip6(service), SERVICE_PORT).into(),
                ),
            };
        Packets {
            family,
            syn: tcp(client, frontend, TCP_SYN),
            new: tcp(client, frontend, TCP_SYN),
            reply: tcp(backend, client, TCP_ACK),
            established: tcp(client, frontend, TCP_ACK),
            other: tcp(client, other, TCP_SYN),
        }
    }

    /// Makes `new` the SYN of the `i`th new connection: its own source address and port.
    fn next_new_connection(&mut self, i: u32) {
        let port = 20_000 + (i & 0x7fff) as u16;
        match self.family {
            Family::Ipv4 => self.new.set_source(SocketAddrV4::new(
                Ipv4Addr::from(FIRST_CLIENT + (i >> 15)),
                port,
            )),
            Family::Ipv6 => self.new.set_source6(v6(
                Ipv6Addr::from(u128::from(FIRST_CLIENT6) + u128::from(i >> 15)),
                port,
            )),
        }
    }
}

const fn v6(ip: Ipv6Addr, port: u16) -> SocketAddrV6 {
    SocketAddrV6::new(ip, port, 0, 0)
}

fn addr6(ip: Ipv6Addr) -> Addr6 {
    Addr6::from_octets(ip.octets())
}

/// The node of B1: INTERFACE (10.244.1.1/24 and fd00:10:244:1::1/64, forwarding on) with the
/// clients and backends of both families as neighbours whose MACs are known. Nothing is sent: BPF_PROG_TEST_RUN only returns verdicts.
fn routed_node() -> Result<Netns> {
    let node = Netns::new(format!("{}b1", netns::unique_prefix()))?;
    node.ip(&[
        "link", "add", INTERFACE, "type", "veth", "peer", "name", "b1peer",
    ])?;
    node.ip(&["link", "set", INTERFACE, "up"])?;
    node.ip(&["link", "set", "b1peer", "up"])?;
    node.ip(&["addr", "add", "10.244.1.1/24", "dev", INTERFACE])?;
    node.ip(&[
        "addr",
        "add",
        "fd00:10:244:1::1/64",
        "dev",
        INTERFACE,
        "nodad",
    ])?;
    let neighbours: [(SocketAddr, &str); 4] = [
        (CLIENT.into(), "02:00:00:00:b1:04"),
        (BACKEND.into(), "02:00:00:00:b1:02"),
        (CLIENT6.into(), "02:00:00:00:b1:04"),
        (BACKEND6.into(), "02:00:00:00:b1:02"),
    ];
    for (neighbour, mac) in neighbours {
        let ip = neighbour.ip().to_string();
        let args = [
            "neigh",
            "add",
            &ip,
            "lladdr",
            mac,
            "dev",
            INTERFACE,
            "nud",
            "permanent",
        ];
        node.ip(&args)?;
    }
    node.sysctl("net.ipv4.conf.all.forwarding", "1")?;
    node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    Ok(node)
}

fn run_once(fd: BorrowedFd<'_>, data: &[u8], ctx: &[u8]) -> Result<u32> {
    let (_, ns) = bpf::test_run(
        fd,
        &bpf::TestRun {
            data,
            ctx: Some(ctx),
            repeat: 1,
            flags: 0,
            batch_size: 0,
        },
    )
    .context("BPF_PROG_TEST_RUN")?;
    Ok(ns)
}

fn mean(runs: u32, mut one: impl FnMut(u32) -> Result<u32>) -> Result<f64> {
    let mut total: u64 = 0;
    for i in 0..runs {
        total += u64::from(one(i)?);
    }
    Ok(total as f64 / f64::from(runs))
}

/// A private copy of the object, ready, with `services` ClusterIP frontends of one backend each.
struct Datapath {
    ebpf: Ebpf,
    /// The counter slot of the backend of the service measured.
    measured_slot: u32,
}

impl Datapath {
    fn load(services: usize, mode: &Mode, runs: u32) -> Result<Self> {
        // Every new connection stays tracked (two entries): room for all of them, so that the
        // measurement never includes LRU eviction.
        let conntrack = (2 * runs as usize + 64)
            .next_power_of_two()
            .max(default_size::CONNTRACK as usize) as u32;
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(map_name::CONNTRACK, conntrack)
            .map_max_entries(map_name::CONNTRACK6, conntrack)
            .load(lb_user::datapath::EBPF_OBJECT)
            .context("load the eBPF object (run as root)")?;
        load_programs(&mut ebpf, mode.family)?;
        let mut config: Array<_, Config> = ebpf
            .map_mut(map_name::CONFIG)
            .context("config")?
            .try_into()?;
        config.set(
            0,
            Config {
                node_addr: ipv4_be(NODE.octets()),
                cluster_cidr_addr: ipv4_be([10, 244, 0, 0]),
                cluster_cidr_mask: ipv4_be([255, 255, 0, 0]),
                flags: CONFIG_F_READY | mode.flags,
                snat_port_min: SNAT_PORT_MIN,
                snat_port_max: SNAT_PORT_MAX,
                clock: lb_user::datapath::kernel_clock()?,
                ..Config::default()
            },
            0,
        )?;
        let mut config6: Array<_, Config6> = ebpf
            .map_mut(map_name::CONFIG6)
            .context("config6")?
            .try_into()?;
        config6.set(
            0,
            Config6 {
                node_addr: addr6(NODE6),
                cluster_cidr_addr: addr6(CLUSTER_CIDR6),
                cluster_cidr_mask: addr6(CLUSTER_CIDR6_MASK),
            },
            0,
        )?;
        // Every backend counted, as the agent counts them: in a slot of its own while there are
        // enough (the measured service, the last, shares one beyond that).
        let stats_slot = |id: u32| 1 + id % (default_size::BACKEND_STATS - 1);
        let endpoint = Backend {
            addr: ipv4_be(BACKEND.ip().octets()),
            port: port_be(BACKEND.port()),
            stats_slot: 0,
        };
        let measured = services as u32 - 1;
        let mut stats: PerCpuArray<_, BackendStats> = ebpf
            .map_mut(map_name::BACKEND_STATS)
            .context("backend stats")?
            .try_into()?;
        // The datapath counts a connection while the slot's owner is the one it opened under:
        // the IPv4 endpoint's owner serves IPv6's too.
        let claim = BackendStats {
            owner: lb_user::maps::stats_slots::PortEndpoint::new(measured, &endpoint).owner(),
            ..BackendStats::default()
        };
        let cpus = aya::util::nr_cpus().map_err(|(_, err)| err)?;
        stats.set(
            stats_slot(measured),
            PerCpuValues::try_from(vec![claim; cpus])?,
            0,
        )?;
        match mode.family {
            Family::Ipv4 => insert_services(
                &mut ebpf,
                (map_name::FRONTENDS, map_name::BACKENDS),
                services,
                |id| FrontendKey {
                    addr: ipv4_be(cluster_ip(id as usize).octets()),
                    port: port_be(SERVICE_PORT),
                    proto: IPPROTO_TCP,
                    _pad: 0,
                },
                |id| Backend {
                    stats_slot: stats_slot(id) as u16,
                    ..endpoint
                },
            )?,
            Family::Ipv6 => insert_services(
                &mut ebpf,
                (map_name::FRONTENDS6, map_name::BACKENDS6),
                services,
                |id| FrontendKey6 {
                    addr: addr6(cluster_ip6(id as usize)),
                    port: port_be(SERVICE_PORT),
                    proto: IPPROTO_TCP,
                    _pad: 0,
                },
                |id| Backend6 {
                    addr: addr6(*BACKEND6.ip()),
                    port: port_be(BACKEND6.port()),
                    stats_slot: stats_slot(id) as u16,
                },
            )?,
        }
        Ok(Datapath {
            ebpf,
            measured_slot: stats_slot(measured),
        })
    }

    /// The packets the measured service's backend counted, summed over CPUs.
    fn counted_packets(&self) -> Result<u64> {
        let stats: PerCpuArray<_, BackendStats> = self
            .ebpf
            .map(map_name::BACKEND_STATS)
            .context("backend stats")?
            .try_into()?;
        let slot = self.measured_slot;
        Ok(stats.get(&slot, 0)?.iter().map(|cpu| cpu.packets).sum())
    }

    fn fd(&self) -> Result<BorrowedFd<'_>> {
        let program: &SchedClassifier = self
            .ebpf
            .program(program_name::INGRESS)
            .context("no ingress program")?
            .try_into()?;
        Ok(program.fd()?.as_fd())
    }
}

/// Loads `lb_ingress` and, for IPv6, the programs it tail-calls, in their slots as the agent
/// puts them.
fn load_programs(ebpf: &mut Ebpf, family: Family) -> Result<()> {
    let names: &[&str] = match family {
        Family::Ipv4 => &[program_name::INGRESS],
        Family::Ipv6 => &[
            program_name::INGRESS,
            program_name::INGRESS6,
            program_name::EGRESS6,
        ],
    };
    for &name in names {
        let program: &mut SchedClassifier = ebpf
            .program_mut(name)
            .with_context(|| format!("no program {name}"))?
            .try_into()?;
        lb_user::datapath::load_program(|| program.load())?;
    }
    if family == Family::Ipv6 {
        lb_user::datapath::ipv6_programs::fill_program_array(ebpf)?;
    }
    Ok(())
}

/// Inserts `services` ClusterIP frontends (`frontend(id)`) of one backend each (`backend(id)`)
/// into the frontend and backend maps `names`.
fn insert_services<K: Pod, B: Pod>(
    ebpf: &mut Ebpf,
    names: (&str, &str),
    services: usize,
    frontend: impl Fn(u32) -> K,
    backend: impl Fn(u32) -> B,
) -> Result<()> {
    let mut backends: HashMap<_, BackendKey, B> =
        ebpf.map_mut(names.1).context("backends")?.try_into()?;
    for id in 0..services as u32 {
        let key = BackendKey {
            service_id: id,
            slot: 0,
        };
        backends.insert(key, backend(id), 0)?;
    }
    let mut frontends: HashMap<_, K, Frontend> =
        ebpf.map_mut(names.0).context("frontends")?.try_into()?;
    for id in 0..services as u32 {
        let value = Frontend {
            service_id: id,
            backend_count: 1,
            // Fields added to the ABI later keep their "off" default.
            ..Default::default()
        };
        frontends.insert(frontend(id), value, 0)?;
    }
    Ok(())
}
