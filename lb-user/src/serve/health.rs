//! `/healthz` and `/livez` as kube-proxy answers them, and the HTTP servers (axum) for them and
//! for `/metrics` and `/proxyMode`.
//!
//! Healthy means: no change is waiting to be synced, or the oldest waiting one arrived less than
//! the health timeout ago (kube-proxy: twice its sync period). `/healthz` is also unhealthy when
//! this node is being deleted or carries the cluster autoscaler's ToBeDeletedByClusterAutoscaler
//! taint, so load balancers drain it; `/livez` ignores the node.
//!
//! Readiness at start: `/healthz` is 503 until the datapath is attached and one sync of the whole
//! desired state wrote every entry (kube-proxy's /healthz is 200 from the start; a node that
//! serves what the maps pinned before does not yet serve what the cluster wants).
//!
//! A sync whose map writes partly failed (a full map) still counts as a sync: the loop runs, the
//! rest is written, and the failed entries are retried. So it never fails `/livez` (a restart
//! would not make the map bigger), nor, once the agent was ready, `/healthz` (draining the node
//! would take away every service it serves because some could not be written; a full map is
//! likely full on every node). Failed writes are errors: logged, counted in
//! `lb_map_write_failures_total`, and a Kubernetes Event on the Service in apiserver mode.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse as _, Response};
use axum::routing::any;
use jiff::Timestamp;
use tokio::net::TcpListener;
use tracing::{error, info};

use crate::serve::metrics::{CodeLabel, Metrics};

#[derive(Debug, Clone)]
pub struct Health {
    timeout: Duration,
    last_updated: Option<Timestamp>,
    oldest_pending: Option<Timestamp>,
    node_eligible: bool,
    /// The programs are attached to the interfaces present at start.
    attached: bool,
    /// A sync wrote the whole desired state without a failed write.
    synced_whole: bool,
}

/// An answer: status and JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

impl Health {
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            last_updated: None,
            oldest_pending: None,
            // Eligible while starting up, until the Node says otherwise (as kube-proxy).
            node_eligible: true,
            attached: false,
            synced_whole: false,
        }
    }

    /// The programs are attached to the interfaces present at start.
    pub fn attached(&mut self) {
        self.attached = true;
    }

    /// A change arrived that the maps do not hold yet.
    pub fn queued(&mut self, now: Timestamp) {
        self.oldest_pending.get_or_insert(now);
    }

    /// A sync of every change queued before it started ran; `failed_writes` of its map writes
    /// failed (they are retried). Without failures the maps hold the whole desired state: every
    /// sync reads the whole source, and after a failure the next one diffs every entry.
    pub fn synced(&mut self, now: Timestamp, failed_writes: usize) {
        self.oldest_pending = None;
        self.last_updated = Some(now);
        self.synced_whole |= failed_writes == 0;
    }

    pub fn set_node_eligible(&mut self, eligible: bool) {
        self.node_eligible = eligible;
    }

    fn healthy(&self, now: Timestamp) -> bool {
        self.oldest_pending.is_none_or(|since| {
            now.duration_since(since)
                .try_into()
                .is_ok_and(|late: Duration| late < self.timeout)
        })
    }

    /// When healthy, lastUpdated is the current time (kube-proxy keeps that for compatibility
    /// with releases where it was the time of the last sync loop run).
    fn last_updated(&self, now: Timestamp, healthy: bool) -> String {
        if healthy {
            go_time(Some(now))
        } else {
            go_time(self.last_updated)
        }
    }

    pub fn healthz(&self, now: Timestamp) -> Answer {
        let ready = self.attached && self.synced_whole;
        let healthy = ready && self.healthy(now) && self.node_eligible;
        Answer {
            status: if healthy { 200 } else { 503 },
            body: format!(
                r#"{{"lastUpdated": "{}","currentTime": "{}", "nodeEligible": {}}}"#,
                self.last_updated(now, healthy),
                go_time(Some(now)),
                self.node_eligible
            ),
        }
    }

    pub fn livez(&self, now: Timestamp) -> Answer {
        let healthy = self.healthy(now);
        Answer {
            status: if healthy { 200 } else { 503 },
            body: format!(
                r#"{{"lastUpdated": "{}","currentTime": "{}"}}"#,
                self.last_updated(now, healthy),
                go_time(Some(now))
            ),
        }
    }
}

