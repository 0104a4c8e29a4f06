//! The `lb agent` process under test, run inside the node namespace on a manifest directory or
//! an in-test apiserver.
use std::{
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result, bail};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::fake_apiserver::FakeApiserver;
use crate::netns::Netns;
use crate::topology::{AgentNode, CLUSTER_CIDR, Topology};

/// The Node name the agent runs as against a fake apiserver.
pub const NODE_NAME: &str = "node-1";

/// Logged by the agent when a sync has been applied to the maps.
pub const SYNC_DONE: &str = "sync done";
/// Logged by the agent once it is attached to the interfaces present at start.
pub const ATTACHED: &str = "attached to the existing interfaces";
const START_TIMEOUT: Duration = Duration::from_secs(30);
const SYNC_TIMEOUT: Duration = Duration::from_secs(10);

/// The `lb` binary: `LB_BIN` (set by `cargo xtask test`), else target/release/lb.
pub fn lb_binary() -> PathBuf {
    std::env::var_os("LB_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/lb"))
}

/// The datapath's counters, by name, as `lb stats` prints them in `ns` (where an agent runs).
pub fn stats(ns: &Netns) -> Result<std::collections::BTreeMap<String, u64>> {
    stats_with(ns, &["stats"])
}

/// [`stats`] of the maps pinned in `bpffs` (an agent's `--bpffs`), whether an agent runs or not.
pub fn stats_at(ns: &Netns, bpffs: &str) -> Result<std::collections::BTreeMap<String, u64>> {
    stats_with(ns, &["stats", "--bpffs", bpffs])
}

fn stats_with(ns: &Netns, args: &[&str]) -> Result<std::collections::BTreeMap<String, u64>> {
    let binary = lb_binary();
    let output = ns.exec(&binary.to_string_lossy(), &[args, &["-o", "json"]].concat())?;
    let stats: serde_json::Value =
        serde_json::from_slice(&output.stdout).with_context(|| format!("lb {args:?} -o json"))?;
    stats["counters"]
        .as_array()
        .with_context(|| format!("no counters in {stats}"))?
        .iter()
        .map(|counter| {
            let name = counter["name"].as_str();
            let value = counter["value"].as_u64();
            match (name, value) {
                (Some(name), Some(value)) => Ok((name.to_owned(), value)),
                _ => bail!("lb stats counter {counter}"),
            }
        })
        .collect()
}

/// The agent's socket hooks when the test gives no `--cgroup`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hooks {
    /// `--cgroup ""`: none.
    OffUnlessGiven,
    /// The agent's default: on the cgroup v2 root.
    Default,
}

pub struct Agent {
    child: Child,
    dir: tempfile::TempDir,
    /// `lb agent` and its arguments as first started, for restarts.
    command: Command,
    /// How many times it was started: each start logs to a file of its own.
    starts: usize,
    syncs_seen: usize,
    /// Just before the spawn, on the clock of the agent's log timestamps.
    spawned_at: SystemTime,
}

impl Agent {
    /// Starts the agent on `manifests` (written as services.yaml) and waits for its first sync.
    pub fn start(topology: &Topology, manifests: &str, extra_args: &[&str]) -> Result<Self> {
        Self::start_on(topology.agent_node(), manifests, extra_args)
    }

    /// [`Agent::start`] on any node (e.g. one of a multi-node cluster).
    pub fn start_on(node: AgentNode<'_>, manifests: &str, extra_args: &[&str]) -> Result<Self> {
        Self::start_manifests(node, manifests, extra_args, Hooks::OffUnlessGiven)
    }

    /// Starts the agent as a user would, with only the flags it requires (so its socket hooks
    /// go on the cgroup v2 root it finds or mounts, translating sockets of the node namespace
    /// only), and waits for its first sync.
    pub fn start_with_default_flags(topology: &Topology, manifests: &str) -> Result<Self> {
        Self::start_manifests(topology.agent_node(), manifests, &[], Hooks::Default)
    }

