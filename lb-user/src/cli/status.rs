//! `lb status`: per Service, whether the datapath holds what the agent wants (from the records
//! the agent pins next to the maps, `lb_user::reconcile::sync_status`); how full every map is; the last sync
//! and the agent. Fails (exits non-zero) when a Service is not in sync.
use std::collections::BTreeMap;

use anyhow::{Context as _, Result};
use comfy_table::{Table, presets};
use jiff::Timestamp;
use lb_common::{AgentInfo, ServiceStatus, field_text, map_name};
use lb_user::datapath::{self, MapFill, ServiceMaps};
use lb_user::maps::connections::protocol_name;
use lb_user::maps::contents::{MapContents, MapContents6};
use lb_user::maps::pins;
use lb_user::reconcile::sync_status::{self, PortStatus, SyncState, Tally};
use serde::Serialize;

use crate::cli::args::{Output, StatsArgs};

pub fn run(args: StatsArgs) -> Result<()> {
    let dir = pins::find(&args.bpffs, map_name::SERVICE_STATUS)?;
    let pinned = ServiceMaps::pinned(&dir)?;
    let maps = pinned.read()?;
    let maps6 = pinned.read6()?;
    let ports = sync_status::compare(&maps.statuses, &maps, &maps6);
    let fill = datapath::read_map_fill(&dir)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .context("map pressure")?;
    let agent = datapath::read_agent_info(&dir)?;
    let status = Status::new(
        &ports,
        (&maps, &maps6),
        &fill,
        &agent,
        pins::agent_running(),
        Timestamp::now(),
    );
    match args.output {
        Output::Table => print!("{}", status.table()),
        Output::Json => println!("{}", serde_json::to_string_pretty(&status)?),
    }
    let out_of_sync = status.services.iter().filter(|s| s.state != "in sync");
    anyhow::ensure!(
        status.in_sync,
        "{} of {} Services not in sync",
        out_of_sync.count(),
        status.services.len()
    );
    Ok(())
}

/// What `lb status -o json` prints.
#[derive(Debug, Serialize)]
struct Status {
    /// Every Service is in sync.
    in_sync: bool,
    /// By namespace/name; a Service whose entries the agent does not want last.
    services: Vec<ServiceRow>,
    maps: Vec<MapRow>,
    /// None before the agent's first sync.
    last_sync: Option<LastSync>,
    agent: AgentRow,
}

#[derive(Debug, Serialize)]
struct ServiceRow {
    /// "namespace/name"; "" for entries of a port the agent has no record of whose frontends
    /// name no Service.
    service: String,
    /// "in sync", "missing", "extra" or "failed": the worst of its ports'.
    state: &'static str,
    /// The first failed write's operation and error, for a failed Service.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    ports: Vec<PortRow>,
}

#[derive(Debug, Serialize)]
struct PortRow {
    /// "PORT_NAME/PROTOCOL" ("/tcp" for an unnamed port); "" for a port without record.
    port: String,
    service_id: u32,
    state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// What the agent wants; None for a port it has no record of.
    desired: Option<Counts>,
    /// What the maps hold.
    actual: Counts,
}

/// A port's entries in each map (its frontends include its ClusterIP's catch-all).
#[derive(Debug, Serialize)]
struct Counts {
    frontends: u32,
    backends: u32,
    source_ranges: u32,
    origins: u32,
}

impl From<Tally> for Counts {
    fn from(t: Tally) -> Self {
        Counts {
            frontends: t.frontends,
            backends: t.backends,
            source_ranges: t.source_ranges,
            origins: t.origins,
        }
    }
}

#[derive(Debug, Serialize)]
struct MapRow {
    map: &'static str,
    entries: u32,
    max_entries: u32,
}

#[derive(Debug, Serialize)]
struct LastSync {
    /// RFC 3339, UTC.
    time: String,
    time_unix_s: u64,
    /// "ok", or "N map writes failed".
    result: String,
    failed_writes: u32,
}

#[derive(Debug, Serialize)]
struct AgentRow {
    /// Whether an `lb agent` runs in this network namespace.
    running: bool,
    /// The version of the agent that last started on these maps.
    version: String,
    /// RFC 3339, UTC.
    started_at: String,
    started_at_unix_s: u64,
    /// None when no agent runs.
    uptime_s: Option<u64>,
    /// Services and ready endpoints as of the last sync.
    services: u32,
    endpoints: u32,
}

fn rfc3339(unix_s: u64) -> String {
    i64::try_from(unix_s)
        .ok()
        .and_then(|s| Timestamp::from_second(s).ok())
        .map_or_else(|| unix_s.to_string(), |t| t.to_string())
}

