//! The single-node fixture most integration tests share: the topology, an echo server on every
//! pod, and the agent on a manifest set.
use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::Result;

use crate::{
    agent::Agent,
    echo::{EchoServer, Proto},
    manifests::{ServiceManifest, yaml},
    netns::Netns,
    topology::{CLUSTER_CIDR, CLUSTER_CIDR_V6, NODE_IP, NODE_IP_V6, POD_GATEWAY_V6, Topology},
};

pub const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
pub const PORT: u16 = 80;
/// The port every pod's echo server listens on.
pub const TARGET_PORT: u16 = 8080;

/// CLUSTER_IP:PORT.
pub fn vip() -> SocketAddr {
    (CLUSTER_IP, PORT).into()
}

/// Fields drop in order: the agent stops before the servers and namespaces go.
pub struct Node {
    pub agent: Agent,
    _servers: Vec<EchoServer>,
    pub topology: Topology,
}

impl Node {
    /// A topology with `pods` pods, each serving on TARGET_PORT, and the agent running on
    /// `services` with `agent_args`.
    pub fn start(pods: usize, services: &[ServiceManifest], agent_args: &[&str]) -> Result<Self> {
        let topology = Topology::new(pods)?;
        let servers = serve_pods(&topology, TARGET_PORT)?;
        let agent = Agent::start(&topology, &yaml(services), agent_args)?;
        Ok(Node {
            agent,
            _servers: servers,
            topology,
        })
    }

    /// A node of `pods` pods whose agent has both families' `--node-ip` and `--cluster-cidr`,
    /// and `extra` flags.
    pub fn start_dual_stack(pods: usize, extra: &[&str]) -> Result<Self> {
        let node_ips = format!("{NODE_IP},{NODE_IP_V6}");
        let cluster_cidrs = format!("{CLUSTER_CIDR},{CLUSTER_CIDR_V6}");
        let mut args = vec!["--node-ip", &node_ips, "--cluster-cidr", &cluster_cidrs];
        args.extend(extra);
        Self::start(pods, &[], &args)
    }

    /// Gives every pod an IPv6 address (`Topology::add_pod_ipv6`). The gateway address is a node
    /// address NodePorts are served on, as IPv4's: waits for the sync it makes, which a later
    /// manifest update must not take for its own.
    pub fn add_pod_ipv6(&mut self) -> Result<()> {
        self.topology.add_pod_ipv6()?;
        let served = format!("{POD_GATEWAY_V6}]");
        self.agent.wait_for_log(&served, Duration::from_secs(5))?;
        self.agent.wait_for_sync(Duration::from_secs(5))?;
        Ok(())
    }

    pub fn ip(&self, pod: &str) -> Ipv4Addr {
        self.topology.pod(pod).ip
    }

    /// The IPv6 address of the pod whose IPv4 address is `ip` (`Topology::add_pod_ipv6`).
    pub fn ipv6_of(&self, ip: Ipv4Addr) -> Ipv6Addr {
        self.topology.pod_ipv6_of(ip)
    }

    pub fn pod_ns(&self, pod: &str) -> &Netns {
        &self.topology.pod(pod).ns
    }

    /// Service `web` at `vip()` with these pods as ready endpoints.
    pub fn service(&self, proto: Proto, endpoints: &[&str]) -> ServiceManifest {
        ServiceManifest::new("web", CLUSTER_IP, proto, PORT, TARGET_PORT)
            .endpoints(endpoints.iter().map(|p| self.ip(p)))
    }
}

/// An echo server on `port` in every pod of `topology`, answering with the pod's name.
pub fn serve_pods(topology: &Topology, port: u16) -> Result<Vec<EchoServer>> {
    topology
        .pods
        .iter()
        .map(|pod| EchoServer::start(&pod.ns, &pod.name, port))
        .collect()
}
