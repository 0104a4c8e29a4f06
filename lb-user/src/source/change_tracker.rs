//! Which Services the apiserver's watch events touched, as kube-proxy's service and endpoints
//! change trackers do: a sync then converts, joins and reconciles only those.
//!
//! An object counts as changed when its resourceVersion differs from the one last seen, so a
//! relist that replays unchanged objects marks nothing; an object missing from a completed
//! relist was deleted while the watch was down.
//!
//! It keeps per object only its key, its resourceVersion as a number and its Service, whose name
//! it holds once ([`ChangeTracker::service_name`]): the specs, the model and the reconciler key
//! their maps by clones of that one name.
use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::{DefaultHasher, Hash as _, Hasher as _};

use crate::model::ServiceName;

/// The two kinds of object a Service's desired state comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Service,
    EndpointSlice,
}

/// What a watch event says of one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectVersion {
    /// `namespace/name`.
    pub key: String,
    pub resource_version: String,
    /// The Service the object belongs to: itself, or a slice's `kubernetes.io/service-name`.
    pub service: Option<ServiceName>,
}

/// A resourceVersion as a number: the apiserver's are decimal (etcd revisions); any other is
/// hashed, as equality is all that is asked of it.
fn version_number(resource_version: &str) -> u64 {
    resource_version.parse().unwrap_or_else(|_| {
        let mut hasher = DefaultHasher::new();
        resource_version.hash(&mut hasher);
        hasher.finish()
    })
}

#[derive(Debug, Default)]
struct Seen {
    /// key → (resourceVersion, owning service).
    objects: HashMap<Box<str>, (u64, Option<ServiceName>)>,
    /// The keys a relist in progress has listed so far.
    relisted: Option<HashSet<Box<str>>>,
}

/// What the tracker holds of one Service: whether its Service object is there, and the keys of
/// its slices, sorted (a Vec rather than a set: a service has one slice or a few, and a set's
/// node has room for eleven).
#[derive(Debug, Default)]
struct Owned {
    service: bool,
    slices: Vec<Box<str>>,
}

#[derive(Debug, Default)]
pub struct ChangeTracker {
    services: Seen,
    slices: Seen,
    /// Every Service that its own object or a slice names, by the one copy of its name.
    owners: HashMap<ServiceName, Owned>,
    changed: BTreeSet<ServiceName>,
}

impl ChangeTracker {
    /// A new version of an object was seen; whether it changed (a relist replays unchanged
    /// ones).
    pub fn applied(&mut self, kind: Kind, object: ObjectVersion) -> bool {
        let key: Box<str> = object.key.into();
        let version = version_number(&object.resource_version);
        let service = object.service.map(|name| self.shared(name));
        let seen = self.seen(kind);
        if let Some(relisted) = &mut seen.relisted {
            relisted.insert(key.clone());
        }
        let previous = seen.objects.insert(key.clone(), (version, service.clone()));
        if let Some((before, owner)) = &previous
            && *before == version
            && *owner == service
        {
            return false;
        }
        let before = previous.and_then(|(_, service)| service);
        self.moved(kind, &key, before, service);
        true
    }

    /// Whether the object `key` is there (seen and not deleted since).
    pub fn knows(&self, kind: Kind, key: &str) -> bool {
        let seen = match kind {
            Kind::Service => &self.services,
            Kind::EndpointSlice => &self.slices,
        };
        seen.objects.contains_key(key)
    }

    /// The tracker's copy of `name`, which the maps keyed by a Service share; None if no object
    /// names it.
    pub fn service_name(&self, name: &ServiceName) -> Option<ServiceName> {
        self.owners
            .get_key_value(name)
            .map(|(name, _)| name.clone())
    }

    pub fn deleted(&mut self, kind: Kind, key: &str) {
        if let Some((_, service)) = self.seen(kind).objects.remove(key) {
            self.moved(kind, key, service, None);
        }
    }

    /// A relist began: objects it does not list by [`ChangeTracker::relisted`] are gone.
    pub fn relisting(&mut self, kind: Kind) {
        self.seen(kind).relisted = Some(HashSet::new());
    }

    /// A relist completed.
    pub fn relisted(&mut self, kind: Kind) {
        let seen = self.seen(kind);
        let Some(listed) = seen.relisted.take() else {
            return;
        };
        let gone: Vec<Box<str>> = seen
            .objects
            .keys()
            .filter(|key| !listed.contains(*key))
            .cloned()
            .collect();
        for key in gone {
            self.deleted(kind, &key);
        }
    }