impl Status {
    fn new(
        ports: &[PortStatus],
        maps: (&MapContents, &MapContents6),
        fill: &[MapFill],
        agent: &AgentInfo,
        running: bool,
        now: Timestamp,
    ) -> Self {
        let mut services: BTreeMap<(bool, String), Vec<&PortStatus>> = BTreeMap::new();
        for port in ports {
            let name = match &port.record {
                Some(record) => Some(service_name(record)),
                None => unrecorded_service(maps, port.service_id),
            };
            // Ports without record after the others.
            let key = (port.record.is_none(), name.unwrap_or_default());
            services.entry(key).or_default().push(port);
        }
        let services: Vec<ServiceRow> = services
            .into_iter()
            .map(|((_, service), ports)| {
                let worst = ports.iter().map(|p| &p.state).max().expect("a port");
                ServiceRow {
                    service,
                    state: worst.name(),
                    error: failure(worst),
                    ports: ports.into_iter().map(port_row).collect(),
                }
            })
            .collect();
        let last_sync = (agent.last_sync_at_s != 0).then(|| LastSync {
            time: rfc3339(agent.last_sync_at_s),
            time_unix_s: agent.last_sync_at_s,
            result: match agent.last_sync_failed_writes {
                0 => "ok".to_owned(),
                n => format!("{n} map writes failed"),
            },
            failed_writes: agent.last_sync_failed_writes,
        });
        let uptime = now.as_second().max(0) as u64;
        Status {
            in_sync: services.iter().all(|s| s.state == SyncState::InSync.name()),
            services,
            maps: fill
                .iter()
                .map(|f| MapRow {
                    map: f.name,
                    entries: f.entries,
                    max_entries: f.max_entries,
                })
                .collect(),
            last_sync,
            agent: AgentRow {
                running,
                version: field_text(&agent.version).to_owned(),
                started_at: rfc3339(agent.started_at_s),
                started_at_unix_s: agent.started_at_s,
                uptime_s: running.then(|| uptime.saturating_sub(agent.started_at_s)),
                services: agent.services,
                endpoints: agent.endpoints,
            },
        }
    }

    /// The Services, one line per port; then the maps; then the last sync and the agent.
    fn table(&self) -> String {
        let mut services = Table::new();
        services.load_style(presets::NOTHING).set_header([
            "SERVICE",
            "PORT",
            "STATE",
            "FRONTENDS",
            "BACKENDS",
            "SOURCE RANGES",
            "ORIGINS",
            "ERROR",
        ]);
        let or_dash = |s: &str| if s.is_empty() { "-" } else { s }.to_owned();
        for service in &self.services {
            for port in &service.ports {
                // actual/desired; a port without record wants none.
                let count = |actual: fn(&Counts) -> u32| match &port.desired {
                    Some(desired) => format!("{}/{}", actual(&port.actual), actual(desired)),
                    None => format!("{}/-", actual(&port.actual)),
                };
                services.add_row([
                    or_dash(&service.service),
                    or_dash(&port.port),
                    port.state.to_owned(),
                    count(|c| c.frontends),
                    count(|c| c.backends),
                    count(|c| c.source_ranges),
                    count(|c| c.origins),
                    or_dash(port.error.as_deref().unwrap_or("")),
                ]);
            }
        }
        let mut maps = Table::new();
        maps.load_style(presets::NOTHING)
            .set_header(["MAP", "ENTRIES", "MAX", "USE"]);
        for map in &self.maps {
            let used = 100.0 * f64::from(map.entries) / f64::from(map.max_entries.max(1));
            maps.add_row([
                map.map.to_owned(),
                map.entries.to_string(),
                map.max_entries.to_string(),
                format!("{used:.1}%"),
            ]);
        }
        let sync = match &self.last_sync {
            Some(sync) => format!("last sync: {} ({})", sync.time, sync.result),
            None => "last sync: none yet".to_owned(),
        };
        let agent = &self.agent;
        let running = match agent.uptime_s {
            Some(uptime) => format!("running, up {uptime} s"),
            None => "not running".to_owned(),
        };
        let verdict = if self.in_sync {
            "in sync"
        } else {
            "NOT in sync"
        };
        format!(
            "datapath: {verdict}\n\n{services}\n\n{maps}\n\n{sync}\nagent: {} {running} (started {}), {} services, {} endpoints\n",
            agent.version, agent.started_at, agent.services, agent.endpoints
        )
    }
}

fn service_name(record: &ServiceStatus) -> String {
    format!(
        "{}/{}",
        field_text(&record.namespace),
        field_text(&record.name)
    )
}

/// The Service a frontend of `service_id` of either family names in its origin, if any.
fn unrecorded_service(
    (maps, maps6): (&MapContents, &MapContents6),
    service_id: u32,
) -> Option<String> {
    let v4 = maps
        .frontends
        .iter()
        .filter(|(_, f)| f.service_id == service_id)
        .find_map(|(key, _)| maps.origins.get(key));
    let v6 = || {
        maps6
            .frontends
            .iter()
            .filter(|(_, f)| f.service_id == service_id)
            .find_map(|(key, _)| maps6.origins.get(key))
    };
    v4.or_else(v6)
        .map(|o| format!("{}/{}", field_text(&o.namespace), field_text(&o.name)))
}

fn failure(state: &SyncState) -> Option<String> {
    match state {
        SyncState::Failed(error) => Some(error.clone()),
        _ => None,
    }
}

fn port_row(port: &PortStatus) -> PortRow {
    PortRow {
        port: port.record.as_ref().map_or_else(String::new, |r| {
            format!(
                "{}/{}",
                field_text(&r.port_name),
                protocol_name(r.proto as u8)
            )
        }),
        service_id: port.service_id,
        state: port.state.name(),
        error: failure(&port.state),
        desired: port.record.is_some().then(|| port.desired.into()),
        actual: port.actual.into(),
    }
}
