//! The subcommands but `lb agent`: the command line, and each command that reads the pins.
pub mod args;
pub mod cleanup;
pub mod conntrack;
pub mod kube_proxy_config;
pub mod services;
pub mod stats;
pub mod status;
pub mod trace;
