//! kube-proxy's rulesets for a ServiceSet, in the structure its iptables and nftables modes write
//! (pkg/proxy/iptables and pkg/proxy/nftables): the parts a forwarded ClusterIP or NodePort
//! packet meets. Firewall, health-check and load-balancer chains that stay empty for these
//! Services are left out; the filter-table hooks that every new connection traverses are kept.
use std::{fmt::Write as _, net::SocketAddr};

use crate::services::{Family, ServicePort, ServiceSet};

const MASQ_MARK: &str = "0x4000";
/// kube-proxy stops writing per-endpoint comments above this many endpoints
/// (largeClusterEndpointsThreshold).
const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// Input for `iptables-restore` or `ip6tables-restore` (either backend), in the set's family;
/// `cluster_cidr` is that family's.
pub fn iptables(set: &ServiceSet, cluster_cidr: &str) -> String {
    let ports = set.ports();
    let host = host_prefix(set.family());
    let large = set.endpoint_count() > LARGE_CLUSTER_ENDPOINTS;
    let mut out = String::with_capacity(ports.len() * 600);
    out.push_str(
        "*filter\n\
         :KUBE-SERVICES - [0:0]\n\
         :KUBE-EXTERNAL-SERVICES - [0:0]\n\
         :KUBE-FORWARD - [0:0]\n\
         :KUBE-NODEPORTS - [0:0]\n\
         :KUBE-PROXY-FIREWALL - [0:0]\n\
         -A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
         -A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n\
         -A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n\
         -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
         -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
         -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n\
         -A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
    );
    let _ = write!(
        out,
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
         -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {MASQ_MARK}/{MASQ_MARK} -j ACCEPT\n\
         -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
         COMMIT\n\
         *nat\n\
         :KUBE-SERVICES - [0:0]\n\
         :KUBE-NODEPORTS - [0:0]\n\
         :KUBE-POSTROUTING - [0:0]\n\
         :KUBE-MARK-MASQ - [0:0]\n"
    );
    for port in &ports {
        let _ = writeln!(out, ":{} - [0:0]", svc_chain(port));
        if port.node_port.is_some() {
            let _ = writeln!(out, ":{} - [0:0]", ext_chain(port));
        }
        for endpoint in 0..port.endpoints.len() {
            let _ = writeln!(out, ":{} - [0:0]", sep_chain(port, endpoint));
        }
    }
    let _ = write!(
        out,
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
         -A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN\n\
         -A KUBE-POSTROUTING -j MARK --xor-mark {MASQ_MARK}\n\
         -A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n\
         -A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}\n"
    );
    for port in &ports {
        let (name, proto, ip, svc) = (
            &port.name,
            port.proto.rule_name(),
            port.cluster_ip,
            svc_chain(port),
        );
        let dport = port.port;
        let _ = writeln!(
            out,
            "-A KUBE-SERVICES -m comment --comment \"{name} cluster IP\" -m {proto} -p {proto} -d {ip}/{host} --dport {dport} -j {svc}"
        );
        let _ = writeln!(
            out,
            "-A {svc} -m comment --comment \"{name} cluster IP\" -m {proto} -p {proto} -d {ip}/{host} --dport {dport} ! -s {cluster_cidr} -j KUBE-MARK-MASQ"
        );
        if let Some(node_port) = port.node_port {
            let ext = ext_chain(port);
            let _ = write!(
                out,
                "-A KUBE-NODEPORTS -m comment --comment {name} -m {proto} -p {proto} --dport {node_port} -j {ext}\n\
                 -A {ext} -m comment --comment \"masquerade traffic for {name} external destinations\" -j KUBE-MARK-MASQ\n\
                 -A {ext} -j {svc}\n"
            );
        }
        let count = port.endpoints.len();
        for (i, endpoint) in port.endpoints.iter().enumerate() {
            let target = SocketAddr::new(*endpoint, port.target_port).to_string();
            let sep = sep_chain(port, i);
            let _ = write!(out, "-A {svc} -m comment --comment \"{name} -> {target}\"");
            if i + 1 < count {
                // Each rule takes 1/(remaining) of what reaches it: uniform over the endpoints.
                let _ = write!(
                    out,
                    " -m statistic --mode random --probability {:.10}",
                    1.0 / (count - i) as f64
                );
            }
            let _ = writeln!(out, " -j {sep}");
            let comment = if large {
                String::new()
            } else {
                format!(" -m comment --comment {name}")
            };
            let _ = write!(
                out,
                "-A {sep}{comment} -s {endpoint}/{host} -j KUBE-MARK-MASQ\n\
                 -A {sep}{comment} -m {proto} -p {proto} -j DNAT --to-destination {target}\n"
            );
        }
    }
    out.push_str(
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n\
         COMMIT\n",
    );
    out
}

