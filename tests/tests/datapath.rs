//! The datapath (tc `lb_ingress`, and `lb_xdp`) run on crafted packets with BPF_PROG_TEST_RUN: no
//! interface, no pinned map. Each test loads its own copy of the object, so tests run in
//! parallel. Run as root.
//!
//! The FIB lookup has no ingress interface in a test run, so translated packets are handed to the
//! stack (TC_ACT_OK); a redirect (TC_ACT_REDIRECT, TTL decremented) is accepted as well. XDP
//! redirects only in a namespace with routes (`in_private_netns`).
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, HashMap, MapData, PerCpuArray, PerCpuValues,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{CgroupSockAddr, SchedClassifier, Xdp},
};
use etherparse::{
    ArpHardwareId, ArpOperation, ArpPacket, EtherType, Ethernet2Header, IpHeaders, IpNumber,
    Ipv4Header, PacketBuilder, TcpHeader, UdpHeader,
};
use lb_common::{
    AffinityKey, Backend, BackendKey, BackendStats, CONFIG_F_MASQUERADE_ALL, CONFIG_F_READY,
    CT_F_MASQUERADE, CT_F_REPLY, CT_F_UNCONFIRMED, CT_UDP_REPLIED, CT_UDP_STREAM, CT_UDP_UNREPLIED,
    Config, ConntrackEntry, ConntrackKey, Counter, FRONTEND_F_LOCAL, FRONTEND_F_MASQUERADE,
    FRONTEND_F_PRESERVE_SOURCE, FRONTEND_F_SOURCE_RANGES, Frontend, FrontendKey, IPPROTO_TCP,
    IPPROTO_UDP, LOCAL_SLOT, SCHED_FLOW_HASH, SCHED_ROUND_ROBIN, SCHED_SOURCE_HASH, SNAT_PORT_MAX,
    SNAT_PORT_MIN, SourceRangeKey, StickyBackend, flow_hash, ipv4_be, map_name, port_be,
    program_name, source_hash, tcp, tcp_timeout_s,
};
use lb_tests::test_run::{entries, run_program};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;

const NODE: Ipv4Addr = Ipv4Addr::new(192, 168, 1, 10);
const CLUSTER_CIDR: (Ipv4Addr, Ipv4Addr) =
    (Ipv4Addr::new(10, 244, 0, 0), Ipv4Addr::new(255, 255, 0, 0));
const CLUSTER_IP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
const NODE_PORT: SocketAddrV4 = SocketAddrV4::new(NODE, 30080);
const POD: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 10), 40000);
const DOCKER_CONTAINER: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(172, 17, 0, 2), 40000);
const EXTERNAL_CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 7), 50000);
const ENDPOINTS: [SocketAddrV4; 3] = [
    SocketAddrV4::new(Ipv4Addr::new(10, 244, 2, 11), 8080),
    SocketAddrV4::new(Ipv4Addr::new(10, 244, 2, 12), 8080),
    SocketAddrV4::new(Ipv4Addr::new(10, 244, 3, 13), 8080),
];
const SERVICE_ID: u32 = 7;

const MAC_SRC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const MAC_DST: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const PAYLOAD: &[u8] = b"hello, service";
const ETH_HLEN: usize = 14;
/// Offset of `ingress_ifindex` in `struct __sk_buff`.
const SKB_INGRESS_IFINDEX: usize = 36;
/// Router Alert (RFC 2113): a valid 4-byte IPv4 option, so IHL becomes 6.
const ROUTER_ALERT: [u8; 4] = [0x94, 0x04, 0x00, 0x00];

