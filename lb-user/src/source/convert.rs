//! Kubernetes objects (k8s-openapi types, from any source) to the model's specs: validation,
//! defaults, and what we ignore (ExternalName, headless, FQDN slices, SCTP).
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Service, ServiceSpec as ServiceSpecK8s, ServiceStatus};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tracing::{debug, warn};

use crate::model::{
    Conditions, ExternalAddresses, Family, Hints, IpFamily, Placement, PortName, PortSpec,
    Protocol, Scheduler, ServiceName, ServiceSpec, SliceEndpoint, SlicePort, SliceSpec, TargetPort,
    TrafficPolicies,
};

/// The Service annotation that chooses its scheduler: `random`, `rr`, `sh` or `maglev`.
pub const SCHEDULER_ANNOTATION: &str = "lb.kubernetes.io/scheduler";

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// A field with a value we cannot use; `field` is its path in the object (`spec.ports[0].port`).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidField {
    pub field: String,
    pub reason: String,
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> InvalidField {
    InvalidField {
        field: field.into(),
        reason: reason.into(),
    }
}

/// The Service as a spec, or None when it is not ours to proxy. An invalid address or source
/// range is left out and added to `skipped` (kube-proxy drops what it cannot parse and serves the
/// rest); any other invalid field rejects the Service.
pub fn service(
    svc: &Service,
    skipped: &mut Vec<InvalidField>,
) -> Result<Option<ServiceSpec>, InvalidField> {
    let name = object_name(&svc.metadata)?;
    let Some(spec) = &svc.spec else {
        debug!(service = %name, "ignored: no spec");
        return Ok(None);
    };
    let (node_ports, load_balancer) = match spec.type_.as_deref().unwrap_or("ClusterIP") {
        "ClusterIP" => (false, false),
        "NodePort" => (true, false),
        "LoadBalancer" => (true, true),
        "ExternalName" => {
            debug!(service = %name, "ignored: type ExternalName");
            return Ok(None);
        }
        other => return Err(invalid("spec.type", format!("unknown type {other:?}"))),
    };
    let Some((cluster_ip, cluster_ip_v6)) = cluster_ips(&name, spec)? else {
        return Ok(None);
    };

    let affinity_timeout_s = session_affinity(spec)?;
    let (external, external_v6) =
        external_addresses(&name, spec, load_balancer, svc.status.as_ref(), skipped)?;
    let scheduler = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SCHEDULER_ANNOTATION))
        .map(|name| {
            Scheduler::parse(name).ok_or_else(|| {
                invalid(
                    format!("metadata.annotations[{SCHEDULER_ANNOTATION}]"),
                    format!("unknown scheduler {name:?} (random, rr, sh, maglev)"),
                )
            })
        })
        .transpose()?;
    let traffic = TrafficPolicies {
        external_local: policy_local(
            spec.external_traffic_policy.as_deref(),
            "spec.externalTrafficPolicy",
        )?,
        internal_local: policy_local(
            spec.internal_traffic_policy.as_deref(),
            "spec.internalTrafficPolicy",
        )?,
        health_check_node_port: spec
            .health_check_node_port
            .map(|n| port_number(n, || "spec.healthCheckNodePort".into()))
            .transpose()?,
    };

    // Sized to the object: the specs live as long as the objects, one per Service.
    let mut ports = Vec::with_capacity(spec.ports.as_ref().map_or(0, Vec::len));
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let field = |f: &str| format!("spec.ports[{i}].{f}");
        let Some(protocol) = protocol(p.protocol.as_deref(), || field("protocol"))? else {
            debug!(service = %name, port = p.port, "ignored port: SCTP");
            continue;
        };
        let port = port_number(p.port, || field("port"))?;
        let node_port = p
            .node_port
            .map(|n| port_number(n, || field("nodePort")))
            .transpose()?;
        let name = PortName::from(p.name.as_deref().unwrap_or_default());
        let target_port = match &p.target_port {
            None => TargetPort::Number(port),
            Some(IntOrString::Int(n)) => {
                TargetPort::Number(port_number(*n, || field("targetPort"))?)
            }
            // Often the port's own name (`targetPort: http` of port `http`): one string for both.
            Some(IntOrString::String(s)) if **s == *name => TargetPort::Name(name.clone()),
            Some(IntOrString::String(s)) => TargetPort::Name(s.as_str().into()),
        };
        ports.push(PortSpec {
            name,
            protocol,
            port,
            node_port,
            target_port,
        });
    }
    // Without allocation a LoadBalancer port has a nodePort only if one was given.
    let allocate_node_ports =
        node_ports && !(load_balancer && spec.allocate_load_balancer_node_ports == Some(false));
    Ok(Some(ServiceSpec {
        name,
        cluster_ip,
        cluster_ip_v6,
        node_ports,
        allocate_node_ports,
        affinity_timeout_s,
        traffic,
        scheduler,
        external,
        external_v6,
        ports,
    }))
}

