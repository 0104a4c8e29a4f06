//! `cargo xtask demo`: builds the test topology in network namespaces, runs the agent on
//! examples/manifests, drives the four Service paths over TCP and UDP and prints what answered.
//! Everything it creates is removed when it ends.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
};

use anyhow::{Context as _, Result};
use lb_tests::{
    agent::Agent,
    echo::{Answer, Proto, requests},
    netns::Netns,
    node::{TARGET_PORT, serve_pods},
    topology::{NODE_IP, POD_GATEWAY, Topology},
};

/// From examples/manifests/demo.yaml.
const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const HAIRPIN: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const PORT: u16 = 80;
const NODE_PORT: u16 = 30080;
const REQUESTS: usize = 20;

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

fn main() -> Result<()> {
    let topology = Topology::new(4).context("build the topology (run as root)")?;
    let servers = serve_pods(&topology, TARGET_PORT)?;
    let manifests =
        read_manifests(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/manifests"))?;
    let agent = Agent::start(&topology, &manifests, &[])?;

    let pod_a = topology.pod("pod-a");
    let paths = [
        DemoPath {
            name: "1 Pod-A → ClusterIP → Pod-B/Pod-C",
            from: Source::PodA,
            to: (WEB, PORT).into(),
            backends: &["pod-b", "pod-c"],
            seen_source: pod_a.ip.into(),
        },
        DemoPath {
            name: "2 Pod-A → ClusterIP → Pod-A (hairpin)",
            from: Source::PodA,
            to: (HAIRPIN, PORT).into(),
            backends: &["pod-a"],
            seen_source: POD_GATEWAY.into(),
        },
        DemoPath {
            name: "3 container → ClusterIP → Pod-B/Pod-C",
            from: Source::Container,
            to: (WEB, PORT).into(),
            backends: &["pod-b", "pod-c"],
            seen_source: POD_GATEWAY.into(),
        },
        DemoPath {
            name: "4 external → NodePort → Pod-B/Pod-C",
            from: Source::External,
            to: (NODE_IP, NODE_PORT).into(),
            backends: &["pod-b", "pod-c"],
            seen_source: POD_GATEWAY.into(),
        },
    ];

    println!(
        "{:<40} {:<5} {:<20} {:<24} {:<16} {:<20} result",
        "path", "proto", "to", "answered by", "backend saw", "client saw"
    );
    let mut failed = 0;
    for path in &paths {
        for proto in [Proto::Tcp, Proto::Udp] {
            let ns: &Netns = match path.from {
                Source::PodA => &pod_a.ns,
                Source::Container => &topology.container,
                Source::External => &topology.client,
            };
            let row = match requests(ns, proto, path.to, REQUESTS) {
                Ok(answers) => Row::of(path, &answers),
                Err(e) => Row::error(format!("{e:#}")),
            };
            failed += usize::from(!row.pass);
            println!(
                "{:<40} {:<5} {:<20} {:<24} {:<16} {:<20} {}",
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
    drop(topology);
    anyhow::ensure!(failed == 0, "{failed} path(s) failed");
    println!("all four paths pass over TCP and UDP; every namespace removed");
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
