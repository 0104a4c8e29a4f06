//! ICMP errors about service traffic reach the client reverse-translated, through a real node
//! namespace with real sockets: a backend's port unreachable fails the client's connected UDP
//! socket at once, and a router's fragmentation needed lets TCP's path MTU discovery finish a
//! transfer through a service whose backend sits behind a link of a lower MTU, and a router's
//! time exceeded (traceroute) reaches the client as about the service. Without the
//! translation the client's kernel cannot match any of them to its socket (it quotes the
//! backend's address, not the service's): the datagram's answer never comes, and the transfer
//! stalls in a black hole.
use std::{
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    agent::{Agent, counter},
    echo::{EchoServer, Proto},
    manifests::{ServiceManifest, yaml},
    netns::{Netns, unique_prefix},
    node::{CLUSTER_IP, Node, PORT, TARGET_PORT, serve_pods},
    topology::{NODE_IP, POD_GATEWAY, Topology},
    transfer::{CountingServer, TRANSFER, learned_mtu, upload},
};
use nix::{
    errno::Errno,
    sys::socket::{setsockopt, sockopt},
};

const NODE_PORT: u16 = 30080;
/// The backends listen on TARGET_PORT; nothing listens on this one.
const CLOSED_PORT: u16 = 8081;
/// A refused datagram fails well before the wait for an answer ends.
const FAST: Duration = Duration::from_millis(500);
const ANSWER_WAIT: Duration = Duration::from_secs(2);
const COUNTER: &str = "icmp_error_translated";

/// Sends one datagram from `ns` on a socket connected to `to` and waits (bounded) for what
/// comes back: the error the socket got, and when.
fn udp_exchange(ns: &Netns, to: SocketAddr) -> Result<(ErrorKind, Duration)> {
    ns.run(move || -> Result<(ErrorKind, Duration)> {
        let socket = UdpSocket::bind("0.0.0.0:0")?;
        socket.connect(to)?;
        socket.set_read_timeout(Some(ANSWER_WAIT))?;
        let start = Instant::now();
        socket.send(b"hello\n")?;
        let mut buf = [0u8; 512];
        match socket.recv(&mut buf) {
            Ok(_) => bail!("UDP answer from {to}"),
            Err(e) => Ok((e.kind(), start.elapsed())),
        }
    })?
}

/// A service port whose endpoint has no listener: the endpoint's kernel answers with ICMP port
/// unreachable, which reaches the client as about the service address, so its connected UDP
/// socket fails with ECONNREFUSED at once. From a pod (not masqueraded), from the endpoint
/// itself (hairpin, masqueraded), and from an external client to the NodePort (masqueraded).
#[test]
fn port_unreachable_from_a_backend_refuses_the_client() -> Result<()> {
    let mut node = Node::start(2, &[], &[])?;
    let closed = ServiceManifest::new("closed", CLUSTER_IP, Proto::Udp, PORT, CLOSED_PORT)
        .node_port(NODE_PORT)
        .endpoints([node.ip("pod-b")]);
    node.agent.update_manifests(&yaml(&[closed]))?;
    let vip: SocketAddr = (CLUSTER_IP, PORT).into();
    let cases = [
        ("pod-a", node.pod_ns("pod-a"), vip),
        ("pod-b (hairpin)", node.pod_ns("pod-b"), vip),
        (
            "external client",
            &node.topology.client,
            (NODE_IP, NODE_PORT).into(),
        ),
    ];
    for (client, ns, to) in cases {
        let (kind, took) = udp_exchange(ns, to)?;
        ensure!(
            kind == ErrorKind::ConnectionRefused && took < FAST,
            "{client} to {to}: {kind:?} after {took:?}, expected a fast ECONNREFUSED"
        );
    }
    let translated = counter(&node.topology.node, COUNTER)?;
    ensure!(translated == cases.len() as u64, "{COUNTER}: {translated}");
    Ok(())
}

