//! A spoofed SYN flood of three times the conntrack table (`--conntrack-max`) to a masqueraded
//! NodePort, in both forwarding modes: idle established connections still echo after it, and new
//! connections of a real client succeed during and after it. Linux's conntrack evicts
//! unconfirmed connections first (early_drop); an LRU of all connections evicted the idle
//! established ones, and the flood's half-open connections held the masquerade ports.
use std::{
    io::BufReader,
    net::{SocketAddr, SocketAddrV4, TcpStream},
    time::Duration,
};

use anyhow::{Result, ensure};
use lb_tests::{
    agent::stats,
    echo::Proto,
    flows::{LineEchoServer, connect_and_echo_line, echo_line},
    manifests::{ServiceManifest, yaml},
    node::{CLUSTER_IP, Node, PORT},
    raw::{send_paced, spoofed_syns},
    topology::NODE_IP,
};

const CONNTRACK_MAX: u32 = 1024;
/// The agent's default `--masquerade-port-range` (4,536 ports: more than the table's
/// connections), and one of 512 ports, as many as the table's connections, so that a flood that
/// held every connection of the table would hold every port (above Linux's default
/// ip_local_port_range, as the default).
const DEFAULT_PORTS: &str = "61000-65535";
const FEW_PORTS: &str = "61000-61511";
/// Spoofed SYNs: three times the table, each a connection of two entries.
const FLOOD_SYNS: u32 = 3 * CONNTRACK_MAX;
/// SYNs sent per pause of the flood, which spreads it over about FLOOD_SYNS / FLOOD_BATCH ×
/// FLOOD_PAUSE (~1 s), so that real connections are opened during it.
const FLOOD_BATCH: usize = 32;
const FLOOD_PAUSE: Duration = Duration::from_millis(10);
/// Idle established connections opened before the flood.
const ESTABLISHED: usize = 8;
/// New connections of the real client after the flood, each of which must succeed.
const AFTER: usize = 20;
/// At most this many new connections of the real client during the flood.
const MAX_DURING: usize = 500;
const NODE_PORT: u16 = 30087;
/// The port of the test's line echo server in pod-b (the fixture's echo servers hold 8080).
const SERVER_PORT: u16 = 8091;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A new connection to `to` that echoes a line.
fn connect_and_echo(to: SocketAddr) -> Result<BufReader<TcpStream>> {
    connect_and_echo_line(to, CONNECT_TIMEOUT)
}