/// Input for `nft -f`: one table (`ip` or `ip6 kube-proxy`, as kube-proxy writes one per
/// family), ClusterIPs dispatched by a verdict map keyed by address . protocol . port, endpoints
/// picked by `numgen random`.
pub fn nftables(set: &ServiceSet, cluster_cidr: &str) -> String {
    let ports = set.ports();
    let (ip, addr_type, loopback) = match set.family() {
        Family::Ipv4 => ("ip", "ipv4_addr", "127.0.0.0/8"),
        Family::Ipv6 => ("ip6", "ipv6_addr", "::1"),
    };
    let mut out = String::with_capacity(ports.len() * 700);
    let _ = write!(
        out,
        "add table {ip} kube-proxy {{ comment \"rules for kube-proxy\" ; }}\n\
         add chain {ip} kube-proxy mark-for-masquerade\n\
         add rule {ip} kube-proxy mark-for-masquerade mark set mark or {MASQ_MARK}\n\
         add chain {ip} kube-proxy masquerading\n\
         add rule {ip} kube-proxy masquerading mark and {MASQ_MARK} == 0 return\n\
         add rule {ip} kube-proxy masquerading mark set mark xor {MASQ_MARK}\n\
         add rule {ip} kube-proxy masquerading masquerade fully-random\n\
         add set {ip} kube-proxy cluster-ips {{ type {addr_type} ; }}\n\
         add map {ip} kube-proxy service-ips {{ type {addr_type} . inet_proto . inet_service : verdict ; }}\n\
         add map {ip} kube-proxy service-nodeports {{ type inet_proto . inet_service : verdict ; }}\n\
         add map {ip} kube-proxy no-endpoint-services {{ type {addr_type} . inet_proto . inet_service : verdict ; }}\n\
         add chain {ip} kube-proxy cluster-ips-check\n\
         add rule {ip} kube-proxy cluster-ips-check {ip} daddr @cluster-ips reject\n\
         add chain {ip} kube-proxy endpoints-check\n\
         add rule {ip} kube-proxy endpoints-check {ip} daddr . meta l4proto . th dport vmap @no-endpoint-services\n\
         add chain {ip} kube-proxy services\n\
         add rule {ip} kube-proxy services {ip} daddr . meta l4proto . th dport vmap @service-ips\n\
         add rule {ip} kube-proxy services fib daddr type local {ip} daddr != {loopback} meta l4proto . th dport vmap @service-nodeports\n\
         add chain {ip} kube-proxy filter-forward {{ type filter hook forward priority -110 ; }}\n\
         add rule {ip} kube-proxy filter-forward ct state new jump endpoints-check\n\
         add rule {ip} kube-proxy filter-forward ct state new jump cluster-ips-check\n\
         add chain {ip} kube-proxy nat-prerouting {{ type nat hook prerouting priority -100 ; }}\n\
         add rule {ip} kube-proxy nat-prerouting jump services\n\
         add chain {ip} kube-proxy nat-output {{ type nat hook output priority -100 ; }}\n\
         add rule {ip} kube-proxy nat-output jump services\n\
         add chain {ip} kube-proxy nat-postrouting {{ type nat hook postrouting priority 100 ; }}\n\
         add rule {ip} kube-proxy nat-postrouting jump masquerading\n"
    );
    for port in &ports {
        let (proto, vip, dport) = (port.proto.rule_name(), port.cluster_ip, port.port);
        let svc = nft_chain("service", port, None);
        let _ = write!(
            out,
            "add chain {ip} kube-proxy {svc}\n\
             add rule {ip} kube-proxy {svc} {ip} daddr {vip} {proto} dport {dport} {ip} saddr != {cluster_cidr} jump mark-for-masquerade\n"
        );
        let mut vmap = Vec::with_capacity(port.endpoints.len());
        for (i, endpoint) in port.endpoints.iter().enumerate() {
            let ep = nft_chain("endpoint", port, Some(i));
            let _ = write!(
                out,
                "add chain {ip} kube-proxy {ep}\n\
                 add rule {ip} kube-proxy {ep} {ip} saddr {endpoint} jump mark-for-masquerade\n\
                 add rule {ip} kube-proxy {ep} meta l4proto {proto} dnat to {}\n",
                SocketAddr::new(*endpoint, port.target_port)
            );
            vmap.push(format!("{i} : goto {ep}"));
        }
        let _ = write!(
            out,
            "add rule {ip} kube-proxy {svc} numgen random mod {} vmap {{ {} }}\n\
             add element {ip} kube-proxy cluster-ips {{ {vip} }}\n\
             add element {ip} kube-proxy service-ips {{ {vip} . {proto} . {dport} : goto {svc} }}\n",
            port.endpoints.len(),
            vmap.join(", ")
        );
        if let Some(node_port) = port.node_port {
            let ext = nft_chain("external", port, None);
            let _ = write!(
                out,
                "add chain {ip} kube-proxy {ext}\n\
                 add rule {ip} kube-proxy {ext} jump mark-for-masquerade\n\
                 add rule {ip} kube-proxy {ext} goto {svc}\n\
                 add element {ip} kube-proxy service-nodeports {{ {proto} . {node_port} : goto {ext} }}\n"
            );
        }
    }
    out
}

