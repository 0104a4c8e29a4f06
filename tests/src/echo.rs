//! Servers that answer with their name and the source they saw, and the clients that ask them.
use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::netns::Netns;

pub const TIMEOUT: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(5);

/// What a server answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The server's name (the pod's).
    pub server: String,
    /// The source address the server saw.
    pub seen_source: SocketAddr,
    /// The peer the client saw the answer come from (for UDP: recvfrom's address).
    pub peer: SocketAddr,
}

impl Answer {
    /// Ok when one of `servers` answered, having seen `source`, and the client saw `peer`.
    pub fn check(&self, servers: &[&str], source: IpAddr, peer: SocketAddr) -> Result<()> {
        anyhow::ensure!(
            servers.contains(&self.server.as_str())
                && self.seen_source.ip() == source
                && self.peer == peer,
            "{self:?}: expected one of {servers:?}, seeing {source}, seen as {peer}"
        );
        Ok(())
    }
}

/// What one server of a [`ServerPair`] does until `stop` is set, as the server `name`.
pub type Serve<S> = fn(&S, &str, &Arc<AtomicBool>);

/// A TCP and a UDP server on one port, each on a thread of its own, stopped on drop.
pub struct ServerPair {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl ServerPair {
    /// Serves TCP and UDP on 0.0.0.0:`port` inside `ns`; the UDP socket's reads time out after
    /// `udp_poll`, for `udp` to look at its stop flag.
    pub fn start(
        ns: &Netns,
        name: &str,
        port: u16,
        udp_poll: Duration,
        tcp: Serve<TcpListener>,
        udp: Serve<UdpSocket>,
    ) -> Result<Self> {
        let any = IpAddr::from(Ipv4Addr::UNSPECIFIED);
        Self::start_on(ns, name, (any, port).into(), udp_poll, tcp, udp)
    }

    /// [`ServerPair::start`] on `addr`.
    pub fn start_on(
        ns: &Netns,
        name: &str,
        addr: SocketAddr,
        udp_poll: Duration,
        tcp: Serve<TcpListener>,
        udp: Serve<UdpSocket>,
    ) -> Result<Self> {
        let (listener, socket) = ns.run(move || -> Result<_> {
            let listener = TcpListener::bind(addr)?;
            listener.set_nonblocking(true)?;
            let socket = UdpSocket::bind(addr)?;
            socket.set_read_timeout(Some(udp_poll))?;
            Ok((listener, socket))
        })??;
        let stop = Arc::new(AtomicBool::new(false));
        let threads = vec![
            std::thread::spawn({
                let (stop, name) = (stop.clone(), name.to_string());
                move || tcp(&listener, &name, &stop)
            }),
            std::thread::spawn({
                let (stop, name) = (stop.clone(), name.to_string());
                move || udp(&socket, &name, &stop)
            }),
        ];
        Ok(ServerPair { stop, threads })
    }
}

impl Drop for ServerPair {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// TCP and UDP servers on one port answering `"<name> <source>"`, stopped on drop.
pub struct EchoServer {
    _servers: ServerPair,
}

impl EchoServer {
    /// Serves TCP and UDP on 0.0.0.0:`port` inside `ns`, answering `"<name> <source>"`.
    pub fn start(ns: &Netns, name: &str, port: u16) -> Result<Self> {
        Self::start_on(ns, name, (IpAddr::from(Ipv4Addr::UNSPECIFIED), port).into())
    }

    /// [`EchoServer::start`] on [::]:`port` (IPv4 too, as IPv4-mapped addresses, unless a
    /// server holds 0.0.0.0:`port`).
    pub fn start_v6(ns: &Netns, name: &str, port: u16) -> Result<Self> {
        Self::start_on(ns, name, (IpAddr::from(Ipv6Addr::UNSPECIFIED), port).into())
    }

