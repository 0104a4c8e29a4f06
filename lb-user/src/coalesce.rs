//! When to sync: kube-proxy's `--min-sync-period` semantics, as a pure state machine.
//!
//! A change is applied as soon as possible, but no sooner than `min_interval` after the previous
//! sync started: a burst of changes during that interval becomes one sync. A sync reads the whole
//! desired state, so it never falls behind: whatever queued up is in it. A sync whose map writes
//! failed is retried after `retry` even without a change.
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Coalescer {
    min_interval: Duration,
    retry: Duration,
    last_run: Option<Instant>,
    /// When the oldest change not yet synced arrived (kube-proxy's "oldest pending queued").
    pending_since: Option<Instant>,
    /// Changes are not synced before this (a source's settle time, restarted by every change).
    not_before: Option<Instant>,
    retry_at: Option<Instant>,
}

impl Coalescer {
    pub fn new(min_interval: Duration, retry: Duration) -> Self {
        Self {
            min_interval,
            retry,
            last_run: None,
            pending_since: None,
            not_before: None,
            retry_at: None,
        }
    }

    /// A change arrived at `now`; it is not synced before `now + settle`.
    pub fn queue(&mut self, now: Instant, settle: Duration) {
        self.pending_since.get_or_insert(now);
        self.not_before = Some(now + settle);
    }

    /// When the next sync is due, if one is.
    pub fn due(&self) -> Option<Instant> {
        match self.pending_since {
            Some(since) => {
                let after_last = self.last_run.map(|l| l + self.min_interval);
                [Some(since), after_last, self.not_before]
                    .into_iter()
                    .flatten()
                    .max()
            }
            None => self.retry_at,
        }
    }

    /// A sync started at `started` and applied everything queued until then; `failed` if some
    /// of its map writes failed.
    pub fn ran(&mut self, started: Instant, failed: bool) {
        self.last_run = Some(started);
        self.pending_since = None;
        self.not_before = None;
        self.retry_at = failed.then(|| started + self.retry.max(self.min_interval));
    }

    /// The oldest change not yet synced.
    pub fn pending_since(&self) -> Option<Instant> {
        self.pending_since
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(1);
    const RETRY: Duration = Duration::from_secs(5);
    const NO_SETTLE: Duration = Duration::ZERO;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn nothing_queued_nothing_due() {
        let c = Coalescer::new(MIN, RETRY);
        assert_eq!(c.due(), None);
        assert_eq!(c.pending_since(), None);
    }

    #[test]
    fn first_change_syncs_at_once() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(MIN, RETRY);
        c.queue(t0, NO_SETTLE);
        assert_eq!(c.due(), Some(t0));
    }

    #[test]
    fn a_burst_within_the_min_interval_is_one_sync() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(MIN, RETRY);
        c.queue(t0, NO_SETTLE);
        c.ran(t0, false);
        for i in 1..10_000u64 {
            c.queue(t0 + Duration::from_micros(i * 50), NO_SETTLE);
        }
        assert_eq!(c.due(), Some(t0 + MIN));
        assert_eq!(c.pending_since(), Some(t0 + Duration::from_micros(50)));
        c.ran(t0 + MIN, false);
        assert_eq!(c.due(), None);
        assert_eq!(c.pending_since(), None);
    }

    #[test]
    fn a_change_long_after_the_last_sync_is_not_delayed() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(MIN, RETRY);
        c.ran(t0, false);
        c.queue(t0 + ms(3000), NO_SETTLE);
        assert_eq!(c.due(), Some(t0 + ms(3000)));
    }

    #[test]
    fn settle_time_restarts_with_every_change() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(Duration::ZERO, RETRY);
        c.queue(t0, ms(100));
        c.queue(t0 + ms(50), ms(100));
        assert_eq!(c.due(), Some(t0 + ms(150)));
    }

    #[test]
    fn failed_writes_are_retried_without_a_change() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(MIN, RETRY);
        c.queue(t0, NO_SETTLE);
        c.ran(t0, true);
        assert_eq!(c.due(), Some(t0 + RETRY));
        assert_eq!(c.pending_since(), None);
        // A change before the retry syncs sooner; that sync retries the writes too.
        c.queue(t0 + ms(1500), NO_SETTLE);
        assert_eq!(c.due(), Some(t0 + ms(1500)));
        c.ran(t0 + ms(1500), false);
        assert_eq!(c.due(), None);
    }
}