/// The router between the node and the remote backend: `lbpr` on the node (a pod interface, so
/// the agent attaches to it), 203.0.113.1 ↔ 203.0.113.2; the backend 10.244.9.2/32 behind it on
/// a veth whose router end has MTU `ROUTER_MTU` and whose backend end keeps 1500, so that
/// neither end's MSS reveals the narrow link and only the router's fragmentation needed can.
struct RemoteBackend {
    _router: Netns,
    backend: Netns,
}

const NODE_ROUTER_SIDE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const ROUTER_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
const ROUTER_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 244, 9, 1);
const REMOTE_BACKEND_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 9, 2);
const ROUTER_MTU: u32 = 1280;

impl RemoteBackend {
    fn new(node: &Netns) -> Result<Self> {
        let prefix = unique_prefix();
        let router = Netns::new(format!("{prefix}rtr"))?;
        let backend = Netns::new(format!("{prefix}rbe"))?;
        router.sysctl("net.ipv4.ip_forward", "1")?;
        node.add_veth("lbpr", &router, "eth0")?;
        node.ip(&[
            "addr",
            "add",
            &format!("{NODE_ROUTER_SIDE}/24"),
            "dev",
            "lbpr",
        ])?;
        node.ip(&["link", "set", "lbpr", "up"])?;
        node.ip(&[
            "route",
            "add",
            "10.244.9.0/24",
            "via",
            &ROUTER_IP.to_string(),
        ])?;
        router.ip(&["addr", "add", &format!("{ROUTER_IP}/24"), "dev", "eth0"])?;
        router.ip(&["link", "set", "eth0", "up"])?;
        router.ip(&[
            "route",
            "add",
            "default",
            "via",
            &NODE_ROUTER_SIDE.to_string(),
        ])?;
        router.add_veth("narrow", &backend, "eth0")?;
        router.ip(&["link", "set", "narrow", "mtu", &ROUTER_MTU.to_string()])?;
        router.ip(&[
            "addr",
            "add",
            &format!("{ROUTER_GATEWAY}/32"),
            "dev",
            "narrow",
        ])?;
        router.ip(&["link", "set", "narrow", "up"])?;
        router.ip(&[
            "route",
            "add",
            &format!("{REMOTE_BACKEND_IP}/32"),
            "dev",
            "narrow",
        ])?;
        backend.ip(&[
            "addr",
            "add",
            &format!("{REMOTE_BACKEND_IP}/32"),
            "dev",
            "eth0",
        ])?;
        backend.ip(&["link", "set", "eth0", "up"])?;
        let gateway = ROUTER_GATEWAY.to_string();
        backend.ip(&["route", "add", &gateway, "dev", "eth0", "scope", "link"])?;
        backend.ip(&["route", "add", "default", "via", &gateway])?;
        Ok(RemoteBackend {
            _router: router,
            backend,
        })
    }
}

/// Well below the retransmission timeouts a transfer would wait through if its large segments
/// were lost on the way (seconds: 1 s, then 2 s, ...).
const PROMPT: Duration = Duration::from_secs(3);

