//! IPv4 fragments through a real node namespace: a UDP datagram larger than the links' MTU (1500)
//! leaves the client in fragments, each is translated as it crosses the node, the endpoint
//! reassembles the datagram, and its answer, as large and fragmented by the endpoint's kernel,
//! comes back reverse-translated. Untranslated later fragments would reach the service address
//! (or the node) and the datagram would never be whole: the exchange would time out.
use std::net::{Ipv4Addr, SocketAddr};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    agent::counter,
    echo::{LARGE_DATAGRAM, Proto, large_exchange, serve_large},
    manifests::{ServiceManifest, yaml},
    netns::Netns,
    node::{CLUSTER_IP, Node, PORT},
    topology::{NODE_IP, POD_GATEWAY},
};

const NODE_PORT: u16 = 30080;
/// Not the echo servers' port: this service's endpoint runs `serve_large`.
const LARGE_PORT: u16 = 8090;

/// Where the endpoint's `serve_large` listens.
fn large_port() -> SocketAddr {
    (Ipv4Addr::UNSPECIFIED, LARGE_PORT).into()
}

/// Who sends to the service, where, and the source its endpoint sees: pod-a to the ClusterIP
/// (itself), the external client to the NodePort (masqueraded to the node's pod-side address).
fn clients(node: &Node) -> [(&Netns, SocketAddr, Ipv4Addr); 2] {
    [
        (
            node.pod_ns("pod-a"),
            SocketAddr::from((CLUSTER_IP, PORT)),
            node.ip("pod-a"),
        ),
        (
            &node.topology.client,
            SocketAddr::from((NODE_IP, NODE_PORT)),
            POD_GATEWAY,
        ),
    ]
}

/// From a pod to the ClusterIP (the endpoint sees the pod) and from an external client to the
/// NodePort (masqueraded), every fragment of both directions translated by tc, and by the XDP
/// path's agent too, which hands fragments to tc.
fn fragmented_udp(agent_args: &[&str]) -> Result<()> {
    let mut node = Node::start(2, &[], agent_args)?;
    let service = ServiceManifest::new("large", CLUSTER_IP, Proto::Udp, PORT, LARGE_PORT)
        .node_port(NODE_PORT)
        .endpoints([node.ip("pod-b")]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let server = serve_large(node.pod_ns("pod-b"), large_port(), 2)?;
    let cases = clients(&node);
    for (ns, to, expected_source) in cases {
        let (seen, peer) = large_exchange(ns, to, LARGE_DATAGRAM)?;
        ensure!(seen.ip() == expected_source, "to {to}: endpoint saw {seen}");
        ensure!(peer == to, "to {to}: answer from {peer}");
    }
    server.join().expect("server thread")?;
    let passed = counter(&node.topology.node, "passed_fragment")?;
    ensure!(passed == 0, "passed_fragment {passed}");
    Ok(())
}

#[test]
fn fragmented_udp_through_cluster_ip_and_node_port() -> Result<()> {
    fragmented_udp(&[])
}

#[test]
fn fragmented_udp_with_the_xdp_path_attached() -> Result<()> {
    fragmented_udp(&["--xdp"])
}

/// The MTU of the node's link to the endpoint in `too_big_without_df_is_fragmented_by_the_node`.
const NARROW_MTU: &str = "1280";
/// Too big for NARROW_MTU, whole on the clients' 1500-byte links.
const WHOLE_DATAGRAM: usize = 1400;

/// Datagrams without DF (the clients' `ip_no_pmtu_disc`) too big for the node's link to the
/// endpoint: the node fragments them, as Linux's `ip_forward` does, in both forwarding modes. A
/// whole one and a fragmented one (each fragment too big again), from a pod to the ClusterIP and
/// from an external client to the masqueraded NodePort. Redirected as they are, the narrow link
/// would drop them; handed to the stack fully translated, a masqueraded one is a martian.
fn too_big_without_df_is_fragmented_by_the_node(forwarding: &str) -> Result<()> {
    let mut node = Node::start(2, &[], &["--forwarding", forwarding])?;
    let backend = node.topology.pod("pod-b");
    node.topology
        .node
        .ip(&["link", "set", &backend.host_interface, "mtu", NARROW_MTU])?;
    backend.ns.ip(&["link", "set", "eth0", "mtu", NARROW_MTU])?;
    let service = ServiceManifest::new("large", CLUSTER_IP, Proto::Udp, PORT, LARGE_PORT)
        .node_port(NODE_PORT)
        .endpoints([backend.ip]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let sizes = [WHOLE_DATAGRAM, LARGE_DATAGRAM];
    let server = serve_large(node.pod_ns("pod-b"), large_port(), 2 * sizes.len())?;
    let cases = clients(&node);
    for (ns, to, expected_source) in cases {
        ns.sysctl("net.ipv4.ip_no_pmtu_disc", "1")?;
        for size in sizes {
            let (seen, peer) =
                large_exchange(ns, to, size).with_context(|| format!("{size} bytes to {to}"))?;
            ensure!(seen.ip() == expected_source, "to {to}: endpoint saw {seen}");
            ensure!(peer == to, "to {to}: answer from {peer}");
        }
    }
    server.join().expect("server thread")?;
    Ok(())
}

#[test]
fn too_big_without_df_is_fragmented_by_the_node_stack() -> Result<()> {
    too_big_without_df_is_fragmented_by_the_node("stack")
}

#[test]
fn too_big_without_df_is_fragmented_by_the_node_redirect() -> Result<()> {
    too_big_without_df_is_fragmented_by_the_node("redirect")
}