fn config() -> Config {
    Config {
        node_addr: ipv4_be(NODE.octets()),
        cluster_cidr_addr: ipv4_be(CLUSTER_CIDR.0.octets()),
        cluster_cidr_mask: ipv4_be(CLUSTER_CIDR.1.octets()),
        flags: CONFIG_F_READY,
        snat_port_min: SNAT_PORT_MIN,
        snat_port_max: SNAT_PORT_MAX,
        clock: lb_user::datapath::kernel_clock().unwrap(),
        ..Config::default()
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn number(self) -> u8 {
        match self {
            Proto::Tcp => IPPROTO_TCP,
            Proto::Udp => IPPROTO_UDP,
        }
    }
}

/// The one packet builder: an Ethernet + IPv4 + TCP/UDP packet with valid checksums, and the
/// header variations the tests need.
#[derive(Clone, Copy)]
struct Packet {
    proto: Proto,
    src: SocketAddrV4,
    dst: SocketAddrV4,
    ttl: u8,
    /// A SYN without ACK, which opens a connection; otherwise ACK is set.
    tcp_syn: bool,
    /// With `tcp_syn`: a SYN-ACK.
    tcp_syn_ack: bool,
    tcp_fin: bool,
    tcp_rst: bool,
    seq: u32,
    ack_number: u32,
    ip_options: &'static [u8],
    more_fragments: bool,
    fragment_offset: u16,
    zero_udp_checksum: bool,
}

impl Packet {
    fn new(proto: Proto, src: SocketAddrV4, dst: SocketAddrV4) -> Self {
        Self {
            proto,
            src,
            dst,
            ttl: 64,
            tcp_syn: false,
            tcp_syn_ack: false,
            tcp_fin: false,
            tcp_rst: false,
            seq: 1000,
            ack_number: 0,
            ip_options: &[],
            more_fragments: false,
            fragment_offset: 0,
            zero_udp_checksum: false,
        }
    }

    fn build(&self) -> Vec<u8> {
        let mut ip = Ipv4Header::new(
            0,
            self.ttl,
            IpNumber(self.proto.number()),
            self.src.ip().octets(),
            self.dst.ip().octets(),
        )
        .unwrap();
        ip.options = self.ip_options.try_into().unwrap();
        ip.more_fragments = self.more_fragments;
        ip.fragment_offset = self.fragment_offset.try_into().unwrap();
        let builder =
            PacketBuilder::ethernet2(MAC_SRC, MAC_DST).ip(IpHeaders::Ipv4(ip, Default::default()));
        let mut bytes = Vec::new();
        match self.proto {
            Proto::Tcp => {
                let mut tcp = TcpHeader::new(self.src.port(), self.dst.port(), self.seq, 65535);
                tcp.syn = self.tcp_syn;
                tcp.ack = !self.tcp_syn || self.tcp_syn_ack;
                tcp.acknowledgment_number = self.ack_number;
                tcp.fin = self.tcp_fin;
                tcp.rst = self.tcp_rst;
                builder.tcp_header(tcp).write(&mut bytes, PAYLOAD).unwrap();
            }
            Proto::Udp => {
                builder
                    .udp(self.src.port(), self.dst.port())
                    .write(&mut bytes, PAYLOAD)
                    .unwrap();
                if self.zero_udp_checksum {
                    let check = ETH_HLEN + 20 + self.ip_options.len() + 6;
                    bytes[check..check + 2].fill(0);
                }
            }
        }
        bytes
    }
}

/// A packet that came out of the program as IPv4 TCP/UDP, with every checksum verified.
#[derive(Debug)]
struct Output {
    src: SocketAddrV4,
    dst: SocketAddrV4,
    udp_checksum: Option<u16>,
}

/// The one checksum verifier: checks that `output` is `input` rewritten (same length, payload and
/// IP fields other than addresses; TTL decremented only when `redirected`), that the IPv4 and
/// TCP/UDP checksums are valid, and returns the new addresses.
fn verify(input: &[u8], redirected: bool, output: &[u8]) -> Output {
    assert_eq!(output.len(), input.len());
    let (eth_in, rest) = Ethernet2Header::from_slice(input).unwrap();
    let (ip_in, l4_in) = Ipv4Header::from_slice(rest).unwrap();
    let (eth, rest) = Ethernet2Header::from_slice(output).unwrap();
    let (ip, l4) = Ipv4Header::from_slice(rest).unwrap();
    if !redirected {
        assert_eq!(eth, eth_in, "MACs are the stack's business");
    }
    assert_eq!(
        ip.calc_header_checksum(),
        ip.header_checksum,
        "IPv4 checksum"
    );
    let ttl = if redirected {
        ip_in.time_to_live - 1
    } else {
        ip_in.time_to_live
    };
    assert_eq!(ip.time_to_live, ttl);
    assert_eq!(
        (
            ip.total_len,
            ip.protocol,
            ip.options.as_slice(),
            ip.identification
        ),
        (
            ip_in.total_len,
            ip_in.protocol,
            ip_in.options.as_slice(),
            ip_in.identification
        )
    );
    let (ports, udp_checksum) = match ip.protocol {
        IpNumber::TCP => {
            let (tcp, payload) = TcpHeader::from_slice(l4).unwrap();
            assert_eq!(payload, PAYLOAD);
            let (tcp_in, _) = TcpHeader::from_slice(l4_in).unwrap();
            let unchanged = TcpHeader {
                source_port: tcp.source_port,
                destination_port: tcp.destination_port,
                checksum: tcp.checksum,
                ..tcp_in
            };
            assert_eq!(tcp, unchanged, "only ports and checksum change");
            let expected = tcp.calc_checksum_ipv4(&ip, payload).unwrap();
            assert_eq!(tcp.checksum, expected, "TCP checksum");
            ((tcp.source_port, tcp.destination_port), None)
        }
        IpNumber::UDP => {
            let (udp, payload) = UdpHeader::from_slice(l4).unwrap();
            assert_eq!(payload, PAYLOAD);
            assert_eq!(udp.length, UdpHeader::from_slice(l4_in).unwrap().0.length);
            if udp.checksum != 0 {
                let expected = udp.calc_checksum_ipv4(&ip, payload).unwrap();
                assert_eq!(udp.checksum, expected, "UDP checksum");
            }
            ((udp.source_port, udp.destination_port), Some(udp.checksum))
        }
        other => panic!("unexpected protocol {other:?}"),
    };
    Output {
        src: SocketAddrV4::new(ip.source.into(), ports.0),
        dst: SocketAddrV4::new(ip.destination.into(), ports.1),
        udp_checksum,
    }
}

fn ct_key(proto: Proto, src: SocketAddrV4, dst: SocketAddrV4) -> ConntrackKey {
    ConntrackKey {
        src_addr: ipv4_be(src.ip().octets()),
        dst_addr: ipv4_be(dst.ip().octets()),
        src_port: port_be(src.port()),
        dst_port: port_be(dst.port()),
        proto: proto.number(),
        _pad0: 0,
        _pad1: 0,
    }
}

fn rewrite_of(entry: &ConntrackEntry) -> (SocketAddrV4, SocketAddrV4) {
    let addr = |a: u32, p: u16| SocketAddrV4::new(a.to_ne_bytes().into(), u16::from_be(p));
    (
        addr(entry.src_addr, entry.src_port),
        addr(entry.dst_addr, entry.dst_port),
    )
}

/// The one fixture: a private, unpinned copy of the object with its program loaded.
struct Datapath {
    ebpf: Ebpf,
    /// The interface the packets arrive on, as the FIB lookup sees it; 0: none.
    ingress_ifindex: u32,
}

impl Datapath {
    fn new(config: Config) -> Self {
        let mut ebpf = EbpfLoader::new()
            // Small maps: many copies are loaded at once.
            .map_max_entries(map_name::FRONTENDS, 64)
            .map_max_entries(map_name::BACKENDS, 64)
            .map_max_entries(map_name::CONNTRACK, CONNTRACK_MAX)
            .load(lb_user::datapath::EBPF_OBJECT)
            .expect("load the object (run as root)");
        let program: &mut SchedClassifier = ebpf
            .program_mut(program_name::INGRESS)
            .unwrap()
            .try_into()
            .unwrap();
        lb_user::datapath::load_program(|| program.load()).expect("verifier accepts the program");
        let mut datapath = Self {
            ebpf,
            ingress_ifindex: 0,
        };
        let mut array: Array<_, Config> = datapath.map(map_name::CONFIG);
        array.set(0, config, 0).unwrap();
        datapath
    }

    /// Ready, with the ClusterIP (TCP and UDP) served by `endpoints`.
    fn with_cluster_ip(endpoints: &[SocketAddrV4]) -> Self {
        let mut datapath = Self::new(config());
        for proto in [Proto::Tcp, Proto::Udp] {
            datapath.service(proto, CLUSTER_IP, 0, SERVICE_ID, endpoints);
        }
        datapath
    }

    fn map<'a, T: TryFrom<&'a mut aya::maps::Map>>(&'a mut self, name: &str) -> T
    where
        T::Error: std::fmt::Debug,
    {
        self.ebpf.map_mut(name).unwrap().try_into().unwrap()
    }

    fn service(
        &mut self,
        proto: Proto,
        frontend: SocketAddrV4,
        flags: u32,
        service_id: u32,
        endpoints: &[SocketAddrV4],
    ) {
        let mut backends: HashMap<_, BackendKey, Backend> = self.map(map_name::BACKENDS);
        for (slot, endpoint) in (0..).zip(endpoints) {
            let backend = Backend {
                addr: ipv4_be(endpoint.ip().octets()),
                port: port_be(endpoint.port()),
                stats_slot: 0,
            };
            backends
                .insert(BackendKey { service_id, slot }, backend, 0)
                .unwrap();
        }
        self.frontend(
            proto,
            frontend,
            Frontend {
                service_id,
                backend_count: endpoints.len() as u32,
                flags,
                ..Default::default()
            },
        );
    }

    fn frontend(&mut self, proto: Proto, at: SocketAddrV4, frontend: Frontend) {
        let key = FrontendKey {
            addr: ipv4_be(at.ip().octets()),
            port: port_be(at.port()),
            proto: proto.number(),
            _pad: 0,
        };
        let mut frontends: HashMap<_, FrontendKey, Frontend> = self.map(map_name::FRONTENDS);
        frontends.insert(key, frontend, 0).unwrap();
    }

    fn run(&self, packet: &[u8]) -> (u32, Vec<u8>) {
        let program: &SchedClassifier = self
            .ebpf
            .program(program_name::INGRESS)
            .unwrap()
            .try_into()
            .unwrap();
        // The head of a struct __sk_buff, up to ingress_ifindex; the kernel zero-fills the rest.
        let mut skb = [0u8; SKB_INGRESS_IFINDEX + 4];
        skb[SKB_INGRESS_IFINDEX..].copy_from_slice(&self.ingress_ifindex.to_ne_bytes());
        run_program(program, packet, Some(&skb))
    }

    /// Runs a packet that must be translated, and returns where it went.
    fn translate(&self, packet: &Packet) -> Output {
        let input = packet.build();
        let (verdict, output) = self.run(&input);
        assert!(
            verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
            "verdict {verdict}"
        );
        verify(&input, verdict == TC_ACT_REDIRECT, &output)
    }

    /// Loads `lb_xdp` beside `lb_ingress`; they share the maps.
    fn with_xdp(mut self) -> Self {
        let program: &mut Xdp = self
            .ebpf
            .program_mut(program_name::XDP)
            .unwrap()
            .try_into()
            .unwrap();
        lb_user::datapath::load_program(|| program.load()).expect("verifier accepts lb_xdp");
        self
    }

    /// Lets `lb_xdp` redirect into interface `name` of this namespace, as the agent does for
    /// the interfaces whose XDP features take redirects.
    fn allow_xdp_egress(&mut self, name: &str, allowed: bool) {
        let ifindex = nix::net::if_::if_nametoindex(name).unwrap();
        let mut egress: HashMap<_, u32, u8> = self.map(map_name::XDP_EGRESS);
        if allowed {
            egress.insert(ifindex, 1, 0).unwrap();
        } else {
            egress.remove(&ifindex).unwrap();
        }
    }

    /// Runs `lb_xdp` (see [`Datapath::with_xdp`]) as if the packet arrived on `ingress_ifindex`.
    fn run_xdp(&self, packet: &[u8]) -> (u32, Vec<u8>) {
        let program: &Xdp = self
            .ebpf
            .program(program_name::XDP)
            .unwrap()
            .try_into()
            .unwrap();
        // struct xdp_md: data, data_end (the packet's length, no metadata), data_meta,
        // ingress_ifindex, rx_queue_index, egress_ifindex.
        let mut xdp_md = [0u32; 6];
        xdp_md[1] = packet.len() as u32;
        xdp_md[3] = self.ingress_ifindex;
        let xdp_md: Vec<u8> = xdp_md.iter().flat_map(|w| w.to_ne_bytes()).collect();
        run_program(program, packet, Some(&xdp_md))
    }

    /// Runs a packet that `lb_xdp` must translate and redirect, and returns where it went.
    fn translate_xdp(&self, packet: &Packet) -> (Output, Vec<u8>) {
        let input = packet.build();
        let (verdict, output) = self.run_xdp(&input);
        assert_eq!(verdict, XDP_REDIRECT);
        (verify(&input, true, &output), output)
    }

    /// Runs a packet that `lb_xdp` must leave to the stack untouched.
    fn assert_xdp_passes(&self, packet: &[u8]) {
        let (verdict, output) = self.run_xdp(packet);
        assert_eq!(verdict, XDP_PASS);
        assert_eq!(output, packet);
    }

    /// Runs a packet that must come out untouched with TC_ACT_OK.
    fn assert_untouched(&self, packet: &[u8]) {
        let (verdict, output) = self.run(packet);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(output, packet);
    }

    fn counter(&self, counter: Counter) -> u64 {
        let map = self.ebpf.map(map_name::COUNTERS).unwrap();
        let counters: PerCpuArray<&MapData, u64> = map.try_into().unwrap();
        counters.get(&(counter as u32), 0).unwrap().iter().sum()
    }

    /// Writes counter slot `slot` zeroed with `owner` on every CPU, as the agent claims it.
    fn claim_stats(&mut self, slot: u16, owner: u32) {
        let mut stats: PerCpuArray<_, BackendStats> = self.map(map_name::BACKEND_STATS);
        let cpus = aya::util::nr_cpus().unwrap();
        let claim = BackendStats {
            owner,
            ..BackendStats::default()
        };
        let values = PerCpuValues::try_from(vec![claim; cpus]).unwrap();
        stats.set(u32::from(slot), values, 0).unwrap();
    }

    /// Counter slot `slot`, summed over CPUs (`owner` of CPU 0).
    fn backend_stats(&self, slot: u16) -> BackendStats {
        let map = self.ebpf.map(map_name::BACKEND_STATS).unwrap();
        let stats: PerCpuArray<&MapData, BackendStats> = map.try_into().unwrap();
        BackendStats::sum(stats.get(&u32::from(slot), 0).unwrap().iter())
    }

    /// The entry of `key` in the main table, else in the unconfirmed one (as the datapath looks
    /// it up), without `CT_F_UNCONFIRMED`: which table holds it is `confirmed`'s question.
    fn conntrack(&self, key: &ConntrackKey) -> Option<ConntrackEntry> {
        [map_name::CONNTRACK, map_name::CONNTRACK_UNCONFIRMED]
            .into_iter()
            .find_map(|name| {
                let map = self.ebpf.map(name).unwrap();
                let conntrack: HashMap<&MapData, ConntrackKey, ConntrackEntry> =
                    map.try_into().unwrap();
                conntrack.get(key, 0).ok()
            })
            .map(|entry| ConntrackEntry {
                flags: entry.flags & !CT_F_UNCONFIRMED,
                ..entry
            })
    }

    /// Whether `key`'s entry is in the main table (its connection confirmed).
    fn confirmed(&self, key: &ConntrackKey) -> bool {
        let map = self.ebpf.map(map_name::CONNTRACK).unwrap();
        let conntrack: HashMap<&MapData, ConntrackKey, ConntrackEntry> = map.try_into().unwrap();
        conntrack.get(key, 0).is_ok()
    }

    fn conntrack_len(&self) -> usize {
        let tables = [map_name::CONNTRACK, map_name::CONNTRACK_UNCONFIRMED];
        entries::<ConntrackKey, ConntrackEntry>(&self.ebpf, &tables)
    }

    /// Moves every unconfirmed entry to the main table, as if each connection had completed
    /// its handshake.
    fn confirm_all(&mut self) {
        let unconfirmed: Vec<(ConntrackKey, ConntrackEntry)> = {
            let map = self.ebpf.map(map_name::CONNTRACK_UNCONFIRMED).unwrap();
            let conntrack: HashMap<&MapData, ConntrackKey, ConntrackEntry> =
                map.try_into().unwrap();
            conntrack.iter().map(Result::unwrap).collect()
        };
        let map = self.ebpf.map_mut(map_name::CONNTRACK).unwrap();
        let mut conntrack: HashMap<&mut MapData, ConntrackKey, ConntrackEntry> =
            map.try_into().unwrap();
        for (key, entry) in &unconfirmed {
            let entry = ConntrackEntry {
                flags: entry.flags & !CT_F_UNCONFIRMED,
                ..*entry
            };
            conntrack.insert(key, entry, 0).unwrap();
        }
        let map = self.ebpf.map_mut(map_name::CONNTRACK_UNCONFIRMED).unwrap();
        let mut conntrack: HashMap<&mut MapData, ConntrackKey, ConntrackEntry> =
            map.try_into().unwrap();
        for (key, _) in &unconfirmed {
            conntrack.remove(key).unwrap();
        }
    }
}

/// A pod connects to the ClusterIP, the flow sticks to its backend, and the reply is translated
/// back; both conntrack entries follow the connection's state.
/// The kernel accepts the object's BTF, which aya only warns about when it does not: the loaded
/// program carries it (so verifier logs and `bpftool prog dump` show source lines). Rust types in
/// a function's signature can make LLVM write BTF the kernel refuses (see `conntrack::Tracked`).
#[test]
fn object_btf_is_accepted() {
    let datapath = Datapath::new(config());
    let program: &SchedClassifier = datapath
        .ebpf
        .program(program_name::INGRESS)
        .unwrap()
        .try_into()
        .unwrap();
    let info = program.info().expect("program info");
    assert!(
        info.btf_id().is_some(),
        "the kernel refused the object's BTF"
    );
}

#[test]
fn cluster_ip_tcp_from_pod() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let first = Packet::new(Proto::Tcp, POD, CLUSTER_IP);
    let out = datapath.translate(&first);
    assert_eq!(out.src, POD, "source untouched");
    let backend = out.dst;
    assert!(ENDPOINTS.contains(&backend), "DNAT to a backend: {backend}");

    let original = datapath
        .conntrack(&ct_key(Proto::Tcp, POD, CLUSTER_IP))
        .unwrap();
    assert_eq!(rewrite_of(&original), (POD, backend));
    // An ACK without a SYN seen picks the connection up, as Linux's conntrack does.
    assert_eq!((original.flags, original.state), (0, tcp::ESTABLISHED));
    assert_eq!(original.service_id, SERVICE_ID);
    let reply = datapath
        .conntrack(&ct_key(Proto::Tcp, backend, POD))
        .unwrap();
    assert_eq!(rewrite_of(&reply), (CLUSTER_IP, POD));
    assert_eq!((reply.flags, reply.state), (CT_F_REPLY, tcp::ESTABLISHED));
    assert_eq!(datapath.conntrack_len(), 2);

    for _ in 0..20 {
        assert_eq!(datapath.translate(&first).dst, backend, "same backend");
    }
    let out = datapath.translate(&Packet::new(Proto::Tcp, backend, POD));
    assert_eq!(
        (out.src, out.dst),
        (CLUSTER_IP, POD),
        "reply reverse-translated"
    );
    for key in [
        ct_key(Proto::Tcp, POD, CLUSTER_IP),
        ct_key(Proto::Tcp, backend, POD),
    ] {
        assert_eq!(datapath.conntrack(&key).unwrap().state, tcp::ESTABLISHED);
    }

    let fin = Packet {
        tcp_fin: true,
        ..first
    };
    assert_eq!(datapath.translate(&fin).dst, backend);
    for key in [
        ct_key(Proto::Tcp, POD, CLUSTER_IP),
        ct_key(Proto::Tcp, backend, POD),
    ] {
        assert_eq!(datapath.conntrack(&key).unwrap().state, tcp::FIN_WAIT);
    }
    assert_eq!(datapath.counter(Counter::NewConnection), 1);
    assert_eq!(datapath.counter(Counter::Translated), 22);
    assert_eq!(datapath.counter(Counter::Masqueraded), 0);
    assert_eq!(datapath.conntrack_len(), 2);
}

/// Per-backend counters: a connection counts in the slot its backend names, both directions,
/// through the slot and owner its conntrack entries took when it opened; once the slot has
/// another owner (its endpoint left, the slot went to another) the connection no longer counts
/// there; a backend in slot 0 is not counted.
#[test]
fn backend_counters_count_in_the_slot_while_it_has_the_connections_owner() {
    let mut datapath = Datapath::new(config());
    let endpoint = ENDPOINTS[0];
    datapath.service(Proto::Tcp, CLUSTER_IP, 0, SERVICE_ID, &[endpoint]);
    let set_slot = |datapath: &mut Datapath, stats_slot| {
        let mut backends: HashMap<_, BackendKey, Backend> = datapath.map(map_name::BACKENDS);
        let key = BackendKey {
            service_id: SERVICE_ID,
            slot: 0,
        };
        let backend = backends.get(&key, 0).unwrap();
        backends
            .insert(
                key,
                Backend {
                    stats_slot,
                    ..backend
                },
                0,
            )
            .unwrap();
    };
    set_slot(&mut datapath, 3);
    datapath.claim_stats(3, 77);

    let first = Packet::new(Proto::Tcp, POD, CLUSTER_IP);
    let reply = Packet::new(Proto::Tcp, endpoint, POD);
    let ip_len = |packet: &Packet| (packet.build().len() - ETH_HLEN) as u64;
    datapath.translate(&first);
    for key in [
        ct_key(Proto::Tcp, POD, CLUSTER_IP),
        ct_key(Proto::Tcp, endpoint, POD),
    ] {
        let entry = datapath.conntrack(&key).unwrap();
        assert_eq!((entry.stats_slot, entry.stats_owner), (3, 77), "{key:?}");
    }
    datapath.translate(&first);
    datapath.translate(&reply);
    assert_eq!(
        datapath.backend_stats(3),
        BackendStats {
            connections: 1,
            packets: 3,
            bytes: 2 * ip_len(&first) + ip_len(&reply),
            owner: 77,
            ports_exhausted: 0,
        }
    );

    // The slot is another endpoint's now: this connection's packets go uncounted.
    datapath.claim_stats(3, 78);
    datapath.translate(&first);
    datapath.translate(&reply);
    assert_eq!(
        datapath.backend_stats(3),
        BackendStats {
            owner: 78,
            ..BackendStats::default()
        }
    );

    // Slot 0: not counted anywhere.
    set_slot(&mut datapath, 0);
    let other = Packet::new(Proto::Tcp, SocketAddrV4::new(*POD.ip(), 40001), CLUSTER_IP);
    datapath.translate(&other);
    datapath.translate(&other);
    assert_eq!(datapath.backend_stats(0), BackendStats::default());
    assert_eq!(datapath.backend_stats(3).packets, 0);
    let entry = datapath.conntrack(&ct_key(Proto::Tcp, other.src, CLUSTER_IP));
    assert_eq!(entry.map(|e| e.stats_slot), Some(0));
}

/// The packets of one TCP connection from POD to the ClusterIP, with sequence numbers that
/// follow each other (every packet carries PAYLOAD): the client's after its SYN, and the
/// server's (from `backend`) after its SYN-ACK.
struct TcpFlow {
    client: Packet,
    server: Packet,
}

const CLIENT_ISN: u32 = 1000;
const SERVER_ISN: u32 = 5000;

impl TcpFlow {
    fn syn() -> Packet {
        Packet {
            tcp_syn: true,
            seq: CLIENT_ISN,
            ..Packet::new(Proto::Tcp, POD, CLUSTER_IP)
        }
    }

    fn syn_ack(backend: SocketAddrV4) -> Packet {
        Packet {
            tcp_syn: true,
            tcp_syn_ack: true,
            seq: SERVER_ISN,
            ack_number: CLIENT_ISN + 1 + PAYLOAD.len() as u32,
            ..Packet::new(Proto::Tcp, backend, POD)
        }
    }

    /// The client's and the server's next segments once the handshake is done.
    fn after_handshake(backend: SocketAddrV4) -> Self {
        let client_next = CLIENT_ISN + 1 + PAYLOAD.len() as u32;
        let server_next = SERVER_ISN + 1 + PAYLOAD.len() as u32;
        TcpFlow {
            client: Packet {
                seq: client_next,
                ack_number: server_next,
                ..Packet::new(Proto::Tcp, POD, CLUSTER_IP)
            },
            server: Packet {
                seq: server_next,
                ack_number: client_next + PAYLOAD.len() as u32,
                ..Packet::new(Proto::Tcp, backend, POD)
            },
        }
    }

    /// Runs the handshake, and the server's first ACK, through `datapath`: both windows are
    /// known. Returns the flow and its backend.
    fn open(datapath: &Datapath) -> (Self, SocketAddrV4) {
        let backend = datapath.translate(&Self::syn()).dst;
        datapath.translate(&Self::syn_ack(backend));
        let flow = Self::after_handshake(backend);
        datapath.translate(&flow.client);
        datapath.translate(&flow.server);
        (flow, backend)
    }
}

impl Datapath {
    /// The state of both entries of the connection from POD to the ClusterIP via `backend`.
    fn tcp_states(&self, backend: SocketAddrV4) -> (u8, u8) {
        let state = |key| self.conntrack(&key).map_or(u8::MAX, |entry| entry.state);
        (
            state(ct_key(Proto::Tcp, POD, CLUSTER_IP)),
            state(ct_key(Proto::Tcp, backend, POD)),
        )
    }
}

/// Linux's handshake: the SYN-ACK makes the connection SYN_RECV (60 s), only the client's ACK
/// makes it ESTABLISHED; before, the SYN-ACK alone made it established for hours.
#[test]
fn tcp_handshake_establishes_on_the_clients_ack() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let backend = datapath.translate(&TcpFlow::syn()).dst;
    assert_eq!(datapath.tcp_states(backend), (tcp::SYN_SENT, tcp::SYN_SENT));
    datapath.translate(&TcpFlow::syn());
    assert_eq!(datapath.tcp_states(backend), (tcp::SYN_SENT, tcp::SYN_SENT));
    let out = datapath.translate(&TcpFlow::syn_ack(backend));
    assert_eq!((out.src, out.dst), (CLUSTER_IP, POD));
    assert_eq!(datapath.tcp_states(backend), (tcp::SYN_RECV, tcp::SYN_RECV));
    // The SYN-ACK does not confirm it: a backend answers a spoofed SYN too.
    let key = ct_key(Proto::Tcp, POD, CLUSTER_IP);
    assert!(!datapath.confirmed(&key));
    let flow = TcpFlow::after_handshake(backend);
    datapath.translate(&flow.client);
    assert_eq!(
        datapath.tcp_states(backend),
        (tcp::ESTABLISHED, tcp::ESTABLISHED)
    );
    assert!(datapath.confirmed(&key), "the client's ACK confirms it");
    assert_eq!(datapath.counter(Counter::ConntrackConfirmed), 1);
    assert_eq!(datapath.counter(Counter::NewConnection), 1);
}

/// The handshake's last ACK must acknowledge the SYN-ACK (Linux's window check): a blind ACK,
/// as a spoofer who never saw the SYN-ACK sends, leaves the connection in SYN_RECV,
/// unconfirmed, to expire in the SYN timeout; before, any ACK established and confirmed it.
#[test]
fn a_handshake_ack_that_misses_the_syn_ack_establishes_nothing() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let backend = datapath.translate(&TcpFlow::syn()).dst;
    datapath.translate(&TcpFlow::syn_ack(backend));
    let key = ct_key(Proto::Tcp, POD, CLUSTER_IP);
    let flow = TcpFlow::after_handshake(backend);
    for offset in [1, 0x10_0000, 0x8000_0000, 0x9000_0000] {
        let blind = Packet {
            ack_number: flow.client.ack_number.wrapping_add(offset),
            ..flow.client
        };
        datapath.translate(&blind);
        assert_eq!(
            datapath.tcp_states(backend),
            (tcp::SYN_RECV, tcp::SYN_RECV),
            "an ACK {offset:#x} past the SYN-ACK"
        );
        assert!(
            !datapath.confirmed(&key),
            "ACK {offset:#x} past the SYN-ACK"
        );
    }
    datapath.translate(&flow.client);
    assert_eq!(
        datapath.tcp_states(backend),
        (tcp::ESTABLISHED, tcp::ESTABLISHED)
    );
    assert!(datapath.confirmed(&key), "the true ACK confirms it");
}

/// A half-close: the client's FIN and the server's ACK leave the connection in CLOSE_WAIT (an
/// hour by default), where the server goes on sending; the server's FIN and the client's last
/// ACK end it in TIME_WAIT. Before, the FIN made it "closing" for 10 s.
#[test]
fn tcp_half_close_lasts_until_both_sides_close() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let (flow, backend) = TcpFlow::open(&datapath);
    let client_fin = Packet {
        tcp_fin: true,
        ..flow.client
    };
    datapath.translate(&client_fin);
    assert_eq!(datapath.tcp_states(backend), (tcp::FIN_WAIT, tcp::FIN_WAIT));
    datapath.translate(&flow.server);
    assert_eq!(
        datapath.tcp_states(backend),
        (tcp::CLOSE_WAIT, tcp::CLOSE_WAIT)
    );
    let more = Packet {
        seq: flow.server.seq + PAYLOAD.len() as u32,
        ..flow.server
    };
    let out = datapath.translate(&more);
    assert_eq!(
        (out.src, out.dst),
        (CLUSTER_IP, POD),
        "the server still sends"
    );
    assert_eq!(
        datapath.tcp_states(backend),
        (tcp::CLOSE_WAIT, tcp::CLOSE_WAIT)
    );
    let server_fin = Packet {
        tcp_fin: true,
        seq: more.seq + PAYLOAD.len() as u32,
        ..more
    };
    datapath.translate(&server_fin);
    assert_eq!(datapath.tcp_states(backend), (tcp::LAST_ACK, tcp::LAST_ACK));
    datapath.translate(&flow.client);
    assert_eq!(
        datapath.tcp_states(backend),
        (tcp::TIME_WAIT, tcp::TIME_WAIT)
    );
}

