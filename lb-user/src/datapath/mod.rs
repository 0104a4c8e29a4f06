//! Loading the embedded eBPF object with pinned maps, and the agent's handles on its maps.
pub mod bpf_link;
pub mod bpffs;
pub mod cgroup_hooks;
pub mod cgroup_mount;
pub mod forward_rules;
pub mod ipv6_programs;
pub mod link_pins;
pub mod links;
pub mod map_pins;
pub mod node_sysctls;
pub mod xdp_targets;

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::AsFd as _;
use std::os::raw::c_int;
use std::path::Path;
use std::time::Duration;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{
    Array, HashMap, IterableMap, Map, MapData, MapError, MapType, PerCpuArray, PerCpuValues,
};
use aya::programs::{CgroupSockAddr, ProgramError, SchedClassifier, Xdp};
use aya::{Ebpf, EbpfError, EbpfLoader};
use bytemuck::Pod;
use ipnet::Ipv6Net;
use lb_common::{
    Addr6, Backend6, Config6, ConntrackEntry6, ConntrackKey6, FrontendKey6, SourceRangeKey6,
};
use lb_common::{AgentInfo, ServiceStatus};
use lb_common::{
    Backend, BackendKey, BackendStats, Clock, Config, ConntrackEntry, ConntrackKey, Counter,
    Frontend, FrontendKey, FrontendOrigin, RejectLimit, SourceRangeKey, ipv4_be, map_name,
    program_name,
};
use nix::libc::EAGAIN;
use nix::time::{ClockId, clock_getres};

use crate::maps::contents::{MapContents, MapContents6, SourceRange};
use crate::maps::map_batch;
use crate::maps::stats_slots::{self, StatsReset};
use crate::maps::writer::MapWriter;
use crate::reconcile::udp_flush::{self, UdpEndpoint};

