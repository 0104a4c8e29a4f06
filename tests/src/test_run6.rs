//! BPF_PROG_TEST_RUN of the IPv6 tc datapath (`lb_ingress` tail-calling `lb_ingress6`) on
//! crafted packets, for datapath6.rs and fragments6.rs: a private, unpinned copy of the object
//! per test, packets built byte by byte (extension headers included), and the TCP/UDP checksums
//! of what comes out computed here over the IPv6 pseudo-header (RFC 8200 8.1), independently of
//! the datapath's incremental updates. Run as root.
use std::net::{Ipv6Addr, SocketAddrV6};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray},
    programs::SchedClassifier,
};
use lb_common::{
    Addr6, AffinityKey6, Backend6, BackendKey, CONFIG_F_READY, Config, Config6, ConntrackEntry6,
    ConntrackKey6, Counter, FRONTEND_F_MASQUERADE, Frontend, FrontendKey6, IPPROTO_TCP,
    IPPROTO_UDP, SNAT_PORT_MAX, SNAT_PORT_MIN, StickyBackend6, map_name, port_be, program_name,
};

use crate::test_run::{entries, run_program};

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;
pub const ETH_HLEN: usize = 14;
pub const IPV6_HLEN: usize = 40;
pub const IPPROTO_ICMPV6: u8 = 58;
pub const IPPROTO_DSTOPTS: u8 = 60;
pub const IPPROTO_HOPOPTS: u8 = 0;
pub const IPPROTO_ROUTING: u8 = 43;
pub const IPPROTO_FRAGMENT: u8 = 44;
pub const IPPROTO_AH: u8 = 51;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;
pub const TCP_RST: u8 = 0x04;
pub const SERVICE_ID: u32 = 7;
pub const PAYLOAD: &[u8] = b"hello, service";

pub const fn addr(last: u16) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, last)
}
pub const fn pod(last: u16, port: u16) -> SocketAddrV6 {
    SocketAddrV6::new(
        Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, last),
        port,
        0,
        0,
    )
}

/// In `fd00:10:96::/112`, as a cluster's IPv6 service CIDR.
pub const CLUSTER_IP: SocketAddrV6 = SocketAddrV6::new(
    Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10),
    80,
    0,
    0,
);
pub const CLIENT: SocketAddrV6 = pod(0x10, 40000);
/// The IPv6 --node-ip: the masquerade address, as the FIB has no answer in a test run.
pub const NODE: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x10);
pub const NODE_PORT: SocketAddrV6 = SocketAddrV6::new(NODE, 30080, 0, 0);
/// Outside the cluster CIDR.
pub const EXTERNAL_CLIENT: SocketAddrV6 = SocketAddrV6::new(addr(7), 50000, 0, 0);
pub const ENDPOINTS: [SocketAddrV6; 3] = [pod(0x21, 8080), pod(0x22, 8080), pod(0x23, 8080)];

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => IPPROTO_TCP,
            Proto::Udp => IPPROTO_UDP,
        }
    }

    /// The checksum's offset in the transport header.
    pub fn check_offset(self) -> usize {
        match self {
            Proto::Tcp => 16,
            Proto::Udp => 6,
        }
    }
}

/// An extension header of 8 bytes: options headers carry a PadN option filling them; a fragment
/// header is the first and only fragment (an atomic fragment).
pub fn extension_header(kind: u8, next: u8) -> [u8; 8] {
    match kind {
        IPPROTO_FRAGMENT => [next, 0, 0, 0, 0x12, 0x34, 0x56, 0x78],
        // Routing type 0 is deprecated; a type the node does not know with segments left 0 is
        // skipped by the stack, and walked by us as any other.
        IPPROTO_ROUTING => [next, 0, 253, 0, 0, 0, 0, 0],
        _ => [next, 0, 1, 4, 0, 0, 0, 0],
    }
}

