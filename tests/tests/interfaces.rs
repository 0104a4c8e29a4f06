//! Which interfaces get the programs: one matching `--pod-interfaces` that carries no Ethernet
//! header (Calico's IPIP `tunl0`, WireGuard; here a tun device, the same kind of link) gets none,
//! as the programs would read its IP header as an Ethernet one.
use std::time::Duration;

use anyhow::{Result, ensure};
use lb_tests::node::Node;

const WAIT: Duration = Duration::from_secs(10);

fn ip(node: &Node, args: &[&str]) -> Result<()> {
    let out = node.topology.node.exec("ip", args)?;
    ensure!(out.status.success(), "ip {args:?}: {out:?}");
    Ok(())
}

#[test]
fn an_interface_without_ethernet_headers_gets_no_programs() -> Result<()> {
    let mut node = Node::start(1, &[], &[])?;
    ip(&node, &["tuntap", "add", "dev", "lbptun0", "mode", "tun"])?;
    ip(&node, &["link", "set", "lbptun0", "up"])?;
    // An Ethernet one after it: once it is attached, the tun device's events were handled.
    ip(
        &node,
        &[
            "link", "add", "lbpv0", "type", "veth", "peer", "name", "lbpv1",
        ],
    )?;
    node.agent.wait_for_log(
        "attached lb_ingress at tc ingress interface=\"lbpv1\"",
        WAIT,
    )?;
    let log = node.agent.log();
    let attached_to_tun = log
        .lines()
        .filter(|line| line.contains("attached lb_") && line.contains("interface=\"lbptun0\""))
        .count();
    ensure!(
        attached_to_tun == 0 && log.contains("not an Ethernet interface"),
        "{log}"
    );
    Ok(())
}
