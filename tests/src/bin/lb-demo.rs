//! `cargo xtask demo`: builds the test topology in network namespaces, runs the agent on
//! examples/manifests with both families configured, drives the four Service paths over TCP and
//! UDP, over IPv4 and IPv6, and prints what answered. Everything it creates is removed when it
//! ends.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
};

use anyhow::{Context as _, Result};
use lb_tests::{
    agent::Agent,
    echo::{Answer, EchoServer, Proto, requests},
    netns::Netns,
    node::{TARGET_PORT, serve_pods},
    topology::{
        CLUSTER_CIDR, CLUSTER_CIDR_V6, NODE_IP, NODE_IP_V6, POD_GATEWAY, POD_GATEWAY_V6, Topology,
        pod_ip_v6,
    },
};

const PORT: u16 = 80;
const NODE_PORT: u16 = 30080;
const REQUESTS: usize = 20;

/// One family's addresses in the topology and in examples/manifests.
struct Family {
    web: IpAddr,
    hairpin: IpAddr,
    node: IpAddr,
    pod_a: IpAddr,
    /// The node's address towards the pods: the source of masqueraded connections.
    pod_gateway: IpAddr,
}

const IPV4: Family = Family {
    web: IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)),
    hairpin: IpAddr::V4(Ipv4Addr::new(10, 96, 0, 20)),
    node: IpAddr::V4(NODE_IP),
    pod_a: IpAddr::V4(Ipv4Addr::new(10, 244, 1, 2)),
    pod_gateway: IpAddr::V4(POD_GATEWAY),
};

const IPV6: Family = Family {
    web: IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x10)),
    hairpin: IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, 0x20)),
    node: IpAddr::V6(NODE_IP_V6),
    pod_a: IpAddr::V6(pod_ip_v6(0)),
    pod_gateway: IpAddr::V6(POD_GATEWAY_V6),
};

struct DemoPath {
    name: &'static str,
    from: Source,
    to: SocketAddr,
    /// Who may answer, and the source each backend must see.
    backends: &'static [&'static str],
    seen_source: IpAddr,
}

enum Source {
    PodA,
    /// On the docker bridge, outside the cluster CIDR.
    Container,
    /// The client namespace behind the node's external interface.
    External,
}

impl Family {
    fn paths(&self) -> [DemoPath; 4] {
        [
            DemoPath {
                name: "1 Pod-A → ClusterIP → Pod-B/Pod-C",
                from: Source::PodA,
                to: (self.web, PORT).into(),
                backends: &["pod-b", "pod-c"],
                seen_source: self.pod_a,
            },
            DemoPath {
                name: "2 Pod-A → ClusterIP → Pod-A (hairpin)",
                from: Source::PodA,
                to: (self.hairpin, PORT).into(),
                backends: &["pod-a"],
                seen_source: self.pod_gateway,
            },
            DemoPath {
                name: "3 container → ClusterIP → Pod-B/Pod-C",
                from: Source::Container,
                to: (self.web, PORT).into(),
                backends: &["pod-b", "pod-c"],
                seen_source: self.pod_gateway,
            },
            DemoPath {
                name: "4 external → NodePort → Pod-B/Pod-C",
                from: Source::External,
                to: (self.node, NODE_PORT).into(),
                backends: &["pod-b", "pod-c"],
                seen_source: self.pod_gateway,
            },
        ]
    }
}

fn main() -> Result<()> {
    let topology = Topology::new(4).context("build the topology (run as root)")?;
    topology.add_pod_ipv6()?;
    topology.add_external_ipv6()?;
    topology.add_container_ipv6()?;
    let servers = serve_pods(&topology, TARGET_PORT)?;
    // Beside each pod's server on 0.0.0.0, one on its IPv6 address.
    let servers_v6 = topology
        .pods
        .iter()
        .enumerate()
        .map(|(i, pod)| {
            EchoServer::start_on(&pod.ns, &pod.name, (pod_ip_v6(i), TARGET_PORT).into())
        })
        .collect::<Result<Vec<_>>>()?;
    let manifests =
        read_manifests(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/manifests"))?;
    let node_ips = format!("{NODE_IP},{NODE_IP_V6}");
    let cluster_cidrs = format!("{CLUSTER_CIDR},{CLUSTER_CIDR_V6}");
    let dual_stack = ["--node-ip", &node_ips, "--cluster-cidr", &cluster_cidrs];
    let agent = Agent::start(&topology, &manifests, &dual_stack)?;

    println!(
        "{:<40} {:<5} {:<24} {:<24} {:<20} {:<24} result",
        "path", "proto", "to", "answered by", "backend saw", "client saw"
    );
    let mut failed = 0;
    for path in IPV4.paths().iter().chain(&IPV6.paths()) {
        for proto in [Proto::Tcp, Proto::Udp] {
            let ns: &Netns = match path.from {
                Source::PodA => &topology.pod("pod-a").ns,
                Source::Container => &topology.container,
                Source::External => &topology.client,
            };
            let row = match requests(ns, proto, path.to, REQUESTS) {
                Ok(answers) => Row::of(path, &answers),
                Err(e) => Row::error(format!("{e:#}")),
            };
            failed += usize::from(!row.pass);
            println!(
                "{:<40} {:<5} {:<24} {:<24} {:<20} {:<24} {}",
                path.name,
                proto.manifest_name(),
                path.to,
                row.answered,
                row.seen,
                row.peer,
                if row.pass { "PASS" } else { "FAIL" }
            );
        }
    }
    drop(agent);
    drop(servers);
    drop(servers_v6);
    drop(topology);
    anyhow::ensure!(failed == 0, "{failed} path(s) failed");
    println!("all four paths pass over TCP and UDP in both families; every namespace removed");
    Ok(())
}

struct Row {
    answered: String,
    seen: String,
    peer: String,
    pass: bool,
}

impl Row {
    fn of(path: &DemoPath, answers: &[Answer]) -> Row {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for a in answers {
            *counts.entry(a.server.as_str()).or_default() += 1;
        }
        let mut seen: Vec<String> = answers
            .iter()
            .map(|a| a.seen_source.ip().to_string())
            .collect();
        seen.dedup();
        let mut peers: Vec<String> = answers.iter().map(|a| a.peer.to_string()).collect();
        peers.dedup();
        let pass = counts.keys().copied().eq(path.backends.iter().copied())
            && answers
                .iter()
                .all(|a| a.seen_source.ip() == path.seen_source && a.peer == path.to);
        Row {
            answered: counts
                .iter()
                .map(|(name, n)| format!("{name}×{n}"))
                .collect::<Vec<_>>()
                .join(" "),
            seen: seen.join(","),
            peer: peers.join(","),
            pass,
        }
    }

    fn error(message: String) -> Row {
        Row {
            answered: message,
            seen: "-".into(),
            peer: "-".into(),
            pass: false,
        }
    }
}

fn read_manifests(dir: &Path) -> Result<String> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    let docs = files
        .iter()
        .map(|f| std::fs::read_to_string(f).with_context(|| format!("read {}", f.display())))
        .collect::<Result<Vec<_>>>()?;
    Ok(docs.join("\n---\n"))
}
