//! B6 through the apiserver: the agent as users run it, fed by the in-test list/watch apiserver
//! (lb_tests::fake_apiserver) with `services` Services × 10 endpoints, `--min-sync-period 0s`.
//! - cold start: agent spawn → the sync that programmed every Service (the list's transfer
//!   included);
//! - an EndpointSlice change at the apiserver → the first probe that shows it (control.rs's
//!   probe: a new connection every 200 µs from a client pod);
//! - a relist after every watch expired (410 Gone): expiry → every store listed again, and
//!   what the sync after it joined;
//! - the agent's RSS after the start and after the changes;
//! - SIGTERM → the agent's exit.
use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use lb_tests::{
    agent::{Agent, NODE_NAME},
    fake_apiserver::FakeApiserver,
    topology::NODE_IP,
};
use serde::{Deserialize as _, Serialize};
use serde_json::Value;

use crate::{
    Plan, Progress,
    control::{Latencies, Shows, probe},
    interrupt,
    services::{SERVICE_PORT, ServiceSet},
    topology::BenchTopology,
    traffic::Server,
};

/// Endpoints of every Service but the measured one.
const ENDPOINTS_PER_SERVICE: usize = 10;
const START_TIMEOUT: Duration = Duration::from_secs(300);
const CHANGE_TIMEOUT: Duration = Duration::from_secs(60);
/// Between a change being seen and the next one.
const GAP: Duration = Duration::from_millis(100);
/// Services, EndpointSlices and the Node: each store relists after its watch expired.
const STORES: usize = 3;

#[derive(Debug, Serialize)]
pub struct ApiControlPoint {
    pub services: usize,
    /// Agent spawn → the sync of every Service.
    pub cold_start_s: f64,
    pub services_per_s: f64,
    /// The `took_ms` of the sync that programmed every Service: the cold start beyond the
    /// lists' transfer.
    pub first_sync_s: f64,
    #[serde(flatten)]
    pub changes: Latencies,
    /// Every watch expired → every store listed again.
    pub relist_s: f64,
    /// The agent's `sync done` line after the relist, if it synced.
    pub relist_sync: Option<String>,
    pub rss_start_kib: u64,
    pub rss_after_changes_kib: u64,
    /// SIGTERM → exit.
    pub stop_s: f64,
    pub error: Option<String>,
}

pub fn run(
    plan: &Plan,
    bpffs: &std::path::Path,
    progress: Progress,
) -> Result<Vec<ApiControlPoint>> {
    let mut points = Vec::new();
    for &services in &plan.control_counts {
        interrupt::check()?;
        let mut point = ApiControlPoint {
            services,
            cold_start_s: 0.0,
            services_per_s: 0.0,
            first_sync_s: 0.0,
            changes: Latencies::default(),
            relist_s: 0.0,
            relist_sync: None,
            rss_start_kib: 0,
            rss_after_changes_kib: 0,
            stop_s: 0.0,
            error: None,
        };
        if let Err(err) = measure(plan, bpffs, &mut point) {
            point.error = Some(format!("{err:#}"));
        }
        progress(&point.summary());
        points.push(point);
    }
    Ok(points)
}

