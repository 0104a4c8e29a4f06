//! The inspection commands on real connections: `lb conntrack` lists each open connection with
//! the backend that answered it (and the masquerade source the backend sees for a NodePort flow),
//! its filters select exactly the matching ones, `lb conntrack delete` removes exactly those, and
//! `lb stats -o json` lists every counter with its meaning. Both work on the pinned maps after
//! the agent has stopped.
use std::{
    collections::BTreeSet,
    io::{BufRead as _, BufReader, Write as _},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket},
};

use anyhow::{Context as _, Result, ensure};
use lb_common::{Counter, SNAT_PORT_MAX, SNAT_PORT_MIN};
use lb_tests::{
    agent::{Agent, lb_binary},
    bpffs::Bpffs,
    echo::{Proto, TIMEOUT},
    flows::LineEchoServer,
    manifests::{ServiceManifest, yaml},
    netns::Netns,
    node::{CLUSTER_IP, PORT, TARGET_PORT},
    topology::{CLIENT_IP, NODE_IP, POD_GATEWAY, Topology},
};
use serde_json::Value;

const NODE_PORT: u16 = 30080;
/// The UDP service's ClusterIP (the TCP one's is CLUSTER_IP).
const UDP_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const BACKENDS: [&str; 2] = ["pod-b", "pod-c"];

/// An open connection and what the datapath should show for it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Expected {
    protocol: &'static str,
    client: SocketAddrV4,
    service: SocketAddrV4,
    /// The backend that answered.
    backend: SocketAddrV4,
    masqueraded: bool,
}

enum Socket {
    Tcp(BufReader<TcpStream>),
    Udp(UdpSocket),
}

/// A connection kept open by the test.
struct Open {
    socket: Socket,
    expected: Expected,
}

impl Open {
    /// Connects from `ns` to `service`, sends a line and reads which backend answered.
    fn connect(
        ns: &Netns,
        proto: Proto,
        service: SocketAddrV4,
        backend_ip: impl Fn(&str) -> Ipv4Addr,
    ) -> Result<Self> {
        let (socket, client) = ns.run(move || -> Result<(Socket, SocketAddr)> {
            Ok(match proto {
                Proto::Tcp => {
                    let stream = TcpStream::connect_timeout(&service.into(), TIMEOUT)?;
                    stream.set_read_timeout(Some(TIMEOUT))?;
                    let client = stream.local_addr()?;
                    (Socket::Tcp(BufReader::new(stream)), client)
                }
                Proto::Udp => {
                    let socket = UdpSocket::bind("0.0.0.0:0")?;
                    socket.connect(service)?;
                    socket.set_read_timeout(Some(TIMEOUT))?;
                    let client = socket.local_addr()?;
                    (Socket::Udp(socket), client)
                }
            })
        })??;
        let SocketAddr::V4(client) = client else {
            unreachable!("IPv4 socket")
        };
        let mut open = Open {
            socket,
            expected: Expected {
                protocol: proto.rule_name(),
                client,
                service,
                backend: service,
                masqueraded: false,
            },
        };
        let server = open.ask()?;
        open.expected.backend = SocketAddrV4::new(backend_ip(&server), TARGET_PORT);
        Ok(open)
    }

    /// Sends a line on the connection; returns the name of the backend that answered.
    fn ask(&mut self) -> Result<String> {
        let mut reply = String::new();
        match &mut self.socket {
            Socket::Tcp(reader) => {
                reader.get_mut().write_all(b"ping\n")?;
                reader.read_line(&mut reply)?;
            }
            Socket::Udp(socket) => {
                socket.send(b"ping\n")?;
                let mut buf = [0; 512];
                let len = socket.recv(&mut buf)?;
                reply = String::from_utf8_lossy(&buf[..len]).into_owned();
            }
        }
        let (server, echoed) = reply
            .split_once(' ')
            .with_context(|| format!("reply {reply:?} on {:?}", self.expected))?;
        ensure!(echoed == "ping\n", "reply {reply:?}");
        Ok(server.to_owned())
    }
}

