//! The variants: what programs the node for a ServiceSet, and where the client sends. Each one is
//! deployed in a topology of its own (see topology.rs); a new variant (e.g. `xdp`: the agent with
//! its XDP program) is one arm in each match.
use std::{
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use lb_tests::{
    agent::Agent,
    topology::{CLUSTER_CIDR, CLUSTER_CIDR_V6, NODE_IP},
};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use serde::Serialize;

use crate::{
    interrupt, rulesets,
    services::{Family, SERVICE_PORT, ServiceSet, TCP_TARGET_PORT},
    topology::{BenchTopology, NODE_IP_V6},
    traffic::Server,
};

/// How long the agent may take to apply a manifest change (50k Services are a large YAML file).
const SYNC_TIMEOUT: Duration = Duration::from_secs(300);
/// How long iptables-restore or nft -f may run (`timeout`'s argument): nft -f of kube-proxy's
/// structure grows faster than linearly with the Services (≈ 400 s at 20k here).
const LOADER_TIMEOUT_S: &str = "180";
/// How often a wait for the agent looks at the interrupt flag.
const SYNC_POLL: Duration = Duration::from_millis(200);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// The client talks to the backend pod; the node only routes.
    Direct,
    IptablesNft,
    IptablesLegacy,
    Nftables,
    /// This project's agent and tc datapath, in its default `--forwarding stack`: Service
    /// traffic crosses the node's netfilter as under kube-proxy.
    Tc,
    /// The agent with `--forwarding redirect`: tc redirects Service traffic past netfilter.
    TcRedirect,
    /// The agent with `--xdp` (and so redirect forwarding): `lb_xdp` on the node's external
    /// interface as well. B4 only: the
    /// B2/B3 client is a pod, whose traffic enters on a pod veth, where XDP never runs.
    Xdp,
}

impl Variant {
    /// `xdp` is measured by B4 only: the B2/B3 client is a pod, whose traffic XDP never sees.
    pub const ALL: [Variant; 7] = [
        Variant::Direct,
        Variant::IptablesNft,
        Variant::IptablesLegacy,
        Variant::Nftables,
        Variant::Tc,
        Variant::TcRedirect,
        Variant::Xdp,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Direct => "direct",
            Variant::IptablesNft => "iptables-nft",
            Variant::IptablesLegacy => "iptables-legacy",
            Variant::Nftables => "nftables",
            Variant::Tc => "tc",
            Variant::TcRedirect => "tc-redirect",
            Variant::Xdp => "xdp",
        }
    }

    /// The program that loads this variant's rules of `family`, if it has one.
    pub fn loader(self, family: Family) -> Option<&'static str> {
        match (self, family) {
            (Variant::Direct | Variant::Tc | Variant::TcRedirect | Variant::Xdp, _) => None,
            (Variant::IptablesNft, Family::Ipv4) => Some("iptables-nft-restore"),
            (Variant::IptablesNft, Family::Ipv6) => Some("ip6tables-nft-restore"),
            (Variant::IptablesLegacy, Family::Ipv4) => Some("iptables-legacy-restore"),
            (Variant::IptablesLegacy, Family::Ipv6) => Some("ip6tables-legacy-restore"),
            (Variant::Nftables, _) => Some("nft"),
        }
    }

    /// Whether this machine can run the variant (its IPv4 loader is installed; a missing IPv6
    /// one is an error of the IPv6 points).
    pub fn available(self) -> bool {
        self.loader(Family::Ipv4).is_none_or(|program| {
            Command::new("which")
                .arg(program)
                .output()
                .is_ok_and(|o| o.status.success())
        })
    }
}

/// A variant deployed in its topology, with the bench servers running in the backends.
pub struct Deployment {
    pub variant: Variant,
    /// Set for the agent's variants (`tc`, `tc-redirect`, `xdp`).
    agent: Option<Agent>,
    /// The agent's flags beyond the topology's and --bpffs.
    agent_args: Vec<String>,
    /// Where rule files and the agent's pins go.
    dir: tempfile::TempDir,
    bpffs: PathBuf,
    _servers: [Server; 2],
    pub topology: BenchTopology,
}

impl Deployment {
    /// `bpffs`: a directory on a bpffs the agent pins its maps in (one per deployment), so the
    /// bench can read them. `agent_args`: more flags for the agent (its variants only).
    pub fn new(variant: Variant, bpffs: &Path, agent_args: &[&str]) -> Result<Self> {
        let topology = BenchTopology::new()?;
        if variant == Variant::Xdp {
            // XDP frames enter a veth only where its receiving end runs NAPI, which GRO turns on:
            // the CNI's part; the agent sees it in the veths' XDP features.
            for pod in &topology.inner.pods {
                pod.ns.exec("ethtool", &["-K", "eth0", "gro", "on"])?;
            }
        }
        let servers = [
            Server::start(&topology.backend().ns, b'a')?,
            Server::start(&topology.second_backend().ns, b'b')?,
        ];
        Ok(Deployment {
            variant,
            agent: None,
            agent_args: agent_args.iter().map(|a| a.to_string()).collect(),
            dir: tempfile::Builder::new().prefix("lbbench").tempdir()?,
            bpffs: bpffs.join(topology.node().name()),
            _servers: servers,
            topology,
        })
    }

    /// Where the agent pins its maps (`tc`).
    pub fn pins(&self) -> &Path {
        &self.bpffs
    }

    /// The agent, once `program` started it (`tc`).
    pub fn agent(&mut self) -> Option<&mut Agent> {
        self.agent.as_mut()
    }

