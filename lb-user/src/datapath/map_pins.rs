//! The pinned maps across agent versions: a pinned map is reused only when its layout is the one
//! this build's object declares; maps of an earlier layout are converted into today's, and the old
//! pins are removed only once the new programs are in place.
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use aya::maps::{HashMap, Map, MapData, MapError};
use lb_common::legacy::{self, ConntrackEntryV1, ConntrackEntryV2, ConntrackEntryV3};
use lb_common::{ConntrackEntry, ConntrackKey, map_name};
use tracing::{info, warn};

/// The map update flag that refuses to overwrite an existing key (uapi/linux/bpf.h).
const BPF_NOEXIST: u64 = 1;

/// What the kernel checks a map by: a pinned map is reused only if these are the object's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub flags: u32,
    pub max_entries: u32,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "type {}, key {} B, value {} B, flags {:#x}, max_entries {}",
            self.map_type, self.key_size, self.value_size, self.flags, self.max_entries
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MapPinError {
    #[error("parsing the eBPF object: {0}")]
    Object(#[from] aya_obj::ParseError),
    #[error("pinned map {name}: {source}")]
    Map { name: String, source: MapError },
    #[error(
        "pinned map {name} has another layout than this build's ({pinned}; this build: {wanted}): \
         it belongs to an incompatible build under the same ABI version and is not reused; the \
         running datapath is left as it is (`lb cleanup` removes it, with its connections)"
    )]
    Incompatible {
        name: String,
        pinned: Layout,
        wanted: Layout,
    },
}

/// A map as this build declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Declared {
    pub layout: Layout,
    /// Its size is a flag's (`--conntrack-max`, ...): a pinned map of another size is kept. Any
    /// other map of another size is another layout (e.g. more counters).
    pub sized_by_flag: bool,
}

/// How a pinned map compares with the object's declaration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    Same,
    /// Only the size differs: the pinned map keeps its entries and its size.
    Resized {
        pinned: u32,
        requested: u32,
    },
    Incompatible,
}

pub fn fit(pinned: Layout, declared: Declared) -> Fit {
    let wanted = declared.layout;
    let same_but_size = Layout {
        max_entries: wanted.max_entries,
        ..pinned
    };
    if same_but_size != wanted || (!declared.sized_by_flag && pinned != wanted) {
        Fit::Incompatible
    } else if pinned.max_entries != wanted.max_entries {
        Fit::Resized {
            pinned: pinned.max_entries,
            requested: wanted.max_entries,
        }
    } else {
        Fit::Same
    }
}

/// The layouts `object` declares for its pinned maps, with the flags' sizes in `sizes` applied.
pub fn declared(
    object: &[u8],
    sizes: &BTreeMap<&str, u32>,
) -> Result<BTreeMap<String, Declared>, MapPinError> {
    let object = aya_obj::Object::parse(object)?;
    Ok(object
        .maps
        .iter()
        .filter(|(name, _)| map_name::ALL.contains(&name.as_str()))
        .map(|(name, map)| {
            let size = sizes.get(name.as_str()).copied();
            let layout = Layout {
                map_type: map.map_type(),
                key_size: map.key_size(),
                value_size: map.value_size(),
                flags: map.map_flags(),
                max_entries: size.unwrap_or(map.max_entries()),
            };
            let declared = Declared {
                layout,
                sized_by_flag: size.is_some(),
            };
            (name.clone(), declared)
        })
        .collect())
}

fn pinned_layout(path: &Path, name: &str) -> Result<Option<Layout>, MapPinError> {
    let err = |source| MapPinError::Map {
        name: name.to_owned(),
        source,
    };
    if !path.exists() {
        return Ok(None);
    }
    let info = MapData::from_pin(path)
        .and_then(|m| m.info())
        .map_err(err)?;
    Ok(Some(Layout {
        map_type: info.map_type().map_err(err)? as u32,
        key_size: info.key_size(),
        value_size: info.value_size(),
        flags: info.map_flags(),
        max_entries: info.max_entries(),
    }))
}

/// Checks every map pinned in `pin_dir` under a name of this build against its declared
/// layout, before anything is loaded: an incompatible one is an error and changes nothing.
pub fn check(pin_dir: &Path, declared: &BTreeMap<String, Declared>) -> Result<(), MapPinError> {
    for (name, &wanted) in declared {
        let Some(pinned) = pinned_layout(&pin_dir.join(name), name)? else {
            continue;
        };
        match fit(pinned, wanted) {
            Fit::Same => {}
            Fit::Resized { pinned, requested } => warn!(
                map = %name,
                pinned,
                requested,
                "pinned map keeps its size; `lb cleanup` and a restart resize it (drops its contents)"
            ),
            Fit::Incompatible => {
                return Err(MapPinError::Incompatible {
                    name: name.clone(),
                    pinned,
                    wanted: wanted.layout,
                });
            }
        }
    }
    Ok(())
}

/// Copies the connections of an earlier agent's conntrack map in `pin_dir` (`LB_CT_V1` to
/// `LB_CT_V3`, oldest first, so that the newest wins should several be there) into `conntrack`.
/// `only_new`: keep entries `conntrack` already has (a second pass after the new programs are
/// in, for connections the old ones opened meanwhile). Returns how many were copied.
pub fn migrate_legacy_conntrack(
    pin_dir: &Path,
    conntrack: &mut HashMap<MapData, ConntrackKey, ConntrackEntry>,
    only_new: bool,
) -> Result<usize, MapPinError> {
    Ok(
        migrate_conntrack::<ConntrackEntryV1>(pin_dir, legacy::CONNTRACK_V1, conntrack, only_new)?
            + migrate_conntrack::<ConntrackEntryV2>(
                pin_dir,
                legacy::CONNTRACK_V2,
                conntrack,
                only_new,
            )?
            + migrate_conntrack::<ConntrackEntryV3>(
                pin_dir,
                legacy::CONNTRACK_V3,
                conntrack,
                only_new,
            )?,
    )
}

