//! Network-namespace topologies and socket helpers for the integration tests.
