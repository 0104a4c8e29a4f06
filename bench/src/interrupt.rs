//! SIGINT and SIGTERM end the run through the ordinary error path: the handler only sets a flag,
//! the phases check it between points, and the `?` that returns unwinds every Deployment (agent
//! stopped, servers joined, namespaces deleted) and the private bpffs with its pins, exactly as a
//! failed point would. A terminal's Ctrl-C also reaches the agent (same process group); it exits
//! on its own and its Deployment finds it gone.
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context as _, Result, bail};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: nix::libc::c_int) {
    // An atomic store is async-signal-safe; everything else waits for the next check.
    INTERRUPTED.store(true, Ordering::Relaxed);
}

pub fn install() -> Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { sigaction(signal, &action) }.with_context(|| format!("sigaction {signal}"))?;
    }
    Ok(())
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// Err once a signal arrived: returning it tears the run down.
pub fn check() -> Result<()> {
    if interrupted() {
        bail!("interrupted: namespaces, agents and pins removed");
    }
    Ok(())
}