/// The compiled lb-ebpf object, built by build.rs.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb"));

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error("loading the eBPF object: {0}")]
    Load(#[from] EbpfError),
    #[error("map {0} not in the eBPF object")]
    MissingMap(&'static str),
    #[error("program {0} not in the eBPF object")]
    MissingProgram(&'static str),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: MapError,
    },
    #[error("map {name}: one value per possible CPU: {source}")]
    PerCpu {
        name: &'static str,
        source: io::Error,
    },
    #[error("map {name}: walking its keys: {source}")]
    KeyWalk {
        name: &'static str,
        source: io::Error,
    },
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: ProgramError,
    },
    #[error("program {name}: duplicating its file descriptor: {source}")]
    ProgramFd {
        name: &'static str,
        source: io::Error,
    },
    #[error(transparent)]
    MapPins(#[from] map_pins::MapPinError),
    #[error("the kernel's jiffy (resolution of CLOCK_MONOTONIC_COARSE): {0}")]
    Clock(String),
}

/// This kernel's datapath clock (`lb_common::Clock`): its jiffy is the resolution of
/// CLOCK_MONOTONIC_COARSE.
pub fn kernel_clock() -> Result<Clock, DatapathError> {
    let resolution = clock_getres(ClockId::CLOCK_MONOTONIC_COARSE)
        .map_err(|errno| DatapathError::Clock(errno.to_string()))?;
    let tick_ns = Duration::from(resolution).as_nanos();
    match u32::try_from(tick_ns) {
        Ok(tick_ns) if tick_ns != 0 => Ok(Clock::with_tick(tick_ns)),
        _ => Err(DatapathError::Clock(format!("{tick_ns} ns"))),
    }
}

/// Runs `load` (a program's `load()`) again while the kernel answers EAGAIN, at most 5 times:
/// the verifier gives up with EAGAIN when a signal reaches the loading thread while it runs, as
/// libbpf also retries.
pub fn load_program(
    mut load: impl FnMut() -> Result<(), ProgramError>,
) -> Result<(), ProgramError> {
    let mut attempts = 5;
    loop {
        match load() {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(EAGAIN) && attempts > 1 =>
            {
                attempts -= 1;
            }
            done => return done,
        }
    }
}

/// Map sizes (max_entries).
#[derive(Clone, Copy, Debug)]
pub struct MapSizes {
    pub frontends: u32,
    pub backends: u32,
    pub conntrack: u32,
    /// The unconfirmed connections' table and their intermediate tuples
    /// (`lb_common::unconfirmed_size`).
    pub unconfirmed: u32,
    pub affinity: u32,
    pub backend_stats: u32,
}

/// The loaded object: its programs (the ingress one loaded, the XDP one on demand; not attached)
/// and the maps the agent writes.
pub struct Datapath {
    ebpf: Ebpf,
    pub service_maps: ServiceMaps,
    config: Array<MapData, Config>,
    config6: Array<MapData, Config6>,
    conntrack: HashMap<MapData, ConntrackKey, ConntrackEntry>,
    /// Connections whose handshake is not complete (`map_name::CONNTRACK_UNCONFIRMED`).
    unconfirmed: HashMap<MapData, ConntrackKey, ConntrackEntry>,
    /// Their IPv6 twins.
    conntrack6: HashMap<MapData, ConntrackKey6, ConntrackEntry6>,
    unconfirmed6: HashMap<MapData, ConntrackKey6, ConntrackEntry6>,
    xdp_egress: HashMap<MapData, u32, u8>,
    agent: Array<MapData, AgentInfo>,
    reject_limit: PerCpuArray<MapData, RejectLimit>,
}

impl Datapath {
    /// Loads the object with every map pinned in `pin_dir` (reused when already pinned with this
    /// build's layout, so conntrack survives an agent restart; an incompatible pinned map is an
    /// error before anything changes) and loads the tc programs, the IPv6 ones in the program
    /// array their IPv4 twins tail-call.
    pub fn load(pin_dir: &Path, sizes: MapSizes) -> Result<Self, DatapathError> {
        let mut loader = EbpfLoader::new();
        for name in map_name::ALL {
            loader.map_pin_path(name, pin_dir.join(name));
        }
        let wanted = [
            (map_name::FRONTENDS, sizes.frontends),
            // One origin per frontend, one status per service port (which has a frontend).
            (map_name::FRONTEND_ORIGINS, sizes.frontends),
            (map_name::SERVICE_STATUS, sizes.frontends),
            (map_name::BACKENDS, sizes.backends),
            (map_name::CONNTRACK, sizes.conntrack),
            (map_name::INTERMEDIATE, sizes.conntrack),
            (map_name::CONNTRACK_UNCONFIRMED, sizes.unconfirmed),
            (map_name::INTERMEDIATE_UNCONFIRMED, sizes.unconfirmed),
            (map_name::AFFINITY, sizes.affinity),
            (map_name::BACKEND_STATS, sizes.backend_stats),
            // The IPv6 twins, sized by the same flags.
            (map_name::FRONTENDS6, sizes.frontends),
            (map_name::FRONTEND_ORIGINS6, sizes.frontends),
            (map_name::BACKENDS6, sizes.backends),
            (map_name::CONNTRACK6, sizes.conntrack),
            (map_name::INTERMEDIATE6, sizes.conntrack),
            (map_name::CONNTRACK6_UNCONFIRMED, sizes.unconfirmed),
            (map_name::INTERMEDIATE6_UNCONFIRMED, sizes.unconfirmed),
            (map_name::AFFINITY6, sizes.affinity),
        ];
        for (name, size) in wanted {
            loader.map_max_entries(name, size);
        }
        let declared = map_pins::declared(EBPF_OBJECT, &wanted.into_iter().collect())?;
        map_pins::check(pin_dir, &declared)?;
        let mut ebpf = loader.load(EBPF_OBJECT)?;

        let service_maps = ServiceMaps {
            frontends: take_map(&mut ebpf, map_name::FRONTENDS)?,
            backends: take_map(&mut ebpf, map_name::BACKENDS)?,
            source_ranges: take_map(&mut ebpf, map_name::SOURCE_RANGES)?,
            origins: take_map(&mut ebpf, map_name::FRONTEND_ORIGINS)?,
            statuses: take_map(&mut ebpf, map_name::SERVICE_STATUS)?,
            stats: take_map(&mut ebpf, map_name::BACKEND_STATS)?,
            v6: ServiceMaps6 {
                frontends: take_map(&mut ebpf, map_name::FRONTENDS6)?,
                backends: take_map(&mut ebpf, map_name::BACKENDS6)?,
                source_ranges: take_map(&mut ebpf, map_name::SOURCE_RANGES6)?,
                origins: take_map(&mut ebpf, map_name::FRONTEND_ORIGINS6)?,
            },
        };
        let config = take_map(&mut ebpf, map_name::CONFIG)?;
        let config6 = take_map(&mut ebpf, map_name::CONFIG6)?;
        let conntrack = take_map(&mut ebpf, map_name::CONNTRACK)?;
        let unconfirmed = take_map(&mut ebpf, map_name::CONNTRACK_UNCONFIRMED)?;
        let conntrack6 = take_map(&mut ebpf, map_name::CONNTRACK6)?;
        let unconfirmed6 = take_map(&mut ebpf, map_name::CONNTRACK6_UNCONFIRMED)?;
        let xdp_egress = take_map(&mut ebpf, map_name::XDP_EGRESS)?;
        let agent = take_map(&mut ebpf, map_name::AGENT)?;
        let reject_limit = take_map(&mut ebpf, map_name::REJECT_LIMIT)?;
        let mut datapath = Datapath {
            ebpf,
            service_maps,
            config,
            config6,
            conntrack,
            unconfirmed,
            conntrack6,
            unconfirmed6,
            xdp_egress,
            agent,
            reject_limit,
        };
        let ipv6 = ipv6_programs::PROGRAMS.map(|(name, _)| name);
        for name in [program_name::INGRESS, program_name::EGRESS]
            .into_iter()
            .chain(ipv6)
        {
            let program: &mut SchedClassifier = datapath.program(name)?;
            load_program(|| program.load())
                .map_err(|source| DatapathError::Program { name, source })?;
        }
        ipv6_programs::fill_program_array(&mut datapath.ebpf)?;
        Ok(datapath)
    }

    pub fn ingress(&mut self) -> Result<&mut SchedClassifier, DatapathError> {
        self.program(program_name::INGRESS)
    }

    pub fn egress(&mut self) -> Result<&mut SchedClassifier, DatapathError> {
        self.program(program_name::EGRESS)
    }

    /// The XDP program; [`Datapath::load_xdp`] first.
    pub fn xdp(&mut self) -> Result<&mut Xdp, DatapathError> {
        self.program(program_name::XDP)
    }

    /// Loads the XDP program (`--xdp`), which shares the maps of the ingress one, and its IPv6
    /// twin into the program array it tail-calls.
    pub fn load_xdp(&mut self) -> Result<(), DatapathError> {
        for name in [program_name::XDP, program_name::XDP6] {
            let xdp: &mut Xdp = self.program(name)?;
            load_program(|| xdp.load())
                .map_err(|source| DatapathError::Program { name, source })?;
        }
        ipv6_programs::fill_xdp_program_array(&mut self.ebpf)
    }

    /// Lets `lb_xdp` redirect into interface `ifindex` (or no longer, when `allowed` is false).
    pub fn set_xdp_egress(&mut self, ifindex: u32, allowed: bool) -> Result<(), DatapathError> {
        let result = if allowed {
            self.xdp_egress.insert(ifindex, 1, 0)
        } else {
            ignore_missing(self.xdp_egress.remove(&ifindex))
        };
        result.map_err(|source| DatapathError::Map {
            name: map_name::XDP_EGRESS,
            source,
        })
    }

    fn program<'a, P>(&'a mut self, name: &'static str) -> Result<&'a mut P, DatapathError>
    where
        &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
    {
        self.ebpf
            .program_mut(name)
            .ok_or(DatapathError::MissingProgram(name))?
            .try_into()
            .map_err(|source| DatapathError::Program { name, source })
    }

    /// One of the cgroup socket hooks (`program_name::CONNECT4`, ...), loaded or not.
    pub fn sock_program(
        &mut self,
        name: &'static str,
    ) -> Result<&mut CgroupSockAddr, DatapathError> {
        self.ebpf
            .program_mut(name)
            .ok_or(DatapathError::MissingProgram(name))?
            .try_into()
            .map_err(|source| DatapathError::Program { name, source })
    }

    /// Deletes the conntrack entries (both directions, both families) of connections to
    /// `removed` UDP endpoints; returns how many. Entries the datapath drops meanwhile are no
    /// failure.
    pub fn flush_udp(&mut self, removed: &BTreeSet<UdpEndpoint>) -> Result<usize, DatapathError> {
        let mut flushed = 0;
        for (name, map) in [
            (map_name::CONNTRACK, &mut self.conntrack),
            (map_name::CONNTRACK_UNCONFIRMED, &mut self.unconfirmed),
        ] {
            flushed += remove_all(name, map, |entries| {
                udp_flush::stale_entries(entries, removed).collect()
            })?;
        }
        for (name, map) in [
            (map_name::CONNTRACK6, &mut self.conntrack6),
            (map_name::CONNTRACK6_UNCONFIRMED, &mut self.unconfirmed6),
        ] {
            flushed += remove_all(name, map, |entries| {
                udp_flush::stale_entries6(entries, removed).collect()
            })?;
        }
        Ok(flushed)
    }

    /// Copies the connections of earlier agents' conntrack maps
    /// (`map_pins::migrate_legacy_conntrack`).
    pub fn migrate_conntrack(
        &mut self,
        pin_dir: &Path,
        only_new: bool,
    ) -> Result<usize, DatapathError> {
        Ok(map_pins::migrate_legacy_conntrack(
            pin_dir,
            &mut self.conntrack,
            only_new,
        )?)
    }

    /// Records which agent writes the maps and how its last sync went, for `lb status`.
    pub fn write_agent_info(&mut self, info: &AgentInfo) -> Result<(), DatapathError> {
        self.agent
            .set(0, info, 0)
            .map_err(|source| DatapathError::Map {
                name: map_name::AGENT,
                source,
            })
    }

    /// Gives every CPU `limit`, a full bucket of its share of the REJECT rate limit.
    pub fn write_reject_limit(&mut self, limit: RejectLimit) -> Result<(), DatapathError> {
        let name = map_name::REJECT_LIMIT;
        let values = aya::util::nr_cpus()
            .map_err(|(_, source)| source)
            .and_then(|cpus| PerCpuValues::try_from(vec![limit; cpus]))
            .map_err(|source| DatapathError::PerCpu { name, source })?;
        self.reject_limit
            .set(0, values, 0)
            .map_err(|source| DatapathError::Map { name, source })
    }

    pub fn write_config6(&mut self, config: &Config6) -> Result<(), DatapathError> {
        self.config6
            .set(0, config, 0)
            .map_err(|source| DatapathError::Map {
                name: map_name::CONFIG6,
                source,
            })
    }

    pub fn write_config(&mut self, config: &Config) -> Result<(), DatapathError> {
        self.config
            .set(0, config, 0)
            .map_err(|source| DatapathError::Map {
                name: map_name::CONFIG,
                source,
            })
    }
}

/// Removes the keys `stale` picks of the entries of `map` (named `name`); returns how many.
fn remove_all<K: aya::Pod, V: aya::Pod>(
    name: &'static str,
    map: &mut HashMap<MapData, K, V>,
    stale: impl FnOnce(Vec<(K, V)>) -> Vec<K>,
) -> Result<usize, DatapathError> {
    let err = |source| DatapathError::Map { name, source };
    // Collected first: deleting while iterating would restart the walk.
    let stale = stale(map.iter().filter_map(Result::ok).collect());
    for key in &stale {
        ignore_missing(map.remove(key)).map_err(err)?;
    }
    Ok(stale.len())
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DatapathError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or(DatapathError::MissingMap(name))?;
    T::try_from(map).map_err(|source| DatapathError::Map { name, source })
}

/// FRONTENDS, BACKENDS, SOURCE_RANGES, FRONTEND_ORIGINS, SERVICE_STATUS and BACKEND_STATS,
/// written by the reconciler.
pub struct ServiceMaps {
    frontends: HashMap<MapData, FrontendKey, Frontend>,
    backends: HashMap<MapData, BackendKey, Backend>,
    /// The value is unused: a key's presence allows its prefix.
    source_ranges: LpmTrie<MapData, SourceRangeKey, u8>,
    origins: HashMap<MapData, FrontendKey, FrontendOrigin>,
    statuses: HashMap<MapData, u32, ServiceStatus>,
    stats: PerCpuArray<MapData, BackendStats>,
    v6: ServiceMaps6,
}

/// FRONTENDS6, BACKENDS6, SOURCE_RANGES6 and FRONTEND_ORIGINS6: the IPv6 twins.
pub struct ServiceMaps6 {
    frontends: HashMap<MapData, FrontendKey6, Frontend>,
    backends: HashMap<MapData, BackendKey, Backend6>,
    source_ranges: LpmTrie<MapData, SourceRangeKey6, u8>,
    origins: HashMap<MapData, FrontendKey6, FrontendOrigin>,
}

fn source_range_key6(range: SourceRange<Ipv6Net>) -> Key<SourceRangeKey6> {
    Key::new(
        SourceRangeKey6::SERVICE_ID_BITS + u32::from(range.net.prefix_len()),
        SourceRangeKey6 {
            service_id: range.service_id,
            addr: Addr6::from_octets(range.net.addr().octets()),
        },
    )
}

/// None for a key the reconciler does not write (a prefix shorter than the service id).
fn source_range6(key: &Key<SourceRangeKey6>) -> Option<SourceRange<Ipv6Net>> {
    let prefix_len = key
        .prefix_len()
        .checked_sub(SourceRangeKey6::SERVICE_ID_BITS)?;
    let data = key.data();
    let net = Ipv6Net::new(
        Ipv6Addr::from(data.addr.octets()),
        u8::try_from(prefix_len).ok()?,
    )
    .ok()?;
    Some(SourceRange {
        service_id: data.service_id,
        net,
    })
}

/// Every entry of a hash map.
fn entries<K: aya::Pod + Ord, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
    name: &'static str,
) -> Result<BTreeMap<K, V>, DatapathError> {
    map.iter()
        .collect::<Result<_, _>>()
        .map_err(|source| DatapathError::Map { name, source })
}

