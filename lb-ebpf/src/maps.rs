//! The maps shared with the agent (layouts in `lb_common`), the counter increment, and the kernel
//! clock and random source that conntrack and backend selection read.
//!
//! The maps are not pinned in the object: the agent gives each one its pin path at load
//! (`EbpfLoader::map_pin_path`), and packet tests load private, unpinned copies.
use aya_ebpf::{
    bindings::{BPF_ANY, BPF_F_NO_PREALLOC, BPF_NOEXIST},
    helpers::{bpf_get_prandom_u32, bpf_jiffies64},
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, lpm_trie::Key},
};
use lb_common::{
    Addr6, AffinityKey6, Backend6, Config6, ConntrackEntry6, ConntrackKey6, FragmentKey6,
    FrontendKey6, SourceRangeKey6, StickyBackend6,
};
use lb_common::{
    AffinityKey, Backend, BackendKey, BackendStats, Config, ConntrackEntry, ConntrackKey, Counter,
    FirstFragment, FragmentKey, Frontend, FrontendKey, FrontendOrigin, RejectLimit, SockBackendKey,
    SockRevNat, SockRevNatKey, SourceRangeKey, StickyBackend, default_size,
};
use lb_common::{AgentInfo, ServiceStatus};
use lb_common::{SockBackendKey6, SockRevNat6, SockRevNatKey6};

#[map(name = "LB_FRONTEND_V4")]
static FRONTENDS: HashMap<FrontendKey, Frontend> =
    HashMap::with_max_entries(default_size::FRONTENDS, 0);

#[map(name = "LB_BACKEND_V1")]
static BACKENDS: HashMap<BackendKey, Backend> =
    HashMap::with_max_entries(default_size::BACKENDS, 0);

#[map(name = "LB_CT_V4")]
static CONNTRACK: LruHashMap<ConntrackKey, ConntrackEntry> =
    LruHashMap::with_max_entries(default_size::CONNTRACK, 0);

/// Connections whose handshake is not complete (`CT_F_UNCONFIRMED`), until `confirm` moves them
/// to `CONNTRACK`: a flood of them evicts only its own kind. Sized by the agent
/// (`lb_common::unconfirmed_size`).
#[map(name = "LB_CT_UNCONFIRMED_V1")]
static UNCONFIRMED: LruHashMap<ConntrackKey, ConntrackEntry> =
    LruHashMap::with_max_entries(default_size::CONNTRACK_UNCONFIRMED, 0);

/// A connection's tuple between lb_ingress and lb_egress (intermediate.rs) → the conntrack key of
/// the same direction. Two per connection, as conntrack's; an LRU as conntrack is.
#[map(name = "LB_INTERMEDIATE_V1")]
static INTERMEDIATE: LruHashMap<ConntrackKey, ConntrackKey> =
    LruHashMap::with_max_entries(default_size::CONNTRACK, 0);

/// The intermediate tuples of the connections in `UNCONFIRMED`, moved to `INTERMEDIATE` with them.
#[map(name = "LB_INTERMEDIATE_UNCONFIRMED_V1")]
static INTERMEDIATE_UNCONFIRMED: LruHashMap<ConntrackKey, ConntrackKey> =
    LruHashMap::with_max_entries(default_size::CONNTRACK_UNCONFIRMED, 0);

#[map(name = "LB_AFFINITY_V1")]
static AFFINITY: LruHashMap<AffinityKey, StickyBackend> =
    LruHashMap::with_max_entries(default_size::AFFINITY, 0);

#[map(name = "LB_RR_V1")]
static ROUND_ROBIN: LruHashMap<u32, u32> =
    LruHashMap::with_max_entries(default_size::ROUND_ROBIN, 0);

#[map(name = "LB_SOCK_REVNAT_V1")]
static SOCK_REVNAT: LruHashMap<SockRevNatKey, SockRevNat> =
    LruHashMap::with_max_entries(default_size::SOCK_REVNAT, 0);

#[map(name = "LB_SOCK_BACKEND_V1")]
static SOCK_BACKEND: LruHashMap<SockBackendKey, StickyBackend> =
    LruHashMap::with_max_entries(default_size::SOCK_BACKEND, 0);

