//! An older release's pinned conntrack, built from a running datapath's: what an agent upgrading
//! from that release finds in its bpffs.
use std::path::Path;

use anyhow::{Context as _, Result, ensure};
use aya::maps::{HashMap, Map, MapData};
use lb_common::{
    ConntrackEntry, ConntrackKey,
    legacy::{CONNTRACK_V2, ConntrackEntryV2},
    map_name,
};

/// Replaces the pinned `LB_CT_V3` in `pin_dir` by an `LB_CT_V2` (same type, key, max_entries and
/// flags, the previous release's value layout) holding the same connections, and returns how
/// many entries it converted. The programs still attached keep using the unpinned `LB_CT_V3`; an
/// agent started next finds only `LB_CT_V2`.
pub fn downgrade(pin_dir: &Path) -> Result<usize> {
    let current_path = pin_dir.join(map_name::CONNTRACK);
    let current = MapData::from_pin(&current_path)
        .with_context(|| format!("opening {}", current_path.display()))?;
    let info = current.info()?;
    let current: HashMap<_, ConntrackKey, ConntrackEntry> =
        HashMap::try_from(Map::from_map_data(current)?)?;

    let def = aya_obj::Map::new_from_params(
        info.map_type()? as u32,
        size_of::<ConntrackKey>() as u32,
        size_of::<ConntrackEntryV2>() as u32,
        info.max_entries(),
        info.map_flags(),
    );
    let legacy = MapData::create(def, CONNTRACK_V2, None).context("creating LB_CT_V2")?;
    let legacy_path = pin_dir.join(CONNTRACK_V2);
    legacy
        .pin(&legacy_path)
        .with_context(|| format!("pinning {}", legacy_path.display()))?;
    let mut legacy: HashMap<_, ConntrackKey, ConntrackEntryV2> =
        HashMap::try_from(Map::from_map_data(legacy)?)?;

    let mut converted = 0;
    for entry in current.iter() {
        let (key, value) = entry?;
        legacy.insert(key, to_v2(value), 0)?;
        converted += 1;
    }
    ensure!(converted > 0, "{} is empty", current_path.display());
    std::fs::remove_file(&current_path)
        .with_context(|| format!("unpinning {}", current_path.display()))?;
    Ok(converted)
}

/// The entry as the previous release stored it: without its counter slot.
fn to_v2(entry: ConntrackEntry) -> ConntrackEntryV2 {
    ConntrackEntryV2 {
        last_seen_ns: entry.last_seen_ns,
        src_addr: entry.src_addr,
        dst_addr: entry.dst_addr,
        src_port: entry.src_port,
        dst_port: entry.dst_port,
        service_id: entry.service_id,
        state: entry.state,
        flags: entry.flags,
        hop_len: entry.hop_len,
        hop: entry.hop,
    }
}
