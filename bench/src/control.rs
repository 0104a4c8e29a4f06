//! B6: control-plane latency. With `services` Services programmed, the measured Service's
//! endpoints go {a} → {a,b} → {b} → {a,b} → {a} → ... one change at a time, each a rename of the
//! measured Service's own manifest file (MEASURED_FILE; the others stay in services.yaml, as one
//! object changing is one file changing in a directory kept by a tool). A probe in the client pod opens a new connection to the ClusterIP about
//! every PROBE_INTERVAL; the latency of a change is from the rename to the send time of the first
//! probe that shows it: for an added endpoint, the first answer from it; for a removed one, the
//! first of STREAK answers in a row from the endpoint that stays (before the change, each answer
//! has an even chance of being either). Run with the agent's --min-sync-period at its default
//! and at 0s, each in a deployment of its own. The client pod reuses TIME_WAIT ports, so probes
//! reopen tuples of connections still closing in the datapath, which must choose anew.
use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::Serialize;

use crate::{
    Plan, Progress, interrupt,
    services::ServiceSet,
    traffic::{CLIENT_CPU, one_connection, percentile, pin},
    variants::{Deployment, Variant, replace_manifest_file, replace_manifests, wait_for_sync},
};

/// `--min-sync-period` values: the agent's default, and none.
pub const MIN_SYNC_PERIODS: [&str; 2] = ["1s", "0s"];
const PROBE_INTERVAL: Duration = Duration::from_micros(200);
/// Answers in a row from the remaining endpoint that show a removal (chance 2^-24 before it).
const STREAK: u32 = 24;
/// Bounds of one change's probing.
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_PROBES: u32 = 300_000;
/// The sync that follows a change, after its probe saw it.
const SYNC_TIMEOUT: Duration = Duration::from_secs(120);
/// Between a change being seen and the next one.
const GAP: Duration = Duration::from_millis(100);
/// The measured Service's manifest file while its changes are measured.
const MEASURED_FILE: &str = "bench.yaml";

