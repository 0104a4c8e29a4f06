//! Kernels before TCX (Linux 6.6) take `lb_ingress` as a netlink tc filter, which cannot be
//! pinned: it stays attached when the agent exits, a restart replaces the agent's own filter
//! instead of stacking another beside it, and `lb cleanup` removes it. Exercised here through
//! the netlink path itself, which this kernel still offers beside TCX.
use anyhow::{Result, ensure};
use aya::{
    EbpfLoader,
    programs::{SchedClassifier, tc::TcAttachType},
};
use lb_common::{map_name, program_name};
use lb_tests::{
    agent::lb_binary,
    netns::{Netns, unique_prefix},
};

const INTERFACE: &str = "lbnl0";

/// One agent start's attach, on the thread that is in the namespace: a fresh object whose
/// program goes on the interface's tc ingress, then dropped as an exiting agent drops it.
fn attach_as_an_agent_would() -> Result<u32> {
    let mut ebpf = EbpfLoader::new()
        .map_max_entries(map_name::CONNTRACK, 1024)
        .load(lb_user::datapath::EBPF_OBJECT)?;
    let program: &mut SchedClassifier = ebpf
        .program_mut(program_name::INGRESS)
        .expect("lb_ingress")
        .try_into()?;
    lb_user::datapath::load_program(|| program.load())?;
    lb_user::datapath::links::attach_netlink_filter(program, INTERFACE, TcAttachType::Ingress)?;
    Ok(program.info()?.id())
}

/// The ids of the bpf programs on the interface's tc ingress (`tc filter show`).
fn ingress_filter_ids(ns: &Netns) -> Result<Vec<u32>> {
    let out = ns.exec("tc", &["filter", "show", "dev", INTERFACE, "ingress"])?;
    let text = String::from_utf8(out.stdout)?;
    Ok(text
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0] == "id")
        .filter_map(|w| w[1].parse().ok())
        .collect())
}

#[test]
fn a_restart_replaces_its_netlink_filter_and_cleanup_removes_it() -> Result<()> {
    let ns = Netns::new(unique_prefix())?;
    ns.ip(&[
        "link", "add", INTERFACE, "type", "veth", "peer", "name", "lbnl1",
    ])?;
    ns.ip(&["link", "set", INTERFACE, "up"])?;

    let first = ns.run(attach_as_an_agent_would)??;
    ensure!(
        ingress_filter_ids(&ns)? == [first],
        "the first agent's filter stays when it exits: {:?}",
        ingress_filter_ids(&ns)?
    );
    let second = ns.run(attach_as_an_agent_would)??;
    ensure!(second != first, "a new program was loaded");
    ensure!(
        ingress_filter_ids(&ns)? == [second],
        "the restart replaced the filter (not one beside it): {:?}",
        ingress_filter_ids(&ns)?
    );

    let bpffs = format!("/run/{}-nothing-pinned", unique_prefix());
    let out = ns.exec(
        &lb_binary().to_string_lossy(),
        &["cleanup", "--bpffs", &bpffs],
    )?;
    let printed = String::from_utf8(out.stdout)?;
    ensure!(
        printed.contains(&format!("from {INTERFACE}")),
        "cleanup says what it detached:\n{printed}"
    );
    ensure!(
        ingress_filter_ids(&ns)?.is_empty(),
        "cleanup left {:?}",
        ingress_filter_ids(&ns)?
    );
    Ok(())
}
