//! The socket hooks of node-local traffic (lb-ebpf's `sock` module) on a cgroup v2 directory:
//! every socket of its processes (and of its descendants') that connects or sends to a service
//! in the agent's network namespace is pointed at a backend.
use std::fs::File;
use std::os::fd::{AsFd as _, AsRawFd as _};
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use anyhow::{Context as _, Result};
use aya::programs::CgroupAttachMode;
use aya::programs::links::FdLink;
use lb_common::program_name;

use crate::datapath::bpf_link::LinkTarget;
use crate::datapath::link_pins::LinkPins;
use crate::datapath::{self, Datapath};
use crate::error_chain;

/// The socket hooks, each attached to the cgroup.
pub const PROGRAMS: [&str; 8] = [
    program_name::CONNECT4,
    program_name::SENDMSG4,
    program_name::RECVMSG4,
    program_name::GETPEERNAME4,
    program_name::CONNECT6,
    program_name::SENDMSG6,
    program_name::RECVMSG6,
    program_name::GETPEERNAME6,
];

/// Puts the hooks on `cgroup` as BPF links beside any other programs, pinned, or swaps them
/// into the links a previous agent pinned there; returns the pin names.
pub fn attach(
    datapath: &mut Datapath,
    pins: &LinkPins,
    cgroup: &Path,
) -> Result<Vec<&'static str>> {
    let dir = File::open(cgroup).with_context(|| {
        format!(
            "--cgroup {}: opening the cgroup v2 directory",
            cgroup.display()
        )
    })?;
    let metadata = dir.metadata()?;
    anyhow::ensure!(
        metadata.is_dir() && cgroup.join("cgroup.procs").exists(),
        "--cgroup {}: not a cgroup v2 directory (no cgroup.procs; without --cgroup the agent \
         finds the cgroup v2 root itself; \"\" disables the socket hooks)",
        cgroup.display()
    );
    // A cgroup's id is its inode number on cgroup2.
    let target = LinkTarget::Cgroup(metadata.ino());
    for name in PROGRAMS {
        let program = datapath.sock_program(name)?;
        datapath::load_program(|| program.load()).with_context(|| format!("loading {name}"))?;
        if pins.replace(name, target, program.fd()?.as_fd())? {
            continue;
        }
        let link = program
            // A BPF link (Linux 5.7+) takes no mode flags and always sits beside others.
            .attach(&dir, CgroupAttachMode::Single)
            .and_then(|id| program.take_link(id))
            .map_err(|err| {
                anyhow::anyhow!(
                    "attaching {name} to {}: {}",
                    cgroup.display(),
                    error_chain(&err)
                )
            })?;
        pins.pin(name, Some(FdLink::try_from(link)?))?;
    }
    Ok(PROGRAMS.to_vec())
}

/// The network namespace's cookie (SO_NETNS_COOKIE, Linux 5.14+) of the calling thread, which
/// the hooks compare with their socket's.
pub fn netns_cookie() -> Result<u64> {
    let socket =
        std::net::UdpSocket::bind("127.0.0.1:0").context("a socket to read SO_NETNS_COOKIE")?;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as nix::libc::socklen_t;
    // SAFETY: the buffer is a u64 and `len` its size, as the option expects.
    let rc = unsafe {
        nix::libc::getsockopt(
            socket.as_raw_fd(),
            nix::libc::SOL_SOCKET,
            nix::libc::SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .context("getsockopt SO_NETNS_COOKIE (Linux 5.14+)");
    }
    Ok(cookie)
}
