//! B6 restart gap: with `bulk`'s Services × endpoints programmed and pinned, the agent is ended
//! (SIGTERM, as a rolling update does; then SIGKILL, as a crash) and a new one is started with the
//! same flags on the same bpffs. Measured on the new agent's log timestamps, from its spawn: its
//! first sync written (manifests are whole at start, so it comes first) and its programs swapped
//! into the pinned links ("attached to the existing interfaces"). Meanwhile a probe in the client
//! pod opens a new connection to the measured ClusterIP every PROBE_INTERVAL and counts the ones
//! that fail: the old programs serve until the new ones take their place, so none should.
use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result, bail};
use lb_tests::{
    agent::{ATTACHED, SYNC_DONE},
    netns::{Netns, enter},
};
use nix::sys::signal::Signal;
use serde::Serialize;
use time::{OffsetDateTime, format_description::well_known::Rfc3339};

use crate::{
    Progress, interrupt,
    services::ServiceSet,
    traffic::{CLIENT_CPU, one_connection, pin},
    variants::Deployment,
};

/// How the old agent ends: a rolling update's SIGTERM, then a crash.
const SIGNALS: [Signal; 2] = [Signal::SIGTERM, Signal::SIGKILL];
const PROBE_INTERVAL: Duration = Duration::from_millis(1);
/// Bounds of one restart's probing.
const PROBE_TIMEOUT: Duration = Duration::from_secs(120);
const MAX_PROBES: u64 = 200_000;
/// Answers the probe must have before the old agent is ended and after the new one attached, so
/// that it covers the whole restart.
pub const ANSWERS_AROUND: u64 = 20;
/// The agent's log line once its object is loaded and the pinned maps checked and read.
const LOADED: &str = "datapath loaded, maps pinned";
/// The agent's log line for a link whose program it swapped in place, and for a new link.
const REPLACED: &str = "replaced lb_";
const ATTACHED_NEW: &str = "attached lb_";
/// The fields of a "sync done" line that count map writes.
const WRITE_FIELDS: [&str; 6] = [
    "frontends_added",
    "frontends_updated",
    "frontends_removed",
    "backends_added",
    "backends_updated",
    "backends_removed",
];

#[derive(Debug, Serialize)]
pub struct Restart {
    /// How the old agent ended.
    pub signal: &'static str,
    pub services: usize,
    pub endpoints_per_service: usize,
    /// The new agent's spawn → its object loaded, the pinned maps checked and read.
    pub loaded_s: f64,
    /// The new agent's spawn → its first "sync done".
    pub first_sync_s: f64,
    /// The new agent's spawn → "attached to the existing interfaces": every program swapped in.
    pub swapped_s: f64,
    /// Map writes of the new agent's first sync: the pinned maps hold the state already.
    pub first_sync_writes: u64,
    /// Links whose program the new agent replaced in place, and links it attached anew.
    pub links_replaced: usize,
    pub links_attached: usize,
    pub probe: Option<ProbeCount>,
    pub error: Option<String>,
}

/// New connections to the measured ClusterIP across a restart.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ProbeCount {
    pub answered: u64,
    pub failed: u64,
    pub seconds: f64,
    /// The longest time between two answers (the probe's own scheduling delays included: it
    /// shares the 2 CPUs with the agent's start).
    pub longest_gap_ms: f64,
    /// Its end, in seconds from the new agent's spawn.
    pub longest_gap_end_s: f64,
    #[serde(skip)]
    longest_gap_end: SystemTime,
}

/// Restarts the agent of `deployment` (programmed with `set`) once per signal.
pub fn run(
    deployment: &mut Deployment,
    set: &ServiceSet,
    progress: Progress,
) -> Result<Vec<Restart>> {
    let mut restarts = Vec::new();
    for signal in SIGNALS {
        interrupt::check()?;
        let mut restart = Restart {
            signal: signal.as_str(),
            services: set.count,
            endpoints_per_service: set.filler_endpoints,
            loaded_s: 0.0,
            first_sync_s: 0.0,
            swapped_s: 0.0,
            first_sync_writes: 0,
            links_replaced: 0,
            links_attached: 0,
            probe: None,
            error: None,
        };
        if let Err(err) = measure(deployment, set, signal, &mut restart) {
            restart.error = Some(format!("{err:#}"));
        }
        progress(&restart.summary());
        restarts.push(restart);
    }
    Ok(restarts)
}