fn measure(plan: &Plan, bpffs: &std::path::Path, point: &mut ApiControlPoint) -> Result<()> {
    let topology = BenchTopology::new()?;
    let (a, b) = (topology.backend().ip, topology.second_backend().ip);
    let _servers = [
        Server::start(&topology.backend().ns, b'a')?,
        Server::start(&topology.second_backend().ns, b'b')?,
    ];
    let api = FakeApiserver::start(topology.node())?;
    api.add_node(NODE_NAME, NODE_IP);
    let mut set = ServiceSet::new(point.services, ENDPOINTS_PER_SERVICE, a);
    api.apply_values(objects(&set.yaml())?);

    let pins = bpffs.join(format!("api-{}", point.services));
    let pins = pins.to_str().context("utf-8 path")?;
    // The default --backends-max (262,144) holds 26k Services × 10 endpoints: the agent does not
    // size its maps from the cluster yet.
    let backends_max = (set.endpoint_count() + 1)
        .next_power_of_two()
        .max(262_144)
        .to_string();
    let args = [
        "--bpffs",
        pins,
        "--min-sync-period",
        "0s",
        "--backends-max",
        &backends_max,
    ];
    let start = Instant::now();
    let mut agent = Agent::start_api(&topology.inner, &api, &args, false)?;
    let programmed = format!(" services={} ", point.services);
    agent.wait_for_log(&programmed, START_TIMEOUT)?;
    point.cold_start_s = start.elapsed().as_secs_f64();
    point.services_per_s = point.services as f64 / point.cold_start_s;
    point.first_sync_s = agent
        .log()
        .lines()
        .find(|l| l.contains("sync done") && l.contains(&programmed))
        .and_then(took_ms)
        .context("the first sync's took_ms")?
        / 1000.0;
    point.rss_start_kib = agent.rss_kib()?;

    let steps: [(Vec<Ipv4Addr>, Shows); 4] = [
        (vec![a, b], Shows::AnswerFrom(b'b')),
        (vec![b], Shows::OnlyFrom(b'b')),
        (vec![a, b], Shows::AnswerFrom(b'a')),
        (vec![a], Shows::OnlyFrom(b'a')),
    ];
    let to = (set.measured_ip(), SERVICE_PORT).into();
    let mut latencies = Vec::new();
    for (endpoints, shows) in steps.iter().cycle().take(plan.control_changes) {
        interrupt::check()?;
        set.measured_endpoints = endpoints.iter().map(|&ip| ip.into()).collect();
        let slice = measured_slice(&set)?;
        let changed = Instant::now();
        api.apply_values(vec![slice]);
        let shows = *shows;
        let latency = topology
            .client_pod()
            .ns
            .run(move || probe(changed, to, shows))??;
        latencies.push(latency);
        std::thread::sleep(GAP);
    }
    point.changes = Latencies::of(&latencies);
    point.rss_after_changes_kib = agent.rss_kib()?;

    let lists = agent.log().matches("list complete").count();
    let syncs = agent.log().matches("sync done").count();
    let expired = Instant::now();
    api.expire_watches();
    let deadline = expired + CHANGE_TIMEOUT;
    while agent.log().matches("list complete").count() < lists + STORES {
        interrupt::check()?;
        if Instant::now() > deadline {
            bail!("no relist within {CHANGE_TIMEOUT:?}:\n{}", agent.log());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    point.relist_s = expired.elapsed().as_secs_f64();
    // The sync a relist brings, if any, comes right after it.
    std::thread::sleep(Duration::from_millis(500));
    point.relist_sync = agent
        .log()
        .lines()
        .filter(|l| l.contains("sync done"))
        .nth(syncs)
        .map(str::to_owned);
    let stopping = Instant::now();
    agent.stop()?;
    point.stop_s = stopping.elapsed().as_secs_f64();
    Ok(())
}

/// The `took_ms="…"` of a `sync done` line.
fn took_ms(line: &str) -> Option<f64> {
    let (_, rest) = line.split_once("took_ms=\"")?;
    rest.split('"').next()?.parse().ok()
}

/// The YAML documents of `yaml` as apiserver objects.
fn objects(yaml: &str) -> Result<Vec<Value>> {
    yaml_serde::Deserializer::from_str(yaml)
        .map(|document| Value::deserialize(document).context("bench manifest"))
        .collect()
}

/// The measured Service's EndpointSlice as it is now.
fn measured_slice(set: &ServiceSet) -> Result<Value> {
    objects(&set.measured_yaml())?
        .into_iter()
        .find(|o| o["kind"] == "EndpointSlice")
        .context("the measured Service has a slice")
}

impl ApiControlPoint {
    pub fn summary(&self) -> String {
        let mut text = format!(
            "  apiserver {:>6} services: cold start {:.2} s ({:.0}/s, first sync {:.2} s), {} \
             changes: p50 {:.1} ms p99 {:.1} ms, relist {:.2} s, RSS {} → {} KiB, exit {:.2} s",
            self.services,
            self.cold_start_s,
            self.services_per_s,
            self.first_sync_s,
            self.changes.latencies_ms.len(),
            self.changes.p50_ms,
            self.changes.p99_ms,
            self.relist_s,
            self.rss_start_kib,
            self.rss_after_changes_kib,
            self.stop_s,
        );
        if let Some(e) = &self.error {
            text += &format!(" ERROR {e}");
        }
        text
    }
}
