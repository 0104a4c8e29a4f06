//! What a run measured, as written to results.json; the report reads the same structs.
use std::{fs, path::Path};

use anyhow::Result;
use serde::Serialize;

use crate::{
    Plan,
    conntrack_full::ConntrackPoint,
    control::ControlPoint,
    control_api::ApiControlPoint,
    datapath_cost::DatapathCost,
    flood::Flood,
    memory::MapMemory,
    restart::Restart,
    services::Family,
    sweep::Bulk,
    syn_flood::SynFlood,
    traffic::{ConnectionRate, RequestRate},
    variants::Variant,
};

#[derive(Debug, Serialize)]
pub struct Results {
    pub started_utc: String,
    pub kernel: String,
    pub cpus: usize,
    pub smoke: bool,
    pub point_seconds: f64,
    pub rounds: u32,
    /// Wall time of the whole run.
    pub seconds: f64,
    /// B1.
    pub datapath: Vec<DatapathCost>,
    /// B2/B3.
    pub points: Vec<Point>,
    /// B4.
    pub flood: Vec<Flood>,
    /// B5.
    pub conntrack: Vec<ConntrackPoint>,
    /// B5: the SYN flood.
    pub syn_flood: Vec<SynFlood>,
    /// B6: change to first packet.
    pub control: Vec<ControlPoint>,
    /// B6 through the apiserver.
    pub control_api: Vec<ApiControlPoint>,
    /// B6: programming many Services at once; B7: the agent's memory then.
    pub bulk: Vec<Bulk>,
    /// B6: the tc agent of `bulk` restarted on its pins, once per signal.
    pub restarts: Vec<Restart>,
    /// B7.
    pub maps: Vec<MapMemory>,
}

impl Results {
    pub fn new(plan: &Plan) -> Result<Self> {
        Ok(Results {
            started_utc: timestamp()?,
            kernel: fs::read_to_string("/proc/sys/kernel/osrelease")?
                .trim()
                .to_string(),
            cpus: std::thread::available_parallelism()?.get(),
            smoke: plan.smoke,
            point_seconds: plan.point_duration.as_secs_f64(),
            rounds: plan.rounds,
            seconds: 0.0,
            datapath: Vec::new(),
            points: Vec::new(),
            flood: Vec::new(),
            conntrack: Vec::new(),
            syn_flood: Vec::new(),
            control: Vec::new(),
            control_api: Vec::new(),
            bulk: Vec::new(),
            restarts: Vec::new(),
            maps: Vec::new(),
        })
    }

    pub fn write(&self, dir: &Path) -> Result<()> {
        fs::write(
            dir.join("results.json"),
            serde_json::to_string_pretty(self)?,
        )?;
        Ok(())
    }

    pub fn point(&self, variant: Variant, services: usize, family: Family) -> Option<&Point> {
        self.points
            .iter()
            .find(|p| p.variant == variant && p.services == services && p.family == family)
    }

    /// The variants that have points, in the order they were measured.
    pub fn variants(&self) -> Vec<Variant> {
        let mut variants: Vec<Variant> = Vec::new();
        for point in &self.points {
            if !variants.contains(&point.variant) {
                variants.push(point.variant);
            }
        }
        variants
    }

    pub fn service_counts(&self) -> Vec<usize> {
        let mut counts: Vec<usize> = self.points.iter().map(|p| p.services).collect();
        counts.sort_unstable();
        counts.dedup();
        counts
    }

    /// The families that have points, IPv4 first.
    pub fn families(&self) -> Vec<Family> {
        let mut families: Vec<Family> = self.points.iter().map(|p| p.family).collect();
        families.sort_unstable();
        families.dedup();
        families
    }
}

/// B2 and B3 of one variant at one service count.
#[derive(Debug, Serialize)]
pub struct Point {
    pub variant: Variant,
    pub services: usize,
    /// The family of the Services' addresses and the client's connections.
    pub family: Family,
    /// How long the variant took to load this count's rules (the agent: to sync them).
    pub program_s: Option<f64>,
    /// The medians of `rounds`: each rate, p50 and p99 on its own (counts are summed).
    pub connections: Option<ConnectionRate>,
    pub requests: Option<RequestRate>,
    pub rounds: Vec<Round>,
    pub error: Option<String>,
}

/// One round of a point: its share of the point's duration for each measurement.
#[derive(Debug, Serialize)]
pub struct Round {
    pub connections: ConnectionRate,
    pub requests: RequestRate,
}

impl Point {
    pub fn new(variant: Variant, services: usize, family: Family) -> Self {
        Point {
            variant,
            services,
            family,
            program_s: None,
            connections: None,
            requests: None,
            rounds: Vec::new(),
            error: None,
        }
    }

    /// Sets `connections` and `requests` from the rounds (none when there are none).
    pub fn summarize_rounds(&mut self) {
        if self.rounds.is_empty() {
            return;
        }
        let median_of = |value: fn(&Round) -> f64| {
            let mut values: Vec<f64> = self.rounds.iter().map(value).collect();
            values.sort_by(f64::total_cmp);
            let mid = values.len() / 2;
            if values.len().is_multiple_of(2) {
                (values[mid - 1] + values[mid]) / 2.0
            } else {
                values[mid]
            }
        };
        self.connections = Some(ConnectionRate {
            connections: self.rounds.iter().map(|r| r.connections.connections).sum(),
            failures: self.rounds.iter().map(|r| r.connections.failures).sum(),
            per_second: median_of(|r| r.connections.per_second),
        });
        self.requests = Some(RequestRate {
            requests: self.rounds.iter().map(|r| r.requests.requests).sum(),
            per_second: median_of(|r| r.requests.per_second),
            p50_us: median_of(|r| r.requests.p50_us),
            p99_us: median_of(|r| r.requests.p99_us),
        });
    }

    pub fn summary(&self) -> String {
        let mut text = format!(
            "  {:<16} {:>6} services {}:",
            self.variant.name(),
            self.services,
            self.family.name()
        );
        if let Some(c) = &self.connections {
            text += &format!(" {:>8.0} conn/s ({} failed)", c.per_second, c.failures);
        }
        if let Some(r) = &self.requests {
            text += &format!(
                " {:>8.0} req/s p50 {:.1} µs p99 {:.1} µs",
                r.per_second, r.p50_us, r.p99_us
            );
        }
        if let Some(e) = &self.error {
            text += &format!(" ERROR {e}");
        }
        text
    }
}

/// UTC, `YYYYMMDD-HHMMSS`: sorts by time as a directory name.
pub fn timestamp() -> Result<String> {
    let format = time::macros::format_description!("[year][month][day]-[hour][minute][second]");
    Ok(time::OffsetDateTime::now_utc().format(&format)?)
}
