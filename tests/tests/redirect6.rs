//! IPv6 in `--forwarding redirect` and on the XDP path (issue 22): the IPv6 seed paths (pod →
//! ClusterIP → another pod, hairpin, external client → NodePort on the node's IPv6 address) over
//! TCP and UDP, redirected by `lb_ingress6` and, for the external client's packets, by `lb_xdp6`.
//! A node's `ip6tables -A FORWARD -j DROP` shows which path the packets took: redirected, they
//! never reach netfilter's FORWARD; handed to the stack (`--forwarding stack`), they are dropped
//! there, as IPv4's (forwarding.rs). A packet too big for its egress link is answered with
//! Packet Too Big about the packet as the client sent it, which path MTU discovery needs.
use std::{
    net::{IpAddr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    agent::{counter, stats_at},
    bpffs::Bpffs,
    echo::{EchoServer, Proto, six_answered},
    manifests,
    netns::Netns,
    node::{Node, PORT},
    topology::{NODE_IP_V6, POD_GATEWAY_V6, pod_ip_v6},
    transfer::{CountingServer, TRANSFER, learned_mtu, upload},
};

/// The IPv6 servers' port: the fixture's IPv4 servers hold the IPv4 target port on 0.0.0.0.
const TARGET_PORT_V6: u16 = 8093;
/// `web6`: pod-b and pod-c.
const CLUSTER_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x21);
/// `self6`: pod-a only, which reaches it through hairpin.
const HAIRPIN_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x22);
/// `np6`, a NodePort Service of pod-b and pod-c.
const NODE_PORT_CLUSTER_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x23);
const NODE_PORT: u16 = 30082;
const PODS: [&str; 3] = ["pod-a", "pod-b", "pod-c"];

/// The Services of the seed paths, IPv6-only: `web6`, `self6` and `np6`.
fn services(proto: Proto) -> Result<String> {
    let b_and_c = [pod_ip_v6(1), pod_ip_v6(2)].map(|addr| addr.to_string());
    let service = |name: &str, cluster_ip: Ipv6Addr, endpoints: &[String]| {
        let slice = format!("{name}-v6");
        manifests::ipv6_only_service(
            name,
            (cluster_ip, PORT),
            proto,
            (&slice, "IPv6", TARGET_PORT_V6),
            endpoints,
        )
    };
    let node_port =
        manifests::ipv6_node_port(&service("np6", NODE_PORT_CLUSTER_IP, &b_and_c), NODE_PORT)?;
    Ok(format!(
        "{}{}{node_port}",
        service("web6", CLUSTER_IP, &b_and_c),
        service("self6", HAIRPIN_IP, &[pod_ip_v6(0).to_string()]),
    ))
}

/// A dual-stack node of three pods with IPv6 addresses, an IPv6 external client, IPv6 servers in
/// every pod and the Services of `services`; its agent runs with `agent_args`. `prepare` runs
/// before the pods get their IPv6 addresses, so that the agent has followed what it changed by
/// the time the Services are synced.
fn node(
    proto: Proto,
    agent_args: &[&str],
    prepare: impl FnOnce(&Node) -> Result<()>,
) -> Result<(Node, Vec<EchoServer>)> {
    let mut node = Node::start_dual_stack(3, agent_args)?;
    prepare(&node)?;
    node.add_pod_ipv6()?;
    node.topology.add_external_ipv6()?;
    let servers = PODS
        .iter()
        .map(|pod| EchoServer::start_v6(node.pod_ns(pod), pod, TARGET_PORT_V6))
        .collect::<Result<Vec<_>>>()?;
    node.agent.update_manifests(&services(proto)?)?;
    Ok((node, servers))
}

/// The node drops every packet it would forward through netfilter.
fn forward_drop(node: &Node) -> Result<()> {
    let out = node
        .topology
        .node
        .exec("ip6tables", &["-A", "FORWARD", "-j", "DROP"])?;
    ensure!(out.status.success(), "ip6tables: {out:?}");
    Ok(())
}