/// The IPv6 sockets' twins of the two above (IPv6 service addresses; IPv4-mapped ones use
/// theirs), sized as theirs.
#[map(name = "LB_SOCK_REVNAT6_V1")]
static SOCK_REVNAT6: LruHashMap<SockRevNatKey6, SockRevNat6> =
    LruHashMap::with_max_entries(default_size::SOCK_REVNAT, 0);

#[map(name = "LB_SOCK_BACKEND6_V1")]
static SOCK_BACKEND6: LruHashMap<SockBackendKey6, StickyBackend6> =
    LruHashMap::with_max_entries(default_size::SOCK_BACKEND, 0);

#[map(name = "LB_FRAGMENT_V2")]
static FRAGMENTS: LruHashMap<FragmentKey, FirstFragment> =
    LruHashMap::with_max_entries(default_size::FRAGMENTS, 0);

#[map(name = "LB_FRAGMENT6_V1")]
static FRAGMENTS6: LruHashMap<FragmentKey6, FirstFragment> =
    LruHashMap::with_max_entries(default_size::FRAGMENTS, 0);

#[map(name = "LB_CONFIG_V4")]
static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

#[map(name = "LB_COUNTER_V11")]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Counter::COUNT, 0);

/// An array, not a hash by endpoint: the verifier inlines its lookup into a few instructions, where
/// a hash lookup (a helper call, jhash of the key, a bucket walk) cost an established packet ~12
/// ns. Its whole size is allocated on every CPU, hence the small default (lb_common).
#[map(name = "LB_BACKEND_STATS_V2")]
static BACKEND_STATS: PerCpuArray<BackendStats> =
    PerCpuArray::with_max_entries(default_size::BACKEND_STATS, 0);

/// Written and read by the agent only (`lb services`); declared here so that it is created and
/// pinned with the others. Sized as the frontends, allocated as used.
#[map(name = "LB_FRONTEND_ORIGIN_V1")]
static FRONTEND_ORIGINS: HashMap<FrontendKey, FrontendOrigin> =
    HashMap::with_max_entries(default_size::FRONTENDS, BPF_F_NO_PREALLOC);

/// Written by the agent, read by `lb status` only; declared here, as `FRONTEND_ORIGINS`, to be
/// created and pinned with the others. One entry per service port, allocated as used.
#[map(name = "LB_SERVICE_STATUS_V1")]
static SERVICE_STATUS: HashMap<u32, ServiceStatus> =
    HashMap::with_max_entries(default_size::FRONTENDS, BPF_F_NO_PREALLOC);

/// Written by the agent, read by `lb status` only.
#[map(name = "LB_AGENT_V1")]
static AGENT: Array<AgentInfo> = Array::with_max_entries(1, 0);

/// The value is unused: a key's presence allows its prefix.
#[map(name = "LB_SOURCE_RANGE_V1")]
static SOURCE_RANGES: LpmTrie<SourceRangeKey, u8> =
    LpmTrie::with_max_entries(default_size::SOURCE_RANGES, 0);

/// Keyed by ifindex; the value is unused. An XDP redirect into an interface that cannot take
/// XDP frames (a veth whose peer has neither GRO nor XDP on) is dropped by the kernel, so the
/// agent lists the ones that can.
#[map(name = "LB_XDP_EGRESS_V1")]
static XDP_EGRESS: HashMap<u32, u8> = HashMap::with_max_entries(default_size::XDP_EGRESS, 0);

// The IPv6 twins of the maps above (docs/ipv6.md), sized as theirs: the agent sizes both
// families' maps from the same flags.

#[map(name = "LB_FRONTEND6_V1")]
static FRONTENDS6: HashMap<FrontendKey6, Frontend> =
    HashMap::with_max_entries(default_size::FRONTENDS, 0);

#[map(name = "LB_BACKEND6_V1")]
static BACKENDS6: HashMap<BackendKey, Backend6> =
    HashMap::with_max_entries(default_size::BACKENDS, 0);

