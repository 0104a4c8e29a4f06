//! ICMPv6 errors about IPv6 service traffic reach the client reverse-translated, through a real
//! node namespace with real sockets, as icmp_errors.rs checks ICMP's for IPv4: a router's Packet
//! Too Big lets TCP's path MTU discovery finish a transfer through an IPv6 ClusterIP whose
//! backend sits behind a link of a lower MTU. IPv6 routers never fragment, so Packet Too Big is
//! the only way the client learns the path MTU. Without the translation the client's kernel
//! cannot match it to its socket (it quotes the backend's address, not the service's), and the
//! transfer stalls in a black hole.
use std::{
    net::{Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    agent::{Agent, counter},
    echo::Proto,
    manifests::ipv6_only_service,
    netns::{Netns, unique_prefix},
    node::PORT,
    topology::{CLUSTER_CIDR, CLUSTER_CIDR_V6, NODE_IP, Topology, mac, pod_ip_v6},
    transfer::{CountingServer, TRANSFER, learned_mtu, upload},
};

const CLUSTER_IP_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x10);
const NODE_IP_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x10);
const BACKEND_PORT: u16 = 8093;
/// The link between the node (`lbpr`, a pod interface, so the agent attaches to it) and the
/// router.
const NODE_ROUTER_SIDE: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 1);
const ROUTER_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 2);
/// The backend, in the IPv6 cluster CIDR, behind the router's narrow link.
const REMOTE_BACKEND_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x244, 9, 0, 0, 0, 2);
const ROUTER_GATEWAY: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x244, 9, 0, 0, 0, 1);
/// IPv6's minimum link MTU, below the 1500 of every other link.
const ROUTER_MTU: u32 = 1280;
/// A transfer that PMTU discovery lets through takes milliseconds; one that waits for
/// retransmissions takes seconds.
const PROMPT: Duration = Duration::from_secs(3);

/// The router between the node and the remote backend, and the backend behind it on a veth whose
/// router end has MTU ROUTER_MTU and whose backend end keeps 1500, so that neither end's MSS
/// reveals the narrow link and only the router's Packet Too Big can. Every address without
/// duplicate address detection and every neighbour static, so that nothing waits for either.
struct RemoteBackend {
    _router: Netns,
    backend: Netns,
}

impl RemoteBackend {
    fn new(node: &Netns) -> Result<Self> {
        let prefix = unique_prefix();
        let router = Netns::new(format!("{prefix}rtr6"))?;
        let backend = Netns::new(format!("{prefix}rbe6"))?;
        router.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        node.add_veth("lbpr", &router, "eth0")?;
        let address = |ns: &Netns, addr: String, dev: &str| -> Result<()> {
            ns.ip(&["-6", "addr", "add", &addr, "dev", dev, "nodad"])?;
            ns.ip(&["link", "set", dev, "up"])
        };
        address(node, format!("{NODE_ROUTER_SIDE}/64"), "lbpr")?;
        node.ip(&[
            "-6",
            "route",
            "add",
            "2001:db8:244:9::/64",
            "via",
            &ROUTER_IP.to_string(),
        ])?;
        address(&router, format!("{ROUTER_IP}/64"), "eth0")?;
        router.ip(&[
            "-6",
            "route",
            "add",
            "default",
            "via",
            &NODE_ROUTER_SIDE.to_string(),
        ])?;
        router.add_veth("narrow", &backend, "eth0")?;
        router.ip(&["link", "set", "narrow", "mtu", &ROUTER_MTU.to_string()])?;
        address(&router, format!("{ROUTER_GATEWAY}/128"), "narrow")?;
        let backend_ip = REMOTE_BACKEND_IP.to_string();
        router.ip(&["-6", "route", "add", &backend_ip, "dev", "narrow"])?;
        address(&backend, format!("{backend_ip}/128"), "eth0")?;
        let gateway = ROUTER_GATEWAY.to_string();
        backend.ip(&["-6", "route", "add", &gateway, "dev", "eth0"])?;
        backend.ip(&["-6", "route", "add", "default", "via", &gateway])?;
        // Static neighbours: a link-local address is tentative for a while, and neighbour
        // discovery sends nothing until it is not.
        let neighbour = |ns: &Netns, dev: &str, addr: Ipv6Addr, peer: (&Netns, &str)| {
            let lladdr = mac(peer.0, peer.1)?;
            ns.ip(&[
                "-6",
                "neigh",
                "add",
                &addr.to_string(),
                "lladdr",
                &lladdr,
                "dev",
                dev,
            ])
        };
        neighbour(node, "lbpr", ROUTER_IP, (&router, "eth0"))?;
        neighbour(&router, "eth0", NODE_ROUTER_SIDE, (node, "lbpr"))?;
        neighbour(&router, "narrow", REMOTE_BACKEND_IP, (&backend, "eth0"))?;
        neighbour(&backend, "eth0", ROUTER_GATEWAY, (&router, "narrow"))?;
        Ok(RemoteBackend {
            _router: router,
            backend,
        })
    }
}

/// PMTU discovery through an IPv6 ClusterIP: pod-a uploads to it, its backend behind a router
/// whose link to it has MTU 1280. The upload finishes promptly, and pod-a has learned MTU 1280
/// towards the ClusterIP, which only the translated Packet Too Big can have taught it.
#[test]
fn path_mtu_discovery_through_an_ipv6_cluster_ip() -> Result<()> {
    let topology = Topology::new(1)?;
    topology.add_pod_ipv6()?;
    let remote = RemoteBackend::new(&topology.node)?;
    let _counting = CountingServer::start(
        &remote.backend,
        (Ipv6Addr::UNSPECIFIED, BACKEND_PORT).into(),
    )?;
    let service = ipv6_only_service(
        "upload6",
        (CLUSTER_IP_V6, PORT),
        Proto::Tcp,
        ("upload6-v6", "IPv6", BACKEND_PORT),
        &[REMOTE_BACKEND_IP.to_string()],
    );
    let node_ips = format!("{NODE_IP},{NODE_IP_V6}");
    let cluster_cidrs = format!("{CLUSTER_CIDR},{CLUSTER_CIDR_V6}");
    let _agent = Agent::start(
        &topology,
        &service,
        &["--node-ip", &node_ips, "--cluster-cidr", &cluster_cidrs],
    )?;

    let client = &topology.pod("pod-a").ns;
    ensure!(
        learned_mtu(client, CLUSTER_IP_V6.into())?.is_none(),
        "a path MTU before any traffic"
    );
    let to: SocketAddr = (CLUSTER_IP_V6, PORT).into();
    let took = upload(client, to).with_context(|| {
        format!(
            "pod-a ({}) to {to}: {:?}",
            pod_ip_v6(0),
            lb_tests::agent::stats(&topology.node)
        )
    })?;
    ensure!(took < PROMPT, "{TRANSFER} bytes took {took:?}");
    let mtu = learned_mtu(client, CLUSTER_IP_V6.into())?;
    ensure!(
        mtu == Some(ROUTER_MTU),
        "path MTU towards {to} {mtu:?}, expected {ROUTER_MTU}"
    );
    println!("pod-a: {TRANSFER} bytes to {to} in {took:?}");
    let translated = counter(&topology.node, "icmp_error_translated")?;
    ensure!(translated >= 1, "icmp_error_translated: {translated}");
    Ok(())
}