/// PMTU discovery through a service: the backend sits behind a router whose link to it has MTU
/// 1280. A pod's upload to the ClusterIP (not masqueraded) and an external client's to the
/// NodePort (masqueraded: the router's error goes to the node address) both finish, and each
/// client has learned MTU 1280 towards the address it connected to, which only the translated
/// fragmentation needed can have taught it. Promptly: the masqueraded upload also shows that the
/// client's large (GSO) segments are forwarded, not lost until retransmissions shrink them.
#[test]
fn path_mtu_discovery_through_a_service() -> Result<()> {
    let topology = Topology::new(1)?;
    let remote = RemoteBackend::new(&topology.node)?;
    let _servers: Vec<EchoServer> = serve_pods(&topology, TARGET_PORT)?;
    let _counting =
        CountingServer::start(&remote.backend, (Ipv4Addr::UNSPECIFIED, TARGET_PORT).into())?;
    let service = ServiceManifest::new("upload", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT)
        .node_port(NODE_PORT)
        .endpoints([REMOTE_BACKEND_IP]);
    let _agent = Agent::start(&topology, &yaml(&[service]), &[])?;

    let cases = [
        ("pod-a", &topology.pod("pod-a").ns, CLUSTER_IP, PORT),
        ("external client", &topology.client, NODE_IP, NODE_PORT),
    ];
    for (client, ns, addr, port) in cases {
        ensure!(
            learned_mtu(ns, addr.into())?.is_none(),
            "{client}: a path MTU before any traffic"
        );
        let took = upload(ns, (addr, port).into()).with_context(|| client.to_string())?;
        ensure!(took < PROMPT, "{client}: {TRANSFER} bytes took {took:?}");
        let mtu = learned_mtu(ns, addr.into())?;
        ensure!(
            mtu == Some(ROUTER_MTU),
            "{client}: path MTU towards {addr} {mtu:?}, expected {ROUTER_MTU}"
        );
        println!("{client}: {TRANSFER} bytes to {addr}:{port} in {took:?}");
    }
    let translated = counter(&topology.node, COUNTER)?;
    ensure!(translated >= cases.len() as u64, "{COUNTER}: {translated}");
    Ok(())
}

/// The MTU of the node's own link to the backend in `path_mtu_of_the_nodes_link_to_a_backend`.
const NODE_LINK_MTU: u32 = 1280;

/// PMTU discovery where the narrow link is the node's own: pod-b's veth has MTU NODE_LINK_MTU on
/// both ends, and pod-b's routes advertise a 1500-byte link's MSS (`advmss 1460`, so that its
/// MSS does not reveal the link), so a full-size segment can only be dropped there. The node
/// answers the clients' DF segments with fragmentation needed quoting them as they were sent
/// (the stack's error, reverse-translated by lb_egress, with `--forwarding stack`; the
/// datapath's own, counted, with `--forwarding redirect`): an external client's upload to the
/// masqueraded NodePort and a pod's to the ClusterIP both finish promptly, and each client has
/// learned the MTU towards the address it connected to. The external client sends plain
/// full-size packets (TSO and GSO off), as from a NIC, which a veth refuses beyond its MTU; the
/// pod sends GSO aggregates, which a veth passes whatever their segments' size, so only their
/// segments' check can catch them.
fn path_mtu_of_the_nodes_link_to_a_backend(forwarding: &str) -> Result<()> {
    let topology = Topology::new(2)?;
    let _servers: Vec<EchoServer> = serve_pods(&topology, TARGET_PORT)?;
    let backend = topology.pod("pod-b");
    let _counting =
        CountingServer::start(&backend.ns, (Ipv4Addr::UNSPECIFIED, CLOSED_PORT).into())?;
    let mtu = NODE_LINK_MTU.to_string();
    topology
        .node
        .ip(&["link", "set", &backend.host_interface, "mtu", &mtu])?;
    backend.ns.ip(&["link", "set", "eth0", "mtu", &mtu])?;
    // Both routes: a connection masqueraded to the gateway's address (the source routing picks
    // towards pod-b) is answered over the gateway's own route.
    let gateway = POD_GATEWAY.to_string();
    backend.ns.ip(&[
        "route", "change", "default", "via", &gateway, "advmss", "1460",
    ])?;
    backend.ns.ip(&[
        "route", "change", &gateway, "dev", "eth0", "scope", "link", "advmss", "1460",
    ])?;
    let service = ServiceManifest::new("upload", CLUSTER_IP, Proto::Tcp, PORT, CLOSED_PORT)
        .node_port(NODE_PORT)
        .endpoints([backend.ip]);
    let _agent = Agent::start(&topology, &yaml(&[service]), &["--forwarding", forwarding])?;
    topology
        .client
        .exec("ethtool", &["-K", "eth0", "tso", "off", "gso", "off"])?;
    let cases = [
        ("external client", &topology.client, NODE_IP, NODE_PORT),
        ("pod-a", &topology.pod("pod-a").ns, CLUSTER_IP, PORT),
    ];
    for (client, ns, addr, port) in cases {
        let took = upload(ns, (addr, port).into())
            .with_context(|| format!("{client}: {:?}", lb_tests::agent::stats(&topology.node)))?;
        ensure!(took < PROMPT, "{client}: {TRANSFER} bytes took {took:?}");
        let mtu = learned_mtu(ns, addr.into())?;
        ensure!(
            mtu == Some(NODE_LINK_MTU),
            "{client}: path MTU towards {addr} {mtu:?}, expected {NODE_LINK_MTU}"
        );
        println!("{forwarding}: {client}: {TRANSFER} bytes to {addr}:{port} in {took:?}");
    }
    if forwarding == "redirect" {
        let answered = counter(&topology.node, "fragmentation_needed")?;
        ensure!(answered >= 2, "fragmentation_needed: {answered}");
    }
    Ok(())
}