/// `lb ARGS --bpffs BPFFS -o json` run in the node namespace.
fn lb_json(node: &Netns, bpffs: &str, args: &[&str]) -> Result<Value> {
    let binary = lb_binary();
    let mut all = args.to_vec();
    all.extend(["--bpffs", bpffs, "-o", "json"]);
    let output = node.exec(&binary.to_string_lossy(), &all)?;
    serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "lb {all:?} printed:\n{}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// The rows of `lb conntrack [ARGS]`, checked for the fields every row has, as the expected
/// connections they show (the masquerade source is checked by the caller).
fn conntrack(node: &Netns, bpffs: &str, args: &[&str]) -> Result<Vec<(Expected, Value)>> {
    let rows = lb_json(node, bpffs, &[&["conntrack"], args].concat())?;
    let rows = rows.as_array().context("a list")?;
    rows.iter()
        .map(|row| {
            let addr = |field: &str| -> Result<SocketAddrV4> {
                row[field]
                    .as_str()
                    .with_context(|| format!("{field} in {row}"))?
                    .parse()
                    .with_context(|| format!("{field} in {row}"))
            };
            let protocol = match row["protocol"].as_str() {
                Some("tcp") => "tcp",
                Some("udp") => "udp",
                _ => anyhow::bail!("protocol in {row}"),
            };
            // kube-proxy's timeouts, the agent's defaults: TCP established 24h, UDP 30s, and
            // 2m once a stream (the client sent again after a reply).
            let timeout = match (protocol, row["state"].as_str()) {
                ("tcp", Some("established")) => 24 * 3600,
                ("udp", Some("replied")) => 30,
                ("udp", Some("stream")) => 120,
                _ => anyhow::bail!("state in {row}"),
            };
            let expires = row["expires_in_s"].as_u64().context("expires_in_s")?;
            ensure!(
                expires > timeout - 30 && expires <= timeout,
                "expires_in_s in {row}"
            );
            let expected = Expected {
                protocol,
                client: addr("client")?,
                service: addr("service")?,
                backend: addr("backend")?,
                masqueraded: !row["masquerade"].is_null(),
            };
            Ok((expected, row.clone()))
        })
        .collect()
}

fn shown(rows: &[(Expected, Value)]) -> BTreeSet<Expected> {
    rows.iter().map(|(e, _)| e.clone()).collect()
}

fn expected<'a>(opens: impl IntoIterator<Item = &'a Open>) -> BTreeSet<Expected> {
    opens.into_iter().map(|o| o.expected.clone()).collect()
}

/// The peers of the established TCP sockets on TARGET_PORT in `ns` (`ss`).
fn tcp_peers(ns: &Netns) -> Result<BTreeSet<SocketAddrV4>> {
    let output = ns.exec(
        "ss",
        &["-Htn", "state", "established", "sport", "=", ":8080"],
    )?;
    String::from_utf8(output.stdout)?
        .lines()
        .map(|line| {
            let peer = line.split_whitespace().last().context("ss line")?;
            peer.parse()
                .with_context(|| format!("peer in ss line {line:?}"))
        })
        .collect()
}

