//! `lb status` against a real agent: in sync (exit 0) once the agent has synced; a frontend
//! deleted and a backend slot added behind the agent's back name their Service missing and
//! extra (exit non-zero), also with the agent stopped (from the pinned records); a new agent
//! repairs them and it says in sync again.
use std::net::Ipv4Addr;
use std::process::Output;

use anyhow::{Context as _, Result, ensure};
use aya::maps::{HashMap, Map, MapData};
use lb_common::{
    Backend, BackendKey, Frontend, FrontendKey, IPPROTO_TCP, ipv4_be, map_name, port_be,
};
use lb_tests::{
    agent::{Agent, lb_binary},
    bpffs::Bpffs,
    echo::Proto,
    manifests::{ServiceManifest, yaml},
    netns::Netns,
    node::{CLUSTER_IP, PORT, TARGET_PORT},
    topology::Topology,
};
use serde_json::Value;

const DNS_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);

/// `lb status --bpffs BPFFS -o json` in the node namespace: whether it exited 0, and its JSON.
fn status(node: &Netns, bpffs: &str) -> Result<(bool, Value)> {
    let Output {
        status,
        stdout,
        stderr,
    } = node
        .command(lb_binary())
        .args(["status", "--bpffs", bpffs, "-o", "json"])
        .output()?;
    let json = serde_json::from_slice(&stdout).with_context(|| {
        format!(
            "lb status ({status}) printed:\n{}\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        )
    })?;
    Ok((status.success(), json))
}

/// The state `lb status` gives each Service, by "namespace/name".
fn states(json: &Value) -> Result<Vec<(String, String)>> {
    json["services"]
        .as_array()
        .context("services")?
        .iter()
        .map(|s| {
            let field = |f: &str| s[f].as_str().map(str::to_owned).context(f.to_owned());
            Ok((field("service")?, field("state")?))
        })
        .collect()
}

fn expect(json: &Value, wanted: &[(&str, &str)]) -> Result<()> {
    let wanted: Vec<(String, String)> = wanted
        .iter()
        .map(|(s, st)| (s.to_string(), st.to_string()))
        .collect();
    ensure!(states(json)? == wanted, "{json:#}");
    Ok(())
}

/// A pinned service map, opened from the test's own mount of the bpffs.
fn pinned<K: aya::Pod, V: aya::Pod>(bpffs: &Bpffs, name: &str) -> Result<HashMap<MapData, K, V>> {
    let path = bpffs.pin_dir().join(name);
    let map = MapData::from_pin(&path).with_context(|| path.display().to_string())?;
    Ok(HashMap::try_from(Map::HashMap(map))?)
}

#[test]
fn status_names_the_services_whose_entries_differ_with_or_without_the_agent() -> Result<()> {
    let topology = Topology::new(3)?;
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let ips = ["pod-b", "pod-c"].map(|p| topology.pod(p).ip);
    let manifests = yaml(&[
        ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT)
            .node_port(30080)
            .endpoints(ips),
        ServiceManifest::new("dns", DNS_CLUSTER_IP, Proto::Udp, PORT, TARGET_PORT).endpoints(ips),
    ]);
    // No audit in this test's time: what is changed behind the agent's back stays so.
    let args = ["--bpffs", &bpffs_arg, "--sync-period", "1h"];
    let mut agent = Agent::start(&topology, &manifests, &args)?;
    let node = &topology.node;

    let (ok, json) = status(node, &bpffs_arg)?;
    ensure!(ok && json["in_sync"] == true, "{json:#}");
    expect(
        &json,
        &[("default/dns", "in sync"), ("default/web", "in sync")],
    )?;
    ensure!(json["last_sync"]["result"] == "ok", "{json:#}");
    ensure!(
        json["last_sync"]["time_unix_s"].as_u64() > Some(0),
        "{json:#}"
    );
    let running = &json["agent"];
    ensure!(
        running["running"] == true
            && running["version"] == env!("CARGO_PKG_VERSION")
            && running["uptime_s"].is_u64()
            && running["services"] == 2,
        "{json:#}"
    );
    let maps: Vec<&str> = json["maps"]
        .as_array()
        .context("maps")?
        .iter()
        .filter(|m| m["max_entries"].as_u64() > Some(0) && m["entries"].is_u64())
        .filter_map(|m| m["map"].as_str())
        .collect();
    for name in map_name::ALL {
        ensure!(maps.contains(&name), "{name} not in {json:#}");
    }

    // The web ClusterIP frontend deleted behind the agent's back.
    let mut frontends = pinned::<FrontendKey, Frontend>(&bpffs, map_name::FRONTENDS)?;
    let key = FrontendKey {
        addr: ipv4_be(CLUSTER_IP.octets()),
        port: port_be(PORT),
        proto: IPPROTO_TCP,
        _pad: 0,
    };
    let web = frontends.get(&key, 0).context("the web frontend")?;
    frontends.remove(&key)?;
    let (ok, json) = status(node, &bpffs_arg)?;
    ensure!(!ok && json["in_sync"] == false, "{json:#}");
    expect(
        &json,
        &[("default/dns", "in sync"), ("default/web", "missing")],
    )?;
    let table = node
        .command(lb_binary())
        .args(["status", "--bpffs", &bpffs_arg])
        .output()?;
    let text = String::from_utf8_lossy(&table.stdout);
    ensure!(!table.status.success(), "{text}");
    ensure!(
        text.lines()
            .any(|l| l.trim_start().starts_with("default/web") && l.contains(" missing ")),
        "{text}"
    );

    // Read from the pins alone once the agent has stopped; a backend slot no one wants added to
    // dns.
    let stopped = agent.stop()?;
    ensure!(stopped.success(), "agent exit {stopped}:\n{}", agent.log());
    let (ok, json) = status(node, &bpffs_arg)?;
    ensure!(!ok, "{json:#}");
    expect(
        &json,
        &[("default/dns", "in sync"), ("default/web", "missing")],
    )?;
    ensure!(
        json["agent"]["running"] == false && json["agent"]["uptime_s"].is_null(),
        "{json:#}"
    );
    let dns_id = json["services"][0]["ports"][0]["service_id"]
        .as_u64()
        .context("dns service_id")?;
    let mut backends = pinned::<BackendKey, Backend>(&bpffs, map_name::BACKENDS)?;
    let stray = BackendKey {
        service_id: dns_id as u32,
        slot: 1000,
    };
    backends.insert(stray, Backend::default(), 0)?;
    let (ok, json) = status(node, &bpffs_arg)?;
    ensure!(!ok, "{json:#}");
    expect(
        &json,
        &[("default/dns", "extra"), ("default/web", "missing")],
    )?;

    // A new agent writes what it wants again (web under a new service id: its id is adopted
    // from its ClusterIP frontend, which is gone): in sync.
    agent.restart(&[], true)?;
    let restored = frontends.get(&key, 0).context("web's frontend restored")?;
    ensure!(restored.backend_count == web.backend_count, "{restored:?}");
    let (ok, json) = status(node, &bpffs_arg)?;
    ensure!(ok && json["in_sync"] == true, "{json:#}\n{}", agent.log());
    expect(
        &json,
        &[("default/dns", "in sync"), ("default/web", "in sync")],
    )?;
    Ok(())
}

/// A backend map too small for the Service: its writes fail and `lb status` says so, with the
/// error.
#[test]
fn status_reports_failed_writes_with_their_error() -> Result<()> {
    let topology = Topology::new(3)?;
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let ips = ["pod-b", "pod-c"].map(|p| topology.pod(p).ip);
    let manifests = yaml(&[
        ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT).endpoints(ips),
    ]);
    let args = ["--bpffs", &bpffs_arg, "--backends-max", "1"];
    let _agent = Agent::start(&topology, &manifests, &args)?;
    let (ok, json) = status(&topology.node, &bpffs_arg)?;
    ensure!(!ok && json["in_sync"] == false, "{json:#}");
    expect(&json, &[("default/web", "failed")])?;
    let error = json["services"][0]["error"].as_str().unwrap_or_default();
    ensure!(error.starts_with("backend insert: "), "{json:#}");
    ensure!(
        json["last_sync"]["failed_writes"].as_u64() > Some(0)
            && json["last_sync"]["result"]
                .as_str()
                .is_some_and(|r| r.ends_with("map writes failed")),
        "{json:#}"
    );
    Ok(())
}
