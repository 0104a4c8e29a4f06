//! Where the desired state comes from: the apiserver's watchers or a manifest directory, and
//! the conversion of their Kubernetes objects into the model's specs.
pub mod apiserver;
pub mod change_tracker;
pub mod convert;
pub mod events;
pub mod manifests;
