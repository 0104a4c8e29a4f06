//! B7: what the datapath's maps cost, from the kernel's own accounting (`memlock` in the map's
//! fdinfo) of a private copy loaded with the default sizes, and the agent's resident memory.
use std::{
    fs,
    os::fd::{AsFd as _, AsRawFd as _},
};

use anyhow::{Context as _, Result};
use aya::{EbpfLoader, maps::Map};
use lb_common::map_name;
use lb_tests::netns::Netns;
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct MapMemory {
    pub map: &'static str,
    pub max_entries: u32,
    pub bytes: u64,
    pub bytes_per_entry: f64,
}

/// Every map of the object at its default size.
pub fn maps() -> Result<Vec<MapMemory>> {
    let mut ebpf = EbpfLoader::new()
        .load(lb_user::datapath::EBPF_OBJECT)
        .context("load the eBPF object (run as root)")?;
    map_name::ALL
        .iter()
        .map(|&name| {
            let map = ebpf
                .take_map(name)
                .with_context(|| format!("no map {name}"))?;
            let data = match &map {
                Map::HashMap(d)
                | Map::LruHashMap(d)
                | Map::Array(d)
                | Map::PerCpuArray(d)
                | Map::LpmTrie(d)
                | Map::ProgramArray(d) => d,
                _ => anyhow::bail!("map {name}: unexpected type"),
            };
            let max_entries = data.info()?.max_entries();
            let fdinfo = fs::read_to_string(format!(
                "/proc/self/fdinfo/{}",
                data.fd().as_fd().as_raw_fd()
            ))?;
            let bytes = fdinfo
                .lines()
                .find_map(|l| l.strip_prefix("memlock:"))
                .context("no memlock in fdinfo")?
                .trim()
                .parse::<u64>()?;
            Ok(MapMemory {
                map: name,
                max_entries,
                bytes,
                bytes_per_entry: bytes as f64 / f64::from(max_entries),
            })
        })
        .collect()
}

/// Resident memory of the processes in `ns` (the agent is the only one in a node namespace), in
/// bytes.
pub fn resident_bytes(ns: &Netns) -> Result<u64> {
    let out = std::process::Command::new("ip")
        .args(["netns", "pids", ns.name()])
        .output()?;
    let mut total = 0;
    for pid in String::from_utf8(out.stdout)?.split_whitespace() {
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        if let Some(kb) = status.lines().find_map(|l| l.strip_prefix("VmRSS:")) {
            total += kb.trim().trim_end_matches(" kB").trim().parse::<u64>()? * 1024;
        }
    }
    Ok(total)
}
