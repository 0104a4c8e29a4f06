//! Topology-aware routing: Cluster traffic goes only to the endpoints the EndpointSlice hints
//! for this node (hints.forNodes) or else for its zone (`--zone`, hints.forZones), through a
//! node namespace with real sockets.
use anyhow::{Result, ensure};
use lb_tests::{
    echo::{Proto, requests},
    manifests::{EndpointManifest, yaml},
    node::{Node, vip},
};

/// Endpoints pod-a (hinted for zone-a) and pod-b (zone-b); the agent is in zone-b: every
/// connection from pod-c reaches pod-b (12 random picks among both would all be pod-b with a
/// chance of 1 in 4096).
#[test]
fn cluster_traffic_prefers_endpoints_hinted_for_this_zone() -> Result<()> {
    let mut node = Node::start(3, &[], &["--zone", "zone-b"])?;
    let service = node
        .service(Proto::Tcp, &[])
        .endpoint(EndpointManifest::ready(node.ip("pod-a")).hinted_for("zone-a"))
        .endpoint(EndpointManifest::ready(node.ip("pod-b")).hinted_for("zone-b"));
    node.agent.update_manifests(&yaml(&[service]))?;
    let answers = requests(node.pod_ns("pod-c"), Proto::Tcp, vip(), 12)?;
    for answer in &answers {
        ensure!(answer.server == "pod-b", "{answer:?}");
    }
    Ok(())
}

/// trafficDistribution PreferSameNode: pod-a is hinted for this node (node-1) and pod-b for
/// another, both for this zone: every connection reaches pod-a, as node hints come first.
/// Then the hint for node-1 moves to another node: the zone hints decide, so both serve.
#[test]
fn cluster_traffic_prefers_endpoints_hinted_for_this_node() -> Result<()> {
    let mut node = Node::start(
        3,
        &[],
        &["--hostname-override", "node-1", "--zone", "zone-a"],
    )?;
    let hinted = |pod: &str, node_name: &str| {
        EndpointManifest::ready(node.ip(pod))
            .hinted_for("zone-a")
            .hinted_for_node(node_name)
    };
    let service = node
        .service(Proto::Tcp, &[])
        .endpoint(hinted("pod-a", "node-1"))
        .endpoint(hinted("pod-b", "node-2"));
    let elsewhere = node
        .service(Proto::Tcp, &[])
        .endpoint(hinted("pod-a", "node-3"))
        .endpoint(hinted("pod-b", "node-2"));
    node.agent.update_manifests(&yaml(&[service]))?;
    let answers = requests(node.pod_ns("pod-c"), Proto::Tcp, vip(), 12)?;
    for answer in &answers {
        ensure!(answer.server == "pod-a", "{answer:?}");
    }

    node.agent.update_manifests(&yaml(&[elsewhere]))?;
    let answers = requests(node.pod_ns("pod-c"), Proto::Tcp, vip(), 24)?;
    for pod in ["pod-a", "pod-b"] {
        ensure!(
            answers.iter().any(|a| a.server == pod),
            "{pod} never answered: {answers:?}"
        );
    }
    Ok(())
}
