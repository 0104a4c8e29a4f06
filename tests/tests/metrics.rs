//! The metrics port of a running agent: `/proxyMode` names our mode, `/metrics` has the drops by
//! reason (the reasons `lb stats` lists), every pinned map's fill with the size a flag set, and
//! kube-proxy's change counters moving with a manifest change; every metric the Grafana
//! dashboard in deploy/ queries is exported.
use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;

use anyhow::{Context as _, Result, ensure};
use lb_common::map_name;
use lb_tests::{
    agent::{Agent, NODE_NAME, lb_binary},
    bpffs::Bpffs,
    echo::Proto,
    manifests::{EndpointManifest, ServiceManifest, yaml},
    netns::Netns,
    node::{CLUSTER_IP, PORT, TARGET_PORT},
    topology::Topology,
};
use serde_json::Value;

const METRICS: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 10249);
const HEALTHZ: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 10256);
const CONNTRACK_MAX: u32 = 4096;
const LOCAL_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 12);

/// Every sample of the text format: `name{labels}` → value.
fn samples(ns: &Netns) -> Result<BTreeMap<String, f64>> {
    let (status, text) = ns.http_get(METRICS, "/metrics")?;
    ensure!(status == 200, "/metrics: {status} {text}");
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(name, value)| Some((name.to_owned(), value.parse().ok()?)))
        .collect())
}

fn sample(samples: &BTreeMap<String, f64>, name: &str) -> Result<f64> {
    samples
        .get(name)
        .copied()
        .with_context(|| format!("{name} not in {samples:#?}"))
}

/// The metric names the dashboard's PromQL queries: ours and kube-proxy's, outside label
/// matchers (whose values are strings).
fn dashboard_metrics() -> Result<BTreeSet<String>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana-dashboard.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().context("panels")? {
        for target in panel["targets"].as_array().context("targets")? {
            exprs.push(target["expr"].as_str().context("expr")?.to_owned());
        }
    }
    let mut names = BTreeSet::new();
    for expr in exprs {
        let mut outside_braces = String::new();
        let mut depth = 0;
        for c in expr.chars() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ if depth == 0 => outside_braces.push(c),
                _ => {}
            }
        }
        names.extend(
            outside_braces
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .filter(|w| w.starts_with("kubeproxy_") || w.starts_with("lb_"))
                .map(str::to_owned),
        );
    }
    ensure!(names.len() > 10, "dashboard queries {names:?}");
    Ok(names)
}

/// The drop reasons `lb stats -o json` lists.
fn stats_drop_reasons(node: &Netns, bpffs: &str) -> Result<BTreeSet<String>> {
    let binary = lb_binary();
    let output = node.exec(
        &binary.to_string_lossy(),
        &["stats", "--bpffs", bpffs, "-o", "json"],
    )?;
    let stats: Value = serde_json::from_slice(&output.stdout)?;
    Ok(stats["drops"]
        .as_array()
        .context("drops")?
        .iter()
        .filter_map(|d| Some(d["reason"].as_str()?.to_owned()))
        .collect())
}

