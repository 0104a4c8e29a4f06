//! Long-lived flows that must outlive the agent: TCP connections and UDP flows, each echoing one
//! line every 10 ms, and what each saw. The criterion is the one Cilium's upgrade tests use for
//! connections that must not be interrupted: no connection reset, no reply later than
//! 10 ms + 250 ms after the one before.
use std::{
    collections::BTreeSet,
    fmt,
    io::{BufRead as _, BufReader, ErrorKind, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{
    echo::{Proto, ServerPair},
    netns::Netns,
};

/// How often a flow sends a line.
pub const ECHO_EVERY: Duration = Duration::from_millis(10);
/// The longest a flow may go without a reply.
pub const MAX_REPLY_GAP: Duration = Duration::from_millis(260);
/// A flow nobody stops ends after this long (and reports it).
const MAX_RUN: Duration = Duration::from_secs(120);
/// A TCP connection that gets no reply for this long counts as broken.
const TCP_REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a flow may take to connect and get its first reply.
const FIRST_REPLY_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_ERRORS_KEPT: usize = 20;
/// How often the servers look at their stop flag.
const SERVER_POLL: Duration = Duration::from_millis(50);

/// TCP and UDP servers on one port that answer each line (TCP) or datagram (UDP) with
/// `"<name> <line>"`, any number of lines per connection. Stopped on drop.
pub struct LineEchoServer {
    _servers: ServerPair,
}

impl LineEchoServer {
    /// Serves on 0.0.0.0:`port` inside `ns`.
    pub fn start(ns: &Netns, name: &str, port: u16) -> Result<Self> {
        let servers = ServerPair::start(ns, name, port, SERVER_POLL, accept_lines, echo_datagrams)?;
        Ok(LineEchoServer { _servers: servers })
    }
}

/// One line through `stream`, echoed back by a LineEchoServer.
pub fn echo_line(stream: &mut BufReader<TcpStream>) -> Result<()> {
    stream.get_mut().write_all(b"ping\n")?;
    let mut line = String::new();
    stream.read_line(&mut line)?;
    ensure!(line.ends_with("ping\n"), "echo {line:?}");
    Ok(())
}

/// A new connection to a LineEchoServer at `to` that echoes a line, with `timeout` for the
/// connect and the answer.
pub fn connect_and_echo_line(to: SocketAddr, timeout: Duration) -> Result<BufReader<TcpStream>> {
    let stream = TcpStream::connect_timeout(&to, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    let mut stream = BufReader::new(stream);
    echo_line(&mut stream)?;
    Ok(stream)
}

fn accept_lines(listener: &TcpListener, name: &str, stop: &Arc<AtomicBool>) {
    let mut connections = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                let (stop, name) = (stop.clone(), name.to_string());
                connections.push(std::thread::spawn(move || echo_lines(stream, &name, &stop)));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    for connection in connections {
        let _ = connection.join();
    }
}

fn echo_lines(stream: TcpStream, name: &str, stop: &AtomicBool) {
    let setup = || -> std::io::Result<TcpStream> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(SERVER_POLL))?;
        stream.try_clone()
    };
    let Ok(mut writer) = setup() else { return };
    let mut reader = BufReader::new(stream);
    // Kept across read timeouts, which may split a line.
    let mut line = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) if line.ends_with(b"\n") => {
                let mut reply = format!("{name} ").into_bytes();
                reply.append(&mut line);
                if writer.write_all(&reply).is_err() {
                    return;
                }
            }
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
}

fn echo_datagrams(socket: &UdpSocket, name: &str, stop: &Arc<AtomicBool>) {
    let mut buf = [0u8; 512];
    while !stop.load(Ordering::Relaxed) {
        if let Ok((len, peer)) = socket.recv_from(&mut buf) {
            let mut reply = format!("{name} ").into_bytes();
            reply.extend_from_slice(&buf[..len]);
            let _ = socket.send_to(&reply, peer);
        }
    }
}

