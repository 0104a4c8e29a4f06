//! The BPF programs, maps and links one process holds, by kernel id, and whether they are still
//! loaded. Ids are unique in the kernel, so tests in parallel never mistake each other's objects.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use aya::programs::links::{FdLink, LinkType, PinnedLink};

/// Kernel ids of BPF objects.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BpfIds {
    pub programs: BTreeSet<u32>,
    pub maps: BTreeSet<u32>,
    pub links: BTreeSet<u32>,
}

impl BpfIds {
    /// Every program, map and link `pid` holds a file descriptor of (a link's fd also names its
    /// program), read from /proc/PID/fdinfo.
    pub fn held_by(pid: u32) -> Result<Self> {
        let dir = format!("/proc/{pid}/fdinfo");
        let mut ids = BpfIds::default();
        for entry in fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
            // An fd closed since the listing has no fdinfo any more.
            let Ok(info) = fs::read_to_string(entry?.path()) else {
                continue;
            };
            for line in info.lines() {
                let Some((field, value)) = line.split_once(':') else {
                    continue;
                };
                let set = match field {
                    "prog_id" => &mut ids.programs,
                    "map_id" => &mut ids.maps,
                    "link_id" => &mut ids.links,
                    _ => continue,
                };
                set.insert(value.trim().parse().with_context(|| format!("{line:?}"))?);
            }
        }
        Ok(ids)
    }

    /// Those of these objects the kernel still has. (An object that goes between the kernel's
    /// listing and its opening errs in the listing: it is gone.)
    pub fn still_loaded(&self) -> BpfIds {
        let programs = aya::programs::loaded_programs().filter_map(|p| p.ok().map(|p| p.id()));
        let maps = aya::maps::loaded_maps().filter_map(|m| m.ok().map(|m| m.id()));
        let links = aya::programs::loaded_links().filter_map(|l| l.ok().map(|l| l.id()));
        BpfIds {
            programs: programs.filter(|id| self.programs.contains(id)).collect(),
            maps: maps.filter(|id| self.maps.contains(id)).collect(),
            links: links.filter(|id| self.links.contains(id)).collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.programs.is_empty() && self.maps.is_empty() && self.links.is_empty()
    }

    /// Waits until the kernel has released every one of these objects (it frees them a moment
    /// after the last reference goes).
    pub fn await_released(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let loaded = self.still_loaded();
            if loaded.is_empty() {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "still loaded after {timeout:?}: {loaded:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A link pinned on a bpffs, as the kernel describes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PinnedLinkInfo {
    pub id: u32,
    pub program: u32,
    pub link_type: LinkType,
}

/// Every link pinned under `dir` (searched recursively), by path relative to `dir`.
pub fn pinned_links(dir: &Path) -> Result<BTreeMap<String, PinnedLinkInfo>> {
    let mut links = BTreeMap::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(current) = dirs.pop() {
        let entries =
            fs::read_dir(&current).with_context(|| format!("reading {}", current.display()))?;
        for entry in entries {
            let entry = entry?;
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                dirs.push(path);
                continue;
            }
            let pinned = PinnedLink::from_pin(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            // Dropped at once: the test holds no reference to the link.
            let info = FdLink::from(pinned).info()?;
            let name = path.strip_prefix(dir)?.to_string_lossy().into_owned();
            links.insert(
                name,
                PinnedLinkInfo {
                    id: info.id(),
                    program: info.program_id(),
                    link_type: info.link_type()?,
                },
            );
        }
    }
    Ok(links)
}

/// The id of the program in each slot of the program array pinned at `path` (`None`: empty).
pub fn program_array_ids(path: &Path) -> Result<Vec<Option<u32>>> {
    use std::os::fd::{AsFd as _, AsRawFd as _};

    use nix::libc;

    /// The lookup member of union bpf_attr.
    #[repr(C)]
    struct LookupAttr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }
    const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
    let map = aya::maps::MapData::from_pin(path)
        .with_context(|| format!("pinned map {}", path.display()))?;
    let slots = map.info()?.max_entries();
    (0..slots)
        .map(|slot: u32| {
            let mut id: u32 = 0;
            let mut attr = LookupAttr {
                map_fd: map.fd().as_fd().as_raw_fd() as u32,
                _pad: 0,
                key: &slot as *const u32 as u64,
                value: &mut id as *mut u32 as u64,
                flags: 0,
            };
            // SAFETY: `attr` is the lookup member of union bpf_attr; `slot` and `id` are live
            // for the call. A program array's lookup from user space answers the program's id.
            let ret = unsafe {
                libc::syscall(
                    libc::SYS_bpf,
                    BPF_MAP_LOOKUP_ELEM,
                    &mut attr as *mut LookupAttr,
                    std::mem::size_of::<LookupAttr>() as libc::c_uint,
                )
            };
            if ret == 0 {
                return Ok(Some(id));
            }
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::ENOENT) => Ok(None),
                _ => Err(err).with_context(|| format!("{} slot {slot}", path.display())),
            }
        })
        .collect()
}