impl ServiceMaps6 {
    fn pinned(pin_dir: &Path) -> Result<Self, DatapathError> {
        Ok(ServiceMaps6 {
            frontends: pinned(pin_dir, map_name::FRONTENDS6)?,
            backends: pinned(pin_dir, map_name::BACKENDS6)?,
            source_ranges: pinned(pin_dir, map_name::SOURCE_RANGES6)?,
            origins: pinned(pin_dir, map_name::FRONTEND_ORIGINS6)?,
        })
    }

    fn read(&self) -> Result<MapContents6, DatapathError> {
        let keys: Vec<Key<SourceRangeKey6>> = self
            .source_ranges
            .keys()
            .collect::<Result<_, _>>()
            .map_err(|source| DatapathError::Map {
            name: map_name::SOURCE_RANGES6,
            source,
        })?;
        Ok(MapContents6 {
            frontends: entries(&self.frontends, map_name::FRONTENDS6)?,
            backends: entries(&self.backends, map_name::BACKENDS6)?,
            source_ranges: keys.iter().filter_map(source_range6).collect(),
            origins: entries(&self.origins, map_name::FRONTEND_ORIGINS6)?,
            statuses: BTreeMap::new(),
        })
    }
}

fn source_range_key(range: SourceRange) -> Key<SourceRangeKey> {
    Key::new(
        SourceRangeKey::SERVICE_ID_BITS + u32::from(range.net.prefix_len()),
        SourceRangeKey {
            service_id: range.service_id,
            addr: ipv4_be(range.net.addr().octets()),
        },
    )
}

