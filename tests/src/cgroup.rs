//! A cgroup v2 directory owned by a test (under the cgroup2 mount, uniquely named), removed on drop
//! (also when the test fails): the scope of the agent's socket hooks, never the machine's root.
use std::{
    ffi::{CString, OsStr},
    fs,
    os::unix::{ffi::OsStrExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, Result};
use nix::libc;

use crate::netns::{Netns, unique_prefix};

/// Where the cgroup2 file system is mounted: /sys/fs/cgroup, or /sys/fs/cgroup/unified on a
/// hybrid (v1 + v2) machine.
fn cgroup2_root() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    mounts
        .lines()
        .find_map(|line| {
            let mut fields = line.split_whitespace().skip(1);
            let (dir, fs_type) = (fields.next()?, fields.next()?);
            (fs_type == "cgroup2").then(|| PathBuf::from(dir))
        })
        .context("no cgroup2 file system mounted")
}

pub struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    pub fn new() -> Result<Self> {
        let path = cgroup2_root()?.join(format!("{}cg", unique_prefix()));
        fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(Cgroup { path })
    }

    /// The path as `--cgroup` for an agent started with `ip netns exec`, which mounts a fresh
    /// /sys without the cgroup2 file system: the directory seen through this process's root.
    pub fn agent_path(&self) -> PathBuf {
        Path::new(&format!("/proc/{}/root", std::process::id())).join(
            self.path
                .strip_prefix("/")
                .expect("the cgroup path is absolute"),
        )
    }

    /// A command that runs inside `ns` and this cgroup: the child joins the cgroup (writing 0
    /// to cgroup.procs moves the writer) between fork and exec, so everything it runs is in it.
    pub fn command(&self, ns: &Netns, program: impl AsRef<OsStr>) -> Result<Command> {
        let procs = CString::new(self.path.join("cgroup.procs").as_os_str().as_bytes())?;
        let mut cmd = ns.command(program);
        // SAFETY: the closure only makes async-signal-safe syscalls (open, write, close) on
        // memory prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if written != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(cmd)
    }

    /// Runs `program` with `args` inside `ns` and this cgroup; its standard output.
    pub fn output(&self, ns: &Netns, program: &str, args: &[&str]) -> Result<String> {
        let out = self
            .command(ns, program)?
            .args(args)
            .output()
            .with_context(|| format!("spawn {program}"))?;
        anyhow::ensure!(
            out.status.success(),
            "{program}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8(out.stdout)?)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // A child that has just exited may still be counted for a moment.
        for _ in 0..50 {
            if fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
