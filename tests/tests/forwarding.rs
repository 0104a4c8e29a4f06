//! `--forwarding stack` (the default: the path kube-proxy's traffic takes) against `--forwarding redirect`:
//! a netfilter FORWARD rule of the node applies to Service traffic only in the first; and
//! endpoints on the node's own address (hostNetwork) work in both, from a pod, a container and
//! outside, as under kube-proxy: the client sees the service address as its peer, the server
//! the client's own address (traffic delivered locally never reaches POSTROUTING's masquerade).
use std::net::SocketAddr;

use anyhow::{Result, ensure};
use lb_tests::{
    agent::{lb_binary, stats_at},
    bpffs::Bpffs,
    echo::{EchoServer, Proto},
    manifests::{ServiceManifest, yaml},
    netns::Netns,
    node::{CLUSTER_IP, Node, PORT, TARGET_PORT, vip},
    paths::{assert_answered_by, check_container_to_service},
    topology::{CLIENT_IP, CLUSTER_CIDR, CONTAINER_IP, NODE_IP},
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
fn node_endpoint(proto: Proto, agent_args: &[&str]) -> Result<(Node, EchoServer)> {
    let mut node = Node::start(2, &[], agent_args)?;
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

fn check_node_endpoint(proto: Proto, agent_args: &[&str]) -> Result<()> {
    let (node, _server) = node_endpoint(proto, agent_args)?;
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
    check_node_endpoint(Proto::Tcp, &["--forwarding", "stack"])
}

#[test]
fn node_endpoint_udp() -> Result<()> {
    check_node_endpoint(Proto::Udp, &["--forwarding", "stack"])
}

#[test]
fn node_endpoint_tcp_redirect() -> Result<()> {
    check_node_endpoint(Proto::Tcp, &["--forwarding", "redirect"])
}

#[test]
fn node_endpoint_udp_redirect() -> Result<()> {
    check_node_endpoint(Proto::Udp, &["--forwarding", "redirect"])
}

/// With `--xdp` on the external interface: lb_xdp opens no connection, so the external
/// client's connections to the NodePort get their intermediate tuples from tc, and the node
/// endpoint's replies are translated by lb_egress.
#[test]
fn node_endpoint_tcp_xdp() -> Result<()> {
    check_node_endpoint(Proto::Tcp, &["--xdp"])
}

#[test]
fn node_endpoint_udp_xdp() -> Result<()> {
    check_node_endpoint(Proto::Udp, &["--xdp"])
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

/// Runs `iptables` in the node's namespace; fails unless it succeeds.
fn iptables(node: &Node, args: &[&str]) -> Result<String> {
    let out = node.topology.node.exec("iptables", args)?;
    ensure!(out.status.success(), "iptables {args:?}: {out:?}");
    Ok(String::from_utf8(out.stdout)?)
}

/// FORWARD's jumps to the agent's chain, as `iptables -S FORWARD` lists them.
fn forward_jumps(node: &Node) -> Result<usize> {
    Ok(iptables(node, &["-S", "FORWARD"])?
        .lines()
        .filter(|rule| rule.ends_with("-j LB-FORWARD"))
        .count())
}

/// A node whose FORWARD policy is DROP (as Docker sets it) with no rule of its own accepting pod
/// traffic, the service `web` on pod-b with NODE_PORT: kube-proxy's KUBE-FORWARD accepts its
/// masqueraded connections (marked by KUBE-MARK-MASQ), and so does the agent's LB-FORWARD.
fn forward_policy_drop(proto: Proto, agent_args: &[&str]) -> Result<Node> {
    let mut node = Node::start(3, &[], agent_args)?;
    let service = node.service(proto, &["pod-b"]).node_port(NODE_PORT);
    node.agent.update_manifests(&yaml(&[service]))?;
    iptables(&node, &["-P", "FORWARD", "DROP"])?;
    Ok(node)
}

fn check_node_port_through_forward_policy_drop(proto: Proto) -> Result<()> {
    let node = forward_policy_drop(proto, &[])?;
    let node_port: SocketAddr = (NODE_IP, NODE_PORT).into();
    let n = answered(&node.topology.client, proto, node_port, ATTEMPTS)?;
    ensure!(
        n == ATTEMPTS,
        "external → NodePort: {n} of {ATTEMPTS} answered"
    );
    // The container behind a bridge, with br_netfilter's bridge-nf-call-iptables on (as
    // kubeadm requires): netfilter's conntrack sees the packet at the bridge port, so it is
    // translated there (the port of docker0 gets the programs), not at docker0's tc ingress
    // after conntrack tracked the untranslated tuple (docs/datapath.md).
    let out = node
        .topology
        .node
        .exec("sysctl", &["-n", "net.bridge.bridge-nf-call-iptables"])?;
    ensure!(
        out.status.success() && out.stdout == b"1\n",
        "bridge-nf-call-iptables is not on: {out:?}"
    );
    let n = answered(&node.topology.container, proto, vip(), ATTEMPTS)?;
    ensure!(
        n == ATTEMPTS,
        "container → ClusterIP: {n} of {ATTEMPTS} answered"
    );
    Ok(())
}

#[test]
fn node_port_through_forward_policy_drop_tcp() -> Result<()> {
    check_node_port_through_forward_policy_drop(Proto::Tcp)
}

#[test]
fn node_port_through_forward_policy_drop_udp() -> Result<()> {
    check_node_port_through_forward_policy_drop(Proto::Udp)
}

/// As under kube-proxy: a pod's connection is not masqueraded, so not marked, and its first
/// packet is new: the FORWARD policy drops it.
#[test]
fn pod_to_cluster_ip_through_forward_policy_drop_is_dropped() -> Result<()> {
    for proto in [Proto::Tcp, Proto::Udp] {
        let node = forward_policy_drop(proto, &[])?;
        let n = answered(node.pod_ns("pod-a"), proto, vip(), 3)?;
        ensure!(n == 0, "pod → ClusterIP {proto:?}: {n} of 3 answered");
    }
    Ok(())
}

/// FORWARD policy DROP, the pod CIDR accepted by the node's own rules (as flannel adds them),
/// and a NetworkPolicy-like drop A → B before them: LB-FORWARD, first in FORWARD, accepts no
/// new unmarked packet, so the drop still stops A → ClusterIP → B (and C still gets through).
#[test]
fn forward_drop_under_policy_drop_still_applies_to_service_traffic() -> Result<()> {
    let n = through_forward_drop(Proto::Tcp, "stack", |node| {
        let (a, b) = (node.ip("pod-a").to_string(), node.ip("pod-b").to_string());
        iptables(node, &["-P", "FORWARD", "DROP"])?;
        iptables(node, &["-A", "FORWARD", "-s", &a, "-d", &b, "-j", "DROP"])?;
        iptables(node, &["-A", "FORWARD", "-s", CLUSTER_CIDR, "-j", "ACCEPT"])?;
        iptables(node, &["-A", "FORWARD", "-d", CLUSTER_CIDR, "-j", "ACCEPT"])?;
        Ok(())
    })?;
    ensure!(
        n == 0,
        "{n} of {ATTEMPTS} connections got through the FORWARD drop"
    );
    Ok(())
}

/// The agent's rules: one jump, however often it starts; they stay when it stops (the datapath
/// does), and `lb cleanup` removes them. Off with --no-forward-rules.
#[test]
fn forward_rules_are_kept_once_and_removed_by_cleanup() -> Result<()> {
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let mut node = forward_policy_drop(Proto::Tcp, &["--bpffs", &bpffs_arg])?;
    let node_port: SocketAddr = (NODE_IP, NODE_PORT).into();
    let chain = iptables(&node, &["-S", "LB-FORWARD"])?;
    for rule in [
        "-m mark --mark 0x4000/0x4000",
        "--ctstate RELATED,ESTABLISHED",
    ] {
        ensure!(chain.contains(rule), "no {rule} in LB-FORWARD:\n{chain}");
    }
    ensure!(!chain.contains("INVALID"), "LB-FORWARD:\n{chain}");
    let first = iptables(&node, &["-S", "FORWARD"])?;
    ensure!(
        first
            .lines()
            .nth(1)
            .is_some_and(|r| r.ends_with("-j LB-FORWARD")),
        "the jump is not first:\n{first}"
    );

    let status = node.agent.stop()?;
    ensure!(status.success(), "agent exit status {status}");
    ensure!(forward_jumps(&node)? == 1, "the jump went with the agent");
    node.agent
        .restart(&["--iptables-masquerade-bit", "5"], true)?;
    ensure!(forward_jumps(&node)? == 1, "{}", iptables(&node, &["-S"])?);
    let chain = iptables(&node, &["-S", "LB-FORWARD"])?;
    ensure!(
        chain.contains("--mark 0x20/0x20") && !chain.contains("0x4000"),
        "LB-FORWARD after a restart with bit 5:\n{chain}"
    );
    let n = answered(&node.topology.client, Proto::Tcp, node_port, 3)?;
    ensure!(n == 3, "with mark bit 5: {n} of 3 answered");

    let status = node.agent.stop()?;
    ensure!(status.success(), "agent exit status {status}");
    let binary = lb_binary();
    let out = node.topology.node.exec(
        &binary.to_string_lossy(),
        &["cleanup", "--bpffs", &bpffs_arg],
    )?;
    ensure!(out.status.success(), "lb cleanup: {out:?}");
    let rules = iptables(&node, &["-S"])?;
    ensure!(!rules.contains("LB-FORWARD"), "after lb cleanup:\n{rules}");

    node.agent.restart(&["--no-forward-rules"], true)?;
    let rules = iptables(&node, &["-S"])?;
    ensure!(
        !rules.contains("LB-FORWARD"),
        "with --no-forward-rules:\n{rules}"
    );
    let n = answered(&node.topology.client, Proto::Tcp, node_port, 3)?;
    ensure!(n == 0, "without the rules: {n} of 3 answered");
    Ok(())
}

/// Runs `program` in the node's namespace; fails unless it succeeds.
fn run_in_node(node: &Node, program: &str, args: &[&str]) -> Result<String> {
    let out = node.topology.node.exec(program, args)?;
    ensure!(out.status.success(), "{program} {args:?}: {out:?}");
    Ok(String::from_utf8(out.stdout)?)
}

/// A node whose rules are in iptables-legacy (kubelet's hint chain there, FORWARD policy DROP
/// there): the agent writes LB-FORWARD into iptables-legacy too, as an accept in iptables-nft
/// would not stop legacy's DROP; `lb cleanup` removes it from there.
#[test]
fn forward_rules_follow_a_node_on_iptables_legacy() -> Result<()> {
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let mut node = Node::start(3, &[], &["--bpffs", &bpffs_arg])?;
    let service = node.service(Proto::Tcp, &["pod-b"]).node_port(NODE_PORT);
    node.agent.update_manifests(&yaml(&[service]))?;
    let status = node.agent.stop()?;
    ensure!(status.success(), "agent exit status {status}");
    // What the first start wrote into iptables-nft (no legacy rules then) goes, pins too.
    let binary = lb_binary();
    let cleanup = |node: &Node| {
        run_in_node(
            node,
            &binary.to_string_lossy(),
            &["cleanup", "--bpffs", &bpffs_arg],
        )
    };
    cleanup(&node)?;
    run_in_node(
        &node,
        "iptables-legacy",
        &["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
    )?;
    run_in_node(&node, "iptables-legacy", &["-P", "FORWARD", "DROP"])?;
    node.agent.restart(&[], true)?;

    let legacy = run_in_node(&node, "iptables-legacy", &["-S", "FORWARD"])?;
    ensure!(
        legacy
            .lines()
            .nth(1)
            .is_some_and(|r| r.ends_with("-j LB-FORWARD")),
        "no jump first in iptables-legacy's FORWARD:\n{legacy}"
    );
    let nft = run_in_node(&node, "iptables-nft", &["-S"])?;
    ensure!(!nft.contains("LB-FORWARD"), "in iptables-nft too:\n{nft}");
    let node_port: SocketAddr = (NODE_IP, NODE_PORT).into();
    let n = answered(&node.topology.client, Proto::Tcp, node_port, ATTEMPTS)?;
    ensure!(
        n == ATTEMPTS,
        "external → NodePort: {n} of {ATTEMPTS} answered"
    );

    let status = node.agent.stop()?;
    ensure!(status.success(), "agent exit status {status}");
    cleanup(&node)?;
    let legacy = run_in_node(&node, "iptables-legacy", &["-S"])?;
    ensure!(
        !legacy.contains("LB-FORWARD"),
        "after lb cleanup:\n{legacy}"
    );
    Ok(())
}
