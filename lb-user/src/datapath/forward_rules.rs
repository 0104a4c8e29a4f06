//! The node's iptables FORWARD rules kube-proxy keeps in its KUBE-FORWARD chain, as lb's
//! `LB-FORWARD`: on a node whose FORWARD policy is DROP, they accept the packets of masqueraded
//! Service connections (marked by the datapath, `--iptables-masquerade-bit`) and every packet of
//! a connection netfilter already accepted. Through the `iptables` command, whichever backend the
//! node's alternatives select (iptables-nft on Debian 12), as kube-proxy does.
use std::io::Write as _;
use std::process::{Command, Output, Stdio};

use anyhow::{Context as _, Result, bail};

/// The chain lb owns in the filter table.
pub const CHAIN: &str = "LB-FORWARD";
/// The comment of FORWARD's jump to `CHAIN`, which tells it apart from anyone else's rules.
pub const JUMP_COMMENT: &str = "lb forwarding rules";

/// The whole of `CHAIN`, in iptables-restore's syntax: kube-proxy's KUBE-FORWARD without its
/// `ctstate INVALID` drop (docs/datapath.md, "FORWARD policy DROP").
pub fn chain_restore_input(masquerade_mark: u32) -> String {
    format!(
        "*filter\n\
         :{CHAIN} - [0:0]\n\
         -A {CHAIN} -m comment --comment \"lb: masqueraded Service traffic\" \
         -m mark --mark {masquerade_mark:#x}/{masquerade_mark:#x} -j ACCEPT\n\
         -A {CHAIN} -m comment --comment \"lb: connections already accepted\" \
         -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
         COMMIT\n"
    )
}

/// FORWARD's jump to `CHAIN`, after `-C`, `-I` or `-D FORWARD`.
fn jump_rule() -> [&'static str; 6] {
    ["-m", "comment", "--comment", JUMP_COMMENT, "-j", CHAIN]
}

/// Whether the `iptables` command can be run at all.
pub fn available() -> bool {
    Command::new("iptables")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Makes `CHAIN` hold exactly its rules (in one iptables-restore transaction, so that a restart
/// never leaves FORWARD without them), and FORWARD jump to it first, once. Idempotent.
pub fn ensure(masquerade_mark: u32) -> Result<()> {
    restore(&chain_restore_input(masquerade_mark))?;
    if !jump_exists()? {
        let mut args = vec!["-I", "FORWARD", "1"];
        args.extend(jump_rule());
        iptables(&args).with_context(|| format!("prepending FORWARD's jump to {CHAIN}"))?;
    }
    Ok(())
}

/// Removes FORWARD's jumps to `CHAIN` and the chain; true if there was anything to remove.
pub fn remove() -> Result<bool> {
    let mut removed = false;
    // Bounded: one jump is ours, more only if something duplicated it.
    for _ in 0..16 {
        if !jump_exists()? {
            break;
        }
        let mut args = vec!["-D", "FORWARD"];
        args.extend(jump_rule());
        iptables(&args).with_context(|| format!("deleting FORWARD's jump to {CHAIN}"))?;
        removed = true;
    }
    if chain_exists()? {
        iptables(&["-F", CHAIN]).with_context(|| format!("flushing {CHAIN}"))?;
        iptables(&["-X", CHAIN]).with_context(|| format!("deleting {CHAIN}"))?;
        removed = true;
    }
    Ok(removed)
}

fn jump_exists() -> Result<bool> {
    // No jump to a missing chain can exist, and iptables-nft's -C exits 2 (not 1) for one.
    if !chain_exists()? {
        return Ok(false);
    }
    let mut args = vec!["-C", "FORWARD"];
    args.extend(jump_rule());
    check(&args).with_context(|| format!("looking for FORWARD's jump to {CHAIN}"))
}

fn chain_exists() -> Result<bool> {
    check(&["-S", CHAIN]).with_context(|| format!("looking for chain {CHAIN}"))
}

/// Runs an iptables query whose exit status 1 means "no".
fn check(args: &[&str]) -> Result<bool> {
    let output = run(Command::new("iptables")
        .args(["-w", "-t", "filter"])
        .args(args))?;
    match output.status.code() {
        Some(0) => Ok(true),
        Some(1) => Ok(false),
        _ => bail!(failure("iptables", args, &output)),
    }
}

fn iptables(args: &[&str]) -> Result<()> {
    let output = run(Command::new("iptables")
        .args(["-w", "-t", "filter"])
        .args(args))?;
    if !output.status.success() {
        bail!(failure("iptables", args, &output));
    }
    Ok(())
}

/// `iptables-restore --noflush`: declaring a chain flushes it (creating it if missing), and
/// leaves the table's other chains as they are.
fn restore(input: &str) -> Result<()> {
    let args = ["-w", "--noflush"];
    let mut child = Command::new("iptables-restore")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running iptables-restore")?;
    child
        .stdin
        .take()
        .context("iptables-restore's stdin")?
        .write_all(input.as_bytes())
        .context("writing to iptables-restore")?;
    let output = child
        .wait_with_output()
        .context("waiting for iptables-restore")?;
    if !output.status.success() {
        bail!(
            "{} for:\n{input}",
            failure("iptables-restore", &args, &output)
        );
    }
    Ok(())
}

fn run(command: &mut Command) -> Result<Output> {
    command
        .output()
        .with_context(|| format!("running {:?}", command.get_program()))
}

fn failure(program: &str, args: &[&str], output: &Output) -> String {
    format!(
        "{program} {} failed ({}): {}",
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_marks_and_states() {
        let input = chain_restore_input(1 << 14);
        assert!(input.contains(":LB-FORWARD - [0:0]\n"), "{input}");
        assert!(
            input.contains("-m mark --mark 0x4000/0x4000 -j ACCEPT\n"),
            "{input}"
        );
        assert!(
            input.contains("-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n"),
            "{input}"
        );
        assert!(!input.contains("INVALID"), "{input}");
        assert!(input.ends_with("COMMIT\n"), "{input}");
    }
}
