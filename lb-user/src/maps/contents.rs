//! What the service maps hold, as the reconciler wants them and as `lb status` reads them: the
//! type every side of a sync shares, in a leaf so that none of them imports another for it.
use std::collections::{BTreeMap, BTreeSet};

use ipnet::Ipv4Net;
use lb_common::{Backend, BackendKey, Frontend, FrontendKey, FrontendOrigin, ServiceStatus};

/// An entry of `SOURCE_RANGES`: sources in `net` may reach the load balancer IPs of service
/// port `service_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SourceRange {
    pub service_id: u32,
    pub net: Ipv4Net,
}

/// Desired contents of the service maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapContents {
    pub frontends: BTreeMap<FrontendKey, Frontend>,
    pub backends: BTreeMap<BackendKey, Backend>,
    pub source_ranges: BTreeSet<SourceRange>,
    /// The Service port and kind of each frontend but the catch-alls (for `lb services`).
    pub origins: BTreeMap<FrontendKey, FrontendOrigin>,
    /// What each service port wants the other maps to hold, by service id (for `lb status`);
    /// written after them at each sync.
    pub statuses: BTreeMap<u32, ServiceStatus>,
}

impl MapContents {
    /// How many entries of `self` and `other` differ: in one only, or with other values.
    pub fn differences(&self, other: &MapContents) -> usize {
        fn differing<K: Ord, V: PartialEq>(a: &BTreeMap<K, V>, b: &BTreeMap<K, V>) -> usize {
            let changed_or_lost = a.iter().filter(|(k, v)| b.get(k) != Some(*v)).count();
            changed_or_lost + b.keys().filter(|k| !a.contains_key(k)).count()
        }
        differing(&self.frontends, &other.frontends)
            + differing(&self.backends, &other.backends)
            + differing(&self.origins, &other.origins)
            + differing(&self.statuses, &other.statuses)
            + self
                .source_ranges
                .symmetric_difference(&other.source_ranges)
                .count()
    }
}
