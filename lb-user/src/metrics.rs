//! Prometheus metrics (prometheus-client), named as kube-proxy names them where it has one, so
//! its dashboards and alerts keep working.
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: u16,
}

/// Every metric; all are atomics, shared between the sync loop and the metrics server.
pub struct Metrics {
    registry: Registry,
    pub sync_duration: Histogram,
    pub last_sync_timestamp: Gauge<f64, AtomicU64>,
    pub last_queued_timestamp: Gauge<f64, AtomicU64>,
    pub network_programming: Histogram,
    pub services: Gauge,
    pub endpoints: Gauge,
    pub map_write_failures: Counter,
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
            last_sync_timestamp: Gauge::default(),
            last_queued_timestamp: Gauge::default(),
            network_programming: Histogram::new(buckets()),
            services: Gauge::default(),
            endpoints: Gauge::default(),
            map_write_failures: Counter::default(),
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
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} not in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
