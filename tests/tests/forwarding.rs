//! `--forwarding stack` (the default: the path kube-proxy's traffic takes) against `--forwarding redirect`:
//! a netfilter FORWARD rule of the node applies to Service traffic only in the first; and
//! endpoints on the node's own address (hostNetwork) work in both, from a pod, a container and
//! outside, as under kube-proxy: the client sees the service address as its peer, the server
//! the client's own address (traffic delivered locally never reaches POSTROUTING's masquerade).
use std::net::SocketAddr;

use anyhow::{Result, ensure};
use lb_tests::{
    agent::stats_at,
    bpffs::Bpffs,
    echo::{EchoServer, Proto},
    manifests::{ServiceManifest, yaml},
    netns::Netns,
    node::{CLUSTER_IP, Node, PORT, TARGET_PORT, vip},
    paths::{assert_answered_by, check_container_to_service},
    topology::{CLIENT_IP, CONTAINER_IP, NODE_IP},
};

const NODE_PORT: u16 = 30090;
/// Connections tried through the FORWARD rule: each dropped one costs the request timeout.
const ATTEMPTS: usize = 5;

/// How many of `count` requests from `ns` to `to` are answered (each fails within its timeout).
fn answered(ns: &Netns, proto: Proto, to: SocketAddr, count: usize) -> Result<usize> {
    ns.run(move || (0..count).filter(|_| proto.request(to).is_ok()).count())
}

