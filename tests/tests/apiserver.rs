//! The agent fed by an in-test apiserver (the real kube-rs list/watch client against
//! lb_tests::fake_apiserver): the four paths, changes while traffic flows, the apiserver going
//! away, expired watches, split and early slices, 10,000 services, /healthz, /livez, /metrics.
use std::{
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use aya::maps::{HashMap, Map, MapData};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use lb_common::{Frontend, FrontendKey, IPPROTO_TCP, ipv4_be, map_name, port_be};
use lb_tests::{
    agent::{Agent, NODE_NAME, SYNC_DONE},
    echo::{EchoServer, Proto, request, requests},
    fake_apiserver::{FakeApiserver, Kind},
    manifests::ServiceManifest,
    netns::Netns,
    node::{TARGET_PORT, serve_pods},
    paths::{
        Traffic, assert_answered_by, check_container_to_service, check_external_to_node_port,
        check_hairpin, check_pod_to_service,
    },
    topology::{NODE_IP, Topology},
};

const WEB_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const HAIRPIN_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const KEPT_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 12);
const PORT: u16 = 80;
const NODE_PORT: u16 = 30080;
const SYNC: Duration = Duration::from_secs(20);
/// Short, so tests do not wait on it; still coalesces the bursts the tests make.
const AGENT_ARGS: &[&str] = &["--min-sync-period", "200ms"];

fn addr(ip: Ipv4Addr) -> SocketAddr {
    (ip, PORT).into()
}

/// This node's Node object, with its InternalIP (the agent takes its node IP from it).
fn node_object() -> Node {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE_NAME},
        "status": {"addresses": [
            {"type": "Hostname", "address": NODE_NAME},
            {"type": "InternalIP", "address": NODE_IP.to_string()},
        ]},
    }))
    .expect("node")
}

/// The Service and EndpointSlice of a test manifest, as apiserver objects.
fn objects(manifest: &ServiceManifest) -> (Service, EndpointSlice) {
    let yaml = manifest.yaml();
    let mut docs = yaml.split("---\n");
    let service = yaml_serde::from_str(docs.next().expect("service")).expect("service yaml");
    let slice = yaml_serde::from_str(docs.next().expect("slice")).expect("slice yaml");
    (service, slice)
}

/// A topology with pods serving on TARGET_PORT, an apiserver in the node namespace holding the
/// Node and `services`, and the agent on it. Fields drop in order: the agent first.
struct ApiNode {
    agent: Agent,
    api: FakeApiserver,
    _servers: Vec<EchoServer>,
    topology: Topology,
}

impl ApiNode {
    fn start(pods: usize) -> Result<Self> {
        Self::start_with(pods, AGENT_ARGS, true, |_| {})
    }

    /// `prepare` runs on the apiserver before the agent starts (it may stop it).
    fn start_with(
        pods: usize,
        args: &[&str],
        wait: bool,
        prepare: impl FnOnce(&mut FakeApiserver),
    ) -> Result<Self> {
        let topology = Topology::new(pods)?;
        let servers = serve_pods(&topology, TARGET_PORT)?;
        let mut api = FakeApiserver::start(&topology.node)?;
        api.apply(&[node_object()]);
        prepare(&mut api);
        let mut node = ApiNode {
            agent: Agent::start_api(&topology, &api, args, false)?,
            api,
            _servers: servers,
            topology,
        };
        if wait {
            node.agent.wait_for_sync(SYNC)?;
        }
        Ok(node)
    }

    fn publish(&self, services: &[ServiceManifest]) {
        let (svcs, slices): (Vec<_>, Vec<_>) = services.iter().map(objects).unzip();
        self.api.apply(&svcs);
        self.api.apply(&slices);
    }

    fn ip(&self, pod: &str) -> Ipv4Addr {
        self.topology.pod(pod).ip
    }

    fn service(&self, name: &str, ip: Ipv4Addr, proto: Proto, pods: &[&str]) -> ServiceManifest {
        ServiceManifest::new(name, ip, proto, PORT, TARGET_PORT)
            .endpoints(pods.iter().map(|p| self.ip(p)))
    }
}

fn four_paths(proto: Proto) -> Result<()> {
    let mut node = ApiNode::start(3)?;
    let web = node
        .service("web", WEB_IP, proto, &["pod-b", "pod-c"])
        .node_port(NODE_PORT);
    let hairpin = node.service("hairpin", HAIRPIN_IP, proto, &["pod-a"]);
    node.publish(&[web, hairpin]);
    node.agent.wait_for_programmed(2, 3, SYNC)?;
    let t = &node.topology;
    check_pod_to_service(t, proto, addr(WEB_IP)).context("path 1")?;
    check_hairpin(t, proto, addr(HAIRPIN_IP)).context("path 2")?;
    check_container_to_service(t, proto, addr(WEB_IP)).context("path 3")?;
    check_external_to_node_port(t, proto, addr(WEB_IP), NODE_PORT).context("path 4")?;
    let log = node.agent.log();
    ensure!(
        log.contains(&format!("node_ip={NODE_IP}")),
        "node IP not from the Node:\n{log}"
    );
    Ok(())
}

