//! kube-proxy parity, beyond the four paths: each Service field and behaviour a kube-proxy user
//! relies on, through a real node namespace with real sockets.
use std::{
    collections::BTreeSet,
    io::ErrorKind,
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    echo::{Answer, Proto, refusal, request, requests},
    manifests::{EndpointManifest, ServiceManifest, yaml},
    netns::Netns,
    node::{CLUSTER_IP, Node, PORT, TARGET_PORT, vip},
    topology::{CLIENT_IP, NODE_IP},
};

const NODE_PORT: u16 = 30080;
/// A rejected connection fails well before any timeout.
const FAST: Duration = Duration::from_millis(500);
const NODE_NAME: &str = "node-1";
const OTHER_NODE: &str = "node-2";
const HEALTH_PORT: u16 = 31000;
/// The agent knows which node it is on.
const AGENT_ARGS: &[&str] = &["--hostname-override", NODE_NAME];

fn assert_refused(ns: &Netns, proto: Proto, to: SocketAddr) -> Result<()> {
    let (kind, took) = refusal(ns, proto, to)?;
    ensure!(
        kind == ErrorKind::ConnectionRefused && took < FAST,
        "{proto:?} to {to}: {kind:?} after {took:?}, expected a fast ECONNREFUSED"
    );
    Ok(())
}

/// REJECT: a service without ready endpoints answers new connections with ICMP port
/// unreachable (TCP and UDP, ClusterIP and NodePort), and so does a port the ClusterIP does not
/// define. Without the datapath the node has no route to the ClusterIP (an unreachable error of
/// another kind), so ECONNREFUSED shows the reject.
#[test]
fn no_endpoints_and_undefined_ports_are_rejected() -> Result<()> {
    let mut node = Node::start(2, &[], &[])?;
    let tcp = |n: &Node| n.service(Proto::Tcp, &[]).node_port(NODE_PORT);
    node.agent
        .update_manifests(&yaml(&[tcp(&node).not_ready_endpoint(node.ip("pod-b"))]))?;
    let pod_a = node.pod_ns("pod-a");
    assert_refused(pod_a, Proto::Tcp, vip())?;
    assert_refused(
        &node.topology.client,
        Proto::Tcp,
        (NODE_IP, NODE_PORT).into(),
    )?;
    // The service defines TCP 80 only: UDP 80 and TCP 81 are undefined ports.
    assert_refused(pod_a, Proto::Udp, vip())?;
    assert_refused(pod_a, Proto::Tcp, (CLUSTER_IP, 81).into())?;
    assert_refused(&node.topology.container, Proto::Tcp, vip())?;

    let udp = ServiceManifest::new("dns", CLUSTER_IP, Proto::Udp, 53, TARGET_PORT);
    node.agent.update_manifests(&yaml(&[
        node.service(Proto::Tcp, &["pod-b"]).node_port(NODE_PORT),
        udp,
    ]))?;
    let pod_a = node.pod_ns("pod-a");
    assert_refused(pod_a, Proto::Udp, (CLUSTER_IP, 53).into())?;
    ensure!(request(pod_a, Proto::Tcp, vip())?.server == "pod-b");
    assert_refused(pod_a, Proto::Tcp, (CLUSTER_IP, 81).into())
}

fn distinct_servers(answers: &[Answer]) -> BTreeSet<&str> {
    answers.iter().map(|a| a.server.as_str()).collect()
}