/// A node with pods A, B and C, the service's only endpoint pod-b, and a FORWARD rule of the
/// node dropping A → B, written by `add_rule`. Returns how many of A's requests to the service
/// were answered, after checking that C's are (the rule is A's only).
fn through_forward_drop(
    proto: Proto,
    forwarding: &str,
    add_rule: impl FnOnce(&Node) -> Result<()>,
) -> Result<usize> {
    let mut node = Node::start(3, &[], &["--forwarding", forwarding])?;
    let service = node.service(proto, &["pod-b"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    add_rule(&node)?;
    let from_c = answered(node.pod_ns("pod-c"), proto, vip(), 3)?;
    ensure!(from_c == 3, "pod-c got {from_c} of 3 answers");
    answered(node.pod_ns("pod-a"), proto, vip(), ATTEMPTS)
}

fn iptables_drop(proto: Proto) -> impl FnOnce(&Node) -> Result<()> {
    move |node| {
        let (a, b) = (node.ip("pod-a").to_string(), node.ip("pod-b").to_string());
        let out = node.topology.node.exec(
            "iptables",
            &[
                "-A",
                "FORWARD",
                "-p",
                proto.rule_name(),
                "-s",
                &a,
                "-d",
                &b,
                "-j",
                "DROP",
            ],
        )?;
        ensure!(out.status.success(), "iptables: {out:?}");
        Ok(())
    }
}

fn nft_drop(proto: Proto) -> impl FnOnce(&Node) -> Result<()> {
    move |node| {
        let (a, b) = (node.ip("pod-a"), node.ip("pod-b"));
        let rule = format!(
            "add rule inet lbtest forward ip saddr {a} ip daddr {b} meta l4proto {} drop",
            proto.rule_name()
        );
        for command in [
            "add table inet lbtest",
            "add chain inet lbtest forward { type filter hook forward priority 0 ; }",
            &rule,
        ] {
            let out = node.topology.node.exec("nft", &[command])?;
            ensure!(out.status.success(), "nft {command}: {out:?}");
        }
        Ok(())
    }
}

#[test]
fn iptables_forward_drop_applies_to_service_traffic_tcp() -> Result<()> {
    let n = through_forward_drop(Proto::Tcp, "stack", iptables_drop(Proto::Tcp))?;
    ensure!(
        n == 0,
        "{n} of {ATTEMPTS} connections got through the FORWARD drop"
    );
    Ok(())
}

#[test]
fn iptables_forward_drop_applies_to_service_traffic_udp() -> Result<()> {
    let n = through_forward_drop(Proto::Udp, "stack", iptables_drop(Proto::Udp))?;
    ensure!(
        n == 0,
        "{n} of {ATTEMPTS} requests got through the FORWARD drop"
    );
    Ok(())
}

#[test]
fn nftables_forward_drop_applies_to_service_traffic_tcp() -> Result<()> {
    let n = through_forward_drop(Proto::Tcp, "stack", nft_drop(Proto::Tcp))?;
    ensure!(
        n == 0,
        "{n} of {ATTEMPTS} connections got through the FORWARD drop"
    );
    Ok(())
}

/// What `--forwarding redirect` is documented to do: bypass netfilter.
#[test]
fn redirect_forwarding_bypasses_a_forward_drop() -> Result<()> {
    let n = through_forward_drop(Proto::Tcp, "redirect", iptables_drop(Proto::Tcp))?;
    ensure!(n == ATTEMPTS, "{n} of {ATTEMPTS} connections answered");
    Ok(())
}

/// The service `web` at `vip()` (and NODE_PORT) whose only endpoint is the node itself, a
/// server on the node's address (hostNetwork).
///
/// The node's routes to pod-a and the container take the node address as source, as on a CNI
/// whose node-side interfaces hold no address of their own (Calico): a UDP server bound to the
/// wildcard answers from the address routing picks, and neither Linux's conntrack nor ours
/// can match an answer from another address than the endpoint's to its connection.
fn node_endpoint(proto: Proto, forwarding: &str) -> Result<(Node, EchoServer)> {
    let mut node = Node::start(2, &[], &["--forwarding", forwarding])?;
    let routes = [
        (format!("{}/32", node.ip("pod-a")), "lbpa"),
        ("172.17.0.0/16".to_owned(), "docker0"),
    ];
    for (to, dev) in &routes {
        let src = NODE_IP.to_string();
        node.topology
            .node
            .ip(&["route", "replace", to, "dev", dev, "src", &src])?;
    }
    let server = EchoServer::start(&node.topology.node, "node", TARGET_PORT)?;
    let service = ServiceManifest::new("web", CLUSTER_IP, proto, PORT, TARGET_PORT)
        .endpoints([NODE_IP])
        .node_port(NODE_PORT);
    node.agent.update_manifests(&yaml(&[service]))?;
    Ok((node, server))
}

fn check_node_endpoint(proto: Proto, forwarding: &str) -> Result<()> {
    let (node, _server) = node_endpoint(proto, forwarding)?;
    let topology = &node.topology;
    let from_pod = lb_tests::echo::requests(node.pod_ns("pod-a"), proto, vip(), 5)?;
    assert_answered_by(&from_pod, &["node"])?;
    for answer in &from_pod {
        ensure!(
            answer.seen_source.ip() == node.ip("pod-a") && answer.peer == vip(),
            "pod → ClusterIP: {answer:?}"
        );
    }
    let from_container = lb_tests::echo::requests(&topology.container, proto, vip(), 5)?;
    assert_answered_by(&from_container, &["node"])?;
    for answer in &from_container {
        ensure!(
            answer.seen_source.ip() == CONTAINER_IP && answer.peer == vip(),
            "container → ClusterIP: {answer:?}"
        );
    }
    let node_port: SocketAddr = (NODE_IP, NODE_PORT).into();
    let from_outside = lb_tests::echo::requests(&topology.client, proto, node_port, 5)?;
    assert_answered_by(&from_outside, &["node"])?;
    for answer in &from_outside {
        ensure!(
            answer.seen_source.ip() == CLIENT_IP && answer.peer == node_port,
            "external → NodePort: {answer:?}"
        );
    }
    Ok(())
}

#[test]
fn node_endpoint_tcp() -> Result<()> {
    check_node_endpoint(Proto::Tcp, "stack")
}

#[test]
fn node_endpoint_udp() -> Result<()> {
    check_node_endpoint(Proto::Udp, "stack")
}

#[test]
fn node_endpoint_tcp_redirect() -> Result<()> {
    check_node_endpoint(Proto::Tcp, "redirect")
}

#[test]
fn node_endpoint_udp_redirect() -> Result<()> {
    check_node_endpoint(Proto::Udp, "redirect")
}

/// A restart with another `--forwarding` swaps the programs into the pinned links and the mode
/// takes effect: masqueraded traffic (container → ClusterIP) keeps working, its source
/// translated by `lb_egress` in the default stack mode and no longer once redirected.
#[test]
fn a_restart_switches_the_forwarding_mode() -> Result<()> {
    let bpffs = Bpffs::mount()?;
    let mut node = Node::start(3, &[], &["--bpffs", &bpffs.arg()])?;
    let service = node.service(Proto::Tcp, &["pod-b", "pod-c"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let egress_translated =
        || -> Result<u64> { Ok(stats_at(&node.topology.node, &bpffs.arg())?["egress_translated"]) };
    check_container_to_service(&node.topology, Proto::Tcp, vip())?;
    let stacked = egress_translated()?;
    ensure!(stacked > 0, "stack mode: lb_egress translated nothing");

    let status = node.agent.stop()?;
    ensure!(status.success(), "agent exit status {status}");
    node.agent.restart(&["--forwarding", "redirect"], true)?;
    check_container_to_service(&node.topology, Proto::Tcp, vip())?;
    let redirected = egress_translated()? - stacked;
    ensure!(
        redirected == 0,
        "redirect mode: lb_egress translated {redirected}"
    );
    Ok(())
}
