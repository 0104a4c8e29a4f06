//! Traffic from the node itself (host processes, hostNetwork pods) through the agent's cgroup
//! socket hooks: a client process in the node namespace and in the test's own cgroup reaches
//! ClusterIPs, NodePorts, externalIPs and LoadBalancer IPs, sees the service address as its peer,
//! and fails fast on a service without endpoints; processes outside the cgroup or the namespace
//! are untouched.
//!
//! The hooks are cgroup/sock_addr programs, which BPF_PROG_TEST_RUN does not run: they are
//! tested here only, with real sockets.
use std::{
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    agent::Agent,
    cgroup::Cgroup,
    echo::{Answer, EchoServer, Proto, request},
    manifests::{IngressManifest, ServiceManifest, yaml},
    netns::{Netns, unique_prefix},
    node::{CLUSTER_IP, Node, PORT, TARGET_PORT, serve_pods, vip},
    topology::{NODE_IP, POD_GATEWAY, Topology},
};

const NODE_PORT: u16 = 30080;
const DNS_PORT: u16 = 53;
const DNS_NODE_PORT: u16 = 30053;
const LOCALHOST: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// A refused connection fails well before any timeout (the client's is 2 s).
const FAST: Duration = Duration::from_millis(500);

/// What the client process printed.
#[derive(Debug)]
enum Outcome {
    Answered(Answer),
    Failed { kind: String, took: Duration },
}

/// What a client process in `ns` and `cgroup` printed for `args`.
fn node_client(cgroup: &Cgroup, ns: &Netns, args: &[&str]) -> Result<String> {
    cgroup.output(ns, env!("CARGO_BIN_EXE_lb-node-client"), args)
}

/// One request from a client process in `ns` and `cgroup`.
fn node_request(cgroup: &Cgroup, ns: &Netns, proto: Proto, to: SocketAddr) -> Result<Outcome> {
    let proto_arg = match proto {
        Proto::Tcp => "tcp",
        Proto::Udp => "udp",
    };
    outcome(&node_client(cgroup, ns, &[proto_arg, &to.to_string()])?)
}

fn outcome(text: &str) -> Result<Outcome> {
    let fields: Vec<&str> = text.split_whitespace().collect();
    match fields.as_slice() {
        ["error", kind, millis] => Ok(Outcome::Failed {
            kind: kind.to_string(),
            took: Duration::from_millis(millis.parse()?),
        }),
        [server, seen, peer] => Ok(Outcome::Answered(Answer {
            server: server.to_string(),
            seen_source: seen.parse()?,
            peer: peer.parse()?,
        })),
        _ => bail!("lb-node-client printed {text:?}"),
    }
}

fn answered(outcome: Outcome) -> Result<Answer> {
    match outcome {
        Outcome::Answered(answer) => Ok(answer),
        failed => bail!("{failed:?}"),
    }
}

fn services(node: &Node, endpoints: &[&str]) -> Vec<ServiceManifest> {
    let ips = || endpoints.iter().map(|p| node.ip(p));
    vec![
        node.service(Proto::Tcp, endpoints).node_port(NODE_PORT),
        ServiceManifest::new("dns", CLUSTER_IP, Proto::Udp, DNS_PORT, TARGET_PORT)
            .node_port(DNS_NODE_PORT)
            .endpoints(ips()),
    ]
}

/// The agent on a node with pods a, b, c, its socket hooks on `cgroup`.
fn start(cgroup: &Cgroup) -> Result<Node> {
    let path = cgroup.agent_path();
    let path = path.to_str().context("cgroup path")?;
    Node::start(3, &[], &["--cgroup", path])
}

