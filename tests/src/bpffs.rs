//! A bpffs mounted by the test, as a node's host mounts /sys/fs/bpf: pins on it outlive the
//! agent. (A bpffs the agent mounts itself under `ip netns exec` lives in the agent's private
//! mount namespace and dies with it.) Unmounted on drop, also when the test fails, which releases
//! every link and map pinned on it.
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use nix::mount::{MntFlags, MsFlags, mount, umount2};

use crate::netns::unique_prefix;

pub struct Bpffs {
    dir: tempfile::TempDir,
}

impl Bpffs {
    /// Mounts a fresh bpffs on a uniquely named directory, in this process's mount namespace
    /// (`ip netns exec` copies it into the agent's).
    pub fn mount() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{}bpffs", unique_prefix()))
            .tempdir()?;
        mount(
            Some("bpffs"),
            dir.path(),
            Some("bpf"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some("mode=0700"),
        )
        .with_context(|| format!("mounting bpffs on {}", dir.path().display()))?;
        Ok(Bpffs { dir })
    }

    /// The agent's `--bpffs`: a directory it creates on this bpffs.
    pub fn pin_dir(&self) -> PathBuf {
        self.dir.path().join("lb")
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// [`Bpffs::pin_dir`] as an argument (`--bpffs` of `lb agent`, `lb stats`, `lb cleanup`).
    pub fn arg(&self) -> String {
        self.pin_dir().to_string_lossy().into_owned()
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        // Lazy: an `lb` process still running in a copy of the mount does not keep it busy.
        let _ = umount2(self.dir.path(), MntFlags::MNT_DETACH);
    }
}