/// The change-to-first-packet latencies of a run of changes.
#[derive(Debug, Default, Serialize)]
pub struct Latencies {
    pub latencies_ms: Vec<f64>,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl Latencies {
    pub fn of(latencies: &[Duration]) -> Self {
        let mut ns: Vec<u64> = latencies.iter().map(|l| l.as_nanos() as u64).collect();
        ns.sort_unstable();
        Latencies {
            latencies_ms: latencies.iter().map(|l| l.as_secs_f64() * 1000.0).collect(),
            p50_ms: percentile(&ns, 0.50) / 1e6,
            p99_ms: percentile(&ns, 0.99) / 1e6,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct ControlPoint {
    pub min_sync_period: &'static str,
    pub services: usize,
    /// Agent start (or manifest rename) to the sync of all `services`.
    pub program_s: f64,
    #[serde(flatten)]
    pub changes: Latencies,
    pub error: Option<String>,
}

/// What a probe waits for after a change.
#[derive(Clone, Copy)]
pub enum Shows {
    /// An answer from this server (an added endpoint).
    AnswerFrom(u8),
    /// STREAK answers in a row from this server (the other endpoint was removed).
    OnlyFrom(u8),
}

pub fn run(plan: &Plan, bpffs: &Path, progress: Progress) -> Result<Vec<ControlPoint>> {
    let mut points = Vec::new();
    for period in MIN_SYNC_PERIODS {
        interrupt::check()?;
        let mut deployment = Deployment::new(Variant::Tc, bpffs, &["--min-sync-period", period])?;
        for &services in &plan.control_counts {
            interrupt::check()?;
            let mut point = ControlPoint {
                min_sync_period: period,
                services,
                program_s: 0.0,
                changes: Latencies::default(),
                error: None,
            };
            if let Err(err) = measure(plan, &mut deployment, &mut point) {
                point.error = Some(format!("{err:#}"));
            }
            progress(&point.summary());
            points.push(point);
        }
    }
    Ok(points)
}

fn measure(plan: &Plan, deployment: &mut Deployment, point: &mut ControlPoint) -> Result<()> {
    let (a, b) = (
        deployment.topology.backend().ip,
        deployment.topology.second_backend().ip,
    );
    let mut set = ServiceSet::new(point.services, 1, a);
    // The previous count's measured Service leaves its own file first: `program` writes every
    // Service to services.yaml.
    if let Some(agent) = deployment.agent() {
        let measured_file = agent.manifest_dir().join(MEASURED_FILE);
        if measured_file.exists() {
            std::fs::remove_file(measured_file)?;
            wait_for_sync(agent, SYNC_TIMEOUT)?;
        }
    }
    point.program_s = deployment.program(&set)?.as_secs_f64();
    // Then into a file of its own: out of services.yaml, then into MEASURED_FILE, each synced.
    let agent = deployment.agent().context("the agent is not running")?;
    replace_manifests(agent, &set.filler_yaml())?;
    wait_for_sync(agent, SYNC_TIMEOUT)?;
    replace_manifest_file(agent, MEASURED_FILE, &set.measured_yaml())?;
    wait_for_sync(agent, SYNC_TIMEOUT)?;
    let steps: [(Vec<Ipv4Addr>, Shows); 4] = [
        (vec![a, b], Shows::AnswerFrom(b'b')),
        (vec![b], Shows::OnlyFrom(b'b')),
        (vec![a, b], Shows::AnswerFrom(b'a')),
        (vec![a], Shows::OnlyFrom(b'a')),
    ];
    let mut latencies = Vec::new();
    for (endpoints, shows) in steps.iter().cycle().take(plan.control_changes) {
        interrupt::check()?;
        set.measured_endpoints = endpoints.iter().map(|&ip| ip.into()).collect();
        let yaml = set.measured_yaml();
        let to = deployment.target(&set);
        let agent = deployment.agent().context("the agent is not running")?;
        let changed = Instant::now();
        replace_manifest_file(agent, MEASURED_FILE, &yaml)?;
        let shows = *shows;
        let latency = deployment
            .topology
            .client_pod()
            .ns
            .run(move || probe(changed, to, shows))??;
        let agent = deployment.agent().context("the agent is not running")?;
        wait_for_sync(agent, SYNC_TIMEOUT)?;
        latencies.push(latency);
        std::thread::sleep(GAP);
    }
    point.changes = Latencies::of(&latencies);
    Ok(())
}

/// Probes `to` until it `shows` the change made at `changed`; returns how long after it.
pub fn probe(changed: Instant, to: SocketAddr, shows: Shows) -> Result<Duration> {
    pin(CLIENT_CPU)?;
    let mut streak_start: Option<Instant> = None;
    let mut streak = 0;
    for _ in 0..MAX_PROBES {
        let sent = Instant::now();
        if sent > changed + PROBE_TIMEOUT {
            break;
        }
        let answer = one_connection(to).ok();
        match shows {
            Shows::AnswerFrom(id) if answer == Some(id) => return Ok(sent - changed),
            Shows::OnlyFrom(id) if answer == Some(id) => {
                let start = *streak_start.get_or_insert(sent);
                streak += 1;
                if streak == STREAK {
                    return Ok(start - changed);
                }
            }
            _ => {
                streak_start = None;
                streak = 0;
            }
        }
        if let Some(wait) = (sent + PROBE_INTERVAL).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    bail!("the change did not show within {PROBE_TIMEOUT:?} or {MAX_PROBES} probes")
}

impl ControlPoint {
    pub fn summary(&self) -> String {
        let mut text = format!(
            "  --min-sync-period {:<3} {:>6} services: programmed in {:.2} s, {} changes: p50 \
             {:.1} ms p99 {:.1} ms",
            self.min_sync_period,
            self.services,
            self.program_s,
            self.changes.latencies_ms.len(),
            self.changes.p50_ms,
            self.changes.p99_ms
        );
        if let Some(e) = &self.error {
            text += &format!(" ERROR {e}");
        }
        text
    }
}
