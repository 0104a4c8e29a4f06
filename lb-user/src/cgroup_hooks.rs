//! The socket hooks of node-local traffic (lb-ebpf's `sock` module) on a cgroup v2 directory:
//! every socket of its processes (and of its descendants') that connects or sends to a service
//! in the agent's network namespace is pointed at a backend.
use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::path::Path;

use anyhow::{Context as _, Result};
use aya::programs::CgroupAttachMode;
use aya::programs::cgroup_sock_addr::CgroupSockAddrLinkId;
use lb_common::program_name;

use crate::datapath::{self, Datapath};
use crate::error_chain;

const PROGRAMS: [&str; 4] = [
    program_name::CONNECT4,
    program_name::SENDMSG4,
    program_name::RECVMSG4,
    program_name::GETPEERNAME4,
];

/// The hooks attached to one cgroup; detached by [`CgroupHooks::detach`] (or when the
/// datapath is dropped).
pub struct CgroupHooks {
    links: Vec<(&'static str, CgroupSockAddrLinkId)>,
}

impl CgroupHooks {
    /// Loads the hooks and attaches them to `cgroup` as BPF links, beside any other programs.
    pub fn attach(datapath: &mut Datapath, cgroup: &Path) -> Result<Self> {
        let dir = File::open(cgroup).with_context(|| {
            format!(
                "--cgroup {}: opening the cgroup v2 directory",
                cgroup.display()
            )
        })?;
        anyhow::ensure!(
            dir.metadata()?.is_dir() && cgroup.join("cgroup.procs").exists(),
            "--cgroup {}: not a cgroup v2 directory (no cgroup.procs; without --cgroup the agent \
             finds the cgroup v2 root itself; \"\" disables the socket hooks)",
            cgroup.display()
        );
        let mut hooks = CgroupHooks { links: Vec::new() };
        for name in PROGRAMS {
            let program = datapath.sock_program(name)?;
            datapath::load_program(|| program.load()).with_context(|| format!("loading {name}"))?;
            let link = program
                // A BPF link (Linux 5.7+) takes no mode flags and always sits beside others.
                .attach(&dir, CgroupAttachMode::Single)
                .map_err(|err| {
                    anyhow::anyhow!(
                        "attaching {name} to {}: {}",
                        cgroup.display(),
                        error_chain(&err)
                    )
                })?;
            hooks.links.push((name, link));
        }
        Ok(hooks)
    }

    pub fn detach(self, datapath: &mut Datapath) -> Result<()> {
        for (name, link) in self.links {
            datapath
                .sock_program(name)?
                .detach(link)
                .with_context(|| format!("detaching {name}"))?;
        }
        Ok(())
    }
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