/// A RST whose sequence number lies outside the receiver's window (a blind injection) is
/// dropped, counted, and leaves the connection as it was, from either side; one inside it
/// closes the connection.
#[test]
fn tcp_rst_closes_only_inside_the_window() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let (flow, backend) = TcpFlow::open(&datapath);
    for (name, sender) in [("client", flow.client), ("server", flow.server)] {
        // The packets carry no window scale option: their windows are read with the largest
        // shift (65535 << 14, just under 1 GiB), so these lie beyond it either way.
        for offset in [0x6000_0000, 0x8000_0000, 0xa000_0000] {
            let rst = Packet {
                tcp_rst: true,
                seq: sender.seq.wrapping_add(offset),
                ..sender
            };
            let name = format!("{name} RST at +{offset:#x}");
            datapath.assert_refused(
                &name,
                &rst.build(),
                Counter::DropTcpOutOfWindow,
                TC_ACT_SHOT,
            );
        }
        let fin = Packet {
            tcp_fin: true,
            seq: sender.seq.wrapping_add(0x8000_0000),
            ..sender
        };
        datapath.assert_refused(
            &format!("{name} FIN"),
            &fin.build(),
            Counter::DropTcpOutOfWindow,
            TC_ACT_SHOT,
        );
    }
    assert_eq!(
        datapath.tcp_states(backend),
        (tcp::ESTABLISHED, tcp::ESTABLISHED)
    );
    let rst = Packet {
        tcp_rst: true,
        seq: flow.client.seq + PAYLOAD.len() as u32 + 100,
        ..flow.client
    };
    assert_eq!(datapath.translate(&rst).dst, backend);
    assert_eq!(datapath.tcp_states(backend), (tcp::CLOSE, tcp::CLOSE));
}

/// A RST, FIN or SYN-ACK to a frontend opens no connection (Linux's conntrack holds it
/// invalid): it passes untouched, untracked.
#[test]
fn tcp_segments_that_open_nothing_are_not_tracked() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let ack = Packet::new(Proto::Tcp, POD, CLUSTER_IP);
    for (name, packet) in [
        (
            "RST",
            Packet {
                tcp_rst: true,
                ..ack
            },
        ),
        (
            "RST+ACK",
            Packet {
                tcp_rst: true,
                ack_number: 7,
                ..ack
            },
        ),
        (
            "FIN",
            Packet {
                tcp_fin: true,
                ..ack
            },
        ),
        (
            "SYN-ACK",
            Packet {
                tcp_syn: true,
                tcp_syn_ack: true,
                ..ack
            },
        ),
    ] {
        datapath.assert_refused(
            name,
            &packet.build(),
            Counter::PassedTcpNoConnection,
            TC_ACT_OK,
        );
    }
    assert_eq!(datapath.conntrack_len(), 0);
}

/// A SYN on the tuple of a closed connection opens a new one, to a backend chosen now (the old
/// one may be gone since), as Linux's conntrack reopens it; the closed connection's own packets
/// and a retransmitted SYN of a new connection keep their backend.
#[test]
fn syn_on_a_closed_connection_opens_a_new_one() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS[..1]);
    let (flow, backend) = TcpFlow::open(&datapath);
    assert_eq!(backend, ENDPOINTS[0]);
    let rst = Packet {
        tcp_rst: true,
        ..flow.client
    };
    assert_eq!(datapath.translate(&rst).dst, ENDPOINTS[0]);
    datapath.service(Proto::Tcp, CLUSTER_IP, 0, SERVICE_ID, &ENDPOINTS[1..2]);
    assert_eq!(
        datapath.translate(&flow.client).dst,
        ENDPOINTS[0],
        "still closing"
    );
    assert_eq!(datapath.counter(Counter::NewConnection), 1);

    let syn = TcpFlow::syn();
    assert_eq!(datapath.translate(&syn).dst, ENDPOINTS[1], "reopened");
    assert_eq!(
        datapath.translate(&syn).dst,
        ENDPOINTS[1],
        "SYN retransmitted"
    );
    assert_eq!(datapath.counter(Counter::NewConnection), 2);
    let original = datapath
        .conntrack(&ct_key(Proto::Tcp, POD, CLUSTER_IP))
        .unwrap();
    assert_eq!(rewrite_of(&original), (POD, ENDPOINTS[1]));
    assert_eq!(original.state, tcp::SYN_SENT);
    let out = datapath.translate(&TcpFlow::syn_ack(ENDPOINTS[1]));
    assert_eq!((out.src, out.dst), (CLUSTER_IP, POD), "its reply");
}

/// A UDP flow is a stream (udp-timeout-stream) once the client sends again after a reply.
#[test]
fn udp_flow_becomes_a_stream_after_a_reply_and_more() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let request = Packet::new(Proto::Udp, POD, CLUSTER_IP);
    let backend = datapath.translate(&request).dst;
    let state = || {
        datapath
            .conntrack(&ct_key(Proto::Udp, POD, CLUSTER_IP))
            .unwrap()
            .state
    };
    assert_eq!(state(), CT_UDP_UNREPLIED);
    datapath.translate(&request);
    assert_eq!(state(), CT_UDP_UNREPLIED);
    datapath.translate(&Packet::new(Proto::Udp, backend, POD));
    assert_eq!(state(), CT_UDP_REPLIED);
    datapath.translate(&request);
    assert_eq!(state(), CT_UDP_STREAM);
    let reply_entry = datapath
        .conntrack(&ct_key(Proto::Udp, backend, POD))
        .unwrap();
    assert_eq!(reply_entry.state, CT_UDP_STREAM);
}

#[test]
fn cluster_ip_udp_from_pod() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let first = Packet::new(Proto::Udp, POD, CLUSTER_IP);
    let out = datapath.translate(&first);
    assert_eq!(out.src, POD);
    let backend = out.dst;
    assert!(ENDPOINTS.contains(&backend));
    assert_ne!(out.udp_checksum, Some(0));
    let reply = datapath
        .conntrack(&ct_key(Proto::Udp, backend, POD))
        .unwrap();
    assert_eq!(rewrite_of(&reply), (CLUSTER_IP, POD));
    for _ in 0..5 {
        assert_eq!(datapath.translate(&first).dst, backend);
    }
    let out = datapath.translate(&Packet::new(Proto::Udp, backend, POD));
    assert_eq!((out.src, out.dst), (CLUSTER_IP, POD));
    assert_eq!(datapath.counter(Counter::NewConnection), 1);
    assert_eq!(datapath.counter(Counter::Translated), 6);
}

#[test]
fn zero_udp_checksum_stays_zero() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let request = Packet {
        zero_udp_checksum: true,
        ..Packet::new(Proto::Udp, POD, CLUSTER_IP)
    };
    let out = datapath.translate(&request);
    assert!(ENDPOINTS.contains(&out.dst));
    assert_eq!(out.udp_checksum, Some(0));
    let reply = Packet {
        zero_udp_checksum: true,
        ..Packet::new(Proto::Udp, out.dst, POD)
    };
    let out = datapath.translate(&reply);
    assert_eq!((out.src, out.udp_checksum), (CLUSTER_IP, Some(0)));
}

/// `client` reaches `frontend`, served by `endpoint` only: the backend must see the connection
/// from the node address and a port of the SNAT range, and its reply must reach the client from
/// the frontend.
fn assert_masqueraded(
    datapath: &Datapath,
    client: SocketAddrV4,
    frontend: SocketAddrV4,
    endpoint: SocketAddrV4,
) {
    let out = datapath.translate(&Packet::new(Proto::Tcp, client, frontend));
    assert_eq!(*out.src.ip(), NODE, "masqueraded to the node");
    assert!((SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&out.src.port()));
    assert_eq!(out.dst, endpoint);
    let reply_key = ct_key(Proto::Tcp, endpoint, out.src);
    let reply = datapath.conntrack(&reply_key).unwrap();
    assert_eq!(reply.flags, CT_F_REPLY | CT_F_MASQUERADE);
    let original = datapath
        .conntrack(&ct_key(Proto::Tcp, client, frontend))
        .unwrap();
    assert_eq!(original.flags, CT_F_MASQUERADE);

    let back = datapath.translate(&Packet::new(Proto::Tcp, endpoint, out.src));
    assert_eq!((back.src, back.dst), (frontend, client));
    assert_eq!(datapath.counter(Counter::Masqueraded), 1);
    assert_eq!(datapath.counter(Counter::Translated), 1);
}

#[test]
fn hairpin_is_masqueraded() {
    let datapath = Datapath::with_cluster_ip(&[ENDPOINTS[0]]);
    let client = SocketAddrV4::new(*ENDPOINTS[0].ip(), 40000);
    assert_masqueraded(&datapath, client, CLUSTER_IP, ENDPOINTS[0]);
}

#[test]
fn source_outside_cluster_cidr_is_masqueraded() {
    let datapath = Datapath::with_cluster_ip(&[ENDPOINTS[1]]);
    assert_masqueraded(&datapath, DOCKER_CONTAINER, CLUSTER_IP, ENDPOINTS[1]);
}

#[test]
fn node_port_is_masqueraded() {
    let mut datapath = Datapath::new(config());
    datapath.service(
        Proto::Tcp,
        NODE_PORT,
        FRONTEND_F_MASQUERADE,
        SERVICE_ID,
        &[ENDPOINTS[2]],
    );
    assert_masqueraded(&datapath, EXTERNAL_CLIENT, NODE_PORT, ENDPOINTS[2]);
}

#[test]
fn masquerade_all_masquerades_pods() {
    let mut datapath = Datapath::new(Config {
        flags: CONFIG_F_READY | CONFIG_F_MASQUERADE_ALL,
        ..config()
    });
    datapath.service(Proto::Tcp, CLUSTER_IP, 0, SERVICE_ID, &[ENDPOINTS[0]]);
    assert_masqueraded(&datapath, POD, CLUSTER_IP, ENDPOINTS[0]);
}

#[test]
fn backends_are_chosen_uniformly() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let mut hits = [0u32; 3];
    for port in 10_000..13_000 {
        let client = SocketAddrV4::new(*POD.ip(), port);
        let out = datapath.translate(&Packet::new(Proto::Tcp, client, CLUSTER_IP));
        hits[ENDPOINTS.iter().position(|e| *e == out.dst).unwrap()] += 1;
    }
    assert!(hits.iter().all(|h| (800..=1200).contains(h)), "{hits:?}");
    assert_eq!(datapath.counter(Counter::NewConnection), 3000);
}

/// sessionAffinity ClientIP: a client's new connections (other source ports) stick to its first
/// backend; other clients still spread; an expired entry, or one whose slot holds another
/// backend now, gives a fresh choice.
#[test]
fn session_affinity_sticks_until_expired_or_moved() {
    let mut datapath = Datapath::new(config());
    datapath.service(Proto::Tcp, CLUSTER_IP, 0, SERVICE_ID, &ENDPOINTS);
    let mut frontends: HashMap<_, FrontendKey, Frontend> = datapath.map(map_name::FRONTENDS);
    let key = FrontendKey {
        addr: ipv4_be(CLUSTER_IP.ip().octets()),
        port: port_be(CLUSTER_IP.port()),
        proto: IPPROTO_TCP,
        _pad: 0,
    };
    let mut frontend = frontends.get(&key, 0).unwrap();
    frontend.affinity_timeout_s = 10;
    frontends.insert(key, frontend, 0).unwrap();

    let connect = |datapath: &Datapath, client: Ipv4Addr, port: u16| {
        let from = SocketAddrV4::new(client, port);
        datapath
            .translate(&Packet::new(Proto::Tcp, from, CLUSTER_IP))
            .dst
    };
    let first = connect(&datapath, *POD.ip(), 10_000);
    for port in 10_001..10_050 {
        assert_eq!(connect(&datapath, *POD.ip(), port), first, "affine");
    }
    let others: std::collections::BTreeSet<_> = (0..60)
        .map(|i| connect(&datapath, Ipv4Addr::new(10, 244, 5, i), 10_000))
        .collect();
    assert_eq!(others.len(), ENDPOINTS.len(), "other clients spread");

    let affinity_key = AffinityKey {
        service_id: SERVICE_ID,
        client_addr: ipv4_be(POD.ip().octets()),
    };
    let entry = |datapath: &Datapath| {
        let map = datapath.ebpf.map(map_name::AFFINITY).unwrap();
        let affinity: HashMap<&MapData, AffinityKey, StickyBackend> = map.try_into().unwrap();
        affinity.get(&affinity_key, 0).unwrap()
    };
    let remembered = entry(&datapath);
    assert_eq!(remembered.backend.addr, ipv4_be(first.ip().octets()));
    assert!(remembered.slot < ENDPOINTS.len() as u32);

    // Expired: some of 40 fresh choices differ from the first (each is 1/3 likely to match).
    let mut changed = false;
    for port in 20_000..20_040 {
        let mut affinity: HashMap<_, AffinityKey, StickyBackend> = datapath.map(map_name::AFFINITY);
        let ancient = StickyBackend {
            last_seen_ns: 1,
            ..remembered
        };
        affinity.insert(affinity_key, ancient, 0).unwrap();
        changed |= connect(&datapath, *POD.ip(), port) != first;
    }
    assert!(changed, "an expired affinity is not used");

    // Moved: the slot the entry names holds another backend now.
    let stale = StickyBackend {
        backend: Backend {
            addr: ipv4_be([10, 244, 9, 9]),
            port: port_be(8080),
            stats_slot: 0,
        },
        ..entry(&datapath)
    };
    let mut affinity: HashMap<_, AffinityKey, StickyBackend> = datapath.map(map_name::AFFINITY);
    affinity.insert(affinity_key, stale, 0).unwrap();
    let fresh = connect(&datapath, *POD.ip(), 30_000);
    assert_ne!(*fresh.ip(), Ipv4Addr::new(10, 244, 9, 9));
    assert_eq!(
        entry(&datapath).backend.addr,
        ipv4_be(fresh.ip().octets()),
        "re-remembered"
    );
}

/// Traffic policy Local: all three endpoints in the Cluster list, ENDPOINTS[0] alone in the
/// Local list of `frontend` with `flags`.
fn local_policy(frontend: SocketAddrV4, flags: u32, local: &[SocketAddrV4]) -> Datapath {
    let mut datapath = Datapath::new(config());
    datapath.service(Proto::Tcp, frontend, flags, SERVICE_ID, &ENDPOINTS);
    let mut backends: HashMap<_, BackendKey, Backend> = datapath.map(map_name::BACKENDS);
    for (i, endpoint) in (0..).zip(local) {
        let backend = Backend {
            addr: ipv4_be(endpoint.ip().octets()),
            port: port_be(endpoint.port()),
            stats_slot: 0,
        };
        let key = BackendKey {
            service_id: SERVICE_ID,
            slot: LOCAL_SLOT | i,
        };
        backends.insert(key, backend, 0).unwrap();
    }
    datapath.frontend(
        Proto::Tcp,
        frontend,
        Frontend {
            service_id: SERVICE_ID,
            backend_count: ENDPOINTS.len() as u32,
            local_count: local.len() as u32,
            flags,
            ..Default::default()
        },
    );
    datapath
}

/// externalTrafficPolicy Local: an external client reaches only the local endpoint and keeps its
/// address; pods are sent over the Cluster list (kube-proxy's short-circuit); without a local
/// endpoint external traffic is dropped, not rejected.
#[test]
fn external_traffic_policy_local() {
    let flags = FRONTEND_F_LOCAL | FRONTEND_F_PRESERVE_SOURCE;
    let datapath = local_policy(NODE_PORT, flags, &[ENDPOINTS[0]]);
    for port in 50_000..50_020 {
        let client = SocketAddrV4::new(*EXTERNAL_CLIENT.ip(), port);
        let out = datapath.translate(&Packet::new(Proto::Tcp, client, NODE_PORT));
        assert_eq!(
            (out.src, out.dst),
            (client, ENDPOINTS[0]),
            "client address kept"
        );
        let back = datapath.translate(&Packet::new(Proto::Tcp, ENDPOINTS[0], client));
        assert_eq!((back.src, back.dst), (NODE_PORT, client));
    }
    assert_eq!(datapath.counter(Counter::Masqueraded), 0);
    let from_pods: std::collections::BTreeSet<_> = (40_000..40_030)
        .map(|port| {
            let pod = SocketAddrV4::new(*POD.ip(), port);
            let out = datapath.translate(&Packet::new(Proto::Tcp, pod, NODE_PORT));
            assert_eq!(out.src, pod);
            out.dst
        })
        .collect();
    assert!(
        from_pods.len() > 1,
        "pods use the Cluster list: {from_pods:?}"
    );

    let none_here = local_policy(NODE_PORT, flags, &[]);
    let packet = Packet::new(Proto::Tcp, EXTERNAL_CLIENT, NODE_PORT).build();
    assert_eq!(none_here.run(&packet).0, TC_ACT_SHOT);
    assert_eq!(none_here.counter(Counter::DropNoLocalBackend), 1);
    assert_eq!(none_here.counter(Counter::Rejected), 0);
}

