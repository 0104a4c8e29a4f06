//! The map ABI shared by the eBPF datapath (`lb-ebpf`) and the agent (`lb-user`).
//!
//! Every map key and value is defined here once: `#[repr(C)]`, explicit padding, and with the `user`
//! feature `bytemuck::Pod` (which rejects hidden padding at compile time) and `aya::Pod`.
//!
//! Addresses and ports are stored in network byte order, exactly as they sit in a packet, so the
//! datapath compares and copies them without swapping. [`ipv4_be`] and [`port_be`] convert.
#![no_std]

pub mod masquerade;
pub mod sticky;
pub mod tcp;
pub mod valid;

/// Names of the maps in the eBPF object. Pinned maps carry the ABI version in their name, so an agent
/// with another layout never reuses them.
pub mod map_name {
    pub const FRONTENDS: &str = "LB_FRONTEND_V4";
    pub const BACKENDS: &str = "LB_BACKEND_V1";
    pub const CONNTRACK: &str = "LB_CT_V4";
    pub const CONFIG: &str = "LB_CONFIG_V4";
    pub const COUNTERS: &str = "LB_COUNTER_V11";
    pub const AFFINITY: &str = "LB_AFFINITY_V1";
    pub const ROUND_ROBIN: &str = "LB_RR_V1";
    pub const SOURCE_RANGES: &str = "LB_SOURCE_RANGE_V1";
    pub const SOCK_REVNAT: &str = "LB_SOCK_REVNAT_V1";
    pub const SOCK_BACKEND: &str = "LB_SOCK_BACKEND_V1";
    pub const FRAGMENTS: &str = "LB_FRAGMENT_V2";
    pub const BACKEND_STATS: &str = "LB_BACKEND_STATS_V2";
    pub const FRONTEND_ORIGINS: &str = "LB_FRONTEND_ORIGIN_V1";
    pub const SERVICE_STATUS: &str = "LB_SERVICE_STATUS_V1";
    pub const AGENT: &str = "LB_AGENT_V1";
    /// This CPU's share of the REJECT rate limit (`RejectLimit`), a per-CPU array of one.
    pub const REJECT_LIMIT: &str = "LB_REJECT_LIMIT_V1";
    /// The connections' intermediate tuples, for `lb_egress` (`ConntrackKey` → `ConntrackKey`).
    pub const INTERMEDIATE: &str = "LB_INTERMEDIATE_V1";
    /// Connections whose handshake is not complete (`ConntrackKey` → `ConntrackEntry`, flagged
    /// `CT_F_UNCONFIRMED`): a table of their own, so that a flood of them evicts only its own
    /// kind, never an established connection of `CONNTRACK`.
    pub const CONNTRACK_UNCONFIRMED: &str = "LB_CT_UNCONFIRMED_V1";
    /// The intermediate tuples of the connections in `CONNTRACK_UNCONFIRMED`, as `INTERMEDIATE`.
    pub const INTERMEDIATE_UNCONFIRMED: &str = "LB_INTERMEDIATE_UNCONFIRMED_V1";
    /// The tc programs' IPv6 twins, which `lb_ingress` and `lb_egress` tail-call (a program
    /// array indexed by `tc_ipv6_slot`). Pinned: a program array loses its entries when its last
    /// user reference goes, and the attached programs outlive the agent.
    pub const TC_IPV6_PROGRAMS: &str = "LB_TC_IPV6_PROGRAMS_V1";
    /// `lb_xdp`'s IPv6 twin, which it tail-calls (a program array indexed by `xdp_ipv6_slot`),
    /// pinned as `TC_IPV6_PROGRAMS`.
    pub const XDP_IPV6_PROGRAMS: &str = "LB_XDP_IPV6_PROGRAMS_V1";
    /// Not pinned (not in `ALL`): the interface indexes are the running agent's.
    pub const XDP_EGRESS: &str = "LB_XDP_EGRESS_V1";
    /// Not pinned (not in `ALL`): each CPU's IPv6 conntrack entry under construction
    /// (`ConntrackEntry6`, a per-CPU array of one), kept off the programs' stack.
    pub const CONNTRACK6_SCRATCH: &str = "LB_CT6_SCRATCH_V1";
    /// The IPv6 twins of the maps whose keys or values hold an address (docs/ipv6.md): the
    /// same roles as their IPv4 maps, with `FrontendKey6`, `Backend6`, `ConntrackKey6`, ... The
    /// maps keyed by service id or counter slot (`BACKEND_STATS`, `SERVICE_STATUS`,
    /// `ROUND_ROBIN`) serve both families: one service id space.
    pub const FRONTENDS6: &str = "LB_FRONTEND6_V1";
    pub const BACKENDS6: &str = "LB_BACKEND6_V1";
    pub const CONNTRACK6: &str = "LB_CT6_V1";
    pub const CONNTRACK6_UNCONFIRMED: &str = "LB_CT6_UNCONFIRMED_V1";
    pub const INTERMEDIATE6: &str = "LB_INTERMEDIATE6_V1";
    pub const INTERMEDIATE6_UNCONFIRMED: &str = "LB_INTERMEDIATE6_UNCONFIRMED_V1";
    pub const AFFINITY6: &str = "LB_AFFINITY6_V1";
    pub const SOURCE_RANGES6: &str = "LB_SOURCE_RANGE6_V1";
    pub const FRONTEND_ORIGINS6: &str = "LB_FRONTEND_ORIGIN6_V1";
    /// The IPv6 addresses of the agent's flags (`Config6`); the rest of `CONFIG` holds for both.
    pub const CONFIG6: &str = "LB_CONFIG6_V1";
    /// The socket hooks' IPv6 maps (`SockRevNatKey6` → `SockRevNat6`, `SockBackendKey6` →
    /// `StickyBackend6`). An IPv4-mapped service address on an IPv6 socket uses the IPv4 maps.
    pub const SOCK_REVNAT6: &str = "LB_SOCK_REVNAT6_V1";
    pub const SOCK_BACKEND6: &str = "LB_SOCK_BACKEND6_V1";
    /// `FragmentKey6` → `FirstFragment`, as `FRAGMENTS` for IPv4, sized as it.
    pub const FRAGMENTS6: &str = "LB_FRAGMENT6_V1";
    pub const ALL: [&str; 34] = [
        FRONTENDS,
        BACKENDS,
        CONNTRACK,
        CONFIG,
        COUNTERS,
        AFFINITY,
        ROUND_ROBIN,
        SOURCE_RANGES,
        SOCK_REVNAT,
        SOCK_BACKEND,
        FRAGMENTS,
        BACKEND_STATS,
        FRONTEND_ORIGINS,
        SERVICE_STATUS,
        AGENT,
        INTERMEDIATE,
        REJECT_LIMIT,
        CONNTRACK_UNCONFIRMED,
        INTERMEDIATE_UNCONFIRMED,
        FRONTENDS6,
        BACKENDS6,
        CONNTRACK6,
        CONNTRACK6_UNCONFIRMED,
        INTERMEDIATE6,
        INTERMEDIATE6_UNCONFIRMED,
        AFFINITY6,
        SOURCE_RANGES6,
        FRONTEND_ORIGINS6,
        CONFIG6,
        TC_IPV6_PROGRAMS,
        XDP_IPV6_PROGRAMS,
        SOCK_REVNAT6,
        SOCK_BACKEND6,
        FRAGMENTS6,
    ];
}

/// Slots of `map_name::TC_IPV6_PROGRAMS`.
pub mod tc_ipv6_slot {
    /// `program_name::INGRESS6`, tail-called by `lb_ingress`.
    pub const INGRESS: u32 = 0;
    /// `program_name::EGRESS6`, tail-called by `lb_egress`.
    pub const EGRESS: u32 = 1;
    pub const COUNT: u32 = 2;
}

/// Slots of `map_name::XDP_IPV6_PROGRAMS`.
pub mod xdp_ipv6_slot {
    /// `program_name::XDP6`, tail-called by `lb_xdp`.
    pub const XDP: u32 = 0;
    pub const COUNT: u32 = 1;
}

/// Names of the programs in the eBPF object.
pub mod program_name {
    /// tc ingress on every interface where traffic enters the node (external and pod-side).
    pub const INGRESS: &str = "lb_ingress";
    /// tc egress on the same interfaces: the source half of the translation of packets the
    /// stack forwarded or sent (`--forwarding stack`, and node endpoints in either mode).
    pub const EGRESS: &str = "lb_egress";
    /// XDP on the external interface (`lb agent --xdp`): the fast path of external traffic.
    pub const XDP: &str = "lb_xdp";
    /// `lb_ingress`'s IPv6 twin, tail-called for IPv6 packets (`tc_ipv6_slot::INGRESS`).
    pub const INGRESS6: &str = "lb_ingress6";
    /// `lb_egress`'s IPv6 twin, tail-called for IPv6 packets (`tc_ipv6_slot::EGRESS`).
    pub const EGRESS6: &str = "lb_egress6";
    /// `lb_xdp`'s IPv6 twin, tail-called for IPv6 frames (`xdp_ipv6_slot::XDP`).
    pub const XDP6: &str = "lb_xdp6";
    /// cgroup/connect4: TCP and connected UDP sockets of the node reaching a service.
    pub const CONNECT4: &str = "lb_connect4";
    /// cgroup/sendmsg4: unconnected UDP sockets of the node sending to a service.
    pub const SENDMSG4: &str = "lb_sendmsg4";
    /// cgroup/recvmsg4: a datagram from a backend is shown as from the service address.
    pub const RECVMSG4: &str = "lb_recvmsg4";
    /// cgroup/getpeername4: a connected socket's peer is shown as the service address.
    pub const GETPEERNAME4: &str = "lb_getpeername4";
    /// The IPv6 twins of the four above, for IPv6 sockets: IPv6 service addresses, and
    /// IPv4-mapped ones (`::ffff:10.96.0.10`) served by the IPv4 frontends.
    pub const CONNECT6: &str = "lb_connect6";
    pub const SENDMSG6: &str = "lb_sendmsg6";
    pub const RECVMSG6: &str = "lb_recvmsg6";
    pub const GETPEERNAME6: &str = "lb_getpeername6";
}

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Default map sizes (each is an agent flag).
pub mod default_size {
    /// Frontends: one per (ClusterIP, port, protocol) and per (node address, nodePort, protocol).
    pub const FRONTENDS: u32 = 131_072;
    /// Backend slots: one per endpoint of every service port.
    pub const BACKENDS: u32 = 262_144;
    /// Conntrack entries: two per connection (original and reply direction). Also the size of
    /// the intermediate tuples' map (`map_name::INTERMEDIATE`), two per connection as well.
    pub const CONNTRACK: u32 = 262_144;
    /// Entries of connections whose handshake is not complete (`map_name::CONNTRACK_UNCONFIRMED`,
    /// and as many intermediate tuples). The agent sizes it from `--conntrack-max` and the
    /// masquerade port range (`unconfirmed_size`).
    pub const CONNTRACK_UNCONFIRMED: u32 = 4_096;
    /// sessionAffinity entries: one per (service port, client address).
    pub const AFFINITY: u32 = 65_536;
    /// Round-robin counters: one per service port scheduled `rr`.
    pub const ROUND_ROBIN: u32 = 65_536;
    /// Allowed source prefixes: one per (service port, loadBalancerSourceRanges entry).
    pub const SOURCE_RANGES: u32 = 65_536;
    /// Interfaces `lb_xdp` may redirect into: those the agent serves whose XDP features take
    /// redirects.
    pub const XDP_EGRESS: u32 = 16_384;
    /// Socket reverse translations: one per (node socket, backend it was sent to).
    pub const SOCK_REVNAT: u32 = 65_536;
    /// Unconnected UDP flows of node sockets: one per (socket, service port it sends to).
    pub const SOCK_BACKEND: u32 = 65_536;
    /// Fragmented datagrams of translated flows in flight: one per (source, destination,
    /// protocol, IP ID) whose first fragment has been seen; as many IPv6 ones (`FRAGMENTS6`),
    /// by the fragment header's identification.
    pub const FRAGMENTS: u32 = 8_192;
    /// Traffic counter slots of backends: one per (service port, endpoint), slot 0 unused. A
    /// per-CPU array, allocated whole on every CPU: 16,384 × 32 B = 512 KiB per CPU (32 MiB on
    /// 64 CPUs). At most `MAX_BACKEND_STATS`.
    pub const BACKEND_STATS: u32 = 16_384;
}

