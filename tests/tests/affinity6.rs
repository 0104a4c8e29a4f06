//! IPv6 parity of backend selection (issue 22): sessionAffinity ClientIP, keyed by the client's
//! IPv6 address, the schedulers by annotation, and the endpoint lists (internalTrafficPolicy
//! Local, terminating endpoints), through a dual-stack node whose pods have IPv6 addresses, with
//! real sockets, as parity.rs checks them over IPv4. Every answer is also checked for who
//! answered, the source the backend saw and the peer the client saw.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Result, ensure};
use lb_tests::{
    echo::{Answer, EchoServer, Proto, requests},
    manifests::{EndpointManifest, ServiceManifest},
    node::{CLUSTER_IP, Node, PORT},
};

const CLUSTER_IP_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x11);
/// The IPv6 servers' port: the fixture's IPv4 servers hold TARGET_PORT on 0.0.0.0, which a
/// server on [::] of the same port would clash with.
const TARGET_PORT_V6: u16 = 8092;
/// The endpoints; pod-a and pod-e are the clients.
const SERVERS: [&str; 3] = ["pod-b", "pod-c", "pod-d"];

fn service() -> SocketAddr {
    (CLUSTER_IP_V6, PORT).into()
}

const NODE_NAME: &str = "node-1";
const OTHER_NODE: &str = "node-2";

/// A dual-stack node `NODE_NAME` of five pods with IPv6 addresses, SERVERS serving on
/// TARGET_PORT_V6.
fn ipv6_node() -> Result<(Node, Vec<EchoServer>)> {
    let mut node = Node::start_dual_stack(5, &["--hostname-override", NODE_NAME])?;
    node.add_pod_ipv6()?;
    let servers = SERVERS
        .iter()
        .map(|pod| EchoServer::start_v6(node.pod_ns(pod), pod, TARGET_PORT_V6))
        .collect::<Result<Vec<_>>>()?;
    Ok((node, servers))
}

/// Service `web`, IPv6-only on CLUSTER_IP_V6:PORT, SERVERS its endpoints.
fn web(node: &Node, proto: Proto) -> ServiceManifest {
    ServiceManifest::new("web", CLUSTER_IP, proto, PORT, TARGET_PORT_V6)
        .endpoints(SERVERS.iter().map(|pod| node.ip(pod)))
}

/// Applies the service `service` makes for the node, made IPv6-only.
fn apply(node: &mut Node, service: impl FnOnce(&Node) -> ServiceManifest) -> Result<()> {
    let yaml = service(node).yaml_ipv6(CLUSTER_IP_V6, |ip| node.ipv6_of(ip));
    node.agent.update_manifests(&yaml)
}

/// `count` `proto` requests from `pod` to the service, each checked: one of SERVERS answered,
/// seeing the pod's own IPv6 address (no masquerade inside the cluster CIDR), seen as the
/// service.
fn ask(node: &Node, pod: &str, proto: Proto, count: usize) -> Result<Vec<Answer>> {
    let answers = requests(node.pod_ns(pod), proto, service(), count)?;
    let source = IpAddr::V6(node.ipv6_of(node.ip(pod)));
    for answer in &answers {
        answer.check(&SERVERS, source, service())?;
    }
    Ok(answers)
}

fn distinct_servers(answers: &[Answer]) -> BTreeSet<&str> {
    answers.iter().map(|a| a.server.as_str()).collect()
}

/// sessionAffinity ClientIP over IPv6, TCP and UDP: every new connection of a client goes to
/// one endpoint, and another client's to one as well; switched off on the live service, they
/// spread again.
#[test]
fn ipv6_session_affinity_client_ip() -> Result<()> {
    let (mut node, _servers) = ipv6_node()?;
    for proto in [Proto::Tcp, Proto::Udp] {
        apply(&mut node, |n| web(n, proto).session_affinity(10800))?;
        for client in ["pod-a", "pod-e"] {
            let answers = ask(&node, client, proto, 30)?;
            ensure!(
                distinct_servers(&answers).len() == 1,
                "{proto:?} affinity of {client}: {:?}",
                distinct_servers(&answers)
            );
        }
        apply(&mut node, |n| web(n, proto))?;
        let answers = ask(&node, "pod-a", proto, 30)?;
        // Without affinity, 30 uniform choices over 3 all landing on one endpoint: p = 3^-29.
        ensure!(
            distinct_servers(&answers).len() > 1,
            "{proto:?}: affinity switched off"
        );
    }
    Ok(())
}