/// `lb agent` as a user runs it: only the flags it requires, under `ip netns exec`, which hides
/// the host's cgroup2 and bpffs mounts (on this hybrid v1 + v2 machine cgroup2 is not even at
/// /sys/fs/cgroup). It starts, warns that its own bpffs cannot outlive it, logs no BTF dump, and
/// its socket hooks on the cgroup v2 root serve a socket of this test's thread in the node
/// namespace: a backend answers, the client's peer is the ClusterIP. Once it has stopped, its
/// hooks are gone (its mounts lived in its own mount namespace): the ClusterIP is unreachable.
#[test]
fn default_flags_under_ip_netns_exec_serve_node_local_traffic() -> Result<()> {
    let topology = Topology::new(2)?;
    let _servers = serve_pods(&topology, TARGET_PORT)?;
    let endpoints = ["pod-a", "pod-b"];
    let service = ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT)
        .endpoints(endpoints.iter().map(|pod| topology.pod(pod).ip));
    let mut agent = Agent::start_with_default_flags(&topology, &yaml(&[service]))?;

    let answer = request(&topology.node, Proto::Tcp, vip()).context("ClusterIP from the node")?;
    ensure!(endpoints.contains(&answer.server.as_str()), "{answer:?}");
    ensure!(answer.peer == vip(), "the client's peer: {}", answer.peer);
    let log = agent.log();
    ensure!(!log.contains("BTF"), "BTF in the agent's log:\n{log}");
    ensure!(
        log.matches("mounted bpffs itself").count() == 1,
        "no warning about its own bpffs:\n{log}"
    );

    agent.stop()?;
    // The links go when their last reference does, the pins' with the agent's mount namespace.
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Ok(answer) = request(&topology.node, Proto::Tcp, vip()) {
        ensure!(
            Instant::now() < deadline,
            "the stopped agent's hooks still translate: {answer:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// ClusterIP (TCP, UDP) and NodePort on the node address and on 127.0.0.1 (TCP, UDP): a
/// backend answers; the client's peer (getpeername for TCP, recvfrom's source for UDP) is the
/// address it used; the backend sees the node's address on its link, the source routing gives,
/// as kube-proxy's masquerade of node-local traffic does.
#[test]
fn node_reaches_cluster_ips_and_node_ports() -> Result<()> {
    let cgroup = Cgroup::new()?;
    let mut node = start(&cgroup)?;
    node.agent
        .update_manifests(&yaml(&services(&node, &["pod-b", "pod-c"])))?;
    let targets = [
        (Proto::Tcp, vip()),
        (Proto::Udp, (CLUSTER_IP, DNS_PORT).into()),
        (Proto::Tcp, (NODE_IP, NODE_PORT).into()),
        (Proto::Udp, (NODE_IP, DNS_NODE_PORT).into()),
        (Proto::Tcp, (LOCALHOST, NODE_PORT).into()),
        (Proto::Udp, (LOCALHOST, DNS_NODE_PORT).into()),
    ];
    for (proto, to) in targets {
        let answer = answered(node_request(&cgroup, &node.topology.node, proto, to)?)
            .with_context(|| format!("{proto:?} to {to}"))?;
        ensure!(
            ["pod-b", "pod-c"].contains(&answer.server.as_str()),
            "{proto:?} to {to}: {answer:?}"
        );
        ensure!(answer.peer == to, "{proto:?} to {to}: peer {}", answer.peer);
        ensure!(
            answer.seen_source.ip() == POD_GATEWAY,
            "{proto:?} to {to}: the backend saw {}",
            answer.seen_source
        );
    }
    Ok(())
}

/// A service without endpoints refuses at once (ECONNREFUSED from connect or sendto, as
/// kube-proxy's REJECT makes it), on the ClusterIP and on a localhost NodePort.
#[test]
fn node_service_without_endpoints_is_refused_fast() -> Result<()> {
    let cgroup = Cgroup::new()?;
    let mut node = start(&cgroup)?;
    node.agent.update_manifests(&yaml(&services(&node, &[])))?;
    let targets = [
        (Proto::Tcp, vip()),
        (Proto::Udp, (CLUSTER_IP, DNS_PORT).into()),
        (Proto::Tcp, (LOCALHOST, NODE_PORT).into()),
    ];
    for (proto, to) in targets {
        match node_request(&cgroup, &node.topology.node, proto, to)? {
            Outcome::Failed { kind, took } => ensure!(
                kind == "Some(ConnectionRefused)" && took < FAST,
                "{proto:?} to {to}: {kind} after {took:?}, expected a fast ECONNREFUSED"
            ),
            answered => bail!("{proto:?} to {to}: {answered:?}"),
        }
    }
    Ok(())
}

/// The hooks act on the test's cgroup and the agent's namespace only. A server on the
/// localhost NodePort answers a node process outside the cgroup, and a process in the cgroup
/// but in another namespace; the same request from inside both reaches a backend.
#[test]
fn only_sockets_in_the_cgroup_and_the_agent_namespace_are_translated() -> Result<()> {
    let cgroup = Cgroup::new()?;
    let mut node = start(&cgroup)?;
    node.agent
        .update_manifests(&yaml(&services(&node, &["pod-b"])))?;
    let localhost_node_port: SocketAddr = (LOCALHOST, NODE_PORT).into();
    let other = Netns::new(format!("{}other", unique_prefix()))?;
    let _node_server = EchoServer::start(&node.topology.node, "node", NODE_PORT)?;
    let _other_server = EchoServer::start(&other, "other", NODE_PORT)?;

    let inside = answered(node_request(
        &cgroup,
        &node.topology.node,
        Proto::Tcp,
        localhost_node_port,
    )?)?;
    ensure!(inside.server == "pod-b", "in the cgroup: {inside:?}");
    // This test's own thread: in the node namespace, not in the cgroup.
    let outside = request(&node.topology.node, Proto::Tcp, localhost_node_port)?;
    ensure!(outside.server == "node", "outside the cgroup: {outside:?}");
    let elsewhere = answered(node_request(
        &cgroup,
        &other,
        Proto::Tcp,
        localhost_node_port,
    )?)?;
    ensure!(
        elsewhere.server == "other",
        "another namespace: {elsewhere:?}"
    );
    Ok(())
}

/// externalIPs and LoadBalancer ingress IPs from the node, as kube-proxy's OUTPUT chain serves
/// them (externalTrafficPolicy Cluster, TCP and UDP): a backend answers, the client's peer is
/// the address it used.
#[test]
fn node_reaches_external_and_load_balancer_ips() -> Result<()> {
    const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
    const LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
    let cgroup = Cgroup::new()?;
    let mut node = start(&cgroup)?;
    let services: Vec<ServiceManifest> = services(&node, &["pod-b", "pod-c"])
        .into_iter()
        .map(|service| {
            service
                .external_ips([EXTERNAL_IP])
                .load_balancer([IngressManifest {
                    ip: LB_IP,
                    ip_mode: Some("VIP"),
                }])
        })
        .collect();
    node.agent.update_manifests(&yaml(&services))?;
    let targets = [
        (Proto::Tcp, (EXTERNAL_IP, vip().port()).into()),
        (Proto::Udp, (EXTERNAL_IP, DNS_PORT).into()),
        (Proto::Tcp, (LB_IP, vip().port()).into()),
        (Proto::Udp, (LB_IP, DNS_PORT).into()),
    ];
    for (proto, to) in targets {
        let answer = answered(node_request(&cgroup, &node.topology.node, proto, to)?)
            .with_context(|| format!("{proto:?} to {to}"))?;
        ensure!(
            ["pod-b", "pod-c"].contains(&answer.server.as_str()) && answer.peer == to,
            "{proto:?} to {to}: {answer:?}"
        );
    }
    Ok(())
}

/// An unconnected UDP socket of the node, which passes through sendmsg4 on every datagram:
/// its 20 requests to a service with three endpoints all reach one backend, as kube-proxy's
/// conntrack keeps a UDP flow on one endpoint, and every answer comes from the service address.
/// New sockets pick again: 12 of them reach more than one backend.
#[test]
fn node_udp_flow_sticks_to_one_backend() -> Result<()> {
    let cgroup = Cgroup::new()?;
    let mut node = start(&cgroup)?;
    node.agent
        .update_manifests(&yaml(&services(&node, &["pod-a", "pod-b", "pod-c"])))?;
    let to: SocketAddr = (CLUSTER_IP, DNS_PORT).into();
    let ns = &node.topology.node;
    let text = node_client(&cgroup, ns, &["udp-flow", &to.to_string(), "20"])?;
    let answers = text
        .lines()
        .map(|line| answered(outcome(line)?))
        .collect::<Result<Vec<_>>>()?;
    ensure!(answers.len() == 20, "{text}");
    ensure!(
        answers
            .iter()
            .all(|a| a.server == answers[0].server && a.peer == to),
        "one flow, one backend: {answers:?}"
    );
    let mut servers = std::collections::BTreeSet::new();
    for _ in 0..12 {
        servers.insert(answered(node_request(&cgroup, ns, Proto::Udp, to)?)?.server);
    }
    ensure!(servers.len() > 1, "new sockets all went to {servers:?}");
    Ok(())
}
