//! TCP connection tracking as Linux's conntrack does it, on real sockets through the node
//! namespace, in both forwarding modes: a half-closed connection stays open while the server
//! takes its time to answer; a RST from outside the connection's window changes nothing; a
//! handshake that never completes expires in the SYN timeouts, not in the established one.
use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    agent::{counter, lb_binary},
    echo::Proto,
    flows::LineEchoServer,
    manifests::{ServiceManifest, yaml},
    netns::Netns,
    node::{CLUSTER_IP, Node, PORT},
    raw::{send_ipv4, tcp_segment},
    topology::NODE_IP,
};
use nix::libc;

// linux/tcp.h, which libc leaves out.
const TCP_REPAIR_ON: libc::c_int = 1;
const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;
const TCP_SEND_QUEUE: libc::c_int = 2;

const NODE_PORT: u16 = 30085;
/// The port of the test's own servers in pod-b (the fixture's echo servers hold 8080).
const SERVER_PORT: u16 = 8090;
/// How long the half-closing client's server waits before it answers: longer than the 10 s an
/// earlier datapath gave a connection after any FIN.
const LATE_ANSWER: Duration = Duration::from_secs(15);
/// How long the RST-hit connection then stays idle: longer than those 10 s.
const IDLE: Duration = Duration::from_secs(12);
const HALF_OPEN: u16 = 50;
/// Linux's SYN_RECV timeout (nf_conntrack_tcp_timeout_syn_recv).
const SYN_RECV_TIMEOUT_S: u64 = 60;
/// A source on the client's link that no namespace holds: the backend's SYN-ACKs to it are
/// never answered (no RST), so the handshakes stay half open.
const SILENT_CLIENT: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 3);
/// `--masquerade-port-range` of the half-open test: inside Linux's default
/// ip_local_port_range (32768-60999).
const MASQUERADE_PORTS: std::ops::RangeInclusive<u16> = 40_000..=40_999;
/// The silent client's first source port.
const SILENT_PORT: u16 = 40_000;

fn forwarding(mode: &str) -> [&str; 2] {
    ["--forwarding", mode]
}

/// The client half-closes (shutdown(SHUT_WR)) after its request; the server reads to the end,
/// waits LATE_ANSWER, then answers on the half-open connection: the answer reaches the client.
fn half_close_then_late_answer(mode: &str) -> Result<()> {
    let mut node = Node::start(2, &[], &forwarding(mode))?;
    let service = ServiceManifest::new("late", CLUSTER_IP, Proto::Tcp, PORT, SERVER_PORT)
        .endpoints([node.ip("pod-b")]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let listener = node
        .pod_ns("pod-b")
        .run(|| TcpListener::bind(("0.0.0.0", SERVER_PORT)))??;
    let server = std::thread::spawn(move || -> Result<()> {
        let mut stream = accept_within(&listener, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut request = Vec::new();
        stream
            .read_to_end(&mut request)
            .context("server: read to EOF")?;
        std::thread::sleep(LATE_ANSWER);
        stream.write_all(b"late answer")?;
        Ok(())
    });
    let vip: SocketAddr = (CLUSTER_IP, PORT).into();
    let answer = node.pod_ns("pod-a").run(move || -> Result<String> {
        let mut stream = TcpStream::connect_timeout(&vip, Duration::from_secs(2))?;
        stream.write_all(b"request")?;
        stream.shutdown(Shutdown::Write)?;
        stream.set_read_timeout(Some(LATE_ANSWER + Duration::from_secs(10)))?;
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .context("client: the late answer")?;
        Ok(answer)
    })?;
    server
        .join()
        .map_err(|_| anyhow::anyhow!("server panicked"))??;
    let answer = answer?;
    ensure!(answer == "late answer", "answer {answer:?}");
    Ok(())
}

/// The first connection `listener` accepts within `timeout`, in blocking mode.
fn accept_within(listener: &TcpListener, timeout: Duration) -> Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                return Ok(stream);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e).context("server: accept"),
        }
    }
}