/// None for a key the reconciler does not write (a prefix shorter than the service id).
fn source_range(key: &Key<SourceRangeKey>) -> Option<SourceRange> {
    let prefix_len = key
        .prefix_len()
        .checked_sub(SourceRangeKey::SERVICE_ID_BITS)?;
    let data = key.data();
    let net = ipnet::Ipv4Net::new(
        Ipv4Addr::from(data.addr.to_ne_bytes()),
        u8::try_from(prefix_len).ok()?,
    )
    .ok()?;
    Some(SourceRange {
        service_id: data.service_id,
        net,
    })
}

/// The map pinned as `name` in `pin_dir`, opened by another process than the agent.
fn pinned<T>(pin_dir: &Path, name: &'static str) -> Result<T, DatapathError>
where
    T: TryFrom<Map, Error = MapError>,
{
    MapData::from_pin(pin_dir.join(name))
        .and_then(Map::from_map_data)
        .and_then(T::try_from)
        .map_err(|source| DatapathError::Map { name, source })
}

impl ServiceMaps {
    /// The service maps pinned in `pin_dir`, for a process that reads them (`lb status`).
    pub fn pinned(pin_dir: &Path) -> Result<Self, DatapathError> {
        Ok(ServiceMaps {
            frontends: pinned(pin_dir, map_name::FRONTENDS)?,
            backends: pinned(pin_dir, map_name::BACKENDS)?,
            source_ranges: pinned(pin_dir, map_name::SOURCE_RANGES)?,
            origins: pinned(pin_dir, map_name::FRONTEND_ORIGINS)?,
            statuses: pinned(pin_dir, map_name::SERVICE_STATUS)?,
            stats: pinned(pin_dir, map_name::BACKEND_STATS)?,
            v6: ServiceMaps6::pinned(pin_dir)?,
        })
    }

    /// What the (pinned) IPv6 maps hold now.
    pub fn read6(&self) -> Result<MapContents6, DatapathError> {
        self.v6.read()
    }

    /// The size of BACKEND_STATS as it is (a pinned map keeps its size).
    pub fn stats_capacity(&self) -> u32 {
        self.stats.len()
    }

    /// What the (pinned) maps hold now.
    pub fn read(&self) -> Result<MapContents, DatapathError> {
        let frontends = self
            .frontends
            .iter()
            .collect::<Result<_, _>>()
            .map_err(|source| DatapathError::Map {
                name: map_name::FRONTENDS,
                source,
            })?;
        let backends = self
            .backends
            .iter()
            .collect::<Result<_, _>>()
            .map_err(|source| DatapathError::Map {
                name: map_name::BACKENDS,
                source,
            })?;
        let keys: Vec<Key<SourceRangeKey>> = self
            .source_ranges
            .keys()
            .collect::<Result<_, _>>()
            .map_err(|source| DatapathError::Map {
                name: map_name::SOURCE_RANGES,
                source,
            })?;
        let origins = self
            .origins
            .iter()
            .collect::<Result<_, _>>()
            .map_err(|source| DatapathError::Map {
                name: map_name::FRONTEND_ORIGINS,
                source,
            })?;
        let statuses = self
            .statuses
            .iter()
            .collect::<Result<_, _>>()
            .map_err(|source| DatapathError::Map {
                name: map_name::SERVICE_STATUS,
                source,
            })?;
        Ok(MapContents {
            frontends,
            backends,
            source_ranges: keys.iter().filter_map(source_range).collect(),
            origins,
            statuses,
        })
    }
}

/// A removal of a key that is not there is no failure: the end state is what was asked.
fn ignore_missing(result: Result<(), MapError>) -> Result<(), MapError> {
    const ENOENT: c_int = nix::libc::ENOENT;
    match result {
        Err(MapError::SyscallError(err)) if err.io_error.raw_os_error() == Some(ENOENT) => Ok(()),
        other => other,
    }
}

/// Writes `entries`; a write the map refuses for want of room (E2BIG) fails with an error that
/// names `size_flag`, the flag that sizes the map.
fn update<K: Pod, V: Pod>(
    map: &MapData,
    entries: &[(K, V)],
    size_flag: &str,
) -> Vec<(usize, io::Error)> {
    let (keys, values): (Vec<K>, Vec<V>) = entries.iter().copied().unzip();
    let mut failures = map_batch::update_all(map.fd().as_fd(), &keys, &values);
    for (_, err) in &mut failures {
        if err.raw_os_error() == Some(nix::libc::E2BIG) {
            *err = io::Error::new(
                io::ErrorKind::StorageFull,
                format!("the map is full: raise {size_flag}"),
            );
        }
    }
    failures
}

fn delete<K: Pod>(map: &MapData, keys: &[K]) -> Vec<(usize, io::Error)> {
    map_batch::delete_all(map.fd().as_fd(), keys)
}

impl MapWriter for ServiceMaps {
    type Error = io::Error;

    fn reset_stats(&mut self, resets: &[StatsReset]) -> Vec<(usize, io::Error)> {
        // Read once (it is a file read), not per slot; without it every reset fails alike.
        let cpus = match aya::util::nr_cpus() {
            Ok(cpus) => cpus,
            Err((_, err)) => {
                let failed = |i| (i, io::Error::new(err.kind(), err.to_string()));
                return (0..resets.len()).map(failed).collect();
            }
        };
        let slots: Vec<u32> = resets.iter().map(|r| u32::from(r.slot)).collect();
        // A per-CPU map's batch takes each slot's values on every possible CPU in a row.
        let values: Vec<BackendStats> = resets
            .iter()
            .flat_map(|reset| {
                let value = BackendStats {
                    owner: reset.owner,
                    ..BackendStats::default()
                };
                std::iter::repeat_n(value, cpus)
            })
            .collect();
        map_batch::update_all_per_cpu(self.stats.map().fd().as_fd(), &slots, &values, cpus)
    }

    fn insert_backends(&mut self, entries: &[(BackendKey, Backend)]) -> Vec<(usize, io::Error)> {
        update(self.backends.map(), entries, "--backends-max")
    }

    fn remove_backends(&mut self, keys: &[BackendKey]) -> Vec<(usize, io::Error)> {
        delete(self.backends.map(), keys)
    }

    fn insert_frontends(&mut self, entries: &[(FrontendKey, Frontend)]) -> Vec<(usize, io::Error)> {
        update(self.frontends.map(), entries, "--frontends-max")
    }

    fn remove_frontends(&mut self, keys: &[FrontendKey]) -> Vec<(usize, io::Error)> {
        delete(self.frontends.map(), keys)
    }

    fn insert_origins(
        &mut self,
        entries: &[(FrontendKey, FrontendOrigin)],
    ) -> Vec<(usize, io::Error)> {
        update(self.origins.map(), entries, "--frontends-max")
    }

    fn remove_origins(&mut self, keys: &[FrontendKey]) -> Vec<(usize, io::Error)> {
        delete(self.origins.map(), keys)
    }

    fn insert_statuses(&mut self, entries: &[(u32, ServiceStatus)]) -> Vec<(usize, io::Error)> {
        update(self.statuses.map(), entries, "--frontends-max")
    }

    fn remove_statuses(&mut self, service_ids: &[u32]) -> Vec<(usize, io::Error)> {
        delete(self.statuses.map(), service_ids)
    }

    fn insert_source_range(&mut self, range: SourceRange) -> Result<(), io::Error> {
        self.source_ranges
            .insert(&source_range_key(range), 1, 0)
            .map_err(io::Error::other)
    }

    fn remove_source_range(&mut self, range: SourceRange) -> Result<(), io::Error> {
        ignore_missing(self.source_ranges.remove(&source_range_key(range)))
            .map_err(io::Error::other)
    }

    fn insert_backends6(&mut self, entries: &[(BackendKey, Backend6)]) -> Vec<(usize, io::Error)> {
        update(self.v6.backends.map(), entries, "--backends-max")
    }

    fn remove_backends6(&mut self, keys: &[BackendKey]) -> Vec<(usize, io::Error)> {
        delete(self.v6.backends.map(), keys)
    }

    fn insert_frontends6(
        &mut self,
        entries: &[(FrontendKey6, Frontend)],
    ) -> Vec<(usize, io::Error)> {
        update(self.v6.frontends.map(), entries, "--frontends-max")
    }

    fn remove_frontends6(&mut self, keys: &[FrontendKey6]) -> Vec<(usize, io::Error)> {
        delete(self.v6.frontends.map(), keys)
    }

    fn insert_origins6(
        &mut self,
        entries: &[(FrontendKey6, FrontendOrigin)],
    ) -> Vec<(usize, io::Error)> {
        update(self.v6.origins.map(), entries, "--frontends-max")
    }

    fn remove_origins6(&mut self, keys: &[FrontendKey6]) -> Vec<(usize, io::Error)> {
        delete(self.v6.origins.map(), keys)
    }

    fn insert_source_range6(&mut self, range: SourceRange<Ipv6Net>) -> Result<(), io::Error> {
        self.v6
            .source_ranges
            .insert(&source_range_key6(range), 1, 0)
            .map_err(io::Error::other)
    }

    fn remove_source_range6(&mut self, range: SourceRange<Ipv6Net>) -> Result<(), io::Error> {
        ignore_missing(self.v6.source_ranges.remove(&source_range_key6(range)))
            .map_err(io::Error::other)
    }
}

/// The datapath's packet counters from the pinned COUNTERS map in `pin_dir`, summed over CPUs.
pub fn read_counters(pin_dir: &Path) -> Result<Vec<(Counter, u64)>, DatapathError> {
    let name = map_name::COUNTERS;
    let err = |source| DatapathError::Map { name, source };
    let data = MapData::from_pin(pin_dir.join(name)).map_err(err)?;
    let map = aya::maps::Map::from_map_data(data).map_err(err)?;
    let counters = PerCpuArray::<_, u64>::try_from(map).map_err(err)?;
    Counter::ALL
        .iter()
        .map(|&c| {
            let values = counters.get(&(c as u32), 0).map_err(err)?;
            Ok((c, values.iter().sum()))
        })
        .collect()
}

/// The agent's record in the pinned AGENT map in `pin_dir`.
pub fn read_agent_info(pin_dir: &Path) -> Result<AgentInfo, DatapathError> {
    let name = map_name::AGENT;
    pinned::<Array<MapData, AgentInfo>>(pin_dir, name)?
        .get(&0, 0)
        .map_err(|source| DatapathError::Map { name, source })
}

/// How full one pinned map is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapFill {
    pub name: &'static str,
    pub entries: u32,
    pub max_entries: u32,
}

