//! The cgroup v2 directory of the socket hooks when `--cgroup` is not given: the root of the
//! cgroup2 file system this process sees in /proc/self/mountinfo, else one the agent mounts.
//!
//! The usual places do not always hold it: on a hybrid (v1 + v2) host it is mounted at
//! /sys/fs/cgroup/unified, and `ip netns exec` gives the process a fresh sysfs where
//! /sys/fs/cgroup is an empty directory with nothing mounted on it.
use std::io;
use std::path::{Path, PathBuf};

use nix::mount::{MsFlags, mount};
use nix::sys::statfs::{CGROUP2_SUPER_MAGIC, FsType, SYSFS_MAGIC, statfs};
use procfs_core::FromRead as _;
use procfs_core::process::MountInfos;
use tracing::info;

const MOUNTINFO: &str = "/proc/self/mountinfo";
/// Where the agent mounts cgroup2 when this is an empty sysfs directory (under `ip netns exec`).
const SYS_FS_CGROUP: &str = "/sys/fs/cgroup";
/// Where it mounts cgroup2 otherwise (e.g. a host with only cgroup v1 mounted).
const OWN_MOUNT: &str = "/run/lb/cgroup2";

#[derive(Debug, thiserror::Error)]
pub enum CgroupMountError {
    #[error("reading {MOUNTINFO}: {0}")]
    Mountinfo(#[from] procfs_core::ProcError),
    #[error("statfs {}: {source}", path.display())]
    Statfs { path: PathBuf, source: nix::Error },
    #[error("creating {}: {source}", path.display())]
    Mkdir { path: PathBuf, source: io::Error },
    #[error("mounting cgroup2 on {}: {source}", path.display())]
    Mount { path: PathBuf, source: nix::Error },
}

/// The cgroup directory whose sockets the hooks translate, from `--cgroup` (`flag`): `None`
/// when the flag is `""` (no hooks), the flag's path when given, else the cgroup v2 root found
/// in /proc/self/mountinfo, else the root of a cgroup2 file system mounted here.
pub fn resolve(flag: Option<&Path>) -> Result<Option<PathBuf>, CgroupMountError> {
    match flag {
        Some(path) if path.as_os_str().is_empty() => Ok(None),
        Some(path) => Ok(Some(path.to_owned())),
        None => find_or_mount().map(Some),
    }
}

fn find_or_mount() -> Result<PathBuf, CgroupMountError> {
    let mounts = MountInfos::from_file(MOUNTINFO)?;
    for root in cgroup2_roots(&mounts) {
        // A later mount on the same directory hides this one.
        if is_on(root, CGROUP2_SUPER_MAGIC)? {
            return Ok(root.to_owned());
        }
    }
    let path = Path::new(SYS_FS_CGROUP);
    // sysfs keeps /sys/fs/cgroup as an empty directory to mount on: nothing is mounted there.
    let path = if is_on(path, SYSFS_MAGIC)? {
        path
    } else {
        let own = Path::new(OWN_MOUNT);
        std::fs::create_dir_all(own).map_err(|source| CgroupMountError::Mkdir {
            path: own.to_owned(),
            source,
        })?;
        own
    };
    mount_cgroup2(path)?;
    Ok(path.to_owned())
}

/// The mount points of the cgroup2 file systems that show their hierarchy's root (not a
/// directory below it, as a bind mount of a child cgroup does), in mount order.
fn cgroup2_roots(mounts: &MountInfos) -> impl Iterator<Item = &Path> {
    mounts
        .iter()
        .filter(|m| m.fs_type == "cgroup2" && m.root == "/")
        .map(|m| m.mount_point.as_path())
}

/// Whether `path` is on a file system of type `magic` (false when it does not exist).
fn is_on(path: &Path, magic: FsType) -> Result<bool, CgroupMountError> {
    match statfs(path) {
        Ok(st) => Ok(st.filesystem_type() == magic),
        Err(nix::Error::ENOENT) => Ok(false),
        Err(source) => Err(CgroupMountError::Statfs {
            path: path.to_owned(),
            source,
        }),
    }
}

fn mount_cgroup2(path: &Path) -> Result<(), CgroupMountError> {
    mount(
        Some("cgroup2"),
        path,
        Some("cgroup2"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(|source| CgroupMountError::Mount {
        path: path.to_owned(),
        source,
    })?;
    info!(path = %path.display(), "mounted cgroup2 (none was visible)");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roots(mountinfo: &str) -> Vec<PathBuf> {
        let mounts = MountInfos::from_read(mountinfo.as_bytes()).expect("parses");
        cgroup2_roots(&mounts).map(Path::to_owned).collect()
    }

    #[test]
    fn unified_host() {
        let mountinfo = "\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
25 22 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw
30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
31 25 0:27 / /sys/fs/bpf rw,nosuid,nodev,noexec,relatime shared:5 - bpf bpf rw,mode=700
";
        assert_eq!(roots(mountinfo), [PathBuf::from("/sys/fs/cgroup")]);
    }

    #[test]
    fn hybrid_host() {
        // This machine: cgroup v1 hierarchies on a tmpfs, cgroup2 at unified.
        let mountinfo = "\
23 1 0:22 / /sys rw,relatime - sysfs sysfs rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
        assert_eq!(roots(mountinfo), [PathBuf::from("/sys/fs/cgroup/unified")]);
    }

    #[test]
    fn none_under_ip_netns_exec() {
        // `ip netns exec` unmounted /sys (and everything below it) and mounted a fresh sysfs.
        let mountinfo = "\
22 1 259:2 / / rw,relatime master:1 - ext4 /dev/nvme0n1p2 rw
51 48 0:40 / /sys rw,relatime - sysfs lbt1x0node rw
";
        assert!(roots(mountinfo).is_empty());
    }

    #[test]
    fn a_bind_mounted_child_cgroup_is_not_a_root() {
        let mountinfo = "\
60 22 0:26 /kubepods/pod1 /run/pod-cgroup rw,relatime - cgroup2 cgroup2 rw
61 22 0:26 / /run/lb/cgroup rw,relatime - cgroup2 cgroup2 rw
62 22 0:26 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw
";
        assert_eq!(
            roots(mountinfo),
            [
                PathBuf::from("/run/lb/cgroup"),
                PathBuf::from("/sys/fs/cgroup")
            ]
        );
    }

    #[test]
    fn flag() {
        assert_eq!(resolve(Some(Path::new(""))).unwrap(), None);
        assert_eq!(
            resolve(Some(Path::new("/run/lb/cgroup"))).unwrap(),
            Some(PathBuf::from("/run/lb/cgroup"))
        );
    }
}
