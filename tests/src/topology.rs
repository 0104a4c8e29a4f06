//! The node under test and its neighbours, each in a namespace of its own:
//!
//! ```text
//!  client (198.51.100.2) ──ext0── node (198.51.100.1) ──lbpa/lbpb/...── pod-a, pod-b, ... (10.244.1.x/32)
//!                                   └─docker0 (172.17.0.1/16)──vethc── container (172.17.0.2)
//! ```
//!
//! Pods are routed the way Calico and Cilium do it: a /32 on the pod, a /32 route per pod on the
//! node, the pod's gateway an address the node holds on every pod veth. Nothing in it has a path
//! to the machine's real interfaces.
use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{Result, ensure};

use crate::netns::{Netns, unique_prefix};

pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);
pub const DOCKER_GATEWAY: Ipv4Addr = Ipv4Addr::new(172, 17, 0, 1);
pub const CONTAINER_IP: Ipv4Addr = Ipv4Addr::new(172, 17, 0, 2);
pub const EXTERNAL_INTERFACE: &str = "ext0";
pub const DOCKER_BRIDGE: &str = "docker0";
/// The IPv6 pod network of `Topology::add_pod_ipv6`, and the pods' IPv6 gateway in it.
pub const CLUSTER_CIDR_V6: &str = "2001:db8:244::/56";
pub const POD_GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x244, 0, 0, 0, 0, 1);
/// The node's and the client's IPv6 addresses on the external link (`add_external_ipv6`).
pub const NODE_IP_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x10);
pub const CLIENT_IP_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 2);
/// The docker bridge's and the container's IPv6 addresses (`add_container_ipv6`), outside
/// CLUSTER_CIDR_V6.
pub const DOCKER_GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x172, 0, 0, 0, 0, 1);
pub const CONTAINER_IP_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x172, 0, 0, 0, 0, 2);
/// `--pod-interfaces` for this topology: the pod veths and the docker bridge.
pub const POD_INTERFACES: &str = "lbp*,docker0";

pub struct Pod {
    /// `pod-a`, `pod-b`, ...: what its servers answer with.
    pub name: String,
    pub ip: Ipv4Addr,
    /// The node-side end of its veth.
    pub host_interface: String,
    pub ns: Netns,
}

pub struct Topology {
    prefix: String,
    pub node: Netns,
    pub client: Netns,
    pub container: Netns,
    pub pods: Vec<Pod>,
}

impl Topology {
    /// Readies the links for `lb agent --xdp`'s fast path, as tests/tests/xdp.rs explains: NAPI
    /// on the pods' veth ends (GRO on) lets XDP redirect into them; the client's checksums
    /// complete, as frames from a wire are.
    pub fn prepare_xdp_fast_path(&self) -> Result<()> {
        for pod in &self.pods {
            pod.ns.exec("ethtool", &["-K", "eth0", "gro", "on"])?;
        }
        self.client.exec("ethtool", &["-K", "eth0", "tx", "off"])?;
        Ok(())
    }

    pub fn new(pods: usize) -> Result<Self> {
        let prefix = unique_prefix();
        let node = Netns::new(format!("{prefix}node"))?;
        node_sysctls(&node)?;

        let client = Netns::new(format!("{prefix}client"))?;
        node.add_veth(EXTERNAL_INTERFACE, &client, "eth0")?;
        node.ip(&[
            "addr",
            "add",
            &format!("{NODE_IP}/24"),
            "dev",
            EXTERNAL_INTERFACE,
        ])?;
        node.ip(&["link", "set", EXTERNAL_INTERFACE, "up"])?;
        client.ip(&["addr", "add", &format!("{CLIENT_IP}/24"), "dev", "eth0"])?;
        client.ip(&["link", "set", "eth0", "up"])?;

        let container = Netns::new(format!("{prefix}ctr"))?;
        node.ip(&["link", "add", DOCKER_BRIDGE, "type", "bridge"])?;
        node.ip(&[
            "addr",
            "add",
            &format!("{DOCKER_GATEWAY}/16"),
            "dev",
            DOCKER_BRIDGE,
        ])?;
        node.ip(&["link", "set", DOCKER_BRIDGE, "up"])?;
        node.add_veth("vethc", &container, "eth0")?;
        node.ip(&["link", "set", "vethc", "master", DOCKER_BRIDGE, "up"])?;
        container.ip(&["addr", "add", &format!("{CONTAINER_IP}/16"), "dev", "eth0"])?;
        container.ip(&["link", "set", "eth0", "up"])?;
        container.ip(&[
            "route",
            "add",
            "default",
            "via",
            &DOCKER_GATEWAY.to_string(),
        ])?;

        let mut topology = Topology {
            prefix,
            node,
            client,
            container,
            pods: Vec::new(),
        };
        for _ in 0..pods {
            topology.add_pod()?;
        }
        Ok(topology)
    }