    /// The services changed since the last call.
    pub fn take_changed(&mut self) -> BTreeSet<ServiceName> {
        std::mem::take(&mut self.changed)
    }

    /// The keys of the slices that belong to `service`.
    pub fn slices_of(&self, service: &ServiceName) -> impl Iterator<Item = &str> {
        self.owners
            .get(service)
            .into_iter()
            .flat_map(|owned| &owned.slices)
            .map(|key| &**key)
    }

    fn seen(&mut self, kind: Kind) -> &mut Seen {
        match kind {
            Kind::Service => &mut self.services,
            Kind::EndpointSlice => &mut self.slices,
        }
    }

    /// The tracker's copy of `name` if it has one, else `name`.
    fn shared(&self, name: ServiceName) -> ServiceName {
        self.service_name(&name).unwrap_or(name)
    }

    /// The object `key` changed and now belongs to `after` instead of `before`.
    fn moved(
        &mut self,
        kind: Kind,
        key: &str,
        before: Option<ServiceName>,
        after: Option<ServiceName>,
    ) {
        if let Some(before) = &before
            && let Some(owned) = self.owners.get_mut(before)
        {
            match kind {
                Kind::Service => owned.service = false,
                Kind::EndpointSlice => {
                    if let Ok(i) = owned.slices.binary_search_by(|k| (**k).cmp(key)) {
                        owned.slices.remove(i);
                    }
                }
            }
            if !owned.service && owned.slices.is_empty() {
                self.owners.remove(before);
            }
        }
        if let Some(after) = &after {
            let owned = self.owners.entry(after.clone()).or_default();
            match kind {
                Kind::Service => owned.service = true,
                Kind::EndpointSlice => {
                    if let Err(i) = owned.slices.binary_search_by(|k| (**k).cmp(key)) {
                        // Most services have one slice: no room for more.
                        owned.slices.reserve_exact(1);
                        owned.slices.insert(i, key.into());
                    }
                }
            }
        }
        self.changed.extend(before);
        self.changed.extend(after);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(name: &str) -> ServiceName {
        ServiceName {
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    fn service(svc: &str, version: &str) -> ObjectVersion {
        ObjectVersion {
            key: format!("shop/{svc}"),
            resource_version: version.into(),
            service: Some(name(svc)),
        }
    }

    fn slice(key: &str, version: &str, svc: &str) -> ObjectVersion {
        ObjectVersion {
            key: format!("shop/{key}"),
            resource_version: version.into(),
            service: Some(name(svc)),
        }
    }

    fn names(list: &[&str]) -> BTreeSet<ServiceName> {
        list.iter().map(|n| name(n)).collect()
    }

    #[test]
    fn each_event_marks_only_its_service() {
        let mut tracker = ChangeTracker::default();
        tracker.applied(Kind::Service, service("web", "1"));
        tracker.applied(Kind::Service, service("db", "2"));
        tracker.applied(Kind::EndpointSlice, slice("web-a", "3", "web"));
        assert_eq!(tracker.take_changed(), names(&["db", "web"]));
        assert_eq!(tracker.take_changed(), names(&[]));

        tracker.applied(Kind::EndpointSlice, slice("web-a", "4", "web"));
        assert_eq!(tracker.take_changed(), names(&["web"]));
        tracker.deleted(Kind::Service, "shop/db");
        assert_eq!(tracker.take_changed(), names(&["db"]));
        tracker.deleted(Kind::EndpointSlice, "shop/web-a");
        assert_eq!(tracker.take_changed(), names(&["web"]));
        assert_eq!(tracker.slices_of(&name("web")).count(), 0);
    }

    #[test]
    fn the_same_version_again_is_no_change() {
        let mut tracker = ChangeTracker::default();
        tracker.applied(Kind::Service, service("web", "1"));
        tracker.take_changed();
        tracker.applied(Kind::Service, service("web", "1"));
        assert_eq!(tracker.take_changed(), names(&[]));
        tracker.deleted(Kind::Service, "shop/unknown");
        assert_eq!(tracker.take_changed(), names(&[]));
    }

    #[test]
    fn only_a_new_version_is_converted_and_a_deleted_object_is_unknown() {
        let mut tracker = ChangeTracker::default();
        assert!(tracker.applied(Kind::Service, service("web", "1")));
        assert!(!tracker.applied(Kind::Service, service("web", "1")));
        assert!(tracker.applied(Kind::Service, service("web", "2")));
        assert!(tracker.knows(Kind::Service, "shop/web"));
        assert!(!tracker.knows(Kind::EndpointSlice, "shop/web"));

        tracker.relisting(Kind::Service);
        tracker.relisted(Kind::Service);
        assert!(!tracker.knows(Kind::Service, "shop/web"));
        assert_eq!(tracker.take_changed(), names(&["web"]));
    }

    #[test]
    fn a_slice_that_changes_service_marks_both() {
        let mut tracker = ChangeTracker::default();
        tracker.applied(Kind::EndpointSlice, slice("s", "1", "web"));
        tracker.take_changed();
        tracker.applied(Kind::EndpointSlice, slice("s", "2", "api"));
        assert_eq!(tracker.take_changed(), names(&["api", "web"]));
        assert_eq!(tracker.slices_of(&name("web")).count(), 0);
        assert_eq!(
            tracker.slices_of(&name("api")).collect::<Vec<_>>(),
            ["shop/s"]
        );
    }

    #[test]
    fn a_relist_yields_only_the_real_changes() {
        let mut tracker = ChangeTracker::default();
        for (svc, version) in [("web", "1"), ("db", "2"), ("cache", "3")] {
            tracker.applied(Kind::Service, service(svc, version));
        }
        tracker.applied(Kind::EndpointSlice, slice("web-a", "4", "web"));
        tracker.applied(Kind::EndpointSlice, slice("db-a", "5", "db"));
        tracker.take_changed();

        // While the watch was down: db changed, cache and db's slice were deleted.
        tracker.relisting(Kind::Service);
        tracker.applied(Kind::Service, service("web", "1"));
        tracker.applied(Kind::Service, service("db", "6"));
        tracker.relisted(Kind::Service);
        tracker.relisting(Kind::EndpointSlice);
        tracker.applied(Kind::EndpointSlice, slice("web-a", "4", "web"));
        tracker.relisted(Kind::EndpointSlice);
        assert_eq!(tracker.take_changed(), names(&["cache", "db"]));
        assert_eq!(tracker.slices_of(&name("db")).count(), 0);
        assert_eq!(tracker.slices_of(&name("web")).count(), 1);
    }

    #[test]
    fn every_object_of_a_service_shares_one_copy_of_its_name() {
        let same = |a: &ServiceName, b: &ServiceName| {
            std::sync::Arc::ptr_eq(&a.name, &b.name)
                && std::sync::Arc::ptr_eq(&a.namespace, &b.namespace)
        };
        let mut tracker = ChangeTracker::default();
        tracker.applied(Kind::EndpointSlice, slice("web-a", "1", "web"));
        let first = tracker.take_changed().pop_first().unwrap();
        tracker.applied(Kind::Service, service("web", "2"));
        let service_marked = tracker.take_changed().pop_first().unwrap();
        tracker.applied(Kind::EndpointSlice, slice("web-b", "3", "web"));
        let slice_marked = tracker.take_changed().pop_first().unwrap();
        assert!(same(&first, &service_marked));
        assert!(same(&first, &slice_marked));
        assert!(same(&first, &tracker.service_name(&name("web")).unwrap()));

        // The name outlives neither its Service nor its slices.
        tracker.deleted(Kind::Service, "shop/web");
        assert!(tracker.service_name(&name("web")).is_some());
        tracker.deleted(Kind::EndpointSlice, "shop/web-a");
        tracker.deleted(Kind::EndpointSlice, "shop/web-b");
        assert_eq!(tracker.service_name(&name("web")), None);
    }

    #[test]
    fn resource_versions_compare_as_numbers_or_digests() {
        assert_eq!(version_number("12345"), 12345);
        assert_eq!(version_number("a1"), version_number("a1"));
        assert_ne!(version_number("a1"), version_number("a2"));
    }

    #[test]
    fn an_object_without_a_service_marks_nothing() {
        let mut tracker = ChangeTracker::default();
        tracker.applied(
            Kind::EndpointSlice,
            ObjectVersion {
                key: "shop/orphan".into(),
                resource_version: "1".into(),
                service: None,
            },
        );
        assert_eq!(tracker.take_changed(), names(&[]));
    }
}