/// The most counter slots `Backend::stats_slot` can index (slot 0 included).
pub const MAX_BACKEND_STATS: u32 = 1 << 16;

/// Masquerade source ports are taken from this range by default: above Linux's default ephemeral
/// range (32768-60999), so they never collide with the node's own sockets.
pub const SNAT_PORT_MIN: u16 = 61_000;
pub const SNAT_PORT_MAX: u16 = 65_535;

/// IPv4 address as the u32 that holds its bytes in network order (as read from a packet).
pub const fn ipv4_be(octets: [u8; 4]) -> u32 {
    u32::from_ne_bytes(octets)
}

/// Port as the u16 that holds its bytes in network order.
pub const fn port_be(port: u16) -> u16 {
    port.to_be()
}

/// Key of `FRONTENDS`: where a service is reached. A ClusterIP port and a NodePort of the same
/// service port are two frontends with the same `service_id`.
///
/// [`FrontendKey::any_port`] of a ClusterIP holds a frontend without backends: a connection to a
/// port the service does not define is rejected, as kube-proxy does.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FrontendKey {
    /// Network byte order.
    pub addr: u32,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}

impl FrontendKey {
    /// The catch-all key of a ClusterIP (port 0, protocol 0), looked up when no port matches.
    pub const fn any_port(addr: u32) -> Self {
        Self {
            addr,
            port: 0,
            proto: 0,
            _pad: 0,
        }
    }
}

/// Value of `FRONTENDS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Frontend {
    /// Key prefix of this service port's slots in `BACKENDS`.
    pub service_id: u32,
    /// Slots `0..backend_count` hold the endpoints for traffic policy Cluster; 0 means the
    /// service has none anywhere, and new connections are rejected (ICMP port unreachable).
    pub backend_count: u32,
    /// Slots `LOCAL_SLOT..LOCAL_SLOT + local_count` hold the endpoints on this node, for
    /// traffic policy Local (`FRONTEND_F_LOCAL`); none there while the service has some
    /// elsewhere: dropped.
    pub local_count: u32,
    /// `FRONTEND_F_*`.
    pub flags: u32,
    /// sessionAffinity ClientIP: a client's new connections go to the endpoint of its last one
    /// while it is idle less than this many seconds. 0: no affinity.
    pub affinity_timeout_s: u32,
    /// `SCHED_*`: how a new connection picks its slot.
    pub scheduler: u32,
}

/// A uniformly random slot (kube-proxy's iptables `statistic --mode random`).
pub const SCHED_RANDOM: u32 = 0;
/// The next slot of a per-service-port counter (IPVS `rr`).
pub const SCHED_ROUND_ROBIN: u32 = 1;
/// [`source_hash`] of the client address (IPVS `sh`).
pub const SCHED_SOURCE_HASH: u32 = 2;
/// [`flow_hash`] of the 5-tuple; the agent fills the lists with a Maglev lookup table, so this
/// is consistent hashing (IPVS `mh`, per flow).
pub const SCHED_FLOW_HASH: u32 = 3;

/// murmur3's finaliser: every input bit reaches every output bit.
pub const fn mix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// The `sh` hash of a client address (network byte order).
pub const fn source_hash(addr: u32) -> u32 {
    mix32(addr ^ 0x9e37_79b9)
}

/// The Maglev hash of a connection's 5-tuple as it arrives.
pub const fn flow_hash(tuple: &ConntrackKey) -> u32 {
    let h = mix32(tuple.src_addr ^ 0x9e37_79b9);
    let h = mix32(h ^ tuple.dst_addr);
    mix_ports_and_proto(h, tuple.src_port, tuple.dst_port, tuple.proto)
}

/// The `sh` hash of an IPv6 client address: [`source_hash`] over its four words, so that
/// clients differing in any of them (not only the interface identifier) spread.
pub const fn source_hash6(addr: &Addr6) -> u32 {
    mix_addr6(0x9e37_79b9, addr)
}

/// The Maglev hash of an IPv6 connection's 5-tuple as it arrives, as [`flow_hash`].
pub const fn flow_hash6(tuple: &ConntrackKey6) -> u32 {
    let h = mix_addr6(0x9e37_79b9, &tuple.src_addr);
    let h = mix_addr6(h, &tuple.dst_addr);
    mix_ports_and_proto(h, tuple.src_port, tuple.dst_port, tuple.proto)
}

/// `h` with the four words of `addr` mixed in, one at a time.
const fn mix_addr6(h: u32, addr: &Addr6) -> u32 {
    let h = mix32(h ^ addr.w0);
    let h = mix32(h ^ addr.w1);
    let h = mix32(h ^ addr.w2);
    mix32(h ^ addr.w3)
}

/// The end of both families' flow hashes: `h` with the ports and the protocol mixed in.
const fn mix_ports_and_proto(h: u32, src_port: u16, dst_port: u16, proto: u8) -> u32 {
    let ports = ((src_port as u32) << 16) | dst_port as u32;
    let h = mix32(h ^ ports);
    mix32(h ^ proto as u32)
}

/// The frontend is reached from outside the cluster (a NodePort): masquerade new connections
/// (externalTrafficPolicy: Cluster).
pub const FRONTEND_F_MASQUERADE: u32 = 1 << 0;
/// Traffic policy Local (internalTrafficPolicy for a ClusterIP, externalTrafficPolicy for a
/// NodePort): only endpoints on this node, the `LOCAL_SLOT` list.
pub const FRONTEND_F_LOCAL: u32 = 1 << 1;
/// externalTrafficPolicy: Local on a NodePort: the backend sees the client's address (no
/// masquerade but hairpin), and sources in the cluster CIDR use the Cluster list, as kube-proxy
/// short-circuits pod traffic to external destinations.
pub const FRONTEND_F_PRESERVE_SOURCE: u32 = 1 << 2;

/// A LoadBalancer ingress IP of a service with loadBalancerSourceRanges: a new connection is
/// served only from a source in a `SOURCE_RANGES` prefix of its service port, else dropped.
pub const FRONTEND_F_SOURCE_RANGES: u32 = 1 << 3;

/// `BackendKey::slot` bit of the Local list of a service port.
pub const LOCAL_SLOT: u32 = 1 << 31;

/// Key of `BACKENDS`: slot `slot` of service port `service_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct BackendKey {
    pub service_id: u32,
    pub slot: u32,
}

/// Value of `BACKENDS`: one endpoint.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Backend {
    /// Network byte order.
    pub addr: u32,
    /// Network byte order.
    pub port: u16,
    /// The index in `BACKEND_STATS` of this endpoint's counters in its service port, the same in
    /// every slot and list the endpoint fills; 0: not counted (the agent ran out of slots).
    /// Not part of the endpoint's identity: compare [`Backend::endpoint`]s.
    pub stats_slot: u16,
}

impl Backend {
    /// The endpoint alone, without its counter slot: what keys and comparisons of endpoints
    /// hold, so that they match an address read from a packet or a socket.
    pub const fn endpoint(&self) -> Backend {
        Backend {
            addr: self.addr,
            port: self.port,
            stats_slot: 0,
        }
    }
}

/// Value of `BACKEND_STATS`, a per-CPU array indexed by `Backend::stats_slot`: what went through
/// one endpoint of a service port, both directions, as `ipvsadm --stats` counts a real server.
///
/// The agent gives each (service port, endpoint) a slot and, before any backend refers to it,
/// writes it zeroed with `owner`, a tag of the endpoint, on every CPU. A new connection copies
/// the slot and its owner into its conntrack entries; its packets are counted only while the
/// slot still has that owner, so the connections of an endpoint that left its service port
/// (whose slot is then another endpoint's) do not count there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct BackendStats {
    pub connections: u64,
    pub packets: u64,
    /// IPv4 total lengths.
    pub bytes: u64,
    /// Which endpoint the slot counts now (never 0 for an assigned slot).
    pub owner: u32,
    /// New connections dropped because no masquerade port towards this endpoint was free
    /// (`Counter::DropSnatPortsExhausted`, per endpoint). Where the padding was: the layout is
    /// unchanged, and earlier datapaths left it 0.
    pub ports_exhausted: u32,
}

impl BackendStats {
    /// One slot's per-CPU values added up; `owner` is the first CPU's (a claim writes the same
    /// owner on every CPU).
    pub fn sum<'a>(per_cpu: impl IntoIterator<Item = &'a BackendStats>) -> BackendStats {
        let mut per_cpu = per_cpu.into_iter().peekable();
        let owner = per_cpu.peek().map_or(0, |cpu| cpu.owner);
        per_cpu.fold(
            BackendStats {
                owner,
                ..BackendStats::default()
            },
            |sum, cpu| BackendStats {
                connections: sum.connections + cpu.connections,
                packets: sum.packets + cpu.packets,
                bytes: sum.bytes + cpu.bytes,
                ports_exhausted: sum.ports_exhausted.wrapping_add(cpu.ports_exhausted),
                ..sum
            },
        )
    }
}

/// Value of `FRONTEND_ORIGINS` (keyed by `FrontendKey`): which Service port a frontend is and
/// how it is reached, for `lb services`. Only the agent reads and writes it; the datapath never
/// touches it. Names are NUL-padded UTF-8, at Kubernetes' length limits (DNS labels of 63
/// characters, port names of 15).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FrontendOrigin {
    pub namespace: [u8; 64],
    pub name: [u8; 64],
    pub port_name: [u8; 16],
    /// `KIND_*`.
    pub kind: u32,
}

impl FrontendOrigin {
    /// Names longer than their field (not valid in Kubernetes) are cut.
    pub fn new(namespace: &str, name: &str, port_name: &str, kind: u32) -> Self {
        FrontendOrigin {
            namespace: text_field(namespace),
            name: text_field(name),
            port_name: text_field(port_name),
            kind,
        }
    }

    /// A name field as text, without its NUL padding.
    pub fn text(field: &[u8]) -> &str {
        field_text(field)
    }

    pub const fn kind_name(&self) -> &'static str {
        match self.kind {
            KIND_CLUSTER_IP => "ClusterIP",
            KIND_NODE_PORT => "NodePort",
            KIND_EXTERNAL_IP => "externalIP",
            KIND_LOAD_BALANCER => "LoadBalancer",
            _ => "unknown",
        }
    }
}

/// `text` as a NUL-padded field of `N` bytes, cut (at a character boundary) if longer.
pub fn text_field<const N: usize>(text: &str) -> [u8; N] {
    let mut len = text.len().min(N);
    while !text.is_char_boundary(len) {
        len -= 1;
    }
    let mut bytes = [0; N];
    bytes[..len].copy_from_slice(&text.as_bytes()[..len]);
    bytes
}

/// A NUL-padded text field as text.
pub fn field_text(field: &[u8]) -> &str {
    let len = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    core::str::from_utf8(&field[..len]).unwrap_or("?")
}

