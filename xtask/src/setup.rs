//! Installs the build and test prerequisites, each only when it is missing.
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

use crate::run;

/// The nightly toolchain that builds lb-ebpf (`-Z build-std=core`).
const NIGHTLY: &str = "nightly";
const BPF_LINKER_VERSION: &str = "0.13.0";
/// bpf-linker must use the nightly's own LLVM.
const BPF_LINKER_LLVM_FEATURE: &str = "llvm-22";
/// Debian packages the tests and the bench need, keyed by a binary each provides.
const DEBIAN_PACKAGES: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("sysctl", "procps"),
    // The bench: kube-proxy's rulesets (both iptables backends come with iptables), and GRO on
    // the veth the live-frames generator sends into.
    ("iptables-legacy-restore", "iptables"),
    ("nft", "nftables"),
    ("ethtool", "ethtool"),
];

pub fn ensure_all(root: &Path) -> Result<()> {
    ensure_nightly_rust_src()?;
    ensure_bpf_linker(root)?;
    ensure_debian_packages()
}

fn ensure_nightly_rust_src() -> Result<()> {
    if !succeeds(Command::new("rustup").args(["run", NIGHTLY, "rustc", "--version"])) {
        eprintln!("setup: installing the {NIGHTLY} toolchain");
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            NIGHTLY,
            "--profile",
            "minimal",
        ]))?;
    }
    if !nightly_sysroot()?
        .join("lib/rustlib/src/rust/library")
        .is_dir()
    {
        eprintln!("setup: adding rust-src to {NIGHTLY}");
        run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]))?;
    }
    Ok(())
}

fn ensure_bpf_linker(root: &Path) -> Result<()> {
    // aya-build runs bpf-linker under `rustup run nightly`, which puts the nightly's libLLVM on
    // the library path; check it the same way.
    let version = Command::new("rustup")
        .args(["run", NIGHTLY, "bpf-linker", "--version"])
        .stderr(Stdio::null())
        .output();
    if let Ok(out) = version
        && out.status.success()
        && String::from_utf8_lossy(&out.stdout).contains(BPF_LINKER_VERSION)
    {
        return Ok(());
    }
    eprintln!("setup: installing bpf-linker {BPF_LINKER_VERSION} against the {NIGHTLY} LLVM");
    let sysroot_lib = nightly_sysroot()?.join("lib");
    let libllvm = fs::read_dir(&sysroot_lib)
        .with_context(|| format!("read {}", sysroot_lib.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so."))
        })
        .with_context(|| format!("no libLLVM.so.* in {}", sysroot_lib.display()))?;
    // bpf-linker's build looks for $LLVM_PREFIX/lib/libLLVM.so.
    let prefix = root.join("target/bpf-linker-llvm");
    let prefix_lib = prefix.join("lib");
    fs::create_dir_all(&prefix_lib)?;
    let link = prefix_lib.join("libLLVM.so");
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(&libllvm, &link)
        .with_context(|| format!("symlink {}", link.display()))?;
    run(Command::new("cargo")
        .args([
            "install",
            "bpf-linker",
            "--locked",
            "--version",
            BPF_LINKER_VERSION,
            "--no-default-features",
            "--features",
            BPF_LINKER_LLVM_FEATURE,
        ])
        .env("LLVM_PREFIX", &prefix))
}

fn ensure_debian_packages() -> Result<()> {
    let missing: Vec<&str> = DEBIAN_PACKAGES
        .iter()
        .filter(|(binary, _)| !succeeds(Command::new("which").arg(binary)))
        .map(|(_, package)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("setup: apt-get install {}", missing.join(" "));
    run(Command::new("apt-get").arg("update"))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn nightly_sysroot() -> Result<PathBuf> {
    let out = Command::new("rustup")
        .args(["run", NIGHTLY, "rustc", "--print", "sysroot"])
        .output()
        .context("rustup run nightly rustc --print sysroot")?;
    if !out.status.success() {
        bail!("rustc +{NIGHTLY} --print sysroot failed");
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
