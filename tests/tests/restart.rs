//! The datapath outlives the agent. Long-lived TCP connections and UDP flows on three paths
//! (pod → ClusterIP, docker → ClusterIP masqueraded, external → NodePort masqueraded), each
//! echoing a line every 10 ms, run while the agent is stopped and started again on the same
//! bpffs: after SIGTERM and a 3 s gap, after SIGKILL, as an upgrade from an older conntrack
//! layout, and while the apiserver is down. None may be reset, none may wait more than 260 ms
//! for a reply, none may move to another backend. While no agent runs, new connections on every
//! path succeed. `lb cleanup` is the only way the datapath goes: it leaves nothing behind.
//!
//! Every test mounts its own bpffs, as a node's host does for the DaemonSet.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use aya::programs::links::LinkType;
use lb_tests::{
    agent::{Agent, lb_binary, stats_at},
    bpf_objects::{BpfIds, PinnedLinkInfo, pinned_links, program_array_ids},
    bpffs::Bpffs,
    cgroup::Cgroup,
    echo::{EchoServer, Proto, request},
    fake_apiserver::FakeApiserver,
    flows::{Flow, FlowReport, LineEchoServer, check_all},
    legacy_conntrack,
    manifests::{ServiceManifest, yaml},
    node::{Node, TARGET_PORT, serve_pods, vip},
    paths::{check_container_to_service, check_external_to_node_port, check_pod_to_service},
    topology::{EXTERNAL_INTERFACE, NODE_IP, Topology},
};

/// Services for new connections (answered by [`EchoServer`]s on TARGET_PORT).
const WEB_TCP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const WEB_UDP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
/// Services for the long-lived flows (answered by [`LineEchoServer`]s on FLOW_PORT).
const FLOW_TCP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const FLOW_UDP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 21);
const PORT: u16 = 80;
const FLOW_PORT: u16 = 8081;
const WEB_TCP_NODE_PORT: u16 = 30080;
const WEB_UDP_NODE_PORT: u16 = 30081;
const FLOW_TCP_NODE_PORT: u16 = 30082;
const FLOW_UDP_NODE_PORT: u16 = 30083;
const BACKENDS: [&str; 2] = ["pod-b", "pod-c"];
/// How long no agent runs after SIGTERM.
const GAP: Duration = Duration::from_secs(3);
/// How long the flows keep running once the new agent has synced: a connection the restart
/// broke shows it within this.
const AFTER_RESTART: Duration = Duration::from_secs(1);
const SYNC: Duration = Duration::from_secs(20);
/// How long the kernel may take to free what nothing references any more.
const RELEASE: Duration = Duration::from_secs(5);

/// A node whose agent, fed by an in-test apiserver, pins its datapath on a bpffs of the test's.
/// Fields drop in order: the agent first (its datapath stays), then the bpffs (which takes the
/// datapath with it), then the servers and the namespaces.
struct SurvivalNode {
    agent: Agent,
    api: FakeApiserver,
    bpffs: Bpffs,
    xdp: bool,
    _servers: Vec<EchoServer>,
    _flow_servers: Vec<LineEchoServer>,
    topology: Topology,
}

impl SurvivalNode {
    /// Pods a, b, c (b and c the backends of every service), the agent with `--xdp` if `xdp`.
    fn start(xdp: bool) -> Result<Self> {
        let topology = Topology::new(3)?;
        if xdp {
            topology.prepare_xdp_fast_path()?;
        }
        let servers = serve_pods(&topology, TARGET_PORT)?;
        let flow_servers = topology
            .pods
            .iter()
            .map(|pod| LineEchoServer::start(&pod.ns, &pod.name, FLOW_PORT))
            .collect::<Result<_>>()?;
        let api = FakeApiserver::start(&topology.node)?;
        api.add_node(lb_tests::agent::NODE_NAME, NODE_IP);
        let bpffs = Bpffs::mount()?;
        let bpffs_arg = bpffs.arg();
        let mut args = vec!["--bpffs", &bpffs_arg, "--min-sync-period", "200ms"];
        if xdp {
            args.push("--xdp");
        }
        let mut agent = Agent::start_api(&topology, &api, &args, true)?;
        let ips =
            |pods: &[&str]| -> Vec<Ipv4Addr> { pods.iter().map(|p| topology.pod(p).ip).collect() };
        let service = |name, ip, proto, target_port, node_port| {
            ServiceManifest::new(name, ip, proto, PORT, target_port)
                .node_port(node_port)
                .endpoints(ips(&BACKENDS))
        };
        api.publish(&[
            service(
                "web-tcp",
                WEB_TCP,
                Proto::Tcp,
                TARGET_PORT,
                WEB_TCP_NODE_PORT,
            ),
            service(
                "web-udp",
                WEB_UDP,
                Proto::Udp,
                TARGET_PORT,
                WEB_UDP_NODE_PORT,
            ),
            service(
                "flow-tcp",
                FLOW_TCP,
                Proto::Tcp,
                FLOW_PORT,
                FLOW_TCP_NODE_PORT,
            ),
            service(
                "flow-udp",
                FLOW_UDP,
                Proto::Udp,
                FLOW_PORT,
                FLOW_UDP_NODE_PORT,
            ),
        ])?;
        agent.wait_for_programmed(4, 8, SYNC)?;
        Ok(SurvivalNode {
            agent,
            api,
            bpffs,
            xdp,
            _servers: servers,
            _flow_servers: flow_servers,
            topology,
        })
    }