/// Value of `SERVICE_STATUS`, keyed by service id: what the agent wants the service maps to
/// hold for one Service port, recorded at each sync next to the maps, so that `lb status` can
/// compare it with what they hold, with or without an agent running. Only the agent writes it
/// and `lb status` reads it; the datapath never touches it. Texts are NUL-padded UTF-8.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceStatus {
    pub namespace: [u8; 64],
    pub name: [u8; 64],
    pub port_name: [u8; 16],
    /// Network byte order: its catch-all frontend is counted with the port's entries.
    pub cluster_ip: u32,
    /// `IPPROTO_*`.
    pub proto: u32,
    /// A checksum of the port's desired entries (computed by the agent, `lb_user::reconcile::sync_status`).
    pub digest: u32,
    /// How many entries of each map the port's desired entries are.
    pub frontends: u32,
    pub backends: u32,
    pub source_ranges: u32,
    pub origins: u32,
    /// Map writes of the port that failed in the sync that recorded it; 0: none.
    pub failed_writes: u32,
    /// The first failed write: the operation and the error.
    pub error: [u8; 128],
}

/// The single value of `AGENT` (index 0): which agent writes the maps and how its syncs go, for
/// `lb status`. Times are wall-clock Unix seconds (the datapath has no wall clock); only the
/// agent writes it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AgentInfo {
    /// NUL-padded.
    pub version: [u8; 32],
    pub started_at_s: u64,
    /// When the last sync ended; 0: none yet.
    pub last_sync_at_s: u64,
    /// Map writes that failed in the last sync; 0: it wrote everything.
    pub last_sync_failed_writes: u32,
    /// Services and ready endpoints as of the last sync.
    pub services: u32,
    pub endpoints: u32,
    pub _pad: u32,
}

pub const KIND_CLUSTER_IP: u32 = 0;
pub const KIND_NODE_PORT: u32 = 1;
pub const KIND_EXTERNAL_IP: u32 = 2;
pub const KIND_LOAD_BALANCER: u32 = 3;

/// The data of a `SOURCE_RANGES` key. The map is an LPM trie, whose key is the kernel's prefix
/// length (in bits of this struct, from its start) followed by this: a prefix of
/// `SourceRangeKey::SERVICE_ID_BITS + n` allows the sources whose first `n` address bits match
/// `addr` to reach the `FRONTEND_F_SOURCE_RANGES` frontends of `service_id`. A packet is looked up
/// with the full length, `SourceRangeKey::FULL_PREFIX`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SourceRangeKey {
    /// Always matched whole; any byte order works, as lookups and entries use the same.
    pub service_id: u32,
    /// Network byte order (the trie matches bytes in order, so the prefix is the address's).
    pub addr: u32,
}

impl SourceRangeKey {
    pub const SERVICE_ID_BITS: u32 = 32;
    pub const FULL_PREFIX: u32 = Self::SERVICE_ID_BITS + 32;
}

/// Key of `AFFINITY`: a client of a service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityKey {
    pub service_id: u32,
    /// Network byte order.
    pub client_addr: u32,
}

/// Value of `AFFINITY` and `SOCK_BACKEND`: the endpoint a client's (or socket's) last new flow
/// went to, and the slot (of either list) it sat in.
/// It is used again only while slot `slot` still holds `backend`: an endpoint that is gone (or
/// moved) gets no more of its flows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct StickyBackend {
    /// The datapath's clock (`Clock`) at the flow's last use.
    pub last_seen_ns: u64,
    pub backend: Backend,
    pub slot: u32,
    pub _pad: u32,
}

/// Key of `CONNTRACK`: the 5-tuple of a packet as it arrives, before any translation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ConntrackKey {
    /// Network byte order.
    pub src_addr: u32,
    /// Network byte order.
    pub dst_addr: u32,
    /// Network byte order.
    pub src_port: u16,
    /// Network byte order.
    pub dst_port: u16,
    pub proto: u8,
    // Padding as scalars, not a byte array: the BPF target zeroes and copies arrays with
    // byte-loop memset/memcpy calls, a cost on every packet.
    pub _pad0: u8,
    pub _pad1: u16,
}

/// Value of `CONNTRACK`: what a packet with that key is rewritten to. Each connection has two
/// entries: the original direction (client → frontend, rewritten to → backend) and the reply
/// direction (`CT_F_REPLY`: backend → client or node, rewritten to frontend → client). The reply
/// entry's rewrite is the original key turned around, so either entry finds the other.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ConntrackEntry {
    /// The datapath's clock (`Clock`) at the last packet.
    pub last_seen_ns: u64,
    /// New source address, network byte order.
    pub src_addr: u32,
    /// New destination address, network byte order.
    pub dst_addr: u32,
    /// New source port, network byte order.
    pub src_port: u16,
    /// New destination port, network byte order.
    pub dst_port: u16,
    pub service_id: u32,
    /// The connection's state, the same in both entries: `tcp::*` for TCP, `CT_UDP_*` for UDP.
    pub state: u8,
    /// `CT_F_*`.
    pub flags: u8,
    /// The IPv4 total length `hop` was resolved for: packets up to it take `hop`, a longer one
    /// asks the FIB again (which checks it against the MTU). 0: no hop cached.
    pub hop_len: u16,
    pub hop: CachedHop,
    /// The connection's endpoint counters (`Backend::stats_slot`; 0: not counted) and their
    /// `BackendStats::owner` when it was made, the same in both entries: an established packet
    /// finds its counters by index, with no hash lookup.
    pub stats_slot: u32,
    pub stats_owner: u32,
    /// TCP: this direction's sequence space, for the window check (zero for UDP).
    pub window: tcp::TcpWindow,
}

/// The route the FIB gave an entry's rewritten packets, kept by the datapath until the entry is
/// next refreshed (at most about a second), so that a connection's packets are not each looked
/// up: in on `iif`, out of `ifindex`, with the destination and source MACs `macs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CachedHop {
    pub ifindex: u32,
    pub iif: u32,
    /// The 12 bytes of the Ethernet header's MACs as they are in memory, in words. Scalars, not an
    /// array: the BPF target zeroes and copies arrays with byte-loop calls.
    pub macs0: u32,
    pub macs1: u32,
    pub macs2: u32,
}

/// An IPv6 address in network byte order, as the four 32-bit words that hold its bytes as they
/// sit in a packet (`w0` the first four). Scalars, not a byte array: the BPF target zeroes and
/// copies arrays with byte-loop memset/memcpy calls, and compares words four at a time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Addr6 {
    pub w0: u32,
    pub w1: u32,
    pub w2: u32,
    pub w3: u32,
}

impl Addr6 {
    /// The address of `octets` (`Ipv6Addr::octets`).
    pub const fn from_octets(o: [u8; 16]) -> Self {
        Addr6 {
            w0: u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
            w1: u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
            w2: u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
            w3: u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
        }
    }

    /// The address's 16 bytes, in order.
    pub const fn octets(&self) -> [u8; 16] {
        let [a, b, c, d] = self.w0.to_ne_bytes();
        let [e, f, g, h] = self.w1.to_ne_bytes();
        let [i, j, k, l] = self.w2.to_ne_bytes();
        let [m, n, o, p] = self.w3.to_ne_bytes();
        [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p]
    }
}

/// Key of `FRONTENDS6`: [`FrontendKey`] of an IPv6 address. Its value is a [`Frontend`], whose
/// `service_id` is in the one id space of both families: a dual-stack service port's IPv4 and
/// IPv6 frontends have the same id, and their backend lists are in `BACKENDS` and `BACKENDS6`
/// under the same [`BackendKey`]s.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FrontendKey6 {
    pub addr: Addr6,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}

impl FrontendKey6 {
    /// The catch-all key of a ClusterIP, as [`FrontendKey::any_port`].
    pub const fn any_port(addr: Addr6) -> Self {
        Self {
            addr,
            port: 0,
            proto: 0,
            _pad: 0,
        }
    }
}

/// Value of `BACKENDS6` (keyed by [`BackendKey`]): one IPv6 endpoint, as [`Backend`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Backend6 {
    pub addr: Addr6,
    /// Network byte order.
    pub port: u16,
    /// As [`Backend::stats_slot`]: the slots of `BACKEND_STATS` are shared by both families.
    pub stats_slot: u16,
}

impl Backend6 {
    /// The endpoint alone, without its counter slot, as [`Backend::endpoint`].
    pub const fn endpoint(&self) -> Backend6 {
        Backend6 {
            addr: self.addr,
            port: self.port,
            stats_slot: 0,
        }
    }
}

/// Key of `CONNTRACK6`, `CONNTRACK6_UNCONFIRMED`, and key and value of `INTERMEDIATE6` and
/// `INTERMEDIATE6_UNCONFIRMED`: [`ConntrackKey`] of an IPv6 packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ConntrackKey6 {
    pub src_addr: Addr6,
    pub dst_addr: Addr6,
    /// Network byte order.
    pub src_port: u16,
    /// Network byte order.
    pub dst_port: u16,
    pub proto: u8,
    // Scalars, as in `ConntrackKey`.
    pub _pad0: u8,
    pub _pad1: u16,
}

/// Value of `CONNTRACK6` and `CONNTRACK6_UNCONFIRMED`: [`ConntrackEntry`] with IPv6 addresses,
/// field for field, so that the conntrack code is written once over both.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ConntrackEntry6 {
    pub last_seen_ns: u64,
    /// New source address.
    pub src_addr: Addr6,
    /// New destination address.
    pub dst_addr: Addr6,
    /// New source port, network byte order.
    pub src_port: u16,
    /// New destination port, network byte order.
    pub dst_port: u16,
    pub service_id: u32,
    pub state: u8,
    /// `CT_F_*`.
    pub flags: u8,
    /// The length `hop` was resolved for, counted as IPv4's total length is: the whole packet
    /// from the IPv6 header on (payload length + 40, extension headers included), which is
    /// what the FIB's MTU check compares. 0: no hop cached.
    pub hop_len: u16,
    pub hop: CachedHop,
    pub stats_slot: u32,
    pub stats_owner: u32,
    pub window: tcp::TcpWindow,
}

/// The data of a `SOURCE_RANGES6` key, as [`SourceRangeKey`]: a prefix of
/// `SERVICE_ID_BITS + n` matches the first `n` bits of `addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SourceRangeKey6 {
    pub service_id: u32,
    pub addr: Addr6,
}

impl SourceRangeKey6 {
    pub const SERVICE_ID_BITS: u32 = 32;
    pub const FULL_PREFIX: u32 = Self::SERVICE_ID_BITS + 128;
}

/// Key of `AFFINITY6`: an IPv6 client of a service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityKey6 {
    pub service_id: u32,
    pub client_addr: Addr6,
}

/// Value of `AFFINITY6`: [`StickyBackend`] of an IPv6 endpoint.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct StickyBackend6 {
    pub last_seen_ns: u64,
    pub backend: Backend6,
    pub slot: u32,
}

/// The single value of `CONFIG6` (index 0): the IPv6 addresses of the agent's flags. All zero
/// on a node without an IPv6 `--node-ip`. Everything else of `Config` holds for both families.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Config6 {
    /// The IPv6 --node-ip: the masquerade address where the FIB picks none.
    pub node_addr: Addr6,
    /// The IPv6 --cluster-cidr; sources outside it are masqueraded. Without one the agent
    /// writes ::/128, which holds no source, as IPv4's 0.0.0.0/32.
    pub cluster_cidr_addr: Addr6,
    pub cluster_cidr_mask: Addr6,
}

/// Map layouts of earlier releases, which an upgrading agent converts into today's (the pinned
/// maps of a running datapath are never reused under another layout).
pub mod legacy {
    use super::{
        CT_UDP_STREAM, CachedHop, ConntrackEntry, IPPROTO_TCP,
        tcp::{self, TcpWindow},
    };

