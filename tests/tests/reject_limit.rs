//! REJECT replies are rate-limited as the kernel limits its own ICMP errors: a burst of SYNs to
//! a NodePort without endpoints gets no more port unreachables than the node's
//! `net.ipv4.icmp_msgs_burst` and `icmp_msgs_per_sec` allow, the others counted and dropped.
use std::{
    net::SocketAddrV4,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Result, bail, ensure};
use lb_tests::{
    agent::{Agent, counter},
    echo::Proto,
    manifests::{ServiceManifest, yaml},
    netns::Netns,
    node::{CLUSTER_IP, PORT, TARGET_PORT},
    raw::{send_ipv4, tcp_segment},
    topology::{CLIENT_IP, NODE_IP, Topology},
};
use nix::{
    libc,
    sys::{
        socket::{MsgFlags, recv, setsockopt, sockopt},
        time::TimeVal,
    },
};

const NODE_PORT: u16 = 30086;
const SYNS: u16 = 200;
/// The node's limit, low enough that the burst of SYNs goes over it.
const ICMP_PER_SEC: u64 = 10;
const ICMP_BURST: u64 = 20;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;

/// An ICMP socket of the calling thread's namespace: it gets a copy of every ICMP message.
fn icmp_socket() -> Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP) };
    ensure!(fd >= 0, "ICMP socket: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    setsockopt(&socket, sockopt::ReceiveTimeout, &TimeVal::new(0, 300_000))?;
    Ok(socket)
}

/// The port unreachables `socket` gets (until none comes for its timeout) about a segment to
/// `to`.
fn port_unreachables(socket: &OwnedFd, to: SocketAddrV4) -> Result<u64> {
    let mut buf = [0u8; 1500];
    let mut count = 0;
    while let Ok(len) = recv(socket.as_raw_fd(), &mut buf, MsgFlags::empty()) {
        let Some((outer, icmp)) = buf[..len].split_at_checked(usize::from(buf[0] & 0xf) * 4) else {
            continue;
        };
        // Type, code, checksum, unused, then the quoted IP header and 8 bytes of TCP.
        if icmp.len() < 8 + 20 + 4 || outer[9] != libc::IPPROTO_ICMP as u8 {
            continue;
        }
        let quoted = &icmp[8..];
        let quoted_to = SocketAddrV4::new(
            [quoted[16], quoted[17], quoted[18], quoted[19]].into(),
            u16::from_be_bytes([quoted[22], quoted[23]]),
        );
        if icmp[0] == ICMP_DEST_UNREACH && icmp[1] == ICMP_PORT_UNREACH && quoted_to == to {
            count += 1;
        }
    }
    Ok(count)
}

/// Waits (bounded) until the datapath has counted every SYN, answered or dropped.
fn wait_for_all_counted(node: &Netns, want: u64) -> Result<(u64, u64)> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let rejected = counter(node, "rejected")?;
        let limited = counter(node, "drop_reject_rate_limited")?;
        if rejected + limited >= want {
            return Ok((rejected, limited));
        }
        if Instant::now() > deadline {
            bail!("{rejected} rejected and {limited} rate-limited of {want}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn reject_replies_are_rate_limited_as_the_nodes_icmp_errors() -> Result<()> {
    let topology = Topology::new(1)?;
    topology
        .node
        .sysctl("net.ipv4.icmp_msgs_per_sec", &ICMP_PER_SEC.to_string())?;
    topology
        .node
        .sysctl("net.ipv4.icmp_msgs_burst", &ICMP_BURST.to_string())?;
    let service = ServiceManifest::new("empty", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT)
        .node_port(NODE_PORT);
    let _agent = Agent::start(&topology, &yaml(&[service]), &[])?;
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let syns = (0..SYNS)
        .map(|i| {
            let from = SocketAddrV4::new(CLIENT_IP, 20_000 + i);
            tcp_segment(from, node_port, u32::from(i), |b| b.syn())
        })
        .collect::<Result<Vec<_>>>()?;
    let (socket, start) = topology.client.run(move || -> Result<_> {
        let socket = icmp_socket()?;
        let start = Instant::now();
        for syn in &syns {
            send_ipv4(syn, NODE_IP)?;
        }
        Ok((socket, start))
    })??;
    let (rejected, limited) = wait_for_all_counted(&topology.node, u64::from(SYNS))?;
    let took = start.elapsed();
    let received = port_unreachables(&socket, node_port)?;
    println!(
        "{SYNS} SYNs in {took:?}: {received} port unreachables received, {rejected} rejected, \
         {limited} rate-limited"
    );
    let allowed = ICMP_BURST + ICMP_PER_SEC * took.as_secs().saturating_add(1);
    ensure!(
        (1..=allowed).contains(&received),
        "{received} port unreachables for {SYNS} SYNs in {took:?}: the node allows 1 to {allowed}"
    );
    ensure!(
        received == rejected && rejected + limited == u64::from(SYNS),
        "received {received}, rejected {rejected}, rate-limited {limited}"
    );
    Ok(())
}