/// How full each map pinned in `pin_dir` is (those not pinned are left out). An array always
/// holds all its entries, but for the counter slots, which fill as endpoints take them; a hash
/// map's keys are walked (a full 262k-entry conntrack: ~0.1 s).
pub fn read_map_fill(pin_dir: &Path) -> Vec<Result<MapFill, DatapathError>> {
    map_name::ALL
        .iter()
        .filter(|name| pin_dir.join(name).exists())
        .map(|&name| {
            let err = |source| DatapathError::Map { name, source };
            let data = MapData::from_pin(pin_dir.join(name)).map_err(err)?;
            let info = data.info().map_err(err)?;
            let max_entries = info.max_entries();
            let entries = match info.map_type().map_err(err)? {
                _ if name == map_name::BACKEND_STATS => stats_slots_in_use(pin_dir)?,
                MapType::Array | MapType::PerCpuArray => max_entries,
                _ => map_batch::count_keys(data.fd().as_fd(), info.key_size() as usize)
                    .map_err(|source| DatapathError::KeyWalk { name, source })?
                    as u32,
            };
            Ok(MapFill {
                name,
                entries,
                max_entries,
            })
        })
        .collect()
}

/// The counter slots of `BACKEND_STATS` that the pinned backends of both families hold.
fn stats_slots_in_use(pin_dir: &Path) -> Result<u32, DatapathError> {
    let backends: HashMap<MapData, BackendKey, Backend> = pinned(pin_dir, map_name::BACKENDS)?;
    let backends6: HashMap<MapData, BackendKey, Backend6> = pinned(pin_dir, map_name::BACKENDS6)?;
    let slots4 = backends
        .iter()
        .filter_map(Result::ok)
        .map(|(_, b)| b.stats_slot);
    let slots6 = backends6
        .iter()
        .filter_map(Result::ok)
        .map(|(_, b)| b.stats_slot);
    Ok(stats_slots::in_use(slots4.chain(slots6)).len() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_error(errno: i32) -> ProgramError {
        ProgramError::LoadError {
            io_error: io::Error::from_raw_os_error(errno),
            verifier_log: aya_obj::VerifierLog::new(String::new()),
        }
    }

    #[test]
    fn loads_are_retried_while_the_verifier_is_interrupted() {
        let mut calls = 0;
        let twice_interrupted = load_program(|| {
            calls += 1;
            if calls <= 2 {
                Err(load_error(EAGAIN))
            } else {
                Ok(())
            }
        });
        assert!(twice_interrupted.is_ok());
        assert_eq!(calls, 3);

        calls = 0;
        let always = load_program(|| {
            calls += 1;
            Err(load_error(EAGAIN))
        });
        assert!(always.is_err());
        assert_eq!(calls, 5);

        calls = 0;
        let refused = load_program(|| {
            calls += 1;
            Err(load_error(nix::libc::EACCES))
        });
        assert!(refused.is_err());
        assert_eq!(calls, 1, "a verifier refusal is final");
    }

    /// Needs root: creates the object's maps in the kernel (no program is loaded).
    #[test]
    fn batches_write_all_but_the_refused_entries() {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(map_name::BACKENDS, 4)
            .load(EBPF_OBJECT)
            .expect("create the maps (run as root)");
        let mut maps = ServiceMaps {
            frontends: take_map(&mut ebpf, map_name::FRONTENDS).unwrap(),
            backends: take_map(&mut ebpf, map_name::BACKENDS).unwrap(),
            source_ranges: take_map(&mut ebpf, map_name::SOURCE_RANGES).unwrap(),
            origins: take_map(&mut ebpf, map_name::FRONTEND_ORIGINS).unwrap(),
            statuses: take_map(&mut ebpf, map_name::SERVICE_STATUS).unwrap(),
            stats: take_map(&mut ebpf, map_name::BACKEND_STATS).unwrap(),
            v6: ServiceMaps6 {
                frontends: take_map(&mut ebpf, map_name::FRONTENDS6).unwrap(),
                backends: take_map(&mut ebpf, map_name::BACKENDS6).unwrap(),
                source_ranges: take_map(&mut ebpf, map_name::SOURCE_RANGES6).unwrap(),
                origins: take_map(&mut ebpf, map_name::FRONTEND_ORIGINS6).unwrap(),
            },
        };
        let entries: Vec<(BackendKey, Backend)> = (0..6)
            .map(|slot| {
                let key = BackendKey {
                    service_id: 1,
                    slot,
                };
                (
                    key,
                    Backend {
                        port: slot as u16,
                        ..Default::default()
                    },
                )
            })
            .collect();
        let failed = maps.insert_backends(&entries);
        let refused: Vec<usize> = failed.iter().map(|(i, _)| *i).collect();
        assert_eq!(
            refused,
            [4, 5],
            "a full map refuses the last two: {failed:?}"
        );
        assert_eq!(maps.read().unwrap().backends.len(), 4);
        // Present and missing keys: the missing one is no failure and the batch goes on.
        let keys = [entries[0].0, entries[5].0, entries[1].0];
        assert!(maps.remove_backends(&keys).is_empty());
        let left: Vec<u32> = maps
            .read()
            .unwrap()
            .backends
            .keys()
            .map(|k| k.slot)
            .collect();
        assert_eq!(left, [2, 3]);
    }
}