/// A time as Go's `time.Time.String()` prints it in UTC, which is what kube-proxy's body holds;
/// None is Go's zero time.
fn go_time(t: Option<Timestamp>) -> String {
    match t {
        Some(t) => t.strftime("%Y-%m-%d %H:%M:%S%.f +0000 UTC").to_string(),
        None => "0001-01-01 00:00:00 +0000 UTC".to_owned(),
    }
}

/// kube-proxy's `/proxyMode` answer on the metrics port (it answers e.g. `iptables`).
pub const PROXY_MODE: &str = "ebpf";

/// `/healthz` and `/livez`.
pub fn health_routes(health: Arc<Mutex<Health>>, metrics: Arc<Metrics>) -> Router {
    let answer = move |path: &'static str| {
        let (health, metrics) = (health.clone(), metrics.clone());
        any(move || async move {
            let now = Timestamp::now();
            let health = health.lock().expect("health lock");
            let (answer, counter) = match path {
                "/healthz" => (health.healthz(now), &metrics.healthz),
                _ => (health.livez(now), &metrics.livez),
            };
            counter
                .get_or_create(&CodeLabel {
                    code: answer.status,
                })
                .inc();
            reply(answer.status, "application/json", answer.body)
        })
    };
    Router::new()
        .route("/healthz", answer("/healthz"))
        .route("/livez", answer("/livez"))
        .fallback(not_found)
}

/// `/metrics` (with the datapath's counters and maps, read from `pin_dir` at each scrape) and
/// `/proxyMode`.
pub fn metrics_routes(metrics: Arc<Metrics>, pin_dir: PathBuf) -> Router {
    Router::new()
        .route(
            "/metrics",
            any(move || async move {
                metrics.read_datapath(&pin_dir);
                reply(
                    200,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    metrics.encode(),
                )
            }),
        )
        .route(
            "/proxyMode",
            any(|| async { reply(200, "text/plain; charset=utf-8", PROXY_MODE.into()) }),
        )
        .fallback(not_found)
}

/// Go's net/http answer to an unknown path.
pub async fn not_found() -> Response {
    reply(
        404,
        "text/plain; charset=utf-8",
        "404 page not found\n".into(),
    )
}

