//! Prometheus metrics (prometheus-client), named as kube-proxy names them where it has one, so
//! its dashboards and alerts keep working.
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tracing::debug;

use crate::datapath;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MapLabel {
    pub map: String,
}

/// kube-proxy's `traffic_policy`: "internal" or "external".
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficPolicyLabel {
    pub traffic_policy: String,
}

/// Every metric; all are atomics, shared between the sync loop and the metrics server.
pub struct Metrics {
    registry: Registry,
    pub sync_duration: Histogram,
    /// Syncs that read every service (the first, and after a relist).
    pub sync_full_duration: Histogram,
    /// Syncs of the changed services only.
    pub sync_partial_duration: Histogram,
    pub endpoint_changes_pending: Gauge,
    pub endpoint_changes: Counter,
    pub service_changes_pending: Gauge,
    pub service_changes: Counter,
    pub no_local_endpoints: Family<TrafficPolicyLabel, Gauge>,
    /// Read from the pinned maps at each scrape.
    pub datapath_drops: Family<ReasonLabel, Counter>,
    pub map_entries: Family<MapLabel, Gauge>,
    pub map_max_entries: Family<MapLabel, Gauge>,
    pub last_sync_timestamp: Gauge<f64, AtomicU64>,
    pub last_queued_timestamp: Gauge<f64, AtomicU64>,
    pub network_programming: Histogram,
    pub services: Gauge,
    pub endpoints: Gauge,
    pub map_write_failures: Counter,
    /// Map entries the periodic audit found differing from what the agent wrote.
    pub audit_repairs: Counter,
    pub healthz: Family<CodeLabel, Counter>,
    pub livez: Family<CodeLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        // 1 ms to ~9 min: a map sync takes milliseconds, network programming includes the
        // apiserver's and the min-sync-period's delays.
        let buckets = || exponential_buckets(0.001, 2.0, 20);
        let m = Metrics {
            registry: Registry::default(),
            sync_duration: Histogram::new(buckets()),
            sync_full_duration: Histogram::new(buckets()),
            sync_partial_duration: Histogram::new(buckets()),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes: Counter::default(),
            no_local_endpoints: Family::default(),
            datapath_drops: Family::default(),
            map_entries: Family::default(),
            map_max_entries: Family::default(),
            last_sync_timestamp: Gauge::default(),
            last_queued_timestamp: Gauge::default(),
            network_programming: Histogram::new(buckets()),
            services: Gauge::default(),
            endpoints: Gauge::default(),
            map_write_failures: Counter::default(),
            audit_repairs: Counter::default(),
            healthz: Family::default(),
            livez: Family::default(),
        };
        let mut registry = Registry::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "How long a sync of the service maps took",
            m.sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "How long a sync of every service took",
            m.sync_full_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "How long a sync of the changed services took",
            m.sync_partial_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Services whose endpoint changes are not in the maps yet (their writes failed and are retried)",
            m.endpoint_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative endpoint changes synced, one per service whose endpoints changed",
            m.endpoint_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Services whose changes are not in the maps yet (their writes failed and are retried)",
            m.service_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative service changes synced, one per service added, removed or changed (endpoints aside)",
            m.service_changes.clone(),
        );
        registry.register(
            // A gauge, as kube-proxy's, despite the name.
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Services with a Local traffic policy and endpoints, none of them ready on this node",
            m.no_local_endpoints.clone(),
        );
        registry.register(
            "lb_datapath_drops",
            "Packets the datapath dropped, by reason (`lb stats` shows the counters of each)",
            m.datapath_drops.clone(),
        );
        registry.register(
            "lb_map_entries",
            "Entries in each pinned map (an array always holds all)",
            m.map_entries.clone(),
        );
        registry.register(
            "lb_map_max_entries",
            "Size of each pinned map",
            m.map_max_entries.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "When the service maps were last synced (Unix time)",
            m.last_sync_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "When the last change to sync was queued (Unix time)",
            m.last_queued_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "From an EndpointSlice's endpoints.kubernetes.io/last-change-trigger-time to the maps holding the change",
            m.network_programming.clone(),
        );
        registry.register(
            "lb_services_programmed",
            "Services in the maps",
            m.services.clone(),
        );
        registry.register(
            "lb_endpoints_programmed",
            "Ready endpoints in the maps, over all service ports",
            m.endpoints.clone(),
        );
        registry.register(
            "lb_map_write_failures",
            "Service map writes that failed (each is retried by a later sync)",
            m.map_write_failures.clone(),
        );
        registry.register(
            "lb_sync_audit_repairs",
            "Service map entries the --sync-period audit found changed, lost or added behind the \
             agent's back (each is rewritten or removed by the next sync)",
            m.audit_repairs.clone(),
        );
        registry.register(
            "kubeproxy_proxy_healthz",
            "/healthz answers by HTTP status code",
            m.healthz.clone(),
        );
        registry.register(
            "kubeproxy_proxy_livez",
            "/livez answers by HTTP status code",
            m.livez.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Reads the drop counters and the maps' fill from the maps pinned in `pin_dir`. Before the
    /// agent pinned them (or if a read fails) the last values stay.
    pub fn read_datapath(&self, pin_dir: &Path) {
        match datapath::read_counters(pin_dir) {
            Ok(values) => {
                // Counter::drop_reason is the one table of reasons, as `lb stats` shows them.
                let mut drops: BTreeMap<&str, u64> = BTreeMap::new();
                for (counter, value) in values {
                    if let Some(reason) = counter.drop_reason() {
                        *drops.entry(reason).or_default() += value;
                    }
                }
                for (reason, packets) in drops {
                    let label = ReasonLabel {
                        reason: reason.to_owned(),
                    };
                    self.datapath_drops
                        .get_or_create(&label)
                        .inner()
                        .store(packets, Ordering::Relaxed);
                }
            }
            Err(err) => debug!(error = %err, "datapath counters not read"),
        }
        for fill in datapath::read_map_fill(pin_dir) {
            match fill {
                Ok(fill) => {
                    let label = MapLabel {
                        map: fill.name.to_owned(),
                    };
                    self.map_entries
                        .get_or_create(&label)
                        .set(fill.entries.into());
                    self.map_max_entries
                        .get_or_create(&label)
                        .set(fill.max_entries.into());
                }
                Err(err) => debug!(error = %err, "map fill not read"),
            }
        }
    }

    /// The Prometheus text format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format_names() {
        let m = Metrics::new();
        m.sync_duration.observe(0.002);
        m.map_write_failures.inc();
        m.healthz.get_or_create(&CodeLabel { code: 200 }).inc();
        m.services.set(3);
        let text = m.encode();
        for line in [
            "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
            "kubeproxy_sync_proxy_rules_duration_seconds_count 1",
            "lb_map_write_failures_total 1",
            "kubeproxy_proxy_healthz_total{code=\"200\"} 1",
            "lb_services_programmed 3",
            "# TYPE kubeproxy_network_programming_duration_seconds histogram",
            "# TYPE kubeproxy_sync_full_proxy_rules_duration_seconds histogram",
            "# TYPE kubeproxy_sync_partial_proxy_rules_duration_seconds histogram",
            "kubeproxy_sync_proxy_rules_service_changes_total 0",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} not in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
