//! The four Service paths through a real node namespace, with real sockets, over TCP and UDP:
//! who answered, which source the backend saw, which peer the client saw.
use std::{
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    bpffs::Bpffs,
    echo::{EchoServer, Proto, request, requests},
    manifests::{ServiceManifest, yaml},
    node::{Node, PORT, TARGET_PORT, vip},
    paths::{
        Traffic, assert_answered_by, check_container_to_service, check_external_to_node_port,
        check_hairpin, check_pod_to_service, servers,
    },
    topology::CONTAINER_IP,
};

const OTHER_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const NODE_PORT: u16 = 30080;

/// Path 1: Pod-A → ClusterIP → Pod-B / Pod-C, not masqueraded.
fn pod_to_service(proto: Proto, forwarding: &str) -> Result<()> {
    let mut node = Node::start(3, &[], &["--forwarding", forwarding])?;
    let service = node.service(proto, &["pod-b", "pod-c"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    check_pod_to_service(&node.topology, proto, vip())
}

#[test]
fn pod_to_service_tcp() -> Result<()> {
    pod_to_service(Proto::Tcp, "redirect")
}

#[test]
fn pod_to_service_tcp_stack() -> Result<()> {
    pod_to_service(Proto::Tcp, "stack")
}

#[test]
fn pod_to_service_udp() -> Result<()> {
    pod_to_service(Proto::Udp, "redirect")
}

#[test]
fn pod_to_service_udp_stack() -> Result<()> {
    pod_to_service(Proto::Udp, "stack")
}

/// Path 2: Pod-A → ClusterIP → Pod-A, masqueraded to the node's address on its veth.
fn hairpin(proto: Proto, forwarding: &str) -> Result<()> {
    let mut node = Node::start(2, &[], &["--forwarding", forwarding])?;
    let service = node.service(proto, &["pod-a"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    check_hairpin(&node.topology, proto, vip())
}

#[test]
fn hairpin_tcp() -> Result<()> {
    hairpin(Proto::Tcp, "redirect")
}

#[test]
fn hairpin_tcp_stack() -> Result<()> {
    hairpin(Proto::Tcp, "stack")
}

#[test]
fn hairpin_udp() -> Result<()> {
    hairpin(Proto::Udp, "redirect")
}

#[test]
fn hairpin_udp_stack() -> Result<()> {
    hairpin(Proto::Udp, "stack")
}

/// Path 3: a container on the docker bridge (outside the cluster CIDR) → ClusterIP, masqueraded.
fn container_to_service(proto: Proto, forwarding: &str) -> Result<()> {
    let mut node = Node::start(3, &[], &["--forwarding", forwarding])?;
    let service = node.service(proto, &["pod-b", "pod-c"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    check_container_to_service(&node.topology, proto, vip())
}

#[test]
fn container_to_service_tcp() -> Result<()> {
    container_to_service(Proto::Tcp, "redirect")
}

#[test]
fn container_to_service_tcp_stack() -> Result<()> {
    container_to_service(Proto::Tcp, "stack")
}

#[test]
fn container_to_service_udp() -> Result<()> {
    container_to_service(Proto::Udp, "redirect")
}

#[test]
fn container_to_service_udp_stack() -> Result<()> {
    container_to_service(Proto::Udp, "stack")
}

/// Path 4: an external client → node address:nodePort, masqueraded (externalTrafficPolicy Cluster).
fn external_to_node_port(proto: Proto, forwarding: &str) -> Result<()> {
    let mut node = Node::start(3, &[], &["--forwarding", forwarding])?;
    let service = node
        .service(proto, &["pod-b", "pod-c"])
        .node_port(NODE_PORT);
    node.agent.update_manifests(&yaml(&[service]))?;
    check_external_to_node_port(&node.topology, proto, vip(), NODE_PORT)
}

#[test]
fn external_to_node_port_tcp() -> Result<()> {
    external_to_node_port(Proto::Tcp, "redirect")
}

#[test]
fn external_to_node_port_tcp_stack() -> Result<()> {
    external_to_node_port(Proto::Tcp, "stack")
}

#[test]
fn external_to_node_port_udp() -> Result<()> {
    external_to_node_port(Proto::Udp, "redirect")
}

#[test]
fn external_to_node_port_udp_stack() -> Result<()> {
    external_to_node_port(Proto::Udp, "stack")
}

/// Uniform random selection: 300 connections over three endpoints.
#[test]
fn connections_spread_over_endpoints() -> Result<()> {
    let mut node = Node::start(4, &[], &[])?;
    let service = node.service(Proto::Tcp, &["pod-b", "pod-c", "pod-d"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let answers = requests(&node.topology.pod("pod-a").ns, Proto::Tcp, vip(), 300)?;
    let counts = servers(&answers);
    ensure!(counts.len() == 3, "{counts:?}");
    // Binomial(300, 1/3): mean 100, sd 8.2; 60..=140 is ±4.9 sd.
    ensure!(
        counts.values().all(|&n| (60..=140).contains(&n)),
        "uneven spread {counts:?}"
    );
    Ok(())
}

/// Endpoints that are not ready get no traffic.
#[test]
fn not_ready_endpoints_are_not_used() -> Result<()> {
    let mut node = Node::start(3, &[], &[])?;
    let service = node
        .service(Proto::Tcp, &["pod-b"])
        .not_ready_endpoint(node.ip("pod-c"));
    node.agent.update_manifests(&yaml(&[service]))?;
    let answers = requests(&node.topology.pod("pod-a").ns, Proto::Tcp, vip(), 20)?;
    assert_answered_by(&answers, &["pod-b"])
}

/// Traffic that is not service traffic passes untouched (no masquerade, no rewrite).
#[test]
fn non_service_traffic_is_untouched() -> Result<()> {
    let mut node = Node::start(2, &[], &[])?;
    let service = node.service(Proto::Udp, &["pod-b"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let pod_b: SocketAddr = (node.ip("pod-b"), TARGET_PORT).into();
    for proto in [Proto::Tcp, Proto::Udp] {
        let from_pod = request(&node.topology.pod("pod-a").ns, proto, pod_b)?;
        ensure!(
            from_pod.seen_source.ip() == node.ip("pod-a") && from_pod.peer == pod_b,
            "{from_pod:?}"
        );
        let from_container = request(&node.topology.container, proto, pod_b)?;
        ensure!(
            from_container.seen_source.ip() == CONTAINER_IP && from_container.peer == pod_b,
            "{from_container:?}"
        );
    }
    Ok(())
}

/// Removing an endpoint stops new connections to it at once; the other endpoint sees no error.
#[test]
fn endpoint_removed_while_traffic_runs() -> Result<()> {
    let mut node = Node::start(3, &[], &[])?;
    let before = node.service(Proto::Tcp, &["pod-b", "pod-c"]);
    let after = node.service(Proto::Tcp, &["pod-b"]);
    node.agent.update_manifests(&yaml(&[before]))?;
    let traffic = Traffic::start(
        &node.topology.pod("pod-a").ns,
        Proto::Tcp,
        vip(),
        Duration::from_secs(30),
    );
    std::thread::sleep(Duration::from_millis(300));
    node.agent.update_manifests(&yaml(&[after]))?;
    let later = requests(&node.topology.pod("pod-a").ns, Proto::Tcp, vip(), 50)?;
    let (answers, errors) = traffic.finish()?;
    ensure!(
        errors.is_empty(),
        "errors while the endpoint went away: {errors:?}"
    );
    assert_answered_by(&answers[..answers.len().min(20)], &["pod-b", "pod-c"])?;
    assert_answered_by(&later, &["pod-b"])
}

/// Deleting one service leaves another untouched; the deleted one stops answering.
#[test]
fn service_deleted_while_traffic_runs() -> Result<()> {
    let mut node = Node::start(3, &[], &[])?;
    let kept = ServiceManifest::new("kept", OTHER_CLUSTER_IP, Proto::Udp, PORT, TARGET_PORT)
        .endpoints([node.ip("pod-c")]);
    let deleted = node.service(Proto::Udp, &["pod-b"]);
    node.agent
        .update_manifests(&yaml(&[deleted.clone(), kept.clone()]))?;
    ensure!(request(&node.topology.pod("pod-a").ns, Proto::Udp, vip())?.server == "pod-b");
    let kept_vip: SocketAddr = (OTHER_CLUSTER_IP, PORT).into();
    let traffic = Traffic::start(
        &node.topology.pod("pod-a").ns,
        Proto::Udp,
        kept_vip,
        Duration::from_secs(30),
    );
    std::thread::sleep(Duration::from_millis(300));
    node.agent.update_manifests(&yaml(&[kept]))?;
    std::thread::sleep(Duration::from_millis(300));
    let (answers, errors) = traffic.finish()?;
    ensure!(
        errors.is_empty(),
        "the kept service was disturbed: {errors:?}"
    );
    assert_answered_by(&answers, &["pod-c"])?;
    // A new socket (new source port, so no conntrack entry) to the deleted service gets nothing.
    ensure!(
        request(&node.topology.pod("pod-a").ns, Proto::Udp, vip()).is_err(),
        "the deleted service still answers"
    );
    Ok(())
}

/// A pod created after the agent started is attached: as a backend its replies are translated.
#[test]
fn pods_created_after_start_are_attached() -> Result<()> {
    let mut node = Node::start(1, &[], &[])?;
    let pod_b = node.topology.add_pod()?;
    let _server = EchoServer::start(&pod_b.ns, &pod_b.name, TARGET_PORT)?;
    let service = node.service(Proto::Udp, &["pod-b"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    // The agent attaches on the netlink event; give it a bounded number of tries.
    let pod_a = node.topology.pod("pod-a");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match request(&pod_a.ns, Proto::Udp, vip()) {
            Ok(answer) => {
                ensure!(
                    answer.server == "pod-b" && answer.peer == vip(),
                    "{answer:?}"
                );
                return Ok(());
            }
            Err(e) if Instant::now() > deadline => return Err(e.context(node.agent.log())),
            Err(_) => {}
        }
    }
}

/// A broken manifest is reported and the last good state stays in the maps.
#[test]
fn broken_manifest_keeps_last_good_state() -> Result<()> {
    let mut node = Node::start(2, &[], &[])?;
    let service = node.service(Proto::Tcp, &["pod-b"]);
    node.agent
        .update_manifests(&yaml(std::slice::from_ref(&service)))?;
    let broken = yaml(&[service]).replace("port: 80", "port: eighty");
    std::fs::write(node.agent.manifest_dir().join("services.yaml"), broken)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !node.agent.log().contains("spec.ports") {
        ensure!(
            Instant::now() < deadline,
            "no error logged:\n{}",
            node.agent.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = node.agent.log();
    ensure!(
        log.contains("services.yaml"),
        "the error names no file:\n{log}"
    );
    let answers = requests(&node.topology.pod("pod-a").ns, Proto::Tcp, vip(), 5)?;
    assert_answered_by(&answers, &["pod-b"])
}

/// SIGTERM leaves the datapath in place when its pins are on a bpffs that outlives the agent (as
/// a node's host mounts it): the service still answers new flows, pod traffic still flows.
/// Detaching is `lb cleanup`'s (tests/tests/restart.rs).
#[test]
fn sigterm_keeps_the_datapath() -> Result<()> {
    let bpffs = Bpffs::mount()?;
    let mut node = Node::start(2, &[], &["--bpffs", &bpffs.arg()])?;
    let service = node.service(Proto::Udp, &["pod-b"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let pod_a = node.topology.pod("pod-a");
    ensure!(request(&pod_a.ns, Proto::Udp, vip())?.server == "pod-b");
    let status = node.agent.stop()?;
    ensure!(
        status.success(),
        "agent exit status {status}:\n{}",
        node.agent.log()
    );
    let answer = request(&pod_a.ns, Proto::Udp, vip()).context("the service after SIGTERM")?;
    ensure!(
        answer.server == "pod-b" && answer.peer == vip(),
        "after SIGTERM: {answer:?}"
    );
    let direct: SocketAddr = (node.ip("pod-b"), TARGET_PORT).into();
    ensure!(request(&pod_a.ns, Proto::Udp, direct)?.server == "pod-b");
    Ok(())
}