#[test]
fn path_mtu_of_the_nodes_link_to_a_backend_stack() -> Result<()> {
    path_mtu_of_the_nodes_link_to_a_backend("stack")
}

#[test]
fn path_mtu_of_the_nodes_link_to_a_backend_redirect() -> Result<()> {
    path_mtu_of_the_nodes_link_to_a_backend("redirect")
}

/// Sends one datagram with TTL `ttl` from `ns` on a socket connected to `to`, with IP_RECVERR
/// (without it Linux reports only hard errors to a UDP socket, and time exceeded is not one),
/// and returns the errno the socket got and when; an error if nothing came back.
fn udp_with_ttl(ns: &Netns, to: SocketAddr, ttl: u32) -> Result<(i32, Duration)> {
    ns.run(move || -> Result<(i32, Duration)> {
        let socket = UdpSocket::bind("0.0.0.0:0")?;
        socket.connect(to)?;
        socket.set_ttl(ttl)?;
        setsockopt(&socket, sockopt::Ipv4RecvErr, &true)?;
        socket.set_read_timeout(Some(ANSWER_WAIT))?;
        let start = Instant::now();
        socket.send(b"hello\n")?;
        let mut buf = [0u8; 512];
        match socket.recv(&mut buf) {
            Ok(_) => bail!("UDP answer from {to}"),
            Err(e) => {
                let errno = e.raw_os_error().with_context(|| format!("{e}"))?;
                Ok((errno, start.elapsed()))
            }
        }
    })?
}

/// traceroute through a service: a datagram whose TTL runs out at the router behind the node
/// (TTL 2: the node forwards it with TTL 1) gets the router's time exceeded back, translated, as
/// EHOSTUNREACH on the client's socket; from a pod to the ClusterIP and from an external client
/// to the NodePort (masqueraded: the router answers the node address).
#[test]
fn time_exceeded_beyond_the_node_reaches_the_client() -> Result<()> {
    let topology = Topology::new(1)?;
    let _remote = RemoteBackend::new(&topology.node)?;
    let service = ServiceManifest::new("trace", CLUSTER_IP, Proto::Udp, PORT, TARGET_PORT)
        .node_port(NODE_PORT)
        .endpoints([REMOTE_BACKEND_IP]);
    let _agent = Agent::start(&topology, &yaml(&[service]), &[])?;
    let cases = [
        ("pod-a", &topology.pod("pod-a").ns, CLUSTER_IP, PORT),
        ("external client", &topology.client, NODE_IP, NODE_PORT),
    ];
    for (client, ns, addr, port) in cases {
        let (errno, took) =
            udp_with_ttl(ns, (addr, port).into(), 2).with_context(|| client.to_string())?;
        ensure!(
            errno == Errno::EHOSTUNREACH as i32 && took < FAST,
            "{client}: {} after {took:?}, expected a fast EHOSTUNREACH",
            Errno::from_raw(errno)
        );
    }
    let translated = counter(&topology.node, COUNTER)?;
    ensure!(translated == cases.len() as u64, "{COUNTER}: {translated}");
    Ok(())
}