#[map(name = "LB_CT6_V1")]
static CONNTRACK6: LruHashMap<ConntrackKey6, ConntrackEntry6> =
    LruHashMap::with_max_entries(default_size::CONNTRACK, 0);

#[map(name = "LB_CT6_UNCONFIRMED_V1")]
static UNCONFIRMED6: LruHashMap<ConntrackKey6, ConntrackEntry6> =
    LruHashMap::with_max_entries(default_size::CONNTRACK_UNCONFIRMED, 0);

#[map(name = "LB_INTERMEDIATE6_V1")]
static INTERMEDIATE6: LruHashMap<ConntrackKey6, ConntrackKey6> =
    LruHashMap::with_max_entries(default_size::CONNTRACK, 0);

#[map(name = "LB_INTERMEDIATE6_UNCONFIRMED_V1")]
static INTERMEDIATE6_UNCONFIRMED: LruHashMap<ConntrackKey6, ConntrackKey6> =
    LruHashMap::with_max_entries(default_size::CONNTRACK_UNCONFIRMED, 0);

#[map(name = "LB_AFFINITY6_V1")]
static AFFINITY6: LruHashMap<AffinityKey6, StickyBackend6> =
    LruHashMap::with_max_entries(default_size::AFFINITY, 0);

/// The value is unused, as in `SOURCE_RANGES`.
#[map(name = "LB_SOURCE_RANGE6_V1")]
static SOURCE_RANGES6: LpmTrie<SourceRangeKey6, u8> =
    LpmTrie::with_max_entries(default_size::SOURCE_RANGES, 0);

/// Written and read by the agent only, as `FRONTEND_ORIGINS`.
#[map(name = "LB_FRONTEND_ORIGIN6_V1")]
static FRONTEND_ORIGINS6: HashMap<FrontendKey6, FrontendOrigin> =
    HashMap::with_max_entries(default_size::FRONTENDS, BPF_F_NO_PREALLOC);

#[map(name = "LB_CONFIG6_V1")]
static CONFIG6: Array<Config6> = Array::with_max_entries(1, 0);

/// This CPU's share of the REJECT rate limit, written by the agent.
#[map(name = "LB_REJECT_LIMIT_V1")]
static REJECT_LIMIT: PerCpuArray<RejectLimit> = PerCpuArray::with_max_entries(1, 0);

/// Whether a REJECT may be answered now, taking its tokens (`RejectLimit::take`). Without the
/// entry, it may.
pub fn reject_allowed(config: &Config) -> bool {
    let now = now_ns(config);
    REJECT_LIMIT.get_ptr_mut(0).is_none_or(|limit| {
        // SAFETY: this CPU's own entry, valid until the program returns; tc programs are not
        // preempted while they run, and nothing else here holds a reference to it.
        unsafe { (*limit).take(now) }
    })
}

pub fn count(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: the slot is this CPU's own; tc and XDP programs are not preempted while they run.
        unsafe { *slot += 1 };
    }
}

/// This CPU's counters of endpoint slot `slot`; none for slot 0 (not counted) or one beyond the
/// map.
fn backend_stats(slot: u32) -> Option<&'static mut BackendStats> {
    if slot == 0 {
        return None;
    }
    // SAFETY: this CPU's own copy, valid until the program returns; tc and XDP programs are not
    // preempted while they run.
    BACKEND_STATS
        .get_ptr_mut(slot)
        .map(|stats| unsafe { &mut *stats })
}

/// The owner a new connection to an endpoint with counter slot `slot` records (0: none).
pub fn backend_stats_owner(slot: u32) -> u32 {
    backend_stats(slot).map_or(0, |stats| stats.owner)
}

/// Counts a packet of `bytes` of a connection whose entry holds counter slot `slot` and owner
/// `owner`: not once the slot is another endpoint's.
pub fn count_backend(slot: u32, owner: u32, bytes: u16) {
    if let Some(stats) = backend_stats(slot)
        && stats.owner == owner
    {
        stats.packets += 1;
        stats.bytes += u64::from(bytes);
    }
}

/// Counts a new connection to the endpoint of counter slot `slot` dropped for want of a free
/// masquerade port.
pub fn count_backend_ports_exhausted(slot: u32) {
    if let Some(stats) = backend_stats(slot) {
        stats.ports_exhausted = stats.ports_exhausted.wrapping_add(1);
    }
}