    /// A TCP connection and a UDP flow on each path.
    fn start_flows(&self) -> Result<Vec<Flow>> {
        let t = &self.topology;
        let node_port = |port| SocketAddr::from((NODE_IP, port));
        let paths = [
            (
                "pod → ClusterIP",
                &t.pod("pod-a").ns,
                (FLOW_TCP, PORT).into(),
                (FLOW_UDP, PORT).into(),
            ),
            (
                "docker → ClusterIP",
                &t.container,
                (FLOW_TCP, PORT).into(),
                (FLOW_UDP, PORT).into(),
            ),
            (
                "external → NodePort",
                &t.client,
                node_port(FLOW_TCP_NODE_PORT),
                node_port(FLOW_UDP_NODE_PORT),
            ),
        ];
        let mut flows = Vec::new();
        for (path, ns, tcp, udp) in paths {
            flows.push(Flow::start(ns, Proto::Tcp, tcp, &format!("{path} tcp"))?);
            flows.push(Flow::start(ns, Proto::Udp, udp, &format!("{path} udp"))?);
        }
        Ok(flows)
    }

    /// New connections on every path, TCP and UDP (30 each, checked by the paths module: who
    /// answered, which source the backend saw, which peer the client saw).
    fn check_new_connections(&self) -> Result<()> {
        let t = &self.topology;
        for (proto, ip, node_port) in [
            (Proto::Tcp, WEB_TCP, WEB_TCP_NODE_PORT),
            (Proto::Udp, WEB_UDP, WEB_UDP_NODE_PORT),
        ] {
            let vip = (ip, PORT).into();
            check_pod_to_service(t, proto, vip).with_context(|| format!("pod → {proto:?}"))?;
            check_container_to_service(t, proto, vip)
                .with_context(|| format!("docker → {proto:?}"))?;
            check_external_to_node_port(t, proto, vip, node_port)
                .with_context(|| format!("external → {proto:?} NodePort"))?;
        }
        Ok(())
    }

    fn xdp_forwarded(&self) -> Result<u64> {
        let counters = stats_at(&self.topology.node, &self.bpffs.arg())?;
        counters
            .get("xdp_forwarded")
            .copied()
            .with_context(|| format!("no xdp_forwarded in {counters:?}"))
    }
}

#[derive(Clone, Copy, Debug)]
enum Scenario {
    /// SIGTERM (what a rolling update sends), 3 s without an agent, a new agent.
    Sigterm,
    /// SIGKILL (a crash, the OOM killer), a new agent.
    Sigkill,
    /// SIGTERM, the pinned conntrack turned into the previous release's `LB_CT_V2`, a new
    /// agent, which converts it.
    UpgradeFromConntrackV2,
    /// SIGTERM, the apiserver goes, a new agent (with --node-ip) serves from the pinned state;
    /// the apiserver comes back.
    ApiserverDown,
}

/// Runs the flows across `scenario` and checks them (every flow's numbers are printed, and
/// are part of the error when a step of the scenario failed).
fn survives(scenario: Scenario, xdp: bool) -> Result<()> {
    let mut node = SurvivalNode::start(xdp)?;
    let flows = node.start_flows()?;
    let outcome = restart(&mut node, scenario);
    if outcome.is_ok() {
        // Not an event to await: the time a connection the restart broke needs to show it.
        std::thread::sleep(AFTER_RESTART);
    }
    let reports = flows
        .into_iter()
        .map(Flow::finish)
        .collect::<Result<Vec<FlowReport>>>()?;
    let summary: Vec<String> = reports.iter().map(ToString::to_string).collect();
    eprintln!("{scenario:?} xdp={xdp}:\n{}", summary.join("\n"));
    outcome.with_context(|| format!("flows:\n{}", summary.join("\n")))?;
    check_all(&reports).with_context(|| format!("{scenario:?}:\n{}", node.agent.log()))
}

