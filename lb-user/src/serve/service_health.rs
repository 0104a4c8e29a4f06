//! healthCheckNodePort: for every externalTrafficPolicy Local service, an HTTP server on its
//! healthCheckNodePort answering as kube-proxy's service health server does, so an external load
//! balancer sends traffic only to nodes with endpoints of the service: 200 with local ready
//! endpoints, 503 without (or while the proxy itself is unhealthy).
use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::HeaderValue;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::model::{Model, ServiceName};
use crate::serve::health;

/// What one healthCheckNodePort reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub service: ServiceName,
    /// Ready endpoints of the service on this node.
    pub local_endpoints: usize,
}

/// The healthCheckNodePorts `model` wants on `node_name`, and what each reports.
pub fn wanted(model: &Model, node_name: &str) -> BTreeMap<u16, Status> {
    let mut wanted = BTreeMap::new();
    for (name, service) in &model.services {
        let traffic = &service.traffic;
        let node_exposed = service.ports.iter().any(|p| p.node_port.is_some());
        let Some(port) = traffic.health_check_node_port else {
            continue;
        };
        if !traffic.external_local || !node_exposed {
            continue;
        }
        // kube-proxy counts ready local endpoints only: terminating ones still get traffic, but
        // the load balancer is told to drain the node.
        let local: BTreeSet<Ipv4Addr> = service
            .ports
            .iter()
            .flat_map(|p| &p.endpoints)
            .filter(|e| e.ready() && e.on_node(node_name))
            .map(|e| e.addr)
            .collect();
        wanted.entry(port).or_insert(Status {
            service: name.clone(),
            local_endpoints: local.len(),
        });
    }
    wanted
}

/// kube-proxy's answer: status, and the JSON body (its exact layout).
pub fn answer(status: &Status, proxy_healthy: bool) -> (u16, String) {
    let code = if status.local_endpoints > 0 && proxy_healthy {
        200
    } else {
        503
    };
    let body = format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {:?},\n\t\t\"name\": {:?}\n\t}},\n\t\"localEndpoints\": {},\n\t\"serviceProxyHealthy\": {}\n}}",
        status.service.namespace, status.service.name, status.local_endpoints, proxy_healthy
    );
    (code, body)
}

type ProxyHealthy = Arc<dyn Fn() -> bool + Send + Sync>;

/// The running servers, one per healthCheckNodePort.
pub struct ServiceHealth {
    proxy_healthy: ProxyHealthy,
    servers: BTreeMap<u16, Server>,
}

struct Server {
    status: Arc<Mutex<Status>>,
    task: JoinHandle<()>,
}

impl ServiceHealth {
    /// `proxy_healthy` is the agent's own health (`serviceProxyHealthy`).
    pub fn new(proxy_healthy: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Self {
            proxy_healthy: Arc::new(proxy_healthy),
            servers: BTreeMap::new(),
        }
    }

    /// Serves exactly `wanted`: new ports are bound (a port that cannot be bound is logged and
    /// tried again by the next update), gone ones closed, the others report their new status.
    /// Runs inside the agent's tokio runtime.
    pub fn update(&mut self, wanted: BTreeMap<u16, Status>) {
        self.servers.retain(|port, server| {
            let keep = wanted.contains_key(port);
            if !keep {
                server.task.abort();
                info!(port, "healthCheckNodePort closed");
            }
            keep
        });
        for (port, status) in wanted {
            if let Some(server) = self.servers.get(&port) {
                *server.status.lock().expect("status lock") = status;
                continue;
            }
            let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
            let listener = std::net::TcpListener::bind(addr)
                .and_then(|l| l.set_nonblocking(true).map(|()| l))
                .and_then(TcpListener::from_std);
            match listener {
                Ok(listener) => {
                    info!(port, service = %status.service, "serving healthCheckNodePort");
                    let status = Arc::new(Mutex::new(status));
                    let routes = routes(status.clone(), self.proxy_healthy.clone());
                    let task = tokio::spawn(health::serve_listener(listener, routes));
                    self.servers.insert(port, Server { status, task });
                }
                Err(err) => {
                    warn!(port, service = %status.service, error = %err, "healthCheckNodePort not served");
                }
            }
        }
    }
}

impl Drop for ServiceHealth {
    fn drop(&mut self) {
        for server in self.servers.values() {
            server.task.abort();
        }
    }
}

/// Every path answers the status (as kube-proxy's service health server).
fn routes(status: Arc<Mutex<Status>>, proxy_healthy: ProxyHealthy) -> Router {
    Router::new().fallback(move || async move {
        let current = status.lock().expect("status lock").clone();
        let (code, body) = answer(&current, proxy_healthy());
        let mut response = health::reply(code, "application/json", body);
        response.headers_mut().insert(
            "X-Load-Balancing-Endpoint-Weight",
            HeaderValue::from(current.local_endpoints),
        );
        response
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{
        Conditions, Endpoint, Placement, Protocol, Service, ServicePort, TargetPort,
        TrafficPolicies,
    };

    fn status(local_endpoints: usize) -> Status {
        Status {
            service: ServiceName {
                namespace: "default".into(),
                name: "web".into(),
            },
            local_endpoints,
        }
    }

    #[test]
    fn answers_as_kube_proxy() {
        let (code, body) = answer(&status(2), true);
        assert_eq!(code, 200);
        assert_eq!(
            body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"default\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
        );
        let parsed: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(parsed["localEndpoints"], 2);
        assert_eq!(answer(&status(0), true).0, 503);
        assert_eq!(answer(&status(1), false).0, 503);
    }

    #[test]
    fn only_external_local_node_exposed_services_with_a_port() {
        let endpoint = |last, node: &str, conditions| Endpoint {
            addr: Ipv4Addr::new(10, 244, 1, last),
            port: 80,
            conditions,
            placement: Placement::new(Some(node), Default::default()),
        };
        let terminating = Conditions {
            ready: false,
            serving: true,
            terminating: true,
        };
        let service = |traffic, node_port| Service {
            cluster_ip: Ipv4Addr::new(10, 96, 0, 1),
            affinity_timeout_s: None,
            traffic,
            scheduler: None,
            external: Default::default(),
            ports: vec![ServicePort {
                name: "".into(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port,
                target_port: TargetPort::Number(80),
                endpoints: vec![
                    endpoint(2, "me", Conditions::READY),
                    endpoint(3, "me", terminating),
                    endpoint(4, "other", Conditions::READY),
                ],
            }],
        };
        let local = TrafficPolicies {
            external_local: true,
            internal_local: false,
            health_check_node_port: Some(31000),
        };
        let mut model = Model::default();
        for (name, svc) in [
            ("web", service(local, Some(30080))),
            (
                "cluster",
                service(
                    TrafficPolicies {
                        external_local: false,
                        ..local
                    },
                    Some(30081),
                ),
            ),
        ] {
            let name = ServiceName {
                namespace: "default".into(),
                name: name.into(),
            };
            model.services.insert(name, svc);
        }
        assert_eq!(wanted(&model, "me"), BTreeMap::from([(31000, status(1))]));
        assert_eq!(wanted(&model, "other")[&31000].local_endpoints, 1);
        assert_eq!(wanted(&model, "nowhere")[&31000].local_endpoints, 0);
    }
}