    /// The conntrack map before TCP states and windows were tracked (`ConntrackEntryV3`
    /// values, the same `ConntrackKey`).
    pub const CONNTRACK_V3: &str = "LB_CT_V3";

    /// `LB_CT_V3`'s `state`: only the first direction seen (TCP: SYN sent).
    pub const V3_STATE_NEW: u8 = 0;
    /// Both directions seen.
    pub const V3_STATE_ESTABLISHED: u8 = 1;
    /// A TCP FIN or RST seen, in either direction, in or out of the window.
    pub const V3_STATE_CLOSING: u8 = 2;

    /// `LB_CT_V3`'s value: today's [`ConntrackEntry`] without its TCP window.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    #[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
    pub struct ConntrackEntryV3 {
        pub last_seen_ns: u64,
        pub src_addr: u32,
        pub dst_addr: u32,
        pub src_port: u16,
        pub dst_port: u16,
        pub service_id: u32,
        pub state: u8,
        pub flags: u8,
        pub hop_len: u16,
        pub hop: CachedHop,
        pub stats_slot: u32,
        pub stats_owner: u32,
    }

    impl ConntrackEntryV3 {
        /// The connection carried over from V3's three states, erring towards keeping it: a
        /// connection that saw a SYN only stays in the handshake; an established one is
        /// established (a UDP one a stream); a closing one, which may be half-closed and still
        /// sending, waits as after a first FIN.
        pub const fn converted_state(proto: u8, state: u8) -> u8 {
            match (proto == IPPROTO_TCP, state) {
                (true, V3_STATE_NEW) => tcp::SYN_SENT,
                (true, V3_STATE_CLOSING) => tcp::FIN_WAIT,
                (true, _) => tcp::ESTABLISHED,
                (false, V3_STATE_NEW) => super::CT_UDP_UNREPLIED,
                (false, _) => CT_UDP_STREAM,
            }
        }

        /// The same connection, in `proto`'s state (see `converted_state`), its windows not
        /// known: the window check passes its segments until it has learned them.
        pub fn converted(&self, proto: u8) -> ConntrackEntry {
            ConntrackEntry {
                last_seen_ns: self.last_seen_ns,
                src_addr: self.src_addr,
                dst_addr: self.dst_addr,
                src_port: self.src_port,
                dst_port: self.dst_port,
                service_id: self.service_id,
                state: Self::converted_state(proto, self.state),
                flags: self.flags,
                hop_len: self.hop_len,
                hop: self.hop,
                stats_slot: self.stats_slot,
                stats_owner: self.stats_owner,
                window: TcpWindow {
                    wscale: tcp::WSCALE_UNKNOWN,
                    ..TcpWindow::default()
                },
            }
        }
    }

    /// The conntrack map before connections held their endpoint's counter slot
    /// (`ConntrackEntryV2` values, the same `ConntrackKey`).
    pub const CONNTRACK_V2: &str = "LB_CT_V2";

    /// `LB_CT_V2`'s value: today's [`ConntrackEntry`] without its counter slot.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    #[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
    pub struct ConntrackEntryV2 {
        pub last_seen_ns: u64,
        pub src_addr: u32,
        pub dst_addr: u32,
        pub src_port: u16,
        pub dst_port: u16,
        pub service_id: u32,
        pub state: u8,
        pub flags: u8,
        pub hop_len: u16,
        pub hop: CachedHop,
    }

    impl From<ConntrackEntryV2> for ConntrackEntryV3 {
        /// The same connection and cached route, not counted (slot 0): which counters it would
        /// have had is not known.
        fn from(old: ConntrackEntryV2) -> Self {
            ConntrackEntryV3 {
                last_seen_ns: old.last_seen_ns,
                src_addr: old.src_addr,
                dst_addr: old.dst_addr,
                src_port: old.src_port,
                dst_port: old.dst_port,
                service_id: old.service_id,
                state: old.state,
                flags: old.flags,
                hop_len: old.hop_len,
                hop: old.hop,
                stats_slot: 0,
                stats_owner: 0,
            }
        }
    }

    /// The conntrack map before connections cached their route (`ConntrackEntryV1` values, the
    /// same `ConntrackKey`).
    pub const CONNTRACK_V1: &str = "LB_CT_V1";

    /// `LB_CT_V1`'s value: `ConntrackEntryV2` without its cached route.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    #[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
    pub struct ConntrackEntryV1 {
        pub last_seen_ns: u64,
        pub src_addr: u32,
        pub dst_addr: u32,
        pub src_port: u16,
        pub dst_port: u16,
        pub service_id: u32,
        pub state: u8,
        pub flags: u8,
        pub _pad0: u16,
        pub _pad1: u32,
    }

    impl From<ConntrackEntryV1> for ConntrackEntryV3 {
        /// The same connection, with no route cached (its next packet asks the FIB), not
        /// counted.
        fn from(old: ConntrackEntryV1) -> Self {
            ConntrackEntryV3::from(ConntrackEntryV2 {
                last_seen_ns: old.last_seen_ns,
                src_addr: old.src_addr,
                dst_addr: old.dst_addr,
                src_port: old.src_port,
                dst_port: old.dst_port,
                service_id: old.service_id,
                state: old.state,
                flags: old.flags,
                hop_len: 0,
                hop: CachedHop::default(),
            })
        }
    }

    const _: () = assert!(core::mem::size_of::<ConntrackEntryV1>() == 32);
    const _: () = assert!(core::mem::size_of::<ConntrackEntryV2>() == 48);
    const _: () = assert!(core::mem::size_of::<ConntrackEntryV3>() == 56);
}

/// The entry translates replies (backend → client).
pub const CT_F_REPLY: u8 = 1 << 0;
/// The connection is masqueraded (source rewritten to a node address).
pub const CT_F_MASQUERADE: u8 = 1 << 1;
/// The entry is in `CONNTRACK_UNCONFIRMED`: its connection's handshake is not complete
/// (`confirms`).
pub const CT_F_UNCONFIRMED: u8 = 1 << 2;

/// Whether a packet that moves a connection not yet confirmed from `old` to `new` (`reply`: it
/// travels from the server) confirms it: moves it into the main conntrack table, where only
/// established flows are, and which a flood of new connections does not evict. Linux's
/// conntrack sets ASSURED at the same points. TCP: the client's ACK that completes the handshake
/// (SYN_RECV → ESTABLISHED), or for a connection picked up mid-stream (opened ESTABLISHED by an
/// ACK) the server's answer. Not the SYN-ACK: a backend answers a spoofed SYN too, and that
/// answer crosses the node. UDP: the client sending again after a reply (a stream).
pub const fn confirms(proto: u8, old: u8, new: u8, reply: bool) -> bool {
    if proto == IPPROTO_TCP {
        new == tcp::ESTABLISHED && (old == tcp::SYN_RECV || old == tcp::ESTABLISHED && reply)
    } else {
        new == CT_UDP_STREAM
    }
}

/// The size of the unconfirmed connections' table (`map_name::CONNTRACK_UNCONFIRMED`) for a
/// main table of `conntrack_max` entries and `masquerade_ports` ports in the masquerade range: at
/// most the main table's, and at most as many entries as ports. Each connection holds two
/// entries and one port, so unconfirmed connections (a SYN flood) hold at most half of any
/// backend's ports: a new connection's 16 random tries all find a held port with a probability
/// below 2^-16. At least 2, one connection.
pub const fn unconfirmed_size(conntrack_max: u32, masquerade_ports: u32) -> u32 {
    let size = if conntrack_max < masquerade_ports {
        conntrack_max
    } else {
        masquerade_ports
    };
    if size < 2 { 2 } else { size }
}

/// UDP: only the first direction has been seen.
pub const CT_UDP_UNREPLIED: u8 = 0;
/// UDP: a reply has been seen.
pub const CT_UDP_REPLIED: u8 = 1;
/// UDP: the client sent again after a reply: a stream (Linux's ASSURED UDP flow), which gets
/// `udp_stream_s`.
pub const CT_UDP_STREAM: u8 = 2;

/// The UDP state after a datagram (`reply`: from the server) of a flow in `state`.
pub const fn udp_step(state: u8, reply: bool) -> u8 {
    match state {
        CT_UDP_UNREPLIED if reply => CT_UDP_REPLIED,
        CT_UDP_REPLIED if !reply => CT_UDP_STREAM,
        other => other,
    }
}

/// The name of a connection's `state`: Linux's (`conntrack -L`), in lower case.
pub const fn conntrack_state_name(proto: u8, state: u8) -> &'static str {
    if proto == IPPROTO_TCP {
        return match state {
            tcp::SYN_SENT => "syn_sent",
            tcp::SYN_RECV => "syn_recv",
            tcp::ESTABLISHED => "established",
            tcp::FIN_WAIT => "fin_wait",
            tcp::CLOSE_WAIT => "close_wait",
            tcp::LAST_ACK => "last_ack",
            tcp::TIME_WAIT => "time_wait",
            tcp::CLOSE => "close",
            tcp::SYN_SENT2 => "syn_sent2",
            _ => "none",
        };
    }
    match state {
        CT_UDP_UNREPLIED => "unreplied",
        CT_UDP_REPLIED => "replied",
        CT_UDP_STREAM => "stream",
        _ => "unknown",
    }
}

const SECOND_NS: u64 = 1_000_000_000;

/// The timeouts the agent's flags set (kube-proxy's `--conntrack-*` names), in seconds.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ConntrackTimeouts {
    pub tcp_established_s: u32,
    pub tcp_close_wait_s: u32,
    /// UDP flows not (yet) a stream.
    pub udp_s: u32,
    pub udp_stream_s: u32,
}

impl ConntrackTimeouts {
    /// kube-proxy's defaults (established 24 h, close-wait 1 h) and Linux's for UDP (its
    /// `nf_conntrack_udp_timeout` and `_stream`, which kube-proxy leaves as they are unless
    /// told).
    pub const KUBE_PROXY: ConntrackTimeouts = ConntrackTimeouts {
        tcp_established_s: 24 * 3600,
        tcp_close_wait_s: 3600,
        udp_s: 30,
        udp_stream_s: 120,
    };
}

impl ConntrackTimeouts {
    /// Linux's defaults, which a flag of "0" keeps (kube-proxy then leaves the sysctl alone).
    pub const LINUX: ConntrackTimeouts = ConntrackTimeouts {
        tcp_established_s: 5 * 24 * 3600,
        tcp_close_wait_s: 60,
        udp_s: 30,
        udp_stream_s: 120,
    };
}

impl Default for ConntrackTimeouts {
    fn default() -> Self {
        Self::KUBE_PROXY
    }
}

/// Linux's fixed TCP timeouts (`nf_conntrack_tcp_timeout_*`), in seconds, for the states
/// kube-proxy leaves alone.
pub mod tcp_timeout_s {
    pub const SYN_SENT: u32 = 120;
    pub const SYN_RECV: u32 = 60;
    pub const FIN_WAIT: u32 = 120;
    pub const LAST_ACK: u32 = 30;
    pub const TIME_WAIT: u32 = 120;
    pub const CLOSE: u32 = 10;
}

