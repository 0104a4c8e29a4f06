//! Topology-aware routing: with `--zone`, Cluster traffic goes only to the endpoints the
//! EndpointSlice hints for this node's zone, through a node namespace with real sockets.
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