#[test]
fn conntrack_and_stats_show_the_open_connections() -> Result<()> {
    let topology = Topology::new(3)?;
    let _servers = topology
        .pods
        .iter()
        .map(|pod| LineEchoServer::start(&pod.ns, &pod.name, TARGET_PORT))
        .collect::<Result<Vec<_>>>()?;
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let ips = BACKENDS.map(|p| topology.pod(p).ip);
    let service = |name: &str, ip, proto| {
        ServiceManifest::new(name, ip, proto, PORT, TARGET_PORT)
            .annotation("lb.kubernetes.io/scheduler", "rr")
            .endpoints(ips)
    };
    let manifests = yaml(&[
        service("web", CLUSTER_IP, Proto::Tcp).node_port(NODE_PORT),
        service("dns", UDP_CLUSTER_IP, Proto::Udp),
    ]);
    let mut agent = Agent::start(&topology, &manifests, &["--bpffs", &bpffs_arg])?;
    let node = &topology.node;

    let backend_ip = |name: &str| topology.pod(name).ip;
    let vip = SocketAddrV4::new(CLUSTER_IP, PORT);
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let pod_a = &topology.pod("pod-a").ns;
    let mut opens = Vec::new();
    for _ in 0..4 {
        opens.push(Open::connect(pod_a, Proto::Tcp, vip, backend_ip)?);
    }
    let udp_vip = SocketAddrV4::new(UDP_CLUSTER_IP, PORT);
    opens.push(Open::connect(pod_a, Proto::Udp, udp_vip, backend_ip)?);
    for _ in 0..2 {
        let mut open = Open::connect(&topology.client, Proto::Tcp, node_port, backend_ip)?;
        open.expected.masqueraded = true;
        opens.push(open);
    }
    let answered: BTreeSet<Ipv4Addr> = opens.iter().map(|o| *o.expected.backend.ip()).collect();
    ensure!(
        answered.len() == 2,
        "rr spread the connections on both backends: {answered:?}"
    );

    // Every open connection, with the backend that answered, and nothing else.
    let rows = conntrack(node, &bpffs_arg, &[])?;
    ensure!(
        rows.len() == opens.len() && shown(&rows) == expected(&opens),
        "lb conntrack shows {:#?}, the open connections are {:#?}",
        shown(&rows),
        expected(&opens)
    );
    // The masquerade source of a NodePort flow is the peer its backend's socket has.
    for (row, open) in rows.iter().filter(|(e, _)| e.masqueraded).map(|r| {
        let open = opens.iter().find(|o| o.expected == r.0).expect("matched");
        (r, open)
    }) {
        let masquerade: SocketAddrV4 = row.1["masquerade"]
            .as_str()
            .context("masquerade")?
            .parse()?;
        ensure!(*masquerade.ip() == POD_GATEWAY, "{}", row.1);
        ensure!(
            (SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&masquerade.port()),
            "{}",
            row.1
        );
        let pod = topology
            .pods
            .iter()
            .find(|p| p.ip == *open.expected.backend.ip())
            .expect("a backend pod");
        let peers = tcp_peers(&pod.ns)?;
        ensure!(
            peers.contains(&masquerade),
            "{} sees {peers:?}, lb conntrack says {masquerade}",
            pod.name
        );
    }

    // Filters select exactly the matching connections.
    let pod_b = SocketAddrV4::new(backend_ip("pod-b"), TARGET_PORT);
    let pod_b_arg = pod_b.to_string();
    type Selects = Box<dyn Fn(&Expected) -> bool>;
    let filters: [(&[&str], Selects); 4] = [
        (
            &["--service", &node_port.to_string()],
            Box::new(move |e: &Expected| e.service == node_port),
        ),
        (
            &["--backend", &pod_b_arg],
            Box::new(move |e| e.backend == pod_b),
        ),
        (
            &["--client", &CLIENT_IP.to_string()],
            Box::new(move |e| *e.client.ip() == CLIENT_IP),
        ),
        (
            &["--service", &vip.to_string(), "--backend", &pod_b_arg],
            Box::new(move |e| e.service == vip && e.backend == pod_b),
        ),
    ];
    for (args, matches) in &filters {
        let want: BTreeSet<Expected> = expected(&opens)
            .into_iter()
            .filter(|e| matches(e))
            .collect();
        ensure!(!want.is_empty(), "{args:?} selects some connection");
        let rows = conntrack(node, &bpffs_arg, args)?;
        ensure!(
            shown(&rows) == want && rows.len() == want.len(),
            "lb conntrack {args:?} shows {:#?}, want {want:#?}",
            shown(&rows)
        );
    }

    // Counters: every one, with its meaning, and the new connections made.
    check_stats(node, &bpffs_arg, opens.len() as u64, 2)?;

    // Delete exactly pod-b's connections; the others keep working on their backend.
    let (on_b, mut others): (Vec<Open>, Vec<Open>) =
        opens.into_iter().partition(|o| o.expected.backend == pod_b);
    let deleted = conntrack(node, &bpffs_arg, &["delete", "--backend", &pod_b_arg])?;
    ensure!(shown(&deleted) == expected(&on_b), "deleted {deleted:#?}");
    let rows = conntrack(node, &bpffs_arg, &[])?;
    ensure!(
        shown(&rows) == expected(&others),
        "after delete --backend {pod_b}: {:#?}",
        shown(&rows)
    );
    for open in &mut others {
        let server = open.ask()?;
        ensure!(
            backend_ip(&server) == *open.expected.backend.ip(),
            "{:?} now answered by {server}",
            open.expected
        );
    }
    // Kept open to the end: a packet of theirs now would be no packet of a tracked connection.
    let _deleted = on_b;

    // With no agent running: the pinned maps still answer both commands.
    let status = agent.stop()?;
    ensure!(status.success(), "agent exit {status}:\n{}", agent.log());
    let rows = conntrack(node, &bpffs_arg, &[])?;
    ensure!(
        shown(&rows) == expected(&others),
        "with the agent stopped: {:#?}",
        shown(&rows)
    );
    let client_arg = CLIENT_IP.to_string();
    let deleted = conntrack(node, &bpffs_arg, &["delete", "--client", &client_arg])?;
    let (external, pod_side): (Vec<&Open>, Vec<&Open>) = others
        .iter()
        .partition(|o| *o.expected.client.ip() == CLIENT_IP);
    ensure!(
        shown(&deleted) == expected(external),
        "deleted with the agent stopped: {deleted:#?}"
    );
    ensure!(shown(&conntrack(node, &bpffs_arg, &[])?) == expected(pod_side));
    check_stats(node, &bpffs_arg, 7, 2)?;
    Ok(())
}