/// How long an idle connection in `state` stays valid.
pub const fn conntrack_timeout_ns(proto: u8, state: u8, timeouts: &ConntrackTimeouts) -> u64 {
    let seconds = if proto == IPPROTO_TCP {
        match state {
            tcp::SYN_SENT | tcp::SYN_SENT2 => tcp_timeout_s::SYN_SENT,
            tcp::SYN_RECV => tcp_timeout_s::SYN_RECV,
            tcp::ESTABLISHED => timeouts.tcp_established_s,
            tcp::FIN_WAIT => tcp_timeout_s::FIN_WAIT,
            tcp::CLOSE_WAIT => timeouts.tcp_close_wait_s,
            tcp::LAST_ACK => tcp_timeout_s::LAST_ACK,
            tcp::TIME_WAIT => tcp_timeout_s::TIME_WAIT,
            _ => tcp_timeout_s::CLOSE,
        }
    } else if state == CT_UDP_STREAM {
        timeouts.udp_stream_s
    } else {
        timeouts.udp_s
    };
    seconds as u64 * SECOND_NS
}

/// The single value of `CONFIG` (index 0): the agent's flags the datapath needs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Config {
    /// --node-ip, network byte order: the masquerade address where the FIB picks none (a local
    /// destination), and what the node's own sockets key service lookups on.
    pub node_addr: u32,
    /// --cluster-cidr, network byte order; sources outside it are masqueraded.
    pub cluster_cidr_addr: u32,
    /// Network byte order.
    pub cluster_cidr_mask: u32,
    /// `CONFIG_F_*`.
    pub flags: u32,
    /// Masquerade source port range, host byte order, inclusive.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// `--iptables-masquerade-bit` as a mask (`1 << bit`): set in `skb->mark` of a masqueraded
    /// connection's client packets handed to the stack, as kube-proxy's KUBE-MARK-MASQ, so that
    /// the agent's FORWARD rule (`LB-FORWARD`) accepts them on a node whose FORWARD policy is
    /// DROP. 0 marks nothing. (Was padding: the layout is unchanged.)
    pub masquerade_mark: u32,
    /// The agent's network namespace (SO_NETNS_COOKIE): the socket hooks translate only sockets
    /// in it, as a cgroup holds processes of every namespace.
    pub netns_cookie: u64,
    pub clock: Clock,
    pub timeouts: ConntrackTimeouts,
}

/// One CPU's token bucket for REJECT replies (ICMP port unreachable), as the kernel limits the
/// ICMP errors it sends with `net.ipv4.icmp_msgs_per_sec` and `icmp_msgs_burst`: the agent
/// gives each CPU its share of the node's rate and burst (the kernel's bucket is one for all
/// CPUs; the BPF target has no atomics in Rust, so each CPU keeps its own). Tokens are counted
/// in ns of credit: a reply costs `cost_ns`, the bucket holds at most `capacity_ns`, and it
/// fills at one ns per ns. An entry no agent wrote (`cost_ns` 0) limits nothing.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RejectLimit {
    pub cost_ns: u64,
    pub capacity_ns: u64,
    pub tokens_ns: u64,
    /// When the tokens were last counted, on the datapath's clock.
    pub stamp_ns: u64,
}

impl RejectLimit {
    /// One CPU's share of `per_sec` replies a second with bursts of `burst`, over `cpus` CPUs;
    /// full. A rate of 0 allows no reply, as the kernel's.
    pub fn new(per_sec: u32, burst: u32, cpus: u32) -> Self {
        let cpus = u64::from(cpus.max(1));
        let share = u64::from(burst).div_ceil(cpus).max(1);
        let (cost_ns, capacity_ns) = match u64::from(per_sec) {
            // Never enough tokens.
            0 => (u64::MAX, 0),
            per_sec => {
                let cost_ns = (SECOND_NS * cpus).div_ceil(per_sec);
                (cost_ns, cost_ns.saturating_mul(share))
            }
        };
        RejectLimit {
            cost_ns,
            capacity_ns,
            tokens_ns: capacity_ns,
            stamp_ns: 0,
        }
    }

    /// Takes a reply's tokens at `now_ns`; false when there are not enough.
    pub fn take(&mut self, now_ns: u64) -> bool {
        if self.cost_ns == 0 {
            return true;
        }
        let elapsed = now_ns.saturating_sub(self.stamp_ns);
        let tokens = self.tokens_ns.saturating_add(elapsed).min(self.capacity_ns);
        self.stamp_ns = now_ns;
        let allowed = tokens >= self.cost_ns;
        self.tokens_ns = if allowed {
            tokens - self.cost_ns
        } else {
            tokens
        };
        allowed
    }
}

/// The datapath's clock, in which every timestamp of the maps (`last_seen_ns`) is: the kernel's
/// jiffies counted in ns from INITIAL_JIFFIES, which reads as CLOCK_MONOTONIC at tick resolution
/// but for a constant offset (the jiffies lag it by 0.26 s on the development machine).
/// Jiffies because the verifier inlines `bpf_jiffies64` into a load, where the clock helper call
/// cost ~35 ns a packet. With a zero `tick_ns` (no agent wrote it) the clock stands at 0:
/// nothing ages.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Clock {
    /// The jiffies counter at the clock's zero: the kernel's INITIAL_JIFFIES (300 s of ticks
    /// before its 32-bit wrap, so that wrap bugs show early).
    pub jiffies_at_zero: u64,
    /// One jiffy (1 / CONFIG_HZ s) in ns: the resolution of CLOCK_MONOTONIC_COARSE.
    pub tick_ns: u32,
    pub _pad: u32,
}

impl Clock {
    /// The clock of a kernel whose jiffy is `tick_ns` long.
    pub const fn with_tick(tick_ns: u32) -> Self {
        if tick_ns == 0 {
            return Clock {
                jiffies_at_zero: 0,
                tick_ns: 0,
                _pad: 0,
            };
        }
        let hz = (SECOND_NS + tick_ns as u64 / 2) / tick_ns as u64;
        Clock {
            // INITIAL_JIFFIES is ((unsigned long)(unsigned int)(-300 * HZ)).
            jiffies_at_zero: (300 * hz as u32).wrapping_neg() as u64,
            tick_ns,
            _pad: 0,
        }
    }

    /// The time in ns when the kernel's jiffies counter reads `jiffies`.
    pub const fn ns(&self, jiffies: u64) -> u64 {
        jiffies
            .wrapping_sub(self.jiffies_at_zero)
            .wrapping_mul(self.tick_ns as u64)
    }
}

/// Key of `SOCK_REVNAT`: a socket of the node (`bpf_get_socket_cookie`) and the backend its
/// connect or sendmsg to a service was pointed to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockRevNatKey {
    pub cookie: u64,
    pub backend: Backend,
}

/// Key of `SOCK_BACKEND`: an unconnected UDP socket of the node and a service port it sends
/// datagrams to, which all go to one backend while the flow is in use, as conntrack keeps a
/// 5-tuple on one endpoint in kube-proxy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockBackendKey {
    pub cookie: u64,
    pub frontend: FrontendKey,
}

/// Key of `FRAGMENTS`: what identifies the fragments of one IPv4 datagram (RFC 791).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FragmentKey {
    /// Network byte order.
    pub src_addr: u32,
    /// Network byte order.
    pub dst_addr: u32,
    /// Network byte order.
    pub id: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// Key of `FRAGMENTS6`: what identifies the fragments of one IPv6 datagram (RFC 8200 4.5: the
/// addresses and the fragment header's 32-bit identification), and its transport protocol, as
/// [`FragmentKey`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FragmentKey6 {
    pub src_addr: Addr6,
    pub dst_addr: Addr6,
    /// Network byte order.
    pub id: u32,
    pub proto: u8,
    // Scalars, as in `ConntrackKey`.
    pub _pad0: u8,
    pub _pad1: u16,
}

/// Value of `FRAGMENTS` and `FRAGMENTS6`: what the datagram's first fragment told, so that the later ones find the
/// same connection (its ports, which only the first carries) and overlaps are seen.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FirstFragment {
    /// When the first fragment was seen (the datapath's clock): after `FRAGMENT_TIMEOUT_NS` the
    /// record is of an earlier datagram that had the same IP ID.
    pub seen_ns: u64,
    /// Network byte order.
    pub src_port: u16,
    /// Network byte order.
    pub dst_port: u16,
    /// Where the first fragment's payload ends, in bytes from the start of the datagram's payload
    /// (IPv6: of its fragmentable part, after the fragment header).
    pub end: u16,
    pub _pad: u16,
}

/// How long the fragments of one datagram are followed: Linux's `ipfrag_time` default, how long
/// its reassembly waits for a datagram's fragments.
pub const FRAGMENT_TIMEOUT_NS: u64 = 30 * SECOND_NS;

/// Value of `SOCK_REVNAT`: the service address the application used, shown to it as the peer
/// (getpeername) or the source of what the backend sends (recvmsg).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockRevNat {
    /// Network byte order.
    pub addr: u32,
    /// Network byte order.
    pub port: u16,
    pub _pad: u16,
}

/// Key of `SOCK_REVNAT6`: [`SockRevNatKey`] of an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockRevNatKey6 {
    pub cookie: u64,
    pub backend: Backend6,
    pub _pad: u32,
}

/// Value of `SOCK_REVNAT6`: [`SockRevNat`] of an IPv6 service address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockRevNat6 {
    pub addr: Addr6,
    /// Network byte order.
    pub port: u16,
    pub _pad: u16,
}

/// Key of `SOCK_BACKEND6`: [`SockBackendKey`] of an IPv6 service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockBackendKey6 {
    pub cookie: u64,
    pub frontend: FrontendKey6,
    pub _pad: u32,
}

/// --masquerade-all.
pub const CONFIG_F_MASQUERADE_ALL: u32 = 1 << 0;
/// The agent has written this config; until then the datapath passes everything.
pub const CONFIG_F_READY: u32 = 1 << 1;
/// --forwarding stack: `lb_ingress` rewrites destinations and hands packets to the stack, whose
/// forwarding path (netfilter's FORWARD and POSTROUTING) they cross; `lb_egress` rewrites
/// sources. Without it, `lb_ingress` translates fully and redirects to the egress interface.
pub const CONFIG_F_STACK_FORWARDING: u32 = 1 << 2;

