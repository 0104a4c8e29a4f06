//! Masquerade policy, pure so that host tests run it: which connections are masqueraded
//! (kube-proxy's KUBE-MARK-MASQ), and the order in which a new connection's source port is
//! searched for in the range (the datapath's `masquerade::claim_source` runs the search).

use crate::{
    Backend, CONFIG_F_MASQUERADE_ALL, Config, FRONTEND_F_MASQUERADE, FRONTEND_F_PRESERVE_SOURCE,
    Frontend,
};

/// Candidate ports tried per new connection: bounded for the verifier, and enough that a failure
/// means the range is nearly full for this backend.
pub const PORT_TRIES: u32 = 16;

/// kube-proxy's KUBE-MARK-MASQ cases: --masquerade-all, a NodePort, a client outside the cluster
/// CIDR (whose replies would not come back through this node), and hairpin (a backend talking to
/// itself would answer its own address directly, bypassing the reverse translation). An
/// externalTrafficPolicy Local NodePort keeps the client's address (its endpoints are on this
/// node, so replies come back through it): only hairpin is masqueraded.
pub fn needed(config: &Config, frontend: &Frontend, client: u32, backend: &Backend) -> bool {
    let preserve = frontend.flags & FRONTEND_F_PRESERVE_SOURCE != 0;
    client == backend.addr
        || !preserve
            && (config.flags & CONFIG_F_MASQUERADE_ALL != 0
                || frontend.flags & FRONTEND_F_MASQUERADE != 0
                || client & config.cluster_cidr_mask != config.cluster_cidr_addr)
}

/// A search of the source port range `[min, min + span)` for a new connection: consecutive ports
/// from a random start, wrapping at the range's end, as Linux's `nf_nat_l4proto_unique_tuple`
/// walks it, so that concurrent connections rarely contend for the same port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortSearch {
    min: u32,
    span: u32,
    /// The offset in the range of the first port tried.
    start: u32,
}

impl PortSearch {
    /// The search of `[min, max]` (host byte order) starting at the offset `random` picks; `None`
    /// for an empty range.
    pub const fn new(min: u16, max: u16, random: u32) -> Option<Self> {
        let min = min as u32;
        let Some(span) = (max as u32 + 1).checked_sub(min) else {
            return None;
        };
        if span == 0 {
            return None;
        }
        Some(Self {
            min,
            span,
            start: random % span,
        })
    }

    /// How many ports the search tries: `PORT_TRIES`, or the whole range when it is smaller.
    pub const fn tries(&self) -> u32 {
        if PORT_TRIES < self.span {
            PORT_TRIES
        } else {
            self.span
        }
    }

    /// Whether try `index` is the search's last.
    pub const fn is_last(&self, index: u32) -> bool {
        index + 1 >= self.tries()
    }