/// Takes the agent through `scenario` and checks new connections while no agent runs and after
/// the restart, and that the new agent replaced the old one's programs in place: the same pinned
/// links, each with a new program, none added beside them, the old programs released.
fn restart(node: &mut SurvivalNode, scenario: Scenario) -> Result<()> {
    let pin_dir = node.bpffs.pin_dir();
    let old_programs = BpfIds {
        programs: BpfIds::held_by(node.agent.pid())?.programs,
        ..BpfIds::default()
    };
    let forwarded_before = if node.xdp { node.xdp_forwarded()? } else { 0 };
    let links_dir = pin_dir.join("links");
    let links_before = pinned_links(&links_dir)?;

    let stopped_at = Instant::now();
    match scenario {
        Scenario::Sigkill => {
            node.agent.kill()?;
        }
        Scenario::Sigterm | Scenario::UpgradeFromConntrackV2 | Scenario::ApiserverDown => {
            let status = node.agent.stop()?;
            ensure!(
                status.success(),
                "agent exit status {status}:\n{}",
                node.agent.log()
            );
        }
    }
    node.check_new_connections()
        .context("new connections while no agent runs")?;
    let ipv6_programs = pin_dir.join(lb_common::map_name::TC_IPV6_PROGRAMS);
    let slots = program_array_ids(&ipv6_programs)?;
    ensure!(
        slots
            .iter()
            .all(|id| id.is_some_and(|id| old_programs.programs.contains(&id))),
        "while no agent runs, the IPv6 programs' slots hold {slots:?}, not the agent's programs \
         {:?}",
        old_programs.programs
    );
    if node.xdp {
        let forwarded = node.xdp_forwarded()?;
        ensure!(
            forwarded > forwarded_before,
            "XDP forwarded nothing while no agent ran ({forwarded_before} before, {forwarded} after)"
        );
    }
    match scenario {
        Scenario::Sigterm => {
            if let Some(rest) = (stopped_at + GAP).checked_duration_since(Instant::now()) {
                std::thread::sleep(rest);
            }
            node.agent.restart(&[], true)?;
        }
        Scenario::Sigkill => node.agent.restart(&[], true)?,
        Scenario::UpgradeFromConntrackV2 => {
            let converted = legacy_conntrack::downgrade(&pin_dir)?;
            eprintln!("LB_CT_V2 pinned with {converted} entries");
            node.agent.restart(&[], true)?;
            for (pin, wanted) in [
                (lb_common::legacy::CONNTRACK_V2, false),
                (lb_common::map_name::CONNTRACK, true),
            ] {
                ensure!(
                    pin_dir.join(pin).exists() == wanted,
                    "after the upgrade {pin} is {}pinned:\n{}",
                    if wanted { "not " } else { "still " },
                    node.agent.log()
                );
            }
        }
        Scenario::ApiserverDown => {
            node.api.stop();
            node.agent
                .restart(&["--node-ip", &NODE_IP.to_string()], false)?;
            node.check_new_connections()
                .context("new connections with the apiserver down")?;
            node.api.restart()?;
            node.agent.wait_for_sync(SYNC)?;
        }
    }
    // bpf_link_update: the same links (ids), each with a new program.
    let links_after = pinned_links(&links_dir)?;
    for (name, before) in &links_before {
        let after = links_after.get(name);
        ensure!(
            after.is_some_and(|a| a.id == before.id && a.program != before.program),
            "link {name} was {before:?}, after the restart {after:?}:\n{}",
            node.agent.log()
        );
    }
    ensure!(
        links_after.len() == links_before.len(),
        "links before the restart {links_before:?}, after {links_after:?}"
    );
    // The new agent's IPv6 programs replaced the old one's, which the release below awaits.
    let slots = program_array_ids(&ipv6_programs)?;
    ensure!(
        slots
            .iter()
            .all(|id| id.is_some_and(|id| !old_programs.programs.contains(&id))),
        "after the restart the IPv6 programs' slots hold {slots:?}, the old agent's {:?}",
        old_programs.programs
    );
    old_programs
        .await_released(RELEASE)
        .with_context(|| format!("the old agent's programs:\n{}", node.agent.log()))?;
    node.check_new_connections()
        .context("new connections after the restart")
}