fn measure(
    deployment: &mut Deployment,
    set: &ServiceSet,
    signal: Signal,
    restart: &mut Restart,
) -> Result<()> {
    let probe = Probe::start(&deployment.topology.client_pod().ns, deployment.target(set));
    probe.wait_for_answers(ANSWERS_AROUND)?;
    let agent = deployment.restart_agent(signal, set)?;
    let log = agent.log();
    let spawned = agent.spawned_at();
    let answered = probe.answered();
    probe.wait_for_answers(answered + ANSWERS_AROUND)?;
    let mut count = probe.finish()?;
    count.longest_gap_end_s = seconds_between(spawned, count.longest_gap_end);
    restart.probe = Some(count);

    restart.loaded_s = seconds_since(spawned, first_line(&log, LOADED)?)?;
    let first_sync = first_line(&log, SYNC_DONE)?;
    restart.first_sync_s = seconds_since(spawned, first_sync)?;
    restart.swapped_s = seconds_since(spawned, first_line(&log, ATTACHED)?)?;
    restart.first_sync_writes = WRITE_FIELDS
        .iter()
        .map(|field| field_value(first_sync, field))
        .sum::<Result<u64>>()?;
    restart.links_replaced = log.lines().filter(|l| l.contains(REPLACED)).count();
    restart.links_attached = log.lines().filter(|l| l.contains(ATTACHED_NEW)).count();
    Ok(())
}

fn first_line<'a>(log: &'a str, needle: &str) -> Result<&'a str> {
    log.lines()
        .find(|l| l.contains(needle))
        .with_context(|| format!("no {needle:?} in the agent's log:\n{log}"))
}

/// From `spawned` to the timestamp that starts the log line `line` (RFC 3339, UTC).
fn seconds_since(spawned: SystemTime, line: &str) -> Result<f64> {
    let stamp = line.split_whitespace().next().unwrap_or_default();
    let at = OffsetDateTime::parse(stamp, &Rfc3339)
        .with_context(|| format!("the timestamp of {line:?}"))?;
    Ok((at - OffsetDateTime::from(spawned)).as_seconds_f64())
}

/// From `from` to `to`, negative when `to` is earlier.
fn seconds_between(from: SystemTime, to: SystemTime) -> f64 {
    match to.duration_since(from) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

/// The value of ` field=<n>` in a log line.
fn field_value(line: &str, field: &str) -> Result<u64> {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(field)?.strip_prefix('='))
        .with_context(|| format!("no {field} in {line:?}"))?
        .parse()
        .with_context(|| format!("{field} in {line:?}"))
}

/// New connections from a namespace to one address, one every PROBE_INTERVAL on a thread of its
/// own, until finished (or PROBE_TIMEOUT, MAX_PROBES).
struct Probe {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    thread: Option<JoinHandle<Result<ProbeCount>>>,
}

impl Probe {
    fn start(client: &Netns, to: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let path = format!("/run/netns/{}", client.name());
        let thread = std::thread::spawn({
            let (stop, answered) = (stop.clone(), answered.clone());
            move || {
                enter(&path)?;
                pin(CLIENT_CPU)?;
                Ok(probe(to, &stop, &answered))
            }
        });
        Probe {
            stop,
            answered,
            thread: Some(thread),
        }
    }

    fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    /// Waits until `count` probes were answered in all.
    fn wait_for_answers(&self, count: u64) -> Result<()> {
        while self.answered() < count {
            interrupt::check()?;
            if self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
                bail!(
                    "the probe ended with {} of {count} answers",
                    self.answered()
                );
            }
            std::thread::sleep(PROBE_INTERVAL);
        }
        Ok(())
    }

    fn finish(mut self) -> Result<ProbeCount> {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.take().expect("joined once");
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("the probe panicked"))?
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn probe(to: SocketAddr, stop: &AtomicBool, answered: &AtomicU64) -> ProbeCount {
    let start = Instant::now();
    let (mut failed, mut last_answer, mut longest_gap) = (0, None, Duration::ZERO);
    let mut longest_gap_end = SystemTime::now();
    for _ in 0..MAX_PROBES {
        let sent = Instant::now();
        if stop.load(Ordering::Relaxed) || sent > start + PROBE_TIMEOUT {
            break;
        }
        match one_connection(to) {
            Ok(_) => {
                let now = Instant::now();
                if let Some(last) = last_answer
                    && now - last > longest_gap
                {
                    longest_gap = now - last;
                    longest_gap_end = SystemTime::now();
                }
                last_answer = Some(now);
                answered.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => failed += 1,
        }
        if let Some(wait) = (sent + PROBE_INTERVAL).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    ProbeCount {
        answered: answered.load(Ordering::Relaxed),
        failed,
        seconds: start.elapsed().as_secs_f64(),
        longest_gap_ms: longest_gap.as_secs_f64() * 1000.0,
        longest_gap_end_s: 0.0,
        longest_gap_end,
    }
}

impl Restart {
    pub fn summary(&self) -> String {
        let mut text = format!(
            "  tc restart after {}: maps loaded {:.3} s, first sync {:.3} s, programs swapped \
             {:.3} s after the new agent's start ({} links replaced in place, {} attached anew, \
             {} map writes)",
            self.signal,
            self.loaded_s,
            self.first_sync_s,
            self.swapped_s,
            self.links_replaced,
            self.links_attached,
            self.first_sync_writes
        );
        if let Some(p) = &self.probe {
            text += &format!(
                "; probe: {} connections, {} failed, longest gap {:.1} ms ending at {:+.3} s",
                p.answered + p.failed,
                p.failed,
                p.longest_gap_ms,
                p.longest_gap_end_s
            );
        }
        if let Some(e) = &self.error {
            text += &format!(" ERROR {e}");
        }
        text
    }
}