/// `tolerated_failures`: of every 20 new connections of the real client (during and after the
/// flood), how many may fail.
fn syn_flood(mode: &str, masquerade_ports: &str, tolerated_failures: usize) -> Result<()> {
    let conntrack_max = CONNTRACK_MAX.to_string();
    let mut node = Node::start(
        2,
        &[],
        &[
            "--forwarding",
            mode,
            "--conntrack-max",
            &conntrack_max,
            "--masquerade-port-range",
            masquerade_ports,
        ],
    )?;
    let _server = LineEchoServer::start(node.pod_ns("pod-b"), "pod-b", SERVER_PORT)?;
    let service = ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, SERVER_PORT)
        .node_port(NODE_PORT)
        .endpoints([node.ip("pod-b")]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let to = SocketAddr::V4(node_port);
    let client = &node.topology.client;

    let mut established = client.run(move || -> Result<Vec<_>> {
        (0..ESTABLISHED).map(|_| connect_and_echo(to)).collect()
    })??;
    let before = stats(&node.topology.node)?;

    let syns = spoofed_syns(node_port, FLOOD_SYNS)?;
    let (sent, (during_ok, during_failures)) = std::thread::scope(|scope| -> Result<_> {
        let flood = scope
            .spawn(|| client.run(move || send_paced(&syns, NODE_IP, FLOOD_BATCH, FLOOD_PAUSE)));
        // New connections of the real client, one after the other, while the flood lasts.
        let during = {
            let (mut ok, mut failures) = (0, Vec::new());
            while !flood.is_finished() && ok + failures.len() < MAX_DURING {
                match client.run(move || connect_and_echo(to))? {
                    Ok(_) => ok += 1,
                    Err(e) => failures.push(format!("{e:#}")),
                }
            }
            (ok, failures)
        };
        let sent = flood
            .join()
            .map_err(|_| anyhow::anyhow!("flood thread panicked"))???;
        Ok((sent, during))
    })?;
    let survivors = established
        .iter_mut()
        .map(|stream| echo_line(stream).is_ok())
        .filter(|&ok| ok)
        .count();
    let after: Vec<String> = client.run(move || {
        (0..AFTER)
            .filter_map(|_| connect_and_echo(to).err().map(|e| format!("{e:#}")))
            .collect()
    })?;
    let after_ok = AFTER - after.len();
    let during_failed = during_failures.len();
    let flooded = stats(&node.topology.node)?;
    let delta = |name: &str| flooded.get(name).unwrap_or(&0) - before.get(name).unwrap_or(&0);
    let report = format!(
        "{mode}: {sent} spoofed SYNs (--conntrack-max {CONNTRACK_MAX}, masquerade ports \
         {masquerade_ports}): {survivors} of \
         {ESTABLISHED} idle established connections echo after it; new connections: \
         {during_ok} of {} during it, {after_ok} of {AFTER} after it; new_connection +{}, \
         drop_snat_ports_exhausted +{}, drop_conntrack_full +{}, conntrack_confirmed +{}, \
         conntrack_unconfirmed_evicted +{}, conntrack_early_drop +{}, drop_tuple_clash +{}; \
         failures during it: {during_failures:?}, after it: {after:?}",
        during_ok + during_failed,
        delta("new_connection"),
        delta("drop_snat_ports_exhausted"),
        delta("drop_conntrack_full"),
        delta("conntrack_confirmed"),
        delta("conntrack_unconfirmed_evicted"),
        delta("conntrack_early_drop"),
        delta("drop_tuple_clash"),
    );
    eprintln!("{report}");
    ensure!(sent == FLOOD_SYNS, "{report}");
    ensure!(
        delta("new_connection") + delta("drop_snat_ports_exhausted") >= u64::from(FLOOD_SYNS),
        "the flood did not reach the datapath: {report}"
    );
    ensure!(
        during_ok + during_failed > 0,
        "no connection during the flood: {report}"
    );
    let tolerated = |attempts: usize| attempts * tolerated_failures / 20;
    ensure!(
        survivors == ESTABLISHED
            && during_failed <= tolerated(during_ok + during_failed)
            && AFTER - after_ok <= tolerated(AFTER),
        "{report}"
    );
    Ok(())
}

/// The table holds a third of the flood, so the ports of evicted flood connections are free again
/// while the backend still holds their request sockets in SYN_RECV (as under Linux's conntrack,
/// whose early drop frees them too): a real connection that draws such a port meets a stale
/// SYN-ACK. Seen in 2 of about 2,400 connections during the flood over 15 runs.
const DEFAULT_PORTS_TOLERATED: usize = 1;

#[test]
fn established_connections_survive_a_syn_flood_of_three_tables_stack() -> Result<()> {
    syn_flood("stack", DEFAULT_PORTS, DEFAULT_PORTS_TOLERATED)
}

#[test]
fn established_connections_survive_a_syn_flood_of_three_tables_redirect() -> Result<()> {
    syn_flood("redirect", DEFAULT_PORTS, DEFAULT_PORTS_TOLERATED)
}

/// With every port held, a new connection takes one from a flood's half-open connection (early
/// drop), which the backend may still hold as a request socket in SYN_RECV: its stale SYN-ACK
/// then costs the client that attempt (1 in 20-40 here). Without the early drop, none succeeds
/// after the flood.
const FEW_PORTS_TOLERATED: usize = 2;

#[test]
fn a_syn_flood_leaves_masquerade_ports_to_real_clients_stack() -> Result<()> {
    syn_flood("stack", FEW_PORTS, FEW_PORTS_TOLERATED)
}

#[test]
fn a_syn_flood_leaves_masquerade_ports_to_real_clients_redirect() -> Result<()> {
    syn_flood("redirect", FEW_PORTS, FEW_PORTS_TOLERATED)
}
