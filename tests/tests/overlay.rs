//! Service traffic between two nodes whose pod CIDRs are routed over VXLAN, on an underlay that
//! drops pod-addressed packets outside the tunnel (`lb_tests::overlay`), one agent on each node,
//! in both forwarding modes. A masqueraded connection to a remote pod takes the source address
//! routing picks towards it, the tunnel device's, as MASQUERADE does: masqueraded to --node-ip,
//! the pod would answer the node's underlay address outside the tunnel, and the underlay drops
//! that. Each case runs from node-1 to a pod on node-2 and from node-2 to a pod on node-1.
use std::{
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddr},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    agent::Agent,
    echo::{EchoServer, Proto, error_kind, request, requests},
    manifests::{EndpointManifest, ServiceManifest, yaml},
    netns::Netns,
    overlay::OverlayCluster,
};

const PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
const PROTOS: [Proto; 2] = [Proto::Tcp, Proto::Udp];
const REQUESTS: usize = 3;

/// The agents stop before the servers and namespaces go.
struct Setup {
    _agents: Vec<Agent>,
    _servers: Vec<EchoServer>,
    cluster: OverlayCluster,
}

impl Setup {
    /// pod-a on node-1, pod-b on node-2, a server on each, and an agent on each node with
    /// `--forwarding forwarding` and `extra_args`, on [`services`].
    fn start(forwarding: &str, extra_args: &[&str]) -> Result<Self> {
        let cluster = OverlayCluster::new([1, 1])?;
        let servers = cluster
            .nodes
            .iter()
            .flat_map(|n| &n.pods)
            .map(|pod| EchoServer::start(&pod.ns, &pod.name, TARGET_PORT))
            .collect::<Result<Vec<_>>>()?;
        let manifests = yaml(&services(&cluster));
        let agents = cluster
            .nodes
            .iter()
            .map(|node| {
                let args = [
                    &[
                        "--hostname-override",
                        &node.name,
                        "--forwarding",
                        forwarding,
                    ],
                    extra_args,
                ]
                .concat();
                Agent::start_on(node.agent_node(), &manifests, &args)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Setup {
            _agents: agents,
            _servers: servers,
            cluster,
        })
    }
}

/// A service per protocol and pod: `to-b-*` served by pod-b on node-2, `to-a-*` by pod-a on
/// node-1.
fn services(cluster: &OverlayCluster) -> Vec<ServiceManifest> {
    let mut services = Vec::new();
    for (pod, node) in [("pod-a", "node-1"), ("pod-b", "node-2")] {
        for proto in PROTOS {
            let name = format!("to-{}-{}", &pod[4..], proto.manifest_name().to_lowercase());
            let endpoint = EndpointManifest::ready(cluster.pod(pod).ip).on_node(node);
            services.push(
                ServiceManifest::new(&name, cluster_ip(pod, proto), proto, PORT, TARGET_PORT)
                    .node_port(node_port(pod, proto))
                    .endpoint(endpoint),
            );
        }
    }
    services
}

fn cluster_ip(pod: &str, proto: Proto) -> Ipv4Addr {
    let base = if pod == "pod-a" { 20 } else { 10 };
    Ipv4Addr::new(10, 96, 0, base + u8::from(proto == Proto::Udp))
}

fn node_port(pod: &str, proto: Proto) -> u16 {
    let base = if pod == "pod-a" { 30090 } else { 30080 };
    base + u16::from(proto == Proto::Udp)
}

/// The (entry node, backend pod) pairs: every case crosses the tunnel.
const CROSSINGS: [(usize, &str); 2] = [(0, "pod-b"), (1, "pod-a")];

/// `REQUESTS` requests per protocol from `client` to `to(pod, proto)`, each answered by `pod`,
/// which saw `seen`, and the client saw `to` as its peer.
fn ensure_answers(
    client: &Netns,
    pod: &str,
    to: impl Fn(Proto) -> SocketAddr,
    seen: Ipv4Addr,
) -> Result<()> {
    for proto in PROTOS {
        let to = to(proto);
        let answers =
            requests(client, proto, to, REQUESTS).with_context(|| format!("{proto:?} to {to}"))?;
        for answer in answers {
            ensure!(
                answer.server == pod && answer.seen_source.ip() == seen && answer.peer == to,
                "{proto:?} to {to}: {answer:?}, expected {pod} to see {seen}"
            );
        }
    }
    Ok(())
}

/// External client → node:NodePort → a pod on the other node, masqueraded to the entry node's
/// tunnel address (externalTrafficPolicy Cluster).
fn node_port_to_a_remote_pod(forwarding: &str) -> Result<()> {
    let setup = Setup::start(forwarding, &[])?;
    let cluster = &setup.cluster;
    for (entry, pod) in CROSSINGS {
        let node = &cluster.nodes[entry];
        ensure_answers(
            &cluster.client,
            pod,
            |proto| (node.ip, node_port(pod, proto)).into(),
            node.tunnel_ip,
        )
        .with_context(|| format!("via {}", node.name))?;
    }
    Ok(())
}

/// A pod → ClusterIP → a pod on the other node: not masqueraded (the client is in the cluster
/// CIDR), the backend sees the client pod; its replies arrive on the client node's tunnel.
fn cluster_ip_to_a_remote_pod(forwarding: &str) -> Result<()> {
    let setup = Setup::start(forwarding, &[])?;
    let cluster = &setup.cluster;
    for (entry, pod) in CROSSINGS {
        let client = &cluster.nodes[entry].pods[0];
        ensure_answers(
            &client.ns,
            pod,
            |proto| (cluster_ip(pod, proto), PORT).into(),
            client.ip,
        )
        .with_context(|| format!("from {}", client.name))?;
    }
    Ok(())
}

/// With --masquerade-all, a pod → ClusterIP → a pod on the other node is masqueraded to the
/// client node's tunnel address.
fn cluster_ip_masqueraded_to_a_remote_pod(forwarding: &str) -> Result<()> {
    let setup = Setup::start(forwarding, &["--masquerade-all"])?;
    let cluster = &setup.cluster;
    for (entry, pod) in CROSSINGS {
        let node = &cluster.nodes[entry];
        let client = &node.pods[0];
        ensure_answers(
            &client.ns,
            pod,
            |proto| (cluster_ip(pod, proto), PORT).into(),
            node.tunnel_ip,
        )
        .with_context(|| format!("from {}", client.name))?;
    }
    Ok(())
}

/// The topology's premise: the underlay carries node addresses, and a pod's packet to a node
/// address reaches it only through the tunnel: a pod on node-2 sending to node-1's underlay
/// address goes out on the underlay from its own address, which the underlay drops; node-2 itself
/// reaches node-1 there.
#[test]
fn the_underlay_drops_pod_addressed_packets() -> Result<()> {
    let cluster = OverlayCluster::new([0, 1])?;
    let node_1 = &cluster.nodes[0];
    let _server = EchoServer::start(&node_1.ns, &node_1.name, TARGET_PORT)?;
    let to: SocketAddr = (node_1.ip, TARGET_PORT).into();
    let answer = request(&cluster.nodes[1].ns, Proto::Tcp, to)?;
    ensure!(answer.server == node_1.name, "{answer:?}");
    let pod = cluster.pod("pod-a");
    match request(&pod.ns, Proto::Tcp, to) {
        Ok(answer) => bail!("{} reached {to} outside the tunnel: {answer:?}", pod.name),
        Err(err) => ensure!(
            error_kind(&err) == Some(ErrorKind::TimedOut),
            "{err:#}, expected a timeout"
        ),
    }
    Ok(())
}

#[test]
fn node_port_to_a_remote_pod_over_vxlan_stack() -> Result<()> {
    node_port_to_a_remote_pod("stack")
}

#[test]
fn node_port_to_a_remote_pod_over_vxlan_redirect() -> Result<()> {
    node_port_to_a_remote_pod("redirect")
}

#[test]
fn cluster_ip_to_a_remote_pod_over_vxlan_stack() -> Result<()> {
    cluster_ip_to_a_remote_pod("stack")
}

#[test]
fn cluster_ip_to_a_remote_pod_over_vxlan_redirect() -> Result<()> {
    cluster_ip_to_a_remote_pod("redirect")
}

#[test]
fn cluster_ip_masqueraded_to_a_remote_pod_over_vxlan_stack() -> Result<()> {
    cluster_ip_masqueraded_to_a_remote_pod("stack")
}

#[test]
fn cluster_ip_masqueraded_to_a_remote_pod_over_vxlan_redirect() -> Result<()> {
    cluster_ip_masqueraded_to_a_remote_pod("redirect")
}