/// `lb stats -o json` lists every counter in order with its meaning, every drop reason, and
/// counted `new` new connections, `masqueraded` of them masqueraded, and no drop.
fn check_stats(node: &Netns, bpffs: &str, new: u64, masqueraded: u64) -> Result<()> {
    let stats = lb_json(node, bpffs, &["stats"])?;
    let counters = stats["counters"].as_array().context("counters")?;
    let names: Vec<&str> = counters.iter().filter_map(|c| c["name"].as_str()).collect();
    let want: Vec<&str> = Counter::ALL.iter().map(|c| c.name()).collect();
    ensure!(names == want, "counters {names:?}");
    for (row, counter) in counters.iter().zip(Counter::ALL) {
        ensure!(row["meaning"] == counter.meaning(), "{row}");
        ensure!(row["value"].is_u64(), "{row}");
    }
    let value = |counter: Counter| counters[counter as usize]["value"].as_u64();
    ensure!(
        value(Counter::NewConnection) == Some(new)
            && value(Counter::Masqueraded) == Some(masqueraded),
        "{stats:#}"
    );
    let reasons: BTreeSet<&str> = stats["drops"]
        .as_array()
        .context("drops")?
        .iter()
        .filter_map(|d| d["reason"].as_str())
        .collect();
    let want: BTreeSet<&str> = Counter::ALL
        .iter()
        .filter_map(|c| c.drop_reason())
        .collect();
    ensure!(reasons == want, "drop reasons {reasons:?}");
    ensure!(stats["dropped_total"] == 0, "{stats:#}");
    Ok(())
}

/// `lb services -o json` as (frontend, protocol) → row.
fn services(
    node: &Netns,
    bpffs: &str,
) -> Result<std::collections::BTreeMap<(String, String), Value>> {
    let rows = lb_json(node, bpffs, &["services"])?;
    rows.as_array()
        .context("a list")?
        .iter()
        .map(|row| {
            let field = |name: &str| row[name].as_str().map(str::to_owned);
            let key = (
                field("frontend").context("frontend")?,
                field("protocol").context("protocol")?,
            );
            Ok((key, row.clone()))
        })
        .collect()
}

