//! kube-proxy's UDP conntrack flush: a UDP client that keeps its source port (a DNS resolver)
//! moves to a live endpoint as soon as its endpoint is removed, instead of staying on the
//! old connection's entries until they time out.
use std::net::{Ipv4Addr, SocketAddr};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    agent::Agent,
    echo::{EchoServer, ask, udp_socket},
    manifests::{ServiceManifest, yaml},
    topology::{NODE_IP, Topology},
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 53);
const PORT: u16 = 53;
const NODE_PORT: u16 = 30053;
const TARGET_PORT: u16 = 8053;

/// The endpoint pod-b is removed (and keeps running, so a stale entry would still get an
/// answer from it): the next datagram from the same socket reaches pod-c. Both a pod client
/// through the ClusterIP (not masqueraded) and an external one through the NodePort
/// (masqueraded: its SNAT port goes too).
#[test]
fn removed_udp_endpoint_loses_its_conntrack() -> Result<()> {
    let topology = Topology::new(3)?;
    let servers =
        ["pod-b", "pod-c"].map(|name| EchoServer::start(&topology.pod(name).ns, name, TARGET_PORT));
    let _servers = servers.into_iter().collect::<Result<Vec<_>>>()?;
    let service = |pods: &[&str]| {
        let service = ServiceManifest::new(
            "dns",
            CLUSTER_IP,
            lb_tests::echo::Proto::Udp,
            PORT,
            TARGET_PORT,
        )
        .node_port(NODE_PORT)
        .endpoints(pods.iter().map(|p| topology.pod(p).ip));
        yaml(&[service])
    };
    let mut agent = Agent::start(&topology, &service(&["pod-b"]), &[])?;
    let clients = [
        (
            udp_socket(&topology.pod("pod-a").ns, "0.0.0.0:0")?,
            SocketAddr::from((CLUSTER_IP, PORT)),
        ),
        (
            udp_socket(&topology.client, "0.0.0.0:0")?,
            SocketAddr::from((NODE_IP, NODE_PORT)),
        ),
    ];
    for (socket, to) in &clients {
        for _ in 0..3 {
            let server = ask(socket, *to).with_context(|| agent.log())?;
            ensure!(server == "pod-b", "{to}: answered by {server}");
        }
    }
    agent.update_manifests(&service(&["pod-c"]))?;
    for (socket, to) in &clients {
        for _ in 0..3 {
            let server =
                ask(socket, *to).with_context(|| format!("after the update: {}", agent.log()))?;
            ensure!(server == "pod-c", "{to}: still answered by {server}");
        }
    }
    ensure!(
        agent
            .log()
            .contains("UDP conntrack of removed endpoints flushed"),
        "{}",
        agent.log()
    );
    Ok(())
}
