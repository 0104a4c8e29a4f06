//! spec.externalIPs, status.loadBalancer.ingress and loadBalancerSourceRanges, from an external
//! client through a node namespace with real sockets. As with kube-proxy, the node does not hold
//! these addresses: the client routes them to the node, and the datapath translates them at tc
//! ingress, before the node's routing would have to know them.
use std::{
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddr},
};

use anyhow::{Result, bail, ensure};
use lb_tests::{
    agent::counter,
    echo::{Answer, Proto, error_kind, request, requests},
    manifests::{EndpointManifest, IngressManifest, ServiceManifest, yaml},
    netns::Netns,
    node::{Node, PORT, TARGET_PORT},
    topology::{CLIENT_IP, NODE_IP, POD_GATEWAY},
};

const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
const PROXY_LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 30);
const LOCAL_EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 11);
const LOCAL_LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 21);
/// A second client address, outside the source ranges.
const OTHER_CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 4);
const NODE_NAME: &str = "node-1";
const AGENT_ARGS: &[&str] = &["--hostname-override", NODE_NAME];

fn vip(ip: Ipv4Addr) -> SocketAddr {
    (ip, PORT).into()
}

fn via_ip(ip: Ipv4Addr) -> IngressManifest {
    IngressManifest {
        ip,
        ip_mode: Some("VIP"),
    }
}

/// The client sends 203.0.113.0/24 to the node, from `source`.
fn route_to_node(client: &Netns, source: Ipv4Addr) -> Result<()> {
    client.ip(&[
        "route",
        "replace",
        "203.0.113.0/24",
        "via",
        &NODE_IP.to_string(),
        "src",
        &source.to_string(),
    ])
}

fn ensure_answer(answer: &Answer, to: SocketAddr, server: &str, seen: Ipv4Addr) -> Result<()> {
    ensure!(
        answer.server == server && answer.seen_source.ip() == seen && answer.peer == to,
        "{to}: {answer:?}, expected {server} seeing {seen}"
    );
    Ok(())
}

/// externalIPs and VIP-mode ingress IPs answer like the NodePort: masqueraded to the node's
/// pod-side address, which routing picks towards the pods (externalTrafficPolicy Cluster), or with the client's address from this node's endpoints only
/// (Local). From a pod, as in kube-proxy: Cluster masquerades too, Local uses every endpoint
/// and keeps the pod's address. An ipMode Proxy ingress IP is not programmed, so the node, which
/// has no route for it, does not serve it.
#[test]
fn external_and_load_balancer_ips_follow_the_external_traffic_policy() -> Result<()> {
    let services = |node: &Node| {
        [
            node.service(Proto::Tcp, &["pod-a"])
                .node_port(30080)
                .external_ips([EXTERNAL_IP])
                .load_balancer([
                    via_ip(LB_IP),
                    IngressManifest {
                        ip: PROXY_LB_IP,
                        ip_mode: Some("Proxy"),
                    },
                ]),
            ServiceManifest::new(
                "web-local",
                Ipv4Addr::new(10, 96, 0, 11),
                Proto::Tcp,
                PORT,
                TARGET_PORT,
            )
            .node_port(30081)
            .external_local(31000)
            .external_ips([LOCAL_EXTERNAL_IP])
            .load_balancer([IngressManifest {
                ip: LOCAL_LB_IP,
                ip_mode: None,
            }])
            .endpoint(EndpointManifest::ready(node.ip("pod-a")).on_node("node-2"))
            .endpoint(EndpointManifest::ready(node.ip("pod-b")).on_node(NODE_NAME)),
        ]
    };
    // The pod addresses are known once the topology exists: start, then write the services.
    let mut node = Node::start(3, &[], AGENT_ARGS)?;
    node.agent.update_manifests(&yaml(&services(&node)))?;
    let client = &node.topology.client;
    route_to_node(client, CLIENT_IP)?;

    for ip in [EXTERNAL_IP, LB_IP] {
        let answer = request(client, Proto::Tcp, vip(ip))?;
        ensure_answer(&answer, vip(ip), "pod-a", POD_GATEWAY)?;
    }
    for ip in [LOCAL_EXTERNAL_IP, LOCAL_LB_IP] {
        for answer in requests(client, Proto::Tcp, vip(ip), 6)? {
            ensure_answer(&answer, vip(ip), "pod-b", CLIENT_IP)?;
        }
    }
    let pod = node.pod_ns("pod-c");
    let pod_ip = node.ip("pod-c");
    for ip in [EXTERNAL_IP, LB_IP] {
        let answer = request(pod, Proto::Tcp, vip(ip))?;
        ensure_answer(&answer, vip(ip), "pod-a", POD_GATEWAY)?;
    }
    for ip in [LOCAL_EXTERNAL_IP, LOCAL_LB_IP] {
        // 16 random picks between pod-a and pod-b all miss one with a chance of 1 in 32768.
        let answers = requests(pod, Proto::Tcp, vip(ip), 16)?;
        for server in ["pod-a", "pod-b"] {
            let answer = answers.iter().find(|a| a.server == server);
            let Some(answer) = answer else {
                bail!("{ip} from a pod: {server} never answered: {answers:?}");
            };
            ensure_answer(answer, vip(ip), server, pod_ip)?;
        }
    }
    match request(client, Proto::Tcp, vip(PROXY_LB_IP)) {
        Ok(answer) => bail!("ipMode Proxy address answered: {answer:?}"),
        Err(err) => ensure!(
            matches!(
                error_kind(&err),
                Some(ErrorKind::NetworkUnreachable | ErrorKind::HostUnreachable)
            ),
            "{err:#}: expected the node's 'no route'"
        ),
    }
    Ok(())
}