#[test]
fn four_paths_tcp() -> Result<()> {
    four_paths(Proto::Tcp)
}

#[test]
fn four_paths_udp() -> Result<()> {
    four_paths(Proto::Udp)
}

/// Slices change, a service goes, another comes; a kept service's traffic sees no error. A
/// service another proxy owns (service-proxy-name label) is never programmed.
#[test]
fn create_update_delete_while_traffic_flows() -> Result<()> {
    let mut node = ApiNode::start(3)?;
    let kept = node.service("kept", KEPT_IP, Proto::Tcp, &["pod-c"]);
    let web = node.service("web", WEB_IP, Proto::Tcp, &["pod-b", "pod-c"]);
    node.publish(&[kept, web.clone()]);
    node.agent.wait_for_programmed(2, 3, SYNC)?;
    let pod_a = &node.topology.pod("pod-a").ns;
    let traffic = Traffic::start(pod_a, Proto::Tcp, addr(KEPT_IP), Duration::from_secs(30));

    let (_, fewer) = objects(&node.service("web", WEB_IP, Proto::Tcp, &["pod-b"]));
    node.api.apply(&[fewer]);
    node.agent.wait_for_programmed(2, 2, SYNC)?;
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(WEB_IP), 20)?, &["pod-b"])?;

    let (mut other, _) = objects(&node.service("other", HAIRPIN_IP, Proto::Tcp, &[]));
    other.metadata.labels.get_or_insert_default().insert(
        "service.kubernetes.io/service-proxy-name".into(),
        "other-proxy".into(),
    );
    node.api.apply(&[other]);
    node.api.delete::<EndpointSlice>(Some("default"), "web-1");
    node.api.delete::<Service>(Some("default"), "web");
    node.agent.wait_for_programmed(1, 1, SYNC)?;
    ensure!(
        request(pod_a, Proto::Tcp, addr(WEB_IP)).is_err(),
        "the deleted service still answers"
    );
    ensure!(
        request(pod_a, Proto::Tcp, addr(HAIRPIN_IP)).is_err(),
        "a service of another proxy was programmed"
    );

    let back = node.service("web", WEB_IP, Proto::Tcp, &["pod-b"]);
    node.publish(&[back]);
    node.agent.wait_for_programmed(2, 2, SYNC)?;
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(WEB_IP), 20)?, &["pod-b"])?;

    let (answers, errors) = traffic.finish()?;
    ensure!(
        errors.is_empty(),
        "the kept service was disturbed: {errors:?}"
    );
    assert_answered_by(&answers, &["pod-c"])
}

/// The apiserver goes away: the datapath keeps serving; a change made meanwhile is programmed
/// once it is back.
#[test]
fn apiserver_gone_and_back() -> Result<()> {
    let mut node = ApiNode::start(3)?;
    node.publish(&[node.service("web", WEB_IP, Proto::Tcp, &["pod-b", "pod-c"])]);
    node.agent.wait_for_programmed(1, 2, SYNC)?;
    node.api.stop();
    let pod_a = &node.topology.pod("pod-a").ns;
    // A few connections at a time: a flood would reuse source ports still in conntrack, which
    // keep their old backend.
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.extend(
            requests(pod_a, Proto::Tcp, addr(WEB_IP), 20).context("while the apiserver is away")?,
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    node.publish(&[node.service("web", WEB_IP, Proto::Tcp, &["pod-c"])]);
    assert_answered_by(&answers, &["pod-b", "pod-c"])?;
    let log = node.agent.log();
    ensure!(
        log.contains("watch failed"),
        "no watch failure logged:\n{log}"
    );

    node.api.restart()?;
    node.agent.wait_for_programmed(1, 1, SYNC)?;
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(WEB_IP), 20)?, &["pod-c"])
}