/// kube-proxy's ipMode for an ingress IP whose load balancer proxies the traffic itself.
const IP_MODE_PROXY: &str = "Proxy";

/// Adds `ip` to the list of its family.
fn push_by_family(ip: IpAddr, v4: &mut Vec<Ipv4Addr>, v6: &mut Vec<Ipv6Addr>) {
    match ip {
        IpAddr::V4(ip) => v4.push(ip),
        IpAddr::V6(ip) => v6.push(ip),
    }
}

/// spec.externalIPs, and for type LoadBalancer the ingress IPs in `status` and
/// spec.loadBalancerSourceRanges, each in its own family (IPv4's, IPv6's). As kube-proxy's
/// per-family proxiers, each family keeps only its own ranges: ranges that are all IPv6 leave
/// the IPv4 ingress IPs open.
/// Unparsable addresses and ranges go to `skipped`; when every range given is unparsable, the
/// ingress IPs are not served at all (closed rather than open to every source).
fn external_addresses(
    name: &ServiceName,
    spec: &ServiceSpecK8s,
    load_balancer: bool,
    status: Option<&ServiceStatus>,
    skipped: &mut Vec<InvalidField>,
) -> Result<(ExternalAddresses, ExternalAddresses<Ipv6Addr>), InvalidField> {
    let mut external = ExternalAddresses::default();
    let mut external_v6 = ExternalAddresses::<Ipv6Addr>::default();
    for (i, ip) in spec.external_ips.iter().flatten().enumerate() {
        match ip_address(ip, || format!("spec.externalIPs[{i}]")) {
            Ok(ip) => push_by_family(
                ip,
                &mut external.external_ips,
                &mut external_v6.external_ips,
            ),
            Err(invalid) => skipped.push(invalid),
        }
    }
    if !load_balancer {
        return Ok((external, external_v6));
    }
    let ingress = status
        .and_then(|status| status.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for (i, entry) in ingress.into_iter().flatten().enumerate() {
        let Some(ip) = &entry.ip else {
            continue;
        };
        match entry.ip_mode.as_deref().unwrap_or("VIP") {
            "VIP" => {}
            IP_MODE_PROXY => {
                debug!(service = %name, ip, "ingress IP with ipMode Proxy: left to its load balancer");
                continue;
            }
            other => {
                return Err(invalid(
                    format!("status.loadBalancer.ingress[{i}].ipMode"),
                    format!("unknown ipMode {other:?} (VIP, Proxy)"),
                ));
            }
        }
        match ip_address(ip, || format!("status.loadBalancer.ingress[{i}].ip")) {
            Ok(ip) => push_by_family(
                ip,
                &mut external.load_balancer_ips,
                &mut external_v6.load_balancer_ips,
            ),
            Err(invalid) => skipped.push(invalid),
        }
    }
    let ranges = spec
        .load_balancer_source_ranges
        .as_deref()
        .unwrap_or_default();
    let mut usable_ranges = 0;
    for (i, range) in ranges.iter().enumerate() {
        // The API allows spaces around a range, and kube-proxy trims them.
        let range = range.trim();
        match range.parse::<IpNet>() {
            Ok(IpNet::V4(net)) => {
                usable_ranges += 1;
                external.source_ranges.push(net.trunc());
            }
            Ok(IpNet::V6(net)) => {
                usable_ranges += 1;
                external_v6.source_ranges.push(net.trunc());
            }
            Err(err) => skipped.push(invalid(
                format!("spec.loadBalancerSourceRanges[{i}]"),
                format!("{range:?}: {err}"),
            )),
        }
    }
    if !ranges.is_empty() && usable_ranges == 0 {
        warn!(service = %name, "no usable loadBalancerSourceRanges: the load balancer IPs are not served");
        external.load_balancer_ips.clear();
        external_v6.load_balancer_ips.clear();
    }
    external.source_ranges.sort_unstable();
    external.source_ranges.dedup();
    external_v6.source_ranges.sort_unstable();
    external_v6.source_ranges.dedup();
    Ok((external, external_v6))
}

fn ip_address(ip: &str, field: impl FnOnce() -> String) -> Result<IpAddr, InvalidField> {
    ip.parse::<IpAddr>()
        .map_err(|err| invalid(field(), format!("{ip:?}: {err}")))
}

/// A traffic policy is Local; Cluster by default.
fn policy_local(policy: Option<&str>, field: &str) -> Result<bool, InvalidField> {
    match policy.unwrap_or("Cluster") {
        "Cluster" => Ok(false),
        "Local" => Ok(true),
        other => Err(invalid(field, format!("unknown traffic policy {other:?}"))),
    }
}

/// kube-proxy's default sessionAffinityConfig.clientIP.timeoutSeconds (3 hours), and the API's
/// maximum (a day).
pub const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;
const MAX_AFFINITY_TIMEOUT_S: u32 = 86_400;

/// The ClientIP affinity timeout, None without affinity.
fn session_affinity(spec: &ServiceSpecK8s) -> Result<Option<u32>, InvalidField> {
    match spec.session_affinity.as_deref().unwrap_or("None") {
        "None" => Ok(None),
        "ClientIP" => {
            let timeout = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match timeout {
                None => Ok(Some(DEFAULT_AFFINITY_TIMEOUT_S)),
                Some(t) => u32::try_from(t)
                    .ok()
                    .filter(|t| (1..=MAX_AFFINITY_TIMEOUT_S).contains(t))
                    .map(Some)
                    .ok_or_else(|| {
                        invalid(
                            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                            format!("{t} is not in 1-{MAX_AFFINITY_TIMEOUT_S}"),
                        )
                    }),
            }
        }
        other => Err(invalid(
            "spec.sessionAffinity",
            format!("unknown affinity {other:?}"),
        )),
    }
}

/// The EndpointSlice as a spec, or None when it is not ours to use.
/// The slice as a spec, or None when it is not ours. An endpoint without a valid address is left
/// out and added to `skipped`; any other invalid field rejects the slice.
pub fn endpoint_slice(
    slice: &EndpointSlice,
    skipped: &mut Vec<InvalidField>,
) -> Result<Option<SliceSpec>, InvalidField> {
    let slice_name = object_name(&slice.metadata)?;
    let family = match slice.address_type.as_str() {
        "IPv4" => IpFamily::V4,
        "IPv6" => IpFamily::V6,
        "FQDN" => {
            debug!(slice = %slice_name, "ignored: addressType FQDN");
            return Ok(None);
        }
        other => {
            return Err(invalid(
                "addressType",
                format!("unknown address type {other:?}"),
            ));
        }
    };
    let Some(service) = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
    else {
        debug!(slice = %slice_name, "ignored: no {SERVICE_NAME_LABEL} label");
        return Ok(None);
    };

    // Sized to the object: the specs live as long as the objects, and a cluster has millions of
    // endpoints.
    let mut ports = Vec::with_capacity(slice.ports.as_ref().map_or(0, Vec::len));
    for (i, p) in slice.ports.iter().flatten().enumerate() {
        let field = |f: &str| format!("ports[{i}].{f}");
        let Some(protocol) = protocol(p.protocol.as_deref(), || field("protocol"))? else {
            continue;
        };
        ports.push(SlicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol,
            port: p
                .port
                .map(|n| port_number(n, || field("port")))
                .transpose()?,
        });
    }

    let mut endpoints = Vec::with_capacity(slice.endpoints.as_ref().map_or(0, Vec::len));
    let mut placements = SlicePlacements::default();
    for (i, e) in slice.endpoints.iter().flatten().enumerate() {
        // Consumers use the first address only (the API says the others are not used).
        let Some(addr) = e.addresses.first() else {
            skipped.push(invalid(format!("endpoints[{i}].addresses"), "empty"));
            continue;
        };
        let field = || format!("endpoints[{i}].addresses[0]");
        let addr = match ip_address(addr, field) {
            Ok(ip) if IpFamily::of(ip) == family => ip,
            Ok(ip) => {
                skipped.push(invalid(field(), format!("{ip} is not {family}")));
                continue;
            }
            Err(invalid) => {
                skipped.push(invalid);
                continue;
            }
        };
        // kube-proxy's reading: unknown ready or serving is true, unknown terminating false.
        let conditions = e.conditions.as_ref();
        let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
        let serving = conditions.and_then(|c| c.serving).unwrap_or(true);
        let terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
        endpoints.push(SliceEndpoint {
            addr,
            conditions: Conditions {
                ready,
                serving,
                terminating,
            },
            placement: placements.of(e),
        });
    }

    Ok(Some(SliceSpec {
        service: ServiceName {
            namespace: slice_name.namespace,
            name: service.as_str().into(),
        },
        family,
        ports,
        endpoints,
    }))
}

