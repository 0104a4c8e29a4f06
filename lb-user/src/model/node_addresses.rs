//! The node addresses NodePorts answer on: kube-proxy's --nodeport-addresses, per family.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::model::Family;

/// Of the node's addresses `present` (and `node_ip`, which serves NodePorts even when it sits
/// on no local interface, e.g. behind a 1:1 NAT), those in `cidrs` (of this family); with no
/// CIDRs, all but loopback and IPv6 link-local ones (localhost NodePorts are a separate matter;
/// a link-local address means nothing without its interface, and every veth has one).
pub fn node_port_addresses<A>(present: &[A], node_ip: Option<A>, cidrs: &[A::Net]) -> Vec<A>
where
    A: Family + Into<IpAddr>,
    A::Net: Into<IpNet>,
{
    let cidrs: Vec<IpNet> = cidrs.iter().map(|&net| net.into()).collect();
    let mut addrs: Vec<A> = present
        .iter()
        .copied()
        .chain(node_ip)
        .filter(|&addr| {
            let ip: IpAddr = addr.into();
            if cidrs.is_empty() {
                !ip.is_loopback() && !is_link_local(ip)
            } else {
                cidrs.iter().any(|cidr| cidr.contains(&ip))
            }
        })
        .collect();
    addrs.sort_unstable();
    addrs.dedup();
    addrs
}

/// fe80::/10 (IPv4's 169.254.0.0/16 serves NodePorts as before).
fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(_) => false,
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    }
}

/// The addresses of `present` of family `A`.
pub fn of_family<A: Family>(present: &[IpAddr]) -> Vec<A> {
    present.iter().filter_map(|&ip| A::of(ip)).collect()
}

/// What chooses the NodePort addresses of each family: its node IP and its
/// --nodeport-addresses.
#[derive(Clone, Debug, Default)]
pub struct NodePortSelection {
    pub node_ip: Option<Ipv4Addr>,
    pub cidrs: Vec<Ipv4Net>,
    pub node_ip6: Option<Ipv6Addr>,
    pub cidrs6: Vec<Ipv6Net>,
}

impl NodePortSelection {
    /// The NodePort addresses of each family among the node's addresses `present`. A node
    /// without an IPv6 node IP has no IPv6 NodePorts (docs/ipv6.md).
    pub fn addresses(&self, present: &[IpAddr]) -> (Vec<Ipv4Addr>, Vec<Ipv6Addr>) {
        let v6 = match self.node_ip6 {
            Some(node_ip) => node_port_addresses(&of_family(present), Some(node_ip), &self.cidrs6),
            None => Vec::new(),
        };
        (
            node_port_addresses(&of_family(present), self.node_ip, &self.cidrs),
            v6,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_every_address_but_loopback_and_cidrs_select() {
        let node = Ipv4Addr::new(198, 51, 100, 1);
        let other = Ipv4Addr::new(192, 0, 2, 1);
        let present = [Ipv4Addr::LOCALHOST, node, other, node];
        assert_eq!(
            node_port_addresses(&present, Some(node), &[]),
            [other, node]
        );
        let only: Ipv4Net = "198.51.100.0/24".parse().unwrap();
        assert_eq!(node_port_addresses(&present, Some(node), &[only]), [node]);
        let loopback: Ipv4Net = "127.0.0.0/8".parse().unwrap();
        assert_eq!(
            node_port_addresses(&present, Some(node), &[loopback]),
            [Ipv4Addr::LOCALHOST]
        );
        // The node IP counts even when no interface holds it.
        assert_eq!(
            node_port_addresses(&[other], Some(node), &[]),
            [other, node]
        );
        // An IPv6-only node has no IPv4 node IP.
        assert_eq!(node_port_addresses(&[other], None, &[]), [other]);
    }

    #[test]
    fn ipv6_default_is_every_address_but_loopback_and_link_local_and_cidrs_select() {
        let node: Ipv6Addr = "2001:db8:100::10".parse().unwrap();
        let other: Ipv6Addr = "2001:db8:200::1".parse().unwrap();
        let link_local: Ipv6Addr = "fe80::1".parse().unwrap();
        let present = [Ipv6Addr::LOCALHOST, link_local, node, other];
        assert_eq!(
            node_port_addresses(&present, Some(node), &[]),
            [node, other]
        );
        let only: Ipv6Net = "2001:db8:200::/48".parse().unwrap();
        assert_eq!(node_port_addresses(&present, Some(node), &[only]), [other]);
        let link_locals: Ipv6Net = "fe80::/10".parse().unwrap();
        assert_eq!(
            node_port_addresses(&present, Some(node), &[link_locals]),
            [link_local],
            "chosen by a CIDR"
        );
        assert_eq!(
            node_port_addresses(&[other], Some(node), &[]),
            [node, other]
        );
        // Both families of the node's addresses, each chosen by its own flags.
        let v4 = Ipv4Addr::new(192, 0, 2, 1);
        let mixed: Vec<IpAddr> = vec![node.into(), other.into(), v4.into(), link_local.into()];
        let selection = NodePortSelection {
            node_ip: Some(v4),
            cidrs: Vec::new(),
            node_ip6: Some(node),
            cidrs6: vec![only],
        };
        assert_eq!(selection.addresses(&mixed), (vec![v4], vec![other]));
        let selection = NodePortSelection {
            cidrs6: Vec::new(),
            ..selection
        };
        assert_eq!(selection.addresses(&mixed), (vec![v4], vec![node, other]));
        let selection = NodePortSelection {
            node_ip6: None,
            ..selection
        };
        assert_eq!(
            selection.addresses(&mixed),
            (vec![v4], vec![]),
            "no IPv6 node IP"
        );
    }
}