#[test]
fn flows_survive_sigterm_and_a_gap() -> Result<()> {
    survives(Scenario::Sigterm, false)
}

#[test]
fn flows_survive_sigterm_and_a_gap_xdp() -> Result<()> {
    survives(Scenario::Sigterm, true)
}

#[test]
fn flows_survive_sigkill() -> Result<()> {
    survives(Scenario::Sigkill, false)
}

#[test]
fn flows_survive_sigkill_xdp() -> Result<()> {
    survives(Scenario::Sigkill, true)
}

#[test]
fn flows_survive_upgrade_from_conntrack_v2() -> Result<()> {
    survives(Scenario::UpgradeFromConntrackV2, false)
}

#[test]
fn flows_survive_upgrade_from_conntrack_v2_xdp() -> Result<()> {
    survives(Scenario::UpgradeFromConntrackV2, true)
}

#[test]
fn flows_survive_restart_with_apiserver_down() -> Result<()> {
    survives(Scenario::ApiserverDown, false)
}

#[test]
fn flows_survive_restart_with_apiserver_down_xdp() -> Result<()> {
    survives(Scenario::ApiserverDown, true)
}

/// What `lb-node-client` (in `cgroup` and `ns`) got for one UDP request to `to`: the server's
/// name, or the error it printed.
fn node_local_udp(cgroup: &Cgroup, ns: &lb_tests::netns::Netns, to: SocketAddr) -> Result<String> {
    let text = cgroup.output(
        ns,
        env!("CARGO_BIN_EXE_lb-node-client"),
        &["udp", &to.to_string()],
    )?;
    match text.split_whitespace().next() {
        Some(first) => Ok(first.to_string()),
        None => bail!("lb-node-client printed nothing"),
    }
}

/// The names in the root directory of `bpffs`.
fn bpffs_entries(bpffs: &Bpffs) -> Result<Vec<String>> {
    let mut names = std::fs::read_dir(bpffs.root())?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<Vec<_>>>()?;
    names.sort();
    Ok(names)
}

