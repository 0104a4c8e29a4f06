//! Network namespaces owned by a test, removed on drop (also when the test fails).
use std::{
    fs::File,
    io::{Read as _, Write as _},
    net::SocketAddr,
    process::{Command, Output},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use nix::sched::{CloneFlags, setns};

static NEXT_ID: AtomicU32 = AtomicU32::new(0);

/// A prefix unique to this process and call, so tests in parallel (and in several processes)
/// never share a name.
pub fn unique_prefix() -> String {
    format!(
        "lbt{}x{}",
        std::process::id(),
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    )
}

#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    pub fn new(name: String) -> Result<Self> {
        run(Command::new("ip").args(["netns", "add", &name]))?;
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip -n NAME ARGS...`
    pub fn ip(&self, args: &[&str]) -> Result<()> {
        run(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Adds veth `name` here with its peer `peer_name` in `peer`, both down and unaddressed.
    pub fn add_veth(&self, name: &str, peer: &Netns, peer_name: &str) -> Result<()> {
        self.ip(&[
            "link", "add", name, "type", "veth", "peer", "name", peer_name, "netns", &peer.name,
        ])
    }

    /// Runs a command inside the namespace.
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<Output> {
        run_output(
            Command::new("ip")
                .args(["netns", "exec", &self.name, program])
                .args(args),
        )
    }

    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.exec("sysctl", &["-qw", &format!("{key}={value}")])
            .map(drop)
    }

    /// A command that will run inside the namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// Runs `f` on a thread that has entered the namespace. Sockets created there stay in it.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || -> Result<T> {
            enter(&path)?;
            Ok(f())
        })
        .join()
        .map_err(|_| anyhow::anyhow!("thread in {} panicked", self.name))?
    }

    /// GET over plain HTTP/1.1 from inside the namespace: (status, body).
    pub fn http_get(&self, to: SocketAddr, path: &str) -> Result<(u16, String)> {
        let path = path.to_owned();
        self.run(move || -> Result<(u16, String)> {
            let mut stream = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(
                stream,
                "GET {path} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n"
            )?;
            let mut response = String::new();
            stream.read_to_string(&mut response)?;
            let status = response
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .context("status line")?;
            let body = response
                .split_once("\r\n\r\n")
                .map(|(_, b)| b.to_owned())
                .unwrap_or_default();
            Ok((status, body))
        })?
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Moves the calling thread into the namespace at `path`.
pub fn enter(path: &str) -> Result<()> {
    let file = File::open(path).with_context(|| format!("open {path}"))?;
    setns(file, CloneFlags::CLONE_NEWNET).with_context(|| format!("setns {path}"))
}

fn run(cmd: &mut Command) -> Result<()> {
    run_output(cmd).map(drop)
}

fn run_output(cmd: &mut Command) -> Result<Output> {
    let out = cmd.output().with_context(|| format!("spawn {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}