#[test]
fn a_half_closed_connection_gets_a_late_answer_stack() -> Result<()> {
    half_close_then_late_answer("stack")
}

#[test]
fn a_half_closed_connection_gets_a_late_answer_redirect() -> Result<()> {
    half_close_then_late_answer("redirect")
}

/// The next sequence number `stream` sends (TCP_REPAIR's view of its send queue).
fn next_send_seq(stream: &TcpStream) -> Result<u32> {
    let fd = stream.as_raw_fd();
    let set = |option: libc::c_int, value: libc::c_int| -> Result<()> {
        // SAFETY: a valid socket and a c_int option value of the size passed.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                option,
                (&raw const value).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        ensure!(
            rc == 0,
            "setsockopt {option}: {}",
            std::io::Error::last_os_error()
        );
        Ok(())
    };
    set(libc::TCP_REPAIR, TCP_REPAIR_ON)?;
    set(libc::TCP_REPAIR_QUEUE, TCP_SEND_QUEUE)?;
    let mut seq: u32 = 0;
    let mut len = size_of::<u32>() as libc::socklen_t;
    // SAFETY: a valid socket, a u32 out value of the size passed.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_QUEUE_SEQ,
            (&raw mut seq).cast(),
            &mut len,
        )
    };
    let read = std::io::Error::last_os_error();
    set(libc::TCP_REPAIR, TCP_REPAIR_OFF_NO_WP)?;
    ensure!(rc == 0, "getsockopt TCP_QUEUE_SEQ: {read}");
    Ok(seq)
}

/// One line through `stream`, answered by the line echo server.
fn echo(stream: &mut TcpStream) -> Result<()> {
    stream.write_all(b"ping\n")?;
    let mut buf = [0u8; 64];
    let len = stream.read(&mut buf)?;
    let text = std::str::from_utf8(&buf[..len])?;
    ensure!(text.ends_with("ping\n"), "echo {text:?}");
    Ok(())
}

/// An idle masqueraded NodePort connection gets a RST from outside, its sequence number far
/// outside the window: the datapath drops and counts it, and IDLE later the connection still
/// echoes.
fn out_of_window_rst_then_idle(mode: &str) -> Result<()> {
    let mut node = Node::start(2, &[], &forwarding(mode))?;
    let _server = LineEchoServer::start(node.pod_ns("pod-b"), "pod-b", SERVER_PORT)?;
    let service = ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, SERVER_PORT)
        .node_port(NODE_PORT)
        .endpoints([node.ip("pod-b")]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let client = &node.topology.client;
    let (mut stream, local, seq) = client.run(move || -> Result<_> {
        let mut stream = TcpStream::connect_timeout(&node_port.into(), Duration::from_secs(2))?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        echo(&mut stream)?;
        let local = match stream.local_addr()? {
            SocketAddr::V4(local) => local,
            SocketAddr::V6(_) => bail!("IPv6 local address"),
        };
        let seq = next_send_seq(&stream)?;
        Ok((stream, local, seq))
    })??;
    let before = counter(&node.topology.node, "drop_tcp_out_of_window")?;
    // 1.5 GiB past the next byte: outside any window, on either side of it.
    let rst = tcp_segment(local, node_port, seq.wrapping_add(0x6000_0000), |b| b.rst())?;
    client.run(move || send_ipv4(&rst, NODE_IP))??;
    wait_for_counter(&node.topology.node, "drop_tcp_out_of_window", before + 1)?;
    std::thread::sleep(IDLE);
    echo(&mut stream).context("the connection after the out-of-window RST and the idle time")?;
    Ok(())
}