    /// [`EchoServer::start`] on `addr` only: beside a server on 0.0.0.0 of the same port when
    /// `addr` is a (not IPv4-mapped) IPv6 address.
    pub fn start_on(ns: &Netns, name: &str, addr: SocketAddr) -> Result<Self> {
        let servers = ServerPair::start_on(ns, name, addr, POLL * 10, serve_tcp, serve_udp)?;
        Ok(EchoServer { _servers: servers })
    }
}

fn serve_tcp(listener: &TcpListener, name: &str, stop: &Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((mut stream, peer)) => {
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_read_timeout(Some(TIMEOUT));
                let mut request = [0u8; 64];
                if stream.read(&mut request).is_ok() {
                    let _ = stream.write_all(format!("{name} {peer}").as_bytes());
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

fn serve_udp(socket: &UdpSocket, name: &str, stop: &Arc<AtomicBool>) {
    let mut buf = [0u8; 512];
    while !stop.load(Ordering::Relaxed) {
        if let Ok((_, peer)) = socket.recv_from(&mut buf) {
            let _ = socket.send_to(format!("{name} {peer}").as_bytes(), peer);
        }
    }
}

fn parse_answer(text: &str, peer: SocketAddr) -> Result<Answer> {
    let (server, seen) = text
        .split_once(' ')
        .with_context(|| format!("malformed answer {text:?}"))?;
    Ok(Answer {
        server: server.to_string(),
        seen_source: seen.parse().with_context(|| format!("answer {text:?}"))?,
        peer,
    })
}

/// One TCP request to `to` (connect, send, read the answer, close). Call inside a namespace.
pub fn tcp_request(to: SocketAddr) -> Result<Answer> {
    let mut stream =
        TcpStream::connect_timeout(&to, TIMEOUT).with_context(|| format!("connect {to}"))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.write_all(b"hello\n")?;
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .with_context(|| format!("read from {to}"))?;
    parse_answer(&text, stream.peer_addr()?)
}

/// One UDP request from an unconnected socket; the answer's source is the peer. Call inside a
/// namespace.
pub fn udp_request(to: SocketAddr) -> Result<Answer> {
    let mut answers = udp_requests(to, 1)?;
    answers.pop().context("no answer")
}

/// `count` UDP requests, one after the other, from one unconnected socket (one flow).
pub fn udp_requests(to: SocketAddr, count: usize) -> Result<Vec<Answer>> {
    let any: IpAddr = if to.is_ipv6() {
        Ipv6Addr::UNSPECIFIED.into()
    } else {
        Ipv4Addr::UNSPECIFIED.into()
    };
    let socket = UdpSocket::bind((any, 0))?;
    socket.set_read_timeout(Some(TIMEOUT))?;
    let mut buf = [0u8; 512];
    (0..count)
        .map(|_| {
            socket.send_to(b"hello\n", to)?;
            let (len, peer) = socket
                .recv_from(&mut buf)
                .with_context(|| format!("no UDP answer from {to}"))?;
            parse_answer(std::str::from_utf8(&buf[..len])?, peer)
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn request(self, to: SocketAddr) -> Result<Answer> {
        match self {
            Proto::Tcp => tcp_request(to),
            Proto::Udp => udp_request(to),
        }
    }

    pub fn manifest_name(self) -> &'static str {
        match self {
            Proto::Tcp => "TCP",
            Proto::Udp => "UDP",
        }
    }

    /// As iptables and nft spell it.
    pub fn rule_name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// An unconnected UDP socket in `ns` bound to `bind` (`0.0.0.0:0` or `[::]:0`): every datagram
/// it sends leaves from the same source port, as a resolver's.
pub fn udp_socket(ns: &Netns, bind: &str) -> Result<UdpSocket> {
    let bind = bind.to_string();
    ns.run(move || -> Result<UdpSocket> {
        let socket = UdpSocket::bind(bind)?;
        socket.set_read_timeout(Some(TIMEOUT))?;
        Ok(socket)
    })?
}

/// The name of the server that answers one datagram from `socket` to `to`; the answer must come
/// from `to`.
pub fn ask(socket: &UdpSocket, to: SocketAddr) -> Result<String> {
    socket.send_to(b"hello\n", to)?;
    let mut buf = [0u8; 512];
    let (len, peer) = socket
        .recv_from(&mut buf)
        .with_context(|| format!("no answer from {to}"))?;
    anyhow::ensure!(peer == to, "answer from {peer}, asked {to}");
    let text = std::str::from_utf8(&buf[..len])?;
    Ok(text.split(' ').next().unwrap_or_default().to_string())
}

/// How a connection attempt from `ns` to `to` failed, and how long it took; an error if it
/// succeeded. UDP uses a connected socket, which is told about ICMP (ICMPv6) errors.
pub fn refusal(ns: &Netns, proto: Proto, to: SocketAddr) -> Result<(ErrorKind, Duration)> {
    ns.run(move || -> Result<(ErrorKind, Duration)> {
        let start = Instant::now();
        let error = match proto {
            Proto::Tcp => match TcpStream::connect_timeout(&to, TIMEOUT) {
                Ok(_) => bail!("TCP connect to {to} succeeded"),
                Err(e) => e,
            },
            Proto::Udp => {
                let socket = UdpSocket::bind((unspecified(&to), 0))?;
                socket.connect(to)?;
                socket.set_read_timeout(Some(TIMEOUT))?;
                socket.send(b"hello\n")?;
                let mut buf = [0u8; 512];
                match socket.recv(&mut buf) {
                    Ok(_) => bail!("UDP answer from {to}"),
                    Err(e) => e,
                }
            }
        };
        Ok((error.kind(), start.elapsed()))
    })?
}

/// The unspecified address of `to`'s family, for a socket that sends to it.
fn unspecified(to: &SocketAddr) -> IpAddr {
    match to {
        SocketAddr::V4(_) => IpAddr::from(Ipv4Addr::UNSPECIFIED),
        SocketAddr::V6(_) => IpAddr::from(Ipv6Addr::UNSPECIFIED),
    }
}

/// Larger than the links' MTU (1500): three fragments, in either family.
pub const LARGE_DATAGRAM: usize = 4000;

/// Answers `count` datagrams to `local` (a port of the unspecified address of one family), each
/// with `"<source>\n"` and the datagram itself, from inside `ns`.
pub fn serve_large(ns: &Netns, local: SocketAddr, count: usize) -> Result<JoinHandle<Result<()>>> {
    let socket = ns.run(move || -> Result<UdpSocket> {
        let socket = UdpSocket::bind(local)?;
        socket.set_read_timeout(Some(TIMEOUT * 5))?;
        Ok(socket)
    })??;
    Ok(std::thread::spawn(move || -> Result<()> {
        let mut buf = vec![0; LARGE_DATAGRAM * 2];
        // Each bounded by the read timeout.
        for _ in 0..count {
            let (len, peer) = socket.recv_from(&mut buf).context("no datagram")?;
            let mut answer = format!("{peer}\n").into_bytes();
            answer.extend_from_slice(&buf[..len]);
            socket.send_to(&answer, peer)?;
        }
        Ok(())
    }))
}

/// Sends one `size`-byte datagram (at most LARGE_DATAGRAM) from `ns` to `to` (a `serve_large`
/// server behind it); returns the source the server saw and the peer the answer came from,
/// having checked that the answer carries the datagram whole.
pub fn large_exchange(ns: &Netns, to: SocketAddr, size: usize) -> Result<(SocketAddr, SocketAddr)> {
    ns.run(move || -> Result<(SocketAddr, SocketAddr)> {
        let socket = UdpSocket::bind((unspecified(&to), 0))?;
        socket.set_read_timeout(Some(TIMEOUT))?;
        let datagram: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        socket.send_to(&datagram, to)?;
        let mut buf = vec![0; LARGE_DATAGRAM * 2];
        let (len, peer) = socket
            .recv_from(&mut buf)
            .with_context(|| format!("no answer from {to}"))?;
        let answer = &buf[..len];
        let newline = answer
            .iter()
            .position(|&b| b == b'\n')
            .context("answer without a source line")?;
        let seen: SocketAddr = std::str::from_utf8(&answer[..newline])?.parse()?;
        anyhow::ensure!(
            answer[newline + 1..] == datagram[..],
            "the answer's {} bytes are not the datagram",
            len - newline - 1
        );
        Ok((seen, peer))
    })?
}

/// The I/O error kind at the root of a failed request, if it was one.
pub fn error_kind(err: &anyhow::Error) -> Option<ErrorKind> {
    err.root_cause()
        .downcast_ref::<std::io::Error>()
        .map(std::io::Error::kind)
}

/// `count` requests from `ns`, up to the first that fails (at most `count` × the timeout in all).
pub fn requests(ns: &Netns, proto: Proto, to: SocketAddr, count: usize) -> Result<Vec<Answer>> {
    ns.run(move || (0..count).map(|_| proto.request(to)).collect())?
}

/// Six requests from `ns` to `to`, each answered by one of `servers` having seen `source`, the
/// client seeing `to` answer.
pub fn six_answered(
    ns: &Netns,
    proto: Proto,
    to: SocketAddr,
    servers: &[&str],
    source: IpAddr,
) -> Result<()> {
    let answers = requests(ns, proto, to, 6)?;
    anyhow::ensure!(answers.len() == 6, "{answers:?}");
    for answer in &answers {
        answer.check(servers, source, to)?;
    }
    Ok(())
}

/// One request from `ns`.
pub fn request(ns: &Netns, proto: Proto, to: SocketAddr) -> Result<Answer> {
    let mut answers = requests(ns, proto, to, 1)?;
    match answers.pop() {
        Some(answer) => Ok(answer),
        None => bail!("no answer"),
    }
}
