//! `lb agent --xdp`: external NodePort traffic through a real node namespace, translated and
//! forwarded by `lb_xdp` on the external interface, the replies by tc on the pod veths.
use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    agent::stats_at,
    bpffs::Bpffs,
    echo::{Proto, udp_requests},
    manifests::yaml,
    node::{Node, vip},
    paths::check_external_to_node_port,
    topology::{EXTERNAL_INTERFACE, NODE_IP, Topology},
};

const NODE_PORT: u16 = 30080;
/// check_external_to_node_port's requests from the client.
const REQUESTS: u64 = 30;

/// The client reaches pod-b / pod-c through node:nodePort, masqueraded (checked by
/// `check_external_to_node_port`, then `udp_flow`). With GRO on in the pods, turned on after the
/// agent started, the client's packets were redirected by XDP: all but each connection's first
/// (tc opens connections) and the first to each backend, whose MAC the node has not resolved yet
/// (those XDP passes to tc). With it off, XDP passes every one to tc, which still serves them.
///
/// After SIGTERM, with its pins on a bpffs that outlives the agent, `lb_xdp` stays attached and
/// the NodePort still answers.
fn external_to_node_port_via_xdp(proto: Proto, redirect_pods: bool) -> Result<()> {
    let bpffs = Bpffs::mount()?;
    let mut node = Node::start(3, &[], &["--xdp", "--bpffs", &bpffs.arg()])?;
    // XDP_REDIRECT into a veth needs NAPI on its peer, here the pods' eth0: GRO on turns it on
    // (veth_xdp_xmit; the node's CNI setup's part, see the README) and gives the node's end the
    // NDO_XMIT XDP feature, whose change notification the agent follows. Left off, a redirected
    // frame would be dropped, so the agent does not list those veths.
    if redirect_pods {
        for pod in &node.topology.pods {
            pod.ns.exec("ethtool", &["-K", "eth0", "gro", "on"])?;
        }
    }
    // Frames from a wire carry complete checksums; a veth peer's stack would leave TCP/UDP ones
    // to checksum offload (CHECKSUM_PARTIAL, a pseudo-header sum in the field), which XDP cannot
    // know and its incremental update would break.
    node.topology
        .client
        .exec("ethtool", &["-K", "eth0", "tx", "off"])?;
    let xdp_attached = || -> Result<bool> {
        let link = node
            .topology
            .node
            .exec("ip", &["link", "show", EXTERNAL_INTERFACE])?;
        Ok(String::from_utf8(link.stdout)?.contains("xdp"))
    };
    ensure!(
        xdp_attached()?,
        "lb_xdp not attached to {EXTERNAL_INTERFACE}"
    );
    let service = node
        .service(proto, &["pod-b", "pod-c"])
        .node_port(NODE_PORT);
    node.agent.update_manifests(&yaml(&[service]))?;

    check_external_to_node_port(&node.topology, proto, vip(), NODE_PORT)?;
    udp_flow(&node.topology, proto)?;
    let counters = stats_at(&node.topology.node, &bpffs.arg())?;
    let (forwarded, passed) = (counters["xdp_forwarded"], counters["xdp_passed"]);
    if redirect_pods {
        ensure!(
            forwarded >= REQUESTS - 2,
            "XDP forwarded {forwarded} packets of {REQUESTS} requests: {counters:?}"
        );
    } else {
        ensure!(
            forwarded == 0 && passed >= REQUESTS,
            "XDP forwarded {forwarded} and passed {passed} packets of {REQUESTS} requests into \
             pods it may not redirect to: {counters:?}"
        );
    }

    let status = node.agent.stop()?;
    ensure!(status.success(), "agent exit status {status}");
    ensure!(xdp_attached()?, "lb_xdp detached by SIGTERM");
    check_external_to_node_port(&node.topology, proto, vip(), NODE_PORT)
        .context("the NodePort after SIGTERM")?;
    udp_flow(&node.topology, proto).context("a UDP flow after SIGTERM")?;
    let after = stats_at(&node.topology.node, &bpffs.arg())?["xdp_forwarded"];
    // As before SIGTERM: all but each connection's first packet (tc opens it).
    ensure!(
        !redirect_pods || after >= forwarded + REQUESTS - 2,
        "XDP forwarded {} packets of {REQUESTS} requests after SIGTERM",
        after - forwarded
    );
    Ok(())
}

/// For UDP, REQUESTS more requests to the NodePort from one socket: one flow, whose datagrams
/// after the first XDP forwards. Each of `check_external_to_node_port`'s is a flow of its own,
/// one datagram, which tc opens. (Each of its TCP connections sends XDP several packets.)
fn udp_flow(topology: &Topology, proto: Proto) -> Result<()> {
    if proto == Proto::Udp {
        let node_port = (NODE_IP, NODE_PORT).into();
        topology
            .client
            .run(move || udp_requests(node_port, REQUESTS as usize))??;
    }
    Ok(())
}

#[test]
fn external_to_node_port_via_xdp_tcp() -> Result<()> {
    external_to_node_port_via_xdp(Proto::Tcp, true)
}

#[test]
fn xdp_leaves_pods_it_may_not_redirect_to_to_tc() -> Result<()> {
    external_to_node_port_via_xdp(Proto::Tcp, false)
}

#[test]
fn external_to_node_port_via_xdp_udp() -> Result<()> {
    external_to_node_port_via_xdp(Proto::Udp, true)
}
