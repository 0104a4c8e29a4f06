//! --nodeport-addresses: NodePorts answer only on the node addresses in those CIDRs.
use std::{
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddr},
};

use anyhow::{Result, bail, ensure};
use lb_tests::{
    agent::Agent,
    echo::{EchoServer, Proto, error_kind, request},
    manifests::{ServiceManifest, yaml},
    topology::{EXTERNAL_INTERFACE, NODE_IP, Topology},
};

const SECOND_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 3);
const NODE_PORT: u16 = 30080;

/// The external interface holds two addresses, the flag covers one: the NodePort answers there,
/// and on the other address the node's own stack refuses (no socket holds the port).
#[test]
fn node_ports_answer_only_on_listed_addresses() -> Result<()> {
    let topology = Topology::new(1)?;
    topology.node.ip(&[
        "addr",
        "add",
        &format!("{SECOND_IP}/24"),
        "dev",
        EXTERNAL_INTERFACE,
    ])?;
    let pod = topology.pod("pod-a");
    let _server = EchoServer::start(&pod.ns, &pod.name, 8080)?;
    let service = ServiceManifest::new("web", Ipv4Addr::new(10, 96, 0, 10), Proto::Tcp, 80, 8080)
        .node_port(NODE_PORT)
        .endpoints([pod.ip]);
    let _agent = Agent::start(
        &topology,
        &yaml(&[service]),
        &["--nodeport-addresses", &format!("{NODE_IP}/32")],
    )?;
    let to: SocketAddr = (NODE_IP, NODE_PORT).into();
    let answer = request(&topology.client, Proto::Tcp, to)?;
    ensure!(answer.server == "pod-a" && answer.peer == to, "{answer:?}");
    let to: SocketAddr = (SECOND_IP, NODE_PORT).into();
    match request(&topology.client, Proto::Tcp, to) {
        Ok(answer) => bail!("{to} answered: {answer:?}"),
        Err(err) => {
            let kind = error_kind(&err);
            ensure!(
                kind == Some(ErrorKind::ConnectionRefused),
                "{to}: {err:#}, expected the node's own refusal"
            );
        }
    }
    Ok(())
}