/// The three seed paths, six requests each: who answered, the source the backend saw (pod-a's
/// own address inside the cluster, the node's address routing picks towards the pods when
/// masqueraded: hairpin and NodePort), the peer the client saw (the service address).
fn check_seed_paths(node: &Node, proto: Proto) -> Result<()> {
    let pod_a = node.pod_ns("pod-a");
    let masqueraded = IpAddr::V6(POD_GATEWAY_V6);
    six_answered(
        pod_a,
        proto,
        (CLUSTER_IP, PORT).into(),
        &["pod-b", "pod-c"],
        IpAddr::V6(pod_ip_v6(0)),
    )
    .context("pod-a → ClusterIP")?;
    six_answered(
        pod_a,
        proto,
        (HAIRPIN_IP, PORT).into(),
        &["pod-a"],
        masqueraded,
    )
    .context("hairpin")?;
    six_answered(
        &node.topology.client,
        proto,
        (NODE_IP_V6, NODE_PORT).into(),
        &["pod-b", "pod-c"],
        masqueraded,
    )
    .context("external client → NodePort")
}

/// `--forwarding redirect`: every seed path is served through the node's FORWARD drop, none of
/// its packets handed to the stack (`fib_fallback`).
fn redirect_seed_paths(proto: Proto) -> Result<()> {
    let (node, _servers) = node(proto, &["--forwarding", "redirect"], |_| Ok(()))?;
    forward_drop(&node)?;
    check_seed_paths(&node, proto)?;
    let fallback = counter(&node.topology.node, "fib_fallback")?;
    ensure!(fallback == 0, "{fallback} packets handed to the stack");
    Ok(())
}

#[test]
fn redirect_ipv6_seed_paths_tcp() -> Result<()> {
    redirect_seed_paths(Proto::Tcp)
}

#[test]
fn redirect_ipv6_seed_paths_udp() -> Result<()> {
    redirect_seed_paths(Proto::Udp)
}

/// A node of `node` whose agent runs with `--xdp` and `extra`, its links ready for the fast path.
fn xdp_node(proto: Proto, extra: &[&str]) -> Result<(Node, Vec<EchoServer>)> {
    let args = [&["--xdp"], extra].concat();
    node(proto, &args, |node| node.topology.prepare_xdp_fast_path())
}

/// `--xdp`: every seed path is served through the node's FORWARD drop, and the external
/// client's packets to the NodePort were forwarded by `lb_xdp6` (`xdp_forwarded`; the pods'
/// own packets enter through their veths, tc's).
fn xdp_seed_paths(proto: Proto) -> Result<()> {
    let (node, _servers) = xdp_node(proto, &[])?;
    forward_drop(&node)?;
    check_seed_paths(&node, proto)?;
    let ns = &node.topology.node;
    let (forwarded, fallback) = (counter(ns, "xdp_forwarded")?, counter(ns, "fib_fallback")?);
    // At least one packet of each of the six requests (UDP: the request), but for a first
    // packet to a backend the agent's XDP_EGRESS had not listed yet.
    ensure!(
        forwarded >= 4,
        "XDP forwarded {forwarded} packets of 6 NodePort requests"
    );
    ensure!(fallback == 0, "{fallback} packets handed to the stack");
    Ok(())
}

#[test]
fn xdp_ipv6_seed_paths_tcp() -> Result<()> {
    xdp_seed_paths(Proto::Tcp)
}

#[test]
fn xdp_ipv6_seed_paths_udp() -> Result<()> {
    xdp_seed_paths(Proto::Udp)
}

/// `lb_xdp6` outlives the agent, as `lb_xdp` does: after SIGTERM, with its pins on a bpffs that
/// outlives it, the NodePort on the node's IPv6 address still answers through XDP (the program
/// array `LB_XDP_IPV6_PROGRAMS_V1` is pinned: unpinned, it would be emptied with the agent's
/// last reference, and every IPv6 frame passed to tc).
#[test]
fn xdp_ipv6_outlives_the_agent() -> Result<()> {
    let bpffs = Bpffs::mount()?;
    let (mut node, _servers) = xdp_node(Proto::Udp, &["--bpffs", &bpffs.arg()])?;
    let node_port = (NODE_IP_V6, NODE_PORT).into();
    let check = |node: &Node| {
        let servers = ["pod-b", "pod-c"];
        six_answered(
            &node.topology.client,
            Proto::Udp,
            node_port,
            &servers,
            IpAddr::V6(POD_GATEWAY_V6),
        )
    };
    let forwarded = |node: &Node| -> Result<u64> {
        Ok(stats_at(&node.topology.node, &bpffs.arg())?["xdp_forwarded"])
    };
    check(&node)?;
    let before = forwarded(&node)?;
    let status = node.agent.stop()?;
    ensure!(status.success(), "agent exit status {status}");
    check(&node).context("the NodePort after SIGTERM")?;
    let after = forwarded(&node)? - before;
    ensure!(
        after >= 6,
        "XDP forwarded {after} of 6 requests after SIGTERM"
    );
    Ok(())
}