/// The placements of one slice's endpoints: those on the same node without hints share one (a
/// slice's endpoints run on a few nodes).
#[derive(Default)]
struct SlicePlacements(HashMap<String, Placement>);

impl SlicePlacements {
    fn of(&mut self, e: &Endpoint) -> Placement {
        let hints = Hints::new(
            e.hints
                .iter()
                .flat_map(|h| h.for_zones.iter().flatten())
                .map(|z| z.name.clone())
                .collect(),
            e.hints
                .iter()
                .flat_map(|h| h.for_nodes.iter().flatten())
                .map(|n| n.name.clone())
                .collect(),
        );
        match &e.node_name {
            Some(node) if hints.is_empty() => self
                .0
                .entry(node.clone())
                .or_insert_with(|| Placement::new(Some(node), hints))
                .clone(),
            node => Placement::new(node.as_deref(), hints),
        }
    }
}

fn object_name(meta: &ObjectMeta) -> Result<ServiceName, InvalidField> {
    let name = meta
        .name
        .as_deref()
        .ok_or_else(|| invalid("metadata.name", "missing"))?;
    Ok(ServiceName {
        namespace: meta.namespace.as_deref().unwrap_or("default").into(),
        name: name.into(),
    })
}

/// A Service's ClusterIP of each family: IPv4's, IPv6's.
type ClusterIps = (Option<Ipv4Addr>, Option<Ipv6Addr>);

