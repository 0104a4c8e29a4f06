//! The node's iptables FORWARD rules kube-proxy keeps in its KUBE-FORWARD chain, as lb's
//! `LB-FORWARD`: on a node whose FORWARD policy is DROP, they accept the packets of masqueraded
//! Service connections (marked by the datapath, `--iptables-masquerade-bit`) and every packet of
//! a connection netfilter already accepted. In the iptables backend (nft or legacy) the node's
//! rules are written in, detected as kubernetes-sigs/iptables-wrappers does for kube-proxy's
//! image: a rule accepting in one backend does not stop the other's DROP policy.
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

/// One iptables backend, by the commands that drive it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Iptables {
    pub command: &'static str,
    restore: &'static str,
    save: &'static str,
}

/// Whichever backend the node's alternatives select.
const DEFAULT: Iptables = Iptables {
    command: "iptables",
    restore: "iptables-restore",
    save: "iptables-save",
};
const NFT: Iptables = Iptables {
    command: "iptables-nft",
    restore: "iptables-nft-restore",
    save: "iptables-nft-save",
};
const LEGACY: Iptables = Iptables {
    command: "iptables-legacy",
    restore: "iptables-legacy-restore",
    save: "iptables-legacy-save",
};

/// The chains kubelet creates in the mangle table of the backend it uses, which
/// kubernetes-sigs/iptables-wrappers looks for first.
const KUBELET_HINTS: [&str; 2] = [":KUBE-IPTABLES-HINT ", ":KUBE-KUBELET-CANARY "];

/// What one backend's `iptables-save` shows of the node's use of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Usage {
    kubelet_hint: bool,
    rules: usize,
}

impl Usage {
    fn of_save_output(save: &str) -> Self {
        Self {
            kubelet_hint: save
                .lines()
                .any(|line| KUBELET_HINTS.iter().any(|hint| line.starts_with(hint))),
            rules: save.lines().filter(|line| line.starts_with("-A ")).count(),
        }
    }
}

/// The backend whose rules the node's netfilter policy is written in, as iptables-wrappers
/// decides (rules in the other one would not stop the node's own DROP policy): kubelet's hint
/// chains first, then the one holding more rules; the node's alternative when neither tells.
fn choose(nft: Usage, legacy: Usage) -> (Iptables, &'static str) {
    if nft.kubelet_hint {
        (NFT, "kubelet's chains are in iptables-nft")
    } else if legacy.kubelet_hint {
        (LEGACY, "kubelet's chains are in iptables-legacy")
    } else if legacy.rules > nft.rules {
        (LEGACY, "iptables-legacy holds more rules")
    } else if nft.rules > legacy.rules {
        (NFT, "iptables-nft holds more rules")
    } else {
        (
            DEFAULT,
            "neither backend holds rules: the node's alternative",
        )
    }
}

impl Iptables {
    /// Whether this backend's command can be run at all.
    fn available(&self) -> bool {
        Command::new(self.command)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    }

    /// The backend the node uses (see `choose`) and why; None without any iptables. With only
    /// one backend installed, the node's alternative.
    pub fn detect() -> Option<(Self, &'static str)> {
        if NFT.available() && LEGACY.available() {
            let usage = |backend: Self| {
                backend
                    .save_output()
                    .map(|save| Usage::of_save_output(&save))
                    .unwrap_or_default()
            };
            return Some(choose(usage(NFT), usage(LEGACY)));
        }
        DEFAULT
            .available()
            .then_some((DEFAULT, "one backend installed"))
    }

    /// Every backend that can hold the agent's rules, for their removal.
    pub fn installed() -> Vec<Self> {
        let both: Vec<Self> = [NFT, LEGACY].into_iter().filter(Self::available).collect();
        if both.len() == 2 {
            both
        } else {
            [DEFAULT].into_iter().filter(Self::available).collect()
        }
    }

    /// Makes `CHAIN` hold exactly its rules (in one iptables-restore transaction, so that a
    /// restart never leaves FORWARD without them), and FORWARD jump to it first, once.
    /// Idempotent.
    pub fn ensure(&self, masquerade_mark: u32) -> Result<()> {
        self.restore(&chain_restore_input(masquerade_mark))?;
        if !self.jump_exists()? {
            let mut args = vec!["-I", "FORWARD", "1"];
            args.extend(jump_rule());
            self.iptables(&args)
                .with_context(|| format!("prepending FORWARD's jump to {CHAIN}"))?;
        }
        Ok(())
    }