/// sessionAffinity ClientIP: every new connection of a client goes to one endpoint; switched off
/// on the live service, they spread again; switched back on with a 1 s timeout, they stick, and
/// after more than the timeout idle a client may land elsewhere. The affinity map has the size
/// `--affinity-max` asks for.
#[test]
fn session_affinity_client_ip() -> Result<()> {
    let mut node = Node::start(4, &[], &["--affinity-max", "4096"])?;
    // The agent's bpffs, seen through its own mount namespace.
    let pin = format!(
        "/proc/{}/root/sys/fs/bpf/lb/{}",
        node.agent.pid(),
        lb_common::map_name::AFFINITY
    );
    let size = aya::maps::MapData::from_pin(&pin)
        .and_then(|map| map.info())
        .with_context(|| pin.clone())?
        .max_entries();
    ensure!(size == 4096, "{pin}: {size} entries");
    let pods = ["pod-b", "pod-c", "pod-d"];
    let affine = |n: &Node, timeout| n.service(Proto::Tcp, &pods).session_affinity(timeout);
    node.agent
        .update_manifests(&yaml(&[affine(&node, 10800)]))?;
    let answers = requests(node.pod_ns("pod-a"), Proto::Tcp, vip(), 30)?;
    ensure!(
        distinct_servers(&answers).len() == 1,
        "affinity: {:?}",
        distinct_servers(&answers)
    );
    // Another client has its own affinity, and it is kept as well.
    let container = requests(&node.topology.container, Proto::Tcp, vip(), 10)?;
    ensure!(distinct_servers(&container).len() == 1);

    node.agent
        .update_manifests(&yaml(&[node.service(Proto::Tcp, &pods)]))?;
    let answers = requests(node.pod_ns("pod-a"), Proto::Tcp, vip(), 30)?;
    // Without affinity, 30 uniform choices over 3 all landing on one endpoint: p = 3^-29.
    ensure!(
        distinct_servers(&answers).len() > 1,
        "affinity switched off"
    );

    node.agent.update_manifests(&yaml(&[affine(&node, 1)]))?;
    let sticky = requests(node.pod_ns("pod-a"), Proto::Tcp, vip(), 20)?;
    ensure!(distinct_servers(&sticky).len() == 1, "affinity switched on");
    // 10 rounds of one connection each after 1.3 s idle: all on one endpoint has p = 3^-9.
    let mut after_idle = BTreeSet::new();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(1300));
        after_idle.insert(request(node.pod_ns("pod-a"), Proto::Tcp, vip())?.server);
    }
    ensure!(
        after_idle.len() > 1,
        "affinity outlived its timeout: {after_idle:?}"
    );
    Ok(())
}

/// An endpoint of `pod` that EndpointSlices place on `node`.
fn on(n: &Node, pod: &str, node: &str) -> EndpointManifest {
    EndpointManifest::ready(n.ip(pod)).on_node(node)
}

/// GET / on the healthCheckNodePort from the external client: status and body.
fn health_check(n: &Node) -> Result<(u16, String)> {
    n.topology
        .client
        .http_get(SocketAddr::from((NODE_IP, HEALTH_PORT)), "/")
}

/// Polls the health check until it reports `status` (the agent updates it after its sync).
fn wait_health(n: &Node, status: u16) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match health_check(n) {
            Ok((got, body)) if got == status => return Ok(body),
            other if Instant::now() > deadline => bail!("health check: {other:?}, want {status}"),
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// externalTrafficPolicy Local: external clients reach only this node's endpoint, unmasqueraded;
/// pods still use every endpoint; healthCheckNodePort answers kube-proxy's JSON (200 with local
/// endpoints, 503 without); with no local endpoint, external traffic is dropped.
#[test]
fn external_traffic_policy_local() -> Result<()> {
    let mut node = Node::start(3, &[], AGENT_ARGS)?;
    let service = |n: &Node, b_node: &str| {
        ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT)
            .node_port(NODE_PORT)
            .external_local(HEALTH_PORT)
            .endpoint(on(n, "pod-b", b_node))
            .endpoint(on(n, "pod-c", OTHER_NODE))
    };
    node.agent
        .update_manifests(&yaml(&[service(&node, NODE_NAME)]))?;
    let node_port: SocketAddr = (NODE_IP, NODE_PORT).into();
    let answers = requests(&node.topology.client, Proto::Tcp, node_port, 20)?;
    ensure!(
        answers
            .iter()
            .all(|a| a.server == "pod-b" && a.seen_source.ip() == CLIENT_IP && a.peer == node_port),
        "local endpoint only, client address kept: {answers:?}"
    );
    let from_pod = requests(node.pod_ns("pod-a"), Proto::Tcp, node_port, 30)?;
    ensure!(
        distinct_servers(&from_pod).len() == 2,
        "pods use every endpoint: {:?}",
        distinct_servers(&from_pod)
    );
    let body = wait_health(&node, 200)?;
    let json: serde_json::Value = serde_json::from_str(&body)?;
    ensure!(
        json["service"]["namespace"] == "default"
            && json["service"]["name"] == "web"
            && json["localEndpoints"] == 1
            && json["serviceProxyHealthy"] == true,
        "{body}"
    );

    node.agent
        .update_manifests(&yaml(&[service(&node, OTHER_NODE)]))?;
    let body = wait_health(&node, 503)?;
    ensure!(body.contains("\"localEndpoints\": 0"), "{body}");
    let (kind, _) = refusal(&node.topology.client, Proto::Tcp, node_port)?;
    ensure!(
        kind != ErrorKind::ConnectionRefused,
        "dropped, not rejected: {kind:?}"
    );
    Ok(())
}