/// The ones' complement sum of the IPv6 pseudo-header and `l4` (checksum field included).
pub fn pseudo_header_sum(src: &Ipv6Addr, dst: &Ipv6Addr, proto: u8, l4: &[u8]) -> u16 {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&src.octets());
    bytes.extend_from_slice(&dst.octets());
    bytes.extend_from_slice(&(l4.len() as u32).to_be_bytes());
    bytes.extend_from_slice(&[0, 0, 0, proto]);
    bytes.extend_from_slice(l4);
    if bytes.len() % 2 == 1 {
        bytes.push(0);
    }
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// An Ethernet + IPv6 frame: `chain` the extension headers in order, then `proto`'s header and
/// payload `l4` (its checksum computed here when it is TCP, UDP or ICMPv6).
pub fn frame(src: &Ipv6Addr, dst: &Ipv6Addr, chain: &[u8], proto: u8, l4: &[u8]) -> Vec<u8> {
    let mut l4 = l4.to_vec();
    let check = match proto {
        IPPROTO_TCP => Some(16),
        IPPROTO_UDP => Some(6),
        IPPROTO_ICMPV6 => Some(2),
        _ => None,
    };
    if let Some(check) = check {
        l4[check..check + 2].fill(0);
        let sum = !pseudo_header_sum(src, dst, proto, &l4);
        l4[check..check + 2].copy_from_slice(&sum.to_be_bytes());
    }
    let mut extensions = Vec::new();
    for (i, &kind) in chain.iter().enumerate() {
        let next = chain.get(i + 1).copied().unwrap_or(proto);
        extensions.extend_from_slice(&extension_header(kind, next));
    }
    let first = chain.first().copied().unwrap_or(proto);
    let payload_len = (extensions.len() + l4.len()) as u16;
    let mut bytes = vec![0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01, 0x86, 0xdd];
    bytes.extend_from_slice(&[0x60, 0, 0, 0]);
    bytes.extend_from_slice(&payload_len.to_be_bytes());
    bytes.extend_from_slice(&[first, 64]);
    bytes.extend_from_slice(&src.octets());
    bytes.extend_from_slice(&dst.octets());
    bytes.extend_from_slice(&extensions);
    bytes.extend_from_slice(&l4);
    bytes
}

/// A TCP segment (`flags`) or UDP datagram from `src` to `dst` carrying `PAYLOAD`, after the
/// extension headers `chain`.
pub fn packet(
    proto: Proto,
    src: SocketAddrV6,
    dst: SocketAddrV6,
    flags: u8,
    chain: &[u8],
) -> Vec<u8> {
    let mut l4 = Vec::new();
    l4.extend_from_slice(&src.port().to_be_bytes());
    l4.extend_from_slice(&dst.port().to_be_bytes());
    match proto {
        Proto::Tcp => {
            l4.extend_from_slice(&1000u32.to_be_bytes());
            l4.extend_from_slice(&0u32.to_be_bytes());
            l4.extend_from_slice(&[5 << 4, flags]);
            l4.extend_from_slice(&65535u16.to_be_bytes());
            l4.extend_from_slice(&[0, 0, 0, 0]);
        }
        Proto::Udp => {
            l4.extend_from_slice(&((8 + PAYLOAD.len()) as u16).to_be_bytes());
            l4.extend_from_slice(&[0, 0]);
        }
    }
    l4.extend_from_slice(PAYLOAD);
    frame(src.ip(), dst.ip(), chain, proto.number(), &l4)
}

/// The addresses and ports of `output`, which must be `input` with those rewritten only, and
/// whose TCP/UDP checksum must be right over the new pseudo-header.
pub fn verify(
    input: &[u8],
    output: &[u8],
    proto: Proto,
    l4: usize,
) -> (SocketAddrV6, SocketAddrV6) {
    assert_eq!(output.len(), input.len());
    let check = l4 + proto.check_offset();
    let unchanged = |range: std::ops::Range<usize>| {
        assert_eq!(
            output[range.clone()],
            input[range.clone()],
            "bytes {range:?}"
        );
    };
    unchanged(0..ETH_HLEN + 8);
    unchanged(ETH_HLEN + IPV6_HLEN..l4);
    unchanged(l4 + 4..check);
    unchanged(check + 2..input.len());
    let ip = |at: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&output[at..at + 16]).unwrap());
    let (src, dst) = (ip(ETH_HLEN + 8), ip(ETH_HLEN + 24));
    assert_eq!(
        pseudo_header_sum(&src, &dst, proto.number(), &output[l4..]),
        0xffff,
        "{proto:?} checksum over the IPv6 pseudo-header"
    );
    let port = |at: usize| u16::from_be_bytes([output[at], output[at + 1]]);
    (
        SocketAddrV6::new(src, port(l4), 0, 0),
        SocketAddrV6::new(dst, port(l4 + 2), 0, 0),
    )
}

pub fn a6(ip: &Ipv6Addr) -> Addr6 {
    Addr6::from_octets(ip.octets())
}

