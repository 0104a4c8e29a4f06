//! Two connections whose translated tuples coincide: a pod reaches two ClusterIPs whose only
//! endpoint is the same pod:port from one local port. Both connections reach the backend as
//! `pod:port → endpoint`; the second gets another source port (as Linux's NAT remaps a clashing
//! null binding), so that each reply finds its own connection.
use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket},
    os::fd::{AsRawFd as _, OwnedFd},
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    echo::{Proto, TIMEOUT},
    manifests::{ServiceManifest, yaml},
    node::{CLUSTER_IP, Node, PORT, TARGET_PORT},
};
use nix::sys::{
    socket::{
        AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, setsockopt, socket, sockopt,
    },
    time::TimeVal,
};

const OTHER_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
/// Requests per ClusterIP from the one UDP socket.
const UDP_ROUNDS: usize = 20;

/// Services `web` and `other` on two ClusterIPs, both served by pod-b only.
fn two_cluster_ips_one_endpoint(proto: Proto) -> Result<(Node, [SocketAddr; 2])> {
    let mut node = Node::start(2, &[], &[])?;
    let web = node.service(proto, &["pod-b"]);
    let other = ServiceManifest::new("other", OTHER_CLUSTER_IP, proto, PORT, TARGET_PORT)
        .endpoints([node.ip("pod-b")]);
    node.agent.update_manifests(&yaml(&[web, other]))?;
    Ok((
        node,
        [(CLUSTER_IP, PORT).into(), (OTHER_CLUSTER_IP, PORT).into()],
    ))
}

/// One UDP socket alternates between the two ClusterIPs: every answer comes from the ClusterIP
/// its request went to.
#[test]
fn one_udp_socket_to_two_cluster_ips_of_one_endpoint() -> Result<()> {
    let (node, vips) = two_cluster_ips_one_endpoint(Proto::Udp)?;
    let peers = node.pod_ns("pod-a").run(move || -> Result<Vec<_>> {
        let socket = UdpSocket::bind("0.0.0.0:0")?;
        socket.set_read_timeout(Some(TIMEOUT))?;
        let mut buf = [0u8; 512];
        let mut peers = Vec::new();
        for to in vips.iter().cycle().take(2 * UDP_ROUNDS) {
            socket.send_to(b"hello\n", to)?;
            let (len, peer) = socket
                .recv_from(&mut buf)
                .with_context(|| format!("no UDP answer from {to}"))?;
            let text = std::str::from_utf8(&buf[..len])?;
            ensure!(text.starts_with("pod-b "), "answered by {text:?}");
            peers.push((*to, peer));
        }
        Ok(peers)
    })??;
    let wrong: Vec<_> = peers.iter().filter(|(to, peer)| to != peer).collect();
    ensure!(
        wrong.is_empty(),
        "{} of {} answers from another address than asked (asked, answered): {wrong:?}",
        wrong.len(),
        peers.len()
    );
    Ok(())
}

/// A TCP socket bound to `local` (SO_REUSEADDR, which lets two connected sockets share it),
/// connected to `to`; connect gives up after TIMEOUT.
fn connect_from(local: SocketAddrV4, to: SocketAddr) -> Result<TcpStream> {
    let to = match to {
        SocketAddr::V4(to) => to,
        SocketAddr::V6(_) => unreachable!("IPv4 only"),
    };
    let socket: OwnedFd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::empty(),
        None,
    )?;
    setsockopt(&socket, sockopt::ReuseAddr, &true)?;
    setsockopt(
        &socket,
        sockopt::SendTimeout,
        &TimeVal::new(TIMEOUT.as_secs() as _, 0),
    )?;
    bind(socket.as_raw_fd(), &SockaddrIn::from(local)).with_context(|| format!("bind {local}"))?;
    connect(socket.as_raw_fd(), &SockaddrIn::from(to))
        .with_context(|| format!("connect {local} → {to}"))?;
    Ok(TcpStream::from(socket))
}

/// Two TCP sockets on one local port, connected to the two ClusterIPs at once: both connect,
/// and each gets its own answer.
#[test]
fn two_tcp_sockets_on_one_port_to_two_cluster_ips_of_one_endpoint() -> Result<()> {
    let (node, vips) = two_cluster_ips_one_endpoint(Proto::Tcp)?;
    let pod_a = node.ip("pod-a");
    let answers = node.pod_ns("pod-a").run(move || -> Result<Vec<String>> {
        // A port of the ephemeral range no other socket of this fresh namespace holds.
        let local = SocketAddrV4::new(pod_a, 40_000);
        let mut streams = vips
            .iter()
            .map(|&to| connect_from(local, to))
            .collect::<Result<Vec<_>>>()?;
        for (stream, to) in streams.iter_mut().zip(vips) {
            stream.set_read_timeout(Some(TIMEOUT))?;
            stream
                .write_all(b"hello\n")
                .with_context(|| format!("send to {to}"))?;
        }
        streams
            .iter_mut()
            .zip(vips)
            .map(|(stream, to)| {
                let mut text = String::new();
                stream
                    .read_to_string(&mut text)
                    .with_context(|| format!("answer from {to}"))?;
                ensure!(
                    stream.peer_addr()? == to,
                    "peer {:?}, not {to}",
                    stream.peer_addr()
                );
                Ok(text)
            })
            .collect()
    })??;
    for answer in &answers {
        ensure!(answer.starts_with("pod-b "), "answers {answers:?}");
    }
    Ok(())
}
