//! Two nodes, one agent on each, real sockets: service traffic that enters one node and is
//! served by a pod on the other, and its replies, which come back through the first node's
//! external interface.
use std::{
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddr},
};

use anyhow::{Result, bail, ensure};
use lb_tests::{
    agent::Agent,
    echo::{EchoServer, Proto, error_kind, request, requests},
    manifests::{EndpointManifest, ServiceManifest, yaml},
    multinode::{CLIENT_IP, Cluster},
};

const PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
const PROTOS: [Proto; 2] = [Proto::Tcp, Proto::Udp];

/// The agents stop before the servers and namespaces go.
struct Setup {
    _agents: Vec<Agent>,
    _servers: Vec<EchoServer>,
    cluster: Cluster,
}

impl Setup {
    /// `pods` per node, a server on every pod, and an agent on every node on `services`
    /// (built from the cluster).
    fn start(
        pods: [usize; 2],
        services: impl Fn(&Cluster) -> Vec<ServiceManifest>,
    ) -> Result<Self> {
        let cluster = Cluster::new(pods)?;
        let servers = cluster
            .nodes
            .iter()
            .flat_map(|n| &n.pods)
            .map(|pod| EchoServer::start(&pod.ns, &pod.name, TARGET_PORT))
            .collect::<Result<Vec<_>>>()?;
        let manifests = yaml(&services(&cluster));
        let agents = cluster
            .nodes
            .iter()
            .map(|node| {
                Agent::start_on(
                    node.agent_node(),
                    &manifests,
                    &["--hostname-override", &node.name],
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Setup {
            _agents: agents,
            _servers: servers,
            cluster,
        })
    }
}

fn cluster_ip(proto: Proto) -> Ipv4Addr {
    match proto {
        Proto::Tcp => Ipv4Addr::new(10, 96, 0, 10),
        Proto::Udp => Ipv4Addr::new(10, 96, 0, 11),
    }
}

fn node_port(proto: Proto) -> u16 {
    match proto {
        Proto::Tcp => 30080,
        Proto::Udp => 30081,
    }
}

/// One service per protocol, served by pod-b on node-2.
fn on_pod_b(
    cluster: &Cluster,
    shape: impl Fn(ServiceManifest) -> ServiceManifest,
) -> Vec<ServiceManifest> {
    PROTOS
        .map(|proto| {
            let name = format!("web-{}", proto.manifest_name().to_lowercase());
            let endpoint = EndpointManifest::ready(cluster.pod("pod-b").ip).on_node("node-2");
            shape(
                ServiceManifest::new(&name, cluster_ip(proto), proto, PORT, TARGET_PORT)
                    .node_port(node_port(proto))
                    .endpoint(endpoint),
            )
        })
        .into()
}

/// Pod-to-pod across nodes is not masqueraded: pod-b sees pod-a's address, and pod-a the
/// ClusterIP it called.
#[test]
fn cluster_ip_on_node_1_reaches_a_pod_on_node_2() -> Result<()> {
    let setup = Setup::start([1, 1], |c| on_pod_b(c, |s| s))?;
    let pod_a = setup.cluster.pod("pod-a");
    for proto in PROTOS {
        let vip: SocketAddr = (cluster_ip(proto), PORT).into();
        for answer in requests(&pod_a.ns, proto, vip, 3)? {
            ensure!(
                answer.server == "pod-b"
                    && answer.seen_source.ip() == pod_a.ip
                    && answer.peer == vip,
                "{proto:?}: {answer:?}"
            );
        }
    }
    Ok(())
}

/// externalTrafficPolicy Cluster: node-1 masquerades to its own address, so pod-b's replies
/// come back through it, and the client sees the node address it called.
#[test]
fn node_port_on_node_1_reaches_a_pod_on_node_2_masqueraded() -> Result<()> {
    let setup = Setup::start([1, 1], |c| on_pod_b(c, |s| s))?;
    let node_1 = setup.cluster.nodes[0].ip;
    for proto in PROTOS {
        let to: SocketAddr = (node_1, node_port(proto)).into();
        for answer in requests(&setup.cluster.client, proto, to, 3)? {
            ensure!(
                answer.server == "pod-b" && answer.seen_source.ip() == node_1 && answer.peer == to,
                "{proto:?}: {answer:?}"
            );
        }
    }
    Ok(())
}

/// externalTrafficPolicy Local: the node with the endpoint serves the NodePort with the
/// client's own address; the node without one drops (it has no endpoint of its own to send
/// to, and forwarding would need a masquerade that hides the client).
#[test]
fn external_traffic_policy_local_across_nodes() -> Result<()> {
    let setup = Setup::start([1, 1], |c| {
        on_pod_b(c, |s| {
            let health = s.node_port.expect("NodePort") + 2000;
            s.external_local(health)
        })
    })?;
    let (node_1, node_2) = (setup.cluster.nodes[0].ip, setup.cluster.nodes[1].ip);
    let client = &setup.cluster.client;
    for proto in PROTOS {
        let to: SocketAddr = (node_2, node_port(proto)).into();
        for answer in requests(client, proto, to, 3)? {
            ensure!(
                answer.server == "pod-b"
                    && answer.seen_source.ip() == CLIENT_IP
                    && answer.peer == to,
                "{proto:?} via node-2: {answer:?}"
            );
        }
        let to: SocketAddr = (node_1, node_port(proto)).into();
        // Dropped, not rejected (nor refused by node-1's stack): no answer at all.
        match request(client, proto, to) {
            Ok(answer) => bail!("{proto:?} via node-1 answered: {answer:?}"),
            Err(err) => {
                let kind = error_kind(&err);
                ensure!(
                    matches!(kind, Some(ErrorKind::TimedOut | ErrorKind::WouldBlock)),
                    "{proto:?} via node-1: {err:#}, expected no answer"
                );
            }
        }
    }
    Ok(())
}