/// The ClusterIP of each family of spec.ipFamilies: the first of that family
/// in clusterIP, clusterIPs. Without ipFamilies (manifests may leave it out), the families of
/// the ClusterIPs. None (ignored) for headless services and services without one.
fn cluster_ips(
    name: &ServiceName,
    spec: &ServiceSpecK8s,
) -> Result<Option<ClusterIps>, InvalidField> {
    let Some(primary) = spec.cluster_ip.as_deref().or(spec
        .cluster_ips
        .as_ref()
        .and_then(|ips| ips.first())
        .map(String::as_str))
    else {
        debug!(service = %name, "ignored: no clusterIP");
        return Ok(None);
    };
    if primary == "None" {
        debug!(service = %name, "ignored: headless (clusterIP None)");
        return Ok(None);
    }
    let candidates = std::iter::once(("spec.clusterIP".to_owned(), primary)).chain(
        spec.cluster_ips
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, ip)| (format!("spec.clusterIPs[{i}]"), ip.as_str())),
    );
    let mut addresses = Vec::new();
    for (field, ip) in candidates {
        addresses.push(ip_address(ip, || field)?);
    }
    let families = match spec.ip_families.as_deref() {
        Some(families) if !families.is_empty() => families
            .iter()
            .enumerate()
            .map(|(i, family)| match family.as_str() {
                "IPv4" => Ok(IpFamily::V4),
                "IPv6" => Ok(IpFamily::V6),
                other => Err(invalid(
                    format!("spec.ipFamilies[{i}]"),
                    format!("unknown family {other:?} (IPv4, IPv6)"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        _ => addresses.iter().map(|ip| IpFamily::of(*ip)).collect(),
    };
    let first_of = |family: IpFamily| {
        families
            .contains(&family)
            .then(|| addresses.iter().find(|ip| IpFamily::of(**ip) == family))
            .flatten()
            .copied()
    };
    let v4 = first_of(IpFamily::V4).and_then(Ipv4Addr::of);
    let v6 = first_of(IpFamily::V6).and_then(Ipv6Addr::of);
    if v4.is_none() && v6.is_none() {
        debug!(service = %name, "ignored: no clusterIP of its ipFamilies");
        return Ok(None);
    }
    Ok(Some((v4, v6)))
}

/// None for SCTP, which we do not proxy.
fn protocol(
    protocol: Option<&str>,
    field: impl FnOnce() -> String,
) -> Result<Option<Protocol>, InvalidField> {
    match protocol.unwrap_or("TCP") {
        "TCP" => Ok(Some(Protocol::Tcp)),
        "UDP" => Ok(Some(Protocol::Udp)),
        "SCTP" => Ok(None),
        other => Err(invalid(field(), format!("unknown protocol {other:?}"))),
    }
}

fn port_number(n: i32, field: impl FnOnce() -> String) -> Result<u16, InvalidField> {
    u16::try_from(n)
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| invalid(field(), format!("{n} is not a port (1-65535)")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec, when nothing was skipped.
    fn service(svc: &Service) -> Result<Option<ServiceSpec>, InvalidField> {
        let mut skipped = Vec::new();
        let spec = super::service(svc, &mut skipped);
        assert!(skipped.is_empty(), "{skipped:?}");
        spec
    }

    fn endpoint_slice(slice: &EndpointSlice) -> Result<Option<SliceSpec>, InvalidField> {
        let mut skipped = Vec::new();
        let spec = super::endpoint_slice(slice, &mut skipped);
        assert!(skipped.is_empty(), "{skipped:?}");
        spec
    }

    fn svc(yaml: &str) -> Service {
        yaml_serde::from_str(yaml).expect("test yaml")
    }

    fn slice(yaml: &str) -> EndpointSlice {
        yaml_serde::from_str(yaml).expect("test yaml")
    }

    const HEAD: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\n";

    #[test]
    fn a_target_port_named_as_its_port_shares_the_ports_name() {
        let spec = service(&svc(&format!(
            "{HEAD}spec:\n  clusterIP: 10.96.0.10\n  ports:\n  - {{name: http, port: 80, targetPort: http}}\n"
        )))
        .unwrap()
        .unwrap();
        let port = &spec.ports[0];
        let TargetPort::Name(target) = &port.target_port else {
            panic!("a named targetPort: {:?}", port.target_port);
        };
        assert!(std::sync::Arc::ptr_eq(target, &port.name));
    }

    #[test]
    fn service_defaults_and_target_ports() {
        let spec = service(&svc(&format!(
            "{HEAD}spec:\n  clusterIP: 10.96.0.10\n  ports:\n  - {{port: 80}}\n  - {{name: b, port: 81, targetPort: web, protocol: UDP}}\n  - {{name: c, port: 82, targetPort: 8082}}\n  - {{name: d, port: 83, protocol: SCTP}}\n"
        )))
        .unwrap()
        .unwrap();
        assert_eq!(spec.name.to_string(), "shop/web");
        assert_eq!(spec.cluster_ip, Some(Ipv4Addr::new(10, 96, 0, 10)));
        assert_eq!(spec.cluster_ip_v6, None);
        assert!(!spec.node_ports);
        assert_eq!(spec.ports.len(), 3);
        assert_eq!(&*spec.ports[0].name, "");
        assert_eq!(spec.ports[0].protocol, Protocol::Tcp);
        assert_eq!(spec.ports[0].target_port, TargetPort::Number(80));
        assert_eq!(spec.ports[1].protocol, Protocol::Udp);
        assert_eq!(spec.ports[1].target_port, TargetPort::Name("web".into()));
        assert_eq!(spec.ports[2].target_port, TargetPort::Number(8082));
    }

    #[test]
    fn ignored_services() {
        for spec in [
            "spec: {type: ExternalName, externalName: example.com}",
            "spec: {clusterIP: None, ports: [{port: 80}]}",
            "spec: {ports: [{port: 80}]}",
            "spec: {clusterIP: 10.96.0.1, ipFamilies: [IPv6], ports: [{port: 80}]}",
        ] {
            assert_eq!(
                service(&svc(&format!("{HEAD}{spec}\n"))),
                Ok(None),
                "{spec}"
            );
        }
        let dual = service(&svc(&format!(
            "{HEAD}spec: {{clusterIP: 'fd00::10', clusterIPs: ['fd00::10', 10.96.0.11], type: NodePort, ports: [{{port: 80, nodePort: 30080}}]}}\n"
        )))
        .unwrap()
        .unwrap();
        assert_eq!(dual.cluster_ip, Some(Ipv4Addr::new(10, 96, 0, 11)));
        assert_eq!(dual.cluster_ip_v6, Some("fd00::10".parse().unwrap()));
        assert!(dual.node_ports);
        assert_eq!(dual.ports[0].node_port, Some(30080));
    }

    #[test]
    fn external_ips_load_balancer_ingress_and_source_ranges() {
        let with = |type_: &str, extra: &str| {
            service(&svc(&format!(
                "{HEAD}spec:
  type: {type_}
  clusterIP: 10.96.0.1
  ports: [{{port: 80}}]
  externalIPs: [203.0.113.10, 'fd00::10']
  loadBalancerSourceRanges: [' 198.51.100.7/24 ', 'fd00::/64', 198.51.100.0/24, 192.0.2.1/32]
status:
  loadBalancer:
    ingress:
      - ip: 203.0.113.20
      - ip: 203.0.113.30
        ipMode: Proxy
      - ip: 203.0.113.40
        ipMode: VIP
      - hostname: lb.example.com
{extra}"
            )))
            .map(|s| s.unwrap())
        };
        let external_v6 = |type_: &str| with(type_, "").map(|s| s.external_v6);
        let external = |type_: &str, extra: &str| with(type_, extra).map(|s| s.external);
        let lb = external("LoadBalancer", "").unwrap();
        assert_eq!(lb.external_ips, [Ipv4Addr::new(203, 0, 113, 10)]);
        let lb_v6 = external_v6("LoadBalancer").unwrap();
        assert_eq!(
            lb_v6.external_ips,
            ["fd00::10".parse::<Ipv6Addr>().unwrap()]
        );
        assert!(lb_v6.load_balancer_ips.is_empty());
        assert_eq!(
            lb_v6.source_ranges,
            ["fd00::/64".parse().unwrap()],
            "each family its own ranges"
        );
        assert_eq!(
            lb.load_balancer_ips,
            [
                Ipv4Addr::new(203, 0, 113, 20),
                Ipv4Addr::new(203, 0, 113, 40)
            ],
            "ipMode Proxy and hostname-only entries are not programmed"
        );
        assert_eq!(
            lb.source_ranges,
            [
                "192.0.2.1/32".parse().unwrap(),
                "198.51.100.0/24".parse().unwrap()
            ],
            "IPv4's, host bits cleared, trimmed, no duplicates"
        );

        let node_port = external("NodePort", "").unwrap();
        assert_eq!(node_port.external_ips, lb.external_ips);
        assert!(
            node_port.load_balancer_ips.is_empty() && node_port.source_ranges.is_empty(),
            "ingress IPs and source ranges belong to type LoadBalancer"
        );

        let bad_mode = external(
            "LoadBalancer",
            "      - {ip: 203.0.113.50, ipMode: Tunnel}\n",
        );
        assert_eq!(
            bad_mode.unwrap_err().field,
            "status.loadBalancer.ingress[4].ipMode"
        );
    }

    #[test]
    fn invalid_addresses_and_ranges_are_skipped_and_the_rest_kept() {
        let status = "status: {loadBalancer: {ingress: [{ip: 203.0.113.50}, {ip: '203.0.113.x'}]}}";
        let mut skipped = Vec::new();
        let spec = super::service(
            &svc(&format!(
                "{HEAD}spec: {{type: LoadBalancer, clusterIP: 10.96.0.1, ports: [{{port: 80}}], externalIPs: [203.0.113.1, 203.0.113, 203.0.113.2, 203.0.113.3], loadBalancerSourceRanges: [198.51.100.0/33, 198.51.100.0/24]}}\n{status}\n"
            )),
            &mut skipped,
        )
        .unwrap()
        .unwrap();
        let fields: Vec<&str> = skipped.iter().map(|f| f.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.externalIPs[1]",
                "status.loadBalancer.ingress[1].ip",
                "spec.loadBalancerSourceRanges[0]"
            ]
        );
        let ip = |last| Ipv4Addr::new(203, 0, 113, last);
        assert_eq!(spec.external.external_ips, [ip(1), ip(2), ip(3)]);
        assert_eq!(spec.external.load_balancer_ips, [ip(50)]);
        assert_eq!(
            spec.external.source_ranges,
            ["198.51.100.0/24".parse::<ipnet::Ipv4Net>().unwrap()]
        );

        // Only unusable ranges: the load balancer IPs close instead of opening to all.
        let mut skipped = Vec::new();
        let spec = super::service(
            &svc(&format!(
                "{HEAD}spec: {{type: LoadBalancer, clusterIP: 10.96.0.1, ports: [{{port: 80}}], loadBalancerSourceRanges: [bogus]}}\n{status}\n"
            )),
            &mut skipped,
        )
        .unwrap()
        .unwrap();
        assert_eq!(skipped.len(), 2);
        assert!(spec.external.load_balancer_ips.is_empty());
    }

    #[test]
    fn session_affinity_defaults_and_limits() {
        let affinity = |spec: &str| {
            service(&svc(&format!(
                "{HEAD}spec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}], {spec}}}\n"
            )))
            .map(|s| s.unwrap().affinity_timeout_s)
        };
        assert_eq!(affinity("sessionAffinity: None"), Ok(None));
        assert_eq!(
            affinity("sessionAffinity: ClientIP"),
            Ok(Some(DEFAULT_AFFINITY_TIMEOUT_S))
        );
        assert_eq!(
            affinity(
                "sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 5}}"
            ),
            Ok(Some(5))
        );
        let err = affinity(
            "sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}",
        )
        .unwrap_err();
        assert_eq!(
            err.field,
            "spec.sessionAffinityConfig.clientIP.timeoutSeconds"
        );
        assert_eq!(
            affinity("sessionAffinity: Sticky").unwrap_err().field,
            "spec.sessionAffinity"
        );
    }

    #[test]
    fn scheduler_annotation() {
        let with = |annotation: &str| {
            service(&svc(&format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: web, annotations: {{{annotation}}}}}\nspec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}]}}\n"
            )))
            .map(|s| s.unwrap().scheduler)
        };
        assert_eq!(with("a: b"), Ok(None));
        assert_eq!(
            with("lb.kubernetes.io/scheduler: maglev"),
            Ok(Some(Scheduler::Maglev))
        );
        assert_eq!(
            with("lb.kubernetes.io/scheduler: rr"),
            Ok(Some(Scheduler::Rr))
        );
        assert!(with("lb.kubernetes.io/scheduler: wlc").is_err());
    }

    #[test]
    fn invalid_service_fields_are_named() {
        let err = service(&svc(&format!(
            "{HEAD}spec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}, {{port: 70000}}]}}\n"
        )))
        .unwrap_err();
        assert_eq!(err.field, "spec.ports[1].port");
        let err = service(&svc(&format!(
            "{HEAD}spec: {{clusterIP: 10.96.0.300, ports: [{{port: 80}}]}}\n"
        )))
        .unwrap_err();
        assert_eq!(err.field, "spec.clusterIP");
        let err = service(&svc(&format!(
            "{HEAD}spec: {{clusterIP: 10.96.0.1, ports: [{{port: 80, protocol: ICMP}}]}}\n"
        )))
        .unwrap_err();
        assert_eq!(err.field, "spec.ports[0].protocol");
    }

    #[test]
    fn slices_join_by_label_and_default_ready() {
        let spec = endpoint_slice(&slice(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-abc\n  namespace: shop\n  labels: {kubernetes.io/service-name: web}\naddressType: IPv4\nports: [{name: http, port: 8080}, {name: s, port: 9, protocol: SCTP}]\nendpoints:\n- addresses: [10.244.1.2]\n- addresses: [10.244.1.3]\n  conditions: {ready: false}\n",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(spec.service.to_string(), "shop/web");
        assert_eq!(
            spec.ports,
            vec![SlicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: Some(8080)
            }]
        );
        assert_eq!(
            spec.endpoints,
            vec![
                SliceEndpoint {
                    addr: Ipv4Addr::new(10, 244, 1, 2).into(),
                    conditions: Conditions::READY,
                    placement: Placement::default(),
                },
                SliceEndpoint {
                    addr: Ipv4Addr::new(10, 244, 1, 3).into(),
                    conditions: Conditions {
                        ready: false,
                        serving: true,
                        terminating: false
                    },
                    placement: Placement::default(),
                },
            ]
        );
    }

    #[test]
    fn endpoint_conditions_node_and_traffic_policies() {
        let spec = endpoint_slice(&slice(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-abc\n  labels: {kubernetes.io/service-name: web}\naddressType: IPv4\nendpoints:\n- addresses: [10.244.1.2]\n  nodeName: n1\n  conditions: {ready: false, serving: true, terminating: true}\n  hints: {forZones: [{name: zone-b}, {name: zone-a}], forNodes: [{name: n1}]}\n",
        ))
        .unwrap()
        .unwrap();
        let e = &spec.endpoints[0];
        assert_eq!(e.placement.node_name(), Some("n1"));
        let hints = e.placement.hints();
        assert_eq!(
            hints.zones().iter().collect::<Vec<_>>(),
            ["zone-a", "zone-b"]
        );
        assert_eq!(hints.nodes().iter().collect::<Vec<_>>(), ["n1"]);
        assert!(!e.conditions.ready && e.conditions.serving && e.conditions.terminating);

        let spec = service(&svc(&format!(
            "{HEAD}spec: {{type: NodePort, clusterIP: 10.96.0.1, ports: [{{port: 80}}], externalTrafficPolicy: Local, healthCheckNodePort: 31000, internalTrafficPolicy: Local}}\n"
        )))
        .unwrap()
        .unwrap();
        assert_eq!(
            spec.traffic,
            TrafficPolicies {
                external_local: true,
                internal_local: true,
                health_check_node_port: Some(31000)
            }
        );
        let err = service(&svc(&format!(
            "{HEAD}spec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}], internalTrafficPolicy: Nearby}}\n"
        )))
        .unwrap_err();
        assert_eq!(err.field, "spec.internalTrafficPolicy");
    }

    #[test]
    fn ignored_and_invalid_slices() {
        let base =
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-abc\n";
        let labels = "  labels: {kubernetes.io/service-name: web}\n";
        assert_eq!(
            endpoint_slice(&slice(&format!(
                "{base}{labels}addressType: FQDN\nendpoints: [{{addresses: [web.example.com]}}]\n"
            ))),
            Ok(None)
        );
        assert_eq!(
            endpoint_slice(&slice(&format!("{base}addressType: IPv4\nendpoints: []\n"))),
            Ok(None)
        );
        let mut skipped = Vec::new();
        let spec = super::endpoint_slice(
            &slice(&format!(
                "{base}{labels}addressType: IPv4\nendpoints: [{{addresses: [10.244.1.2]}}, {{addresses: [bogus]}}, {{addresses: []}}, {{addresses: ['fd00::1']}}]\n"
            )),
            &mut skipped,
        )
        .unwrap()
        .unwrap();
        let addrs: Vec<IpAddr> = spec.endpoints.iter().map(|e| e.addr).collect();
        assert_eq!(addrs, [IpAddr::from(Ipv4Addr::new(10, 244, 1, 2))]);
        let fields: Vec<&str> = skipped.iter().map(|f| f.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "endpoints[1].addresses[0]",
                "endpoints[2].addresses",
                "endpoints[3].addresses[0]"
            ],
            "an IPv6 address in an IPv4 slice is invalid"
        );
    }

    #[test]
    fn dual_stack_service_has_a_cluster_ip_per_family_of_ip_families() {
        let spec = |families: &str| {
            service(&svc(&format!(
                "{HEAD}spec: {{type: NodePort, clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, 'fd00:96::10'], {families} ports: [{{port: 80, nodePort: 30080}}]}}\n"
            )))
            .map(|s| s.map(|s| (s.cluster_ip, s.cluster_ip_v6)))
        };
        let v4 = Some(Ipv4Addr::new(10, 96, 0, 10));
        let v6 = Some("fd00:96::10".parse::<Ipv6Addr>().unwrap());
        assert_eq!(spec("ipFamilies: [IPv4, IPv6],"), Ok(Some((v4, v6))));
        assert_eq!(spec("ipFamilies: [IPv6, IPv4],"), Ok(Some((v4, v6))));
        assert_eq!(
            spec(""),
            Ok(Some((v4, v6))),
            "without ipFamilies: the ClusterIPs'"
        );
        assert_eq!(spec("ipFamilies: [IPv4],"), Ok(Some((v4, None))));
        assert_eq!(spec("ipFamilies: [IPv6],"), Ok(Some((None, v6))));
        assert_eq!(
            spec("ipFamilies: [IPv5],").unwrap_err().field,
            "spec.ipFamilies[0]"
        );
        let v6_only = service(&svc(&format!(
            "{HEAD}spec: {{clusterIP: 'fd00:96::11', ipFamilies: [IPv6], ports: [{{port: 80}}]}}\n"
        )))
        .unwrap()
        .unwrap();
        assert_eq!(v6_only.cluster_ip, None);
        assert_eq!(v6_only.cluster_ip_v6, Some("fd00:96::11".parse().unwrap()));
    }

    #[test]
    fn slices_carry_their_address_type() {
        let slice_of = |address_type: &str, address: &str| {
            endpoint_slice(&slice(&format!(
                "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-{address_type}\n  labels: {{kubernetes.io/service-name: web}}\naddressType: {address_type}\nports: [{{port: 8080}}]\nendpoints: [{{addresses: ['{address}']}}]\n"
            )))
            .unwrap()
        };
        let v4 = slice_of("IPv4", "10.244.1.2").unwrap();
        assert_eq!(v4.family, IpFamily::V4);
        let v6 = slice_of("IPv6", "fd00:10:244::2").unwrap();
        assert_eq!(v6.family, IpFamily::V6);
        assert_eq!(
            v6.endpoints[0].addr,
            "fd00:10:244::2".parse::<IpAddr>().unwrap()
        );
        assert_eq!(slice_of("FQDN", "web.example.com"), None);
    }
}