/// Counts the first packet, of `bytes`, of a new connection to the endpoint of counter slot
/// `slot`.
pub fn count_backend_connection(slot: u32, bytes: u16) {
    if let Some(stats) = backend_stats(slot) {
        stats.connections += 1;
        stats.packets += 1;
        stats.bytes += u64::from(bytes);
    }
}

/// Read in place: the agent writes it at its start, before it attaches the programs.
pub fn config() -> Option<&'static Config> {
    CONFIG.get(0)
}

pub fn frontend(key: &FrontendKey) -> Option<Frontend> {
    // SAFETY: the value is copied out at once; the agent replaces frontends whole.
    unsafe { FRONTENDS.get(key).copied() }
}

pub fn backend(key: &BackendKey) -> Option<Backend> {
    // SAFETY: the value is copied out at once; the agent replaces backends whole.
    unsafe { BACKENDS.get(key).copied() }
}

/// Some loadBalancerSourceRanges prefix of `service_id` holds `addr` (network byte order).
pub fn source_range_contains(service_id: u32, addr: u32) -> bool {
    SOURCE_RANGES
        .get(Key::new(
            SourceRangeKey::FULL_PREFIX,
            SourceRangeKey { service_id, addr },
        ))
        .is_some()
}

/// Some loadBalancerSourceRanges prefix of `service_id` holds the IPv6 `addr`.
pub fn source_range6_contains(service_id: u32, addr: &Addr6) -> bool {
    SOURCE_RANGES6
        .get(Key::new(
            SourceRangeKey6::FULL_PREFIX,
            SourceRangeKey6 {
                service_id,
                addr: *addr,
            },
        ))
        .is_some()
}

/// The entry of `key`: in the main table (established connections), else in the unconfirmed
/// one; an established packet pays one lookup.
pub fn conntrack(key: &ConntrackKey) -> Option<&'static mut ConntrackEntry> {
    // SAFETY: the value stays valid until the program returns (RCU); other CPUs may write the same
    // entry, which tears at worst a timestamp or a state byte, as in any map-based conntrack.
    CONNTRACK
        .get_ptr_mut(key)
        .or_else(|| UNCONFIRMED.get_ptr_mut(key))
        .map(|entry| unsafe { &mut *entry })
}

/// The entry of `key` in the unconfirmed table only.
pub fn unconfirmed(key: &ConntrackKey) -> Option<&'static mut ConntrackEntry> {
    // SAFETY: as in `conntrack`.
    UNCONFIRMED
        .get_ptr_mut(key)
        .map(|entry| unsafe { &mut *entry })
}

/// Into the main table (a confirmed connection). `flags` is `BPF_ANY`, `BPF_NOEXIST` or
/// `BPF_EXIST`.
pub fn conntrack_insert(key: &ConntrackKey, entry: &ConntrackEntry, flags: u32) -> bool {
    CONNTRACK.insert(key, entry, u64::from(flags)).is_ok()
}

/// Into the unconfirmed table (a new connection). `flags` as `conntrack_insert`'s.
pub fn unconfirmed_insert(key: &ConntrackKey, entry: &ConntrackEntry, flags: u32) -> bool {
    UNCONFIRMED.insert(key, entry, u64::from(flags)).is_ok()
}

/// Deletes the entry of `key` from both tables.
pub fn conntrack_remove(key: &ConntrackKey) {
    // Nothing to undo when the entry is already gone (evicted by the LRU).
    let _ = CONNTRACK.remove(key);
    let _ = UNCONFIRMED.remove(key);
}

/// Deletes the entry of `key` from the unconfirmed table.
pub fn unconfirmed_remove(key: &ConntrackKey) {
    let _ = UNCONFIRMED.remove(key);
}

/// The conntrack key of intermediate tuple `key`: from the main table, else the unconfirmed one.
pub fn intermediate(key: &ConntrackKey) -> Option<ConntrackKey> {
    // SAFETY: the value is copied out at once.
    unsafe {
        INTERMEDIATE
            .get(key)
            .or_else(|| INTERMEDIATE_UNCONFIRMED.get(key))
            .copied()
    }
}