/// Checks that `lb services` lists exactly the three frontends, each with both backends, and
/// that each backend counted as many new connections as it answered (`answers`: per service
/// name and backend), and for UDP, whose packets are known, two packets and their bytes per
/// connection.
fn check_services(
    node: &Netns,
    bpffs: &str,
    frontends: &[(SocketAddrV4, &str, &str, &str)],
    backends: &BTreeSet<SocketAddrV4>,
    answers: &std::collections::BTreeMap<(&str, SocketAddrV4), u64>,
    udp_bytes_per_connection: &std::collections::BTreeMap<SocketAddrV4, u64>,
) -> Result<()> {
    let rows = services(node, bpffs)?;
    let want: BTreeSet<(String, String)> = frontends
        .iter()
        .map(|(addr, proto, _, _)| (addr.to_string(), (*proto).to_owned()))
        .collect();
    let shown: BTreeSet<(String, String)> = rows.keys().cloned().collect();
    ensure!(shown == want, "lb services lists {shown:?}, want {want:?}");
    for (addr, proto, kind, name) in frontends {
        let row = &rows[&(addr.to_string(), (*proto).to_owned())];
        ensure!(row["kind"] == *kind, "kind in {row:#}");
        ensure!(
            row["service"] == format!("default/{name}"),
            "service in {row:#}"
        );
        ensure!(
            row["port_name"] == "app" && row["scheduler"] == "rr",
            "{row:#}"
        );
        let listed = row["backends"].as_array().context("backends")?;
        let addresses: BTreeSet<SocketAddrV4> = listed
            .iter()
            .map(|b| {
                b["address"]
                    .as_str()
                    .context("address")?
                    .parse()
                    .context("address")
            })
            .collect::<Result<_>>()?;
        ensure!(
            addresses == *backends && listed.len() == backends.len(),
            "{addr}/{proto} lists {addresses:?}"
        );
        for backend in listed {
            let address: SocketAddrV4 = backend["address"].as_str().context("address")?.parse()?;
            let want = answers.get(&(*name, address)).copied().unwrap_or(0);
            let connections = backend["connections"].as_u64().context("connections")?;
            let packets = backend["packets"].as_u64().context("packets")?;
            let bytes = backend["bytes"].as_u64().context("bytes")?;
            ensure!(
                connections == want,
                "{addr}/{proto}: {backend}, want {want} connections"
            );
            ensure!(backend["state"] == "ready", "{backend}");
            if *proto == "udp" {
                let per_connection = udp_bytes_per_connection[&address];
                ensure!(
                    packets == 2 * want && bytes == per_connection * want,
                    "{addr}/udp: {backend}, want {} packets, {} bytes",
                    2 * want,
                    per_connection * want
                );
            } else {
                // SYN, SYN-ACK, ACK, the line and its answer at least.
                ensure!(packets >= 5 * want && bytes >= 40 * packets, "{backend}");
            }
        }
    }
    Ok(())
}