/// Waits (bounded) until the datapath counter `name` reaches `want`.
fn wait_for_counter(ns: &Netns, name: &str, want: u64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let value = counter(ns, name)?;
        if value >= want {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{name} is {value}, not {want}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_out_of_window_rst_leaves_an_idle_nodeport_connection_open_stack() -> Result<()> {
    out_of_window_rst_then_idle("stack")
}

#[test]
fn an_out_of_window_rst_leaves_an_idle_nodeport_connection_open_redirect() -> Result<()> {
    out_of_window_rst_then_idle("redirect")
}

/// `lb conntrack -o json` in the node namespace.
fn conntrack_rows(node: &Netns) -> Result<Vec<serde_json::Value>> {
    let output = node.exec(&lb_binary().to_string_lossy(), &["conntrack", "-o", "json"])?;
    let rows: serde_json::Value = serde_json::from_slice(&output.stdout)
        .with_context(|| String::from_utf8_lossy(&output.stdout).into_owned())?;
    rows.as_array().cloned().context("conntrack rows")
}

/// HALF_OPEN SYNs to a masqueraded NodePort whose handshakes never complete (the backend's
/// SYN-ACKs go to a source nobody holds): each connection shows in SYN_RECV and expires within
/// Linux's SYN_RECV timeout. The agent runs with a `--masquerade-port-range` inside the node's
/// ephemeral range: it warns of the overlap, and the masquerade ports come from the range.
fn half_open_handshakes(mode: &str) -> Result<()> {
    let range = format!("{}-{}", MASQUERADE_PORTS.start(), MASQUERADE_PORTS.end());
    let args = [&forwarding(mode)[..], &["--masquerade-port-range", &range]].concat();
    let mut node = Node::start(2, &[], &args)?;
    let log = node.agent.log();
    ensure!(
        log.contains("--masquerade-port-range: ports 40000-40999 are also the node's"),
        "no warning of the overlap with ip_local_port_range:\n{log}"
    );
    let service = node.service(Proto::Tcp, &["pod-b"]).node_port(NODE_PORT);
    node.agent.update_manifests(&yaml(&[service]))?;
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let syns = (0..HALF_OPEN)
        .map(|i| {
            let from = SocketAddrV4::new(SILENT_CLIENT, SILENT_PORT + i);
            tcp_segment(from, node_port, 1_000_000 * u32::from(i), |b| b.syn())
        })
        .collect::<Result<Vec<_>>>()?;
    node.topology.client.run(move || -> Result<()> {
        for syn in &syns {
            send_ipv4(syn, NODE_IP)?;
        }
        Ok(())
    })??;
    // Every SYN's SYN-ACK has come back once the rows show them all past SYN_SENT.
    let deadline = Instant::now() + Duration::from_secs(5);
    let rows = loop {
        let rows: Vec<_> = conntrack_rows(&node.topology.node)?
            .into_iter()
            .filter(|row| {
                row["client"]
                    .as_str()
                    .is_some_and(|c| c.starts_with(&format!("{SILENT_CLIENT}:")))
            })
            .collect();
        let answered = rows.iter().filter(|r| r["state"] != "syn_sent").count();
        if answered == usize::from(HALF_OPEN) || Instant::now() > deadline {
            break rows;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    ensure!(
        rows.len() == usize::from(HALF_OPEN),
        "{} connections of the silent client tracked, not {HALF_OPEN}: {rows:#?}",
        rows.len()
    );
    let wrong: Vec<_> = rows
        .iter()
        .filter(|row| {
            let masquerade_port = row["masquerade"]
                .as_str()
                .and_then(|m| m.parse::<SocketAddrV4>().ok())
                .map(|m| m.port());
            row["state"] != "syn_recv"
                || row["expires_in_s"]
                    .as_u64()
                    .is_none_or(|s| s > SYN_RECV_TIMEOUT_S)
                || !masquerade_port.is_some_and(|p| MASQUERADE_PORTS.contains(&p))
        })
        .collect();
    ensure!(
        wrong.is_empty(),
        "{} of {HALF_OPEN} half-open connections not in syn_recv expiring within \
         {SYN_RECV_TIMEOUT_S} s from a masquerade port of {MASQUERADE_PORTS:?}: {:#?}",
        wrong.len(),
        wrong.first()
    );
    Ok(())
}

#[test]
fn half_open_handshakes_expire_in_the_syn_timeout_stack() -> Result<()> {
    half_open_handshakes("stack")
}

#[test]
fn half_open_handshakes_expire_in_the_syn_timeout_redirect() -> Result<()> {
    half_open_handshakes("redirect")
}
