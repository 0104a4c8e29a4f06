//! Kubernetes Events on the Services whose map entries this node could not write (a full map),
//! in apiserver mode, so that `kubectl describe service` shows it. kube-runtime's Recorder
//! publishes them from a task of its own (the sync loop never waits on the apiserver) and makes a
//! repeat within its cache time a series on one Event.
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::error_chain;
use crate::maps::writer::WriteFailure;
use crate::model::ServiceName;
use crate::source::convert::InvalidField;

/// The reason of the Events on Services whose map writes failed.
pub const MAP_WRITE_FAILED: &str = "MapWriteFailed";
/// The reason of the Events on objects with fields that were skipped as invalid.
pub const FIELDS_SKIPPED: &str = "InvalidFieldsSkipped";
/// The Events' reporting controller; the instance is the node.
const CONTROLLER: &str = "lb";
/// A Service whose writes keep failing (they are retried at every sync) gets an Event again
/// after this long: client-go's event spam filter lets one through per object every 5 minutes.
const REPEAT_AFTER: Duration = Duration::from_secs(300);
/// Events waiting for the apiserver; a sync's further ones wait for a later sync (or, for
/// skipped fields, are only logged).
const QUEUE: usize = 64;

pub struct WriteFailureEvents {
    queue: mpsc::Sender<(Event, ObjectReference)>,
    node_name: String,
    throttle: Throttle,
}

impl WriteFailureEvents {
    /// Starts the publishing task.
    pub fn start(client: Client, node_name: &str) -> Self {
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: CONTROLLER.into(),
                instance: Some(node_name.into()),
            },
        );
        let (queue, mut events) = mpsc::channel::<(Event, ObjectReference)>(QUEUE);
        tokio::spawn(async move {
            while let Some((event, service)) = events.recv().await {
                if let Err(err) = recorder.publish(&event, &service).await {
                    let name = service.name.unwrap_or_default();
                    let namespace = service.namespace.unwrap_or_default();
                    warn!(service = %format!("{namespace}/{name}"), error = %error_chain(&err), "publishing an Event");
                }
            }
        });
        Self {
            queue,
            node_name: node_name.to_owned(),
            throttle: Throttle::default(),
        }
    }

    /// After a sync: a Warning Event on each Service of `failed` that has not had one within
    /// REPEAT_AFTER; `service` gives its object reference (None: no Event).
    pub fn report(
        &mut self,
        failed: &BTreeMap<ServiceName, WriteFailure>,
        service: impl Fn(&ServiceName) -> Option<ObjectReference>,
    ) {
        let now = Instant::now();
        self.throttle.keep_only(failed);
        for (name, failure) in failed {
            if !self.throttle.due(name, now) {
                continue;
            }
            let Some(reference) = service(name) else {
                continue;
            };
            let event = Event {
                type_: EventType::Warning,
                reason: MAP_WRITE_FAILED.into(),
                note: Some(format!(
                    "{} writes of this Service's entries to the service maps failed on node {} (the first: {}). Until they succeed, the node serves what its maps held for the Service before (nothing for a new one); they are retried at every sync. A full map needs a larger --frontends-max or --backends-max.",
                    failure.writes, self.node_name, failure.error
                )),
                action: "Sync".into(),
                secondary: None,
            };
            if self.queue.try_send((event, reference)).is_err() {
                debug!("Event queue full: the other services' Events wait for a later sync");
                break;
            }
            self.throttle.sent(name, now);
        }
    }

    /// A Warning Event on `object`, one of whose versions had `skipped` fields left out. Sent
    /// once per version: objects are converted again only when they change.
    pub fn fields_skipped(&self, object: ObjectReference, skipped: &[InvalidField]) {
        let fields: Vec<String> = skipped.iter().map(ToString::to_string).collect();
        let event = Event {
            type_: EventType::Warning,
            reason: FIELDS_SKIPPED.into(),
            note: Some(format!(
                "node {} left out invalid fields and serves the rest: {}",
                self.node_name,
                fields.join("; ")
            )),
            action: "Sync".into(),
            secondary: None,
        };
        if self.queue.try_send((event, object)).is_err() {
            debug!("Event queue full: the skipped fields are only logged");
        }
    }
}

/// When each failing service last had an Event.
#[derive(Debug, Default)]
struct Throttle {
    sent: BTreeMap<ServiceName, Instant>,
}

impl Throttle {
    /// Forgets the services that no longer fail: when they fail again, that is news.
    fn keep_only(&mut self, failing: &BTreeMap<ServiceName, WriteFailure>) {
        self.sent.retain(|name, _| failing.contains_key(name));
    }

    fn due(&self, name: &ServiceName, now: Instant) -> bool {
        self.sent
            .get(name)
            .is_none_or(|&at| now.duration_since(at) >= REPEAT_AFTER)
    }

    fn sent(&mut self, name: &ServiceName, now: Instant) {
        self.sent.insert(name.clone(), now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failing(names: &[&str]) -> BTreeMap<ServiceName, WriteFailure> {
        names
            .iter()
            .map(|n| {
                let name = ServiceName {
                    namespace: "default".into(),
                    name: (*n).into(),
                };
                let failure = WriteFailure {
                    writes: 1,
                    error: "backend insert: full".into(),
                };
                (name, failure)
            })
            .collect()
    }

    #[test]
    fn a_service_that_keeps_failing_is_reported_again_only_after_a_while() {
        let mut throttle = Throttle::default();
        let t0 = Instant::now();
        let web = failing(&["web"]);
        let name = web.keys().next().unwrap();
        assert!(throttle.due(name, t0));
        throttle.sent(name, t0);
        // The retries every few seconds.
        for retry in 1..60 {
            throttle.keep_only(&web);
            assert!(!throttle.due(name, t0 + Duration::from_secs(5 * retry)));
        }
        assert!(throttle.due(name, t0 + REPEAT_AFTER));
        // Written at last, then failing again: reported at once.
        throttle.keep_only(&failing(&[]));
        assert!(throttle.due(name, t0 + Duration::from_secs(10)));
    }
}