/// The conntrack key of intermediate tuple `key` in the unconfirmed table only.
pub fn intermediate_unconfirmed(key: &ConntrackKey) -> Option<ConntrackKey> {
    // SAFETY: the value is copied out at once.
    unsafe { INTERMEDIATE_UNCONFIRMED.get(key).copied() }
}

/// Into the main table (a confirmed connection's tuple).
pub fn intermediate_insert(key: &ConntrackKey, conntrack_key: &ConntrackKey) -> bool {
    INTERMEDIATE
        .insert(key, conntrack_key, u64::from(BPF_ANY))
        .is_ok()
}

/// Into the unconfirmed table (a new connection's tuple).
pub fn intermediate_unconfirmed_insert(key: &ConntrackKey, conntrack_key: &ConntrackKey) -> bool {
    INTERMEDIATE_UNCONFIRMED
        .insert(key, conntrack_key, u64::from(BPF_ANY))
        .is_ok()
}

/// Deletes intermediate tuple `key` from the main table.
pub fn intermediate_remove(key: &ConntrackKey) {
    let _ = INTERMEDIATE.remove(key);
}

/// Deletes intermediate tuple `key` from the unconfirmed table.
pub fn intermediate_unconfirmed_remove(key: &ConntrackKey) {
    let _ = INTERMEDIATE_UNCONFIRMED.remove(key);
}

pub fn affinity(key: &AffinityKey) -> Option<&'static mut StickyBackend> {
    // SAFETY: valid until the program returns (RCU); a racing CPU tears at worst the timestamp.
    AFFINITY
        .get_ptr_mut(key)
        .map(|entry| unsafe { &mut *entry })
}

pub fn affinity_insert(key: &AffinityKey, entry: &StickyBackend) {
    // A failed insert only costs the next connection its affinity.
    let _ = AFFINITY.insert(key, entry, 0);
}

pub fn affinity6(key: &AffinityKey6) -> Option<&'static mut StickyBackend6> {
    // SAFETY: as in `affinity`.
    AFFINITY6
        .get_ptr_mut(key)
        .map(|entry| unsafe { &mut *entry })
}

pub fn affinity6_insert(key: &AffinityKey6, entry: &StickyBackend6) {
    // As `affinity_insert`.
    let _ = AFFINITY6.insert(key, entry, 0);
}

pub fn sock_backend(key: &SockBackendKey) -> Option<&'static mut StickyBackend> {
    // SAFETY: as in `affinity`.
    SOCK_BACKEND
        .get_ptr_mut(key)
        .map(|entry| unsafe { &mut *entry })
}

pub fn sock_backend_insert(key: &SockBackendKey, entry: &StickyBackend) {
    // A failed insert only lets the socket's next datagram pick a backend again.
    let _ = SOCK_BACKEND.insert(key, entry, 0);
}

pub fn sock_revnat(key: &SockRevNatKey) -> Option<SockRevNat> {
    // SAFETY: the value is copied out at once.
    unsafe { SOCK_REVNAT.get(key).copied() }
}

pub fn sock_revnat_insert(key: &SockRevNatKey, value: &SockRevNat) {
    // A failed insert only leaves the application seeing the backend's address.
    let _ = SOCK_REVNAT.insert(key, value, 0);
}

pub fn sock_backend6(key: &SockBackendKey6) -> Option<&'static mut StickyBackend6> {
    // SAFETY: as in `affinity`.
    SOCK_BACKEND6
        .get_ptr_mut(key)
        .map(|entry| unsafe { &mut *entry })
}

pub fn sock_backend6_insert(key: &SockBackendKey6, entry: &StickyBackend6) {
    // As `sock_backend_insert`.
    let _ = SOCK_BACKEND6.insert(key, entry, 0);
}

pub fn sock_revnat6(key: &SockRevNatKey6) -> Option<SockRevNat6> {
    // SAFETY: the value is copied out at once.
    unsafe { SOCK_REVNAT6.get(key).copied() }
}

