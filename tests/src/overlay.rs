//! Two nodes whose pod CIDRs are routed over VXLAN, as flannel's and Calico's VXLAN modes do it,
//! on an underlay that, like a cloud VPC, carries only the nodes' own addresses:
//!
//! ```text
//!                         ┌─ n1 ──ext0── node-1 (203.0.113.1)  ─ flannel.1 (10.244.1.0/32), lbp*── pods 10.244.1.x
//!  underlay (bridge br0) ─┼─ n2 ──ext0── node-2 (203.0.113.11) ─ flannel.1 (10.244.2.0/32), lbp*── pods 10.244.2.x
//!                         └─ c0 ──eth0── client (203.0.113.100)
//! ```
//!
//! Each node routes the other's pod CIDR `via` the other's tunnel address `onlink` on its
//! `flannel.1`, a VXLAN device to the other node, which holds an address of its own pod CIDR
//! (flannel's `flannel.1`, Calico's `vxlan.calico`). The underlay is strict: an nftables rule on
//! its bridge drops every IPv4 frame whose source or destination is not an underlay address, so
//! a pod-addressed packet gets through only inside the tunnel (VXLAN's outer header carries the
//! nodes' addresses). Pods are wired as in the single-node
//! [`Topology`](crate::topology::Topology). Nothing in it has a path to the machine's real
//! interfaces.
use std::net::Ipv4Addr;

use anyhow::{Context as _, Result};

use crate::multinode::{Segment, node_with_pods, pod_cidr, pod_named};
use crate::netns::{Netns, unique_prefix};
use crate::topology::{AgentNode, EXTERNAL_INTERFACE, Pod};

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 100);
/// The underlay's only addresses.
pub const UNDERLAY: &str = "203.0.113.0/24";
/// Each node's VXLAN device, named as flannel's.
pub const TUNNEL_INTERFACE: &str = "flannel.1";
/// `--pod-interfaces` of every node: the pod veths and the tunnel, where replies from remote
/// pods arrive.
pub const POD_INTERFACES: &str = "lbp*,flannel.1";
const VXLAN_ID: &str = "1";
/// flannel's VXLAN port.
const VXLAN_PORT: &str = "8472";

pub struct Node {
    /// `node-1`, `node-2`: the agent's --hostname-override and the endpoints' nodeName.
    pub name: String,
    /// The underlay address: --node-ip.
    pub ip: Ipv4Addr,
    /// The tunnel device's address, 10.244.N.0: what routing picks as the source towards the
    /// other node's pods.
    pub tunnel_ip: Ipv4Addr,
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

/// Fields drop in order: nodes and client (and their veths) before the underlay.
pub struct OverlayCluster {
    pub nodes: Vec<Node>,
    pub client: Netns,
    pub underlay: Netns,
}

impl OverlayCluster {
    /// Two nodes with `pods[i]` pods on node i+1, lettered across the cluster as in
    /// [`Cluster`](crate::multinode::Cluster).
    pub fn new(pods: [usize; 2]) -> Result<Self> {
        let prefix = unique_prefix();
        let underlay = Segment::new(format!("{prefix}underlay"))?;
        strict_underlay(&underlay.ns)?;
        let client = Netns::new(format!("{prefix}client"))?;
        underlay.plug(&client, "eth0", "c0", &format!("{CLIENT_IP}/24"))?;

        let ips = [
            Ipv4Addr::new(203, 0, 113, 1),
            Ipv4Addr::new(203, 0, 113, 11),
        ];
        let mut nodes = Vec::new();
        let mut letter = 0;
        for (i, count) in pods.into_iter().enumerate() {
            let n = i as u8 + 1;
            let (ns, pods) = node_with_pods(&prefix, n, count, &mut letter)?;
            underlay.plug(
                &ns,
                EXTERNAL_INTERFACE,
                &format!("n{n}"),
                &format!("{}/24", ips[i]),
            )?;
            let tunnel_ip = Ipv4Addr::new(10, 244, n, 0);
            ns.ip(&[
                "link",
                "add",
                TUNNEL_INTERFACE,
                "type",
                "vxlan",
                "id",
                VXLAN_ID,
                "local",
                &ips[i].to_string(),
                "remote",
                &ips[1 - i].to_string(),
                "dstport",
                VXLAN_PORT,
                "dev",
                EXTERNAL_INTERFACE,
            ])?;
            ns.ip(&[
                "addr",
                "add",
                &format!("{tunnel_ip}/32"),
                "dev",
                TUNNEL_INTERFACE,
            ])?;
            ns.ip(&["link", "set", TUNNEL_INTERFACE, "up"])?;
            nodes.push(Node {
                name: format!("node-{n}"),
                ip: ips[i],
                tunnel_ip,
                pod_cidr: pod_cidr(n),
                ns,
                pods,
            });
        }
        for (node, other) in [(0, 1), (1, 0)] {
            let via = nodes[other].tunnel_ip.to_string();
            nodes[node].ns.ip(&[
                "route",
                "add",
                &nodes[other].pod_cidr,
                "via",
                &via,
                "dev",
                TUNNEL_INTERFACE,
                "onlink",
            ])?;
        }
        Ok(OverlayCluster {
            nodes,
            client,
            underlay: underlay.ns,
        })
    }

    pub fn pod(&self, name: &str) -> &Pod {
        pod_named(self.nodes.iter().flat_map(|n| &n.pods), name)
    }
}

/// The underlay's bridge forwards IPv4 only between underlay addresses (ARP passes).
fn strict_underlay(underlay: &Netns) -> Result<()> {
    let ruleset = format!(
        "table bridge underlay {{
            chain forward {{
                type filter hook forward priority 0; policy accept;
                ether type ip ip saddr != {UNDERLAY} counter drop
                ether type ip ip daddr != {UNDERLAY} counter drop
                ether type ip6 counter drop
            }}
        }}"
    );
    let mut nft = underlay.command("nft");
    nft.args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null());
    let mut child = nft.spawn().context("spawn nft")?;
    std::io::Write::write_all(
        &mut child.stdin.take().context("nft stdin")?,
        ruleset.as_bytes(),
    )?;
    let status = child.wait()?;
    anyhow::ensure!(status.success(), "nft -f: {status}");
    Ok(())
}