    /// Removes FORWARD's jumps to `CHAIN` and the chain; true if there was anything to remove.
    pub fn remove(&self) -> Result<bool> {
        let mut removed = false;
        // Bounded: one jump is ours, more only if something duplicated it.
        for _ in 0..16 {
            if !self.jump_exists()? {
                break;
            }
            let mut args = vec!["-D", "FORWARD"];
            args.extend(jump_rule());
            self.iptables(&args)
                .with_context(|| format!("deleting FORWARD's jump to {CHAIN}"))?;
            removed = true;
        }
        if self.chain_exists()? {
            self.iptables(&["-F", CHAIN])
                .with_context(|| format!("flushing {CHAIN}"))?;
            self.iptables(&["-X", CHAIN])
                .with_context(|| format!("deleting {CHAIN}"))?;
            removed = true;
        }
        Ok(removed)
    }

    fn jump_exists(&self) -> Result<bool> {
        // No jump to a missing chain can exist, and iptables-nft's -C exits 2 (not 1) for one.
        if !self.chain_exists()? {
            return Ok(false);
        }
        let mut args = vec!["-C", "FORWARD"];
        args.extend(jump_rule());
        self.check(&args)
            .with_context(|| format!("looking for FORWARD's jump to {CHAIN}"))
    }

    fn chain_exists(&self) -> Result<bool> {
        self.check(&["-S", CHAIN])
            .with_context(|| format!("looking for chain {CHAIN}"))
    }

    /// Runs an iptables query whose exit status 1 means "no".
    fn check(&self, args: &[&str]) -> Result<bool> {
        let output = run(Command::new(self.command)
            .args(["-w", "-t", "filter"])
            .args(args))?;
        match output.status.code() {
            Some(0) => Ok(true),
            Some(1) => Ok(false),
            _ => bail!(failure(self.command, args, &output)),
        }
    }

    fn iptables(&self, args: &[&str]) -> Result<()> {
        let output = run(Command::new(self.command)
            .args(["-w", "-t", "filter"])
            .args(args))?;
        if !output.status.success() {
            bail!(failure(self.command, args, &output));
        }
        Ok(())
    }

    /// Every table's rules, as `iptables-save` prints them.
    fn save_output(&self) -> Result<String> {
        let output = run(&mut Command::new(self.save))?;
        if !output.status.success() {
            bail!(failure(self.save, &[], &output));
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// `iptables-restore --noflush`: declaring a chain flushes it (creating it if missing), and
    /// leaves the table's other chains as they are.
    fn restore(&self, input: &str) -> Result<()> {
        let args = ["-w", "--noflush"];
        let mut child = Command::new(self.restore)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {}", self.restore))?;
        child
            .stdin
            .take()
            .with_context(|| format!("{}'s stdin", self.restore))?
            .write_all(input.as_bytes())
            .with_context(|| format!("writing to {}", self.restore))?;
        let output = child
            .wait_with_output()
            .with_context(|| format!("waiting for {}", self.restore))?;
        if !output.status.success() {
            bail!("{} for:\n{input}", failure(self.restore, &args, &output));
        }
        Ok(())
    }
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

    const SAVE_WITH_HINT: &str = "*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\n\
                                  :KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n";
    const SAVE_WITH_RULES: &str = "*filter\n:FORWARD DROP [0:0]\n:DOCKER - [0:0]\n\
                                   -A FORWARD -j DOCKER\n-A FORWARD -o docker0 -j ACCEPT\nCOMMIT\n";

    #[test]
    fn usage_of_save_output() {
        assert_eq!(
            Usage::of_save_output(SAVE_WITH_HINT),
            Usage {
                kubelet_hint: true,
                rules: 0
            }
        );
        assert_eq!(
            Usage::of_save_output(SAVE_WITH_RULES),
            Usage {
                kubelet_hint: false,
                rules: 2
            }
        );
        assert_eq!(Usage::of_save_output(""), Usage::default());
    }

    #[test]
    fn kubelet_hints_then_rules_then_the_alternative() {
        let hint = Usage::of_save_output(SAVE_WITH_HINT);
        let rules = Usage::of_save_output(SAVE_WITH_RULES);
        let none = Usage::default();
        assert_eq!(choose(hint, rules).0, NFT);
        assert_eq!(choose(rules, hint).0, LEGACY);
        assert_eq!(choose(hint, hint).0, NFT);
        assert_eq!(choose(none, rules).0, LEGACY);
        assert_eq!(choose(rules, none).0, NFT);
        assert_eq!(choose(none, none).0, DEFAULT);
    }
}