/// internalTrafficPolicy Local: pods reach only the local endpoint; none here: dropped.
#[test]
fn internal_traffic_policy_local() {
    let datapath = local_policy(CLUSTER_IP, FRONTEND_F_LOCAL, &[ENDPOINTS[1]]);
    for port in 40_000..40_020 {
        let pod = SocketAddrV4::new(*POD.ip(), port);
        let out = datapath.translate(&Packet::new(Proto::Tcp, pod, CLUSTER_IP));
        assert_eq!((out.src, out.dst), (pod, ENDPOINTS[1]));
    }
    let none_here = local_policy(CLUSTER_IP, FRONTEND_F_LOCAL, &[]);
    let packet = Packet::new(Proto::Tcp, POD, CLUSTER_IP).build();
    assert_eq!(none_here.run(&packet).0, TC_ACT_SHOT);
    assert_eq!(none_here.counter(Counter::DropNoLocalBackend), 1);
}

/// loadBalancerSourceRanges: a LoadBalancer IP with allowed prefixes serves a source inside one
/// (masqueraded, as external traffic with policy Cluster) and drops any other, in tc and XDP,
/// counted and without a conntrack entry.
#[test]
fn source_outside_load_balancer_source_ranges_is_dropped() {
    let lb_ip = SocketAddrV4::new(Ipv4Addr::new(198, 51, 100, 50), 80);
    let mut datapath = Datapath::new(config()).with_xdp();
    datapath.service(
        Proto::Tcp,
        lb_ip,
        FRONTEND_F_MASQUERADE | FRONTEND_F_SOURCE_RANGES,
        SERVICE_ID,
        &ENDPOINTS,
    );
    let mut ranges: LpmTrie<_, SourceRangeKey, u8> = datapath.map(map_name::SOURCE_RANGES);
    let allowed = SourceRangeKey {
        service_id: SERVICE_ID,
        addr: ipv4_be([203, 0, 113, 0]),
    };
    ranges
        .insert(
            &Key::new(SourceRangeKey::SERVICE_ID_BITS + 28, allowed),
            1,
            0,
        )
        .unwrap();

    let inside = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 15), 50_000);
    let out = datapath.translate(&Packet::new(Proto::Tcp, inside, lb_ip));
    assert_eq!(out.src.ip(), &NODE, "masqueraded");
    assert!(ENDPOINTS.contains(&out.dst), "{out:?}");

    let outside = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 16), 50_000);
    let packet = Packet::new(Proto::Tcp, outside, lb_ip).build();
    assert_eq!(datapath.run(&packet).0, TC_ACT_SHOT);
    assert_eq!(datapath.run_xdp(&packet).0, XDP_DROP);
    assert_eq!(datapath.counter(Counter::DropSourceRange), 2);
    assert_eq!(
        datapath.conntrack_len(),
        2,
        "only the allowed connection's two entries"
    );
}

/// Sets the scheduler of the TCP ClusterIP frontend.
fn schedule(datapath: &mut Datapath, scheduler: u32) {
    let mut frontends: HashMap<_, FrontendKey, Frontend> = datapath.map(map_name::FRONTENDS);
    let key = FrontendKey {
        addr: ipv4_be(CLUSTER_IP.ip().octets()),
        port: port_be(CLUSTER_IP.port()),
        proto: IPPROTO_TCP,
        _pad: 0,
    };
    let frontend = frontends.get(&key, 0).unwrap();
    frontends
        .insert(
            key,
            Frontend {
                scheduler,
                ..frontend
            },
            0,
        )
        .unwrap();
}

/// rr: consecutive new connections take the slots in turn. sh: one client address, one
/// backend. Flow hash: the slot is `flow_hash(tuple) % count`, the agent's Maglev table.
#[test]
fn schedulers_pick_slots() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    schedule(&mut datapath, SCHED_ROUND_ROBIN);
    let picks: Vec<_> = (10_000..10_030)
        .map(|port| {
            let client = SocketAddrV4::new(*POD.ip(), port);
            datapath
                .translate(&Packet::new(Proto::Tcp, client, CLUSTER_IP))
                .dst
        })
        .collect();
    for (i, pick) in picks.iter().enumerate() {
        assert_eq!(*pick, picks[i % ENDPOINTS.len()], "round robin: {picks:?}");
    }
    assert_eq!(
        picks[..3]
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        3
    );

    schedule(&mut datapath, SCHED_SOURCE_HASH);
    for client in 1..20u8 {
        let addr = Ipv4Addr::new(10, 244, 6, client);
        let slot = source_hash(ipv4_be(addr.octets())) % ENDPOINTS.len() as u32;
        for port in [20_000, 20_001, 20_002] {
            let out = datapath.translate(&Packet::new(
                Proto::Tcp,
                SocketAddrV4::new(addr, port),
                CLUSTER_IP,
            ));
            assert_eq!(out.dst, ENDPOINTS[slot as usize], "source hash");
        }
    }

    schedule(&mut datapath, SCHED_FLOW_HASH);
    for port in 30_000..30_050 {
        let client = SocketAddrV4::new(*POD.ip(), port);
        let slot = flow_hash(&ct_key(Proto::Tcp, client, CLUSTER_IP)) % ENDPOINTS.len() as u32;
        let out = datapath.translate(&Packet::new(Proto::Tcp, client, CLUSTER_IP));
        assert_eq!(out.dst, ENDPOINTS[slot as usize], "flow hash");
    }
}

#[test]
fn non_service_traffic_is_untouched() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let other_addr = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 11), 80);
    let other_port = SocketAddrV4::new(*CLUSTER_IP.ip(), 81);
    let icmp = {
        let mut bytes = Vec::new();
        PacketBuilder::ethernet2(MAC_SRC, MAC_DST)
            .ipv4(POD.ip().octets(), CLUSTER_IP.ip().octets(), 64)
            .icmpv4_echo_request(1, 1)
            .write(&mut bytes, PAYLOAD)
            .unwrap();
        bytes
    };
    let ipv6 = {
        let mut bytes = Vec::new();
        PacketBuilder::ethernet2(MAC_SRC, MAC_DST)
            .ipv6([0xfd; 16], [0xfe; 16], 64)
            .tcp(40000, 80, 1, 65535)
            .write(&mut bytes, PAYLOAD)
            .unwrap();
        bytes
    };
    let arp = {
        let mut bytes = Vec::new();
        let request = ArpPacket::new(
            ArpHardwareId::ETHERNET,
            EtherType::IPV4,
            ArpOperation::REQUEST,
            &MAC_SRC,
            &POD.ip().octets(),
            &[0; 6],
            &CLUSTER_IP.ip().octets(),
        )
        .unwrap();
        PacketBuilder::ethernet2(MAC_SRC, [0xff; 6])
            .arp(request)
            .write(&mut bytes)
            .unwrap();
        bytes
    };
    let packets = [
        Packet::new(Proto::Tcp, POD, other_addr).build(),
        Packet::new(Proto::Tcp, POD, other_port).build(),
        icmp,
        ipv6,
        arp,
    ];
    for packet in &packets {
        datapath.assert_untouched(packet);
    }
    // The IPv6 packet is lb_ingress6's, which this fixture does not load (datapath6.rs does): the
    // tail call to it fails and passes the packet.
    assert_eq!(datapath.counter(Counter::Passed), packets.len() as u64 - 1);
    assert_eq!(datapath.counter(Counter::PassedTailCallFailed), 1);
    assert_eq!(datapath.conntrack_len(), 0);
}

#[test]
fn malformed_packets_are_untouched() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let tcp = Packet::new(Proto::Tcp, POD, CLUSTER_IP).build();
    let udp = Packet::new(Proto::Udp, POD, CLUSTER_IP).build();
    let l4 = ETH_HLEN + 20;
    // Keeps the IP header consistent (total length, checksum) with an L4 header cut to `len`.
    let cut_l4 = |packet: &[u8], len: usize| {
        let mut bytes = packet[..l4 + len].to_vec();
        let (mut ip, _) = Ipv4Header::from_slice(&bytes[ETH_HLEN..]).unwrap();
        ip.total_len = (20 + len) as u16;
        ip.header_checksum = ip.calc_header_checksum();
        bytes[ETH_HLEN..l4].copy_from_slice(&ip.to_bytes());
        bytes
    };
    let with_ip_byte = |index: usize, value: u8| {
        let mut bytes = tcp.clone();
        bytes[ETH_HLEN + index] = value;
        bytes
    };
    let packets = [
        // The kernel refuses test input shorter than Ethernet + a 20-byte IPv4 header, so a
        // truncated IP header is one whose IHL (15: 60 bytes) runs past the packet.
        with_ip_byte(0, 0x4f),
        cut_l4(&tcp, 10),
        cut_l4(&tcp, 0),
        cut_l4(&udp, 4),
        // IHL 4.
        with_ip_byte(0, 0x44),
        // Version 5.
        with_ip_byte(0, 0x55),
        // Total length above the frame's.
        with_ip_byte(2, 0x10),
        // Total length below the header's.
        {
            let mut bytes = with_ip_byte(2, 0);
            bytes[ETH_HLEN + 3] = 16;
            bytes
        },
    ];
    for packet in &packets {
        datapath.assert_untouched(packet);
    }
    assert_eq!(
        datapath.counter(Counter::PassedUnparsed),
        packets.len() as u64
    );
    assert_eq!(datapath.conntrack_len(), 0);
}

#[test]
fn ip_options_use_the_right_l4_offset() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    for proto in [Proto::Tcp, Proto::Udp] {
        let request = Packet {
            ip_options: &ROUTER_ALERT,
            ..Packet::new(proto, POD, CLUSTER_IP)
        };
        assert_eq!(request.build()[ETH_HLEN] & 0x0f, 6, "IHL");
        let out = datapath.translate(&request);
        assert!(ENDPOINTS.contains(&out.dst), "{proto:?}: {out:?}");
        assert_eq!(out.src, POD);
        let reply = Packet {
            ip_options: &ROUTER_ALERT,
            ..Packet::new(proto, out.dst, POD)
        };
        let back = datapath.translate(&reply);
        assert_eq!((back.src, back.dst), (CLUSTER_IP, POD));
    }
}

/// A UDP datagram from `src` to `dst` with a `len`-byte payload (valid checksum), cut into IPv4
/// fragments of `chunk` bytes of it (a multiple of 8), all with IP ID `id`.
fn udp_fragments(
    src: SocketAddrV4,
    dst: SocketAddrV4,
    id: u16,
    len: usize,
    chunk: usize,
) -> Vec<Vec<u8>> {
    let payload: Vec<u8> = (0..len).map(|i| i as u8).collect();
    let mut whole = Vec::new();
    PacketBuilder::ethernet2(MAC_SRC, MAC_DST)
        .ipv4(src.ip().octets(), dst.ip().octets(), 64)
        .udp(src.port(), dst.port())
        .write(&mut whole, &payload)
        .unwrap();
    let datagram = &whole[ETH_HLEN + 20..];
    (0..)
        .zip(datagram.chunks(chunk))
        .map(|(i, part)| {
            let mut ip = Ipv4Header::new(
                part.len() as u16,
                64,
                IpNumber::UDP,
                src.ip().octets(),
                dst.ip().octets(),
            )
            .unwrap();
            ip.identification = id;
            ip.fragment_offset = ((i * chunk / 8) as u16).try_into().unwrap();
            ip.more_fragments = (i + 1) * chunk < datagram.len();
            ip.header_checksum = ip.calc_header_checksum();
            let mut bytes = whole[..ETH_HLEN].to_vec();
            bytes.extend(ip.to_bytes());
            bytes.extend(part);
            bytes
        })
        .collect()
}

impl Datapath {
    /// Runs the fragments of one UDP datagram, which must all be translated alike: each keeps its
    /// IP ID, fragment fields, length and (after the first) payload, with a valid IPv4 checksum;
    /// the datagram they make up has a valid UDP checksum and its payload. Returns its new
    /// addresses.
    fn translate_fragments(&self, fragments: &[Vec<u8>]) -> (SocketAddrV4, SocketAddrV4) {
        let mut addrs = None;
        let mut datagram = Vec::new();
        for (i, input) in fragments.iter().enumerate() {
            let (verdict, output) = self.run(input);
            assert!(
                verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
                "fragment {i}: verdict {verdict}"
            );
            assert_eq!(output.len(), input.len(), "fragment {i}");
            let (ip_in, payload_in) = Ipv4Header::from_slice(&input[ETH_HLEN..]).unwrap();
            let (ip, payload) = Ipv4Header::from_slice(&output[ETH_HLEN..]).unwrap();
            assert_eq!(
                ip.calc_header_checksum(),
                ip.header_checksum,
                "fragment {i}"
            );
            assert_eq!(
                (ip.identification, ip.fragment_offset, ip.more_fragments),
                (
                    ip_in.identification,
                    ip_in.fragment_offset,
                    ip_in.more_fragments
                ),
                "fragment {i}"
            );
            if i > 0 {
                assert_eq!(payload, payload_in, "fragment {i}: payload only");
            }
            let these = (ip.source, ip.destination);
            assert_eq!(*addrs.get_or_insert(these), these, "fragment {i}");
            datagram.extend_from_slice(payload);
        }
        let (src, dst) = addrs.unwrap();
        let mut pseudo = [src, dst].concat();
        pseudo.extend([0, IPPROTO_UDP]);
        pseudo.extend((datagram.len() as u16).to_be_bytes());
        pseudo.extend(&datagram);
        assert!(checksum_ok(&pseudo), "UDP checksum of the datagram");
        let (udp, payload) = UdpHeader::from_slice(&datagram).unwrap();
        assert!(payload.iter().enumerate().all(|(i, &b)| b == i as u8));
        (
            SocketAddrV4::new(src.into(), udp.source_port),
            SocketAddrV4::new(dst.into(), udp.destination_port),
        )
    }
}

/// A fragmented UDP datagram to a service (a ClusterIP from a pod; a NodePort from outside,
/// masqueraded): all its fragments reach the endpoint its first fragment chose, and the
/// endpoint's fragmented reply goes back to the client. Fragments take the stack's path in both
/// forwarding modes (main.rs): here, at tc ingress, they get their intermediate tuples (the
/// destination translated); lb_egress translates the source once the stack has forwarded them.
#[test]
fn fragments_follow_their_first_fragment() {
    for (client, frontend, flags) in [
        (POD, CLUSTER_IP, 0),
        (EXTERNAL_CLIENT, NODE_PORT, FRONTEND_F_MASQUERADE),
    ] {
        let mut datapath = Datapath::new(config());
        datapath.service(Proto::Udp, frontend, flags, SERVICE_ID, &ENDPOINTS);
        let request = udp_fragments(client, frontend, 0x1234, 3000, 1480);
        assert_eq!(request.len(), 3);
        let (src, dst) = datapath.translate_fragments(&request);
        let tracked = datapath
            .conntrack(&ct_key(Proto::Udp, client, frontend))
            .unwrap();
        let (translated_src, translated_dst) = rewrite_of(&tracked);
        assert!(ENDPOINTS.contains(&dst), "{dst}");
        assert_eq!(translated_dst, dst);
        if flags & FRONTEND_F_MASQUERADE != 0 {
            assert_eq!(*translated_src.ip(), NODE);
        } else {
            assert_eq!(translated_src, client);
        }
        // The client's address with the port the endpoint sees: lb_egress translates the rest.
        let intermediate_client = SocketAddrV4::new(*client.ip(), translated_src.port());
        assert_eq!(src, intermediate_client);
        let reply = udp_fragments(dst, translated_src, 0x4321, 3000, 1480);
        assert_eq!(
            datapath.translate_fragments(&reply),
            (dst, intermediate_client)
        );
        assert_eq!(datapath.counter(Counter::NewConnection), 1);
        assert_eq!(datapath.counter(Counter::Translated), 5);
        assert_eq!(datapath.counter(Counter::PassedFragment), 0);
    }
}

