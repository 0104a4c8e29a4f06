//! Command line.
use std::net::Ipv4Addr;
use std::ops::RangeInclusive;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use ipnet::Ipv4Net;
use lb_common::default_size;

pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/lb";

#[derive(Debug, Parser)]
#[command(name = "lb", version, about = "eBPF replacement for kube-proxy")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Program the datapath from a manifest directory and keep it in sync.
    Agent(AgentArgs),
    /// Print the datapath's packet counters (summed over CPUs).
    Stats(StatsArgs),
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// Directory of Kubernetes YAML (*.yaml, *.yml): v1 Services and discovery.k8s.io/v1
    /// EndpointSlices. Watched for changes.
    #[arg(long, value_name = "DIR")]
    pub manifests: PathBuf,
    /// The node's address: NodePort frontends and the masquerade source.
    #[arg(long, value_name = "IPV4")]
    pub node_ip: Ipv4Addr,
    /// Pod network; connections from outside it are masqueraded.
    #[arg(long, value_name = "CIDR")]
    pub cluster_cidr: Ipv4Net,
    /// Interface where traffic from outside the node enters.
    #[arg(long, value_name = "IFNAME")]
    pub external_interface: String,
    /// Pod-side interfaces (shell globs, comma-separated), also those created later.
    #[arg(
        long,
        value_name = "GLOB[,GLOB...]",
        value_delimiter = ',',
        required = true
    )]
    pub pod_interfaces: Vec<String>,
    /// Range nodePorts are allocated from when a manifest gives none.
    #[arg(long, value_name = "MIN-MAX", default_value = "30000-32767", value_parser = parse_port_range)]
    pub nodeport_range: RangeInclusive<u16>,
    /// Masquerade every new service connection, not only those from outside the cluster CIDR.
    #[arg(long)]
    pub masquerade_all: bool,
    /// bpffs directory for the pinned maps (mounted if needed); pins survive agent restarts.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// Frontends map size: (ClusterIP, port, protocol) and (node IP, nodePort, protocol) entries.
    #[arg(long, value_name = "N", default_value_t = default_size::FRONTENDS)]
    pub frontends_max: u32,
    /// Backends map size: one entry per endpoint of every service port.
    #[arg(long, value_name = "N", default_value_t = default_size::BACKENDS)]
    pub backends_max: u32,
    /// Conntrack map size: two entries per connection.
    #[arg(long, value_name = "N", default_value_t = default_size::CONNTRACK)]
    pub conntrack_max: u32,
}

#[derive(Debug, Args)]
pub struct StatsArgs {
    /// bpffs directory of the agent's pinned maps.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
}

fn parse_port_range(s: &str) -> Result<RangeInclusive<u16>, String> {
    let (min, max) = s
        .split_once('-')
        .ok_or_else(|| format!("{s:?}: expected MIN-MAX"))?;
    let parse = |p: &str| p.trim().parse::<u16>().map_err(|e| format!("{p:?}: {e}"));
    let (min, max) = (parse(min)?, parse(max)?);
    if min == 0 || min > max {
        return Err(format!("{s:?}: expected 1 <= MIN <= MAX"));
    }
    Ok(min..=max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_ranges() {
        assert_eq!(parse_port_range("30000-32767"), Ok(30000..=32767));
        assert!(parse_port_range("32767-30000").is_err());
        assert!(parse_port_range("0-10").is_err());
        assert!(parse_port_range("30000").is_err());
    }

    #[test]
    fn agent_command_line() {
        let cli = Cli::try_parse_from([
            "lb",
            "agent",
            "--manifests",
            "/m",
            "--node-ip",
            "198.51.100.1",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--external-interface",
            "ext0",
            "--pod-interfaces",
            "lbp*,veth*",
        ])
        .unwrap();
        let Command::Agent(a) = cli.command else {
            panic!("not agent")
        };
        assert_eq!(a.pod_interfaces, ["lbp*", "veth*"]);
        assert_eq!(a.nodeport_range, 30000..=32767);
        assert_eq!(a.bpffs, PathBuf::from(DEFAULT_BPFFS));
        assert_eq!(a.conntrack_max, default_size::CONNTRACK);
        assert!(!a.masquerade_all);
    }
}
