//! Whether the service maps hold what the agent wants, per Service port, readable without the
//! agent: at every sync the agent records a checksum and the counts of each port's desired
//! entries in the pinned `SERVICE_STATUS` map (with the writes that failed), and `lb status`
//! computes the same of what the maps hold and compares. Both go through [`tallies`], so the
//! two sides cannot count differently.
use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use bytemuck::bytes_of as bytes;
use lb_common::{
    Backend, BackendKey, Frontend, FrontendKey, FrontendOrigin, ServiceStatus, field_text, ipv4_be,
    text_field,
};

use crate::model::ServicePortId;
use crate::reconcile::{MapContents, SourceRange, WriteFailure};

/// A service port's entries in a [`MapContents`], summed up: a checksum and how many of each.
/// A port's entries are its frontends, the catch-all of its ClusterIP, its backend slots, its
/// source ranges and the origins of its frontends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub digest: u32,
    pub frontends: u32,
    pub backends: u32,
    pub source_ranges: u32,
    pub origins: u32,
}

/// One port's entries, in key order.
#[derive(Default)]
struct PortEntries<'a> {
    frontends: Vec<(&'a FrontendKey, &'a Frontend)>,
    backends: Vec<(&'a BackendKey, &'a Backend)>,
    source_ranges: Vec<&'a SourceRange>,
    origins: Vec<(&'a FrontendKey, &'a FrontendOrigin)>,
}

/// The tally of every service port in `contents`, by service id. `cluster_ip` gives a port's
/// ClusterIP (network byte order), whose catch-all is counted with it; None: no catch-all.
pub fn tallies(
    contents: &MapContents,
    cluster_ip: impl Fn(u32) -> Option<u32>,
) -> BTreeMap<u32, Tally> {
    let mut ports: BTreeMap<u32, PortEntries> = BTreeMap::new();
    // Service id 0: the catch-alls, which belong to every port of their ClusterIP.
    for (key, frontend) in contents.frontends.iter().filter(|(_, f)| f.service_id != 0) {
        let port = ports.entry(frontend.service_id).or_default();
        port.frontends.push((key, frontend));
        if let Some(origin) = contents.origins.get(key) {
            port.origins.push((key, origin));
        }
    }
    for (key, backend) in &contents.backends {
        ports
            .entry(key.service_id)
            .or_default()
            .backends
            .push((key, backend));
    }
    for range in &contents.source_ranges {
        ports
            .entry(range.service_id)
            .or_default()
            .source_ranges
            .push(range);
    }
    ports
        .into_iter()
        .map(|(service_id, entries)| {
            let catch_all = cluster_ip(service_id)
                .map(FrontendKey::any_port)
                .and_then(|key| contents.frontends.get_key_value(&key));
            (service_id, tally(&entries, catch_all))
        })
        .collect()
}

fn tally(entries: &PortEntries, catch_all: Option<(&FrontendKey, &Frontend)>) -> Tally {
    let mut digest = crc32fast::Hasher::new();
    for (key, frontend) in entries.frontends.iter().chain(&catch_all) {
        digest.update(bytes(*key));
        digest.update(bytes(*frontend));
    }
    for (key, backend) in &entries.backends {
        digest.update(bytes(*key));
        digest.update(bytes(*backend));
    }
    for range in &entries.source_ranges {
        digest.update(&range.service_id.to_ne_bytes());
        digest.update(&range.net.addr().octets());
        digest.update(&[range.net.prefix_len()]);
    }
    for (key, origin) in &entries.origins {
        digest.update(bytes(*key));
        digest.update(bytes(*origin));
    }
    let count = |n: usize| n as u32;
    Tally {
        digest: digest.finalize(),
        frontends: count(entries.frontends.len() + usize::from(catch_all.is_some())),
        backends: count(entries.backends.len()),
        source_ranges: count(entries.source_ranges.len()),
        origins: count(entries.origins.len()),
    }
}

/// The record of service port `port` (of ClusterIP `cluster_ip`) whose desired entries tally
/// `desired`, and whose writes in the sync failed as `failure` says.
pub fn record(
    port: &ServicePortId,
    cluster_ip: Ipv4Addr,
    desired: Tally,
    failure: Option<&WriteFailure>,
) -> ServiceStatus {
    ServiceStatus {
        namespace: text_field(&port.service.namespace),
        name: text_field(&port.service.name),
        port_name: text_field(&port.port_name),
        cluster_ip: ipv4_be(cluster_ip.octets()),
        proto: u32::from(port.protocol.ipproto()),
        digest: desired.digest,
        frontends: desired.frontends,
        backends: desired.backends,
        source_ranges: desired.source_ranges,
        origins: desired.origins,
        failed_writes: failure.map_or(0, |f| f.writes as u32),
        error: text_field(failure.map_or("", |f| &f.error)),
    }
}

/// How a service port's entries in the maps compare with what the agent wants.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SyncState {
    InSync,
    /// Entries are there that the agent does not want: more than it wants, or of a port it
    /// does not know.
    Extra,
    /// Entries the agent wants are not there (or not as it wants them).
    Missing,
    /// The agent's writes of the port failed in its last sync: the error.
    Failed(String),
}

impl SyncState {
    pub fn name(&self) -> &'static str {
        match self {
            SyncState::InSync => "in sync",
            SyncState::Extra => "extra",
            SyncState::Missing => "missing",
            SyncState::Failed(_) => "failed",
        }
    }
}

/// One service port as `lb status` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortStatus {
    pub service_id: u32,
    /// None: the maps hold entries of a port the agent has no record of.
    pub record: Option<ServiceStatus>,
    /// What the agent wants (from its record).
    pub desired: Tally,
    /// What the maps hold.
    pub actual: Tally,
    pub state: SyncState,
}

/// Every port of `records` (what the agent wants, by service id) and every other port with
/// entries in `actual` (what the maps hold), in service id order.
pub fn compare(records: &BTreeMap<u32, ServiceStatus>, actual: &MapContents) -> Vec<PortStatus> {
    let mut actual = tallies(actual, |id| records.get(&id).map(|r| r.cluster_ip));
    let mut ports: Vec<PortStatus> = records
        .iter()
        .map(|(&service_id, record)| {
            let desired = Tally {
                digest: record.digest,
                frontends: record.frontends,
                backends: record.backends,
                source_ranges: record.source_ranges,
                origins: record.origins,
            };
            // A port without frontends and slots (all of them lost) has no tally.
            let actual = actual.remove(&service_id).unwrap_or_default();
            let state = if record.failed_writes > 0 {
                SyncState::Failed(field_text(&record.error).to_owned())
            } else {
                state(desired, actual)
            };
            PortStatus {
                service_id,
                record: Some(*record),
                desired,
                actual,
                state,
            }
        })
        .collect();
    ports.extend(actual.into_iter().map(|(service_id, actual)| PortStatus {
        service_id,
        record: None,
        desired: Tally::default(),
        actual,
        state: SyncState::Extra,
    }));
    ports.sort_by_key(|p| p.service_id);
    ports
}

/// In sync when the maps hold exactly the desired entries; missing when fewer of any map are
/// there, or as many but not the same (a desired entry is not there as desired); else extra.
fn state(desired: Tally, actual: Tally) -> SyncState {
    if desired == actual {
        return SyncState::InSync;
    }
    let counts = |t: Tally| [t.frontends, t.backends, t.source_ranges, t.origins];
    let (desired, actual) = (counts(desired), counts(actual));
    let fewer = desired.iter().zip(&actual).any(|(d, a)| a < d);
    if fewer || desired == actual {
        SyncState::Missing
    } else {
        SyncState::Extra
    }
}