/// Indexes of `COUNTERS`, a per-CPU array of u64 packet counts.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// A new connection to a frontend was translated.
    NewConnection = 0,
    /// Of those, masqueraded.
    Masqueraded,
    /// A packet of a tracked connection was translated (either direction).
    Translated,
    /// Not service traffic, passed untouched.
    Passed,
    /// Truncated or inconsistent header, or an ICMP fragment: passed untouched.
    PassedUnparsed,
    /// Dropped: the frontend counts a backend slot that is not in the map.
    DropNoBackend,
    /// Dropped: traffic policy Local and no endpoint on this node (the service has some
    /// elsewhere).
    DropNoLocalBackend,
    /// Dropped: a conntrack insert failed.
    DropConntrackFull,
    /// Dropped: no free masquerade port for this backend.
    DropSnatPortsExhausted,
    /// Dropped: a packet rewrite helper failed.
    DropRewriteFailed,
    /// Translated, but not redirected (`--forwarding redirect`): the FIB had no forwarding
    /// answer, the destination is local (a node endpoint), or the packet is too big for its
    /// link without DF (the stack fragments it). Handed to the stack.
    FibFallback,
    /// A new connection to a service without endpoints, or to a port a ClusterIP does not
    /// define: answered with ICMP port unreachable.
    Rejected,
    /// Dropped: a new connection to a LoadBalancer IP from a source outside the service's
    /// loadBalancerSourceRanges.
    DropSourceRange,
    /// XDP translated a packet and redirected it (counted with NewConnection or Translated).
    XdpForwarded,
    /// XDP left a packet untouched to the stack, where tc handles and counts it: not service
    /// traffic, one tc must answer (REJECT, TTL 1, ICMP), one whose next hop's MAC is unresolved,
    /// or one whose egress interface is not in `XDP_EGRESS`.
    /// Such a packet of a new connection counts NewConnection in XDP, then Translated in tc.
    XdpPassed,
    /// An ICMP error about a tracked connection was reverse-translated (outer and quoted
    /// headers) and forwarded (tc only).
    IcmpErrorTranslated,
    /// A later IPv4 fragment of no translated datagram (not service traffic, or its first
    /// fragment not seen yet): passed untouched.
    PassedFragment,
    /// The IPv4 header checksum is wrong: passed untouched, for the stack to drop (ip_rcv) and
    /// count (`InCsumErrors`) as it does without us.
    PassedBadIpChecksum,
    /// Dropped: a TCP data offset below 5 words or beyond the segment, which Linux's conntrack
    /// holds invalid and its TCP discards.
    DropBadTcpHeader,
    /// Dropped: a UDP length below 8 or beyond the IP payload, which Linux's conntrack holds
    /// invalid and its UDP discards.
    DropBadUdpLength,
    /// Dropped: a TCP flag combination Linux's conntrack holds invalid (`tcp_valid_flags`: no
    /// flags, SYN with FIN or RST, FIN without ACK, "xmas"...).
    DropBadTcpFlags,
    /// Dropped: an IPv4 fragment that overlaps the datagram's first fragment (a second first
    /// fragment with other ports or length, or a later one starting inside the first), for
    /// which Linux's reassembly discards the whole datagram.
    DropFragmentOverlap,
    /// Dropped: a new connection's translated tuple is another connection's (a client reaching
    /// two frontends of one backend from one port), and no free source port of the range was
    /// found to remap it to; or one of its intermediate tuples (between tc ingress and egress)
    /// is another live connection's.
    DropTupleClash,
    /// Dropped: a TCP RST or FIN outside its connection's window (Linux's `tcp_in_window`),
    /// which leaves the connection's state as it was. Linux's conntrack marks such a segment
    /// INVALID and kube-proxy's KUBE-FORWARD drops INVALID packets.
    DropTcpOutOfWindow,
    /// A TCP RST, FIN or SYN-ACK of no tracked connection, which cannot open one (Linux's
    /// conntrack holds it INVALID): passed untouched, untracked.
    PassedTcpNoConnection,
    /// lb_egress rewrote the source (masquerade, or the service address of a reply) of a
    /// packet the stack forwarded or sent.
    EgressTranslated,
    /// `--forwarding redirect`: a packet with DF set too big for its egress link, answered
    /// with ICMP fragmentation needed (the link's MTU) as the stack's forwarding would; an IPv6
    /// packet (IPv6 routers never fragment) with ICMPv6 Packet Too Big.
    FragmentationNeeded,
    /// Dropped: a REJECT (ICMP port unreachable) over the rate the node's `icmp_msgs_per_sec`
    /// and `icmp_msgs_burst` allow, as the kernel limits its own ICMP errors.
    DropRejectRateLimited,
    /// A connection completed its handshake (TCP) or became a stream (UDP) and moved from the
    /// unconfirmed connections' table to the main one (`confirms`).
    ConntrackConfirmed,
    /// A new connection took over the conntrack entry of an expired connection (or of the
    /// closed one it reopens): deleted, then inserted only if no other CPU's insert came first.
    ConntrackTakenOver,
    /// A connection completing its handshake found its other direction's entry gone from the
    /// unconfirmed table: evicted by newer unconfirmed connections (a flood fills that table,
    /// not the main one). It stays unconfirmed and is not translated in that direction.
    ConntrackUnconfirmedEvicted,
    /// Every masquerade port a new connection tried was held, some by unconfirmed connections:
    /// one of those was dropped and its port taken (Linux's early_drop of unassured entries).
    ConntrackEarlyDrop,
    /// An IPv6 packet whose extension header chain the parser does not walk (longer than it
    /// follows, truncated, or AH/ESP before the transport header): passed untouched.
    PassedIpv6ExtensionHeader,
    /// The tail call into an IPv6 program failed (its slot empty: the agent had not filled the
    /// program array yet): the packet passed untouched.
    PassedTailCallFailed,
}

impl Counter {
    pub const COUNT: u32 = 34;
    pub const ALL: [Counter; Self::COUNT as usize] = [
        Counter::NewConnection,
        Counter::Masqueraded,
        Counter::Translated,
        Counter::Passed,
        Counter::PassedUnparsed,
        Counter::DropNoBackend,
        Counter::DropNoLocalBackend,
        Counter::DropConntrackFull,
        Counter::DropSnatPortsExhausted,
        Counter::DropRewriteFailed,
        Counter::FibFallback,
        Counter::Rejected,
        Counter::DropSourceRange,
        Counter::XdpForwarded,
        Counter::XdpPassed,
        Counter::IcmpErrorTranslated,
        Counter::PassedFragment,
        Counter::PassedBadIpChecksum,
        Counter::DropBadTcpHeader,
        Counter::DropBadUdpLength,
        Counter::DropBadTcpFlags,
        Counter::DropFragmentOverlap,
        Counter::DropTupleClash,
        Counter::DropTcpOutOfWindow,
        Counter::PassedTcpNoConnection,
        Counter::EgressTranslated,
        Counter::FragmentationNeeded,
        Counter::DropRejectRateLimited,
        Counter::ConntrackConfirmed,
        Counter::ConntrackTakenOver,
        Counter::ConntrackUnconfirmedEvicted,
        Counter::ConntrackEarlyDrop,
        Counter::PassedIpv6ExtensionHeader,
        Counter::PassedTailCallFailed,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Counter::NewConnection => "new_connection",
            Counter::Masqueraded => "masqueraded",
            Counter::Translated => "translated",
            Counter::Passed => "passed",
            Counter::PassedUnparsed => "passed_unparsed",
            Counter::DropNoBackend => "drop_no_backend",
            Counter::DropNoLocalBackend => "drop_no_local_backend",
            Counter::DropConntrackFull => "drop_conntrack_full",
            Counter::DropSnatPortsExhausted => "drop_snat_ports_exhausted",
            Counter::DropRewriteFailed => "drop_rewrite_failed",
            Counter::FibFallback => "fib_fallback",
            Counter::Rejected => "rejected",
            Counter::DropSourceRange => "drop_source_range",
            Counter::XdpForwarded => "xdp_forwarded",
            Counter::XdpPassed => "xdp_passed",
            Counter::IcmpErrorTranslated => "icmp_error_translated",
            Counter::PassedFragment => "passed_fragment",
            Counter::PassedBadIpChecksum => "passed_bad_ip_checksum",
            Counter::DropBadTcpHeader => "drop_bad_tcp_header",
            Counter::DropBadUdpLength => "drop_bad_udp_length",
            Counter::DropBadTcpFlags => "drop_bad_tcp_flags",
            Counter::DropFragmentOverlap => "drop_fragment_overlap",
            Counter::DropTupleClash => "drop_tuple_clash",
            Counter::DropTcpOutOfWindow => "drop_tcp_out_of_window",
            Counter::PassedTcpNoConnection => "passed_tcp_no_connection",
            Counter::EgressTranslated => "egress_translated",
            Counter::FragmentationNeeded => "fragmentation_needed",
            Counter::DropRejectRateLimited => "drop_reject_rate_limited",
            Counter::ConntrackConfirmed => "conntrack_confirmed",
            Counter::ConntrackTakenOver => "conntrack_taken_over",
            Counter::ConntrackUnconfirmedEvicted => "conntrack_unconfirmed_evicted",
            Counter::ConntrackEarlyDrop => "conntrack_early_drop",
            Counter::PassedIpv6ExtensionHeader => "passed_ipv6_extension_header",
            Counter::PassedTailCallFailed => "passed_tail_call_failed",
        }
    }

    /// What the counter counts, in one line, for `lb stats`.
    pub const fn meaning(self) -> &'static str {
        match self {
            Counter::NewConnection => "new connections to a service, translated to a backend",
            Counter::Masqueraded => {
                "new connections whose source was masqueraded to a node address (of new_connection)"
            }
            Counter::Translated => "packets of tracked connections translated (either direction)",
            Counter::Passed => "packets that are not service traffic, passed untouched",
            Counter::PassedUnparsed => {
                "packets with a truncated or inconsistent header, or ICMP fragments, passed untouched"
            }
            Counter::DropNoBackend => {
                "dropped: the service's backend slot is missing from the backend map"
            }
            Counter::DropNoLocalBackend => {
                "dropped: traffic policy Local and no endpoint on this node (there are some elsewhere)"
            }
            Counter::DropConntrackFull => "dropped: the conntrack map refused a new connection",
            Counter::DropSnatPortsExhausted => {
                "dropped: no free masquerade source port towards the backend"
            }
            Counter::DropRewriteFailed => "dropped: rewriting the packet failed",
            Counter::FibFallback => {
                "packets translated but without a route lookup answer, handed to the kernel stack"
            }
            Counter::Rejected => {
                "new connections to a service without endpoints (or an undefined port), answered with ICMP port unreachable"
            }
            Counter::DropSourceRange => {
                "dropped: a LoadBalancer IP reached from outside its loadBalancerSourceRanges"
            }
            Counter::XdpForwarded => {
                "packets translated and redirected by XDP (also counted as new_connection or translated)"
            }
            Counter::XdpPassed => "packets XDP left to tc, which handles and counts them",
            Counter::IcmpErrorTranslated => {
                "ICMP errors about tracked connections, reverse-translated and forwarded"
            }
            Counter::PassedFragment => {
                "later IPv4 and IPv6 fragments of no translated datagram, passed untouched"
            }
            Counter::DropTupleClash => {
                "dropped: a new connection's translated tuple is another's and no free source port was found to remap it"
            }
            Counter::EgressTranslated => {
                "packets the stack forwarded or sent whose source tc egress translated (masquerade, or a reply's service address)"
            }
            Counter::PassedBadIpChecksum => {
                "packets with a wrong IPv4 header checksum, passed untouched for the stack to drop"
            }
            Counter::DropBadTcpHeader => {
                "dropped: a TCP data offset below 5 words or beyond the segment"
            }
            Counter::DropBadUdpLength => "dropped: a UDP length below 8 or beyond the IP payload",
            Counter::DropBadTcpFlags => {
                "dropped: a TCP flag combination Linux's conntrack holds invalid (null, SYN+FIN, xmas...)"
            }
            Counter::DropFragmentOverlap => {
                "dropped: an IPv4 or IPv6 fragment overlapping its datagram's first fragment"
            }
            Counter::DropTcpOutOfWindow => {
                "dropped: a TCP RST or FIN outside its connection's window (its state unchanged)"
            }
            Counter::PassedTcpNoConnection => {
                "TCP RST, FIN or SYN-ACK packets of no tracked connection, passed untouched and untracked"
            }
            Counter::FragmentationNeeded => {
                "packets with DF set (every IPv6 packet) too big for the egress link (--forwarding redirect), answered with ICMP fragmentation needed (ICMPv6 Packet Too Big)"
            }
            Counter::DropRejectRateLimited => {
                "dropped: ICMP port unreachable replies (REJECT) over the node's icmp_msgs_per_sec/icmp_msgs_burst"
            }
            Counter::ConntrackConfirmed => {
                "connections that completed their handshake (UDP: became a stream), moved to the main conntrack table"
            }
            Counter::ConntrackTakenOver => {
                "conntrack entries of expired (or reopened closed) connections taken over by a new connection"
            }
            Counter::ConntrackUnconfirmedEvicted => {
                "connections completing their handshake whose other direction was evicted from the unconfirmed table (a flood)"
            }
            Counter::ConntrackEarlyDrop => {
                "unconfirmed connections dropped for their masquerade port: every port a new connection tried was held"
            }
            Counter::PassedIpv6ExtensionHeader => {
                "IPv6 packets with an extension header chain the parser does not walk, passed untouched"
            }
            Counter::PassedTailCallFailed => {
                "IPv6 packets passed untouched because the IPv6 program was not installed (tail call failed)"
            }
        }
    }

    /// The reason, as a user reads it (like Cilium's drop reasons), when the counter counts
    /// dropped packets; `None` for every other counter. `lb stats` groups drops by it.
    pub const fn drop_reason(self) -> Option<&'static str> {
        match self {
            Counter::DropNoBackend => Some("Service backend not found"),
            Counter::DropNoLocalBackend => Some("No local endpoint (traffic policy Local)"),
            Counter::DropConntrackFull => Some("Conntrack map full"),
            Counter::DropSnatPortsExhausted => Some("Masquerade ports exhausted"),
            Counter::DropRewriteFailed => Some("Packet rewrite failed"),
            Counter::DropSourceRange => Some("Source outside loadBalancerSourceRanges"),
            Counter::DropTupleClash => Some("NAT tuple clash, no port to remap"),
            Counter::DropBadTcpHeader => Some("Invalid TCP header (data offset)"),
            Counter::DropBadUdpLength => Some("Invalid UDP length"),
            Counter::DropBadTcpFlags => Some("Invalid TCP flags"),
            Counter::DropFragmentOverlap => Some("Overlapping fragment"),
            Counter::DropTcpOutOfWindow => Some("TCP RST or FIN outside the window"),
            Counter::DropRejectRateLimited => Some("REJECT reply rate-limited"),
            Counter::NewConnection
            | Counter::Masqueraded
            | Counter::Translated
            | Counter::Passed
            | Counter::PassedUnparsed
            | Counter::FibFallback
            | Counter::Rejected
            | Counter::XdpForwarded
            | Counter::XdpPassed
            | Counter::IcmpErrorTranslated
            | Counter::PassedFragment
            | Counter::PassedBadIpChecksum
            | Counter::PassedTcpNoConnection
            | Counter::EgressTranslated
            | Counter::FragmentationNeeded
            | Counter::ConntrackConfirmed
            | Counter::ConntrackTakenOver
            | Counter::ConntrackUnconfirmedEvicted
            | Counter::ConntrackEarlyDrop
            | Counter::PassedIpv6ExtensionHeader
            | Counter::PassedTailCallFailed => None,
        }
    }
}