/// A connection from `source` in `ns` to the load balancer IP gets no answer at all, and
/// `drop_source_range` counts it.
fn ensure_dropped(node: &Node, ns: &Netns, source: Ipv4Addr) -> Result<()> {
    let before = counter(&node.topology.node, "drop_source_range")?;
    match request(ns, Proto::Tcp, vip(LB_IP)) {
        Ok(answer) => bail!("{source} answered: {answer:?}"),
        Err(err) => ensure!(
            error_kind(&err) == Some(ErrorKind::TimedOut),
            "{source}: {err:#}, expected a silent drop"
        ),
    }
    let dropped = counter(&node.topology.node, "drop_source_range")? - before;
    // The SYN and its retransmissions within the connect timeout.
    ensure!(
        dropped >= 1,
        "{source}: drop_source_range grew by {dropped}"
    );
    Ok(())
}

/// loadBalancerSourceRanges: the load balancer IP serves a source inside them and drops one
/// outside (no answer at all), a pod outside them included (kube-proxy's firewall chain also
/// filters forwarded traffic); the externalIP and the NodePort of the same service are not
/// restricted, as in kube-proxy.
#[test]
fn load_balancer_source_ranges_drop_other_sources() -> Result<()> {
    let mut node = Node::start(2, &[], AGENT_ARGS)?;
    let service = node
        .service(Proto::Tcp, &["pod-a"])
        .node_port(30080)
        .external_ips([EXTERNAL_IP])
        .load_balancer([via_ip(LB_IP)])
        .source_ranges(&[&format!("{CLIENT_IP}/32"), "192.0.2.0/24"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let client = &node.topology.client;
    client.ip(&[
        "addr",
        "add",
        &format!("{OTHER_CLIENT_IP}/24"),
        "dev",
        "eth0",
    ])?;

    route_to_node(client, CLIENT_IP)?;
    let answer = request(client, Proto::Tcp, vip(LB_IP))?;
    ensure_answer(&answer, vip(LB_IP), "pod-a", POD_GATEWAY)?;

    route_to_node(client, OTHER_CLIENT_IP)?;
    ensure_dropped(&node, client, OTHER_CLIENT_IP)?;
    ensure_dropped(&node, node.pod_ns("pod-b"), node.ip("pod-b"))?;
    let answer = request(client, Proto::Tcp, vip(EXTERNAL_IP))?;
    ensure_answer(&answer, vip(EXTERNAL_IP), "pod-a", POD_GATEWAY)?;
    let node_port: SocketAddr = (NODE_IP, 30080).into();
    let answer = request(client, Proto::Tcp, node_port)?;
    ensure!(answer.server == "pod-a", "{answer:?}");
    Ok(())
}
