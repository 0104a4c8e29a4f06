//! The Services every variant is programmed with, from one description: `count` Services, the
//! measured one last (the worst position in kube-proxy's iptables chains), each with real
//! endpoints. The agent gets them as manifests; rulesets.rs writes the same as kube-proxy's rules.
use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use serde::Serialize;

/// Every Service's TCP port, and the port the bench servers listen on.
pub const SERVICE_PORT: u16 = 80;
pub const TCP_TARGET_PORT: u16 = 9000;
/// The measured Service's UDP port (NodePort `NODE_PORT`) and its sink in the backend (B4).
pub const UDP_TARGET_PORT: u16 = 9001;
pub const NODE_PORT: u16 = 30080;
/// The first ClusterIP; Service `i` has the next ones in order.
const FIRST_CLUSTER_IP: u32 = u32::from_be_bytes([10, 96, 0, 10]);
/// The first IPv6 ClusterIP, as FIRST_CLUSTER_IP.
const FIRST_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xa);
/// Endpoints of the filler Services beyond the first sit here (no pod answers: they are never
/// selected, the measured Service has its own).
const FILLER_ENDPOINT_BASE: u32 = u32::from_be_bytes([10, 244, 2, 1]);
const FILLER_ENDPOINT_BASE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x244, 2, 0, 0, 0, 1);
pub const MAX_SERVICES: usize = 60_000;

pub use lb_tests::echo::Proto;

/// The address family of a ServiceSet: its ClusterIPs, endpoints and the client's packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::Ipv4, Family::Ipv6];

    pub fn name(self) -> &'static str {
        match self {
            Family::Ipv4 => "ipv4",
            Family::Ipv6 => "ipv6",
        }
    }

    pub fn of(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Family::Ipv4,
            IpAddr::V6(_) => Family::Ipv6,
        }
    }

    /// Kubernetes' name of the family (`ipFamilies`, an EndpointSlice's `addressType`).
    fn kubernetes_name(self) -> &'static str {
        match self {
            Family::Ipv4 => "IPv4",
            Family::Ipv6 => "IPv6",
        }
    }
}

/// One service port as kube-proxy sees it.
#[derive(Clone, Debug)]
pub struct ServicePort {
    /// `default/<service>:<port name>`
    pub name: String,
    pub cluster_ip: IpAddr,
    pub proto: Proto,
    pub port: u16,
    pub node_port: Option<u16>,
    pub target_port: u16,
    pub endpoints: Vec<IpAddr>,
}

#[derive(Clone, Debug)]
pub struct ServiceSet {
    pub count: usize,
    /// Filler Services: the first is the measured backend, the others addresses no pod has.
    pub filler_endpoints: usize,
    /// The measured Service's endpoints.
    pub measured_endpoints: Vec<IpAddr>,
    /// Address of the first filler endpoint (the backend pod); its family is the set's.
    pub backend: IpAddr,
}

impl ServiceSet {
    /// `count` Services (`count - 1` fillers and the measured one), each filler with
    /// `filler_endpoints` endpoints.
    pub fn new(count: usize, filler_endpoints: usize, backend: impl Into<IpAddr>) -> Self {
        assert!((1..=MAX_SERVICES).contains(&count));
        let backend = backend.into();
        ServiceSet {
            count,
            filler_endpoints,
            measured_endpoints: vec![backend],
            backend,
        }
    }

    pub fn family(&self) -> Family {
        Family::of(self.backend)
    }

    /// The measured Service's ClusterIP: the last one.
    pub fn measured_ip(&self) -> IpAddr {
        self.cluster_ip(self.count - 1)
    }

    /// The ClusterIP of Service `index`, in the set's family.
    fn cluster_ip(&self, index: usize) -> IpAddr {
        match self.family() {
            Family::Ipv4 => cluster_ip(index).into(),
            Family::Ipv6 => cluster_ip6(index).into(),
        }
    }

    pub fn endpoint_count(&self) -> usize {
        (self.count - 1) * self.filler_endpoints + self.measured_endpoints.len() * 2
    }

    fn filler_endpoint_ips(&self) -> Vec<IpAddr> {
        (0..self.filler_endpoints)
            .map(|k| match (k, self.family()) {
                (0, _) => self.backend,
                (k, Family::Ipv4) => Ipv4Addr::from(FILLER_ENDPOINT_BASE + k as u32).into(),
                (k, Family::Ipv6) => {
                    Ipv6Addr::from(u128::from(FILLER_ENDPOINT_BASE6) + k as u128).into()
                }
            })
            .collect()
    }

    /// Every service port, in the order kube-proxy's chains evaluate them: the measured
    /// Service's last.
    pub fn ports(&self) -> Vec<ServicePort> {
        let filler = self.filler_endpoint_ips();
        let mut ports: Vec<ServicePort> = (0..self.count - 1)
            .map(|i| ServicePort {
                name: format!("default/svc-{i}:app"),
                cluster_ip: self.cluster_ip(i),
                proto: Proto::Tcp,
                port: SERVICE_PORT,
                node_port: None,
                target_port: TCP_TARGET_PORT,
                endpoints: filler.clone(),
            })
            .collect();
        let ip = self.measured_ip();
        ports.push(ServicePort {
            name: "default/bench:flood".into(),
            cluster_ip: ip,
            proto: Proto::Udp,
            port: SERVICE_PORT,
            node_port: Some(NODE_PORT),
            target_port: UDP_TARGET_PORT,
            endpoints: self.measured_endpoints.clone(),
        });
        ports.push(ServicePort {
            name: "default/bench:app".into(),
            cluster_ip: ip,
            proto: Proto::Tcp,
            port: SERVICE_PORT,
            node_port: None,
            target_port: TCP_TARGET_PORT,
            endpoints: self.measured_endpoints.clone(),
        });
        ports
    }

