//! `lb trace` against a running agent with real traffic: it names the backend that answered an
//! open connection and the one a new connection to a source-hash service then reaches, says
//! REJECT for a service without endpoints and drop (with the reason) for a source outside
//! loadBalancerSourceRanges, and changes no state: no conntrack entry, no counter.
use std::{
    collections::BTreeSet,
    io::{BufRead as _, BufReader, Write as _},
    net::{Ipv4Addr, SocketAddrV4, TcpStream},
};

use anyhow::{Context as _, Result, ensure};
use lb_common::Counter;
use lb_tests::{
    agent::{Agent, lb_binary},
    bpffs::Bpffs,
    echo::{Proto, TIMEOUT},
    flows::LineEchoServer,
    manifests::{IngressManifest, ServiceManifest, yaml},
    netns::Netns,
    node::{CLUSTER_IP, PORT, TARGET_PORT},
    topology::{CLIENT_IP, EXTERNAL_INTERFACE, Topology},
};
use serde_json::Value;

/// A ClusterIP without endpoints.
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 12);
/// A LoadBalancer IP whose source ranges hold only CLIENT_IP.
const LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
/// A client address outside those ranges.
const OTHER_CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 4);
const BACKENDS: [&str; 2] = ["pod-b", "pod-c"];
const CLIENTS: [&str; 2] = ["pod-a", "pod-d"];