/// How many of `count` requests from `ns` to `to` are answered (each fails within its timeout).
fn answered(ns: &Netns, proto: Proto, to: SocketAddr, count: usize) -> Result<usize> {
    ns.run(move || (0..count).filter(|_| proto.request(to).is_ok()).count())
}

/// `--forwarding stack`: pod → ClusterIP → pod is forwarded by the stack, so the node's FORWARD
/// drop applies to it, as to IPv4's (kube-proxy's traffic takes the same path).
fn stack_mode_honours_a_forward_drop(proto: Proto) -> Result<()> {
    let (node, _servers) = node(proto, &["--forwarding", "stack"], |_| Ok(()))?;
    let to = (CLUSTER_IP, PORT).into();
    let pod_a = node.pod_ns("pod-a");
    let before = answered(pod_a, proto, to, 3)?;
    ensure!(
        before == 3,
        "{before} of 3 answered before the FORWARD drop"
    );
    forward_drop(&node)?;
    let after = answered(pod_a, proto, to, 3)?;
    ensure!(after == 0, "{after} of 3 answered through the FORWARD drop");
    Ok(())
}

#[test]
fn stack_mode_honours_an_ipv6_forward_drop_tcp() -> Result<()> {
    stack_mode_honours_a_forward_drop(Proto::Tcp)
}

#[test]
fn stack_mode_honours_an_ipv6_forward_drop_udp() -> Result<()> {
    stack_mode_honours_a_forward_drop(Proto::Udp)
}

/// IPv6's minimum link MTU, below the 1500 of every other link.
const NARROW_MTU: u32 = 1280;
/// A transfer that PMTU discovery lets through takes milliseconds; one that waits for
/// retransmissions takes seconds.
const PROMPT: Duration = Duration::from_secs(3);

/// `--forwarding redirect`: pod-a uploads to a ClusterIP whose backend, pod-b, sits behind the
/// node's end of its veth set to MTU 1280 (pod-b's end keeps 1500, so that its MSS does not
/// reveal the narrow link). The node bypasses the stack, so `lb_ingress6` answers the too big
/// segments with Packet Too Big quoting them as pod-a sent them (to the ClusterIP): pod-a learns
/// MTU 1280 towards the ClusterIP and the upload finishes promptly. The stack's own Packet Too
/// Big would quote the translated packet, which pod-a cannot match to its socket.
#[test]
fn redirect_answers_too_big_ipv6_packets_with_packet_too_big() -> Result<()> {
    let (mut node, _servers) = node(Proto::Tcp, &["--forwarding", "redirect"], |_| Ok(()))?;
    let pod_b = node.topology.pod("pod-b");
    let mtu = NARROW_MTU.to_string();
    node.topology
        .node
        .exec("ip", &["link", "set", &pod_b.host_interface, "mtu", &mtu])?;
    let _counting = CountingServer::start(
        &pod_b.ns,
        (Ipv6Addr::UNSPECIFIED, TARGET_PORT_V6 + 1).into(),
    )?;
    let service = manifests::ipv6_only_service(
        "upload6",
        (CLUSTER_IP, PORT),
        Proto::Tcp,
        ("upload6-v6", "IPv6", TARGET_PORT_V6 + 1),
        &[pod_ip_v6(1).to_string()],
    );
    node.agent.update_manifests(&service)?;
    let client = node.pod_ns("pod-a");
    let to: SocketAddr = (CLUSTER_IP, PORT).into();
    let took = upload(client, to).context("pod-a's upload to the ClusterIP")?;
    ensure!(took < PROMPT, "{TRANSFER} bytes took {took:?}");
    let learned = learned_mtu(client, CLUSTER_IP.into())?;
    ensure!(
        learned == Some(NARROW_MTU),
        "path MTU towards {to} {learned:?}, expected {NARROW_MTU}"
    );
    let answered = counter(&node.topology.node, "fragmentation_needed")?;
    ensure!(answered >= 1, "fragmentation_needed: {answered}");
    Ok(())
}