    /// Adds the next pod (`pod-a` at 10.244.1.2, `pod-b` at .3, ...) on a new veth `lbpa`, ...
    pub fn add_pod(&mut self) -> Result<&Pod> {
        let index = self.pods.len();
        assert!(index < 26, "pods are named a..z");
        let ip = Ipv4Addr::new(10, 244, 1, 2 + index as u8);
        let pod = add_pod(&self.node, &self.prefix, index, ip, POD_GATEWAY)?;
        self.pods.push(pod);
        Ok(self.pods.last().expect("just pushed"))
    }

    /// Gives every pod an IPv6 address (`pod_ip_v6`) routed as its IPv4 one: a /128 on the pod,
    /// a /128 route on the node, the gateway an address the node holds on every pod veth, with
    /// static neighbours so that no packet waits for neighbour discovery or duplicate address
    /// detection.
    pub fn add_pod_ipv6(&self) -> Result<()> {
        self.node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        for (index, pod) in self.pods.iter().enumerate() {
            add_pod_ipv6(&self.node, pod, pod_ip_v6(index), POD_GATEWAY_V6)?;
        }
        Ok(())
    }

    /// The IPv6 address `add_pod_ipv6` gives the pod whose IPv4 address is `ip`.
    pub fn pod_ipv6_of(&self, ip: Ipv4Addr) -> Ipv6Addr {
        let index = self.pods.iter().position(|p| p.ip == ip);
        pod_ip_v6(index.unwrap_or_else(|| panic!("no pod at {ip}")))
    }

    /// Gives the external link IPv6: NODE_IP_V6 on the node's side, CLIENT_IP_V6 on the
    /// client's, as `add_pod_ipv6` does for the pods.
    pub fn add_external_ipv6(&self) -> Result<()> {
        let node_side = (&self.node, EXTERNAL_INTERFACE, NODE_IP_V6);
        link_ipv6(node_side, (&self.client, "eth0", CLIENT_IP_V6))
    }

    /// Gives the docker bridge DOCKER_GATEWAY_V6 and the container CONTAINER_IP_V6, its default
    /// route through the bridge.
    pub fn add_container_ipv6(&self) -> Result<()> {
        let node_side = (&self.node, DOCKER_BRIDGE, DOCKER_GATEWAY_V6);
        link_ipv6(node_side, (&self.container, "eth0", CONTAINER_IP_V6))?;
        let gateway = DOCKER_GATEWAY_V6.to_string();
        self.container
            .ip(&["-6", "route", "add", "default", "via", &gateway])
    }

    /// The node as the agent sees it.
    pub fn agent_node(&self) -> AgentNode<'_> {
        AgentNode {
            ns: &self.node,
            ip: NODE_IP,
            external_interface: EXTERNAL_INTERFACE,
            pod_interfaces: POD_INTERFACES,
        }
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
    }
}

/// What the agent needs to know of the node it runs on.
#[derive(Clone, Copy, Debug)]
pub struct AgentNode<'a> {
    pub ns: &'a Netns,
    /// --node-ip.
    pub ip: Ipv4Addr,
    pub external_interface: &'a str,
    /// --pod-interfaces.
    pub pod_interfaces: &'a str,
}

