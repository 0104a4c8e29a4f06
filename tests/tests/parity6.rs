//! kube-proxy parity over IPv6 (issue 22): the parity table's rows for IPv6 Services, through a
//! real node namespace with real sockets, as parity.rs and external_addresses.rs for IPv4.
use std::{
    io::ErrorKind,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Result, bail, ensure};
use lb_tests::{
    agent::counter,
    echo::{EchoServer, Proto, error_kind, refusal, request},
    manifests::{endpoint_lines, ipv6_service_head},
    netns::Netns,
    node::{Node, PORT},
    topology::{EXTERNAL_INTERFACE, NODE_IP_V6, POD_GATEWAY_V6, mac, pod_ip_v6},
};

/// The REJECT tests' IPv6-only ClusterIP.
const REJECT_CLUSTER_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x30);
/// The source range tests' IPv6-only LoadBalancer: its ClusterIP and ingress IP.
const RANGES_CLUSTER_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x31);
const RANGES_LB_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 0x20);
/// The external client's address inside the source ranges, and a second one outside them.
const RANGES_CLIENT_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 2);
const RANGES_OTHER_CLIENT_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 4);
/// The pods' IPv6 servers: the fixture's IPv4 servers hold the target port on 0.0.0.0.
const RANGES_TARGET_PORT: u16 = 8093;
/// A rejected connection fails well before any timeout.
const FAST: Duration = Duration::from_millis(500);
/// A rejected TCP connection: the SYN's retransmission (after 1 s) at the latest. In this
/// topology the error about the first SYN reaches the pod while connect() still holds the socket
/// (the veths deliver in the sender's own softirq), and the kernel drops it
/// (TcpExtLockDroppedIcmps); the retransmission's error refuses the connection. Still well within
/// the connect timeout, which is what a dropped SYN would take.
const TCP_REFUSED_WITHIN: Duration = Duration::from_millis(1500);

/// A node of `pods` pods with both families' --node-ip and --cluster-cidr, the pods holding
/// their IPv6 addresses too.
fn dual_stack_node(pods: usize) -> Result<Node> {
    let mut node = Node::start_dual_stack(pods, &[])?;
    node.add_pod_ipv6()?;
    Ok(node)
}

/// An IPv6-only Service `name` on `cluster_ip`:PORT, TCP and UDP, with `spec` lines and `status`
/// added, and an IPv6 EndpointSlice of ready `endpoints` on `target_port`.
fn ipv6_service(
    name: &str,
    cluster_ip: Ipv6Addr,
    (spec, status): (&str, &str),
    endpoints: &[Ipv6Addr],
    target_port: u16,
) -> String {
    let endpoints = if endpoints.is_empty() {
        " []\n".to_string()
    } else {
        format!("\n{}", endpoint_lines(endpoints))
    };
    let head = ipv6_service_head(name, cluster_ip);
    format!(
        "{head}{spec}  ports:
    - name: tcp
      protocol: TCP
      port: {PORT}
      targetPort: {target_port}
    - name: udp
      protocol: UDP
      port: {PORT}
      targetPort: {target_port}
{status}---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-v6
  namespace: default
  labels:
    kubernetes.io/service-name: {name}
addressType: IPv6
ports:
  - name: tcp
    protocol: TCP
    port: {target_port}
  - name: udp
    protocol: UDP
    port: {target_port}
endpoints:{endpoints}"
    )
}

fn assert_refused(ns: &Netns, proto: Proto, to: SocketAddr) -> Result<()> {
    let (kind, took) = refusal(ns, proto, to)?;
    let within = match proto {
        Proto::Udp => FAST,
        Proto::Tcp => TCP_REFUSED_WITHIN,
    };
    ensure!(
        kind == ErrorKind::ConnectionRefused && took < within,
        "{proto:?} to {to}: {kind:?} after {took:?}, expected ECONNREFUSED within {within:?}"
    );
    Ok(())
}

/// REJECT over IPv6: an IPv6 ClusterIP whose Service has no endpoints answers a pod's new
/// connections with ICMPv6 port unreachable (TCP and UDP), and so does a port it does not define.
/// Without the datapath's answer the connection times out (the node has no route for the
/// ClusterIP, and answers another unreachable): ECONNREFUSED at once shows the reject.
#[test]
fn ipv6_no_endpoints_and_undefined_ports_are_rejected() -> Result<()> {
    let mut node = dual_stack_node(1)?;
    node.agent.update_manifests(&ipv6_service(
        "empty6",
        REJECT_CLUSTER_IP,
        ("  type: ClusterIP\n", ""),
        &[],
        RANGES_TARGET_PORT,
    ))?;
    let pod = node.pod_ns("pod-a");
    for proto in [Proto::Tcp, Proto::Udp] {
        assert_refused(pod, proto, (REJECT_CLUSTER_IP, PORT).into())?;
        assert_refused(pod, proto, (REJECT_CLUSTER_IP, PORT + 1).into())?;
    }
    let rejected = counter(&node.topology.node, "rejected")?;
    ensure!(rejected >= 4, "rejected: {rejected}");
    Ok(())
}

