//! The single-node fixture most integration tests share: the topology, an echo server on every
//! pod, and the agent on a manifest set.
use std::net::{Ipv4Addr, SocketAddr};

use anyhow::Result;

use crate::{
    agent::Agent,
    echo::{EchoServer, Proto},
    manifests::{ServiceManifest, yaml},
    netns::Netns,
    topology::Topology,
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

    pub fn ip(&self, pod: &str) -> Ipv4Addr {
        self.topology.pod(pod).ip
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