/// internalTrafficPolicy Local: pods reach only the endpoints on their node.
#[test]
fn internal_traffic_policy_local() -> Result<()> {
    let mut node = Node::start(3, &[], AGENT_ARGS)?;
    let service = ServiceManifest::new("web", CLUSTER_IP, Proto::Udp, PORT, TARGET_PORT)
        .internal_local()
        .endpoint(on(&node, "pod-b", NODE_NAME))
        .endpoint(on(&node, "pod-c", OTHER_NODE));
    node.agent.update_manifests(&yaml(&[service]))?;
    let answers = requests(node.pod_ns("pod-a"), Proto::Udp, vip(), 20)?;
    ensure!(
        distinct_servers(&answers) == BTreeSet::from(["pod-b"]),
        "{:?}",
        distinct_servers(&answers)
    );
    Ok(())
}

/// Terminating endpoints: while none is ready, serving terminating ones get the traffic (not
/// the terminating ones that stopped serving); a ready one takes over at once. The same holds
/// for the Local list of externalTrafficPolicy Local, whose health check reports 0 ready local
/// endpoints meanwhile, so load balancers drain the node.
#[test]
fn terminating_endpoints_are_a_fallback() -> Result<()> {
    let mut node = Node::start(4, &[], AGENT_ARGS)?;
    let (b, c, d) = (node.ip("pod-b"), node.ip("pod-c"), node.ip("pod-d"));
    let terminating = ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT)
        .endpoint(EndpointManifest::terminating(b, true))
        .endpoint(EndpointManifest::terminating(c, false));
    node.agent
        .update_manifests(&yaml(std::slice::from_ref(&terminating)))?;
    let answers = requests(node.pod_ns("pod-a"), Proto::Tcp, vip(), 20)?;
    ensure!(distinct_servers(&answers) == BTreeSet::from(["pod-b"]));
    node.agent
        .update_manifests(&yaml(&[terminating.endpoint(EndpointManifest::ready(d))]))?;
    let answers = requests(node.pod_ns("pod-a"), Proto::Tcp, vip(), 20)?;
    ensure!(distinct_servers(&answers) == BTreeSet::from(["pod-d"]));

    let local = ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT)
        .node_port(NODE_PORT)
        .external_local(HEALTH_PORT)
        .endpoint(EndpointManifest::terminating(b, true).on_node(NODE_NAME))
        .endpoint(on(&node, "pod-c", OTHER_NODE));
    node.agent.update_manifests(&yaml(&[local]))?;
    let node_port: SocketAddr = (NODE_IP, NODE_PORT).into();
    let answers = requests(&node.topology.client, Proto::Tcp, node_port, 10)?;
    ensure!(distinct_servers(&answers) == BTreeSet::from(["pod-b"]));
    wait_health(&node, 503)?;
    Ok(())
}

/// Schedulers by annotation: rr takes the endpoints in turn (30 connections, 10 each), sh keeps
/// a client on one endpoint, maglev spreads flows.
#[test]
fn schedulers_by_annotation() -> Result<()> {
    let mut node = Node::start(4, &[], &[])?;
    let pods = ["pod-b", "pod-c", "pod-d"];
    let scheduled = |n: &Node, name| {
        n.service(Proto::Tcp, &pods)
            .annotation("lb.kubernetes.io/scheduler", name)
    };
    node.agent
        .update_manifests(&yaml(&[scheduled(&node, "rr")]))?;
    let answers = requests(node.pod_ns("pod-a"), Proto::Tcp, vip(), 30)?;
    for pod in pods {
        let n = answers.iter().filter(|a| a.server == pod).count();
        ensure!(n == 10, "round robin gave {pod} {n} of 30");
    }
    node.agent
        .update_manifests(&yaml(&[scheduled(&node, "sh")]))?;
    let answers = requests(node.pod_ns("pod-a"), Proto::Tcp, vip(), 20)?;
    ensure!(distinct_servers(&answers).len() == 1, "source hash");
    node.agent
        .update_manifests(&yaml(&[scheduled(&node, "maglev")]))?;
    let answers = requests(node.pod_ns("pod-a"), Proto::Tcp, vip(), 60)?;
    ensure!(
        distinct_servers(&answers).len() == 3,
        "maglev spreads flows: {:?}",
        distinct_servers(&answers)
    );
    Ok(())
}
