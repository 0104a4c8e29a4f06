//! --nodeport-addresses: NodePorts answer only on the node addresses in those CIDRs.
use std::{
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
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
const SYNC_TIMEOUT: Duration = Duration::from_secs(5);

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

/// The addresses are the node's current ones: an address added while the agent runs serves the
/// NodePort (without it the node's own stack would refuse), and once removed it no longer
/// does. The client routes that address via the node throughout, so after the removal its
/// requests still reach the node, which must not translate them any more.
#[test]
fn node_ports_follow_address_changes() -> Result<()> {
    let topology = Topology::new(1)?;
    let pod = topology.pod("pod-a");
    let _server = EchoServer::start(&pod.ns, &pod.name, 8080)?;
    let service = ServiceManifest::new("web", Ipv4Addr::new(10, 96, 0, 10), Proto::Tcp, 80, 8080)
        .node_port(NODE_PORT)
        .endpoints([pod.ip]);
    let mut agent = Agent::start(&topology, &yaml(&[service]), &[])?;
    let second = format!("{SECOND_IP}/32");
    topology
        .client
        .ip(&["route", "add", &second, "via", &NODE_IP.to_string()])?;
    let to: SocketAddr = (SECOND_IP, NODE_PORT).into();
    let answered = || {
        request(&topology.client, Proto::Tcp, to).is_ok_and(|a| a.server == "pod-a" && a.peer == to)
    };

    // Each change makes the agent sync once its netlink notification arrives.
    topology
        .node
        .ip(&["addr", "add", &second, "dev", EXTERNAL_INTERFACE])?;
    agent.wait_for_sync(SYNC_TIMEOUT)?;
    ensure!(answered(), "{to} not served after the address was added");
    topology
        .node
        .ip(&["addr", "del", &second, "dev", EXTERNAL_INTERFACE])?;
    agent.wait_for_sync(SYNC_TIMEOUT)?;
    ensure!(
        !answered(),
        "{to} still served after the address was removed"
    );
    Ok(())
}
