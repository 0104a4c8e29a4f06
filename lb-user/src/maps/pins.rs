//! Finding the agent's pinned maps from another process.
//!
//! Under `ip netns exec` every process gets its own mount namespace, so the bpffs the agent
//! mounted is invisible to a later `ip netns exec ... lb stats`. The agent's view is still
//! reachable through /proc/PID/root of an agent running in the same network namespace.
use std::fs;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use aya::maps::{Map, MapData, MapError};

/// `dir` if `pin` is pinned there; else the same directory as seen by an `lb agent` process in
/// this network namespace; None if neither has it.
pub fn locate(dir: &Path, pin: &str) -> Option<PathBuf> {
    if dir.join(pin).exists() {
        return Some(dir.to_owned());
    }
    let relative = dir.strip_prefix("/").unwrap_or(dir);
    agents()
        .into_iter()
        .map(|proc| proc.join("root").join(relative))
        .find(|candidate| candidate.join(pin).exists())
}

/// Whether an `lb agent` process runs in this network namespace.
pub fn agent_running() -> bool {
    !agents().is_empty()
}

/// The /proc/PID directories of the `lb agent` processes in this network namespace.
fn agents() -> Vec<PathBuf> {
    let Ok(own_netns) = fs::read_link("/proc/self/ns/net") else {
        return Vec::new();
    };
    let Ok(procs) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|e| e.path())
        .filter(|proc| fs::read_link(proc.join("ns/net")).ok().as_ref() == Some(&own_netns))
        .filter(|proc| fs::read(proc.join("cmdline")).is_ok_and(|c| is_agent(&c)))
        .collect()
}

/// The map pinned as `name` in `dir`, as the aya map type `T` (`HashMap<MapData, K, V>`, ...).
pub fn open<T>(dir: &Path, name: &str) -> anyhow::Result<T>
where
    T: TryFrom<Map, Error = MapError>,
{
    MapData::from_pin(dir.join(name))
        .and_then(Map::from_map_data)
        .and_then(T::try_from)
        .map_err(|e| anyhow::anyhow!("opening {name}: {}", crate::error_chain(&e)))
}

/// The directory `locate` finds, or an error saying where `pin` was looked for.
pub fn find(dir: &Path, pin: &str) -> anyhow::Result<PathBuf> {
    locate(dir, pin).ok_or_else(|| {
        anyhow::anyhow!(
            "no {pin} pinned in {} (nor seen by an agent in this network namespace)",
            dir.display()
        )
    })
}

/// argv is `.../lb agent ...`.
fn is_agent(cmdline: &[u8]) -> bool {
    let mut args = cmdline.split(|&b| b == 0);
    let program = args
        .next()
        .map(|a| Path::new(std::ffi::OsStr::from_bytes(a)));
    program.is_some_and(|p| p.file_name().is_some_and(|n| n == "lb"))
        && args.next() == Some(b"agent")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_agent_command_lines() {
        assert!(is_agent(
            b"/work/target/release/lb\0agent\0--manifests\0/x\0"
        ));
        assert!(is_agent(b"lb\0agent\0"));
        assert!(!is_agent(b"lb\0stats\0"));
        assert!(!is_agent(b"/usr/bin/lbx\0agent\0"));
    }
}