pub fn ct_key(proto: Proto, src: SocketAddrV6, dst: SocketAddrV6) -> ConntrackKey6 {
    ConntrackKey6 {
        src_addr: a6(src.ip()),
        dst_addr: a6(dst.ip()),
        src_port: port_be(src.port()),
        dst_port: port_be(dst.port()),
        proto: proto.number(),
        _pad0: 0,
        _pad1: 0,
    }
}

pub fn rewrite_of(entry: &ConntrackEntry6) -> (SocketAddrV6, SocketAddrV6) {
    let sock = |a: &Addr6, p: u16| SocketAddrV6::new(a.octets().into(), u16::from_be(p), 0, 0);
    (
        sock(&entry.src_addr, entry.src_port),
        sock(&entry.dst_addr, entry.dst_port),
    )
}

/// A private, unpinned copy of the object: `lb_ingress` and the IPv6 programs loaded, the program
/// array filled as the agent fills it (or left empty).
pub struct Datapath {
    pub ebpf: Ebpf,
}

impl Datapath {
    pub fn new(fill_program_array: bool) -> Self {
        let mut loader = EbpfLoader::new();
        // Small maps: many copies are loaded at once.
        for name in [
            map_name::FRONTENDS,
            map_name::BACKENDS,
            map_name::CONNTRACK,
            map_name::FRONTENDS6,
            map_name::BACKENDS6,
            map_name::CONNTRACK6,
            map_name::CONNTRACK6_UNCONFIRMED,
            map_name::INTERMEDIATE6,
            map_name::INTERMEDIATE6_UNCONFIRMED,
        ] {
            loader.map_max_entries(name, 64);
        }
        let mut ebpf = loader
            .load(lb_user::datapath::EBPF_OBJECT)
            .expect("load the object (run as root)");
        for name in [
            program_name::INGRESS,
            program_name::INGRESS6,
            program_name::EGRESS6,
        ] {
            let program: &mut SchedClassifier = ebpf.program_mut(name).unwrap().try_into().unwrap();
            lb_user::datapath::load_program(|| program.load())
                .unwrap_or_else(|err| panic!("verifier accepts {name}: {err}"));
        }
        if fill_program_array {
            lb_user::datapath::ipv6_programs::fill_program_array(&mut ebpf).unwrap();
        }
        let config = Config {
            flags: CONFIG_F_READY,
            snat_port_min: SNAT_PORT_MIN,
            snat_port_max: SNAT_PORT_MAX,
            clock: lb_user::datapath::kernel_clock().unwrap(),
            ..Config::default()
        };
        let mut array: Array<_, Config> =
            ebpf.map_mut(map_name::CONFIG).unwrap().try_into().unwrap();
        array.set(0, config, 0).unwrap();
        Self { ebpf }
    }

    /// Ready, with the ClusterIP (TCP and UDP) served by `endpoints`.
    pub fn with_cluster_ip(endpoints: &[SocketAddrV6]) -> Self {
        let mut datapath = Self::new(true);
        let mut backends: HashMap<_, BackendKey, Backend6> = datapath
            .ebpf
            .map_mut(map_name::BACKENDS6)
            .unwrap()
            .try_into()
            .unwrap();
        for (slot, endpoint) in (0..).zip(endpoints) {
            let backend = Backend6 {
                addr: a6(endpoint.ip()),
                port: port_be(endpoint.port()),
                stats_slot: 0,
            };
            let key = BackendKey {
                service_id: SERVICE_ID,
                slot,
            };
            backends.insert(key, backend, 0).unwrap();
        }
        let mut frontends: HashMap<_, FrontendKey6, Frontend> = datapath
            .ebpf
            .map_mut(map_name::FRONTENDS6)
            .unwrap()
            .try_into()
            .unwrap();
        for (frontend, flags) in [(CLUSTER_IP, 0), (NODE_PORT, FRONTEND_F_MASQUERADE)] {
            for proto in [Proto::Tcp, Proto::Udp] {
                let key = FrontendKey6 {
                    addr: a6(frontend.ip()),
                    port: port_be(frontend.port()),
                    proto: proto.number(),
                    _pad: 0,
                };
                let frontend = Frontend {
                    service_id: SERVICE_ID,
                    backend_count: endpoints.len() as u32,
                    flags,
                    ..Frontend::default()
                };
                frontends.insert(key, frontend, 0).unwrap();
            }
        }
        datapath
    }