/// A later fragment whose first was not translated passes untouched, counted: one that arrives
/// before its first, and those of a datagram between pods.
#[test]
fn later_fragments_without_a_translated_first_pass_untouched() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let early = udp_fragments(POD, CLUSTER_IP, 7, 3000, 1480);
    datapath.assert_untouched(&early[1]);
    for fragment in udp_fragments(POD, ENDPOINTS[0], 8, 3000, 1480) {
        datapath.assert_untouched(&fragment);
    }
    assert_eq!(datapath.counter(Counter::PassedFragment), 3);
    assert_eq!(datapath.counter(Counter::Passed), 1);
    assert_eq!(datapath.conntrack_len(), 0);
}

/// `bytes` (an Ethernet + IPv4 frame) with its IPv4 header checksum computed again.
fn fix_ip_checksum(bytes: &mut [u8]) {
    let (mut ip, _) = Ipv4Header::from_slice(&bytes[ETH_HLEN..]).unwrap();
    ip.header_checksum = ip.calc_header_checksum();
    let len = ip.header_len();
    bytes[ETH_HLEN..ETH_HLEN + len].copy_from_slice(&ip.to_bytes());
}

/// The malformed variants of `packet` (IPv4 header without options) that Linux's IP input or
/// conntrack holds invalid, each with the counter and tc verdict it must get.
fn malformed(packet: &Packet) -> Vec<(&'static str, Vec<u8>, Counter, u32)> {
    let l4 = ETH_HLEN + 20;
    let edit = |change: &dyn Fn(&mut Vec<u8>)| {
        let mut bytes = packet.build();
        change(&mut bytes);
        fix_ip_checksum(&mut bytes);
        bytes
    };
    let mut bad_checksum = packet.build();
    bad_checksum[ETH_HLEN + 10] ^= 0x01;
    let mut cases = vec![(
        "bad IPv4 header checksum",
        bad_checksum,
        Counter::PassedBadIpChecksum,
        TC_ACT_OK,
    )];
    let segment_len = 20 + PAYLOAD.len();
    match packet.proto {
        Proto::Tcp => {
            let data_offset = |words: u8| edit(&|b| b[l4 + 12] = words << 4);
            let flags = |flags: u8| edit(&|b| b[l4 + 13] = flags);
            let beyond = (segment_len / 4 + 1) as u8;
            cases.extend(
                [
                    (
                        "TCP data offset 4",
                        data_offset(4),
                        Counter::DropBadTcpHeader,
                    ),
                    (
                        "TCP data offset 0",
                        data_offset(0),
                        Counter::DropBadTcpHeader,
                    ),
                    (
                        "TCP data offset beyond the segment",
                        data_offset(beyond),
                        Counter::DropBadTcpHeader,
                    ),
                    ("SYN+FIN", flags(0x03), Counter::DropBadTcpFlags),
                    ("SYN+FIN+ACK", flags(0x13), Counter::DropBadTcpFlags),
                    ("null", flags(0), Counter::DropBadTcpFlags),
                    (
                        "xmas (FIN, PSH, URG)",
                        flags(0x29),
                        Counter::DropBadTcpFlags,
                    ),
                    ("FIN without ACK", flags(0x01), Counter::DropBadTcpFlags),
                    ("SYN+RST", flags(0x06), Counter::DropBadTcpFlags),
                ]
                .map(|(name, bytes, counter)| (name, bytes, counter, TC_ACT_SHOT)),
            );
        }
        Proto::Udp => {
            let udp_len =
                |len: u16| edit(&|b| b[l4 + 4..l4 + 6].copy_from_slice(&len.to_be_bytes()));
            cases.extend(
                [
                    ("UDP length 7", udp_len(7), Counter::DropBadUdpLength),
                    ("UDP length 0", udp_len(0), Counter::DropBadUdpLength),
                    (
                        "UDP length beyond the payload",
                        udp_len((8 + PAYLOAD.len() + 1) as u16),
                        Counter::DropBadUdpLength,
                    ),
                ]
                .map(|(name, bytes, counter)| (name, bytes, counter, TC_ACT_SHOT)),
            );
        }
    }
    cases
}

impl Datapath {
    /// Runs `bytes`, which must be neither translated nor tracked: `verdict` with the packet
    /// unchanged, the conntrack table as it was, `counter` moved by one, nothing translated.
    fn assert_refused(&self, name: &str, bytes: &[u8], counter: Counter, verdict: u32) {
        let entries = self.conntrack_entries();
        let translated = self.counter(Counter::Translated) + self.counter(Counter::NewConnection);
        let count = self.counter(counter);
        let (got, output) = self.run(bytes);
        assert_eq!(got, verdict, "{name}: verdict");
        assert_eq!(output, bytes, "{name}: untouched");
        assert_eq!(self.conntrack_entries(), entries, "{name}: conntrack");
        assert_eq!(
            self.counter(Counter::Translated) + self.counter(Counter::NewConnection),
            translated,
            "{name}: not translated"
        );
        assert_eq!(self.counter(counter), count + 1, "{name}: {counter:?}");
    }

    fn conntrack_entries(&self) -> Vec<(ConntrackKey, ConntrackEntry)> {
        let mut entries: Vec<_> = [map_name::CONNTRACK, map_name::CONNTRACK_UNCONFIRMED]
            .into_iter()
            .flat_map(|name| {
                let map = self.ebpf.map(name).unwrap();
                let conntrack: HashMap<&MapData, ConntrackKey, ConntrackEntry> =
                    map.try_into().unwrap();
                conntrack.iter().map(Result::unwrap).collect::<Vec<_>>()
            })
            .collect();
        entries.sort_by_key(|(k, _)| (k.src_addr, k.dst_addr, k.src_port, k.dst_port, k.proto));
        entries
    }
}

/// Malformed packets to a frontend open no connection: no conntrack entry, no masquerade port
/// (a NodePort, masqueraded), counted by reason; a bad IPv4 header checksum passes to the stack,
/// which drops it (ip_rcv), the rest are dropped (the stack would forward them to a ClusterIP
/// untranslated, where kube-proxy's `ctstate INVALID` rule drops them).
#[test]
fn malformed_packets_to_a_frontend_open_no_connection() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    for proto in [Proto::Tcp, Proto::Udp] {
        let flags = FRONTEND_F_MASQUERADE;
        datapath.service(proto, NODE_PORT, flags, SERVICE_ID + 1, &ENDPOINTS);
    }
    for proto in [Proto::Tcp, Proto::Udp] {
        for (client, frontend) in [(POD, CLUSTER_IP), (EXTERNAL_CLIENT, NODE_PORT)] {
            let request = Packet {
                tcp_syn: true,
                ..Packet::new(proto, client, frontend)
            };
            for (name, bytes, counter, verdict) in malformed(&request) {
                datapath.assert_refused(name, &bytes, counter, verdict);
            }
        }
    }
    assert_eq!(datapath.conntrack_len(), 0);
    assert_eq!(datapath.counter(Counter::Masqueraded), 0);
    // The well-formed request still opens its connection.
    datapath.translate(&Packet::new(Proto::Tcp, POD, CLUSTER_IP));
    assert_eq!(datapath.conntrack_len(), 2);
}

/// Malformed packets of a tracked connection, either direction, are not translated and leave
/// its entries as they were (a SYN+FIN or FIN without ACK does not close it).
#[test]
fn malformed_packets_of_a_connection_leave_it_alone() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    for proto in [Proto::Tcp, Proto::Udp] {
        let request = Packet::new(proto, POD, CLUSTER_IP);
        let backend = datapath.translate(&request).dst;
        let reply = Packet::new(proto, backend, POD);
        datapath.translate(&reply);
        for packet in [request, reply] {
            for (name, bytes, counter, verdict) in malformed(&packet) {
                datapath.assert_refused(name, &bytes, counter, verdict);
            }
        }
        let entry = datapath.conntrack(&ct_key(proto, POD, CLUSTER_IP)).unwrap();
        let replied = match proto {
            Proto::Tcp => tcp::ESTABLISHED,
            Proto::Udp => CT_UDP_REPLIED,
        };
        assert_eq!(entry.state, replied, "{proto:?}");
    }
    assert_eq!(datapath.conntrack_len(), 4);
}

/// lb_xdp applies the same checks: a bad IPv4 header checksum goes to the stack (and tc), the
/// rest are dropped, counted by reason; nothing is tracked.
#[test]
fn xdp_refuses_malformed_packets() {
    let mut datapath = Datapath::new(config()).with_xdp();
    for proto in [Proto::Tcp, Proto::Udp] {
        let flags = FRONTEND_F_MASQUERADE;
        datapath.service(proto, NODE_PORT, flags, SERVICE_ID, &ENDPOINTS);
        let request = Packet {
            tcp_syn: true,
            ..Packet::new(proto, EXTERNAL_CLIENT, NODE_PORT)
        };
        for (name, bytes, counter, verdict) in malformed(&request) {
            let (xdp_verdict, output) = datapath.run_xdp(&bytes);
            assert_eq!(output, bytes, "{name}: untouched");
            if verdict == TC_ACT_OK {
                assert_eq!(xdp_verdict, XDP_PASS, "{name}");
                datapath.assert_refused(name, &bytes, counter, verdict);
            } else {
                assert_eq!(xdp_verdict, XDP_DROP, "{name}");
            }
        }
    }
    assert_eq!(datapath.conntrack_len(), 0);
    assert_eq!(datapath.counter(Counter::NewConnection), 0);
    assert_eq!(datapath.counter(Counter::XdpPassed), 2);
    assert_eq!(datapath.counter(Counter::DropBadTcpHeader), 3);
    assert_eq!(datapath.counter(Counter::DropBadTcpFlags), 6);
    assert_eq!(datapath.counter(Counter::DropBadUdpLength), 3);
}

/// Fragments that overlap their datagram's first fragment are dropped, as Linux's reassembly
/// discards the datagram: a second first fragment with other ports opens no connection, and a
/// later fragment starting inside the first (which could rewrite the header it was tracked
/// with) is not translated. Exact duplicates of a first fragment are translated alike.
#[test]
fn fragments_overlapping_their_first_are_dropped() {
    let mut datapath = Datapath::new(config());
    let flags = FRONTEND_F_MASQUERADE;
    datapath.service(Proto::Udp, NODE_PORT, flags, SERVICE_ID, &ENDPOINTS);
    let request = udp_fragments(EXTERNAL_CLIENT, NODE_PORT, 0x1234, 3000, 1480);
    let (verdict, first) = datapath.run(&request[0]);
    assert!(verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT);
    assert_eq!(datapath.conntrack_len(), 2);
    let (_, again) = datapath.run(&request[0]);
    assert_eq!(again, first, "a duplicate");

    let mut other_ports = request[0].clone();
    let src_port = ETH_HLEN + 20;
    other_ports[src_port..src_port + 2].copy_from_slice(&50_001u16.to_be_bytes());
    datapath.assert_refused(
        "a first fragment with other ports",
        &other_ports,
        Counter::DropFragmentOverlap,
        TC_ACT_SHOT,
    );
    let mut longer = udp_fragments(EXTERNAL_CLIENT, NODE_PORT, 0x1234, 3000, 1488)[0].clone();
    fix_ip_checksum(&mut longer);
    datapath.assert_refused(
        "a longer first fragment",
        &longer,
        Counter::DropFragmentOverlap,
        TC_ACT_SHOT,
    );
    // The second fragment moved 8 bytes back, into the first (its UDP header's end).
    let mut inside = request[1].clone();
    inside[ETH_HLEN + 6..ETH_HLEN + 8].copy_from_slice(&(0x2000u16 | (1480 / 8 - 1)).to_be_bytes());
    fix_ip_checksum(&mut inside);
    datapath.assert_refused(
        "a later fragment inside the first",
        &inside,
        Counter::DropFragmentOverlap,
        TC_ACT_SHOT,
    );
    let mut at_the_start = request[1].clone();
    at_the_start[ETH_HLEN + 6..ETH_HLEN + 8].copy_from_slice(&0x2001u16.to_be_bytes());
    fix_ip_checksum(&mut at_the_start);
    datapath.assert_refused(
        "a later fragment over the UDP header",
        &at_the_start,
        Counter::DropFragmentOverlap,
        TC_ACT_SHOT,
    );
    // The datagram's own fragments still follow their first.
    for fragment in &request[1..] {
        let (verdict, output) = datapath.run(fragment);
        assert!(verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT);
        assert_ne!(
            output[ETH_HLEN + 16..ETH_HLEN + 20],
            fragment[ETH_HLEN + 16..ETH_HLEN + 20]
        );
    }
    assert_eq!(datapath.counter(Counter::NewConnection), 1);
    assert_eq!(datapath.conntrack_len(), 2);
}

#[test]
fn ttl_one_goes_to_the_stack_untranslated() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let packet = Packet {
        ttl: 1,
        ..Packet::new(Proto::Tcp, POD, CLUSTER_IP)
    };
    datapath.assert_untouched(&packet.build());
    assert_eq!(datapath.counter(Counter::NewConnection), 0);
    assert_eq!(datapath.conntrack_len(), 0);
}

/// The 16-bit ones' complement sum of `bytes` is all ones: the checksum over them is valid.
fn checksum_ok(bytes: &[u8]) -> bool {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum == 0xffff
}

/// `output` is the ICMP port unreachable about `input`, bounced back to its sender: MACs
/// swapped, from the address the client tried, the original IP header and 8 bytes quoted,
/// both checksums valid.
fn assert_port_unreachable(input: &[u8], verdict: u32, output: &[u8]) {
    assert_eq!(verdict, TC_ACT_REDIRECT, "sent back out");
    assert_eq!(output[..6], input[6..12], "to the sender's MAC");
    assert_eq!(output[6..12], input[..6], "from the MAC it was sent to");
    let (ip_in, _) = Ipv4Header::from_slice(&input[ETH_HLEN..]).unwrap();
    let (ip, icmp) = Ipv4Header::from_slice(&output[ETH_HLEN..]).unwrap();
    assert_eq!(
        ip.calc_header_checksum(),
        ip.header_checksum,
        "IPv4 checksum"
    );
    assert_eq!(ip.protocol, IpNumber::ICMP);
    assert_eq!(
        (ip.source, ip.destination),
        (ip_in.destination, ip_in.source)
    );
    let quote_len = ip_in.header_len() + 8;
    assert_eq!(usize::from(ip.total_len), 20 + 8 + quote_len);
    assert_eq!(
        output.len(),
        ETH_HLEN + usize::from(ip.total_len),
        "trimmed"
    );
    assert_eq!(
        icmp[..2],
        [3, 3],
        "destination unreachable, port unreachable"
    );
    assert_eq!(icmp[4..8], [0; 4]);
    assert_eq!(icmp[8..], input[ETH_HLEN..ETH_HLEN + quote_len], "quote");
    assert!(checksum_ok(icmp), "ICMP checksum");
}

#[test]
fn service_without_backends_rejects() {
    let datapath = Datapath::with_cluster_ip(&[]);
    let packets = [
        Packet::new(Proto::Tcp, POD, CLUSTER_IP),
        Packet::new(Proto::Udp, POD, CLUSTER_IP),
        Packet {
            ip_options: &ROUTER_ALERT,
            ..Packet::new(Proto::Udp, POD, CLUSTER_IP)
        },
    ];
    for packet in &packets {
        let input = packet.build();
        let (verdict, output) = datapath.run(&input);
        assert_port_unreachable(&input, verdict, &output);
    }
    assert_eq!(datapath.counter(Counter::Rejected), packets.len() as u64);
    assert_eq!(datapath.counter(Counter::NewConnection), 0);
    assert_eq!(datapath.conntrack_len(), 0);
}

/// A ClusterIP's catch-all frontend rejects the ports the service does not define; without one
/// (any other address) the packet is not ours.
#[test]
fn undefined_cluster_ip_port_rejects() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let mut frontends: HashMap<_, FrontendKey, Frontend> = datapath.map(map_name::FRONTENDS);
    frontends
        .insert(
            FrontendKey::any_port(ipv4_be(CLUSTER_IP.ip().octets())),
            Frontend::default(),
            0,
        )
        .unwrap();
    for proto in [Proto::Tcp, Proto::Udp] {
        let input = Packet::new(proto, POD, SocketAddrV4::new(*CLUSTER_IP.ip(), 81)).build();
        let (verdict, output) = datapath.run(&input);
        assert_port_unreachable(&input, verdict, &output);
    }
    assert!(
        ENDPOINTS.contains(
            &datapath
                .translate(&Packet::new(Proto::Tcp, POD, CLUSTER_IP))
                .dst
        )
    );
    let elsewhere = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 99), 81);
    datapath.assert_untouched(&Packet::new(Proto::Tcp, POD, elsewhere).build());
    assert_eq!(datapath.counter(Counter::Rejected), 2);
}

