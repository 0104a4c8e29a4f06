//! Loading the embedded eBPF object with pinned maps, and the agent's handles on its maps.
use std::collections::BTreeSet;
use std::io;
use std::os::fd::AsFd as _;
use std::os::raw::c_int;
use std::path::Path;

use aya::maps::{Array, HashMap, IterableMap, MapData, MapError, PerCpuArray};
use aya::programs::{ProgramError, SchedClassifier};
use aya::{Ebpf, EbpfError, EbpfLoader};
use bytemuck::Pod;
use lb_common::{
    Backend, BackendKey, Config, ConntrackEntry, ConntrackKey, Counter, Frontend, FrontendKey,
    map_name, program_name,
};
use tracing::warn;

use crate::map_batch;

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

fn update<K: Pod, V: Pod>(map: &MapData, entries: &[(K, V)]) -> Vec<(usize, io::Error)> {
    let (keys, values): (Vec<K>, Vec<V>) = entries.iter().copied().unzip();
    map_batch::update_all(map.fd().as_fd(), &keys, &values)
}

fn delete<K: Pod>(map: &MapData, keys: &[K]) -> Vec<(usize, io::Error)> {
    map_batch::delete_all(map.fd().as_fd(), keys)
}

impl MapWriter for ServiceMaps {
    type Error = io::Error;

    fn insert_backends(&mut self, entries: &[(BackendKey, Backend)]) -> Vec<(usize, io::Error)> {
        update(self.backends.map(), entries)
    }

    fn remove_backends(&mut self, keys: &[BackendKey]) -> Vec<(usize, io::Error)> {
        delete(self.backends.map(), keys)
    }

    fn insert_frontends(&mut self, entries: &[(FrontendKey, Frontend)]) -> Vec<(usize, io::Error)> {
        update(self.frontends.map(), entries)
    }

    fn remove_frontends(&mut self, keys: &[FrontendKey]) -> Vec<(usize, io::Error)> {
        delete(self.frontends.map(), keys)
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

#[cfg(test)]
mod tests {
    use super::*;

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
