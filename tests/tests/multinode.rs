//! Two nodes, one agent on each, real sockets: service traffic that enters one node and is
//! served by a pod on the other, and its replies, which come back through the first node's
//! external interface; in IPv4 and in IPv6.
use std::{
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use anyhow::{Result, bail, ensure};
use lb_tests::{
    agent::Agent,
    echo::{EchoServer, Proto, error_kind, request, requests},
    manifests::{EndpointManifest, ServiceManifest, ipv6_service_head, yaml},
    multinode::{CLIENT_IP, CLIENT_IP_V6, CLUSTER_CIDRS, Cluster, node_ip_v6, pod_ip_v6},
    netns::Netns,
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

    /// `pods` per node in a dual-stack cluster (`Cluster::add_ipv6`), a server on every pod's
    /// IPv6 address, and a dual-stack agent on every node on `manifests`.
    fn start_ipv6(pods: [usize; 2], manifests: &str) -> Result<Self> {
        let cluster = Cluster::new(pods)?;
        cluster.add_ipv6()?;
        let mut servers = Vec::new();
        let mut agents = Vec::new();
        for (i, node) in cluster.nodes.iter().enumerate() {
            let n = i as u8 + 1;
            for (k, pod) in node.pods.iter().enumerate() {
                let addr = (pod_ip_v6(n, k), TARGET_PORT).into();
                servers.push(EchoServer::start_on(&pod.ns, &pod.name, addr)?);
            }
            let node_ips = format!("{},{}", node.ip, node_ip_v6(n));
            let args = [
                "--hostname-override",
                &node.name,
                "--node-ip",
                &node_ips,
                "--cluster-cidr",
                CLUSTER_CIDRS,
            ];
            agents.push(Agent::start_on(node.agent_node(), manifests, &args)?);
        }
        Ok(Setup {
            _agents: agents,
            _servers: servers,
            cluster,
        })
    }
}

/// One IPv6-only NodePort Service per protocol (ClusterIP 2001:db8:96::10 for TCP, ::11 for
/// UDP, the NodePorts of `node_port`), served by node-2's first pod (pod-b of `[1, 1]`);
/// `external_local`: with externalTrafficPolicy Local.
fn ipv6_on_pod_b(external_local: bool) -> String {
    PROTOS
        .map(|proto| {
            let name = format!("web6-{}", proto.manifest_name().to_lowercase());
            let (cluster_ip, node_port) = (ipv6_cluster_ip(proto), node_port(proto));
            let (proto, pod) = (proto.manifest_name(), pod_ip_v6(2, 0));
            let policy = if external_local {
                format!(
                    "  externalTrafficPolicy: Local\n  healthCheckNodePort: {}\n",
                    node_port + 2000
                )
            } else {
                String::new()
            };
            let head = ipv6_service_head(&name, cluster_ip);
            format!(
                "{head}  type: NodePort
{policy}  ports:
    - protocol: {proto}
      port: {PORT}
      targetPort: {TARGET_PORT}
      nodePort: {node_port}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: default
  labels:
    kubernetes.io/service-name: {name}
addressType: IPv6
ports:
  - protocol: {proto}
    port: {TARGET_PORT}
endpoints:
  - addresses: [\"{pod}\"]
    nodeName: node-2
"
            )
        })
        .concat()
}

fn ipv6_cluster_ip(proto: Proto) -> Ipv6Addr {
    match proto {
        Proto::Tcp => Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x10),
        Proto::Udp => Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x11),
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
        no_answer(client, proto, (node_1, node_port(proto)).into())?;
    }
    Ok(())
}

/// `cluster_ip_on_node_1_reaches_a_pod_on_node_2` over IPv6: not masqueraded, pod-b sees
/// pod-a's IPv6 address, pod-a the ClusterIP it called.
#[test]
fn ipv6_cluster_ip_on_node_1_reaches_a_pod_on_node_2() -> Result<()> {
    let setup = Setup::start_ipv6([1, 1], &ipv6_on_pod_b(false))?;
    let pod_a = setup.cluster.pod("pod-a");
    for proto in PROTOS {
        let vip: SocketAddr = (ipv6_cluster_ip(proto), PORT).into();
        for answer in requests(&pod_a.ns, proto, vip, 3)? {
            answer.check(&["pod-b"], IpAddr::V6(pod_ip_v6(1, 0)), vip)?;
        }
    }
    Ok(())
}

/// `node_port_on_node_1_reaches_a_pod_on_node_2_masqueraded` over IPv6: node-1 masquerades to
/// its IPv6 address towards node-2, so pod-b's replies come back through it, and the client
/// sees node-1's IPv6 NodePort answer.
#[test]
fn ipv6_node_port_on_node_1_reaches_a_pod_on_node_2_masqueraded() -> Result<()> {
    let setup = Setup::start_ipv6([1, 1], &ipv6_on_pod_b(false))?;
    let node_1 = node_ip_v6(1);
    for proto in PROTOS {
        let to: SocketAddr = (node_1, node_port(proto)).into();
        for answer in requests(&setup.cluster.client, proto, to, 3)? {
            answer.check(&["pod-b"], IpAddr::V6(node_1), to)?;
        }
    }
    Ok(())
}

/// `external_traffic_policy_local_across_nodes` over IPv6: node-2 serves its NodePort with the
/// client's own IPv6 address; node-1, without an endpoint of its own, gives no answer.
#[test]
fn ipv6_external_traffic_policy_local_across_nodes() -> Result<()> {
    let setup = Setup::start_ipv6([1, 1], &ipv6_on_pod_b(true))?;
    let client = &setup.cluster.client;
    for proto in PROTOS {
        let to: SocketAddr = (node_ip_v6(2), node_port(proto)).into();
        for answer in requests(client, proto, to, 3)? {
            answer.check(&["pod-b"], IpAddr::V6(CLIENT_IP_V6), to)?;
        }
        no_answer(client, proto, (node_ip_v6(1), node_port(proto)).into())?;
    }
    Ok(())
}

/// A request from `client` to `to` is dropped, not rejected (nor refused by the node's stack):
/// no answer at all.
fn no_answer(client: &Netns, proto: Proto, to: SocketAddr) -> Result<()> {
    match request(client, proto, to) {
        Ok(answer) => bail!("{proto:?} to {to} answered: {answer:?}"),
        Err(err) => {
            let kind = error_kind(&err);
            ensure!(
                matches!(kind, Some(ErrorKind::TimedOut | ErrorKind::WouldBlock)),
                "{proto:?} to {to}: {err:#}, expected no answer"
            );
            Ok(())
        }
    }
}
