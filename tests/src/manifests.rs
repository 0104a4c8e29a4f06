//! Kubernetes manifests (Service + EndpointSlice YAML) for the tests.
use std::{
    fmt::Write as _,
    net::{Ipv4Addr, Ipv6Addr},
};

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
    pub endpoints: Vec<EndpointManifest>,
    /// sessionAffinity ClientIP with this timeoutSeconds.
    pub affinity_timeout: Option<u32>,
    /// externalTrafficPolicy: Local.
    pub external_local: bool,
    /// internalTrafficPolicy: Local.
    pub internal_local: bool,
    pub health_check_node_port: Option<u16>,
    pub annotations: Vec<(String, String)>,
    /// spec.externalIPs.
    pub external_ips: Vec<Ipv4Addr>,
    /// Type LoadBalancer with these status.loadBalancer.ingress entries.
    pub load_balancer: Option<Vec<IngressManifest>>,
    /// spec.loadBalancerSourceRanges.
    pub source_ranges: Vec<String>,
}

/// One status.loadBalancer.ingress entry.
#[derive(Debug, Clone)]
pub struct IngressManifest {
    pub ip: Ipv4Addr,
    /// ipMode: `VIP` or `Proxy`; None leaves it out.
    pub ip_mode: Option<&'static str>,
}

/// One endpoint of the slice.
#[derive(Debug, Clone)]
pub struct EndpointManifest {
    pub addr: Ipv4Addr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
    /// hints.forZones.
    pub zone_hints: Vec<String>,
    /// hints.forNodes.
    pub node_hints: Vec<String>,
}

impl EndpointManifest {
    pub fn ready(addr: Ipv4Addr) -> Self {
        EndpointManifest {
            addr,
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            zone_hints: Vec::new(),
            node_hints: Vec::new(),
        }
    }

    /// Terminating, still serving (or not) until it is gone.
    pub fn terminating(addr: Ipv4Addr, serving: bool) -> Self {
        EndpointManifest {
            ready: false,
            serving,
            terminating: true,
            ..Self::ready(addr)
        }
    }

    pub fn on_node(mut self, node: &str) -> Self {
        self.node_name = Some(node.to_string());
        self
    }

    /// A topology hint for `zone` (as the EndpointSlice controller sets them).
    pub fn hinted_for(mut self, zone: &str) -> Self {
        self.zone_hints.push(zone.to_string());
        self
    }