/// Gives the external link IPv6 (NODE_IP_V6 on the node's side, both client addresses on the
/// client's, static neighbours), and routes the load balancer's prefix to the node from
/// `source`.
fn external_ipv6(node: &Node) -> Result<()> {
    let (host, client) = (&node.topology.node, &node.topology.client);
    let nodad = |ns: &Netns, addr: Ipv6Addr, dev: &str| {
        ns.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{addr}/64"),
            "dev",
            dev,
            "nodad",
        ])
    };
    nodad(host, NODE_IP_V6, EXTERNAL_INTERFACE)?;
    nodad(client, RANGES_CLIENT_IP, "eth0")?;
    nodad(client, RANGES_OTHER_CLIENT_IP, "eth0")?;
    let (host_mac, client_mac) = (mac(host, EXTERNAL_INTERFACE)?, mac(client, "eth0")?);
    for addr in [RANGES_CLIENT_IP, RANGES_OTHER_CLIENT_IP] {
        let addr = addr.to_string();
        host.ip(&[
            "-6",
            "neigh",
            "add",
            &addr,
            "lladdr",
            &client_mac,
            "dev",
            EXTERNAL_INTERFACE,
        ])?;
    }
    let node_ip = NODE_IP_V6.to_string();
    client.ip(&[
        "-6", "neigh", "add", &node_ip, "lladdr", &host_mac, "dev", "eth0",
    ])
}

/// The client sends the load balancer's prefix to the node, from `source`.
fn route_lb_to_node(client: &Netns, source: Ipv6Addr) -> Result<()> {
    client.ip(&[
        "-6",
        "route",
        "replace",
        &format!("{RANGES_LB_IP}/64"),
        "via",
        &NODE_IP_V6.to_string(),
        "src",
        &source.to_string(),
    ])
}

/// loadBalancerSourceRanges over IPv6: the IPv6 load balancer IP serves a client inside the
/// ranges (masqueraded: the backend sees the node's address towards the pods) and drops one
/// outside (no answer at all, counted `drop_source_range`).
#[test]
fn ipv6_load_balancer_source_ranges_drop_other_sources() -> Result<()> {
    let mut node = dual_stack_node(1)?;
    external_ipv6(&node)?;
    let _server = EchoServer::start_v6(node.pod_ns("pod-a"), "pod-a", RANGES_TARGET_PORT)?;
    let spec = format!(
        "  type: LoadBalancer\n  loadBalancerSourceRanges: [\"{RANGES_CLIENT_IP}/128\", \"2001:db8:200::/48\"]\n"
    );
    let status =
        format!("status:\n  loadBalancer:\n    ingress:\n      - ip: \"{RANGES_LB_IP}\"\n");
    node.agent.update_manifests(&ipv6_service(
        "ranges6",
        RANGES_CLUSTER_IP,
        (&spec, &status),
        &[pod_ip_v6(0)],
        RANGES_TARGET_PORT,
    ))?;
    let client = &node.topology.client;
    let lb: SocketAddr = (RANGES_LB_IP, PORT).into();

    route_lb_to_node(client, RANGES_CLIENT_IP)?;
    let answer = request(client, Proto::Tcp, lb)?;
    answer.check(&["pod-a"], IpAddr::V6(POD_GATEWAY_V6), lb)?;

    route_lb_to_node(client, RANGES_OTHER_CLIENT_IP)?;
    let before = counter(&node.topology.node, "drop_source_range")?;
    match request(client, Proto::Tcp, lb) {
        Ok(answer) => bail!("{RANGES_OTHER_CLIENT_IP} answered: {answer:?}"),
        Err(err) => ensure!(
            error_kind(&err) == Some(ErrorKind::TimedOut),
            "{RANGES_OTHER_CLIENT_IP}: {err:#}, expected a silent drop"
        ),
    }
    let dropped = counter(&node.topology.node, "drop_source_range")? - before;
    ensure!(dropped >= 1, "drop_source_range grew by {dropped}");
    Ok(())
}
