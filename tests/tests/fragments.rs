//! IPv4 fragments through a real node namespace: a UDP datagram larger than the links' MTU (1500)
//! leaves the client in fragments, each is translated as it crosses the node, the endpoint
//! reassembles the datagram, and its answer, as large and fragmented by the endpoint's kernel,
//! comes back reverse-translated. Untranslated later fragments would reach the service address
//! (or the node) and the datagram would never be whole: the exchange would time out.
use std::net::{Ipv4Addr, SocketAddr};

use anyhow::{Result, ensure};
use lb_tests::{
    agent::counter,
    echo::{Proto, large_exchange, serve_large},
    manifests::{ServiceManifest, yaml},
    node::{CLUSTER_IP, Node, PORT},
    topology::{NODE_IP, POD_GATEWAY},
};

const NODE_PORT: u16 = 30080;
/// Not the echo servers' port: this service's endpoint runs `serve_large`.
const LARGE_PORT: u16 = 8090;

/// From a pod to the ClusterIP (the endpoint sees the pod) and from an external client to the
/// NodePort (masqueraded), every fragment of both directions translated by tc, and by the XDP
/// path's agent too, which hands fragments to tc.
fn fragmented_udp(agent_args: &[&str]) -> Result<()> {
    let mut node = Node::start(2, &[], agent_args)?;
    let service = ServiceManifest::new("large", CLUSTER_IP, Proto::Udp, PORT, LARGE_PORT)
        .node_port(NODE_PORT)
        .endpoints([node.ip("pod-b")]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let local = SocketAddr::from((Ipv4Addr::UNSPECIFIED, LARGE_PORT));
    let server = serve_large(node.pod_ns("pod-b"), local, 2)?;
    let pod_a = node.ip("pod-a");
    let cases = [
        (
            node.pod_ns("pod-a"),
            SocketAddr::from((CLUSTER_IP, PORT)),
            pod_a,
        ),
        (
            &node.topology.client,
            SocketAddr::from((NODE_IP, NODE_PORT)),
            POD_GATEWAY,
        ),
    ];
    for (ns, to, expected_source) in cases {
        let (seen, peer) = large_exchange(ns, to)?;
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
