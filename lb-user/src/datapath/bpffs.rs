//! Making sure the pin directory is on a bpffs.
//!
//! `ip netns exec` gives the process a fresh sysfs where /sys/fs/bpf exists but nothing is mounted
//! on it, and sysfs refuses mkdir; so the default /sys/fs/bpf/lb needs bpffs mounted on its parent.
use std::io;
use std::path::{Path, PathBuf};

use nix::mount::{MsFlags, mount};
use nix::sys::statfs::{FsType, statfs};
use tracing::warn;

const BPF_FS_MAGIC: FsType = FsType(0xcafe_4a11);
const SYSFS_MAGIC: FsType = FsType(0x6265_6572);

#[derive(Debug, thiserror::Error)]
pub enum BpffsError {
    #[error("{}: neither it nor its parent directory exists", .0.display())]
    NoParent(PathBuf),
    #[error("statfs {}: {source}", path.display())]
    Statfs { path: PathBuf, source: nix::Error },
    #[error("mounting bpffs on {}: {source}", path.display())]
    Mount { path: PathBuf, source: nix::Error },
    #[error("creating {}: {source}", path.display())]
    Mkdir { path: PathBuf, source: io::Error },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fs {
    Bpf,
    Sys,
    Other,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    Use,
    Mkdir,
    /// The parent is on sysfs (no mkdir there): mount on the parent, then mkdir.
    MountParentThenMkdir,
    MountDir,
    /// A plain directory parent: create the pin directory and mount on it, hiding nothing.
    MkdirThenMount,
}

/// `dir` and `parent`: the filesystem each is on, None when it does not exist.
fn plan(dir: Option<Fs>, parent: Option<Fs>) -> Option<Plan> {
    Some(match (dir, parent) {
        (Some(Fs::Bpf), _) => Plan::Use,
        (Some(_), _) => Plan::MountDir,
        (None, Some(Fs::Bpf)) => Plan::Mkdir,
        (None, Some(Fs::Sys)) => Plan::MountParentThenMkdir,
        (None, Some(Fs::Other)) => Plan::MkdirThenMount,
        (None, None) => return None,
    })
}

fn fs_of(path: &Path) -> Result<Option<Fs>, BpffsError> {
    match statfs(path) {
        Ok(st) if st.filesystem_type() == BPF_FS_MAGIC => Ok(Some(Fs::Bpf)),
        Ok(st) if st.filesystem_type() == SYSFS_MAGIC => Ok(Some(Fs::Sys)),
        Ok(_) => Ok(Some(Fs::Other)),
        Err(nix::Error::ENOENT) => Ok(None),
        Err(source) => Err(BpffsError::Statfs {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Makes `dir` a directory on a bpffs, mounting one if needed.
pub fn ensure(dir: &Path) -> Result<(), BpffsError> {
    let parent = dir.parent().unwrap_or(Path::new("/"));
    let plan =
        plan(fs_of(dir)?, fs_of(parent)?).ok_or_else(|| BpffsError::NoParent(dir.to_owned()))?;
    match plan {
        Plan::Use => Ok(()),
        Plan::Mkdir => mkdir(dir),
        Plan::MountParentThenMkdir => {
            mount_bpffs(parent)?;
            mkdir(dir)
        }
        Plan::MountDir => mount_bpffs(dir),
        Plan::MkdirThenMount => {
            mkdir(dir)?;
            mount_bpffs(dir)
        }
    }
}

fn mkdir(path: &Path) -> Result<(), BpffsError> {
    match std::fs::create_dir(path) {
        Err(err) if err.kind() != io::ErrorKind::AlreadyExists => Err(BpffsError::Mkdir {
            path: path.to_owned(),
            source: err,
        }),
        _ => Ok(()),
    }
}

fn mount_bpffs(path: &Path) -> Result<(), BpffsError> {
    mount(
        Some("bpffs"),
        path,
        Some("bpf"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=0700"),
    )
    .map_err(|source| BpffsError::Mount {
        path: path.to_owned(),
        source,
    })?;
    warn!(
        path = %path.display(),
        "mounted bpffs itself: the pins, and so the datapath, live only as long as this mount \
         namespace (under `ip netns exec`, the agent's own: the datapath cannot outlive the \
         agent); mount the host's bpffs there first, as the DaemonSet mounts /sys/fs/bpf"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans() {
        assert_eq!(plan(Some(Fs::Bpf), Some(Fs::Bpf)), Some(Plan::Use));
        assert_eq!(plan(None, Some(Fs::Bpf)), Some(Plan::Mkdir));
        // ip netns exec: /sys/fs/bpf is an empty sysfs directory.
        assert_eq!(plan(None, Some(Fs::Sys)), Some(Plan::MountParentThenMkdir));
        assert_eq!(plan(Some(Fs::Sys), Some(Fs::Sys)), Some(Plan::MountDir));
        assert_eq!(plan(Some(Fs::Other), Some(Fs::Other)), Some(Plan::MountDir));
        assert_eq!(plan(None, Some(Fs::Other)), Some(Plan::MkdirThenMount));
        assert_eq!(plan(None, None), None);
    }
}