pub fn sock_revnat6_insert(key: &SockRevNatKey6, value: &SockRevNat6) {
    // As `sock_revnat_insert`.
    let _ = SOCK_REVNAT6.insert(key, value, 0);
}

/// The next value of the round-robin counter of `service_id`, shared by all CPUs.
pub fn round_robin(service_id: u32) -> u32 {
    let counter = ROUND_ROBIN.get_ptr_mut(service_id).or_else(|| {
        // BPF_NOEXIST: another CPU may have created it meanwhile; either way it exists now.
        let _ = ROUND_ROBIN.insert(service_id, 0, u64::from(BPF_NOEXIST));
        ROUND_ROBIN.get_ptr_mut(service_id)
    });
    match counter {
        // SAFETY: a valid u32 in the map until the program returns (RCU). Not atomic (the
        // BPF target has no atomic read-modify-write in Rust): CPUs racing on one service port
        // may pick the same slot, which only blurs the rotation for that instant.
        Some(counter) => unsafe {
            let value = *counter;
            *counter = value.wrapping_add(1);
            value
        },
        // The map is full of live counters: fall back to a random pick.
        None => random(),
    }
}

pub fn xdp_egress(ifindex: u32) -> bool {
    // SAFETY: only the key's presence is read.
    unsafe { XDP_EGRESS.get(ifindex).is_some() }
}

/// The datapath's clock (`lb_common::Clock`, which the agent writes into `config`).
pub fn now_ns(config: &Config) -> u64 {
    // SAFETY: the helper takes no arguments and cannot fail.
    config.clock.ns(unsafe { bpf_jiffies64() })
}

pub fn random() -> u32 {
    // SAFETY: the helper takes no arguments and cannot fail.
    unsafe { bpf_get_prandom_u32() }
}

pub fn first_fragment(key: &FragmentKey) -> Option<FirstFragment> {
    // SAFETY: the value is copied out at once.
    unsafe { FRAGMENTS.get(key).copied() }
}

/// Best effort: when the map is full, LRU eviction makes room.
pub fn remember_first_fragment(key: &FragmentKey, first: &FirstFragment) {
    let _ = FRAGMENTS.insert(key, first, 0);
}

pub fn first_fragment6(key: &FragmentKey6) -> Option<FirstFragment> {
    // SAFETY: the value is copied out at once.
    unsafe { FRAGMENTS6.get(key).copied() }
}

/// Best effort, as `remember_first_fragment`.
pub fn remember_first_fragment6(key: &FragmentKey6, first: &FirstFragment) {
    let _ = FRAGMENTS6.insert(key, first, 0);
}

/// Read in place, as `config`.
pub fn config6() -> Option<&'static Config6> {
    CONFIG6.get(0)
}

pub fn frontend6(key: &FrontendKey6) -> Option<Frontend> {
    // SAFETY: the value is copied out at once; the agent replaces frontends whole.
    unsafe { FRONTENDS6.get(key).copied() }
}

pub fn backend6(key: &BackendKey) -> Option<Backend6> {
    // SAFETY: the value is copied out at once; the agent replaces backends whole.
    unsafe { BACKENDS6.get(key).copied() }
}

/// The IPv6 entry of `key`, as `conntrack`: the main table, else the unconfirmed one.
pub fn conntrack6(key: &ConntrackKey6) -> Option<&'static mut ConntrackEntry6> {
    // SAFETY: as in `conntrack`.
    CONNTRACK6
        .get_ptr_mut(key)
        .or_else(|| UNCONFIRMED6.get_ptr_mut(key))
        .map(|entry| unsafe { &mut *entry })
}

/// Into the IPv6 main table. `flags` as `conntrack_insert`'s.
pub fn conntrack6_insert(key: &ConntrackKey6, entry: &ConntrackEntry6, flags: u32) -> bool {
    CONNTRACK6.insert(key, entry, u64::from(flags)).is_ok()
}

/// Deletes the IPv6 entry of `key` from both tables.
pub fn conntrack6_remove(key: &ConntrackKey6) {
    let _ = CONNTRACK6.remove(key);
    let _ = UNCONFIRMED6.remove(key);
}