/// Pod number `index` of a node (`pod-a`, ... on veth `lbpa`, ...) at `ip`, its gateway
/// `gateway` (an address the node holds on every pod veth).
pub(crate) fn add_pod(
    node: &Netns,
    prefix: &str,
    index: usize,
    ip: Ipv4Addr,
    gateway: Ipv4Addr,
) -> Result<Pod> {
    let letter = (b'a' + index as u8) as char;
    let name = format!("pod-{letter}");
    let host_interface = format!("lbp{letter}");
    let ns = Netns::new(format!("{prefix}{name}"))?;
    node.add_veth(&host_interface, &ns, "eth0")?;
    node.ip(&[
        "addr",
        "add",
        &format!("{gateway}/32"),
        "dev",
        &host_interface,
    ])?;
    node.ip(&["link", "set", &host_interface, "up"])?;
    node.ip(&["route", "add", &format!("{ip}/32"), "dev", &host_interface])?;
    ns.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"])?;
    ns.ip(&["link", "set", "eth0", "up"])?;
    ns.ip(&[
        "route",
        "add",
        &gateway.to_string(),
        "dev",
        "eth0",
        "scope",
        "link",
    ])?;
    ns.ip(&["route", "add", "default", "via", &gateway.to_string()])?;
    Ok(Pod {
        name,
        ip,
        host_interface,
        ns,
    })
}

/// Gives `pod` of `node` the IPv6 address `ip` (a /128 on the pod, a /128 route on the node),
/// its gateway `gateway` an address the node holds on the pod's veth, with static neighbours
/// both ways.
pub(crate) fn add_pod_ipv6(node: &Netns, pod: &Pod, ip: Ipv6Addr, gateway: Ipv6Addr) -> Result<()> {
    let (ip, gateway) = (ip.to_string(), gateway.to_string());
    let veth = pod.host_interface.as_str();
    let gateway_on_veth = format!("{gateway}/128");
    node.ip(&["-6", "addr", "add", &gateway_on_veth, "dev", veth, "nodad"])?;
    node.ip(&["-6", "route", "add", &format!("{ip}/128"), "dev", veth])?;
    let pod_mac = mac(&pod.ns, "eth0")?;
    node.ip(&["-6", "neigh", "add", &ip, "lladdr", &pod_mac, "dev", veth])?;
    let pod_addr = format!("{ip}/128");
    pod.ns
        .ip(&["-6", "addr", "add", &pod_addr, "dev", "eth0", "nodad"])?;
    pod.ns
        .ip(&["-6", "route", "add", &gateway, "dev", "eth0"])?;
    pod.ns.ip(&[
        "-6", "route", "add", "default", "via", &gateway, "dev", "eth0",
    ])?;
    let veth_mac = mac(node, veth)?;
    pod.ns.ip(&[
        "-6", "neigh", "add", &gateway, "lladdr", &veth_mac, "dev", "eth0",
    ])
}

/// Puts the two ends of a link (namespace, interface, address) in one /64, each with the other
/// as a static neighbour, so that no packet waits for neighbour discovery or duplicate address
/// detection.
fn link_ipv6(a: (&Netns, &str, Ipv6Addr), b: (&Netns, &str, Ipv6Addr)) -> Result<()> {
    for ((ns, interface, addr), (peer_ns, peer_interface, peer_addr)) in [(a, b), (b, a)] {
        let cidr = format!("{addr}/64");
        ns.ip(&["-6", "addr", "add", &cidr, "dev", interface, "nodad"])?;
        let peer_mac = mac(peer_ns, peer_interface)?;
        let peer = peer_addr.to_string();
        ns.ip(&[
            "-6", "neigh", "add", &peer, "lladdr", &peer_mac, "dev", interface,
        ])?;
    }
    Ok(())
}

/// Pod `index`'s IPv6 address in CLUSTER_CIDR_V6 (`pod-a` 2001:db8:244::2, ...).
pub const fn pod_ip_v6(index: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0x244, 0, 0, 0, 0, 2 + index as u16)
}

/// The MAC address of `interface` in `ns`.
pub fn mac(ns: &Netns, interface: &str) -> Result<String> {
    let path = format!("/sys/class/net/{interface}/address");
    let out = ns.exec("cat", &[&path])?;
    ensure!(out.status.success(), "{path}: {out:?}");
    Ok(String::from_utf8(out.stdout)?.trim().to_string())
}

/// The sysctls of a node: a router that never sends redirects (the datapath forwards traffic
/// back out the interface it came in on) and accepts asymmetric paths.
pub(crate) fn node_sysctls(node: &Netns) -> Result<()> {
    for (key, value) in [
        ("net.ipv4.ip_forward", "1"),
        ("net.ipv4.conf.all.send_redirects", "0"),
        ("net.ipv4.conf.default.send_redirects", "0"),
        ("net.ipv4.conf.all.rp_filter", "0"),
        ("net.ipv4.conf.default.rp_filter", "0"),
    ] {
        node.sysctl(key, value)?;
    }
    Ok(())
}