#[test]
fn services_lists_frontends_with_their_backends_and_counters() -> Result<()> {
    let topology = Topology::new(3)?;
    let _servers = topology
        .pods
        .iter()
        .map(|pod| LineEchoServer::start(&pod.ns, &pod.name, TARGET_PORT))
        .collect::<Result<Vec<_>>>()?;
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let ips = BACKENDS.map(|p| topology.pod(p).ip);
    let service = |name: &str, ip, proto| {
        ServiceManifest::new(name, ip, proto, PORT, TARGET_PORT)
            .annotation("lb.kubernetes.io/scheduler", "rr")
            .endpoints(ips)
    };
    let manifests = yaml(&[
        service("web", CLUSTER_IP, Proto::Tcp).node_port(NODE_PORT),
        service("dns", UDP_CLUSTER_IP, Proto::Udp),
    ]);
    let mut agent = Agent::start(&topology, &manifests, &["--bpffs", &bpffs_arg])?;
    let node = &topology.node;
    let backend_ip = |name: &str| topology.pod(name).ip;
    let vip = SocketAddrV4::new(CLUSTER_IP, PORT);
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let udp_vip = SocketAddrV4::new(UDP_CLUSTER_IP, PORT);
    let backends: BTreeSet<SocketAddrV4> = ips
        .iter()
        .map(|ip| SocketAddrV4::new(*ip, TARGET_PORT))
        .collect();
    // The NodePort is served on every address of the node (NODE_IP among them).
    let node_addrs: BTreeSet<SocketAddrV4> = services(node, &bpffs_arg)?
        .keys()
        .filter_map(|(frontend, _)| frontend.parse::<SocketAddrV4>().ok())
        .filter(|addr| addr.port() == NODE_PORT)
        .collect();
    ensure!(
        node_addrs.contains(&node_port),
        "NodePorts on {node_addrs:?}"
    );
    let mut frontends = vec![
        (vip, "tcp", "ClusterIP", "web"),
        (udp_vip, "udp", "ClusterIP", "dns"),
    ];
    frontends.extend(
        node_addrs
            .iter()
            .map(|addr| (*addr, "tcp", "NodePort", "web")),
    );

    // Nothing counted before any traffic.
    let none = std::collections::BTreeMap::new();
    let udp_bytes: std::collections::BTreeMap<SocketAddrV4, u64> = BACKENDS
        .iter()
        .map(|pod| {
            // ping\n, and its answer "POD ping\n", each in an IPv4 and a UDP header.
            let request = 20 + 8 + 5;
            let answer = 20 + 8 + pod.len() as u64 + 6;
            (
                SocketAddrV4::new(backend_ip(pod), TARGET_PORT),
                request + answer,
            )
        })
        .collect();
    check_services(node, &bpffs_arg, &frontends, &backends, &none, &udp_bytes)?;

    let pod_a = &topology.pod("pod-a").ns;
    let mut opens = Vec::new();
    for _ in 0..5 {
        opens.push(("web", Open::connect(pod_a, Proto::Tcp, vip, backend_ip)?));
    }
    for _ in 0..2 {
        let open = Open::connect(&topology.client, Proto::Tcp, node_port, backend_ip)?;
        opens.push(("web", open));
    }
    for _ in 0..3 {
        opens.push((
            "dns",
            Open::connect(pod_a, Proto::Udp, udp_vip, backend_ip)?,
        ));
    }
    let mut answers = std::collections::BTreeMap::new();
    for (name, open) in &opens {
        *answers.entry((*name, open.expected.backend)).or_insert(0) += 1;
    }
    ensure!(
        answers.keys().filter(|(name, _)| *name == "web").count() == 2,
        "rr spread the TCP connections on both backends: {answers:?}"
    );
    check_services(
        node, &bpffs_arg, &frontends, &backends, &answers, &udp_bytes,
    )?;

    // With no agent running, the pinned maps answer the same.
    let status = agent.stop()?;
    ensure!(status.success(), "agent exit {status}:\n{}", agent.log());
    check_services(
        node, &bpffs_arg, &frontends, &backends, &answers, &udp_bytes,
    )?;

    // A new agent keeps every endpoint's counter slot: the counts go on from where they were.
    agent.restart(&[], true)?;
    check_services(
        node, &bpffs_arg, &frontends, &backends, &answers, &udp_bytes,
    )
    .with_context(|| format!("after a restart:\n{}", agent.log()))?;
    let open = Open::connect(pod_a, Proto::Udp, udp_vip, backend_ip)?;
    *answers.entry(("dns", open.expected.backend)).or_insert(0) += 1;
    check_services(
        node, &bpffs_arg, &frontends, &backends, &answers, &udp_bytes,
    )
    .with_context(|| format!("a connection after the restart:\n{}", agent.log()))?;
    Ok(())
}
