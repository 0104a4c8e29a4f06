//! `lb cleanup`: detaches every hook, removes every pin under --bpffs and the agent's iptables
//! FORWARD rules.
use std::path::Path;

use anyhow::{Context as _, Result};
use lb_user::datapath::forward_rules::{self, Iptables};
use lb_user::datapath::link_pins::{self, LINKS_DIR};
use lb_user::datapath::links;

use crate::cli::args::CleanupArgs;

/// Both removals are tried whether or not the other fails; the first error is returned.
pub fn run(args: CleanupArgs) -> Result<()> {
    let datapath = remove_datapath(&args);
    let rules = remove_forward_rules();
    datapath.and(rules)
}

fn remove_datapath(args: &CleanupArgs) -> Result<()> {
    // Kernels before TCX: the tc filters are not pinned, they are found by program name.
    for (interface, program) in links::detach_netlink_filters()? {
        println!("detached {program} (tc filter) from {interface}");
    }
    let dir = &args.bpffs;
    if !dir.exists() {
        println!("nothing pinned at {}", dir.display());
        return Ok(());
    }
    // Links first: a removed link pin detaches its program.
    let links = dir.join(LINKS_DIR);
    for name in link_pins::pinned_names(&links) {
        remove_pin(&links.join(&name))?;
        println!("detached {name}");
    }
    remove_dir(&links)?;
    for name in link_pins::pinned_names(dir) {
        remove_pin(&dir.join(&name))?;
        println!("removed map {name}");
    }
    remove_dir(dir)?;
    Ok(())
}

/// The agent's FORWARD rules (forward_rules.rs), which stay while the datapath does.
fn remove_forward_rules() -> Result<()> {
    let installed = Iptables::installed();
    if installed.is_empty() {
        println!("iptables not found: no {} to remove", forward_rules::CHAIN);
    }
    for iptables in installed {
        if iptables.remove()? {
            println!(
                "removed iptables chain {} and FORWARD's jump to it ({})",
                forward_rules::CHAIN,
                iptables.command
            );
        }
    }
    Ok(())
}

fn remove_pin(path: &Path) -> Result<()> {
    std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))
}

/// Removes an emptied pin directory; one that is a mount point itself stays, empty.
fn remove_dir(path: &Path) -> Result<()> {
    match std::fs::remove_dir(path) {
        Err(err)
            if err.kind() != std::io::ErrorKind::NotFound
                && err.raw_os_error() != Some(nix::libc::EBUSY) =>
        {
            Err(err).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}