const _: () = {
    assert!(core::mem::size_of::<FrontendKey>() == 8);
    assert!(core::mem::size_of::<Frontend>() == 24);
    assert!(core::mem::size_of::<AffinityKey>() == 8);
    assert!(core::mem::size_of::<StickyBackend>() == 24);
    assert!(core::mem::size_of::<BackendKey>() == 8);
    assert!(core::mem::size_of::<Backend>() == 8);
    assert!(core::mem::size_of::<BackendStats>() == 32);
    assert!(core::mem::size_of::<FrontendOrigin>() == 148);
    assert!(core::mem::size_of::<ServiceStatus>() == 304);
    assert!(core::mem::size_of::<AgentInfo>() == 64);
    assert!(core::mem::size_of::<ConntrackKey>() == 16);
    assert!(core::mem::size_of::<ConntrackEntry>() == 64);
    assert!(core::mem::size_of::<SourceRangeKey>() * 8 == SourceRangeKey::FULL_PREFIX as usize);
    assert!(core::mem::size_of::<Config>() == 64);
    assert!(core::mem::size_of::<SockRevNatKey>() == 16);
    assert!(core::mem::size_of::<SockRevNat>() == 8);
    assert!(core::mem::size_of::<SockBackendKey>() == 16);
    assert!(core::mem::size_of::<FragmentKey>() == 12);
    assert!(core::mem::size_of::<FirstFragment>() == 16);
    assert!(core::mem::size_of::<FragmentKey6>() == 40);
    assert!(core::mem::size_of::<RejectLimit>() == 32);
    assert!(core::mem::size_of::<Addr6>() == 16);
    assert!(core::mem::size_of::<FrontendKey6>() == 20);
    assert!(core::mem::size_of::<Backend6>() == 20);
    assert!(core::mem::size_of::<ConntrackKey6>() == 40);
    assert!(core::mem::size_of::<ConntrackEntry6>() == 88);
    assert!(core::mem::size_of::<SourceRangeKey6>() * 8 == SourceRangeKey6::FULL_PREFIX as usize);
    assert!(core::mem::size_of::<AffinityKey6>() == 20);
    assert!(core::mem::size_of::<StickyBackend6>() == 32);
    assert!(core::mem::size_of::<Config6>() == 48);
    assert!(core::mem::size_of::<SockRevNatKey6>() == 32);
    assert!(core::mem::size_of::<SockRevNat6>() == 20);
    assert!(core::mem::size_of::<SockBackendKey6>() == 32);
    assert!(Counter::ALL[Counter::COUNT as usize - 1] as u32 == Counter::COUNT - 1);
};

#[cfg(feature = "user")]
mod user {
    use super::*;

    // SAFETY: all of these are #[repr(C)] with explicit padding; bytemuck::Pod (derived above)
    // checks at compile time that they have no hidden padding and accept any bit pattern.
    unsafe impl aya::Pod for FrontendKey {}
    unsafe impl aya::Pod for Frontend {}
    unsafe impl aya::Pod for BackendKey {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for BackendStats {}
    unsafe impl aya::Pod for FrontendOrigin {}
    unsafe impl aya::Pod for ServiceStatus {}
    unsafe impl aya::Pod for AgentInfo {}
    unsafe impl aya::Pod for ConntrackKey {}
    unsafe impl aya::Pod for ConntrackEntry {}
    unsafe impl aya::Pod for legacy::ConntrackEntryV1 {}
    unsafe impl aya::Pod for legacy::ConntrackEntryV2 {}
    unsafe impl aya::Pod for legacy::ConntrackEntryV3 {}
    unsafe impl aya::Pod for ConntrackTimeouts {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for Clock {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for StickyBackend {}
    unsafe impl aya::Pod for SourceRangeKey {}
    unsafe impl aya::Pod for SockRevNatKey {}
    unsafe impl aya::Pod for SockRevNat {}
    unsafe impl aya::Pod for SockBackendKey {}
    unsafe impl aya::Pod for FragmentKey {}
    unsafe impl aya::Pod for FirstFragment {}
    unsafe impl aya::Pod for FragmentKey6 {}
    unsafe impl aya::Pod for RejectLimit {}
    unsafe impl aya::Pod for Addr6 {}
    unsafe impl aya::Pod for FrontendKey6 {}
    unsafe impl aya::Pod for Backend6 {}
    unsafe impl aya::Pod for ConntrackKey6 {}
    unsafe impl aya::Pod for ConntrackEntry6 {}
    unsafe impl aya::Pod for SourceRangeKey6 {}
    unsafe impl aya::Pod for AffinityKey6 {}
    unsafe impl aya::Pod for StickyBackend6 {}
    unsafe impl aya::Pod for Config6 {}
    unsafe impl aya::Pod for SockRevNatKey6 {}
    unsafe impl aya::Pod for SockRevNat6 {}
    unsafe impl aya::Pod for SockBackendKey6 {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::valid::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