    /// A topology hint for node `node` (trafficDistribution PreferSameNode).
    pub fn hinted_for_node(mut self, node: &str) -> Self {
        self.node_hints.push(node.to_string());
        self
    }
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
            affinity_timeout: None,
            external_local: false,
            internal_local: false,
            health_check_node_port: None,
            annotations: Vec::new(),
            external_ips: Vec::new(),
            load_balancer: None,
            source_ranges: Vec::new(),
        }
    }

    pub fn external_ips(mut self, ips: impl IntoIterator<Item = Ipv4Addr>) -> Self {
        self.external_ips = ips.into_iter().collect();
        self
    }

    /// Type LoadBalancer (with the nodePort given or allocated) with these ingress entries.
    pub fn load_balancer(mut self, ingress: impl IntoIterator<Item = IngressManifest>) -> Self {
        self.load_balancer = Some(ingress.into_iter().collect());
        self
    }

    pub fn source_ranges(mut self, ranges: &[&str]) -> Self {
        self.source_ranges = ranges.iter().map(|r| r.to_string()).collect();
        self
    }

    pub fn node_port(mut self, node_port: u16) -> Self {
        self.node_port = Some(node_port);
        self
    }

    /// Ready endpoints (replacing any others).
    pub fn endpoints(mut self, addrs: impl IntoIterator<Item = Ipv4Addr>) -> Self {
        self.endpoints = addrs.into_iter().map(EndpointManifest::ready).collect();
        self
    }

    pub fn not_ready_endpoint(mut self, addr: Ipv4Addr) -> Self {
        self.endpoints.push(EndpointManifest {
            ready: false,
            serving: false,
            ..EndpointManifest::ready(addr)
        });
        self
    }

    pub fn endpoint(mut self, endpoint: EndpointManifest) -> Self {
        self.endpoints.push(endpoint);
        self
    }

    /// sessionAffinity ClientIP with `timeout` seconds.
    pub fn session_affinity(mut self, timeout: u32) -> Self {
        self.affinity_timeout = Some(timeout);
        self
    }

    /// externalTrafficPolicy: Local, with this healthCheckNodePort.
    pub fn external_local(mut self, health_check_node_port: u16) -> Self {
        self.external_local = true;
        self.health_check_node_port = Some(health_check_node_port);
        self
    }

    /// internalTrafficPolicy: Local.
    pub fn internal_local(mut self) -> Self {
        self.internal_local = true;
        self
    }

    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.push((key.to_string(), value.to_string()));
        self
    }

    pub fn yaml(&self) -> String {
        let cluster_ip = self.cluster_ip.to_string();
        self.render(&cluster_ip, "IPv4", &|addr| addr.to_string())
    }

    /// This Service made IPv6-only: ClusterIP `cluster_ip`, an IPv6 EndpointSlice whose
    /// endpoints are those of `self` with the addresses `ipv6` gives for their IPv4 ones.
    pub fn yaml_ipv6(&self, cluster_ip: Ipv6Addr, ipv6: impl Fn(Ipv4Addr) -> Ipv6Addr) -> String {
        let cluster_ip =
            format!("\"{cluster_ip}\"\n  clusterIPs: [\"{cluster_ip}\"]\n  ipFamilies: [IPv6]");
        self.render(&cluster_ip, "IPv6", &|addr| ipv6(addr).to_string())
    }

    /// The YAML with `cluster_ip` as the value of clusterIP, the slice's `address_type`, and
    /// `endpoint` writing each endpoint's address.
    fn render(
        &self,
        cluster_ip: &str,
        address_type: &str,
        endpoint: &dyn Fn(Ipv4Addr) -> String,
    ) -> String {
        let ServiceManifest {
            name,
            cluster_ip: _,
            proto,
            port,
            node_port,
            target_port,
            endpoints,
            affinity_timeout,
            external_local,
            internal_local,
            health_check_node_port,
            annotations,
            external_ips,
            load_balancer,
            source_ranges,
        } = self;
        let proto = proto.manifest_name();
        let (kind, node_port) = match node_port {
            Some(p) => ("NodePort", format!("\n      nodePort: {p}")),
            None => ("ClusterIP", String::new()),
        };
        let mut status = String::new();
        let kind = match load_balancer {
            Some(ingress) => {
                status.push_str("status:\n  loadBalancer:\n    ingress:\n");
                for entry in ingress {
                    let _ = writeln!(status, "      - ip: {}", entry.ip);
                    if let Some(mode) = entry.ip_mode {
                        let _ = writeln!(status, "        ipMode: {mode}");
                    }
                }
                "LoadBalancer"
            }
            None => kind,
        };
        let mut spec = String::new();
        let list = |items: Vec<String>| format!("[{}]", items.join(", "));
        if !external_ips.is_empty() {
            let ips = list(external_ips.iter().map(Ipv4Addr::to_string).collect());
            let _ = writeln!(spec, "  externalIPs: {ips}");
        }
        if !source_ranges.is_empty() {
            let ranges = list(source_ranges.iter().map(|r| format!("\"{r}\"")).collect());
            let _ = writeln!(spec, "  loadBalancerSourceRanges: {ranges}");
        }
        if let Some(timeout) = affinity_timeout {
            let _ = write!(
                spec,
                "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: {timeout}\n"
            );
        }
        if *external_local {
            spec.push_str("  externalTrafficPolicy: Local\n");
        }
        if let Some(port) = health_check_node_port {
            let _ = writeln!(spec, "  healthCheckNodePort: {port}");
        }
        if *internal_local {
            spec.push_str("  internalTrafficPolicy: Local\n");
        }
        let mut metadata = String::new();
        if !annotations.is_empty() {
            metadata.push_str("  annotations:\n");
            for (key, value) in annotations {
                let _ = writeln!(metadata, "    {key}: \"{value}\"");
            }
        }
        let mut yaml = format!(
            "apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
{metadata}spec:
  type: {kind}
  clusterIP: {cluster_ip}
{spec}  ports:
    - name: app
      protocol: {proto}
      port: {port}
      targetPort: app{node_port}
{status}---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: default
  labels:
    kubernetes.io/service-name: {name}
addressType: {address_type}
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
        for e in endpoints {
            let _ = write!(
                yaml,
                "  - addresses: [\"{}\"]\n    conditions:\n      ready: {}\n      serving: {}\n      terminating: {}\n",
                endpoint(e.addr),
                e.ready,
                e.serving,
                e.terminating
            );
            if let Some(node) = &e.node_name {
                let _ = writeln!(yaml, "    nodeName: {node}");
            }
            if !e.zone_hints.is_empty() || !e.node_hints.is_empty() {
                let names = |names: &[String]| -> String {
                    let names: Vec<String> =
                        names.iter().map(|n| format!("{{name: {n}}}")).collect();
                    names.join(", ")
                };
                let _ = writeln!(
                    yaml,
                    "    hints: {{forZones: [{}], forNodes: [{}]}}",
                    names(&e.zone_hints),
                    names(&e.node_hints)
                );
            }
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

/// The first lines of an IPv6-only Service `name` on `cluster_ip`, its spec's family fields
/// last: the caller adds the rest of the spec.
pub fn ipv6_service_head(name: &str, cluster_ip: Ipv6Addr) -> String {
    format!(
        "---
apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
spec:
  clusterIP: \"{cluster_ip}\"
  clusterIPs: [\"{cluster_ip}\"]
  ipFamilies: [IPv6]
"
    )
}

/// An EndpointSlice's `endpoints` entries, one line per address.
pub fn endpoint_lines(addresses: &[impl std::fmt::Display]) -> String {
    addresses
        .iter()
        .map(|a| format!("  - addresses: [\"{a}\"]\n"))
        .collect()
}

/// `service` (an `ipv6_only_service`) made of type NodePort on `node_port`.
pub fn ipv6_node_port(service: &str, node_port: u16) -> anyhow::Result<String> {
    let (cluster_ip, port) = ("  type: ClusterIP\n", "      targetPort: app\n");
    anyhow::ensure!(
        service.contains(cluster_ip) && service.contains(port),
        "{service}"
    );
    Ok(service
        .replacen(cluster_ip, "  type: NodePort\n", 1)
        .replacen(port, &format!("{port}      nodePort: {node_port}\n"), 1))
}

/// An IPv6-only Service `name` on `frontend` (its ClusterIP and port, named `app`, targetPort
/// `app`) and its EndpointSlice `slice` (name, addressType, port) of `addresses`.
pub fn ipv6_only_service(
    name: &str,
    frontend: (Ipv6Addr, u16),
    proto: Proto,
    slice: (&str, &str, u16),
    addresses: &[String],
) -> String {
    let (cluster_ip, port) = frontend;
    let proto = proto.manifest_name();
    let (slice_name, address_type, slice_port) = slice;
    let (head, endpoints) = (
        ipv6_service_head(name, cluster_ip),
        endpoint_lines(addresses),
    );
    format!(
        "{head}  type: ClusterIP
  ports:
    - name: app
      protocol: {proto}
      port: {port}
      targetPort: app
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {slice_name}
  namespace: default
  labels:
    kubernetes.io/service-name: {name}
addressType: {address_type}
ports:
  - name: app
    protocol: {proto}
    port: {slice_port}
endpoints:
{endpoints}"
    )
}
