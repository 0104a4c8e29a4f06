//! The test topology itself, without the agent: pods and the container reach each other's
//! addresses directly, and every namespace it made is gone after drop.
use std::net::SocketAddr;

use anyhow::{Result, ensure};
use lb_tests::{
    echo::{EchoServer, Proto, request},
    topology::{CONTAINER_IP, Topology},
};

#[test]
fn pods_and_container_route_through_the_node() -> Result<()> {
    let topology = Topology::new(2)?;
    let names: Vec<String> = [&topology.node, &topology.client, &topology.container]
        .iter()
        .map(|ns| ns.name().to_string())
        .chain(topology.pods.iter().map(|p| p.ns.name().to_string()))
        .collect();
    {
        let pod_b = topology.pod("pod-b");
        let _server = EchoServer::start(&pod_b.ns, &pod_b.name, 8080)?;
        let to: SocketAddr = (pod_b.ip, 8080).into();
        for proto in [Proto::Tcp, Proto::Udp] {
            let answer = request(&topology.pod("pod-a").ns, proto, to)?;
            ensure!(
                answer.server == "pod-b" && answer.seen_source.ip() == topology.pod("pod-a").ip
            );
            let answer = request(&topology.container, proto, to)?;
            ensure!(answer.server == "pod-b" && answer.seen_source.ip() == CONTAINER_IP);
        }
    }
    drop(topology);
    let left = String::from_utf8(
        std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()?
            .stdout,
    )?;
    for name in names {
        ensure!(
            !left.split_whitespace().any(|n| n == name),
            "{name} left behind"
        );
    }
    Ok(())
}
