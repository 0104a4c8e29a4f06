//! Loading the embedded eBPF object with pinned maps, and the agent's handles on its maps.
use std::collections::BTreeSet;
use std::os::raw::c_int;
use std::path::Path;

use aya::maps::{Array, HashMap, MapData, MapError, PerCpuArray};
use aya::programs::{CgroupSockAddr, ProgramError, SchedClassifier};
use aya::{Ebpf, EbpfError, EbpfLoader};
use lb_common::{
    Backend, BackendKey, Config, ConntrackEntry, ConntrackKey, Counter, Frontend, FrontendKey,
    map_name, program_name,
};
use tracing::warn;

use crate::reconcile::{MapContents, MapWriter};
use crate::udp_flush::{self, UdpEndpoint};

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
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: ProgramError,
    },
}

/// Map sizes (max_entries).
#[derive(Clone, Copy, Debug)]
pub struct MapSizes {
    pub frontends: u32,
    pub backends: u32,
    pub conntrack: u32,
}

/// The loaded object: its ingress program (loaded, not attached) and the maps the agent writes.
pub struct Datapath {
    ebpf: Ebpf,
    pub service_maps: ServiceMaps,
    config: Array<MapData, Config>,
    conntrack: HashMap<MapData, ConntrackKey, ConntrackEntry>,
}

impl Datapath {
    /// Loads the object with every map pinned in `pin_dir` (reused when already pinned, so
    /// conntrack survives an agent restart) and loads the ingress program.
    pub fn load(pin_dir: &Path, sizes: MapSizes) -> Result<Self, DatapathError> {
        let mut loader = EbpfLoader::new();
        for name in map_name::ALL {
            loader.map_pin_path(name, pin_dir.join(name));
        }
        let wanted = [
            (map_name::FRONTENDS, sizes.frontends),
            (map_name::BACKENDS, sizes.backends),
            (map_name::CONNTRACK, sizes.conntrack),
        ];
        for (name, size) in wanted {
            loader.map_max_entries(name, size);
        }
        let mut ebpf = loader.load(EBPF_OBJECT)?;

        for (name, size) in wanted {
            let pinned = MapData::from_pin(pin_dir.join(name))
                .and_then(|map| map.info())
                .map_err(|source| DatapathError::Map { name, source })?
                .max_entries();
            if pinned != size {
                warn!(
                    map = name,
                    pinned,
                    requested = size,
                    "pinned map keeps its size; remove the pin to resize (drops its contents)"
                );
            }
        }

        let service_maps = ServiceMaps {
            frontends: take_map(&mut ebpf, map_name::FRONTENDS)?,
            backends: take_map(&mut ebpf, map_name::BACKENDS)?,
        };
        let config = take_map(&mut ebpf, map_name::CONFIG)?;
        let conntrack = take_map(&mut ebpf, map_name::CONNTRACK)?;
        let mut datapath = Datapath {
            ebpf,
            service_maps,
            config,
            conntrack,
        };
        datapath
            .ingress()?
            .load()
            .map_err(|source| DatapathError::Program {
                name: program_name::INGRESS,
                source,
            })?;
        Ok(datapath)
    }

    pub fn ingress(&mut self) -> Result<&mut SchedClassifier, DatapathError> {
        let name = program_name::INGRESS;
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

    /// Deletes the conntrack entries (both directions) of connections to `removed` UDP
    /// endpoints; returns how many. Entries the datapath drops meanwhile are no failure.
    pub fn flush_udp(&mut self, removed: &BTreeSet<UdpEndpoint>) -> Result<usize, DatapathError> {
        let err = |source| DatapathError::Map {
            name: map_name::CONNTRACK,
            source,
        };
        // Collected first: deleting while iterating would restart the walk.
        let entries: Vec<_> = self.conntrack.iter().filter_map(Result::ok).collect();
        let stale: Vec<ConntrackKey> = udp_flush::stale_entries(entries, removed).collect();
        for key in &stale {
            ignore_missing(self.conntrack.remove(key)).map_err(err)?;
        }
        Ok(stale.len())
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

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DatapathError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or(DatapathError::MissingMap(name))?;
    T::try_from(map).map_err(|source| DatapathError::Map { name, source })
}

/// FRONTENDS and BACKENDS, written by the reconciler.
pub struct ServiceMaps {
    frontends: HashMap<MapData, FrontendKey, Frontend>,
    backends: HashMap<MapData, BackendKey, Backend>,
}

impl ServiceMaps {
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
        Ok(MapContents {
            frontends,
            backends,
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

impl MapWriter for ServiceMaps {
    type Error = MapError;

    fn insert_backend(&mut self, key: BackendKey, value: Backend) -> Result<(), MapError> {
        self.backends.insert(key, value, 0)
    }

    fn remove_backend(&mut self, key: BackendKey) -> Result<(), MapError> {
        ignore_missing(self.backends.remove(&key))
    }

    fn insert_frontend(&mut self, key: FrontendKey, value: Frontend) -> Result<(), MapError> {
        self.frontends.insert(key, value, 0)
    }

    fn remove_frontend(&mut self, key: FrontendKey) -> Result<(), MapError> {
        ignore_missing(self.frontends.remove(&key))
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