    /// The port of try `index` (< `tries()`), in host byte order.
    pub const fn port(&self, index: u32) -> u16 {
        let mut offset = self.start + index;
        if offset >= self.span {
            offset -= self.span;
        }
        (self.min + offset) as u16
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;
    use crate::{FRONTEND_F_LOCAL, ipv4_be};

    fn ports(search: &PortSearch) -> Vec<u16> {
        (0..search.tries()).map(|i| search.port(i)).collect()
    }

    #[test]
    fn ports_are_tried_consecutively_from_the_random_start() {
        let search = PortSearch::new(32768, 60999, 100).unwrap();
        assert_eq!(search.tries(), PORT_TRIES);
        let tried = ports(&search);
        assert_eq!(tried[0], 32868);
        assert!(tried.windows(2).all(|w| w[1] == w[0] + 1), "{tried:?}");
        assert!(!search.is_last(PORT_TRIES - 2));
        assert!(search.is_last(PORT_TRIES - 1));
    }

    #[test]
    fn the_search_wraps_at_the_ranges_end_and_stays_inside_it() {
        // The start is the random number modulo the span (28,232 ports): offset 28,229 is the
        // range's third port from its end.
        let search = PortSearch::new(32768, 60999, 28232 + 28229).unwrap();
        let tried = ports(&search);
        assert_eq!(&tried[..4], &[60997, 60998, 60999, 32768]);
        assert_eq!(tried[PORT_TRIES as usize - 1], 32768 + 12);
        for random in [0, 1, u32::MAX, 0x8000_0000, 28231] {
            let search = PortSearch::new(32768, 60999, random).unwrap();
            assert!(
                ports(&search).iter().all(|p| (32768..=60999).contains(p)),
                "{random}"
            );
        }
    }

    #[test]
    fn a_small_range_is_tried_whole_and_once() {
        let search = PortSearch::new(1000, 1003, 2).unwrap();
        assert_eq!(search.tries(), 4);
        assert_eq!(ports(&search), [1002, 1003, 1000, 1001]);
        let one = PortSearch::new(5000, 5000, 12345).unwrap();
        assert_eq!(ports(&one), [5000]);
        assert!(one.is_last(0));
    }

    #[test]
    fn an_empty_range_has_no_search() {
        assert_eq!(PortSearch::new(2000, 1999, 0), None);
        assert_eq!(PortSearch::new(2000, 1000, 7), None);
        let full = PortSearch::new(0, u16::MAX, u32::MAX).unwrap();
        assert_eq!(full.port(0), (u32::MAX % 65536) as u16);
        assert_eq!(full.port(1), 0);
    }

    const CLIENT_IN_CLUSTER: u32 = ipv4_be([10, 244, 1, 5]);
    const CLIENT_OUTSIDE: u32 = ipv4_be([192, 0, 2, 7]);
    const BACKEND_ADDR: u32 = ipv4_be([10, 244, 2, 9]);

    fn config(flags: u32) -> Config {
        Config {
            flags,
            cluster_cidr_addr: ipv4_be([10, 244, 0, 0]),
            cluster_cidr_mask: ipv4_be([255, 255, 0, 0]),
            ..Config::default()
        }
    }

    fn frontend(flags: u32) -> Frontend {
        Frontend {
            flags,
            ..Frontend::default()
        }
    }

    fn backend() -> Backend {
        Backend {
            addr: BACKEND_ADDR,
            port: 80u16.to_be(),
            stats_slot: 0,
        }
    }

    #[test]
    fn masquerade_follows_kube_proxys_mark_masq_rules() {
        let plain = config(0);
        let clusterip = frontend(0);
        // A pod to a ClusterIP keeps its address; a client outside the cluster CIDR does not.
        assert!(!needed(&plain, &clusterip, CLIENT_IN_CLUSTER, &backend()));
        assert!(needed(&plain, &clusterip, CLIENT_OUTSIDE, &backend()));
        // --masquerade-all, and a NodePort (FRONTEND_F_MASQUERADE), masquerade pods too.
        let all = config(CONFIG_F_MASQUERADE_ALL);
        assert!(needed(&all, &clusterip, CLIENT_IN_CLUSTER, &backend()));
        let nodeport = frontend(FRONTEND_F_MASQUERADE);
        assert!(needed(&plain, &nodeport, CLIENT_IN_CLUSTER, &backend()));
        // Hairpin: a backend reaching itself through the service.
        assert!(needed(&plain, &clusterip, BACKEND_ADDR, &backend()));
    }

    #[test]
    fn traffic_policy_local_keeps_the_source_except_for_hairpin() {
        let local = frontend(FRONTEND_F_MASQUERADE | FRONTEND_F_LOCAL | FRONTEND_F_PRESERVE_SOURCE);
        let all = config(CONFIG_F_MASQUERADE_ALL);
        assert!(!needed(&all, &local, CLIENT_OUTSIDE, &backend()));
        assert!(!needed(&all, &local, CLIENT_IN_CLUSTER, &backend()));
        assert!(needed(&all, &local, BACKEND_ADDR, &backend()));
    }
}