/// 410 Gone on every watch; the Service relist then fails for a while: the maps keep every live
/// service until the relist completes, then converge (a service created meanwhile appears).
#[test]
fn expired_watch_relists_without_deleting_live_services() -> Result<()> {
    let mut node = ApiNode::start(3)?;
    node.publish(&[
        node.service("web", WEB_IP, Proto::Tcp, &["pod-b"]),
        node.service("kept", KEPT_IP, Proto::Tcp, &["pod-c"]),
    ]);
    node.agent.wait_for_programmed(2, 2, SYNC)?;
    let lists_before = service_lists(&node.api);
    let syncs_before = node.agent.log().matches("sync done").count();
    // Syncs may still happen (other stores relisted, the Service store still whole): none of
    // them may drop a service.
    let lost_services = |log: &str| {
        log.lines()
            .filter(|l| l.contains("sync done"))
            .skip(syncs_before)
            .any(|l| !l.contains(" services=2 ") && !l.contains(" services=3 "))
    };

    node.api.fail_lists(Kind::Service, true);
    node.api.expire_watches();
    node.publish(&[node.service("late", HAIRPIN_IP, Proto::Tcp, &["pod-a"])]);
    let pod_a = &node.topology.pod("pod-a").ns;
    let traffic = Traffic::start(pod_a, Proto::Tcp, addr(WEB_IP), Duration::from_secs(3));
    let deadline = Instant::now() + SYNC;
    while service_lists(&node.api) < lists_before + 2 {
        ensure!(
            Instant::now() < deadline,
            "no relist: {:?}",
            node.api.requests()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (answers, errors) = traffic.finish()?;
    ensure!(
        errors.is_empty(),
        "a live service was disturbed: {errors:?}"
    );
    assert_answered_by(&answers, &["pod-b"])?;
    let log = node.agent.log();
    ensure!(
        !lost_services(&log),
        "a sync dropped a live service:\n{log}"
    );
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(KEPT_IP), 5)?, &["pod-c"])?;

    node.api.fail_lists(Kind::Service, false);
    node.agent.wait_for_programmed(3, 3, SYNC)?;
    assert_answered_by(
        &requests(pod_a, Proto::Tcp, addr(HAIRPIN_IP), 5)?,
        &["pod-a"],
    )
}

/// While the watches are down a Service and its slice are deleted and another slice changes;
/// the 410 forces relists, which carry no DELETED events: the diff against what was seen removes
/// the deleted service, programs the change and keeps the untouched one.
#[test]
fn a_relist_applies_what_changed_while_the_watches_were_down() -> Result<()> {
    const GONE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 13);
    let mut node = ApiNode::start(3)?;
    node.publish(&[
        node.service("web", WEB_IP, Proto::Tcp, &["pod-b", "pod-c"]),
        node.service("kept", KEPT_IP, Proto::Tcp, &["pod-c"]),
        node.service("gone", GONE_IP, Proto::Tcp, &["pod-b"]),
    ]);
    node.agent.wait_for_programmed(3, 4, SYNC)?;
    let pod_a = &node.topology.pod("pod-a").ns;
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(GONE_IP), 5)?, &["pod-b"])?;

    for kind in [Kind::Service, Kind::EndpointSlice] {
        node.api.fail_lists(kind, true);
    }
    node.api.expire_watches();
    node.api.delete::<EndpointSlice>(Some("default"), "gone-1");
    node.api.delete::<Service>(Some("default"), "gone");
    node.publish(&[node.service("web", WEB_IP, Proto::Tcp, &["pod-b"])]);
    node.api.expire_watches();
    for kind in [Kind::Service, Kind::EndpointSlice] {
        node.api.fail_lists(kind, false);
    }

    node.agent.wait_for_programmed(2, 2, SYNC)?;
    ensure!(
        request(pod_a, Proto::Tcp, addr(GONE_IP)).is_err(),
        "the service deleted while the watches were down still answers"
    );
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(WEB_IP), 20)?, &["pod-b"])?;
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(KEPT_IP), 5)?, &["pod-c"])
}

fn service_lists(api: &FakeApiserver) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.starts_with("GET /api/v1/services?") && !r.contains("watch=true"))
        .count()
}

/// One service's endpoints in three EndpointSlices; one of them goes.
#[test]
fn slices_split_across_objects() -> Result<()> {
    let mut node = ApiNode::start(4)?;
    let (service, _) = objects(&node.service("web", WEB_IP, Proto::Tcp, &[]));
    let slices: Vec<EndpointSlice> = ["pod-b", "pod-c", "pod-d"]
        .iter()
        .map(|pod| {
            let (_, mut slice) = objects(&node.service("web", WEB_IP, Proto::Tcp, &[pod]));
            slice.metadata.name = Some(format!("web-{pod}"));
            slice
        })
        .collect();
    node.api.apply(&[service]);
    node.api.apply(&slices);
    node.agent.wait_for_programmed(1, 3, SYNC)?;
    let pod_a = &node.topology.pod("pod-a").ns;
    assert_answered_by(
        &requests(pod_a, Proto::Tcp, addr(WEB_IP), 60)?,
        &["pod-b", "pod-c", "pod-d"],
    )?;
    node.api
        .delete::<EndpointSlice>(Some("default"), "web-pod-c");
    node.agent.wait_for_programmed(1, 2, SYNC)?;
    assert_answered_by(
        &requests(pod_a, Proto::Tcp, addr(WEB_IP), 40)?,
        &["pod-b", "pod-d"],
    )
}

