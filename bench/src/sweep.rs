//! B2 and B3 for every variant at every service count. The variants take turns at each count, so
//! that drift of the machine over the run (other load, thermal) lands on all of them alike.
use std::path::Path;

use anyhow::Result;

use crate::{
    Plan, Progress,
    results::Point,
    services::ServiceSet,
    traffic::{connection_rate, request_rate},
    variants::Deployment,
};

/// Bounds of one point, whatever its duration: far above what this box can do.
const MAX_CONNECTIONS: u64 = 1_000_000;
const MAX_REQUESTS: usize = 4_000_000;

/// Every available variant in its own topology.
pub fn deploy(plan: &Plan, bpffs: &Path, progress: Progress) -> Result<Vec<Deployment>> {
    let mut deployments = Vec::new();
    for &variant in &plan.variants {
        if !variant.available() {
            progress(&format!("  {}: not installed, skipped", variant.name()));
            continue;
        }
        deployments.push(Deployment::new(variant, bpffs)?);
    }
    Ok(deployments)
}

pub fn run(plan: &Plan, deployments: &mut [Deployment], progress: Progress) -> Result<Vec<Point>> {
    let mut points = Vec::new();
    for &count in &plan.service_counts {
        for deployment in deployments.iter_mut() {
            let set = ServiceSet::new(count, 1, deployment.topology.backend().ip);
            let point = measure(plan, deployment, &set);
            progress(&point.summary());
            points.push(point);
        }
    }
    Ok(points)
}

fn measure(plan: &Plan, deployment: &mut Deployment, set: &ServiceSet) -> Point {
    let mut point = Point::new(deployment.variant, set.count);
    let result = (|| -> Result<()> {
        point.program_s = Some(deployment.program(set)?.as_secs_f64());
        let client = &deployment.topology.client_pod().ns;
        let to = deployment.target(set);
        point.connections = Some(connection_rate(
            client,
            to,
            plan.point_duration,
            MAX_CONNECTIONS,
        )?);
        point.requests = Some(request_rate(client, to, plan.point_duration, MAX_REQUESTS)?);
        Ok(())
    })();
    if let Err(err) = result {
        point.error = Some(format!("{err:#}"));
    }
    point
}