/// The prefix length of one address of `family`.
fn host_prefix(family: Family) -> u8 {
    match family {
        Family::Ipv4 => 32,
        Family::Ipv6 => 128,
    }
}

/// kube-proxy names chains by a hash of the service port (and endpoint): 16 base32 characters
/// after the prefix; 16 hex digits of a hash here, which is as long and as unique.
fn chain_hash(port: &ServicePort, endpoint: Option<usize>) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let text = format!("{}/{}{endpoint:?}", port.name, port.proto.rule_name());
    for byte in text.bytes() {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016X}")
}

fn svc_chain(port: &ServicePort) -> String {
    format!("KUBE-SVC-{}", chain_hash(port, None))
}

fn ext_chain(port: &ServicePort) -> String {
    format!("KUBE-EXT-{}", chain_hash(port, None))
}

fn sep_chain(port: &ServicePort, endpoint: usize) -> String {
    format!("KUBE-SEP-{}", chain_hash(port, Some(endpoint)))
}

/// `service-<hash>-<namespace>-<name>-<proto>-<port>`, kube-proxy's nftables naming with `-` for
/// `/` and `:`.
fn nft_chain(kind: &str, port: &ServicePort, endpoint: Option<usize>) -> String {
    let hash = &chain_hash(port, endpoint)[..8];
    let name = port.name.replace(['/', ':'], "-");
    match endpoint {
        Some(i) => format!("{kind}-{hash}-{name}-{}-{i}", port.proto.rule_name()),
        None => format!("{kind}-{hash}-{name}-{}", port.proto.rule_name()),
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn set() -> ServiceSet {
        ServiceSet::new(3, 2, Ipv4Addr::new(10, 244, 1, 2))
    }

    #[test]
    fn iptables_measured_service_is_last_and_nodeports_close_the_chain() {
        let rules = iptables(&set(), "10.244.0.0/16");
        let services: Vec<&str> = rules
            .lines()
            .filter(|l| l.starts_with("-A KUBE-SERVICES"))
            .collect();
        assert_eq!(services.len(), 5);
        assert!(services[3].contains("bench:app"));
        assert!(services[4].contains("KUBE-NODEPORTS"));
        assert_eq!(rules.matches("--probability 0.5000000000").count(), 2);
        assert_eq!(rules.matches("COMMIT").count(), 2);
    }

    fn set6() -> ServiceSet {
        ServiceSet::new(
            3,
            2,
            "2001:db8:244::2".parse::<std::net::Ipv6Addr>().unwrap(),
        )
    }

    #[test]
    fn ip6tables_rules_use_ipv6_prefixes_and_bracketed_targets() {
        let rules = iptables(&set6(), "2001:db8:244::/56");
        assert!(!rules.contains("/32"), "{rules}");
        assert!(rules.contains("-d fd00:10:96::c/128 --dport 80"), "{rules}");
        assert!(rules.contains("-s 2001:db8:244::2/128 -j KUBE-MARK-MASQ"));
        assert!(rules.contains("--to-destination [2001:db8:244::2]:9000"));
        assert!(rules.contains("! -s 2001:db8:244::/56"));
    }

    #[test]
    fn nftables_ip6_table_for_an_ipv6_set() {
        let rules = nftables(&set6(), "2001:db8:244::/56");
        assert!(
            rules.lines().all(|l| !l.contains(" ip kube-proxy")),
            "{rules}"
        );
        assert_eq!(
            rules
                .matches("add element ip6 kube-proxy service-ips { fd00:10:96::")
                .count(),
            4
        );
        assert!(rules.contains("type ipv6_addr . inet_proto . inet_service"));
        assert!(rules.contains("dnat to [2001:db8:244::2]:9000"));
        assert!(rules.contains("ip6 daddr != ::1"));
    }

    #[test]
    fn nftables_maps_every_port() {
        let rules = nftables(&set(), "10.244.0.0/16");
        assert_eq!(
            rules
                .matches("add element ip kube-proxy service-ips")
                .count(),
            4
        );
        assert_eq!(rules.matches("service-nodeports {").count(), 2);
        assert!(rules.contains("numgen random mod 2 vmap"));
    }
}
