//! Two nodes on one network segment, each with its own pods:
//!
//! ```text
//!                    ┌─ n1 ──ext0── node-1 (198.51.100.1)  ──lbp*── pods in 10.244.1.0/24
//!  net (bridge br0) ─┼─ n2 ──ext0── node-2 (198.51.100.11) ──lbp*── pods in 10.244.2.0/24
//!                    └─ c0 ──eth0── client (198.51.100.100)
//! ```
//!
//! The bridge namespace stands for the network between the nodes. Each node routes the other's
//! pod CIDR via the other's address, as a CNI in direct-routing mode does. Pods are wired as in
//! the single-node [`Topology`](crate::topology::Topology). Nothing in it has a path to the
//! machine's real interfaces.
use std::net::Ipv4Addr;

use anyhow::Result;

use crate::netns::{Netns, unique_prefix};
use crate::topology::{AgentNode, EXTERNAL_INTERFACE, Pod, add_pod, node_sysctls};

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 100);
/// `--pod-interfaces` of every node.
pub const POD_INTERFACES: &str = "lbp*";

pub struct Node {
    /// `node-1`, `node-2`: the agent's --hostname-override and the endpoints' nodeName.
    pub name: String,
    pub ip: Ipv4Addr,
    /// 10.244.N.0/24.
    pub pod_cidr: String,
    pub ns: Netns,
    pub pods: Vec<Pod>,
}

impl Node {
    pub fn agent_node(&self) -> AgentNode<'_> {
        AgentNode {
            ns: &self.ns,
            ip: self.ip,
            external_interface: EXTERNAL_INTERFACE,
            pod_interfaces: POD_INTERFACES,
        }
    }
}

/// Fields drop in order: nodes and client (and their veths) before the network.
pub struct Cluster {
    pub nodes: Vec<Node>,
    pub client: Netns,
    pub net: Netns,
}

impl Cluster {
    /// Two nodes with `pods[i]` pods on node i+1. Pods are lettered across the cluster: with
    /// `[1, 2]`, pod-a is on node-1, pod-b and pod-c on node-2.
    pub fn new(pods: [usize; 2]) -> Result<Self> {
        let prefix = unique_prefix();
        let net = Segment::new(format!("{prefix}net"))?;
        let client = Netns::new(format!("{prefix}client"))?;
        net.plug(&client, "eth0", "c0", &format!("{CLIENT_IP}/24"))?;

        let mut nodes = Vec::new();
        let mut letter = 0;
        for (i, count) in pods.into_iter().enumerate() {
            let n = i as u8 + 1;
            let (ns, pods) = node_with_pods(&prefix, n, count, &mut letter)?;
            let ip = Ipv4Addr::new(198, 51, 100, 1 + 10 * i as u8);
            net.plug(
                &ns,
                EXTERNAL_INTERFACE,
                &format!("n{n}"),
                &format!("{ip}/24"),
            )?;
            nodes.push(Node {
                name: format!("node-{n}"),
                ip,
                pod_cidr: pod_cidr(n),
                ns,
                pods,
            });
        }
        for (node, other) in [(0, 1), (1, 0)] {
            let via = nodes[other].ip.to_string();
            nodes[node]
                .ns
                .ip(&["route", "add", &nodes[other].pod_cidr, "via", &via])?;
        }
        Ok(Cluster {
            nodes,
            client,
            net: net.ns,
        })
    }

    pub fn pod(&self, name: &str) -> &Pod {
        pod_named(self.nodes.iter().flat_map(|n| &n.pods), name)
    }
}

/// A network segment between namespaces: a bridge in a namespace of its own.
pub struct Segment {
    pub ns: Netns,
}

impl Segment {
    pub fn new(name: String) -> Result<Self> {
        let ns = Netns::new(name)?;
        ns.ip(&["link", "add", "br0", "type", "bridge"])?;
        ns.ip(&["link", "set", "br0", "up"])?;
        Ok(Segment { ns })
    }

    /// Connects `ns` to the segment: its interface `inside`, with address `addr` (CIDR
    /// notation), is a veth whose other end, `port`, is on the bridge.
    pub fn plug(&self, ns: &Netns, inside: &str, port: &str, addr: &str) -> Result<()> {
        self.ns.add_veth(port, ns, inside)?;
        self.ns.ip(&["link", "set", port, "master", "br0", "up"])?;
        ns.ip(&["addr", "add", addr, "dev", inside])?;
        ns.ip(&["link", "set", inside, "up"])
    }
}

/// Node `n`'s namespace (`{prefix}node{n}`) with `count` pods in 10.244.n.0/24 (gateway
/// 10.244.n.1), lettered from `letter` on, which it advances.
pub fn node_with_pods(
    prefix: &str,
    n: u8,
    count: usize,
    letter: &mut usize,
) -> Result<(Netns, Vec<Pod>)> {
    let ns = Netns::new(format!("{prefix}node{n}"))?;
    node_sysctls(&ns)?;
    let gateway = Ipv4Addr::new(10, 244, n, 1);
    let mut pods = Vec::new();
    for k in 0..count {
        let pod_ip = Ipv4Addr::new(10, 244, n, 2 + k as u8);
        pods.push(add_pod(&ns, prefix, *letter, pod_ip, gateway)?);
        *letter += 1;
    }
    Ok((ns, pods))
}

/// Node `n`'s pod CIDR.
pub fn pod_cidr(n: u8) -> String {
    format!("10.244.{n}.0/24")
}

/// The pod called `name` among `pods`.
pub fn pod_named<'a>(mut pods: impl Iterator<Item = &'a Pod>, name: &str) -> &'a Pod {
    pods.find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no pod {name}"))
}