/// An answer with kube-proxy's headers.
pub fn reply(status: u16, content_type: &'static str, body: String) -> Response {
    (
        StatusCode::from_u16(status).expect("valid status"),
        [
            (header::CONTENT_TYPE, content_type),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

/// Binds `addr` (so a taken port fails the start) and serves `routes` on it in the background.
pub async fn serve(addr: SocketAddr, what: &str, routes: Router) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    info!(%addr, "serving {what}");
    tokio::spawn(serve_listener(listener, routes));
    Ok(())
}

/// Serves `routes` on `listener` until the task is aborted.
pub async fn serve_listener(listener: TcpListener, routes: Router) {
    let addr = listener.local_addr().ok();
    // axum::serve only returns on a listener error, which it already retries.
    if let Err(err) = axum::serve(listener, routes).await {
        error!(?addr, error = %err, "HTTP server stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    /// Attached and one whole sync written: what the agent is once started.
    fn ready(timeout: Duration, at: Timestamp) -> Health {
        let mut h = Health::new(timeout);
        h.attached();
        h.synced(at, 0);
        h
    }

    #[test]
    fn healthy_when_synced() {
        let mut h = ready(Duration::from_secs(60), at("2025-03-01T09:00:00Z"));
        let now = at("2025-03-01T10:00:00.5Z");
        assert_eq!(
            h.healthz(now),
            Answer {
                status: 200,
                body: r#"{"lastUpdated": "2025-03-01 10:00:00.5 +0000 UTC","currentTime": "2025-03-01 10:00:00.5 +0000 UTC", "nodeEligible": true}"#.into()
            }
        );
        h.queued(now);
        h.synced(at("2025-03-01T10:00:01Z"), 0);
        assert_eq!(h.livez(at("2025-03-01T11:00:00Z")).status, 200);
    }

    #[test]
    fn not_ready_until_attached_and_a_sync_wrote_everything() {
        let t0 = at("2025-03-01T10:00:00Z");
        // The apiserver's order: attached, then synced (first with failed writes).
        let mut h = Health::new(Duration::from_secs(60));
        assert_eq!((h.healthz(t0).status, h.livez(t0).status), (503, 200));
        assert!(
            h.healthz(t0)
                .body
                .starts_with(r#"{"lastUpdated": "0001-01-01 00:00:00 +0000 UTC","#)
        );
        h.attached();
        assert_eq!(h.healthz(t0).status, 503);
        h.queued(t0);
        let t1 = at("2025-03-01T10:00:01Z");
        h.synced(t1, 3);
        assert_eq!((h.healthz(t1).status, h.livez(t1).status), (503, 200));
        h.synced(t1, 0);
        assert_eq!(h.healthz(t1).status, 200);
        // The manifests' order: synced, then attached.
        let mut h = Health::new(Duration::from_secs(60));
        h.synced(t0, 0);
        assert_eq!(h.healthz(t0).status, 503);
        h.attached();
        assert_eq!(h.healthz(t0).status, 200);
    }

    #[test]
    fn failed_writes_fail_neither_livez_nor_a_ready_healthz() {
        let mut h = ready(Duration::from_secs(2), at("2025-03-01T10:00:00Z"));
        // A change whose writes fail at every retry (every 5 s), for a minute.
        h.queued(at("2025-03-01T10:00:01Z"));
        for second in (1..60).step_by(5) {
            let now = at("2025-03-01T10:00:00Z") + jiff::SignedDuration::from_secs(second);
            h.synced(now, 7);
            let later = now + jiff::SignedDuration::from_secs(4);
            assert_eq!((h.livez(later).status, h.healthz(later).status), (200, 200));
        }
    }

    #[test]
    fn a_change_waiting_longer_than_the_timeout_is_unhealthy() {
        let mut h = ready(Duration::from_secs(60), at("2025-03-01T09:59:00Z"));
        h.queued(at("2025-03-01T10:00:00Z"));
        h.queued(at("2025-03-01T10:00:30Z"));
        assert_eq!(h.healthz(at("2025-03-01T10:00:59Z")).status, 200);
        let late = at("2025-03-01T10:01:00Z");
        assert_eq!(
            h.livez(late),
            Answer {
                status: 503,
                body: r#"{"lastUpdated": "2025-03-01 09:59:00 +0000 UTC","currentTime": "2025-03-01 10:01:00 +0000 UTC"}"#.into()
            }
        );
        assert_eq!(h.healthz(late).status, 503);
    }

    #[test]
    fn never_synced_reports_go_zero_time() {
        let mut h = Health::new(Duration::from_secs(1));
        h.queued(at("2025-03-01T10:00:00Z"));
        let body = h.livez(at("2025-03-01T10:00:02Z")).body;
        assert!(
            body.starts_with(r#"{"lastUpdated": "0001-01-01 00:00:00 +0000 UTC","#),
            "{body}"
        );
    }

    #[test]
    fn an_ineligible_node_fails_healthz_only() {
        let mut h = ready(Duration::from_secs(60), at("2025-03-01T09:00:00Z"));
        h.set_node_eligible(false);
        let now = at("2025-03-01T10:00:00Z");
        let healthz = h.healthz(now);
        assert_eq!(healthz.status, 503);
        assert!(healthz.body.ends_with(r#""nodeEligible": false}"#));
        assert_eq!(h.livez(now).status, 200);
    }
}