    /// `2001:db8::<last>` with word `word` also set to `extra` (words in the packet's order).
    fn addr6(last: u8, word: usize, extra: u32) -> Addr6 {
        let mut octets = [0u8; 16];
        octets[..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
        octets[15] = last;
        let mut addr = Addr6::from_octets(octets);
        match word {
            0 => addr.w0 ^= extra,
            1 => addr.w1 ^= extra,
            2 => addr.w2 ^= extra,
            _ => addr.w3 ^= extra,
        }
        addr
    }

    fn tuple6(src: Addr6, src_port: u16) -> ConntrackKey6 {
        ConntrackKey6 {
            src_addr: src,
            dst_addr: addr6(0x10, 0, 0),
            src_port: port_be(src_port),
            dst_port: port_be(80),
            proto: IPPROTO_TCP,
            _pad0: 0,
            _pad1: 0,
        }
    }

    /// Counts per slot of a table of `N` slots over `hashes`.
    fn spread<const N: usize>(hashes: impl Iterator<Item = u32>) -> [u32; N] {
        let mut hits = [0; N];
        for h in hashes {
            hits[h as usize % N] += 1;
        }
        hits
    }

    /// One flow always lands on one slot; the flows of one client (other source ports) spread
    /// evenly over a Maglev table; every part of the 5-tuple counts, each word of both
    /// addresses included.
    #[test]
    fn ipv6_flow_hash_keeps_a_flow_and_spreads_flows() {
        let client = addr6(0x20, 0, 0);
        let flow = tuple6(client, 40000);
        assert_eq!(flow_hash6(&flow), flow_hash6(&tuple6(client, 40000)));
        let hits: [_; 3] = spread((10_000..13_000).map(|p| flow_hash6(&tuple6(client, p))));
        assert!(hits.iter().all(|h| (900..=1100).contains(h)), "{hits:?}");
        let table: [_; 211] = spread((10_000..31_100).map(|p| flow_hash6(&tuple6(client, p))));
        assert!(table.iter().all(|h| (50..=150).contains(h)), "{table:?}");

        let base = flow_hash6(&flow);
        for word in 0..4 {
            let src = tuple6(addr6(0x20, word, 1 << 20), 40000);
            assert_ne!(flow_hash6(&src), base, "source word {word}");
            let dst = ConntrackKey6 {
                dst_addr: addr6(0x10, word, 1 << 20),
                ..flow
            };
            assert_ne!(flow_hash6(&dst), base, "destination word {word}");
        }
        let other_port = ConntrackKey6 {
            dst_port: port_be(81),
            ..flow
        };
        let udp = ConntrackKey6 {
            proto: IPPROTO_UDP,
            ..flow
        };
        assert_ne!(flow_hash6(&other_port), base);
        assert_ne!(flow_hash6(&udp), base);
    }

    /// Clients spread evenly, whichever word they differ in (a /64 of pods differs in the last
    /// ones, clients of other networks in the first).
    #[test]
    fn ipv6_source_hash_spreads_clients_by_every_word() {
        for word in 0..4 {
            let hits: [_; 3] = spread(
                (0..3000u32).map(|i| source_hash6(&addr6(0x20, word, i.wrapping_mul(0x0101)))),
            );
            assert!(
                hits.iter().all(|h| (900..=1100).contains(h)),
                "word {word}: {hits:?}"
            );
        }
    }

    #[test]
    fn a_tcp_connection_is_confirmed_by_the_handshake_s_last_ack_only() {
        let flags = [
            TCP_SYN,
            TCP_SYN | TCP_ACK,
            TCP_ACK,
            TCP_RST,
            TCP_FIN | TCP_ACK,
        ];
        // A spoofed SYN flood: the SYN, the backend's SYN-ACK, nothing from the client after.
        let mut state = tcp::NONE;
        for (flags, reply) in [(TCP_SYN, false), (TCP_SYN | TCP_ACK, true)] {
            let tcp::Step::To(next) = tcp::step(state, reply, flags) else {
                panic!("{flags:#x} from {state}");
            };
            assert!(!confirms(IPPROTO_TCP, state, next, reply));
            state = next;
        }
        let tcp::Step::To(established) = tcp::step(state, false, TCP_ACK) else {
            panic!("the client's ACK");
        };
        assert!(confirms(IPPROTO_TCP, state, established, false));
        // A connection picked up by a client's ACK: the server's answer confirms it, not the
        // client's next segment.
        assert!(!confirms(
            IPPROTO_TCP,
            tcp::ESTABLISHED,
            tcp::ESTABLISHED,
            false
        ));
        assert!(confirms(
            IPPROTO_TCP,
            tcp::ESTABLISHED,
            tcp::ESTABLISHED,
            true
        ));
        // Nothing else does: a handshake that ends in a RST or a FIN stays unconfirmed.
        for old in 0..10 {
            for flags in flags {
                for reply in [false, true] {
                    let tcp::Step::To(new) = tcp::step(old, reply, flags) else {
                        continue;
                    };
                    let expected = new == tcp::ESTABLISHED
                        && (old == tcp::SYN_RECV || old == tcp::ESTABLISHED && reply);
                    assert_eq!(confirms(IPPROTO_TCP, old, new, reply), expected);
                }
            }
        }
    }

    #[test]
    fn a_udp_flow_is_confirmed_once_a_stream() {
        let replied = udp_step(CT_UDP_UNREPLIED, true);
        assert!(!confirms(IPPROTO_UDP, CT_UDP_UNREPLIED, replied, true));
        let stream = udp_step(replied, false);
        assert!(confirms(IPPROTO_UDP, replied, stream, false));
    }

    #[test]
    fn unconfirmed_connections_hold_at_most_half_the_masquerade_ports() {
        let ports = u32::from(SNAT_PORT_MAX - SNAT_PORT_MIN) + 1;
        assert_eq!(unconfirmed_size(default_size::CONNTRACK, ports), ports);
        assert_eq!(unconfirmed_size(1024, ports), 1024);
        assert_eq!(unconfirmed_size(0, ports), 2);
        for (max, ports) in [(1 << 20, 100), (64, 4536), (1 << 18, 28_232)] {
            // Two entries per connection, one port each.
            assert!(unconfirmed_size(max, ports) / 2 <= ports / 2 + 1);
        }
    }

    #[test]
    fn reject_limit_allows_the_burst_then_the_rate() {
        // The kernel's defaults over 2 CPUs: 500 a second and a burst of 25 each.
        let mut limit = RejectLimit::new(1000, 50, 2);
        let t0 = 10 * SECOND_NS;
        let burst = (0..100).filter(|_| limit.take(t0)).count();
        assert_eq!(burst, 25);
        // 10 ms later: 5 more.
        let later = (0..100)
            .filter(|_| limit.take(t0 + SECOND_NS / 100))
            .count();
        assert_eq!(later, 5);
        // Idle for long: no more than the burst.
        let after_idle = (0..100)
            .filter(|_| limit.take(t0 + 100 * SECOND_NS))
            .count();
        assert_eq!(after_idle, 25);
    }

    #[test]
    fn reject_limit_edges() {
        let mut none = RejectLimit::new(0, 50, 2);
        assert!(!none.take(SECOND_NS));
        assert!(!none.take(1000 * SECOND_NS));
        let mut unwritten = RejectLimit::default();
        assert!((0..1000).all(|_| unwritten.take(0)));
        // A burst below the CPU count still lets each CPU answer one.
        let mut small = RejectLimit::new(1000, 1, 4);
        assert!(small.take(SECOND_NS));
        assert!(!small.take(SECOND_NS));
    }

    #[test]
    fn clock_counts_from_the_kernels_initial_jiffies() {
        // CONFIG_HZ 250 and 300 (whose jiffy rounds to 3,333,333 ns).
        let clock = Clock::with_tick(4_000_000);
        assert_eq!(clock.jiffies_at_zero, (1 << 32) - 300 * 250);
        assert_eq!(clock.ns(clock.jiffies_at_zero), 0);
        assert_eq!(clock.ns(clock.jiffies_at_zero + 250), SECOND_NS);
        let clock = Clock::with_tick(3_333_333);
        assert_eq!(clock.jiffies_at_zero, (1 << 32) - 300 * 300);
        assert_eq!(clock.ns(clock.jiffies_at_zero + 3), 9_999_999);
        assert_eq!(Clock::with_tick(0).ns(12_345), 0);
    }

    #[test]
    fn long_texts_are_cut_at_a_character_boundary() {
        let field: [u8; 4] = text_field("abcé");
        assert_eq!(field_text(&field), "abc");
        let field: [u8; 8] = text_field("ns");
        assert_eq!(field_text(&field), "ns");
    }

    #[test]
    fn ipv6_words_hold_the_address_bytes_in_packet_order() {
        let octets = [
            0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x02,
        ];
        let addr = Addr6::from_octets(octets);
        assert_eq!(addr.w0.to_ne_bytes(), [0x20, 0x01, 0x0d, 0xb8]);
        assert_eq!(addr.w3.to_ne_bytes(), [0, 0, 0x01, 0x02]);
        assert_eq!(addr.octets(), octets);
    }

    #[test]
    fn byte_order_helpers_match_packet_layout() {
        let addr = ipv4_be([10, 96, 0, 1]);
        assert_eq!(addr.to_ne_bytes(), [10, 96, 0, 1]);
        assert_eq!(port_be(0x1f90).to_ne_bytes(), [0x1f, 0x90]);
    }

    #[test]
    fn timeouts_are_linuxs_and_kube_proxys() {
        let flags = ConntrackTimeouts {
            tcp_established_s: 1000,
            tcp_close_wait_s: 200,
            udp_s: 3,
            udp_stream_s: 4,
        };
        let s = |proto, state| conntrack_timeout_ns(proto, state, &flags) / SECOND_NS;
        assert_eq!(s(IPPROTO_TCP, tcp::SYN_SENT), 120);
        assert_eq!(s(IPPROTO_TCP, tcp::SYN_RECV), 60);
        assert_eq!(s(IPPROTO_TCP, tcp::ESTABLISHED), 1000);
        assert_eq!(s(IPPROTO_TCP, tcp::FIN_WAIT), 120);
        assert_eq!(s(IPPROTO_TCP, tcp::CLOSE_WAIT), 200);
        assert_eq!(s(IPPROTO_TCP, tcp::LAST_ACK), 30);
        assert_eq!(s(IPPROTO_TCP, tcp::TIME_WAIT), 120);
        assert_eq!(s(IPPROTO_TCP, tcp::CLOSE), 10);
        assert_eq!(s(IPPROTO_TCP, 200), 10);
        assert_eq!(s(IPPROTO_UDP, CT_UDP_UNREPLIED), 3);
        assert_eq!(s(IPPROTO_UDP, CT_UDP_REPLIED), 3);
        assert_eq!(s(IPPROTO_UDP, CT_UDP_STREAM), 4);
        let defaults = ConntrackTimeouts::default();
        assert_eq!(defaults.tcp_established_s, 86_400);
        assert_eq!(defaults.tcp_close_wait_s, 3600);
        assert_eq!((defaults.udp_s, defaults.udp_stream_s), (30, 120));
    }

    #[test]
    fn a_udp_flow_is_a_stream_once_the_client_sends_after_a_reply() {
        assert_eq!(udp_step(CT_UDP_UNREPLIED, false), CT_UDP_UNREPLIED);
        assert_eq!(udp_step(CT_UDP_UNREPLIED, true), CT_UDP_REPLIED);
        // A reply of several datagrams is not yet a conversation.
        assert_eq!(udp_step(CT_UDP_REPLIED, true), CT_UDP_REPLIED);
        assert_eq!(udp_step(CT_UDP_REPLIED, false), CT_UDP_STREAM);
        assert_eq!(udp_step(CT_UDP_STREAM, true), CT_UDP_STREAM);
        assert_eq!(conntrack_state_name(IPPROTO_UDP, CT_UDP_STREAM), "stream");
        assert_eq!(
            conntrack_state_name(IPPROTO_TCP, tcp::CLOSE_WAIT),
            "close_wait"
        );
    }

    #[test]
    fn legacy_conntrack_entries_convert_uncounted() {
        let hop = CachedHop {
            ifindex: 7,
            iif: 3,
            macs0: 1,
            macs1: 2,
            macs2: 3,
        };
        let v2 = legacy::ConntrackEntryV2 {
            last_seen_ns: 42,
            src_addr: ipv4_be([10, 96, 0, 1]),
            dst_addr: ipv4_be([10, 244, 1, 2]),
            src_port: port_be(80),
            dst_port: port_be(40000),
            service_id: 9,
            state: legacy::V3_STATE_ESTABLISHED,
            flags: CT_F_REPLY | CT_F_MASQUERADE,
            hop_len: 1500,
            hop,
        };
        let current = legacy::ConntrackEntryV3 {
            last_seen_ns: 42,
            src_addr: v2.src_addr,
            dst_addr: v2.dst_addr,
            src_port: v2.src_port,
            dst_port: v2.dst_port,
            service_id: 9,
            state: legacy::V3_STATE_ESTABLISHED,
            flags: CT_F_REPLY | CT_F_MASQUERADE,
            hop_len: 1500,
            hop,
            stats_slot: 0,
            stats_owner: 0,
        };
        assert_eq!(legacy::ConntrackEntryV3::from(v2), current);
        let v1 = legacy::ConntrackEntryV1 {
            last_seen_ns: 42,
            src_addr: v2.src_addr,
            dst_addr: v2.dst_addr,
            src_port: v2.src_port,
            dst_port: v2.dst_port,
            service_id: 9,
            state: legacy::V3_STATE_ESTABLISHED,
            flags: CT_F_REPLY | CT_F_MASQUERADE,
            _pad0: 0,
            _pad1: 0,
        };
        let no_route = legacy::ConntrackEntryV3 {
            hop_len: 0,
            hop: CachedHop::default(),
            ..current
        };
        assert_eq!(legacy::ConntrackEntryV3::from(v1), no_route);
    }

    #[test]
    fn v3_connections_carry_over_conservatively_with_windows_unknown() {
        let v3 = legacy::ConntrackEntryV3 {
            last_seen_ns: 42,
            src_addr: ipv4_be([10, 96, 0, 1]),
            stats_slot: 5,
            stats_owner: 6,
            flags: CT_F_REPLY,
            ..Default::default()
        };
        let state = |proto, state| {
            legacy::ConntrackEntryV3 { state, ..v3 }
                .converted(proto)
                .state
        };
        assert_eq!(state(IPPROTO_TCP, legacy::V3_STATE_NEW), tcp::SYN_SENT);
        assert_eq!(
            state(IPPROTO_TCP, legacy::V3_STATE_ESTABLISHED),
            tcp::ESTABLISHED
        );
        assert_eq!(state(IPPROTO_TCP, legacy::V3_STATE_CLOSING), tcp::FIN_WAIT);
        assert_eq!(state(IPPROTO_UDP, legacy::V3_STATE_NEW), CT_UDP_UNREPLIED);
        assert_eq!(
            state(IPPROTO_UDP, legacy::V3_STATE_ESTABLISHED),
            CT_UDP_STREAM
        );
        let entry = v3.converted(IPPROTO_TCP);
        assert_eq!(
            (
                entry.last_seen_ns,
                entry.src_addr,
                entry.flags,
                entry.stats_slot,
                entry.stats_owner
            ),
            (42, v3.src_addr, CT_F_REPLY, 5, 6)
        );
        assert_eq!(entry.window.max_window, 0);
        assert_eq!(entry.window.wscale, tcp::WSCALE_UNKNOWN);
    }

    #[test]
    fn drops_and_only_drops_have_a_reason() {
        for counter in Counter::ALL {
            assert!(!counter.meaning().is_empty());
            let is_drop = counter.name().starts_with("drop_");
            assert_eq!(counter.drop_reason().is_some(), is_drop, "{counter:?}");
        }
    }

    #[test]
    fn counter_names_are_unique() {
        for (i, a) in Counter::ALL.iter().enumerate() {
            assert_eq!(*a as usize, i);
            for b in &Counter::ALL[i + 1..] {
                assert_ne!(a.name(), b.name());
            }
        }
    }
}