/// What one flow saw from its first reply until it was stopped.
#[derive(Debug, Clone)]
pub struct FlowReport {
    pub label: String,
    pub sent: u64,
    pub replies: u64,
    /// The longest time without a reply (between two replies, or from the last one to the stop).
    pub max_gap: Duration,
    /// Resets, timeouts, replies out of order. A TCP flow ends at its first.
    pub errors: Vec<String>,
    /// The backends that answered.
    pub servers: BTreeSet<String>,
}

impl FlowReport {
    /// No error, no gap over [`MAX_REPLY_GAP`], one backend throughout.
    pub fn check(&self) -> Result<()> {
        ensure!(self.errors.is_empty(), "errors: {:?}", self.errors);
        ensure!(
            self.max_gap <= MAX_REPLY_GAP,
            "no reply for {:?} (at most {MAX_REPLY_GAP:?} allowed)",
            self.max_gap
        );
        ensure!(
            self.servers.len() == 1,
            "answered by {:?}: the flow moved to another backend",
            self.servers
        );
        Ok(())
    }

    fn reply(&mut self, server: &str, last_reply: &mut Instant) {
        let now = Instant::now();
        self.max_gap = self.max_gap.max(now - *last_reply);
        *last_reply = now;
        self.replies += 1;
        self.servers.insert(server.to_string());
    }

    /// Keeps the first few errors (a UDP flow goes on after one, every 10 ms).
    fn error(&mut self, error: String) {
        if self.errors.len() < MAX_ERRORS_KEPT {
            self.errors.push(error);
        }
    }
}

impl fmt::Display for FlowReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: max gap {} ms, {} replies to {} lines, answered by {:?}",
            self.label,
            self.max_gap.as_millis(),
            self.replies,
            self.sent,
            self.servers
        )?;
        if !self.errors.is_empty() {
            write!(f, ", errors {:?}", self.errors)?;
        }
        Ok(())
    }
}

/// Checks every report; the error lists each failing flow.
pub fn check_all(reports: &[FlowReport]) -> Result<()> {
    let failures: Vec<String> = reports
        .iter()
        .filter_map(|r| r.check().err().map(|e| format!("{r}: {e:#}")))
        .collect();
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// One flow, echoing on a thread in a namespace until finished (or dropped).
pub struct Flow {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<FlowReport>>,
}

impl Flow {
    /// Connects from `ns` to `to` and returns once the first reply came back.
    pub fn start(ns: &Netns, proto: Proto, to: SocketAddr, label: &str) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel();
        let path = format!("/run/netns/{}", ns.name());
        let label = label.to_string();
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let mut report = FlowReport {
                    label,
                    sent: 0,
                    replies: 0,
                    max_gap: Duration::ZERO,
                    errors: Vec::new(),
                    servers: BTreeSet::new(),
                };
                let connected = crate::netns::enter(&path).and_then(|()| Echo::connect(proto, to));
                let mut echo = match connected {
                    Ok(echo) => echo,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return report;
                    }
                };
                match echo.first_reply(&mut report) {
                    Ok(()) => {
                        let _ = ready_tx.send(Ok(()));
                        echo.run(&mut report, &stop);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
                report
            }
        });
        let ready = ready_rx
            .recv_timeout(FIRST_REPLY_TIMEOUT * 2)
            .with_context(|| format!("flow to {to} did not start"))?;
        ready.with_context(|| format!("{proto:?} flow to {to}"))?;
        Ok(Flow {
            stop,
            thread: Some(thread),
        })
    }

    pub fn finish(mut self) -> Result<FlowReport> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .expect("joined only here")
            .join()
            .map_err(|_| anyhow::anyhow!("flow thread panicked"))
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The client end of a flow.
enum Echo {
    Tcp(BufReader<TcpStream>, TcpStream),
    Udp(UdpSocket),
}