/// The slices arrive (and are synced) before their service: the service then comes with its
/// endpoints.
#[test]
fn slices_before_their_service() -> Result<()> {
    let mut node = ApiNode::start(3)?;
    let (service, slice) = objects(&node.service("web", WEB_IP, Proto::Udp, &["pod-b", "pod-c"]));
    node.api.apply(&[slice]);
    std::thread::sleep(Duration::from_millis(500));
    node.api.apply(&[service]);
    node.agent.wait_for_programmed(1, 2, SYNC)?;
    check_pod_to_service(&node.topology, Proto::Udp, addr(WEB_IP))
}

/// `n` Services × 10 endpoints at `api`, on ClusterIPs from 10.100.0.0; the first Service's one
/// endpoint is pod-b, so traffic shows the maps serve it.
fn publish_many(api: &FakeApiserver, topology: &Topology, n: usize) {
    let mut services = Vec::with_capacity(n);
    let mut slices = Vec::with_capacity(n);
    for i in 0..n {
        let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 0)) + i as u32);
        let endpoints: Vec<Ipv4Addr> = if i == 0 {
            vec![topology.pods[1].ip]
        } else {
            (0..10u32)
                .map(|e| {
                    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 250, 0, 0)) + (i as u32) * 10 + e)
                })
                .collect()
        };
        let manifest = ServiceManifest::new(&format!("svc-{i}"), ip, Proto::Tcp, PORT, TARGET_PORT)
            .endpoints(endpoints);
        let (svc, slice) = objects(&manifest);
        services.push(svc);
        slices.push(slice);
    }
    api.apply(&services);
    api.apply(&slices);
}

/// /livez answers while the agent's first sync of 10,000 Services × 10 endpoints runs: the
/// sync blocks the agent's own loop, not its servers. An answer counts when the log shows every
/// store listed (the sync is due at once with --min-sync-period 0s) and no sync done yet, read
/// after the answer came.
#[test]
fn health_answers_during_a_long_sync() -> Result<()> {
    const N: usize = 10_000;
    let topology = Topology::new(2)?;
    let api = FakeApiserver::start(&topology.node)?;
    api.apply(&[node_object()]);
    publish_many(&api, &topology, N);
    let mut agent = Agent::start_api(&topology, &api, &["--min-sync-period", "0s"], false)?;
    let health: SocketAddr = (Ipv4Addr::LOCALHOST, 10256).into();
    let listed = [
        "list complete resource=Node",
        "list complete resource=Services",
        "list complete resource=EndpointSlices",
    ];
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut during_sync = 0;
    loop {
        let answered = topology.node.http_get(health, "/livez").is_ok();
        let log = agent.log();
        if log.contains(SYNC_DONE) {
            break;
        }
        if answered && listed.iter().all(|l| log.contains(l)) {
            during_sync += 1;
        }
        ensure!(Instant::now() < deadline, "no first sync:\n{log}");
        std::thread::sleep(Duration::from_millis(5));
    }
    agent.wait_for_programmed(N, (N - 1) * 10 + 1, SYNC)?;
    ensure!(
        during_sync >= 3,
        "/livez answered {during_sync} times during the first sync:\n{}",
        agent.log()
    );
    Ok(())
}

/// 10,000 services × 10 endpoints in the first list: all programmed, the time logged.
#[test]
fn ten_thousand_services_in_one_list() -> Result<()> {
    const N: usize = 10_000;
    let topology = Topology::new(2)?;
    let _server = EchoServer::start(&topology.pods[1].ns, "pod-b", TARGET_PORT)?;
    let api = FakeApiserver::start(&topology.node)?;
    api.apply(&[node_object()]);
    publish_many(&api, &topology, N);
    let start = Instant::now();
    let mut agent = Agent::start_api(&topology, &api, AGENT_ARGS, false)?;
    agent.wait_for_programmed(N, (N - 1) * 10 + 1, Duration::from_secs(120))?;
    let took = start.elapsed();
    let log = agent.log();
    let sync = log
        .lines()
        .find(|l| l.contains(&format!(" services={N} ")))
        .unwrap_or_default();
    let rss = agent.rss_kib()?;
    eprintln!(
        "{N} services x 10 endpoints: agent start to programmed in {took:?}, agent RSS {rss} KiB; {sync}"
    );
    // The first service's first endpoint is a real pod: the maps serve it.
    let answers = requests(
        &topology.pods[0].ns,
        Proto::Tcp,
        addr(Ipv4Addr::new(10, 100, 0, 0)),
        30,
    )?;
    ensure!(answers.iter().any(|a| a.server == "pod-b"), "{answers:?}");

    // One slice changes: the sync joins that one service, not the 10,000.
    let one_more = ServiceManifest::new(
        "svc-1",
        Ipv4Addr::new(10, 100, 0, 1),
        Proto::Tcp,
        PORT,
        TARGET_PORT,
    )
    .endpoints((0..11u32).map(|e| Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 251, 0, 0)) + e)));
    api.apply(&[objects(&one_more).1]);
    agent.wait_for_programmed(N, (N - 1) * 10 + 2, Duration::from_secs(60))?;
    let log = agent.log();
    let change = log
        .lines()
        .rfind(|l| l.contains(&format!(" endpoints={} ", (N - 1) * 10 + 2)))
        .unwrap_or_default();
    eprintln!("one slice changed: {change}");
    ensure!(
        change.contains(" services_joined=1 "),
        "a one-slice change joined more than its service: {change}"
    );
    Ok(())
}

