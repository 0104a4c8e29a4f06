//! The request/response server in a backend pod and the two clients: connection rate (B2) and
//! request rate with latency on one connection (B3). The client runs on CPU 0, the server on
//! CPU 1; every loop ends at its deadline or its count, whichever comes first.
use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use lb_tests::netns::Netns;
use nix::{
    sched::{CpuSet, sched_setaffinity},
    sys::socket::{Shutdown, shutdown},
    unistd::Pid,
};
use serde::Serialize;

use crate::services::{TCP_TARGET_PORT, UDP_TARGET_PORT};

pub const CLIENT_CPU: usize = 0;
pub const SERVER_CPU: usize = 1;
const IO_TIMEOUT: Duration = Duration::from_secs(1);
const WARMUP: Duration = Duration::from_millis(200);

/// Pins the calling thread.
pub fn pin(cpu: usize) -> Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu)?;
    sched_setaffinity(Pid::from_raw(0), &set).context("sched_setaffinity")
}

/// Answers every byte it reads with its `id`, one connection at a time, on TCP_TARGET_PORT of
/// both families; holds a UDP socket on UDP_TARGET_PORT that is never read, so that UDP to it
/// (B5) is not refused.
pub struct Server {
    stop: Arc<AtomicBool>,
    listener: Arc<TcpListener>,
    thread: Option<JoinHandle<()>>,
    _sink: UdpSocket,
}

impl Server {
    pub fn start(ns: &Netns, id: u8) -> Result<Self> {
        let (listener, sink) = ns.run(|| -> Result<_> {
            Ok((
                // Both families: an IPv6 socket that takes IPv4 too (bindv6only is 0).
                TcpListener::bind(("::", TCP_TARGET_PORT))?,
                UdpSocket::bind(("0.0.0.0", UDP_TARGET_PORT))?,
            ))
        })??;
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let (listener, stop) = (listener.clone(), stop.clone());
            move || {
                let _ = pin(SERVER_CPU);
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((stream, _)) = listener.accept() {
                        let _ = serve(stream, id);
                    }
                }
            }
        });
        Ok(Server {
            stop,
            listener,
            thread: Some(thread),
            _sink: sink,
        })
    }
}

fn serve(mut stream: TcpStream, id: u8) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(IO_TIMEOUT * 2))?;
    let mut byte = [0u8; 1];
    while stream.read(&mut byte)? == 1 {
        stream.write_all(&[id])?;
    }
    Ok(())
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the blocking accept (it returns EINVAL on a shut-down listener).
        let _ = shutdown(self.listener.as_raw_fd(), Shutdown::Read);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One connection: connect, 1-byte request, 1-byte response, close. Returns the server's id.
pub fn one_connection(to: SocketAddr) -> std::io::Result<u8> {
    let mut stream = TcpStream::connect_timeout(&to, IO_TIMEOUT)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.write_all(&[1])?;
    let mut id = [0u8; 1];
    stream.read_exact(&mut id)?;
    Ok(id[0])
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct ConnectionRate {
    pub connections: u64,
    pub failures: u64,
    pub per_second: f64,
}

/// B2: sequential connections from `ns` to `to` for `duration` (at most `max`).
pub fn connection_rate(
    ns: &Netns,
    to: SocketAddr,
    duration: Duration,
    max: u64,
) -> Result<ConnectionRate> {
    ns.run(move || -> Result<_> {
        pin(CLIENT_CPU)?;
        let warmup = Instant::now() + WARMUP;
        while Instant::now() < warmup {
            let _ = one_connection(to);
        }
        let start = Instant::now();
        let (mut connections, mut failures) = (0, 0);
        while connections + failures < max && start.elapsed() < duration {
            match one_connection(to) {
                Ok(_) => connections += 1,
                Err(_) => failures += 1,
            }
        }
        Ok(ConnectionRate {
            connections,
            failures,
            per_second: connections as f64 / start.elapsed().as_secs_f64(),
        })
    })?
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct RequestRate {
    pub requests: u64,
    pub per_second: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// B3: 1-byte requests and responses on one connection for `duration` (at most `max`).
pub fn request_rate(
    ns: &Netns,
    to: SocketAddr,
    duration: Duration,
    max: usize,
) -> Result<RequestRate> {
    ns.run(move || -> Result<_> {
        pin(CLIENT_CPU)?;
        let mut stream =
            TcpStream::connect_timeout(&to, IO_TIMEOUT).with_context(|| format!("connect {to}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        let mut byte = [0u8; 1];
        let mut exchange = |stream: &mut TcpStream| -> Result<()> {
            stream.write_all(&[1])?;
            stream.read_exact(&mut byte).context("response")?;
            Ok(())
        };
        let warmup = Instant::now() + WARMUP;
        while Instant::now() < warmup {
            exchange(&mut stream)?;
        }
        let mut latencies_ns: Vec<u64> = Vec::with_capacity(max.min(4_000_000));
        let start = Instant::now();
        while latencies_ns.len() < max && start.elapsed() < duration {
            let sent = Instant::now();
            exchange(&mut stream)?;
            latencies_ns.push(sent.elapsed().as_nanos() as u64);
        }
        let seconds = start.elapsed().as_secs_f64();
        latencies_ns.sort_unstable();
        Ok(RequestRate {
            requests: latencies_ns.len() as u64,
            per_second: latencies_ns.len() as f64 / seconds,
            p50_us: percentile(&latencies_ns, 0.50) / 1000.0,
            p99_us: percentile(&latencies_ns, 0.99) / 1000.0,
        })
    })?
}

/// `sorted` ascending; 0 when empty.
pub fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let index = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[index] as f64
}