/// sessionAffinity's timeout over IPv6: with 1 s, a client's connections stick, and after more
/// than the timeout idle it may land elsewhere.
#[test]
fn ipv6_session_affinity_expires() -> Result<()> {
    let (mut node, _servers) = ipv6_node()?;
    apply(&mut node, |n| web(n, Proto::Tcp).session_affinity(1))?;
    let sticky = ask(&node, "pod-a", Proto::Tcp, 20)?;
    ensure!(distinct_servers(&sticky).len() == 1, "affinity switched on");
    // 10 rounds of one connection each after 1.3 s idle: all on one endpoint has p = 3^-9.
    let mut after_idle = BTreeSet::new();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(1300));
        after_idle.insert(ask(&node, "pod-a", Proto::Tcp, 1)?.remove(0).server);
    }
    ensure!(
        after_idle.len() > 1,
        "affinity outlived its timeout: {after_idle:?}"
    );
    Ok(())
}

/// Schedulers by annotation over IPv6: rr takes the endpoints in turn (30 connections, 10
/// each), sh keeps each client on one endpoint, maglev spreads flows.
#[test]
fn ipv6_schedulers_by_annotation() -> Result<()> {
    let (mut node, _servers) = ipv6_node()?;
    let scheduled =
        |node: &Node, name| web(node, Proto::Tcp).annotation("lb.kubernetes.io/scheduler", name);
    apply(&mut node, |n| scheduled(n, "rr"))?;
    let answers = ask(&node, "pod-a", Proto::Tcp, 30)?;
    for pod in SERVERS {
        let n = answers.iter().filter(|a| a.server == pod).count();
        ensure!(n == 10, "round robin gave {pod} {n} of 30");
    }
    apply(&mut node, |n| scheduled(n, "sh"))?;
    for client in ["pod-a", "pod-e"] {
        let answers = ask(&node, client, Proto::Tcp, 20)?;
        ensure!(
            distinct_servers(&answers).len() == 1,
            "source hash of {client}: {:?}",
            distinct_servers(&answers)
        );
    }
    apply(&mut node, |n| scheduled(n, "maglev"))?;
    let answers = ask(&node, "pod-a", Proto::Tcp, 60)?;
    ensure!(
        distinct_servers(&answers).len() == 3,
        "maglev spreads flows: {:?}",
        distinct_servers(&answers)
    );
    Ok(())
}

/// An endpoint of `pod` that EndpointSlices place on `node_name`.
fn on(node: &Node, pod: &str, node_name: &str) -> EndpointManifest {
    EndpointManifest::ready(node.ip(pod)).on_node(node_name)
}

/// internalTrafficPolicy Local over IPv6: pods reach only the endpoints on their node.
#[test]
fn ipv6_internal_traffic_policy_local() -> Result<()> {
    let (mut node, _servers) = ipv6_node()?;
    apply(&mut node, |n| {
        ServiceManifest::new("web", CLUSTER_IP, Proto::Udp, PORT, TARGET_PORT_V6)
            .internal_local()
            .endpoint(on(n, "pod-b", NODE_NAME))
            .endpoint(on(n, "pod-c", OTHER_NODE))
    })?;
    let answers = ask(&node, "pod-a", Proto::Udp, 20)?;
    ensure!(
        distinct_servers(&answers) == BTreeSet::from(["pod-b"]),
        "{:?}",
        distinct_servers(&answers)
    );
    Ok(())
}

/// Terminating endpoints over IPv6: while none is ready, serving terminating ones get the
/// traffic (not the terminating ones that stopped serving); a ready one takes over at once.
#[test]
fn ipv6_terminating_endpoints_are_a_fallback() -> Result<()> {
    let (mut node, _servers) = ipv6_node()?;
    let terminating = |n: &Node| {
        ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT_V6)
            .endpoint(EndpointManifest::terminating(n.ip("pod-b"), true))
            .endpoint(EndpointManifest::terminating(n.ip("pod-c"), false))
    };
    apply(&mut node, terminating)?;
    let answers = ask(&node, "pod-a", Proto::Tcp, 20)?;
    ensure!(distinct_servers(&answers) == BTreeSet::from(["pod-b"]));
    apply(&mut node, |n| {
        terminating(n).endpoint(EndpointManifest::ready(n.ip("pod-d")))
    })?;
    let answers = ask(&node, "pod-a", Proto::Tcp, 20)?;
    ensure!(distinct_servers(&answers) == BTreeSet::from(["pod-d"]));
    Ok(())
}