/// kube-proxy's body: {"lastUpdated": "...","currentTime": "..."[, "nodeEligible": bool]}.
fn health_json(body: &str) -> Result<serde_json::Value> {
    let json: serde_json::Value = serde_json::from_str(body).with_context(|| body.to_owned())?;
    ensure!(
        json["lastUpdated"].is_string() && json["currentTime"].is_string(),
        "{body}"
    );
    Ok(json)
}

#[test]
fn healthz_livez_and_metrics() -> Result<()> {
    let mut node = ApiNode::start(2)?;
    node.publish(&[node.service("web", WEB_IP, Proto::Tcp, &["pod-b"])]);
    node.agent.wait_for_programmed(1, 1, SYNC)?;
    let ns = &node.topology.node;
    let health: SocketAddr = (Ipv4Addr::LOCALHOST, 10256).into();
    let (status, body) = ns.http_get(health, "/healthz")?;
    ensure!(status == 200, "{status} {body}");
    let json = health_json(&body)?;
    ensure!(json["nodeEligible"] == true, "{body}");
    ensure!(
        json["lastUpdated"] == json["currentTime"],
        "healthy: lastUpdated is now: {body}"
    );
    let (status, body) = ns.http_get(health, "/livez")?;
    ensure!(
        status == 200 && health_json(&body)?.get("nodeEligible").is_none(),
        "{status} {body}"
    );
    ensure!(ns.http_get(health, "/nope")?.0 == 404);

    let (status, text) = ns.http_get((Ipv4Addr::LOCALHOST, 10249).into(), "/metrics")?;
    ensure!(status == 200, "{status} {text}");
    for line in [
        "lb_services_programmed 1",
        "lb_endpoints_programmed 1",
        "lb_map_write_failures_total 0",
        "kubeproxy_proxy_healthz_total{code=\"200\"} 1",
    ] {
        ensure!(text.lines().any(|l| l == line), "{line:?} not in\n{text}");
    }
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_network_programming_duration_seconds_bucket",
    ] {
        ensure!(text.contains(name), "{name} not in\n{text}");
    }

    // A node marked for deletion by the cluster autoscaler fails /healthz, not /livez.
    let mut tainted = node_object();
    tainted.spec.get_or_insert_default().taints = Some(vec![k8s_openapi::api::core::v1::Taint {
        key: "ToBeDeletedByClusterAutoscaler".into(),
        effect: "NoSchedule".into(),
        ..Default::default()
    }]);
    node.api.apply(&[tainted]);
    let deadline = Instant::now() + SYNC;
    loop {
        let (status, body) = ns.http_get(health, "/healthz")?;
        if status == 503 {
            ensure!(health_json(&body)?["nodeEligible"] == false, "{body}");
            break;
        }
        ensure!(Instant::now() < deadline, "/healthz still {status} {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    ensure!(ns.http_get(health, "/livez")?.0 == 200);
    Ok(())
}

/// A change that cannot be synced (the slices never list) for longer than twice the sync period
/// makes /healthz and /livez 503; once synced they are 200 again.
#[test]
fn health_fails_while_changes_wait() -> Result<()> {
    let topology_args = ["--min-sync-period", "200ms", "--sync-period", "1s"];
    let mut node = ApiNode::start_with(2, &topology_args, false, |api| {
        api.fail_lists(Kind::EndpointSlice, true)
    })?;
    node.publish(&[node.service("web", WEB_IP, Proto::Tcp, &["pod-b"])]);
    let ns = &node.topology.node;
    let health: SocketAddr = (Ipv4Addr::LOCALHOST, 10256).into();
    let deadline = Instant::now() + SYNC;
    loop {
        match ns.http_get(health, "/livez") {
            Ok((503, body)) => {
                let json = health_json(&body)?;
                ensure!(
                    json["lastUpdated"] == "0001-01-01 00:00:00 +0000 UTC",
                    "{body}"
                );
                break;
            }
            other => ensure!(Instant::now() < deadline, "/livez still {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    ensure!(ns.http_get(health, "/healthz")?.0 == 503);
    node.api.fail_lists(Kind::EndpointSlice, false);
    node.agent.wait_for_programmed(1, 1, SYNC)?;
    let (status, body) = ns.http_get(health, "/healthz")?;
    ensure!(status == 200, "{status} {body}");
    Ok(())
}

/// `path` answers `want` on every GET from now until `duration` has passed (polled every 100 ms).
fn answers_throughout(ns: &Netns, path: &str, want: u16, duration: Duration) -> Result<()> {
    let health: SocketAddr = (Ipv4Addr::LOCALHOST, 10256).into();
    let end = Instant::now() + duration;
    while Instant::now() < end {
        let (status, body) = ns.http_get(health, path)?;
        ensure!(status == want, "{path}: {status} {body}");
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// With --node-ip the agent needs no apiserver to start: while it is unreachable the agent
/// loads and attaches the datapath, /livez is 200 and /healthz 503 (not ready: nothing synced);
/// once the apiserver is back and listed, the first sync makes /healthz 200 and the service
/// answers.
#[test]
fn starts_and_attaches_while_the_apiserver_is_down() -> Result<()> {
    let node_ip = NODE_IP.to_string();
    let args = ["--min-sync-period", "200ms", "--node-ip", &node_ip];
    let mut node = ApiNode::start_with(3, &args, false, FakeApiserver::stop)?;
    node.agent
        .wait_for_log(lb_tests::agent::ATTACHED, SYNC)
        .context("attaching while the apiserver is down")?;
    let ns = &node.topology.node;
    let health: SocketAddr = (Ipv4Addr::LOCALHOST, 10256).into();
    let (status, body) = ns.http_get(health, "/healthz")?;
    ensure!(status == 503, "/healthz before any sync: {status} {body}");
    ensure!(
        health_json(&body)?["lastUpdated"] == "0001-01-01 00:00:00 +0000 UTC",
        "{body}"
    );
    // Not ready, but alive: nothing waits to be synced, the apiserver is away.
    answers_throughout(ns, "/livez", 200, Duration::from_secs(1))?;
    ensure!(
        ns.http_get(health, "/healthz")?.0 == 503,
        "ready before a sync"
    );
    let log = node.agent.log();
    ensure!(
        log.contains("watch failed") && !log.contains(lb_tests::agent::SYNC_DONE),
        "{log}"
    );

    node.publish(&[node.service("web", WEB_IP, Proto::Tcp, &["pod-b", "pod-c"])]);
    node.api.restart()?;
    node.agent.wait_for_programmed(1, 2, SYNC)?;
    let (status, body) = ns.http_get(health, "/healthz")?;
    ensure!(
        status == 200,
        "/healthz after the first sync: {status} {body}"
    );
    let pod_a = &node.topology.pod("pod-a").ns;
    assert_answered_by(
        &requests(pod_a, Proto::Tcp, addr(WEB_IP), 20)?,
        &["pod-b", "pod-c"],
    )
}

/// A full backends map makes one service's writes fail, again at every retry: that is an error
/// (logged, lb_map_write_failures_total, a Warning Event on the Service), not a reason to restart
/// the agent: /livez stays 200 past twice the sync period, and so does /healthz (the node serves
/// every other service). The other service keeps answering.
#[test]
fn full_maps_fail_writes_not_liveness() -> Result<()> {
    let args = [
        "--min-sync-period",
        "200ms",
        "--sync-period",
        "1s",
        "--backends-max",
        "2",
    ];
    let mut node = ApiNode::start_with(3, &args, true, |_| {})?;
    node.publish(&[node.service("web", WEB_IP, Proto::Tcp, &["pod-b"])]);
    node.agent.wait_for_programmed(1, 1, SYNC)?;
    // Three endpoints, one backend slot left.
    node.publish(&[node.service("big", KEPT_IP, Proto::Tcp, &["pod-a", "pod-b", "pod-c"])]);
    let ns = &node.topology.node;
    let metrics: SocketAddr = (Ipv4Addr::LOCALHOST, 10249).into();
    let failures = || -> Result<u64> {
        let (_, text) = ns.http_get(metrics, "/metrics")?;
        text.lines()
            .find_map(|l| l.strip_prefix("lb_map_write_failures_total "))
            .context("lb_map_write_failures_total")?
            .parse()
            .context("lb_map_write_failures_total")
    };
    let deadline = Instant::now() + SYNC;
    while failures()? == 0 {
        ensure!(
            Instant::now() < deadline,
            "no failed write:\n{}",
            node.agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The health timeout is 2 s; the failed writes are retried every 5 s.
    answers_throughout(ns, "/livez", 200, Duration::from_secs(3))?;
    answers_throughout(ns, "/healthz", 200, Duration::from_millis(500))?;
    // The error names the flag that sizes the full map, once per sync with the writes it
    // refused, not once per entry.
    let log = node.agent.log();
    let full = log
        .lines()
        .filter(|l| l.contains("map full") && l.contains("raise --backends-max"))
        .count();
    let syncs = log.matches(SYNC_DONE).count();
    ensure!(
        full > 0
            && full <= syncs
            && !log
                .lines()
                .any(|l| l.contains("ERROR") && l.contains("map write failed")),
        "{full} map full lines in {syncs} syncs, or a line per entry:\n{log}"
    );

    let deadline = Instant::now() + SYNC;
    let event = loop {
        let events = node.api.events();
        if let Some(event) = events.iter().find(|e| e["regarding"]["name"] == "big") {
            break event.clone();
        }
        ensure!(
            Instant::now() < deadline,
            "no Event for the service; events: {events:?}\n{}",
            node.agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    ensure!(
        event["type"] == "Warning"
            && event["reason"] == "MapWriteFailed"
            && event["regarding"]["kind"] == "Service"
            && event["regarding"]["namespace"] == "default"
            && event["regarding"]["uid"].is_string()
            && event["metadata"]["namespace"] == "default"
            && event["reportingInstance"] == NODE_NAME
            && event["note"]
                .as_str()
                .is_some_and(|n| n.contains(NODE_NAME) && n.contains("raise --backends-max")),
        "{event:#}"
    );
    let events = node.api.events();
    ensure!(
        events.iter().all(|e| e["regarding"]["name"] == "big"),
        "an Event for a service whose writes succeeded: {events:?}"
    );
    let pod_a = &node.topology.pod("pod-a").ns;
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(WEB_IP), 10)?, &["pod-b"])
}

/// One invalid externalIP among three good ones (an object older than the apiserver's
/// validation): the good three stay served, and the Service gets an Event naming the field.
#[test]
fn an_invalid_external_ip_leaves_the_others_served() -> Result<()> {
    let ips: Vec<Ipv4Addr> = (1..=3).map(|i| Ipv4Addr::new(203, 0, 113, i)).collect();
    let mut node = ApiNode::start(3)?;
    let (svc, slice) = objects(
        &node
            .service("web", WEB_IP, Proto::Tcp, &["pod-b"])
            .external_ips(ips.iter().copied()),
    );
    let mut svc = serde_json::to_value(&svc)?;
    svc["spec"]["externalIPs"]
        .as_array_mut()
        .context("externalIPs")?
        .insert(1, "203.0.113.x".into());
    node.api.apply_values(vec![svc]);
    node.api.apply(&[slice]);
    node.agent.wait_for_programmed(1, 1, SYNC)?;

    let client = &node.topology.client;
    client.ip(&[
        "route",
        "replace",
        "203.0.113.0/24",
        "via",
        &NODE_IP.to_string(),
    ])?;
    for ip in &ips {
        let answers = requests(client, Proto::Tcp, (*ip, PORT).into(), 5)
            .with_context(|| format!("externalIP {ip}"))?;
        assert_answered_by(&answers, &["pod-b"])?;
    }
    let deadline = Instant::now() + SYNC;
    loop {
        let events = node.api.events();
        let skipped = events
            .iter()
            .find(|e| e["reason"] == "InvalidFieldsSkipped");
        if let Some(event) = skipped {
            ensure!(
                event["regarding"]["name"] == "web"
                    && event["note"]
                        .as_str()
                        .unwrap_or_default()
                        .contains("spec.externalIPs[1]"),
                "{event:#}"
            );
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "no Event for the skipped field; events: {events:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// allocateLoadBalancerNodePorts: false gives a LoadBalancer Service no NodePort: the apiserver
/// allocates them, the agent never invents one (here it would take the range's only port).
#[test]
fn no_node_port_without_allocation() -> Result<()> {
    const ONLY_PORT: u16 = 30500;
    let args = [
        "--min-sync-period",
        "200ms",
        "--nodeport-range",
        "30500-30500",
    ];
    let mut node = ApiNode::start_with(3, &args, true, |_| {})?;
    let (mut svc, slice) = objects(&node.service("web", WEB_IP, Proto::Tcp, &["pod-b"]));
    let spec = svc.spec.as_mut().context("spec")?;
    spec.type_ = Some("LoadBalancer".into());
    spec.allocate_load_balancer_node_ports = Some(false);
    node.api.apply(&[svc]);
    node.api.apply(&[slice]);
    node.agent.wait_for_programmed(1, 1, SYNC)?;
    let pod_a = &node.topology.pod("pod-a").ns;
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(WEB_IP), 5)?, &["pod-b"])?;
    ensure!(
        request(
            &node.topology.client,
            Proto::Tcp,
            (NODE_IP, ONLY_PORT).into()
        )
        .is_err(),
        "a NodePort the agent invented answers"
    );
    Ok(())
}

/// The --sync-period audit: a frontend deleted behind the agent's back (a stray `bpftool map
/// delete`, a lost write) is written again within the period, though nothing changed in the
/// cluster, and the repair is logged and counted.
#[test]
fn a_frontend_deleted_behind_the_agents_back_is_restored_within_the_sync_period() -> Result<()> {
    const SYNC_PERIOD: Duration = Duration::from_secs(2);
    let args = ["--min-sync-period", "200ms", "--sync-period", "2s"];
    let mut node = ApiNode::start_with(3, &args, true, |_| {})?;
    node.publish(&[node.service("web", WEB_IP, Proto::Tcp, &["pod-b"])]);
    node.agent.wait_for_programmed(1, 1, SYNC)?;
    let pod_a = &node.topology.pod("pod-a").ns;
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(WEB_IP), 3)?, &["pod-b"])?;

    // The agent's bpffs, seen through its own mount namespace.
    let pin = format!(
        "/proc/{}/root/sys/fs/bpf/lb/{}",
        node.agent.pid(),
        map_name::FRONTENDS
    );
    let map = MapData::from_pin(&pin).with_context(|| pin.clone())?;
    let mut frontends: HashMap<_, FrontendKey, Frontend> = HashMap::try_from(Map::HashMap(map))?;
    let key = FrontendKey {
        addr: ipv4_be(WEB_IP.octets()),
        port: port_be(PORT),
        proto: IPPROTO_TCP,
        _pad: 0,
    };
    let written = frontends.get(&key, 0).context("the web frontend")?;
    frontends.remove(&key)?;
    let deleted = Instant::now();
    let deadline = deleted + SYNC_PERIOD + SYNC;
    let restored = loop {
        if let Ok(frontend) = frontends.get(&key, 0) {
            break frontend;
        }
        ensure!(
            Instant::now() < deadline,
            "the frontend is still missing {:?} after its deletion",
            deleted.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    ensure!(
        restored == written,
        "restored {restored:?}, written {written:?}"
    );
    ensure!(
        deleted.elapsed() <= SYNC_PERIOD + Duration::from_secs(1),
        "restored after {:?}",
        deleted.elapsed()
    );
    node.agent
        .wait_for_log("audit: service map entries differ", SYNC)?;
    let (_, metrics) = node
        .topology
        .node
        .http_get((Ipv4Addr::LOCALHOST, 10249).into(), "/metrics")?;
    ensure!(
        metrics.contains("lb_sync_audit_repairs_total 1"),
        "{metrics}"
    );
    assert_answered_by(&requests(pod_a, Proto::Tcp, addr(WEB_IP), 3)?, &["pod-b"])
}

/// `--config` with kube-proxy's KubeProxyConfiguration: the fields that apply set their flags
/// (the metrics and health servers move), a flag on the command line wins over the file (the
/// node name: the file's would find no Node and never sync), and a field that does not apply
/// is named in a warning.
#[test]
fn a_kube_proxy_configuration_file_sets_the_flags() -> Result<()> {
    let metrics: SocketAddr = (Ipv4Addr::LOCALHOST, 10351).into();
    let health: SocketAddr = (Ipv4Addr::LOCALHOST, 10356).into();
    let dir = tempfile::Builder::new().prefix("lbt-config").tempdir()?;
    let config = dir.path().join("kube-proxy.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
hostnameOverride: not-this-node
metricsBindAddress: {metrics}
healthzBindAddress: {health}
minSyncPeriod: 200ms
mode: ipvs
"
        ),
    )?;
    let config = config.to_str().context("temp path")?;
    let mut node = ApiNode::start_with(2, &["--config", config], true, |_| {})?;
    node.publish(&[node.service("web", WEB_IP, Proto::Tcp, &["pod-b"])]);
    node.agent.wait_for_programmed(1, 1, SYNC)?;
    let answer = request(&node.topology.pod("pod-a").ns, Proto::Tcp, addr(WEB_IP))?;
    assert_answered_by(&[answer], &["pod-b"])?;

    let ns = &node.topology.node;
    let (status, mode) = ns.http_get(metrics, "/proxyMode")?;
    ensure!((status, mode.as_str()) == (200, "ebpf"), "{status} {mode}");
    ensure!(ns.http_get(health, "/healthz")?.0 == 200);
    ensure!(
        ns.http_get((Ipv4Addr::LOCALHOST, 10249).into(), "/metrics")
            .is_err(),
        "metrics still on the default port"
    );
    let log = node.agent.log();
    ensure!(
        log.contains("--config: mode: ipvs: lb is its own proxy mode: ignored"),
        "no warning for the mode:\n{log}"
    );
    Ok(())
}