#[test]
fn missing_backend_slot_drops() {
    let mut datapath = Datapath::new(config());
    let packet = Packet::new(Proto::Tcp, POD, CLUSTER_IP).build();
    // A count that claims a slot the agent has not written yet.
    let frontend = Frontend {
        service_id: SERVICE_ID,
        backend_count: 1,
        ..Default::default()
    };
    datapath.frontend(Proto::Tcp, CLUSTER_IP, frontend);
    assert_eq!(datapath.run(&packet).0, TC_ACT_SHOT);
    assert_eq!(datapath.counter(Counter::DropNoBackend), 1);
    assert_eq!(datapath.conntrack_len(), 0);
}

#[test]
fn config_not_ready_passes_everything() {
    let mut datapath = Datapath::new(Config {
        flags: 0,
        ..config()
    });
    datapath.service(Proto::Tcp, CLUSTER_IP, 0, SERVICE_ID, &ENDPOINTS);
    datapath.assert_untouched(&Packet::new(Proto::Tcp, POD, CLUSTER_IP).build());
    assert_eq!(datapath.counter(Counter::NewConnection), 0);
    assert_eq!(datapath.conntrack_len(), 0);
}

#[test]
fn snat_ports_exhausted_drops() {
    let mut datapath = Datapath::new(Config {
        snat_port_min: 62_000,
        snat_port_max: 62_000,
        ..config()
    });
    datapath.service(Proto::Tcp, CLUSTER_IP, 0, SERVICE_ID, &[ENDPOINTS[0]]);
    let out = datapath.translate(&Packet::new(Proto::Tcp, DOCKER_CONTAINER, CLUSTER_IP));
    assert_eq!(out.src, SocketAddrV4::new(NODE, 62_000));
    // Established: an unconfirmed holder would give way (`an_unconfirmed_holder_gives_way`).
    datapath.confirm_all();

    let second = SocketAddrV4::new(*DOCKER_CONTAINER.ip(), 40001);
    let packet = Packet::new(Proto::Tcp, second, CLUSTER_IP).build();
    assert_eq!(datapath.run(&packet).0, TC_ACT_SHOT);
    assert_eq!(datapath.counter(Counter::DropSnatPortsExhausted), 1);
    assert_eq!(datapath.counter(Counter::NewConnection), 1);
    assert!(
        datapath
            .conntrack(&ct_key(Proto::Tcp, second, CLUSTER_IP))
            .is_none()
    );
}

/// The only masquerade port is held by a connection whose handshake is not complete (a flood's
/// half-open SYN): a new connection takes it over (early drop), both of the holder's entries
/// go.
#[test]
fn an_unconfirmed_holder_gives_way() {
    let mut datapath = Datapath::new(Config {
        snat_port_min: 62_000,
        snat_port_max: 62_000,
        ..config()
    });
    datapath.service(Proto::Tcp, CLUSTER_IP, 0, SERVICE_ID, &[ENDPOINTS[0]]);
    let out = datapath.translate(&Packet::new(Proto::Tcp, DOCKER_CONTAINER, CLUSTER_IP));
    assert_eq!(out.src, SocketAddrV4::new(NODE, 62_000));

    let second = SocketAddrV4::new(*DOCKER_CONTAINER.ip(), 40001);
    let taken = datapath.translate(&Packet::new(Proto::Tcp, second, CLUSTER_IP));
    assert_eq!(taken.src, SocketAddrV4::new(NODE, 62_000));
    assert_eq!(datapath.counter(Counter::ConntrackEarlyDrop), 1);
    assert_eq!(datapath.counter(Counter::DropSnatPortsExhausted), 0);
    assert!(
        datapath
            .conntrack(&ct_key(Proto::Tcp, DOCKER_CONTAINER, CLUSTER_IP))
            .is_none(),
        "the holder's original entry goes with it"
    );
    assert_eq!(datapath.conntrack_len(), 2);
}

/// The datapath's size of the conntrack map (`Datapath::new`).
const CONNTRACK_MAX: u32 = 16_384;

/// Runs the rest of the calling thread on `cpu`.
fn pin_to_cpu(cpu: usize) {
    let mut cpus = nix::sched::CpuSet::new();
    cpus.set(cpu).unwrap();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &cpus).unwrap();
}

/// New connections probing the one masquerade port, which a live connection holds, in a full
/// conntrack map: each is dropped, and no live entry is evicted for them. An insert into a full
/// LRU map evicts an entry whether or not it succeeds, so the allocator must look before it
/// inserts. The probes run on another CPU than the fill, whose LRU free list is empty.
#[test]
fn probing_a_held_port_evicts_no_live_connection() {
    let mut datapath = Datapath::new(Config {
        snat_port_min: 62_000,
        snat_port_max: 62_000,
        ..config()
    });
    datapath.service(Proto::Tcp, CLUSTER_IP, 0, SERVICE_ID, &[ENDPOINTS[0]]);
    let probing_cpu =
        usize::from(std::thread::available_parallelism().is_ok_and(|cpus| cpus.get() > 1));
    pin_to_cpu(0);
    let now = monotonic_ns();
    let mut conntrack: HashMap<_, ConntrackKey, ConntrackEntry> = datapath.map(map_name::CONNTRACK);
    for i in 0..CONNTRACK_MAX + 1_000 {
        let [_, _, hi, lo] = i.to_be_bytes();
        let client = SocketAddrV4::new(Ipv4Addr::new(198, 51, hi, lo), 5353);
        let live = ConntrackEntry {
            last_seen_ns: now,
            state: CT_UDP_UNREPLIED,
            ..Default::default()
        };
        conntrack
            .insert(ct_key(Proto::Udp, client, CLUSTER_IP), live, 0)
            .unwrap();
    }
    let holder = datapath.translate(&Packet::new(Proto::Tcp, DOCKER_CONTAINER, CLUSTER_IP));
    assert_eq!(holder.src, SocketAddrV4::new(NODE, 62_000));
    // Established: an unconfirmed holder would give way to the probes (early drop).
    datapath.confirm_all();
    let conntrack: HashMap<_, ConntrackKey, ConntrackEntry> = datapath.map(map_name::CONNTRACK);
    let live: Vec<ConntrackKey> = conntrack.keys().map(Result::unwrap).collect();

    pin_to_cpu(probing_cpu);
    const PROBES: u16 = 200;
    for i in 0..PROBES {
        let client = SocketAddrV4::new(*DOCKER_CONTAINER.ip(), 40_001 + i);
        let packet = Packet::new(Proto::Tcp, client, CLUSTER_IP).build();
        assert_eq!(datapath.run(&packet).0, TC_ACT_SHOT);
    }
    assert_eq!(
        datapath.counter(Counter::DropSnatPortsExhausted),
        u64::from(PROBES)
    );
    let conntrack: HashMap<_, ConntrackKey, ConntrackEntry> = datapath.map(map_name::CONNTRACK);
    let evicted = live
        .iter()
        .filter(|key| conntrack.get(key, 0).is_err())
        .count();
    assert_eq!(evicted, 0, "live entries evicted by the probes");
}

#[test]
fn expired_entry_is_replaced() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let gone = SocketAddrV4::new(Ipv4Addr::new(10, 244, 9, 9), 9999);
    let key = ct_key(Proto::Tcp, POD, CLUSTER_IP);
    let ancient = ConntrackEntry {
        last_seen_ns: 1,
        src_addr: key.src_addr,
        dst_addr: ipv4_be(gone.ip().octets()),
        src_port: key.src_port,
        dst_port: port_be(gone.port()),
        service_id: SERVICE_ID,
        state: tcp::SYN_SENT,
        flags: 0,
        ..Default::default()
    };
    assert!(
        uptime_s() > u64::from(tcp_timeout_s::SYN_SENT),
        "the machine must be up longer than the timeout for last_seen 1 to be ancient"
    );
    let mut conntrack: HashMap<_, ConntrackKey, ConntrackEntry> = datapath.map(map_name::CONNTRACK);
    conntrack.insert(key, ancient, 0).unwrap();

    let out = datapath.translate(&Packet::new(Proto::Tcp, POD, CLUSTER_IP));
    assert!(ENDPOINTS.contains(&out.dst), "a new selection: {out:?}");
    let entry = datapath.conntrack(&key).unwrap();
    assert_eq!(rewrite_of(&entry), (POD, out.dst));
    assert_eq!(entry.state, tcp::ESTABLISHED);
    assert!(entry.last_seen_ns > 1);
    assert_eq!(datapath.counter(Counter::NewConnection), 1);
    assert_eq!(datapath.counter(Counter::Translated), 0);
}

const OTHER_CLUSTER_IP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 11), 80);
const OTHER_SERVICE_ID: u32 = 8;

/// A pod reaches two ClusterIPs whose one endpoint is the same from one source port: both
/// connections translate to the same tuple unless the second gets another source port, as
/// Linux's NAT remaps a clashing null binding. The first connection's entries stay as they
/// were, and each reply comes back from the ClusterIP its connection went to, to the pod's port.
#[test]
fn clashing_translated_tuples_get_a_new_source_port() {
    for proto in [Proto::Tcp, Proto::Udp] {
        let mut datapath = Datapath::new(config());
        datapath.service(proto, CLUSTER_IP, 0, SERVICE_ID, &ENDPOINTS[..1]);
        datapath.service(
            proto,
            OTHER_CLUSTER_IP,
            0,
            OTHER_SERVICE_ID,
            &ENDPOINTS[..1],
        );
        let first = Packet::new(proto, POD, CLUSTER_IP);
        let second = Packet::new(proto, POD, OTHER_CLUSTER_IP);
        let out = datapath.translate(&first);
        assert_eq!((out.src, out.dst), (POD, ENDPOINTS[0]), "{proto:?}");
        let first_entries = [
            ct_key(proto, POD, CLUSTER_IP),
            ct_key(proto, ENDPOINTS[0], POD),
        ]
        .map(|key| datapath.conntrack(&key).unwrap());

        let out = datapath.translate(&second);
        let remapped = out.src;
        assert_eq!(out.dst, ENDPOINTS[0]);
        assert_eq!(remapped.ip(), POD.ip(), "not masqueraded");
        assert!(
            (SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&remapped.port()),
            "{proto:?}: a port of the range, not the clashing {POD}: {remapped}"
        );
        assert_eq!(
            [
                ct_key(proto, POD, CLUSTER_IP),
                ct_key(proto, ENDPOINTS[0], POD),
            ]
            .map(|key| datapath.conntrack(&key).unwrap()),
            first_entries,
            "{proto:?}: the first connection's entries are intact"
        );
        let original = datapath
            .conntrack(&ct_key(proto, POD, OTHER_CLUSTER_IP))
            .unwrap();
        assert_eq!(rewrite_of(&original), (remapped, ENDPOINTS[0]));
        assert_eq!(original.flags, 0);
        let reply = datapath
            .conntrack(&ct_key(proto, ENDPOINTS[0], remapped))
            .unwrap();
        assert_eq!(rewrite_of(&reply), (OTHER_CLUSTER_IP, POD));
        assert_eq!(reply.flags, CT_F_REPLY);

        for _ in 0..3 {
            let out = datapath.translate(&first);
            assert_eq!((out.src, out.dst), (POD, ENDPOINTS[0]));
            let out = datapath.translate(&second);
            assert_eq!((out.src, out.dst), (remapped, ENDPOINTS[0]));
            let out = datapath.translate(&Packet::new(proto, ENDPOINTS[0], POD));
            assert_eq!(
                (out.src, out.dst),
                (CLUSTER_IP, POD),
                "{proto:?}: first's reply"
            );
            let out = datapath.translate(&Packet::new(proto, ENDPOINTS[0], remapped));
            assert_eq!(
                (out.src, out.dst),
                (OTHER_CLUSTER_IP, POD),
                "{proto:?}: second's reply, to the pod's own port"
            );
        }
        assert_eq!(datapath.counter(Counter::NewConnection), 2);
        assert_eq!(datapath.counter(Counter::Masqueraded), 0);
        assert_eq!(datapath.conntrack_len(), 4);
    }
}

/// A clash with no free port in the range to remap to: the new connection is counted and
/// dropped, and the connections that hold the ports keep their entries.
#[test]
fn clash_without_a_free_port_drops() {
    let mut datapath = Datapath::new(Config {
        snat_port_min: 62_000,
        snat_port_max: 62_000,
        ..config()
    });
    let third_cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 12), 80);
    for (service_id, frontend) in [CLUSTER_IP, OTHER_CLUSTER_IP, third_cluster_ip]
        .into_iter()
        .enumerate()
    {
        datapath.service(Proto::Udp, frontend, 0, service_id as u32, &ENDPOINTS[..1]);
    }
    assert_eq!(
        datapath
            .translate(&Packet::new(Proto::Udp, POD, CLUSTER_IP))
            .src,
        POD
    );
    let remapped = SocketAddrV4::new(*POD.ip(), 62_000);
    assert_eq!(
        datapath
            .translate(&Packet::new(Proto::Udp, POD, OTHER_CLUSTER_IP))
            .src,
        remapped
    );

    // Established: an unconfirmed holder of the port would give way (early drop).
    datapath.confirm_all();
    let third = Packet::new(Proto::Udp, POD, third_cluster_ip).build();
    assert_eq!(datapath.run(&third).0, TC_ACT_SHOT);
    assert_eq!(datapath.counter(Counter::DropTupleClash), 1);
    assert_eq!(datapath.counter(Counter::NewConnection), 2);
    assert!(
        datapath
            .conntrack(&ct_key(Proto::Udp, POD, third_cluster_ip))
            .is_none()
    );
    for (from, frontend) in [(POD, CLUSTER_IP), (remapped, OTHER_CLUSTER_IP)] {
        let out = datapath.translate(&Packet::new(Proto::Udp, ENDPOINTS[0], from));
        assert_eq!((out.src, out.dst), (frontend, POD));
    }
    assert_eq!(datapath.conntrack_len(), 4);
}

/// Two CPUs see the first packet of one flow at once, both pick the one endpoint: the one that
/// inserts second finds the reply entry the other just wrote (the state pre-inserted here). It is
/// this flow's, not a clash: the packet takes the same translation (no remapped port), and the
/// flow is one connection.
#[test]
fn first_packet_on_two_cpus_is_one_connection() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS[..1]);
    let key = ct_key(Proto::Udp, POD, CLUSTER_IP);
    let reply_key = ct_key(Proto::Udp, ENDPOINTS[0], POD);
    let written_by_the_other_cpu = ConntrackEntry {
        last_seen_ns: monotonic_ns(),
        src_addr: key.dst_addr,
        dst_addr: key.src_addr,
        src_port: key.dst_port,
        dst_port: key.src_port,
        service_id: SERVICE_ID,
        state: CT_UDP_UNREPLIED,
        flags: CT_F_REPLY,
        ..Default::default()
    };
    let mut conntrack: HashMap<_, ConntrackKey, ConntrackEntry> = datapath.map(map_name::CONNTRACK);
    conntrack
        .insert(reply_key, written_by_the_other_cpu, 0)
        .unwrap();

    let out = datapath.translate(&Packet::new(Proto::Udp, POD, CLUSTER_IP));
    assert_eq!((out.src, out.dst), (POD, ENDPOINTS[0]), "not remapped");
    assert_eq!(
        rewrite_of(&datapath.conntrack(&key).unwrap()),
        (POD, ENDPOINTS[0])
    );
    assert_eq!(
        rewrite_of(&datapath.conntrack(&reply_key).unwrap()),
        (CLUSTER_IP, POD)
    );
    assert_eq!(datapath.conntrack_len(), 2);
    assert_eq!(datapath.counter(Counter::DropTupleClash), 0);
}

/// Two CPUs run the first packet of each of many flows at the same moment (a barrier before
/// each), with three endpoints to choose from: however the two interleave, each flow is one
/// connection, and both packets went to its endpoint. Before inserts were exclusive, the later
/// CPU's connection overwrote the earlier's, whose packet had gone to another endpoint.
#[test]
fn first_packets_racing_on_two_cpus_make_one_connection_each() {
    // Half the unconfirmed table (default_size::CONNTRACK_UNCONFIRMED, two entries a flow, a
    // third while a losing CPU's reply entry lives): an LRU map evicts before it is full when a
    // CPU's share of free nodes runs out, and an evicted entry would read as a split flow.
    const FLOWS: u16 = 1000;
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let barrier = std::sync::Barrier::new(2);
    let [on_cpu0, on_cpu1] = [0, 1].map(|cpu| {
        let (datapath, barrier) = (&datapath, &barrier);
        move || -> Vec<SocketAddrV4> {
            let mut cpus = nix::sched::CpuSet::new();
            cpus.set(cpu).unwrap();
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &cpus).unwrap();
            (0..FLOWS)
                .map(|port| {
                    let client = SocketAddrV4::new(*POD.ip(), 10_000 + port);
                    let packet = Packet::new(Proto::Udp, client, CLUSTER_IP);
                    barrier.wait();
                    datapath.translate(&packet).dst
                })
                .collect()
        }
    });
    let (cpu0, cpu1) = std::thread::scope(|scope| {
        let cpu0 = scope.spawn(on_cpu0);
        let cpu1 = scope.spawn(on_cpu1);
        (cpu0.join().unwrap(), cpu1.join().unwrap())
    });
    let split: Vec<_> = (0..FLOWS)
        .zip(cpu0.iter().zip(&cpu1))
        .filter(|(port, (a, b))| {
            let client = SocketAddrV4::new(*POD.ip(), 10_000 + port);
            let original = datapath.conntrack(&ct_key(Proto::Udp, client, CLUSTER_IP));
            a != b || original.map(|entry| rewrite_of(&entry).1) != Some(**a)
        })
        .collect();
    assert!(split.is_empty(), "flows split between endpoints: {split:?}");
    assert_eq!(datapath.conntrack_len(), 2 * usize::from(FLOWS));
    assert_eq!(datapath.counter(Counter::NewConnection), u64::from(FLOWS));
}

