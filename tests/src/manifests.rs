//! Kubernetes manifests (Service + EndpointSlice YAML) for the tests.
use std::{fmt::Write as _, net::Ipv4Addr};

use crate::echo::Proto;

/// One Service with one port named `app`, its targetPort the name `app`, and one EndpointSlice.
#[derive(Debug, Clone)]
pub struct ServiceManifest {
    pub name: String,
    pub cluster_ip: Ipv4Addr,
    pub proto: Proto,
    pub port: u16,
    /// Type NodePort with this nodePort.
    pub node_port: Option<u16>,
    /// The port the endpoints listen on.
    pub target_port: u16,
    /// (address, ready)
    pub endpoints: Vec<(Ipv4Addr, bool)>,
}

impl ServiceManifest {
    pub fn new(
        name: &str,
        cluster_ip: Ipv4Addr,
        proto: Proto,
        port: u16,
        target_port: u16,
    ) -> Self {
        ServiceManifest {
            name: name.to_string(),
            cluster_ip,
            proto,
            port,
            node_port: None,
            target_port,
            endpoints: Vec::new(),
        }
    }

    pub fn node_port(mut self, node_port: u16) -> Self {
        self.node_port = Some(node_port);
        self
    }

    pub fn endpoints(mut self, addrs: impl IntoIterator<Item = Ipv4Addr>) -> Self {
        self.endpoints = addrs.into_iter().map(|a| (a, true)).collect();
        self
    }

    pub fn not_ready_endpoint(mut self, addr: Ipv4Addr) -> Self {
        self.endpoints.push((addr, false));
        self
    }

    pub fn yaml(&self) -> String {
        let ServiceManifest {
            name,
            cluster_ip,
            proto,
            port,
            node_port,
            target_port,
            endpoints,
        } = self;
        let proto = proto.manifest_name();
        let (kind, node_port) = match node_port {
            Some(p) => ("NodePort", format!("\n      nodePort: {p}")),
            None => ("ClusterIP", String::new()),
        };
        let mut yaml = format!(
            "apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
spec:
  type: {kind}
  clusterIP: {cluster_ip}
  ports:
    - name: app
      protocol: {proto}
      port: {port}
      targetPort: app{node_port}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: default
  labels:
    kubernetes.io/service-name: {name}
addressType: IPv4
ports:
  - name: app
    protocol: {proto}
    port: {target_port}
endpoints:
"
        );
        if endpoints.is_empty() {
            yaml.truncate(yaml.len() - "endpoints:\n".len());
            yaml.push_str("endpoints: []\n");
        }
        for (addr, ready) in endpoints {
            let _ = write!(
                yaml,
                "  - addresses: [\"{addr}\"]\n    conditions:\n      ready: {ready}\n"
            );
        }
        yaml
    }
}

/// Several services as one multi-document file.
pub fn yaml(services: &[ServiceManifest]) -> String {
    services
        .iter()
        .map(ServiceManifest::yaml)
        .collect::<Vec<_>>()
        .join("---\n")
}
