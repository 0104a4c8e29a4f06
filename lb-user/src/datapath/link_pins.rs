//! The programs' attachments as BPF links pinned in `<bpffs>/links/`, one file per hook: they stay
//! attached when the agent exits, whatever the reason, as kube-proxy's rules stay in the kernel.
//! A starting agent swaps its programs into the pinned links in place (BPF_LINK_UPDATE), so no
//! packet meets an interface without a program; only `lb cleanup` removes them.
use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd as _, BorrowedFd};
use std::path::{Path, PathBuf};

use aya::programs::ProgramError;
use aya::programs::links::{FdLink, LinkError};
use tracing::{info, warn};

use crate::datapath::bpf_link::{self, LinkTarget};
use crate::error_chain;

/// The directory under the bpffs directory that holds the link pins.
pub const LINKS_DIR: &str = "links";

#[derive(Debug, thiserror::Error)]
pub enum LinkPinError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("attaching: {}", error_chain(.0))]
    Attach(#[from] ProgramError),
    #[error("taking the new link: {}", error_chain(.0))]
    Link(#[from] LinkError),
    #[error("pinning at {}: {source}", path.display())]
    Pin {
        path: PathBuf,
        source: aya::pin::PinError,
    },
}

/// The link pins in one bpffs directory.
#[derive(Debug)]
pub struct LinkPins {
    dir: PathBuf,
}

impl LinkPins {
    /// The link pins under `bpffs` (a directory on a bpffs), creating their directory.
    pub fn open(bpffs: &Path) -> Result<Self, LinkPinError> {
        let dir = bpffs.join(LINKS_DIR);
        match std::fs::create_dir(&dir) {
            Err(err) if err.kind() != io::ErrorKind::AlreadyExists => {
                return Err(LinkPinError::Io {
                    path: dir,
                    source: err,
                });
            }
            _ => {}
        }
        Ok(Self { dir })
    }

    /// Swaps `program` into the link pinned as `name` if that link is still attached to
    /// `target`; false when there is no such link (then [`LinkPins::pin`] a new one).
    pub fn replace(
        &self,
        name: &str,
        target: LinkTarget,
        program: BorrowedFd<'_>,
    ) -> Result<bool, LinkPinError> {
        let path = self.dir.join(name);
        let Some(link) = self.open_attached(&path, target)? else {
            return Ok(false);
        };
        bpf_link::replace_program(link.as_fd(), program)
            .map_err(|source| LinkPinError::Io { path, source })?;
        Ok(true)
    }

    /// Pins a new link as `name` (None: the kernel attached without a link, a netlink tc filter
    /// before Linux 6.6, which stays attached by itself).
    pub fn pin(&self, name: &str, link: Option<FdLink>) -> Result<(), LinkPinError> {
        if let Some(link) = link {
            let path = self.dir.join(name);
            link.pin(&path)
                .map_err(|source| LinkPinError::Pin { path, source })?;
        }
        Ok(())
    }

    /// The link pinned at `path` if it is attached to `target`; a pin of a link attached
    /// elsewhere (its interface gone, another cgroup) is removed, which releases the link.
    fn open_attached(
        &self,
        path: &Path,
        target: LinkTarget,
    ) -> Result<Option<std::os::fd::OwnedFd>, LinkPinError> {
        let io_err = |source| LinkPinError::Io {
            path: path.to_owned(),
            source,
        };
        let link = match bpf_link::open_pinned(path) {
            Ok(link) => link,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(io_err(err)),
        };
        let pinned_target = bpf_link::target(link.as_fd()).map_err(io_err)?;
        if pinned_target == target {
            return Ok(Some(link));
        }
        info!(pin = %path.display(), ?pinned_target, ?target, "removing a stale link pin");
        std::fs::remove_file(path).map_err(io_err)?;
        Ok(None)
    }

    /// Removes the pin `name`, which detaches its link (a no-op when there is none).
    pub fn remove(&self, name: &str) {
        let path = self.dir.join(name);
        match std::fs::remove_file(&path) {
            Ok(()) => info!(pin = name, "link unpinned"),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => warn!(pin = %path.display(), %err, "could not remove a link pin"),
        }
    }

    /// Removes every pin not in `keep`: links of interfaces that are gone or no longer match,
    /// and of hooks this agent does not use (e.g. XDP after a restart without `--xdp`).
    pub fn remove_all_but(&self, keep: &BTreeSet<String>) {
        for name in pinned_names(&self.dir) {
            if !keep.contains(&name) {
                self.remove(&name);
            }
        }
    }
}

/// The names of the pins in `dir` (none when it cannot be read).
pub fn pinned_names(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}
