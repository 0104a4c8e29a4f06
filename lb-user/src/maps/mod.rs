//! The service maps' contents and the trait that writes them; the pinned maps from user space:
//! batch operations, counter slots, conntrack walks, and finding the pins from another process.
pub mod connections;
pub mod contents;
pub mod map_batch;
pub mod pins;
pub mod stats_slots;
pub mod writer;
