//! B2 and B3 for every variant at every service count.
use std::{path::Path, time::Duration};

use anyhow::Result;
use serde::Serialize;

use crate::{
    Plan, Progress, interrupt, memory,
    restart::{self, Restart},
    results::{Point, Round},
    services::{Family, ServiceSet},
    traffic::{connection_rate, request_rate},
    variants::{Deployment, Variant},
};

/// Bounds of one point, whatever its duration: far above what this box can do.
const MAX_CONNECTIONS: u64 = 1_000_000;
const MAX_REQUESTS: usize = 4_000_000;

/// Every available variant of `variants` in its own topology.
pub fn deploy(variants: &[Variant], bpffs: &Path, progress: Progress) -> Result<Vec<Deployment>> {
    let mut deployments = Vec::new();
    for &variant in variants {
        if !variant.available() {
            progress(&format!("  {}: not installed, skipped", variant.name()));
            continue;
        }
        interrupt::check()?;
        deployments.push(Deployment::new(variant, bpffs, &[])?);
    }
    Ok(deployments)
}

/// At each count and in each family every variant is programmed, then measured in `plan.rounds`
/// rounds that take turns across the variants: a few seconds of the machine's drift (other load
/// on a shared box) then lands on every variant alike, and a point is the median of its rounds.
pub fn run(plan: &Plan, deployments: &mut [Deployment], progress: Progress) -> Result<Vec<Point>> {
    let mut points = Vec::new();
    for &count in &plan.service_counts {
        for &family in &plan.families {
            points.extend(run_count(plan, deployments, count, family, progress)?);
        }
    }
    Ok(points)
}

/// The points of every variant at `count` Services of `family`.
fn run_count(
    plan: &Plan,
    deployments: &mut [Deployment],
    count: usize,
    family: Family,
    progress: Progress,
) -> Result<Vec<Point>> {
    let round_duration = plan.point_duration / plan.rounds;
    let mut measured: Vec<(&mut Deployment, ServiceSet, Point)> = Vec::new();
    for deployment in deployments.iter_mut().filter(|d| d.variant != Variant::Xdp) {
        interrupt::check()?;
        let set = ServiceSet::new(count, 1, deployment.topology.backend_ip(family));
        let mut point = Point::new(deployment.variant, count, family);
        match deployment.program(&set) {
            Ok(took) => point.program_s = Some(took.as_secs_f64()),
            Err(err) => point.error = Some(format!("{err:#}")),
        }
        measured.push((deployment, set, point));
    }
    for _ in 0..plan.rounds {
        for (deployment, set, point) in measured.iter_mut().filter(|m| m.2.error.is_none()) {
            interrupt::check()?;
            match measure_round(deployment, set, round_duration) {
                Ok(round) => point.rounds.push(round),
                Err(err) => point.error = Some(format!("{err:#}")),
            }
        }
    }
    let mut points = Vec::new();
    for (_, _, mut point) in measured {
        point.summarize_rounds();
        progress(&point.summary());
        points.push(point);
    }
    Ok(points)
}

fn measure_round(deployment: &Deployment, set: &ServiceSet, duration: Duration) -> Result<Round> {
    let client = &deployment.topology.client_pod().ns;
    let to = deployment.target(set);
    Ok(Round {
        connections: connection_rate(client, to, duration, MAX_CONNECTIONS)?,
        requests: request_rate(client, to, duration, MAX_REQUESTS)?,
    })
}

/// B6 (bulk) and B7 (agent memory): every variant programs `services` × `endpoints` from
/// nothing: the loaders from a single Service, the agent by starting on them in a deployment of
/// its own (start to its first sync, attached), as a node's agent does. Then (B6 restart) that
/// agent is restarted on its pins.
pub fn bulk(
    plan: &Plan,
    deployments: &mut [Deployment],
    bpffs: &Path,
    progress: Progress,
) -> Result<(Vec<Bulk>, Vec<Restart>)> {
    let (services, endpoints) = plan.bulk;
    let mut bulk = Vec::new();
    let mut restarts = Vec::new();
    for deployment in deployments.iter_mut() {
        // The control plane is the same in both forwarding modes: `tc` stands for both.
        if matches!(
            deployment.variant,
            Variant::Direct | Variant::TcRedirect | Variant::Xdp
        ) {
            continue;
        }
        interrupt::check()?;
        let mut fresh = None;
        let deployment = match deployment.variant {
            Variant::Tc => fresh.insert(Deployment::new(Variant::Tc, bpffs, &[])?),
            _ => {
                deployment.program(&ServiceSet::new(1, 1, deployment.topology.backend().ip))?;
                deployment
            }
        };
        let set = ServiceSet::new(services, endpoints, deployment.topology.backend().ip);
        let seconds = match deployment.program(&set) {
            Ok(took) => took.as_secs_f64(),
            Err(err) => {
                // A loader past its timeout: the others are still worth having.
                progress(&format!("  {:<16} {err:#}", deployment.variant.name()));
                continue;
            }
        };
        let agent_resident_bytes = match deployment.variant {
            Variant::Tc => Some(memory::resident_bytes(deployment.topology.node())?),
            _ => None,
        };
        let entry = Bulk {
            variant: deployment.variant,
            services,
            endpoints_per_service: endpoints,
            seconds,
            agent_resident_bytes,
        };
        progress(&format!(
            "  {:<16} {services} × {endpoints} programmed in {seconds:.2} s{}",
            entry.variant.name(),
            agent_resident_bytes
                .map(|b| format!(", agent RSS {:.0} MiB", b as f64 / 1048576.0))
                .unwrap_or_default()
        ));
        bulk.push(entry);
        if deployment.variant == Variant::Tc && plan.wants_restart() {
            restarts = restart::run(deployment, &set, progress)?;
        }
    }
    Ok((bulk, restarts))
}

#[derive(Debug, Serialize)]
pub struct Bulk {
    pub variant: Variant,
    pub services: usize,
    pub endpoints_per_service: usize,
    /// iptables-restore / nft -f run time; the agent: its start → its first sync applied and
    /// its programs attached (includes loading the object and the manifest's parse).
    pub seconds: f64,
    pub agent_resident_bytes: Option<u64>,
}
