//! When to sync: kube-proxy's `--min-sync-period` semantics, as a pure state machine.
//!
//! kube-proxy's sync runner lets syncs through a token bucket of BURST tokens, one earned back
//! per `min_interval`: a change after a quiet period is synced at once (so is the one right
//! after it), and only a burst waits, each change then at most `min_interval` after the
//! previous sync started; whatever queued up meanwhile is one sync. A sync reads the whole
//! desired state, so it never falls behind. A sync whose map writes failed is retried after
//! `retry` even without a change.
use std::time::{Duration, Instant};

/// Syncs that may run back to back after a quiet period (kube-proxy's `burstSyncs`).
pub const BURST: u32 = 2;

#[derive(Debug, Clone)]
pub struct Coalescer {
    min_interval: Duration,
    retry: Duration,
    /// When the bucket is full again (every token earned back); None or past: it is. A sync
    /// may start once at least one token is back: `min_interval * (BURST - 1)` before this.
    full_at: Option<Instant>,
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
            full_at: None,
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
            Some(since) => [Some(since), self.token_at(), self.not_before]
                .into_iter()
                .flatten()
                .max(),
            None => self.retry_at,
        }
    }

    /// When the bucket holds a token again; None: it does.
    fn token_at(&self) -> Option<Instant> {
        let full_at = self.full_at?;
        full_at.checked_sub(self.min_interval * (BURST - 1))
    }

    /// A sync started at `started` and applied everything queued until then; `failed` if some
    /// of its map writes failed.
    pub fn ran(&mut self, started: Instant, failed: bool) {
        let from = self.full_at.map_or(started, |full_at| full_at.max(started));
        self.full_at = Some(from + self.min_interval);
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

    /// Queues a change at `at` and syncs it when due; returns when the sync ran.
    fn change(c: &mut Coalescer, at: Instant) -> Instant {
        c.queue(at, NO_SETTLE);
        let due = c.due().expect("a change is due");
        c.ran(due, false);
        due
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

    /// kube-proxy's burst: two syncs back to back after a quiet period, then one per period.
    #[test]
    fn the_change_after_an_isolated_one_syncs_at_once_too() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(MIN, RETRY);
        assert_eq!(change(&mut c, t0), t0);
        assert_eq!(change(&mut c, t0 + ms(100)), t0 + ms(100));
        assert_eq!(change(&mut c, t0 + ms(200)), t0 + MIN, "the third waits");
        assert_eq!(change(&mut c, t0 + MIN + ms(10)), t0 + 2 * MIN);
    }

    #[test]
    fn a_burst_waits_for_the_period_and_is_one_sync() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(MIN, RETRY);
        change(&mut c, t0);
        change(&mut c, t0 + ms(10));
        let first = t0 + ms(20);
        for i in 0..10_000u64 {
            c.queue(first + Duration::from_micros(i * 50), NO_SETTLE);
        }
        assert_eq!(c.due(), Some(t0 + MIN));
        assert_eq!(c.pending_since(), Some(first));
        c.ran(t0 + MIN, false);
        assert_eq!(c.due(), None);
        assert_eq!(c.pending_since(), None);
    }

    #[test]
    fn a_change_a_period_after_the_last_sync_is_not_delayed() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(MIN, RETRY);
        // A burst has taken every token...
        change(&mut c, t0);
        change(&mut c, t0);
        assert_eq!(change(&mut c, t0), t0 + MIN);
        // ...and one is back a period after the last sync.
        assert_eq!(change(&mut c, t0 + 2 * MIN), t0 + 2 * MIN);
        // A quiet period of BURST periods earns the whole burst back.
        let quiet = t0 + 10 * MIN;
        assert_eq!(change(&mut c, quiet), quiet);
        assert_eq!(change(&mut c, quiet + ms(1)), quiet + ms(1));
        assert_eq!(change(&mut c, quiet + ms(2)), quiet + MIN);
    }

    #[test]
    fn without_a_period_nothing_waits() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(Duration::ZERO, RETRY);
        for i in 0..100 {
            assert_eq!(change(&mut c, t0 + ms(i)), t0 + ms(i));
        }
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