    /// Where the client sends for the measured Service.
    pub fn target(&self, set: &ServiceSet) -> SocketAddr {
        match self.variant {
            Variant::Direct => (set.backend, TCP_TARGET_PORT).into(),
            _ => (set.measured_ip(), SERVICE_PORT).into(),
        }
    }

    /// Programs the node with `set`, replacing what it had; returns how long the loader (or the
    /// agent's sync) took.
    pub fn program(&mut self, set: &ServiceSet) -> Result<Duration> {
        let node = self.topology.node();
        match self.variant {
            Variant::Direct => Ok(Duration::ZERO),
            Variant::IptablesNft | Variant::IptablesLegacy => {
                let file = self.dir.path().join("rules.iptables");
                fs::write(&file, rulesets::iptables(set, cluster_cidr(set.family())))?;
                let loader = self
                    .variant
                    .loader(set.family())
                    .expect("iptables has a loader");
                let start = Instant::now();
                node.exec(
                    "timeout",
                    &[LOADER_TIMEOUT_S, loader, file.to_str().expect("utf-8 path")],
                )?;
                Ok(start.elapsed())
            }
            Variant::Nftables => {
                let file = self.dir.path().join("rules.nft");
                fs::write(&file, rulesets::nftables(set, cluster_cidr(set.family())))?;
                // Replace, not merge: the previous count's chains go.
                let table = match set.family() {
                    Family::Ipv4 => "ip",
                    Family::Ipv6 => "ip6",
                };
                let _ = node.exec("nft", &["delete", "table", table, "kube-proxy"]);
                let start = Instant::now();
                node.exec(
                    "timeout",
                    &[
                        LOADER_TIMEOUT_S,
                        "nft",
                        "-f",
                        file.to_str().expect("utf-8 path"),
                    ],
                )?;
                Ok(start.elapsed())
            }
            Variant::Tc | Variant::TcRedirect | Variant::Xdp => {
                let yaml = set.yaml();
                match &mut self.agent {
                    None => {
                        let start = Instant::now();
                        self.agent = Some(self.start_agent(&yaml)?);
                        Ok(start.elapsed())
                    }
                    Some(agent) => {
                        let start = Instant::now();
                        replace_manifests(agent, &yaml)?;
                        wait_for_sync(agent, SYNC_TIMEOUT)?;
                        Ok(start.elapsed())
                    }
                }
            }
        }
    }

    /// Starts the agent on `yaml` with this deployment's flags, on a dual-stack node; returns
    /// once it has synced and attached.
    fn start_agent(&self, yaml: &str) -> Result<Agent> {
        let node_ips = format!("{NODE_IP},{NODE_IP_V6}");
        let cluster_cidrs = format!("{CLUSTER_CIDR},{CLUSTER_CIDR_V6}");
        let mut args = vec![
            "--bpffs",
            self.bpffs.to_str().expect("utf-8 path"),
            "--node-ip",
            &node_ips,
            "--cluster-cidr",
            &cluster_cidrs,
        ];
        match self.variant {
            Variant::TcRedirect => args.extend(["--forwarding", "redirect"]),
            Variant::Xdp => args.push("--xdp"),
            _ => {}
        }
        args.extend(self.agent_args.iter().map(String::as_str));
        Agent::start(&self.topology.inner, yaml, &args).context("start the agent")
    }

    /// Ends the agent with `signal` (SIGTERM as a rolling update, SIGKILL as a crash) and starts
    /// a new one with the same flags on the same pins and `set`; returns it once it has synced
    /// and attached.
    pub fn restart_agent(&mut self, signal: Signal, set: &ServiceSet) -> Result<&mut Agent> {
        // Before the stop: the bench's own work is no part of the gap.
        let yaml = set.yaml();
        let mut old = self.agent.take().context("the agent is not running")?;
        kill(Pid::from_raw(old.pid() as i32), signal).with_context(|| format!("{signal}"))?;
        let status = old.stop()?;
        anyhow::ensure!(
            signal != Signal::SIGTERM || status.success(),
            "the agent exited with {status} on SIGTERM:\n{}",
            old.log()
        );
        drop(old);
        Ok(self.agent.insert(self.start_agent(&yaml)?))
    }
}

/// The pod network of `family`, as kube-proxy's `--cluster-cidr` gives it.
fn cluster_cidr(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => CLUSTER_CIDR,
        Family::Ipv6 => CLUSTER_CIDR_V6,
    }
}

/// The agent's next sync, like `Agent::wait_for_sync`, but a signal ends the wait at once rather
/// than after a 50k-Service sync.
pub fn wait_for_sync(agent: &mut Agent, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        interrupt::check()?;
        match agent.wait_for_sync(SYNC_POLL) {
            Ok(()) => return Ok(()),
            Err(err) if err.to_string().starts_with("agent exited") => return Err(err),
            Err(_) => {}
        }
    }
    agent.wait_for_sync(Duration::ZERO)
}

/// Replaces the agent's services.yaml atomically (a rename), without waiting for the sync.
pub fn replace_manifests(agent: &Agent, yaml: &str) -> Result<()> {
    replace_manifest_file(agent, "services.yaml", yaml)
}

/// Replaces (or creates) the agent's manifest file `name` atomically (a rename of a file
/// written beside its directory), without waiting for the sync.
pub fn replace_manifest_file(agent: &Agent, name: &str, yaml: &str) -> Result<()> {
    let dir = agent.manifest_dir();
    let tmp = dir.with_file_name(format!("{name}.bench"));
    fs::write(&tmp, yaml)?;
    fs::rename(&tmp, dir.join(name))?;
    Ok(())
}