/// `lb ARGS --bpffs BPFFS -o json` run in the node namespace.
fn lb_json(node: &Netns, bpffs: &str, args: &[&str]) -> Result<Value> {
    let mut all = args.to_vec();
    all.extend(["--bpffs", bpffs, "-o", "json"]);
    let output = node.exec(&lb_binary().to_string_lossy(), &all)?;
    serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "lb {all:?} printed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// `lb trace` of a TCP packet from `from` to `to` arriving on `interface`.
fn trace(
    node: &Netns,
    bpffs: &str,
    from: SocketAddrV4,
    to: SocketAddrV4,
    interface: &str,
) -> Result<Value> {
    let (from, to) = (from.to_string(), to.to_string());
    let args = [
        "trace",
        "--proto",
        "tcp",
        "--from",
        &from,
        "--to",
        &to,
        "--in-interface",
        interface,
    ];
    lb_json(node, bpffs, &args)
}

/// A TCP connection from `ns` to `service` that has been answered; returns it (kept open), its
/// source and the name of the backend that answered.
fn connect(ns: &Netns, service: SocketAddrV4) -> Result<(TcpStream, SocketAddrV4, String)> {
    ns.run(move || -> Result<_> {
        let stream = TcpStream::connect_timeout(&service.into(), TIMEOUT)?;
        stream.set_read_timeout(Some(TIMEOUT))?;
        let std::net::SocketAddr::V4(client) = stream.local_addr()? else {
            anyhow::bail!("IPv4 socket");
        };
        let mut reader = BufReader::new(stream.try_clone()?);
        reader.get_mut().write_all(b"ping\n")?;
        let mut reply = String::new();
        reader.read_line(&mut reply)?;
        let (server, echoed) = reply.split_once(' ').context("reply")?;
        ensure!(echoed == "ping\n", "reply {reply:?}");
        Ok((stream, client, server.to_owned()))
    })?
}

/// What of the datapath's state a trace could change: the connections (without their
/// remaining time, which moves by itself), the counters a traced packet would move and the
/// per-backend counters (in `lb services`).
fn state(node: &Netns, bpffs: &str) -> Result<(BTreeSet<String>, Vec<u64>, Value)> {
    let rows = lb_json(node, bpffs, &["conntrack"])?;
    let connections = rows
        .as_array()
        .context("a list")?
        .iter()
        .map(|row| {
            let mut row = row.clone();
            row.as_object_mut().context("a row")?.remove("expires_in_s");
            Ok(row.to_string())
        })
        .collect::<Result<_>>()?;
    let stats = lb_json(node, bpffs, &["stats"])?;
    let counters = [
        Counter::NewConnection,
        Counter::Translated,
        Counter::Masqueraded,
        Counter::Rejected,
        Counter::DropSourceRange,
    ]
    .iter()
    .map(|&c| {
        stats["counters"][c as usize]["value"]
            .as_u64()
            .with_context(|| format!("{} in {stats}", c.name()))
    })
    .collect::<Result<_>>()?;
    Ok((connections, counters, lb_json(node, bpffs, &["services"])?))
}

#[test]
fn trace_names_what_the_datapath_does_and_changes_nothing() -> Result<()> {
    let topology = Topology::new(4)?;
    let _servers = BACKENDS
        .iter()
        .map(|&name| LineEchoServer::start(&topology.pod(name).ns, name, TARGET_PORT))
        .collect::<Result<Vec<_>>>()?;
    let bpffs = Bpffs::mount()?;
    let bpffs = bpffs.arg();
    let ips = BACKENDS.map(|p| topology.pod(p).ip);
    let manifests = yaml(&[
        ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT)
            .annotation("lb.kubernetes.io/scheduler", "sh")
            .endpoints(ips),
        ServiceManifest::new("empty", EMPTY_IP, Proto::Tcp, PORT, TARGET_PORT),
        ServiceManifest::new(
            "guarded",
            Ipv4Addr::new(10, 96, 0, 13),
            Proto::Tcp,
            PORT,
            8080,
        )
        .node_port(30081)
        .load_balancer([IngressManifest {
            ip: LB_IP,
            ip_mode: Some("VIP"),
        }])
        .source_ranges(&[&format!("{CLIENT_IP}/32")])
        .endpoints(ips),
    ]);
    let _agent = Agent::start(&topology, &manifests, &["--bpffs", &bpffs])?;
    let node = &topology.node;
    let vip = SocketAddrV4::new(CLUSTER_IP, PORT);
    let answered_by = |server: &str| SocketAddrV4::new(topology.pod(server).ip, TARGET_PORT);

    let (_open, open_client, open_server) = connect(&topology.pod("pod-a").ns, vip)?;
    let before = state(node, &bpffs)?;

    // The open connection: its conntrack entry's backend, the one that answered.
    let pod_a_interface = &topology.pod("pod-a").host_interface;
    let traced = trace(node, &bpffs, open_client, vip, pod_a_interface)?;
    ensure!(
        traced["verdict"] == "forwarded"
            && traced["conntrack"] == "existing"
            && traced["frontend"] == vip.to_string()
            && traced["backend"] == answered_by(&open_server).to_string(),
        "open connection {open_client} answered by {open_server}: {traced:#}"
    );

    // New flows to the sh service, from each client: the backend its hash picks.
    let mut predicted = Vec::new();
    for client in CLIENTS {
        let pod = topology.pod(client);
        let from = SocketAddrV4::new(pod.ip, 40_001);
        let traced = trace(node, &bpffs, from, vip, &pod.host_interface)?;
        let candidates: BTreeSet<String> = ips
            .iter()
            .map(|&ip| SocketAddrV4::new(ip, TARGET_PORT).to_string())
            .collect();
        let listed: BTreeSet<String> = traced["candidates"]
            .as_array()
            .context("candidates")?
            .iter()
            .filter_map(|c| c.as_str().map(str::to_owned))
            .collect();
        ensure!(
            traced["verdict"] == "forwarded"
                && traced["conntrack"] == "new"
                && traced["policy"]["scheduler"] == "sh"
                && listed == candidates,
            "new flow from {client}: {traced:#}"
        );
        let backend = traced["backend"]
            .as_str()
            .with_context(|| format!("backend of {traced:#}"))?
            .to_owned();
        let backend_pod = topology
            .pods
            .iter()
            .find(|p| SocketAddrV4::new(p.ip, TARGET_PORT).to_string() == backend)
            .with_context(|| format!("a backend pod at {backend}"))?;
        ensure!(
            traced["interface"] == backend_pod.host_interface.as_str(),
            "new flow from {client} leaves towards {}: {traced:#}",
            backend_pod.name
        );
        predicted.push((client, backend));
    }

    // No endpoints: REJECT, as kube-proxy.
    let from = SocketAddrV4::new(topology.pod("pod-a").ip, 40_002);
    let empty = SocketAddrV4::new(EMPTY_IP, PORT);
    let traced = trace(node, &bpffs, from, empty, pod_a_interface)?;
    ensure!(
        traced["verdict"] == "REJECT" && traced["backend"].is_null(),
        "{traced:#}"
    );

    // A source outside loadBalancerSourceRanges: dropped, for that reason.
    let guarded = SocketAddrV4::new(LB_IP, PORT);
    let outside = SocketAddrV4::new(OTHER_CLIENT_IP, 40_003);
    let traced = trace(node, &bpffs, outside, guarded, EXTERNAL_INTERFACE)?;
    let reason = Counter::DropSourceRange.drop_reason().context("a drop")?;
    ensure!(
        traced["verdict"] == "drop"
            && traced["reason"] == reason
            && traced["policy"]["source_ranges"] == true,
        "{traced:#}"
    );

    // Nothing traced left a trace.
    let after = state(node, &bpffs)?;
    ensure!(
        before == after,
        "lb trace changed the datapath's state:\n{before:#?}\n{after:#?}"
    );

    // Real connections from the traced sources reach the predicted backends.
    for (client, backend) in predicted {
        let (_stream, _, server) = connect(&topology.pod(client).ns, vip)?;
        ensure!(
            answered_by(&server).to_string() == backend,
            "{client}: lb trace said {backend}, {server} answered"
        );
    }
    Ok(())
}