impl Echo {
    fn connect(proto: Proto, to: SocketAddr) -> Result<Self> {
        Ok(match proto {
            Proto::Tcp => {
                let stream = TcpStream::connect_timeout(&to, FIRST_REPLY_TIMEOUT)
                    .with_context(|| format!("connect {to}"))?;
                stream.set_nodelay(true)?;
                stream.set_read_timeout(Some(TCP_REPLY_TIMEOUT))?;
                Echo::Tcp(BufReader::new(stream.try_clone()?), stream)
            }
            Proto::Udp => {
                let socket = UdpSocket::bind("0.0.0.0:0")?;
                // Connected: replies from any other source than `to` never reach it.
                socket.connect(to)?;
                Echo::Udp(socket)
            }
        })
    }

    /// Line 0 and its reply, the start of the gaps measured.
    fn first_reply(&mut self, report: &mut FlowReport) -> Result<()> {
        let deadline = Instant::now() + FIRST_REPLY_TIMEOUT;
        while Instant::now() < deadline {
            match self.exchange(0, report) {
                Ok(Some(server)) => {
                    report.servers.insert(server);
                    report.replies += 1;
                    return Ok(());
                }
                Ok(None) => {}
                Err(e) => return Err(e),
            }
        }
        bail!("no first reply within {FIRST_REPLY_TIMEOUT:?}")
    }

    /// Sends a line every ECHO_EVERY until stopped.
    fn run(&mut self, report: &mut FlowReport, stop: &AtomicBool) {
        let started = Instant::now();
        let mut last_reply = started;
        let mut seq = 1;
        while !stop.load(Ordering::Relaxed) {
            if started.elapsed() > MAX_RUN {
                report.error(format!("never stopped within {MAX_RUN:?}"));
                break;
            }
            let sent_at = Instant::now();
            match self.exchange(seq, report) {
                Ok(Some(server)) => report.reply(&server, &mut last_reply),
                Ok(None) => {}
                Err(e) => {
                    report.error(format!("line {seq}: {e:#}"));
                    if matches!(self, Echo::Tcp(..)) {
                        break;
                    }
                }
            }
            seq += 1;
            if let Some(rest) = (sent_at + ECHO_EVERY).checked_duration_since(Instant::now()) {
                std::thread::sleep(rest);
            }
        }
        report.max_gap = report.max_gap.max(last_reply.elapsed());
    }

    /// Sends line `seq`; the server that answered it. TCP waits for the reply; UDP waits at
    /// most ECHO_EVERY (None: lost or late; a late reply to an earlier line is skipped).
    fn exchange(&mut self, seq: u64, report: &mut FlowReport) -> Result<Option<String>> {
        report.sent += 1;
        match self {
            Echo::Tcp(reader, writer) => {
                writer.write_all(format!("{seq}\n").as_bytes())?;
                let mut line = String::new();
                if reader.read_line(&mut line)? == 0 {
                    bail!("connection closed");
                }
                let server = answer_to(line.trim_end(), seq)?
                    .with_context(|| format!("reply {line:?} out of order"))?;
                Ok(Some(server))
            }
            Echo::Udp(socket) => {
                socket.send(seq.to_string().as_bytes())?;
                let deadline = Instant::now() + ECHO_EVERY;
                let mut buf = [0u8; 512];
                loop {
                    let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                        return Ok(None);
                    };
                    socket.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
                    match socket.recv(&mut buf) {
                        Ok(len) => {
                            if let Some(server) = answer_to(std::str::from_utf8(&buf[..len])?, seq)?
                            {
                                return Ok(Some(server));
                            }
                        }
                        Err(e)
                            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
                        {
                            return Ok(None);
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
    }
}

/// The server named in `reply` if it answers line `seq`; None if it answers an earlier line.
fn answer_to(reply: &str, seq: u64) -> Result<Option<String>> {
    let (server, number) = reply
        .split_once(' ')
        .with_context(|| format!("malformed reply {reply:?}"))?;
    let number: u64 = number
        .trim_end()
        .parse()
        .with_context(|| format!("reply {reply:?}"))?;
    ensure!(number <= seq, "reply {reply:?} to a line not sent yet");
    Ok((number == seq).then(|| server.to_string()))
}