    /// Service and EndpointSlice manifests for the agent.
    pub fn yaml(&self) -> String {
        self.filler_yaml() + &self.measured_yaml()
    }

    /// The manifests of the filler Services.
    pub fn filler_yaml(&self) -> String {
        let mut yaml = String::with_capacity(self.count * 700);
        let filler = self.filler_endpoint_ips();
        for i in 0..self.count - 1 {
            let name = format!("svc-{i}");
            write_service(
                &mut yaml,
                &name,
                self.cluster_ip(i),
                &[("app", Proto::Tcp, None)],
            );
            write_slice(
                &mut yaml,
                &name,
                &[("app", Proto::Tcp, TCP_TARGET_PORT)],
                &filler,
                self.family(),
            );
        }
        yaml
    }

    /// The manifests of the measured Service.
    pub fn measured_yaml(&self) -> String {
        let mut yaml = String::new();
        write_service(
            &mut yaml,
            "bench",
            self.measured_ip(),
            &[
                ("app", Proto::Tcp, None),
                ("flood", Proto::Udp, Some(NODE_PORT)),
            ],
        );
        write_slice(
            &mut yaml,
            "bench",
            &[
                ("app", Proto::Tcp, TCP_TARGET_PORT),
                ("flood", Proto::Udp, UDP_TARGET_PORT),
            ],
            &self.measured_endpoints,
            self.family(),
        );
        yaml
    }
}

pub fn cluster_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::from(FIRST_CLUSTER_IP + index as u32)
}

/// The IPv6 ClusterIP of Service `index`.
pub fn cluster_ip6(index: usize) -> Ipv6Addr {
    Ipv6Addr::from(u128::from(FIRST_CLUSTER_IP6) + index as u128)
}

fn write_service(yaml: &mut String, name: &str, ip: IpAddr, ports: &[(&str, Proto, Option<u16>)]) {
    let kind = if ports.iter().any(|p| p.2.is_some()) {
        "NodePort"
    } else {
        "ClusterIP"
    };
    let _ = write!(
        yaml,
        "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\n\
         spec:\n  type: {kind}\n  clusterIP: {ip}\n  clusterIPs: [\"{ip}\"]\n  ipFamilies: [{}]\n  \
         ports:\n",
        Family::of(ip).kubernetes_name()
    );
    for (port_name, proto, node_port) in ports {
        let _ = write!(
            yaml,
            "    - name: {port_name}\n      protocol: {}\n      port: {SERVICE_PORT}\n      \
             targetPort: {port_name}\n",
            proto.manifest_name()
        );
        if let Some(node_port) = node_port {
            let _ = writeln!(yaml, "      nodePort: {node_port}");
        }
    }
}

fn write_slice(
    yaml: &mut String,
    name: &str,
    ports: &[(&str, Proto, u16)],
    endpoints: &[IpAddr],
    family: Family,
) {
    let _ = write!(
        yaml,
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
         namespace: default\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: {}\n\
         ports:\n",
        family.kubernetes_name()
    );
    for (port_name, proto, port) in ports {
        let _ = write!(
            yaml,
            "  - name: {port_name}\n    protocol: {}\n    port: {port}\n",
            proto.manifest_name()
        );
    }
    yaml.push_str("endpoints:\n");
    for addr in endpoints {
        let _ = write!(
            yaml,
            "  - addresses: [\"{addr}\"]\n    conditions:\n      ready: true\n"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_service_is_last_and_has_both_ports() {
        let set = ServiceSet::new(3, 2, Ipv4Addr::new(10, 244, 1, 2));
        let ports = set.ports();
        assert_eq!(ports.len(), 4);
        assert!(ports[..2].iter().all(|p| p.endpoints.len() == 2));
        assert_eq!(ports[3].cluster_ip, set.measured_ip());
        assert_eq!(ports[2].node_port, Some(NODE_PORT));
        assert_eq!(set.yaml().matches("kind: Service\n").count(), 3);
        assert_eq!(set.yaml().matches("addressType: IPv4\n").count(), 3);
    }

    #[test]
    fn ipv6_set_has_ipv6_cluster_ips_families_and_slices() {
        let backend: IpAddr = "2001:db8:244::2".parse().unwrap();
        let set = ServiceSet::new(3, 2, backend);
        assert_eq!(set.family(), Family::Ipv6);
        assert_eq!(set.measured_ip(), IpAddr::V6(cluster_ip6(2)));
        let ports = set.ports();
        assert!(ports.iter().all(|p| p.cluster_ip.is_ipv6()));
        assert!(ports.iter().flat_map(|p| &p.endpoints).all(|e| e.is_ipv6()));
        let yaml = set.yaml();
        assert_eq!(yaml.matches("ipFamilies: [IPv6]\n").count(), 3);
        assert_eq!(yaml.matches("addressType: IPv6\n").count(), 3);
        assert!(!yaml.contains("IPv4"), "{yaml}");
    }
}