/// The datapath's clock counts jiffies from the kernel's INITIAL_JIFFIES (lb_common::Clock), so
/// its timestamps read as CLOCK_MONOTONIC does, to within the jiffies counted before timekeeping
/// started.
#[test]
fn timestamps_are_about_the_monotonic_clock() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let before = monotonic_ns();
    datapath.translate(&Packet::new(Proto::Tcp, POD, CLUSTER_IP));
    let after = monotonic_ns();
    let stamped = datapath
        .conntrack(&ct_key(Proto::Tcp, POD, CLUSTER_IP))
        .unwrap()
        .last_seen_ns;
    assert!(
        stamped + 1_000_000_000 > before && stamped < after + 1_000_000_000,
        "stamped {stamped} ns, CLOCK_MONOTONIC {before}..{after} ns"
    );
}

fn monotonic_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    Duration::from(now).as_nanos() as u64
}

fn uptime_s() -> u64 {
    let uptime = std::fs::read_to_string("/proc/uptime").unwrap();
    let seconds = uptime.split('.').next().unwrap();
    seconds.parse().unwrap()
}

const EGRESS_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xaa];
const NEIGHBOUR_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xbb];
const EXTERNAL_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xcc];
const ROUTER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xdd];

fn mac_text(mac: [u8; 6]) -> String {
    mac.map(|b| format!("{b:02x}")).join(":")
}

/// `lb-out`'s address in [`in_routed_netns`]: what routing picks as the source towards the pods.
const LB_OUT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 1);

/// Runs `test` in a network namespace of its own with `lb-in`'s index: packets arrive on `lb-in`
/// (198.51.100.1/24, 203.0.113.0/24 routed via 198.51.100.2, whose MAC is known); the pods are
/// behind `lb-out` ([`LB_OUT_ADDR`]/24), where the MAC of ENDPOINTS[0] is known and that of
/// ENDPOINTS[1] is not.
fn in_routed_netns(test: impl FnOnce(u32) + Send + 'static) {
    // unshare(CLONE_NEWNET) moves only the calling thread, and `ip` inherits it: a thread of our
    // own leaves the test harness's threads where they are, and the namespace goes with it.
    std::thread::spawn(|| {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        for args in [
            format!(
                "link add lb-in address {} type veth peer name lb-in-peer",
                mac_text(EXTERNAL_MAC)
            ),
            format!(
                "link add lb-out address {} type veth peer name lb-out-peer",
                mac_text(EGRESS_MAC)
            ),
            "link set lb-in up".into(),
            "link set lb-in-peer up".into(),
            "link set lb-out up".into(),
            "link set lb-out-peer up".into(),
            "addr add 198.51.100.1/24 dev lb-in".into(),
            format!(
                "neigh add 198.51.100.2 lladdr {} dev lb-in nud permanent",
                mac_text(ROUTER_MAC)
            ),
            "route add 203.0.113.0/24 via 198.51.100.2 dev lb-in".into(),
            format!("addr add {LB_OUT_ADDR}/24 dev lb-out"),
            format!(
                "neigh add {} lladdr {} dev lb-out nud permanent",
                ENDPOINTS[0].ip(),
                mac_text(NEIGHBOUR_MAC)
            ),
        ] {
            ip(&args);
        }
        std::fs::write("/proc/sys/net/ipv4/conf/all/forwarding", "1").unwrap();
        test(nix::net::if_::if_nametoindex("lb-in").unwrap());
    })
    .join()
    .unwrap();
}

/// `ip ARGS` (space-separated) in the calling thread's namespace.
fn ip(args: &str) {
    let status = std::process::Command::new("ip")
        .args(args.split(' '))
        .status()
        .unwrap();
    assert!(status.success(), "ip {args}");
}

/// `known`'s MAC is `mac` now, in the namespace of `in_routed_netns`.
fn set_neighbour_mac(known: SocketAddrV4, mac: [u8; 6]) {
    ip(&format!(
        "neigh replace {} lladdr {} dev lb-out nud permanent",
        known.ip(),
        mac_text(mac)
    ));
}

/// The packet's destination and source MACs.
fn macs(packet: &[u8]) -> (String, String) {
    let (eth, _) = Ethernet2Header::from_slice(packet).unwrap();
    (mac_text(eth.destination), mac_text(eth.source))
}

/// In a private network namespace with a route to the backends: a packet whose next hop is known
/// is redirected with the FIB's MACs, one whose neighbour is unresolved is redirected for the
/// kernel to resolve; both with the TTL decremented (checked by `verify`).
#[test]
fn routed_packets_are_redirected() {
    in_routed_netns(|lb_in| {
        let (known, unresolved) = (ENDPOINTS[0], ENDPOINTS[1]);
        let mut datapath = Datapath::new(config());
        datapath.service(Proto::Tcp, CLUSTER_IP, 0, SERVICE_ID, &[known]);
        datapath.service(Proto::Udp, CLUSTER_IP, 0, SERVICE_ID + 1, &[unresolved]);
        datapath.ingress_ifindex = lb_in;

        let input = Packet::new(Proto::Tcp, POD, CLUSTER_IP).build();
        let (verdict, output) = datapath.run(&input);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(verify(&input, true, &output).dst, known);
        assert_eq!(
            macs(&output),
            (mac_text(NEIGHBOUR_MAC), mac_text(EGRESS_MAC))
        );

        let input = Packet::new(Proto::Udp, POD, CLUSTER_IP).build();
        let (verdict, output) = datapath.run(&input);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(verify(&input, true, &output).dst, unresolved);
        assert_eq!(
            output[..12],
            input[..12],
            "the kernel fills in the MACs on egress"
        );
        assert_eq!(datapath.counter(Counter::FibFallback), 0);
    });
}

/// A connection's conntrack entry caches the FIB's route: its later packets take it (even after
/// the neighbour's MAC changed) until the entry is next refreshed, when the FIB is asked again;
/// a packet longer than the one the route was checked for asks the FIB again.
#[test]
fn established_packets_take_the_cached_route() {
    in_routed_netns(|lb_in| {
        let known = ENDPOINTS[0];
        let mut datapath = Datapath::new(config());
        datapath.service(Proto::Tcp, CLUSTER_IP, 0, SERVICE_ID, &[known]);
        datapath.ingress_ifindex = lb_in;
        let key = ct_key(Proto::Tcp, POD, CLUSTER_IP);
        let input = Packet::new(Proto::Tcp, POD, CLUSTER_IP).build();
        assert_eq!(datapath.run(&input).0, TC_ACT_REDIRECT);
        let entry = datapath.conntrack(&key).unwrap();
        assert_eq!(usize::from(entry.hop_len), input.len() - ETH_HLEN);
        assert_eq!(
            entry.hop.ifindex,
            nix::net::if_::if_nametoindex("lb-out").unwrap()
        );
        assert_eq!(entry.hop.iif, lb_in);

        let moved = [0x02, 0, 0, 0, 0, 0xee];
        set_neighbour_mac(known, moved);
        let (verdict, output) = datapath.run(&input);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(verify(&input, true, &output).dst, known);
        assert_eq!(
            macs(&output),
            (mac_text(NEIGHBOUR_MAC), mac_text(EGRESS_MAC)),
            "the cached route"
        );

        let longer = Packet {
            ip_options: &[1, 1, 1, 1],
            ..Packet::new(Proto::Tcp, POD, CLUSTER_IP)
        }
        .build();
        let (_, output) = datapath.run(&longer);
        assert_eq!(macs(&output).0, mac_text(moved), "longer: the FIB again");
        let entry = datapath.conntrack(&key).unwrap();
        assert_eq!(usize::from(entry.hop_len), longer.len() - ETH_HLEN);

        set_neighbour_mac(known, NEIGHBOUR_MAC);
        let (_, output) = datapath.run(&input);
        assert_eq!(macs(&output).0, mac_text(moved), "still cached");
        // Seen two seconds ago: this packet refreshes the entry, which drops its route.
        let aged = ConntrackEntry {
            last_seen_ns: entry.last_seen_ns - 2_000_000_000,
            ..entry
        };
        let mut conntrack: HashMap<_, ConntrackKey, ConntrackEntry> =
            datapath.map(map_name::CONNTRACK);
        conntrack.insert(key, aged, 0).unwrap();
        let (_, output) = datapath.run(&input);
        assert_eq!(
            macs(&output).0,
            mac_text(NEIGHBOUR_MAC),
            "refreshed: the FIB again"
        );
        assert_eq!(datapath.counter(Counter::FibFallback), 0);
    });
}

/// lb_xdp on NodePort traffic from an external client, TCP and UDP, with and without IP
/// options: a connection's first packet goes on to tc untouched, which opens the connection;
/// its next packets hit conntrack in XDP: DNAT and masquerade (to the source routing picks
/// towards the backend, not the configured node address, as MASQUERADE) with valid checksums,
/// redirected towards the backend with the FIB's MACs and the TTL decremented; the backend's
/// reply arriving on the external interface (as from a remote backend) is reverse-translated
/// and sent back towards the client.
#[test]
fn xdp_translates_and_redirects_node_port_traffic() {
    in_routed_netns(|lb_in| {
        let mut datapath = Datapath::new(config()).with_xdp();
        datapath.ingress_ifindex = lb_in;
        datapath.allow_xdp_egress("lb-in", true);
        datapath.allow_xdp_egress("lb-out", true);
        for (proto, service_id) in [(Proto::Tcp, SERVICE_ID), (Proto::Udp, SERVICE_ID + 1)] {
            let flags = FRONTEND_F_MASQUERADE;
            datapath.service(proto, NODE_PORT, flags, service_id, &[ENDPOINTS[0]]);
        }
        let cases = [
            (Proto::Tcp, &[][..]),
            (Proto::Udp, &[]),
            (Proto::Tcp, &ROUTER_ALERT),
        ];
        for (port, (proto, ip_options)) in (50_000..).zip(cases) {
            let client = SocketAddrV4::new(*EXTERNAL_CLIENT.ip(), port);
            let request = Packet {
                ip_options,
                ..Packet::new(proto, client, NODE_PORT)
            };
            datapath.assert_xdp_passes(&request.build());
            let (verdict, opened) = datapath.run(&request.build());
            assert_eq!(verdict, TC_ACT_REDIRECT, "{proto:?}: opened by tc");
            let opened = verify(&request.build(), true, &opened);
            let (out, bytes) = datapath.translate_xdp(&request);
            assert_eq!(
                (out.src, out.dst),
                (opened.src, opened.dst),
                "conntrack hit"
            );
            assert_eq!(*out.src.ip(), LB_OUT_ADDR, "{proto:?}: masqueraded");
            assert!((SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&out.src.port()));
            assert_eq!(out.dst, ENDPOINTS[0]);
            assert_eq!(
                macs(&bytes),
                (mac_text(NEIGHBOUR_MAC), mac_text(EGRESS_MAC))
            );

            let reply = Packet {
                ip_options,
                ..Packet::new(proto, ENDPOINTS[0], out.src)
            };
            let (back, bytes) = datapath.translate_xdp(&reply);
            assert_eq!(
                (back.src, back.dst),
                (NODE_PORT, client),
                "reverse-translated"
            );
            assert_eq!(macs(&bytes), (mac_text(ROUTER_MAC), mac_text(EXTERNAL_MAC)));
        }
        assert_eq!(datapath.counter(Counter::NewConnection), 3);
        assert_eq!(datapath.counter(Counter::Masqueraded), 3);
        assert_eq!(datapath.counter(Counter::Translated), 6);
        assert_eq!(datapath.counter(Counter::XdpForwarded), 6);
        assert_eq!(datapath.counter(Counter::XdpPassed), 3);

        // An egress the agent has not listed (a pod veth whose peer cannot take XDP frames):
        // the packets of a tracked connection go to tc untouched.
        datapath.allow_xdp_egress("lb-out", false);
        let client = SocketAddrV4::new(*EXTERNAL_CLIENT.ip(), 50_100);
        let input = Packet::new(Proto::Tcp, client, NODE_PORT).build();
        assert_eq!(datapath.run(&input).0, TC_ACT_REDIRECT, "opened by tc");
        assert_eq!(datapath.counter(Counter::NewConnection), 4);
        assert_eq!(datapath.run_xdp(&input), (XDP_PASS, input.clone()));
        assert_eq!(datapath.counter(Counter::XdpPassed), 4);
        let (verdict, output) = datapath.run(&input);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(verify(&input, true, &output).dst, ENDPOINTS[0]);
    });
}

/// When the backend's MAC is unresolved, lb_xdp passes a tracked connection's packet untouched;
/// tc, on the same interface, finds that connection and applies the same translation.
#[test]
fn xdp_leaves_unresolved_next_hops_to_tc() {
    in_routed_netns(|lb_in| {
        let mut datapath = Datapath::new(config()).with_xdp();
        datapath.ingress_ifindex = lb_in;
        let unresolved = ENDPOINTS[1];
        datapath.service(
            Proto::Tcp,
            NODE_PORT,
            FRONTEND_F_MASQUERADE,
            SERVICE_ID,
            &[unresolved],
        );
        let input = Packet::new(Proto::Tcp, EXTERNAL_CLIENT, NODE_PORT).build();
        datapath.assert_xdp_passes(&input);
        assert_eq!(datapath.conntrack_len(), 0, "XDP opens no connection");
        assert_eq!(datapath.run(&input).0, TC_ACT_REDIRECT, "opened by tc");
        let tracked = datapath
            .conntrack(&ct_key(Proto::Tcp, EXTERNAL_CLIENT, NODE_PORT))
            .unwrap();

        datapath.assert_xdp_passes(&input);
        let (verdict, output) = datapath.run(&input);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        let out = verify(&input, true, &output);
        assert_eq!(
            (out.src, out.dst),
            rewrite_of(&tracked),
            "the same translation"
        );
        assert_eq!(out.dst, unresolved);
        assert_eq!(datapath.counter(Counter::NewConnection), 1);
        // XDP's lookup, then tc's.
        assert_eq!(datapath.counter(Counter::Translated), 2);
        assert_eq!(datapath.counter(Counter::XdpPassed), 2);
        assert_eq!(datapath.counter(Counter::XdpForwarded), 0);
        assert_eq!(datapath.conntrack_len(), 2);
    });
}

/// What lb_xdp does not finish goes to the stack untouched, counted only as passed by XDP (tc
/// counts why): fragments, non-service traffic, TTL 1, a new connection (tc opens it), and one
/// to a service without endpoints (tc answers it with REJECT). Drops are XDP's own.
#[test]
fn xdp_passes_what_it_does_not_finish() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS).with_xdp();
    datapath.service(
        Proto::Udp,
        NODE_PORT,
        FRONTEND_F_MASQUERADE,
        SERVICE_ID + 1,
        &[],
    );
    let request = Packet::new(Proto::Tcp, EXTERNAL_CLIENT, CLUSTER_IP);
    let packets = [
        Packet {
            more_fragments: true,
            ..request
        },
        Packet {
            fragment_offset: 185,
            ..request
        },
        Packet::new(Proto::Tcp, EXTERNAL_CLIENT, SocketAddrV4::new(NODE, 22)),
        Packet { ttl: 1, ..request },
        request,
        Packet::new(Proto::Udp, EXTERNAL_CLIENT, NODE_PORT),
    ];
    for packet in &packets {
        datapath.assert_xdp_passes(&packet.build());
    }
    assert_eq!(datapath.counter(Counter::XdpPassed), packets.len() as u64);
    for counter in [Counter::Passed, Counter::PassedUnparsed, Counter::Rejected] {
        assert_eq!(datapath.counter(counter), 0, "{counter:?} is tc's to count");
    }
    assert_eq!(datapath.conntrack_len(), 0);

    let no_local = local_policy(
        NODE_PORT,
        FRONTEND_F_LOCAL | FRONTEND_F_PRESERVE_SOURCE,
        &[],
    );
    let no_local = no_local.with_xdp();
    let packet = Packet::new(Proto::Tcp, EXTERNAL_CLIENT, NODE_PORT).build();
    assert_eq!(no_local.run_xdp(&packet).0, XDP_DROP);
    assert_eq!(no_local.counter(Counter::DropNoLocalBackend), 1);
}