#[test]
fn proxy_mode_drops_map_fill_changes_and_the_dashboard() -> Result<()> {
    let topology = Topology::new(3)?;
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let web = |endpoints: &[&str]| {
        ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT)
            .endpoints(endpoints.iter().map(|p| topology.pod(p).ip))
    };
    // internalTrafficPolicy Local, its only endpoint on another node.
    let local = ServiceManifest::new("local", LOCAL_CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT)
        .internal_local()
        .endpoint(EndpointManifest::ready(topology.pod("pod-c").ip).on_node("node-2"));
    let conntrack_max = CONNTRACK_MAX.to_string();
    let mut agent = Agent::start(
        &topology,
        &yaml(&[web(&["pod-b"]), local.clone()]),
        &[
            "--bpffs",
            &bpffs_arg,
            "--conntrack-max",
            &conntrack_max,
            "--hostname-override",
            NODE_NAME,
        ],
    )?;
    let node = &topology.node;

    let (status, mode) = node.http_get(METRICS, "/proxyMode")?;
    ensure!(
        (status, mode.as_str()) == (200, "ebpf"),
        "/proxyMode: {status} {mode}"
    );

    // The dashboard's /healthz panel counts answers: one to count.
    node.http_get(HEALTHZ, "/healthz")?;
    let before = samples(node)?;

    let reasons: BTreeSet<String> = before
        .keys()
        .filter_map(|k| k.strip_prefix("lb_datapath_drops_total{reason=\""))
        .filter_map(|k| k.strip_suffix("\"}"))
        .map(str::to_owned)
        .collect();
    let listed = stats_drop_reasons(node, &bpffs_arg)?;
    ensure!(
        !reasons.is_empty() && reasons == listed,
        "drop reasons: /metrics {reasons:?}, lb stats {listed:?}"
    );

    for map in map_name::ALL {
        let max = sample(&before, &format!("lb_map_max_entries{{map=\"{map}\"}}"))?;
        ensure!(max > 0.0, "{map}: max_entries {max}");
        let entries = sample(&before, &format!("lb_map_entries{{map=\"{map}\"}}"))?;
        ensure!(entries <= max, "{map}: {entries} entries of {max}");
    }
    let conntrack = format!("lb_map_max_entries{{map=\"{}\"}}", map_name::CONNTRACK);
    ensure!(sample(&before, &conntrack)? == f64::from(CONNTRACK_MAX));
    // The ClusterIP's frontend is there (the web service has one port).
    let frontends = format!("lb_map_entries{{map=\"{}\"}}", map_name::FRONTENDS);
    ensure!(sample(&before, &frontends)? >= 1.0, "{before:#?}");
    // The counter slots fill as endpoints take them, though their map is an array.
    let stats = |metric: &str| format!("{metric}{{map=\"{}\"}}", map_name::BACKEND_STATS);
    let slots = sample(&before, &stats("lb_map_entries"))?;
    ensure!(
        slots >= 1.0 && slots < sample(&before, &stats("lb_map_max_entries"))?,
        "counter slots in use: {slots}"
    );

    for name in [
        "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
        "kubeproxy_sync_proxy_rules_service_changes_pending",
    ] {
        sample(&before, name)?;
    }
    let no_local = |policy: &str| {
        format!(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{{traffic_policy=\"{policy}\"}}"
        )
    };
    ensure!(
        (
            sample(&before, &no_local("internal"))?,
            sample(&before, &no_local("external"))?
        ) == (1.0, 0.0),
        "{before:#?}"
    );
    let services = "kubeproxy_sync_proxy_rules_service_changes_total";
    let endpoints = "kubeproxy_sync_proxy_rules_endpoint_changes_total";
    // The first sync added both services with their endpoints.
    ensure!(sample(&before, services)? == 2.0 && sample(&before, endpoints)? == 2.0);

    // One more endpoint for web: an endpoint change, no service change.
    agent.update_manifests(&yaml(&[web(&["pod-b", "pod-c"]), local]))?;
    let after = samples(node)?;
    ensure!(
        (sample(&after, services)?, sample(&after, endpoints)?) == (2.0, 3.0),
        "after an endpoint was added: {after:#?}"
    );
    let frontends_after = sample(&after, &frontends)?;
    ensure!(frontends_after == sample(&before, &frontends)?);

    let exported: BTreeSet<&str> = after
        .keys()
        .map(|k| k.split_once('{').map_or(k.as_str(), |(name, _)| name))
        .collect();
    let missing: Vec<String> = dashboard_metrics()?
        .into_iter()
        .filter(|name| !exported.contains(name.as_str()))
        .collect();
    ensure!(
        missing.is_empty(),
        "the dashboard queries {missing:?}, /metrics has no such sample: {exported:?}"
    );
    agent.stop()?;
    Ok(())
}