/// Copies the connections of the pinned conntrack map `name`, of `Old` values, if there is one.
fn migrate_conntrack<Old>(
    pin_dir: &Path,
    name: &str,
    conntrack: &mut HashMap<MapData, ConntrackKey, ConntrackEntry>,
    only_new: bool,
) -> Result<usize, MapPinError>
where
    Old: aya::Pod + Into<ConntrackEntryV3>,
{
    let path = pin_dir.join(name);
    let err = |source| MapPinError::Map {
        name: name.to_owned(),
        source,
    };
    let Some(pinned) = pinned_layout(&path, name)? else {
        return Ok(0);
    };
    let wanted = Layout {
        key_size: size_of::<ConntrackKey>() as u32,
        value_size: size_of::<Old>() as u32,
        ..pinned
    };
    if pinned != wanted {
        return Err(MapPinError::Incompatible {
            name: name.to_owned(),
            pinned,
            wanted,
        });
    }
    let old: HashMap<MapData, ConntrackKey, Old> =
        HashMap::try_from(Map::from_map_data(MapData::from_pin(&path).map_err(err)?).map_err(err)?)
            .map_err(err)?;
    let flags = if only_new { BPF_NOEXIST } else { 0 };
    let mut copied = 0;
    for entry in old.iter() {
        // An entry the old datapath deletes while it is read is skipped.
        let Ok((key, value)) = entry else { continue };
        let entry = value.into().converted(key.proto);
        match conntrack.insert(key, entry, flags) {
            Ok(()) => copied += 1,
            Err(MapError::SyscallError(e))
                if only_new && e.io_error.raw_os_error() == Some(nix::libc::EEXIST) => {}
            Err(source) => {
                return Err(MapPinError::Map {
                    name: map_name::CONNTRACK.to_owned(),
                    source,
                });
            }
        }
    }
    info!(
        from = name,
        to = map_name::CONNTRACK,
        copied,
        "conntrack migrated"
    );
    Ok(copied)
}

/// Removes from `pin_dir` the maps an agent of another ABI version pinned (`LB_*_V<n>` not in
/// `map_name::ALL`), which no one reuses and would otherwise keep their memory (a conntrack map
/// is hundreds of MiB). Called once the new programs are in place and the migrations written.
pub fn remove_stale(pin_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(pin_dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if is_stale(name) {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => info!(pin = name, "removed a map pinned by another ABI version"),
                Err(err) => warn!(pin = name, %err, "could not remove a stale pinned map"),
            }
        }
    }
}

fn is_stale(name: &str) -> bool {
    let versioned = name.starts_with("LB_")
        && name
            .rsplit_once("_V")
            .is_some_and(|(_, v)| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()));
    versioned && !map_name::ALL.contains(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pins_of_other_abi_versions_are_stale() {
        assert!(is_stale("LB_CT_V1"));
        assert!(is_stale("LB_CT_V2"));
        assert!(is_stale("LB_CT_V3"));
        assert!(is_stale("LB_BACKEND_STATS_V1"));
        assert!(is_stale("LB_FRONTEND_V3"));
        for current in map_name::ALL {
            assert!(!is_stale(current), "{current}");
        }
        for not_ours in [
            "cilium_ct4_global",
            "LB_NOTES",
            "LB_CT_Vx",
            "LB_CT_V",
            "lb_ct_v1",
        ] {
            assert!(!is_stale(not_ours), "{not_ours}");
        }
    }

    #[test]
    fn a_layout_fits_only_if_the_same_or_resized_by_its_flag() {
        let wanted = Layout {
            map_type: 9,
            key_size: 16,
            value_size: 48,
            flags: 0,
            max_entries: 1024,
        };
        let by_flag = Declared {
            layout: wanted,
            sized_by_flag: true,
        };
        let fixed = Declared {
            layout: wanted,
            sized_by_flag: false,
        };
        assert_eq!(fit(wanted, by_flag), Fit::Same);
        assert_eq!(fit(wanted, fixed), Fit::Same);
        let bigger = Layout {
            max_entries: 4096,
            ..wanted
        };
        assert_eq!(
            fit(bigger, by_flag),
            Fit::Resized {
                pinned: 4096,
                requested: 1024
            }
        );
        // A map whose size is the object's (the counters): another size is another layout.
        assert_eq!(fit(bigger, fixed), Fit::Incompatible);
        for other in [
            Layout {
                map_type: 1,
                ..wanted
            },
            Layout {
                key_size: 12,
                ..wanted
            },
            Layout {
                value_size: 32,
                ..wanted
            },
            Layout { flags: 1, ..wanted },
        ] {
            assert_eq!(fit(other, by_flag), Fit::Incompatible, "{other}");
        }
    }

    #[test]
    fn the_object_declares_every_pinned_map() {
        let sizes = BTreeMap::from([(map_name::CONNTRACK, 777)]);
        let declared = declared(crate::datapath::EBPF_OBJECT, &sizes).unwrap();
        for name in map_name::ALL {
            assert!(declared.contains_key(name), "{name}");
        }
        let ct = declared[map_name::CONNTRACK];
        assert!(ct.sized_by_flag && !declared[map_name::COUNTERS].sized_by_flag);
        let ct = ct.layout;
        assert_eq!(ct.max_entries, 777);
        assert_eq!(ct.key_size as usize, size_of::<ConntrackKey>());
        assert_eq!(ct.value_size as usize, size_of::<ConntrackEntry>());
    }
}