/// SIGTERM leaves every hook in place (tc, XDP, the socket hooks); `lb cleanup` then detaches
/// them all and removes every pin: no program, map or link of the agent's stays loaded, no XDP
/// program on the external interface, the service no longer answers, pod traffic still flows.
#[test]
fn cleanup_removes_everything() -> Result<()> {
    let cgroup = Cgroup::new()?;
    let bpffs = Bpffs::mount()?;
    // A new bpffs has the kernel's own entries (progs.debug, maps.debug with BPF_PRELOAD).
    let fresh_bpffs = bpffs_entries(&bpffs)?;
    let bpffs_arg = bpffs.arg();
    let cgroup_path = cgroup.agent_path();
    let cgroup_arg = cgroup_path.to_str().context("cgroup path")?;
    let mut node = Node::start(
        2,
        &[],
        &["--bpffs", &bpffs_arg, "--xdp", "--cgroup", cgroup_arg],
    )?;
    let service = node.service(Proto::Udp, &["pod-b"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let pod_a = &node.topology.pod("pod-a").ns;
    let node_ns = &node.topology.node;
    ensure!(request(pod_a, Proto::Udp, vip())?.server == "pod-b");
    ensure!(node_local_udp(&cgroup, node_ns, vip())? == "pod-b");

    // The agent holds its programs and maps; its links, pinned, it need not.
    let links = pinned_links(&bpffs.pin_dir().join("links"))?;
    let mut held = BpfIds::held_by(node.agent.pid())?;
    held.links.extend(links.values().map(|l| l.id));
    held.programs.extend(links.values().map(|l| l.program));
    ensure!(
        !held.programs.is_empty() && !held.maps.is_empty(),
        "the agent holds {held:?}"
    );
    let types: Vec<LinkType> = links.values().map(|l| l.link_type).collect();
    for wanted in [LinkType::Tcx, LinkType::Xdp, LinkType::Cgroup] {
        ensure!(
            types.contains(&wanted),
            "no {wanted:?} link pinned: {links:?}"
        );
    }
    let xdp_attached = || -> Result<bool> {
        let link = node_ns.exec("ip", &["link", "show", EXTERNAL_INTERFACE])?;
        Ok(String::from_utf8(link.stdout)?.contains("xdp"))
    };
    ensure!(xdp_attached()?, "no XDP program on {EXTERNAL_INTERFACE}");
    let forward_rules = || -> Result<String> {
        let out = node_ns.exec("iptables", &["-S"])?;
        ensure!(out.status.success(), "iptables -S: {out:?}");
        Ok(String::from_utf8(out.stdout)?)
    };
    ensure!(
        forward_rules()?
            .contains("-A FORWARD -m comment --comment \"lb forwarding rules\" -j LB-FORWARD"),
        "no FORWARD jump to LB-FORWARD:\n{}",
        forward_rules()?
    );

    let status = node.agent.stop()?;
    ensure!(
        status.success(),
        "agent exit status {status}:\n{}",
        node.agent.log()
    );
    ensure!(
        request(pod_a, Proto::Udp, vip())?.server == "pod-b",
        "the service stopped answering after SIGTERM"
    );
    ensure!(
        node_local_udp(&cgroup, node_ns, vip())? == "pod-b",
        "node-local traffic not translated after SIGTERM"
    );
    ensure!(xdp_attached()?, "XDP detached by SIGTERM");

    let binary = lb_binary();
    node_ns
        .exec(
            &binary.to_string_lossy(),
            &["cleanup", "--bpffs", &bpffs_arg],
        )
        .context("lb cleanup")?;
    ensure!(
        !bpffs.pin_dir().exists(),
        "{} still exists after lb cleanup",
        bpffs.pin_dir().display()
    );
    ensure!(
        bpffs_entries(&bpffs)? == fresh_bpffs,
        "left on the bpffs: {:?}, when mounted {fresh_bpffs:?}",
        bpffs_entries(&bpffs)?
    );
    held.await_released(RELEASE)
        .context("the agent's programs, maps and links after lb cleanup")?;
    ensure!(!xdp_attached()?, "XDP still attached after lb cleanup");
    ensure!(
        !forward_rules()?.contains("LB-FORWARD"),
        "iptables rules left after lb cleanup:\n{}",
        forward_rules()?
    );
    ensure!(
        request(pod_a, Proto::Udp, vip()).is_err(),
        "the service still answers after lb cleanup"
    );
    ensure!(
        node_local_udp(&cgroup, node_ns, vip())? != "pod-b",
        "node-local traffic still translated after lb cleanup"
    );
    let direct: SocketAddr = (node.ip("pod-b"), TARGET_PORT).into();
    ensure!(request(pod_a, Proto::Udp, direct)?.server == "pod-b");
    Ok(())
}

/// Interfaces that come and go while no agent runs: the next agent unpins the links (tc ingress
/// and egress) of a pod veth that went (the kernel then frees them) and attaches to one that
/// appeared, whose pod, as a
/// backend, answers through the ClusterIP (its replies translated on that veth).
#[test]
fn restart_follows_interfaces_changed_while_stopped() -> Result<()> {
    let bpffs = Bpffs::mount()?;
    let mut node = Node::start(3, &[], &["--bpffs", &bpffs.arg()])?;
    let links_dir = bpffs.pin_dir().join("links");
    let before = pinned_links(&links_dir)?;
    let status = node.agent.stop()?;
    ensure!(status.success(), "agent exit status {status}");

    let gone = node.topology.pod("pod-c").host_interface.clone();
    node.topology.node.ip(&["link", "del", &gone])?;
    let pod_d = node.topology.add_pod()?;
    let _server = EchoServer::start(&pod_d.ns, &pod_d.name, TARGET_PORT)?;
    node.agent.restart(&[], true)?;

    let after = pinned_links(&links_dir)?;
    let ids = |links: &BTreeMap<String, PinnedLinkInfo>| -> BTreeSet<u32> {
        links.values().map(|l| l.id).collect()
    };
    let unpinned = &ids(&before) - &ids(&after);
    let added = &ids(&after) - &ids(&before);
    ensure!(
        unpinned.len() == 2 && added.len() == 2,
        "links before {before:?}, after {after:?} ({gone} deleted, lbpd added):\n{}",
        node.agent.log()
    );
    BpfIds {
        links: unpinned,
        ..BpfIds::default()
    }
    .await_released(RELEASE)
    .context("the links of the deleted interface")?;

    let service = node.service(Proto::Udp, &["pod-d"]);
    node.agent.update_manifests(&yaml(&[service]))?;
    let answer = request(&node.topology.pod("pod-a").ns, Proto::Udp, vip())?;
    ensure!(
        answer.server == "pod-d" && answer.peer == vip(),
        "through the new veth: {answer:?}"
    );
    Ok(())
}
