//! The writes of a sync into the service maps, as a trait: the aya maps implement it
//! (`datapath::ServiceMaps`), a fake does in tests.
use ipnet::Ipv6Net;
use lb_common::{
    Backend, Backend6, BackendKey, Frontend, FrontendKey, FrontendKey6, FrontendOrigin,
    ServiceStatus,
};

use crate::maps::contents::SourceRange;
use crate::maps::stats_slots::StatsReset;

/// The service maps, as the reconciler writes them: the aya maps, or a fake in tests. Each
/// call writes one phase of a sync, in order (one batch syscall on the aya maps), and returns
/// the entries that failed, by index; the others are written. Removing a key that is not there
/// is no failure. Source ranges, few, are written one by one.
pub trait MapWriter {
    type Error: std::error::Error + 'static;
    /// Writes each slot of `BACKEND_STATS` zeroed with its owner, on every CPU.
    fn reset_stats(&mut self, resets: &[StatsReset]) -> Vec<(usize, Self::Error)>;
    fn insert_backends(&mut self, entries: &[(BackendKey, Backend)]) -> Vec<(usize, Self::Error)>;
    fn remove_backends(&mut self, keys: &[BackendKey]) -> Vec<(usize, Self::Error)>;
    fn insert_frontends(
        &mut self,
        entries: &[(FrontendKey, Frontend)],
    ) -> Vec<(usize, Self::Error)>;
    fn remove_frontends(&mut self, keys: &[FrontendKey]) -> Vec<(usize, Self::Error)>;
    fn insert_origins(
        &mut self,
        entries: &[(FrontendKey, FrontendOrigin)],
    ) -> Vec<(usize, Self::Error)>;
    fn remove_origins(&mut self, keys: &[FrontendKey]) -> Vec<(usize, Self::Error)>;
    fn insert_statuses(&mut self, entries: &[(u32, ServiceStatus)]) -> Vec<(usize, Self::Error)>;
    fn remove_statuses(&mut self, service_ids: &[u32]) -> Vec<(usize, Self::Error)>;
    fn insert_source_range(&mut self, range: SourceRange) -> Result<(), Self::Error>;
    fn remove_source_range(&mut self, range: SourceRange) -> Result<(), Self::Error>;
    // The IPv6 maps, as their IPv4 twins above.
    fn insert_backends6(&mut self, entries: &[(BackendKey, Backend6)])
    -> Vec<(usize, Self::Error)>;
    fn remove_backends6(&mut self, keys: &[BackendKey]) -> Vec<(usize, Self::Error)>;
    fn insert_frontends6(
        &mut self,
        entries: &[(FrontendKey6, Frontend)],
    ) -> Vec<(usize, Self::Error)>;
    fn remove_frontends6(&mut self, keys: &[FrontendKey6]) -> Vec<(usize, Self::Error)>;
    fn insert_origins6(
        &mut self,
        entries: &[(FrontendKey6, FrontendOrigin)],
    ) -> Vec<(usize, Self::Error)>;
    fn remove_origins6(&mut self, keys: &[FrontendKey6]) -> Vec<(usize, Self::Error)>;
    fn insert_source_range6(&mut self, range: SourceRange<Ipv6Net>) -> Result<(), Self::Error>;
    fn remove_source_range6(&mut self, range: SourceRange<Ipv6Net>) -> Result<(), Self::Error>;
}

/// A service's failed map writes in one sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteFailure {
    pub writes: usize,
    /// The first one: the operation and the error.
    pub error: String,
}