/// Translated packets without a route back to the stack, counted.
#[test]
fn unrouted_packets_fall_back_to_the_stack() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let input = Packet::new(Proto::Tcp, POD, CLUSTER_IP).build();
    let (verdict, output) = datapath.run(&input);
    assert_eq!(verdict, TC_ACT_OK);
    verify(&input, false, &output);
    assert_eq!(datapath.counter(Counter::FibFallback), 1);
}

/// Below the kernel's 1M limit, so that added features have room; a jump in this number means
/// a loop or branch structure that multiplies verifier states. lb_ingress is about 220k, lb_egress
/// about 8k and lb_xdp about 13k (it opens no connection): the port search is a bpf_loop callback whose body is verified
/// once, and it reports a port rather than a tuple, which would keep one verifier state per
/// outcome through the rest of the new connection path. The socket hooks, loaded too, are a few
/// thousand (connect, sendmsg) and under a hundred (recvmsg, getpeername).
#[test]
fn verifier_cost_is_bounded() {
    let mut datapath = Datapath::new(config()).with_xdp();
    let egress: &mut SchedClassifier = datapath
        .ebpf
        .program_mut(program_name::EGRESS)
        .unwrap()
        .try_into()
        .unwrap();
    lb_user::datapath::load_program(|| egress.load()).expect("verifier accepts lb_egress");
    for name in lb_user::datapath::cgroup_hooks::PROGRAMS {
        let program: &mut CgroupSockAddr =
            datapath.ebpf.program_mut(name).unwrap().try_into().unwrap();
        lb_user::datapath::load_program(|| program.load())
            .unwrap_or_else(|err| panic!("verifier accepts {name}: {err}"));
    }
    let tc_programs = [
        program_name::INGRESS,
        program_name::EGRESS,
        program_name::XDP,
    ];
    for name in tc_programs
        .into_iter()
        .chain(lb_user::datapath::cgroup_hooks::PROGRAMS)
    {
        let program = datapath.ebpf.program(name).unwrap();
        let processed = program
            .info()
            .unwrap()
            .verified_instruction_count()
            .unwrap();
        eprintln!("{name}: {processed} instructions processed");
        assert!(
            processed < 300_000,
            "{name}: {processed} instructions processed"
        );
    }
}

/// An ICMP error from `from` to `to` (type and code `kind`, bytes 4..8 `rest`) quoting the first
/// `quote_len` bytes (all when `None`) of the IP packet in the frame `quoted`.
fn icmp_error(
    from: Ipv4Addr,
    to: Ipv4Addr,
    kind: [u8; 2],
    rest: [u8; 4],
    quoted: &[u8],
    quote_len: Option<usize>,
) -> Vec<u8> {
    let quote = &quoted[ETH_HLEN..];
    let quote = &quote[..quote_len.unwrap_or(quote.len())];
    let mut bytes = Vec::new();
    PacketBuilder::ethernet2(MAC_SRC, MAC_DST)
        .ipv4(from.octets(), to.octets(), 64)
        .icmpv4_raw(kind[0], kind[1], rest)
        .write(&mut bytes, quote)
        .unwrap();
    bytes
}

const FRAG_NEEDED: [u8; 2] = [3, 4];
const PORT_UNREACHABLE: [u8; 2] = [3, 3];
const TTL_EXCEEDED: [u8; 2] = [11, 0];
/// Frag-needed's next-hop MTU (1400) in bytes 6..8.
const MTU_1400: [u8; 4] = [0, 0, 0x05, 0x78];

/// An ICMP error that came out of the program, checked: same length; MACs kept unless
/// redirected; outer IPv4 checksum valid, TTL decremented only when redirected, other fields
/// kept; ICMP checksum valid over the whole message, type, code and bytes 4..8 kept; the quoted
/// IPv4 header's checksum valid and only its addresses changed; the quoted TCP/UDP header's
/// bytes past the ports kept but its checksum, which, when the whole segment is quoted, is
/// valid for the new addresses (a UDP checksum of zero stays zero).
/// Returns (outer source, outer destination, quoted source, quoted destination).
fn verify_icmp_error(
    input: &[u8],
    verdict: u32,
    output: &[u8],
) -> (Ipv4Addr, Ipv4Addr, SocketAddrV4, SocketAddrV4) {
    assert!(
        verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
        "verdict {verdict}"
    );
    let redirected = verdict == TC_ACT_REDIRECT;
    assert_eq!(output.len(), input.len());
    if !redirected {
        assert_eq!(output[..ETH_HLEN], input[..ETH_HLEN], "MACs");
    }
    let (ip_in, icmp_in) = Ipv4Header::from_slice(&input[ETH_HLEN..]).unwrap();
    let (ip, icmp) = Ipv4Header::from_slice(&output[ETH_HLEN..]).unwrap();
    assert_eq!(
        ip.calc_header_checksum(),
        ip.header_checksum,
        "outer IPv4 checksum"
    );
    let ttl = ip_in.time_to_live - u8::from(redirected);
    let kept = |ip: &Ipv4Header| {
        (
            ip.total_len,
            ip.protocol,
            ip.identification,
            ip.dont_fragment,
        )
    };
    assert_eq!((ip.time_to_live, kept(&ip)), (ttl, kept(&ip_in)));
    assert!(checksum_ok(icmp), "ICMP checksum");
    assert_eq!(icmp[..2], icmp_in[..2], "type and code");
    assert_eq!(icmp[4..8], icmp_in[4..8], "rest of the ICMP header");

    let (quoted_in, l4_in) = Ipv4Header::from_slice(&icmp_in[8..]).unwrap();
    let (quoted, l4) = Ipv4Header::from_slice(&icmp[8..]).unwrap();
    assert_eq!(
        quoted.calc_header_checksum(),
        quoted.header_checksum,
        "quoted IPv4 checksum"
    );
    let unchanged = Ipv4Header {
        source: quoted.source,
        destination: quoted.destination,
        header_checksum: quoted.header_checksum,
        ..quoted_in.clone()
    };
    assert_eq!(quoted, unchanged, "only the quoted addresses change");
    let check_at = if quoted.protocol == IpNumber::UDP {
        6
    } else {
        16
    };
    let past_ports = |l4: &[u8]| {
        let mut bytes = l4[4..].to_vec();
        if let Some(check) = bytes.get_mut(check_at - 4..check_at - 2) {
            check.fill(0);
        }
        bytes
    };
    assert_eq!(
        past_ports(l4),
        past_ports(l4_in),
        "only ports and checksum change"
    );
    let whole = usize::from(quoted.total_len) == quoted.header_len() + l4.len();
    if whole {
        match quoted.protocol {
            IpNumber::TCP => {
                let (tcp, payload) = TcpHeader::from_slice(l4).unwrap();
                let expected = tcp.calc_checksum_ipv4(&quoted, payload).unwrap();
                assert_eq!(tcp.checksum, expected, "quoted TCP checksum");
            }
            IpNumber::UDP => {
                let (udp, payload) = UdpHeader::from_slice(l4).unwrap();
                let (udp_in, _) = UdpHeader::from_slice(l4_in).unwrap();
                if udp_in.checksum == 0 {
                    assert_eq!(udp.checksum, 0, "no UDP checksum stays none");
                } else {
                    let expected = udp.calc_checksum_ipv4(&quoted, payload).unwrap();
                    assert_eq!(udp.checksum, expected, "quoted UDP checksum");
                }
            }
            other => panic!("unexpected quoted protocol {other:?}"),
        }
    }
    let port = |at: usize| u16::from_be_bytes([l4[at], l4[at + 1]]);
    (
        ip.source.into(),
        ip.destination.into(),
        SocketAddrV4::new(quoted.source.into(), port(0)),
        SocketAddrV4::new(quoted.destination.into(), port(2)),
    )
}

/// A router between the node and the backends.
const POD_ROUTER: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 1);
/// A router between an external client and the node.
const CLIENT_ROUTER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);

/// ICMP errors about a tracked connection's packets, in both directions, are reverse-translated
/// as Linux's NAT does: the quote back to what its sender sent, the outer destination that
/// sender, the outer source the service address when the quote's destination was translated
/// (else the hop that sent it). Masqueraded (NodePort) and DNAT-only (pod to ClusterIP), TCP and
/// UDP, whole quotes (TCP/UDP checksums checked) and RFC 792's 8 bytes. No conntrack change.
#[test]
fn icmp_errors_about_tracked_flows_are_reverse_translated() {
    let mut datapath = Datapath::with_cluster_ip(&[ENDPOINTS[0]]);
    for proto in [Proto::Tcp, Proto::Udp] {
        datapath.service(
            proto,
            NODE_PORT,
            FRONTEND_F_MASQUERADE,
            SERVICE_ID + 1,
            &[ENDPOINTS[1]],
        );
    }
    let mut translated = 0;
    for proto in [Proto::Tcp, Proto::Udp] {
        // Masqueraded: the backend sees node:port.
        let request = Packet::new(proto, EXTERNAL_CLIENT, NODE_PORT);
        let sent = datapath.translate(&request);
        assert_eq!((*sent.src.ip(), sent.dst), (NODE, ENDPOINTS[1]));
        let reply = Packet::new(proto, ENDPOINTS[1], sent.src);
        assert_eq!(
            (
                datapath.translate(&reply).src,
                datapath.translate(&reply).dst
            ),
            (NODE_PORT, EXTERNAL_CLIENT)
        );
        let entries = (
            datapath.conntrack(&ct_key(proto, EXTERNAL_CLIENT, NODE_PORT)),
            datapath.conntrack(&ct_key(proto, ENDPOINTS[1], sent.src)),
        );

        // From the backend side, about the masqueraded request (node:port → backend).
        let as_sent = Packet {
            src: sent.src,
            dst: sent.dst,
            ..request
        };
        for (from, kind, rest, quote_len) in [
            (POD_ROUTER, FRAG_NEEDED, MTU_1400, None),
            (*ENDPOINTS[1].ip(), PORT_UNREACHABLE, [0; 4], None),
            (POD_ROUTER, TTL_EXCEEDED, [0; 4], Some(28)),
        ] {
            let input = icmp_error(from, NODE, kind, rest, &as_sent.build(), quote_len);
            let (verdict, output) = datapath.run(&input);
            assert_eq!(
                verify_icmp_error(&input, verdict, &output),
                (
                    *NODE_PORT.ip(),
                    *EXTERNAL_CLIENT.ip(),
                    EXTERNAL_CLIENT,
                    NODE_PORT
                ),
                "{proto:?} {kind:?} from {from}"
            );
            translated += 1;
        }
        // From the client side, about the reply (node port → client): back to the backend, from
        // the masquerade address.
        let as_replied = Packet {
            src: NODE_PORT,
            dst: EXTERNAL_CLIENT,
            ..request
        };
        let input = icmp_error(
            CLIENT_ROUTER,
            NODE,
            FRAG_NEEDED,
            MTU_1400,
            &as_replied.build(),
            None,
        );
        let (verdict, output) = datapath.run(&input);
        assert_eq!(
            verify_icmp_error(&input, verdict, &output),
            (NODE, *ENDPOINTS[1].ip(), ENDPOINTS[1], sent.src)
        );
        translated += 1;
        assert_eq!(
            (
                datapath.conntrack(&ct_key(proto, EXTERNAL_CLIENT, NODE_PORT)),
                datapath.conntrack(&ct_key(proto, ENDPOINTS[1], sent.src)),
            ),
            entries,
            "errors leave the connection alone"
        );

        // DNAT only: a pod to the ClusterIP.
        let request = Packet::new(proto, POD, CLUSTER_IP);
        assert_eq!(datapath.translate(&request).dst, ENDPOINTS[0]);
        let as_sent = Packet {
            dst: ENDPOINTS[0],
            ..request
        };
        let input = icmp_error(
            *ENDPOINTS[0].ip(),
            *POD.ip(),
            PORT_UNREACHABLE,
            [0; 4],
            &as_sent.build(),
            None,
        );
        let (verdict, output) = datapath.run(&input);
        assert_eq!(
            verify_icmp_error(&input, verdict, &output),
            (*CLUSTER_IP.ip(), *POD.ip(), POD, CLUSTER_IP)
        );
        // The pod's kernel about the reply (ClusterIP → pod): to the backend, still from the pod.
        let as_replied = Packet {
            src: CLUSTER_IP,
            dst: POD,
            ..request
        };
        let input = icmp_error(
            *POD.ip(),
            *CLUSTER_IP.ip(),
            PORT_UNREACHABLE,
            [0; 4],
            &as_replied.build(),
            None,
        );
        let (verdict, output) = datapath.run(&input);
        assert_eq!(
            verify_icmp_error(&input, verdict, &output),
            (*POD.ip(), *ENDPOINTS[0].ip(), ENDPOINTS[0], POD)
        );
        translated += 2;
    }
    // A quoted UDP datagram without a checksum, and a quoted header with options.
    let request = Packet {
        zero_udp_checksum: true,
        ip_options: &ROUTER_ALERT,
        ..Packet::new(Proto::Udp, POD, CLUSTER_IP)
    };
    let as_sent = Packet {
        dst: ENDPOINTS[0],
        ..request
    };
    let input = icmp_error(
        POD_ROUTER,
        *POD.ip(),
        FRAG_NEEDED,
        MTU_1400,
        &as_sent.build(),
        None,
    );
    let (verdict, output) = datapath.run(&input);
    assert_eq!(
        verify_icmp_error(&input, verdict, &output),
        (*CLUSTER_IP.ip(), *POD.ip(), POD, CLUSTER_IP)
    );
    translated += 1;
    assert_eq!(datapath.counter(Counter::IcmpErrorTranslated), translated);
}

/// Other ICMP, and errors not about a tracked flow, are left alone: an echo request, an error
/// about an untracked flow, one whose quote is a later fragment, one sent to someone other than
/// the quoted packet's sender (Linux's conntrack refuses it as related too), a truncated quote,
/// a redirect. lb_xdp passes ICMP errors to tc.
#[test]
fn icmp_not_about_tracked_flows_is_untouched() {
    let datapath = Datapath::with_cluster_ip(&[ENDPOINTS[0]]).with_xdp();
    let request = Packet::new(Proto::Udp, POD, CLUSTER_IP);
    assert_eq!(datapath.translate(&request).dst, ENDPOINTS[0]);
    let as_sent = Packet {
        dst: ENDPOINTS[0],
        ..request
    }
    .build();
    let untracked = Packet {
        src: SocketAddrV4::new(*POD.ip(), 40001),
        ..Packet::new(Proto::Udp, POD, ENDPOINTS[0])
    }
    .build();
    let later_fragment = Packet {
        dst: ENDPOINTS[0],
        fragment_offset: 185,
        ..request
    }
    .build();
    let echo = {
        let mut bytes = Vec::new();
        PacketBuilder::ethernet2(MAC_SRC, MAC_DST)
            .ipv4(ENDPOINTS[0].ip().octets(), POD.ip().octets(), 64)
            .icmpv4_echo_request(1, 1)
            .write(&mut bytes, PAYLOAD)
            .unwrap();
        bytes
    };
    let backend = *ENDPOINTS[0].ip();
    let elsewhere = Ipv4Addr::new(10, 244, 1, 99);
    let packets = [
        echo,
        icmp_error(
            backend,
            *POD.ip(),
            PORT_UNREACHABLE,
            [0; 4],
            &untracked,
            None,
        ),
        icmp_error(
            backend,
            *POD.ip(),
            PORT_UNREACHABLE,
            [0; 4],
            &later_fragment,
            None,
        ),
        icmp_error(backend, elsewhere, PORT_UNREACHABLE, [0; 4], &as_sent, None),
        icmp_error(backend, *POD.ip(), [5, 1], [10, 244, 0, 1], &as_sent, None),
    ];
    for packet in &packets {
        datapath.assert_untouched(packet);
    }
    assert_eq!(datapath.counter(Counter::Passed), packets.len() as u64);
    let truncated = icmp_error(
        backend,
        *POD.ip(),
        PORT_UNREACHABLE,
        [0; 4],
        &as_sent,
        Some(24),
    );
    datapath.assert_untouched(&truncated);
    assert_eq!(datapath.counter(Counter::PassedUnparsed), 1);
    assert_eq!(datapath.counter(Counter::IcmpErrorTranslated), 0);

    let tracked = icmp_error(backend, *POD.ip(), PORT_UNREACHABLE, [0; 4], &as_sent, None);
    datapath.assert_xdp_passes(&tracked);
    assert_eq!(datapath.counter(Counter::XdpPassed), 1);
    assert_eq!(datapath.counter(Counter::IcmpErrorTranslated), 0);
    let (verdict, output) = datapath.run(&tracked);
    verify_icmp_error(&tracked, verdict, &output);
    assert_eq!(datapath.counter(Counter::IcmpErrorTranslated), 1);
}
