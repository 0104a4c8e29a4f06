//! The node addresses NodePorts answer on: kube-proxy's --nodeport-addresses.
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

/// Of the node's addresses `present` (and `node_ip`, which serves NodePorts even when it sits
/// on no local interface, e.g. behind a 1:1 NAT), those in `cidrs`; with no CIDRs, all but
/// loopback (localhost NodePorts are a separate matter).
pub fn node_port_addresses(
    present: &[Ipv4Addr],
    node_ip: Option<Ipv4Addr>,
    cidrs: &[Ipv4Net],
) -> Vec<Ipv4Addr> {
    let mut addrs: Vec<Ipv4Addr> = present
        .iter()
        .copied()
        .chain(node_ip)
        .filter(|addr| {
            if cidrs.is_empty() {
                !addr.is_loopback()
            } else {
                cidrs.iter().any(|cidr| cidr.contains(addr))
            }
        })
        .collect();
    addrs.sort_unstable();
    addrs.dedup();
    addrs
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
}
