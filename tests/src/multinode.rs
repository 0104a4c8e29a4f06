//! Two nodes on one network segment, each with its own pods:
//!
//! ```text
//!                    ┌─ n1 ──ext0── node-1 (198.51.100.1)  ──lbp*── pods in 10.244.1.0/24
//!  net (bridge br0) ─┼─ n2 ──ext0── node-2 (198.51.100.11) ──lbp*── pods in 10.244.2.0/24
//!                    └─ c0 ──eth0── client (198.51.100.100)
//! ```
//!
//! `Cluster::add_ipv6` gives it a second family: the nodes 2001:db8:100::1 and ::11, the client
//! ::100, node N's pods in 2001:db8:244:N::/64, routed the same way.
//!
//! The bridge namespace stands for the network between the nodes. Each node routes the other's
//! pod CIDR via the other's address, as a CNI in direct-routing mode does. Pods are wired as in
//! the single-node [`Topology`](crate::topology::Topology). Nothing in it has a path to the
//! machine's real interfaces.
use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::Result;

use crate::netns::{Netns, unique_prefix};
use crate::topology::{AgentNode, EXTERNAL_INTERFACE, Pod, add_pod, add_pod_ipv6, node_sysctls};

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 100);
pub const CLIENT_IP_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x100);
/// `--cluster-cidr` of a dual-stack cluster: every node's pod CIDR of each family.
pub const CLUSTER_CIDRS: &str = "10.244.0.0/16,2001:db8:244::/56";
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

    /// Gives the cluster IPv6 (see the module's doc): addresses on the segment, every pod an
    /// IPv6 address (`pod_ip_v6`), each node a route to the other's IPv6 pod CIDR via its
    /// address on the segment.
    pub fn add_ipv6(&self) -> Result<()> {
        let on_segment = |ns: &Netns, interface: &str, ip: Ipv6Addr| {
            ns.ip(&[
                "-6",
                "addr",
                "add",
                &format!("{ip}/64"),
                "dev",
                interface,
                "nodad",
            ])
        };
        on_segment(&self.client, "eth0", CLIENT_IP_V6)?;
        for (i, node) in self.nodes.iter().enumerate() {
            let n = i as u8 + 1;
            node.ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
            on_segment(&node.ns, EXTERNAL_INTERFACE, node_ip_v6(n))?;
            for (k, pod) in node.pods.iter().enumerate() {
                add_pod_ipv6(&node.ns, pod, pod_ip_v6(n, k), pod_ip_v6_gateway(n))?;
            }
        }
        for (node, other) in [(0, 1), (1, 0)] {
            let via = node_ip_v6(other as u8 + 1).to_string();
            let cidr = format!("2001:db8:244:{}::/64", other + 1);
            self.nodes[node]
                .ns
                .ip(&["-6", "route", "add", &cidr, "via", &via])?;
        }
        Ok(())
    }
}

/// Node `n`'s IPv6 address on the segment (`Cluster::add_ipv6`).
pub const fn node_ip_v6(n: u8) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 1 + 0x10 * (n as u16 - 1))
}

/// The IPv6 address of node `n`'s pod `k` (counted on that node from 0).
pub const fn pod_ip_v6(n: u8, k: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0x244, n as u16, 0, 0, 0, 2 + k as u16)
}

const fn pod_ip_v6_gateway(n: u8) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0x244, n as u16, 0, 0, 0, 1)
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
