//! The bench topology: the tests' node topology (lb_tests::topology) with two backend pods and a
//! client pod, so that service traffic crosses the node between two namespaces:
//!
//! ```text
//!  client pod (10.244.1.4) ──lbpc── node ──lbpa── backend pod-a (10.244.1.2)
//!                                        └─lbpb── backend pod-b (10.244.1.3)
//!  external client (198.51.100.2) ──ext0── node (198.51.100.1)
//! ```
//!
//! Every pod also has an IPv6 address (2001:db8:244::2, ::3, ::4: lb_tests' `add_pod_ipv6`), and
//! the node NODE_IP_V6 on ext0, so that B2/B3 measure both families on the same topology.
//!
//! Each variant gets a topology of its own, built identically: netfilter's NAT table and its
//! conntrack hooks stay registered in a namespace once used, and would tax every variant
//! measured after iptables in a shared one.
use std::net::{IpAddr, Ipv6Addr};

use anyhow::{Context as _, Result};
use lb_tests::{
    netns::Netns,
    topology::{EXTERNAL_INTERFACE, NODE_IP, Pod, Topology, pod_ip_v6},
};

use crate::services::Family;

/// The node's IPv6 address (the agent's IPv6 `--node-ip`).
pub const NODE_IP_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 1);

pub struct BenchTopology {
    pub inner: Topology,
}

impl BenchTopology {
    pub fn new() -> Result<Self> {
        let inner = Topology::new(3).context("build the topology (run as root)")?;
        inner.add_pod_ipv6()?;
        let node_ip_v6 = format!("{NODE_IP_V6}/64");
        inner.node.ip(&[
            "-6",
            "addr",
            "add",
            &node_ip_v6,
            "dev",
            EXTERNAL_INTERFACE,
            "nodad",
        ])?;
        let topology = BenchTopology { inner };
        let client = &topology.inner.client;
        // Service traffic from the external client (B5) is routed by the node; pod traffic has
        // its default route already.
        client.ip(&["route", "add", "10.96.0.0/12", "via", &NODE_IP.to_string()])?;
        for ns in [client, &topology.client_pod().ns] {
            // The connection-rate client opens tens of thousands of connections a second and
            // closes first: reuse TIME_WAIT ports (safe with timestamps), from a wide range.
            ns.sysctl("net.ipv4.tcp_tw_reuse", "1")?;
            ns.sysctl("net.ipv4.ip_local_port_range", "10000 60999")?;
        }
        // The live-frames generator transmits XDP frames into ext0's peer; a veth takes them
        // only when its receiving end runs NAPI, which GRO turns on.
        topology
            .inner
            .node
            .exec("ethtool", &["-K", EXTERNAL_INTERFACE, "gro", "on"])?;
        Ok(topology)
    }

    pub fn node(&self) -> &Netns {
        &self.inner.node
    }

    pub fn backend(&self) -> &Pod {
        &self.inner.pods[0]
    }

    /// The backend pod's address of `family`.
    pub fn backend_ip(&self, family: Family) -> IpAddr {
        match family {
            Family::Ipv4 => self.backend().ip.into(),
            Family::Ipv6 => pod_ip_v6(0).into(),
        }
    }

    pub fn second_backend(&self) -> &Pod {
        &self.inner.pods[1]
    }

    pub fn client_pod(&self) -> &Pod {
        &self.inner.pods[2]
    }
}
