//! Bulk transfers for path MTU tests: a server that counts what each connection uploads, the
//! client that uploads, and the path MTU a namespace has learned.
use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};

use crate::{echo::TIMEOUT, netns::Netns};

/// How much each client uploads: dozens of full-size segments.
pub const TRANSFER: usize = 64 * 1024;
/// A transfer that PMTU discovery lets through takes milliseconds; a black hole never ends.
pub const TRANSFER_WAIT: Duration = Duration::from_secs(10);
/// Reads each connection to EOF and answers with the byte count; stopped on drop.
pub struct CountingServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl CountingServer {
    /// Listens on `at` (an unspecified address of either family and a port) inside `ns`.
    pub fn start(ns: &Netns, at: SocketAddr) -> Result<Self> {
        let listener = ns.run(move || -> Result<TcpListener> {
            let listener = TcpListener::bind(at)?;
            listener.set_nonblocking(true)?;
            Ok(listener)
        })??;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => count_to_eof(stream),
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            }
        });
        Ok(CountingServer {
            stop,
            thread: Some(thread),
        })
    }
}

fn count_to_eof(mut stream: TcpStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(TRANSFER_WAIT));
    let mut buf = [0u8; 16 * 1024];
    let mut total = 0usize;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => total += n,
            Err(_) => return,
        }
    }
    let _ = stream.write_all(total.to_string().as_bytes());
}

impl Drop for CountingServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Uploads TRANSFER bytes from `ns` to `to` and returns how long it took until the server's
/// count came back; fails if it does not within TRANSFER_WAIT.
pub fn upload(ns: &Netns, to: SocketAddr) -> Result<Duration> {
    ns.run(move || -> Result<Duration> {
        let start = Instant::now();
        let mut stream =
            TcpStream::connect_timeout(&to, TIMEOUT).with_context(|| format!("connect {to}"))?;
        stream.set_write_timeout(Some(TRANSFER_WAIT))?;
        stream.set_read_timeout(Some(TRANSFER_WAIT))?;
        stream.write_all(&vec![0x5a; TRANSFER])?;
        stream.shutdown(std::net::Shutdown::Write)?;
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .with_context(|| format!("the count from {to} after {:?}", start.elapsed()))?;
        ensure!(
            answer == TRANSFER.to_string(),
            "{to} counted {answer:?} bytes"
        );
        Ok(start.elapsed())
    })?
}

/// The path MTU `ns` has learned towards `to` (`ip route get`: a cached exception).
pub fn learned_mtu(ns: &Netns, to: IpAddr) -> Result<Option<u32>> {
    let output = ns.exec("ip", &["route", "get", &to.to_string()])?;
    let text = String::from_utf8(output.stdout)?;
    let mut words = text.split_whitespace();
    while let Some(word) = words.next() {
        if word == "mtu" {
            return Ok(Some(words.next().context("mtu value")?.parse()?));
        }
    }
    Ok(None)
}