    fn start_manifests(
        node: AgentNode<'_>,
        manifests: &str,
        extra_args: &[&str],
        hooks: Hooks,
    ) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("lbt-agent").tempdir()?;
        let manifest_dir = dir.path().join("manifests");
        fs::create_dir(&manifest_dir)?;
        fs::write(manifest_dir.join("services.yaml"), manifests)?;
        let mut args: Vec<OsString> = vec!["--manifests".into(), manifest_dir.into()];
        // The node's address unless the test gives its own (e.g. one per family).
        if !extra_args.contains(&"--node-ip") {
            args.extend(["--node-ip".into(), node.ip.to_string().into()]);
        }
        Self::spawn(node, dir, args, extra_args, hooks, true)
    }

    /// Starts the agent on the apiserver `api` (in the node namespace) as node [`NODE_NAME`],
    /// without --node-ip (it comes from the Node). Waits for the first sync if `wait`.
    pub fn start_api(
        topology: &Topology,
        api: &FakeApiserver,
        extra_args: &[&str],
        wait: bool,
    ) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("lbt-agent").tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let args = vec![
            "--kubeconfig".into(),
            kubeconfig.into(),
            "--hostname-override".into(),
            NODE_NAME.into(),
        ];
        Self::spawn(
            topology.agent_node(),
            dir,
            args,
            extra_args,
            Hooks::OffUnlessGiven,
            wait,
        )
    }

    fn spawn(
        node: AgentNode<'_>,
        dir: tempfile::TempDir,
        source_args: Vec<OsString>,
        extra_args: &[&str],
        hooks: Hooks,
        wait: bool,
    ) -> Result<Self> {
        // Not the machine's root cgroup unless the test runs the defaults (the hooks translate
        // only sockets of the node namespace): a test that wants the hooks gives its own cgroup.
        let cgroup: &[&str] = if extra_args.contains(&"--cgroup") || hooks == Hooks::Default {
            &[]
        } else {
            &["--cgroup", ""]
        };
        let cluster_cidr: &[&str] = if extra_args.contains(&"--cluster-cidr") {
            &[]
        } else {
            &["--cluster-cidr", CLUSTER_CIDR]
        };
        let mut command = node.ns.command(lb_binary());
        command
            .arg("agent")
            .args(source_args)
            .args(cluster_cidr)
            .args(["--external-interface", node.external_interface])
            .args(["--pod-interfaces", node.pod_interfaces])
            .args(cgroup)
            .args(extra_args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null());
        let spawned_at = SystemTime::now();
        let mut agent = Agent {
            child: spawn_logged(&mut command, &dir.path().join("agent.log"))?,
            dir,
            command,
            starts: 1,
            syncs_seen: 0,
            spawned_at,
        };
        if wait {
            agent.wait_for_sync(START_TIMEOUT)?;
            // The first sync comes before the attachments; a packet sent in between would pass
            // untranslated.
            agent.wait_for_log(ATTACHED, START_TIMEOUT)?;
        }
        Ok(agent)
    }

    /// Starts the agent again (after it exited) with the arguments of its first start and
    /// `extra_args`, on the same bpffs, logging to a new file ([`Agent::log`] reads it). Waits
    /// until its programs are in place and, if `wait_for_sync`, for its first sync.
    pub fn restart(&mut self, extra_args: &[&str], wait_for_sync: bool) -> Result<()> {
        if self.child.try_wait()?.is_none() {
            bail!("restart while the agent still runs:\n{}", self.log());
        }
        let mut command = Command::new(self.command.get_program());
        command
            .args(self.command.get_args())
            .args(extra_args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null());
        self.starts += 1;
        self.syncs_seen = 0;
        self.spawned_at = SystemTime::now();
        self.child = spawn_logged(&mut command, &self.log_path())?;
        self.wait_for_log(ATTACHED, START_TIMEOUT)?;
        if wait_for_sync {
            self.wait_for_sync(START_TIMEOUT)?;
        }
        Ok(())
    }

    /// Waits for a sync (after those already seen) that left `services` services and
    /// `endpoints` ready endpoints in the maps.
    pub fn wait_for_programmed(
        &mut self,
        services: usize,
        endpoints: usize,
        timeout: Duration,
    ) -> Result<()> {
        let want = (
            format!(" services={services} "),
            format!(" endpoints={endpoints} "),
        );
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.log();
            let syncs: Vec<&str> = log.lines().filter(|l| l.contains(SYNC_DONE)).collect();
            if let Some(i) = syncs[self.syncs_seen.min(syncs.len())..]
                .iter()
                .position(|l| l.contains(&want.0) && l.contains(&want.1))
            {
                self.syncs_seen += i + 1;
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("agent exited ({status}):\n{log}");
            }
            if Instant::now() > deadline {
                bail!("no sync to{}{}within {timeout:?}:\n{log}", want.0, want.1);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// When the process was spawned: its log lines' timestamps are on the same clock.
    pub fn spawned_at(&self) -> SystemTime {
        self.spawned_at
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The agent's resident memory (VmRSS), in KiB.
    pub fn rss_kib(&self) -> Result<u64> {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid()))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .context("VmRSS")
    }

    pub fn manifest_dir(&self) -> PathBuf {
        self.dir.path().join("manifests")
    }

    /// The log of the latest start.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_path(&self) -> PathBuf {
        match self.starts {
            1 => self.dir.path().join("agent.log"),
            n => self.dir.path().join(format!("agent-{n}.log")),
        }
    }

    /// Replaces services.yaml (atomically, by rename) and waits until the agent has synced it.
    pub fn update_manifests(&mut self, manifests: &str) -> Result<()> {
        let tmp = self.dir.path().join("services.yaml.tmp");
        fs::write(&tmp, manifests)?;
        fs::rename(&tmp, self.manifest_dir().join("services.yaml"))?;
        self.wait_for_sync(SYNC_TIMEOUT)
    }

    /// Waits for the next "sync done" line after those already seen.
    pub fn wait_for_sync(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let syncs = self.log().matches(SYNC_DONE).count();
            if syncs > self.syncs_seen {
                self.syncs_seen = syncs;
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("agent exited ({status}):\n{}", self.log());
            }
            if Instant::now() > deadline {
                bail!("no sync within {timeout:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the agent has logged a line containing `needle` (e.g. the attachment of an
    /// interface, which follows the first sync).
    pub fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(needle) {
            if let Some(status) = self.child.try_wait()? {
                bail!("agent exited ({status}) before {needle:?}:\n{}", self.log());
            }
            if Instant::now() > deadline {
                bail!("no {needle:?} within {timeout:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Sends SIGTERM and waits for the agent to exit.
    pub fn stop(&mut self) -> Result<std::process::ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child.kill()?;
        bail!("agent did not exit on SIGTERM:\n{}", self.log())
    }

    /// Kills the agent with SIGKILL (as a crash or the OOM killer would) and reaps it.
    pub fn kill(&mut self) -> Result<std::process::ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            bail!("the agent had already exited ({status}):\n{}", self.log());
        }
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL)?;
        Ok(self.child.wait()?)
    }
}

/// The datapath counter `name` of the agent running in `ns`, as `lb stats` prints it there.
pub fn counter(ns: &Netns, name: &str) -> Result<u64> {
    let counters = stats(ns)?;
    counters
        .get(name)
        .copied()
        .with_context(|| format!("no counter {name} in {counters:?}"))
}

/// Runs `command` with its stdout and stderr in a new file at `log`.
fn spawn_logged(command: &mut Command, log: &Path) -> Result<Child> {
    let log = fs::File::create(log)?;
    command
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("spawn {}", lb_binary().display()))
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.stop().is_err() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
