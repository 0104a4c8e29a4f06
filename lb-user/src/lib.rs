//! The agent: desired state from a source (the apiserver or a manifest directory), one
//! reconciler into the eBPF maps. The flow is source → model → reconcile → maps → datapath;
//! serve answers health and metrics beside it.
pub mod compact;
pub mod datapath;
pub mod maps;
pub mod model;
pub mod reconcile;
pub mod serve;
pub mod source;

/// `error: cause: cause`: aya's errors keep the OS error in their source, not their message.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