    /// The IPv6 --node-ip NODE and --cluster-cidr fd00:10:244::/48, which holds the pods.
    pub fn set_node_and_cluster_cidr(&mut self) {
        let config6 = Config6 {
            node_addr: a6(&NODE),
            cluster_cidr_addr: a6(&Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0)),
            cluster_cidr_mask: a6(&Ipv6Addr::new(0xffff, 0xffff, 0xffff, 0, 0, 0, 0, 0)),
        };
        let mut array: Array<_, Config6> = self
            .ebpf
            .map_mut(map_name::CONFIG6)
            .unwrap()
            .try_into()
            .unwrap();
        array.set(0, config6, 0).unwrap();
    }

    /// Writes `frontend` at `key` in FRONTENDS6.
    pub fn set_frontend(&mut self, key: FrontendKey6, frontend: Frontend) {
        let mut frontends: HashMap<_, FrontendKey6, Frontend> = self
            .ebpf
            .map_mut(map_name::FRONTENDS6)
            .unwrap()
            .try_into()
            .unwrap();
        frontends.insert(key, frontend, 0).unwrap();
    }

    /// Changes the ClusterIP's TCP frontend with `change`.
    pub fn change_tcp_cluster_ip(&mut self, change: impl FnOnce(&mut Frontend)) {
        let mut frontends: HashMap<_, FrontendKey6, Frontend> = self
            .ebpf
            .map_mut(map_name::FRONTENDS6)
            .unwrap()
            .try_into()
            .unwrap();
        let key = FrontendKey6 {
            addr: a6(CLUSTER_IP.ip()),
            port: port_be(CLUSTER_IP.port()),
            proto: IPPROTO_TCP,
            _pad: 0,
        };
        let mut frontend = frontends.get(&key, 0).unwrap();
        change(&mut frontend);
        frontends.insert(key, frontend, 0).unwrap();
    }

    /// The sessionAffinity entry of `key`.
    pub fn affinity(&self, key: &AffinityKey6) -> Option<StickyBackend6> {
        let map = self.ebpf.map(map_name::AFFINITY6).unwrap();
        let affinity: HashMap<&MapData, AffinityKey6, StickyBackend6> = map.try_into().unwrap();
        affinity.get(key, 0).ok()
    }

    pub fn set_affinity(&mut self, key: AffinityKey6, entry: StickyBackend6) {
        let map = self.ebpf.map_mut(map_name::AFFINITY6).unwrap();
        let mut affinity: HashMap<&mut MapData, AffinityKey6, StickyBackend6> =
            map.try_into().unwrap();
        affinity.insert(key, entry, 0).unwrap();
    }

    /// Runs `lb_ingress` on `packet`.
    pub fn run(&self, packet: &[u8]) -> (u32, Vec<u8>) {
        let program: &SchedClassifier = self
            .ebpf
            .program(program_name::INGRESS)
            .unwrap()
            .try_into()
            .unwrap();
        run_program(program, packet, None)
    }

    /// Runs a packet that must come out untouched with TC_ACT_OK.
    pub fn assert_untouched(&self, packet: &[u8]) {
        let (verdict, output) = self.run(packet);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(output, packet, "untouched");
    }

    /// Runs a packet that must be translated (handed to the stack), and returns its new tuple.
    pub fn translate(
        &self,
        packet: &[u8],
        proto: Proto,
        l4: usize,
    ) -> (SocketAddrV6, SocketAddrV6) {
        let (verdict, output) = self.run(packet);
        assert_eq!(verdict, TC_ACT_OK);
        verify(packet, &output, proto, l4)
    }

    pub fn counter(&self, counter: Counter) -> u64 {
        let map = self.ebpf.map(map_name::COUNTERS).unwrap();
        let counters: PerCpuArray<&MapData, u64> = map.try_into().unwrap();
        counters.get(&(counter as u32), 0).unwrap().iter().sum()
    }

    /// The entry of `key`, in whichever IPv6 conntrack table holds it.
    pub fn conntrack(&self, key: &ConntrackKey6) -> Option<ConntrackEntry6> {
        [map_name::CONNTRACK6, map_name::CONNTRACK6_UNCONFIRMED]
            .into_iter()
            .find_map(|name| {
                let map = self.ebpf.map(name).unwrap();
                let conntrack: HashMap<&MapData, ConntrackKey6, ConntrackEntry6> =
                    map.try_into().unwrap();
                conntrack.get(key, 0).ok()
            })
    }

    pub fn conntrack_len(&self) -> usize {
        let tables = [map_name::CONNTRACK6, map_name::CONNTRACK6_UNCONFIRMED];
        entries::<ConntrackKey6, ConntrackEntry6>(&self.ebpf, &tables)
    }
}
