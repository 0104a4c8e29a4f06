//! Dual-stack configuration (issue 22, steps 1 and 2): the agent takes one `--node-ip` and one
//! `--cluster-cidr` per family and a Service of both families, serves its IPv4 side as an
//! IPv4-only Service is served, and writes its IPv6 side into the IPv6 maps (which `lb services`
//! lists); the IPv6 datapath serves a pod's connection to an IPv6 ClusterIP (seed path 1 over
//! IPv6, TCP and UDP), hairpin and an external client's to a NodePort on the node's IPv6 address
//! (masqueraded), and the socket hooks a node process's IPv6 socket to an IPv6 ClusterIP or an
//! IPv4-mapped IPv4 one; the rest of IPv6 is still pending.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    agent::{SYNC_DONE, lb_binary},
    bpffs::Bpffs,
    cgroup::Cgroup,
    echo::{Answer, EchoServer, Proto, ask, requests, six_answered, udp_socket},
    manifests::{self, EndpointManifest, ServiceManifest},
    netns::Netns,
    node::{CLUSTER_IP, Node, PORT, TARGET_PORT, vip},
    paths::{check_external_to_node_port, check_pod_to_service},
    topology::{
        CLIENT_IP_V6, CLUSTER_CIDR_V6, NODE_IP, NODE_IP_V6, POD_GATEWAY, POD_GATEWAY_V6, pod_ip_v6,
    },
};

const NODE_PORT: u16 = 30080;
const CLUSTER_IP_V6: &str = "2001:db8:96::10";
const CLUSTER_IP_V6_ONLY: &str = "2001:db8:96::11";
/// Logged once a sync changes how many IPv6 frontends the model holds.
const IPV6_PENDING: &str = "IPv6 frontends: TCP and UDP served, masquerade, affinity, schedulers, source ranges, REJECT, ICMPv6 errors and fragments included (IPv6 datapath partial)";

/// `service` (an IPv4 Service and its IPv4 slice) made dual-stack: ipFamilies [IPv4, IPv6], a
/// ClusterIP per family, an IPv6 slice and an FQDN slice (ignored) beside the IPv4 one.
fn dual_stack(service: &str, proto: Proto) -> Result<String> {
    let cluster_ip = format!("  clusterIP: {CLUSTER_IP}\n");
    ensure!(service.contains(&cluster_ip), "{service}");
    let both = format!(
        "{cluster_ip}  clusterIPs: [\"{CLUSTER_IP}\", \"{CLUSTER_IP_V6}\"]\n  \
         ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n"
    );
    let proto = proto.manifest_name();
    let slice = |suffix: &str, address_type: &str, addresses: &[&str]| {
        let endpoints = manifests::endpoint_lines(addresses);
        format!(
            "---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-{suffix}
  namespace: default
  labels:
    kubernetes.io/service-name: web
addressType: {address_type}
ports:
  - name: app
    protocol: {proto}
    port: 8080
endpoints:
{endpoints}"
        )
    };
    Ok(format!(
        "{}{}{}",
        service.replacen(&cluster_ip, &both, 1),
        slice("v6", "IPv6", &["2001:db8:244::b", "2001:db8:244::c"]),
        slice("fqdn", "FQDN", &["web.example.com"]),
    ))
}

/// An IPv6-only Service `web6` with a stale IPv4 slice of `pods`, which it ignores.
fn ipv6_only_with_ipv4_slice(proto: Proto, pods: &[Ipv4Addr]) -> String {
    let addresses: Vec<String> = pods.iter().map(ToString::to_string).collect();
    ipv6_only_service(proto, ("web6-stale", "IPv4", TARGET_PORT), &addresses)
}

/// An IPv6-only Service `web6` on CLUSTER_IP_V6_ONLY:PORT and its EndpointSlice `slice`
/// (name, addressType, port) of `addresses`.
fn ipv6_only_service(proto: Proto, slice: (&str, &str, u16), addresses: &[String]) -> String {
    let cluster_ip = CLUSTER_IP_V6_ONLY.parse().expect("an IPv6 address");
    manifests::ipv6_only_service("web6", (cluster_ip, PORT), proto, slice, addresses)
}

/// A node of three pods whose agent has both families' `--node-ip` and `--cluster-cidr`, and
/// `extra` flags.
fn dual_stack_node(extra: &[&str]) -> Result<Node> {
    Node::start_dual_stack(3, extra)
}

/// Both families given to the agent, the Service dual-stack: its IPv4 ClusterIP and NodePort
/// answer as on an IPv4-only node (who answered, the source the backend saw, the peer the client
/// saw). An IPv6-only Service beside it gets no IPv4 side from its stale IPv4 slice. The log
/// counts the IPv6 frontends (the dual-stack Service's ClusterIP and its NodePort on the IPv6
/// node IP, the IPv6-only Service's ClusterIP) as not served.
fn dual_stack_service_serves_ipv4(proto: Proto) -> Result<()> {
    let mut node = dual_stack_node(&["--nodeport-addresses", "198.51.100.0/24,2001:db8:100::/64"])?;
    let service = node
        .service(proto, &["pod-b", "pod-c"])
        .node_port(NODE_PORT)
        .yaml();
    let stale = [node.ip("pod-a")];
    node.agent.update_manifests(&format!(
        "{}{}",
        dual_stack(&service, proto)?,
        ipv6_only_with_ipv4_slice(proto, &stale)
    ))?;
    check_pod_to_service(&node.topology, proto, vip())?;
    check_external_to_node_port(&node.topology, proto, vip(), NODE_PORT)?;
    node.agent
        .wait_for_log(IPV6_PENDING, Duration::from_secs(5))?;
    let log = node.agent.log();
    let pending = last_line(&log, IPV6_PENDING);
    ensure!(
        pending.contains("services=2 ") && pending.contains("frontends=3"),
        "{pending}"
    );
    let synced = last_line(&log, SYNC_DONE);
    ensure!(
        synced.contains(" services=1 "),
        "one Service with an IPv4 side: {synced}"
    );
    Ok(())
}

#[test]
fn dual_stack_service_serves_ipv4_tcp() -> Result<()> {
    dual_stack_service_serves_ipv4(Proto::Tcp)
}

#[test]
fn dual_stack_service_serves_ipv4_udp() -> Result<()> {
    dual_stack_service_serves_ipv4(Proto::Udp)
}

/// An IPv6-only node (only IPv6 values given) starts, attaches and syncs an IPv6-only Service
/// (with a stale IPv4 slice): nothing to serve on IPv4, its ClusterIP counted as pending.
#[test]
fn ipv6_only_node_starts_and_counts_its_ipv6_frontends() -> Result<()> {
    let mut node = Node::start(
        1,
        &[],
        &[
            "--node-ip",
            &NODE_IP_V6.to_string(),
            "--cluster-cidr",
            CLUSTER_CIDR_V6,
        ],
    )?;
    let stale = [node.ip("pod-a")];
    node.agent
        .update_manifests(&ipv6_only_with_ipv4_slice(Proto::Tcp, &stale))?;
    node.agent
        .wait_for_log(IPV6_PENDING, Duration::from_secs(5))?;
    let log = node.agent.log();
    let pending = last_line(&log, IPV6_PENDING);
    ensure!(
        pending.contains("services=1 ") && pending.contains("frontends=1"),
        "{pending}"
    );
    let synced = last_line(&log, SYNC_DONE);
    ensure!(synced.contains(" services=0 "), "no IPv4 side: {synced}");
    Ok(())
}

/// A TCP frontend as `lb services -o json` lists it.
#[derive(Clone, Debug)]
struct Listed {
    frontend: String,
    kind: String,
    service_id: u64,
    /// Their addresses.
    backends: Vec<String>,
}

/// `lb services --bpffs BPFFS -o json` in `node`: its TCP frontends.
fn services(node: &Netns, bpffs: &str) -> Result<Vec<Listed>> {
    let output = node.exec(
        &lb_binary().to_string_lossy(),
        &["services", "--bpffs", bpffs, "-o", "json"],
    )?;
    let rows: serde_json::Value = serde_json::from_slice(&output.stdout)
        .with_context(|| String::from_utf8_lossy(&output.stdout).into_owned())?;
    rows.as_array()
        .context("a list")?
        .iter()
        .filter(|row| row["protocol"] == "tcp")
        .map(|row| {
            let text = |v: &serde_json::Value| v.as_str().map(str::to_owned).context("a string");
            let backends = row["backends"]
                .as_array()
                .context("backends")?
                .iter()
                .map(|b| text(&b["address"]))
                .collect::<Result<_>>()?;
            Ok(Listed {
                frontend: text(&row["frontend"])?,
                kind: text(&row["kind"])?,
                service_id: row["service_id"].as_u64().context("service_id")?,
                backends,
            })
        })
        .collect()
}

/// The dual-stack Service's IPv6 ClusterIP and its NodePort on the IPv6 node IP are in the
/// IPv6 maps, as `lb services` lists them: with its IPv6 endpoints and the service id of its
/// IPv4 side (one id space); the IPv6-only Service's ClusterIP without endpoints (its stale IPv4
/// slice ignored). Once the Service is IPv4-only, they are gone and its IPv4 side stays.
#[test]
fn dual_stack_service_ipv6_side_is_in_the_ipv6_maps() -> Result<()> {
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let mut node = dual_stack_node(&["--bpffs", &bpffs_arg])?;
    let service = node
        .service(Proto::Tcp, &["pod-b", "pod-c"])
        .node_port(NODE_PORT)
        .yaml();
    let stale = [node.ip("pod-a")];
    node.agent.update_manifests(&format!(
        "{}{}",
        dual_stack(&service, Proto::Tcp)?,
        ipv6_only_with_ipv4_slice(Proto::Tcp, &stale)
    ))?;
    let listed = services(&node.topology.node, &bpffs_arg)?;
    let row = |frontend: &str| {
        listed
            .iter()
            .find(|l| l.frontend == frontend)
            .with_context(|| format!("{frontend} not in {listed:?}"))
    };
    let v4_id = row(&format!("{CLUSTER_IP}:{PORT}"))?.service_id;
    let v6_endpoints = [
        format!("[2001:db8:244::b]:{TARGET_PORT}"),
        format!("[2001:db8:244::c]:{TARGET_PORT}"),
    ];
    for (frontend, kind) in [
        (format!("[{CLUSTER_IP_V6}]:{PORT}"), "ClusterIP"),
        (format!("[{NODE_IP_V6}]:{NODE_PORT}"), "NodePort"),
    ] {
        let mut row = row(&frontend)?.clone();
        row.backends.sort();
        ensure!(
            row.kind == kind && row.service_id == v4_id && row.backends == v6_endpoints,
            "{frontend}: {listed:?}"
        );
    }
    let v6_only = row(&format!("[{CLUSTER_IP_V6_ONLY}]:80"))?;
    ensure!(
        v6_only.service_id != v4_id && v6_only.backends.is_empty(),
        "{listed:?}"
    );

    // IPv4-only again: its IPv6 frontends (and the IPv6-only Service) are gone.
    node.agent.update_manifests(&service)?;
    let listed = services(&node.topology.node, &bpffs_arg)?;
    ensure!(
        listed.iter().all(|l| !l.frontend.starts_with('[')),
        "IPv6 frontends left: {listed:?}"
    );
    ensure!(
        listed
            .iter()
            .any(|l| l.frontend == format!("{CLUSTER_IP}:{PORT}") && l.service_id == v4_id),
        "{listed:?}"
    );
    Ok(())
}

/// The last line of `log` that contains `needle` (empty if none).
fn last_line<'a>(log: &'a str, needle: &str) -> &'a str {
    log.lines()
        .rfind(|line| line.contains(needle))
        .unwrap_or_default()
}

/// The IPv6 servers' port: the fixture's IPv4 servers hold TARGET_PORT on 0.0.0.0, which a
/// server on [::] of the same port would clash with.
const TARGET_PORT_V6: u16 = 8092;

/// An IPv6-only Service `web6` with an IPv6 slice of `endpoints` on TARGET_PORT_V6.
fn ipv6_only(proto: Proto, endpoints: &[Ipv6Addr]) -> String {
    let addresses: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
    ipv6_only_service(proto, ("web6-v6", "IPv6", TARGET_PORT_V6), &addresses)
}

/// Seed path 1 over IPv6: pod-a → an IPv6 ClusterIP → pod-b or pod-c. The backend sees pod-a's
/// own address (no masquerade inside the cluster CIDR), the client sees the ClusterIP answer.
fn pod_to_ipv6_cluster_ip(proto: Proto) -> Result<()> {
    let mut node = dual_stack_node(&[])?;
    node.add_pod_ipv6()?;
    let _servers = serve_ipv6(&node, &["pod-b", "pod-c"])?;
    node.agent
        .update_manifests(&ipv6_only(proto, &[pod_ip_v6(1), pod_ip_v6(2)]))?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    six_answered(
        node.pod_ns("pod-a"),
        proto,
        service,
        &["pod-b", "pod-c"],
        IpAddr::V6(pod_ip_v6(0)),
    )?;
    Ok(())
}

#[test]
fn pod_to_ipv6_cluster_ip_tcp() -> Result<()> {
    pod_to_ipv6_cluster_ip(Proto::Tcp)
}

#[test]
fn pod_to_ipv6_cluster_ip_udp() -> Result<()> {
    pod_to_ipv6_cluster_ip(Proto::Udp)
}

/// A dual-stack node (`dual_stack_node`) whose pods have IPv6 addresses and whose socket hooks
/// are on `cgroup`.
fn dual_stack_node_with_hooks(cgroup: &Cgroup) -> Result<Node> {
    let path = cgroup.agent_path();
    let mut node = dual_stack_node(&["--cgroup", path.to_str().context("cgroup path")?])?;
    node.add_pod_ipv6()?;
    Ok(node)
}

/// What `lb-node-client` printed for one `proto` request to `to`, run in the node namespace and
/// `cgroup`: `<server> <source it saw> <peer>`, or `error <kind> <milliseconds>`.
fn node_client(cgroup: &Cgroup, node: &Node, proto: Proto, to: SocketAddr) -> Result<String> {
    let proto = proto.rule_name();
    let program = env!("CARGO_BIN_EXE_lb-node-client");
    cgroup.output(&node.topology.node, program, &[proto, &to.to_string()])
}

/// The answer `lb-node-client` printed for one `proto` request to `to`.
fn node_answer(cgroup: &Cgroup, node: &Node, proto: Proto, to: SocketAddr) -> Result<Answer> {
    let text = node_client(cgroup, node, proto, to)?;
    answer_of(&text).with_context(|| format!("{proto:?} to {to}"))
}

/// The answer of one line `lb-node-client` printed: `<server> <source it saw> <peer>`.
fn answer_of(line: &str) -> Result<Answer> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let [server, seen, peer] = fields[..] else {
        anyhow::bail!("{line:?}");
    };
    ensure!(server != "error", "{line:?}");
    Ok(Answer {
        server: server.to_string(),
        seen_source: seen.parse().with_context(|| format!("{line:?}"))?,
        peer: peer.parse().with_context(|| format!("{line:?}"))?,
    })
}

/// A process of the node (no pod) with an IPv6 socket reaches an IPv6 ClusterIP through the
/// connect6/sendmsg6 hooks: pod-b or pod-c answers, seeing the node's address on its link (the
/// source routing gives, as for IPv4), and the client's peer (getpeername, recvfrom's source
/// through recvmsg6) is the ClusterIP.
fn node_to_ipv6_cluster_ip(proto: Proto) -> Result<()> {
    let cgroup = Cgroup::new()?;
    let mut node = dual_stack_node_with_hooks(&cgroup)?;
    let _servers = serve_ipv6(&node, &["pod-b", "pod-c"])?;
    node.agent
        .update_manifests(&ipv6_only(proto, &[pod_ip_v6(1), pod_ip_v6(2)]))?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    for _ in 0..4 {
        let answer = node_answer(&cgroup, &node, proto, service)?;
        answer.check(&["pod-b", "pod-c"], IpAddr::V6(POD_GATEWAY_V6), service)?;
    }
    Ok(())
}

#[test]
fn node_to_ipv6_cluster_ip_tcp() -> Result<()> {
    node_to_ipv6_cluster_ip(Proto::Tcp)
}

#[test]
fn node_to_ipv6_cluster_ip_udp() -> Result<()> {
    node_to_ipv6_cluster_ip(Proto::Udp)
}

/// An IPv6 socket of the node to an IPv4 ClusterIP as an IPv4-mapped address
/// (`::ffff:10.96.0.10`, Java's default): an IPv4 backend answers over IPv4, seeing the node's
/// IPv4 address on its link, and the client's peer is the IPv4-mapped ClusterIP. TCP through
/// connect6 and getpeername6; unconnected UDP through sendmsg4 (the kernel sends an IPv4-mapped
/// datagram as IPv4) and recvmsg6.
fn node_to_ipv4_mapped_cluster_ip(proto: Proto) -> Result<()> {
    let cgroup = Cgroup::new()?;
    let mut node = dual_stack_node_with_hooks(&cgroup)?;
    let service = node.service(proto, &["pod-b", "pod-c"]).yaml();
    node.agent.update_manifests(&service)?;
    let mapped: SocketAddr = (CLUSTER_IP.to_ipv6_mapped(), PORT).into();
    for _ in 0..4 {
        let answer = node_answer(&cgroup, &node, proto, mapped)?;
        answer.check(&["pod-b", "pod-c"], IpAddr::V4(POD_GATEWAY), mapped)?;
    }
    Ok(())
}

#[test]
fn node_to_ipv4_mapped_cluster_ip_tcp() -> Result<()> {
    node_to_ipv4_mapped_cluster_ip(Proto::Tcp)
}

#[test]
fn node_to_ipv4_mapped_cluster_ip_udp() -> Result<()> {
    node_to_ipv4_mapped_cluster_ip(Proto::Udp)
}

/// An IPv6 ClusterIP without endpoints refuses a node socket at once (ECONNREFUSED from connect
/// or sendto), as the IPv4 hooks and kube-proxy's REJECT do.
#[test]
fn node_ipv6_service_without_endpoints_is_refused_fast() -> Result<()> {
    let cgroup = Cgroup::new()?;
    let mut node = dual_stack_node_with_hooks(&cgroup)?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    for proto in [Proto::Tcp, Proto::Udp] {
        node.agent.update_manifests(&ipv6_only(proto, &[]))?;
        let text = node_client(&cgroup, &node, proto, service)?;
        let fields: Vec<&str> = text.split_whitespace().collect();
        let fast = |millis: &str| millis.parse::<u64>().is_ok_and(|ms| ms < 500);
        ensure!(
            matches!(fields[..], ["error", "Some(ConnectionRefused)", millis] if fast(millis)),
            "{proto:?}: {text:?}, expected a fast ECONNREFUSED"
        );
    }
    Ok(())
}

/// An unconnected IPv6 UDP socket of the node, which passes through sendmsg6 on every datagram:
/// its 20 requests to an IPv6 service with three endpoints all reach one backend (as IPv4's,
/// `LB_SOCK_BACKEND6_V1`), every answer from the service address; new sockets pick again: 12 of
/// them reach more than one backend.
#[test]
fn node_ipv6_udp_flow_sticks_to_one_backend() -> Result<()> {
    let cgroup = Cgroup::new()?;
    let mut node = dual_stack_node_with_hooks(&cgroup)?;
    let pods = ["pod-a", "pod-b", "pod-c"];
    let _servers = serve_ipv6(&node, &pods)?;
    let endpoints = [pod_ip_v6(0), pod_ip_v6(1), pod_ip_v6(2)];
    node.agent
        .update_manifests(&ipv6_only(Proto::Udp, &endpoints))?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    let program = env!("CARGO_BIN_EXE_lb-node-client");
    let args = ["udp-flow", &service.to_string(), "20"];
    let text = cgroup.output(&node.topology.node, program, &args)?;
    let flow = text.lines().map(answer_of).collect::<Result<Vec<_>>>()?;
    ensure!(
        flow.len() == 20
            && flow
                .iter()
                .all(|a| a.server == flow[0].server && a.peer == service),
        "one flow, one backend, answers from {service}: {flow:?}"
    );
    let mut servers = std::collections::BTreeSet::new();
    for _ in 0..12 {
        servers.insert(node_answer(&cgroup, &node, Proto::Udp, service)?.server);
    }
    ensure!(servers.len() > 1, "new sockets all went to {servers:?}");
    Ok(())
}

/// externalTrafficPolicy Local over IPv6: the external client reaches only this node's endpoint
/// through the NodePort on the node's IPv6 address, its own address kept; pods use every
/// endpoint.
#[test]
fn ipv6_external_traffic_policy_local() -> Result<()> {
    let mut node = dual_stack_node(&["--hostname-override", "node-1"])?;
    node.add_pod_ipv6()?;
    node.topology.add_external_ipv6()?;
    let _servers = serve_ipv6(&node, &["pod-b", "pod-c"])?;
    let on = |pod: &str, node_name: &str| EndpointManifest::ready(node.ip(pod)).on_node(node_name);
    let service = ServiceManifest::new("web", CLUSTER_IP, Proto::Tcp, PORT, TARGET_PORT_V6)
        .node_port(NODE_PORT_V6)
        .external_local(31000)
        .endpoint(on("pod-b", "node-1"))
        .endpoint(on("pod-c", "node-2"));
    let yaml = service.yaml_ipv6(CLUSTER_IP_V6_ONLY.parse()?, |ip| node.ipv6_of(ip));
    node.agent.update_manifests(&yaml)?;
    let node_port: SocketAddr = (NODE_IP_V6, NODE_PORT_V6).into();
    let client = IpAddr::V6(CLIENT_IP_V6);
    for answer in requests(&node.topology.client, Proto::Tcp, node_port, 20)? {
        answer.check(&["pod-b"], client, node_port)?;
    }
    let from_pod = requests(node.pod_ns("pod-a"), Proto::Tcp, node_port, 30)?;
    let servers: std::collections::BTreeSet<_> = from_pod.iter().map(|a| &a.server).collect();
    ensure!(servers.len() == 2, "pods use every endpoint: {servers:?}");
    Ok(())
}

/// sessionAffinity and the `sh` scheduler hold for the node's own IPv6 sockets (connect6), as
/// for IPv4's: keyed by the node's IPv6 address, its 12 connections to an IPv6 Service with
/// three endpoints all reach one of them, under either.
#[test]
fn node_ipv6_sockets_honour_affinity_and_source_hash() -> Result<()> {
    let cgroup = Cgroup::new()?;
    let mut node = dual_stack_node_with_hooks(&cgroup)?;
    let pods = ["pod-a", "pod-b", "pod-c"];
    let _servers = serve_ipv6(&node, &pods)?;
    let cluster_ip: Ipv6Addr = CLUSTER_IP_V6_ONLY.parse()?;
    let service: SocketAddr = (cluster_ip, PORT).into();
    let web = ServiceManifest {
        target_port: TARGET_PORT_V6,
        ..node.service(Proto::Tcp, &pods)
    };
    let sticky = [
        ("affinity", web.clone().session_affinity(10800)),
        ("sh", web.annotation("lb.kubernetes.io/scheduler", "sh")),
    ];
    for (name, manifest) in sticky {
        let yaml = manifest.yaml_ipv6(cluster_ip, |ip| node.ipv6_of(ip));
        node.agent.update_manifests(&yaml)?;
        let mut servers = std::collections::BTreeSet::new();
        for _ in 0..12 {
            let answer = node_answer(&cgroup, &node, Proto::Tcp, service)?;
            answer.check(&pods, IpAddr::V6(POD_GATEWAY_V6), service)?;
            servers.insert(answer.server);
        }
        // Random choices: all 12 on one of 3 endpoints has p = 3^-11.
        ensure!(servers.len() == 1, "{name}: {servers:?}");
    }
    Ok(())
}

/// `lb ARGS --bpffs BPFFS -o json` in `node`: whether it exited 0, and its JSON.
fn lb_json(node: &Netns, args: &[&str], bpffs: &str) -> Result<(bool, serde_json::Value)> {
    let mut all = args.to_vec();
    all.extend(["--bpffs", bpffs, "-o", "json"]);
    let output = node.exec(&lb_binary().to_string_lossy(), &all)?;
    let json = serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "lb {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })?;
    Ok((output.status.success(), json))
}

/// "Operators must see inside" over IPv6: after 6 connections from pod-a to an IPv6-only
/// Service, `lb services` counts them on its IPv6 endpoints (each with a counter slot of its
/// own), and `lb status` has a record of the Service that counts its IPv6 entries (its
/// ClusterIP and catch-all, its 2 backend slots, 1 origin) and says it is in sync.
#[test]
fn ipv6_endpoints_traffic_is_counted_and_their_service_in_sync() -> Result<()> {
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let mut node = dual_stack_node(&["--bpffs", &bpffs_arg])?;
    node.add_pod_ipv6()?;
    let _servers = serve_ipv6(&node, &["pod-b", "pod-c"])?;
    node.agent
        .update_manifests(&ipv6_only(Proto::Tcp, &[pod_ip_v6(1), pod_ip_v6(2)]))?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    let answers = requests(node.pod_ns("pod-a"), Proto::Tcp, service, 6)?;
    ensure!(answers.len() == 6, "{answers:?}");

    let ns = &node.topology.node;
    let (_, rows) = lb_json(ns, &["services"], &bpffs_arg)?;
    let frontend = format!("[{CLUSTER_IP_V6_ONLY}]:{PORT}");
    let row = rows
        .as_array()
        .context("a list")?
        .iter()
        .find(|r| r["frontend"] == frontend.as_str() && r["protocol"] == "tcp")
        .with_context(|| format!("{frontend} in {rows}"))?;
    let backends = row["backends"].as_array().context("backends")?;
    let connections: u64 = backends
        .iter()
        .map(|b| b["connections"].as_u64().unwrap_or_default())
        .sum();
    ensure!(
        backends.len() == 2 && backends.iter().all(|b| b["counted"] == true) && connections == 6,
        "6 connections counted on the IPv6 endpoints: {row}"
    );

    let (in_sync, status) = lb_json(ns, &["status"], &bpffs_arg)?;
    let web6 = status["services"]
        .as_array()
        .context("services")?
        .iter()
        .find(|s| s["service"] == "default/web6")
        .with_context(|| format!("default/web6 in {status}"))?;
    let port = &web6["ports"][0];
    let counts = |side: &str| {
        let c = &port[side];
        [&c["frontends"], &c["backends"], &c["origins"]].map(|v| v.as_u64())
    };
    ensure!(
        in_sync
            && web6["state"] == "in sync"
            && counts("desired") == [Some(2), Some(2), Some(1)]
            && counts("actual") == counts("desired"),
        "{status}"
    );
    Ok(())
}

/// kube-proxy's UDP conntrack flush over IPv6: pod-b's endpoint is removed (pod-b keeps
/// running, so a stale entry would still get its answer); the next datagram from the same
/// socket to the IPv6 ClusterIP reaches pod-c.
#[test]
fn removed_ipv6_udp_endpoint_loses_its_conntrack() -> Result<()> {
    let mut node = dual_stack_node(&[])?;
    node.add_pod_ipv6()?;
    let _servers = serve_ipv6(&node, &["pod-b", "pod-c"])?;
    node.agent
        .update_manifests(&ipv6_only(Proto::Udp, &[pod_ip_v6(1)]))?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    let socket = udp_socket(node.pod_ns("pod-a"), "[::]:0")?;
    for _ in 0..3 {
        let server = ask(&socket, service).with_context(|| node.agent.log())?;
        ensure!(server == "pod-b", "answered by {server}");
    }
    node.agent
        .update_manifests(&ipv6_only(Proto::Udp, &[pod_ip_v6(2)]))?;
    for _ in 0..3 {
        let server = ask(&socket, service)
            .with_context(|| format!("after the update: {}", node.agent.log()))?;
        ensure!(server == "pod-c", "still answered by {server}");
    }
    let log = node.agent.log();
    ensure!(
        log.contains("UDP conntrack of removed endpoints flushed"),
        "{log}"
    );
    Ok(())
}

/// --nodeport-addresses of IPv6, as of IPv4: the dual-stack Service's NodePort is listed on
/// the node's IPv6 addresses in the flag's IPv6 CIDR (not on the IPv6 --node-ip outside it), as
/// they come and go (each change makes the agent sync once its netlink notification arrives).
#[test]
fn ipv6_node_ports_follow_nodeport_addresses() -> Result<()> {
    const SECOND_IP_V6: &str = "2001:db8:300::10";
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let flag = format!("{NODE_IP}/32,2001:db8:300::/64");
    let mut node = dual_stack_node(&["--bpffs", &bpffs_arg, "--nodeport-addresses", &flag])?;
    let service = node
        .service(Proto::Tcp, &["pod-b", "pod-c"])
        .node_port(NODE_PORT)
        .yaml();
    node.agent
        .update_manifests(&dual_stack(&service, Proto::Tcp)?)?;
    let node_ports = |node: &Node| -> Result<Vec<String>> {
        let mut listed: Vec<String> = services(&node.topology.node, &bpffs_arg)?
            .into_iter()
            .filter(|l| l.kind == "NodePort")
            .map(|l| l.frontend)
            .collect();
        listed.sort();
        Ok(listed)
    };
    let v4 = format!("{NODE_IP}:{NODE_PORT}");
    let listed = node_ports(&node)?;
    ensure!(listed == [v4.clone()], "{listed:?}");

    let address = format!("{SECOND_IP_V6}/128");
    let external = lb_tests::topology::EXTERNAL_INTERFACE;
    let interface_address = |op: &str| {
        node.topology
            .node
            .ip(&["-6", "addr", op, &address, "dev", external, "nodad"])
    };
    interface_address("add")?;
    node.agent.wait_for_sync(Duration::from_secs(5))?;
    let listed = node_ports(&node)?;
    let v6 = format!("[{SECOND_IP_V6}]:{NODE_PORT}");
    ensure!(listed == [v4.clone(), v6], "{listed:?}");
    interface_address("del")?;
    node.agent.wait_for_sync(Duration::from_secs(5))?;
    let listed = node_ports(&node)?;
    ensure!(listed == [v4], "{listed:?}");
    Ok(())
}

/// The hairpin path over IPv6: pod-a → an IPv6 ClusterIP whose only endpoint is pod-a. The
/// connection is masqueraded (else pod-a would answer itself directly): the backend sees the
/// node address routing picks towards it (the pods' gateway, as over IPv4), the client the
/// ClusterIP.
fn ipv6_hairpin(proto: Proto) -> Result<()> {
    let mut node = dual_stack_node(&[])?;
    node.add_pod_ipv6()?;
    let _server = EchoServer::start_v6(node.pod_ns("pod-a"), "pod-a", TARGET_PORT_V6)?;
    node.agent
        .update_manifests(&ipv6_only(proto, &[pod_ip_v6(0)]))?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    six_answered(
        node.pod_ns("pod-a"),
        proto,
        service,
        &["pod-a"],
        IpAddr::V6(POD_GATEWAY_V6),
    )?;
    Ok(())
}

#[test]
fn ipv6_hairpin_tcp() -> Result<()> {
    ipv6_hairpin(Proto::Tcp)
}

#[test]
fn ipv6_hairpin_udp() -> Result<()> {
    ipv6_hairpin(Proto::Udp)
}

const NODE_PORT_V6: u16 = 30081;

/// The IPv6-only Service `web6` of `ipv6_only`, of type NodePort on NODE_PORT_V6.
fn ipv6_node_port(proto: Proto, endpoints: &[Ipv6Addr]) -> Result<String> {
    manifests::ipv6_node_port(&ipv6_only(proto, endpoints), NODE_PORT_V6)
}

/// External client → NodePort on the node's IPv6 address → pod-b or pod-c, externalTrafficPolicy
/// Cluster: masqueraded, the backend sees the node address routing picks towards it (the pods'
/// gateway), the client sees node:NodePort answer.
fn external_to_ipv6_node_port(proto: Proto) -> Result<()> {
    let mut node = dual_stack_node(&[])?;
    node.add_pod_ipv6()?;
    node.topology.add_external_ipv6()?;
    let _servers = serve_ipv6(&node, &["pod-b", "pod-c"])?;
    node.agent
        .update_manifests(&ipv6_node_port(proto, &[pod_ip_v6(1), pod_ip_v6(2)])?)?;
    let node_port: SocketAddr = (NODE_IP_V6, NODE_PORT_V6).into();
    six_answered(
        &node.topology.client,
        proto,
        node_port,
        &["pod-b", "pod-c"],
        IpAddr::V6(POD_GATEWAY_V6),
    )?;
    Ok(())
}

#[test]
fn external_to_ipv6_node_port_tcp() -> Result<()> {
    external_to_ipv6_node_port(Proto::Tcp)
}

#[test]
fn external_to_ipv6_node_port_udp() -> Result<()> {
    external_to_ipv6_node_port(Proto::Udp)
}

/// `lb trace` over IPv6: the UDP flow pod-a has open to an IPv6 ClusterIP is traced to the
/// backend that answered it, a new flow from another port is a new connection choosing among
/// both endpoints, and tracing changes no connection (`lb conntrack`, whose filters select the
/// flow by its IPv6 service, backend and client).
#[test]
fn ipv6_trace_names_the_backend_and_changes_nothing() -> Result<()> {
    let bpffs = Bpffs::mount()?;
    let bpffs_arg = bpffs.arg();
    let mut node = dual_stack_node(&["--bpffs", &bpffs_arg])?;
    node.add_pod_ipv6()?;
    let _servers = serve_ipv6(&node, &["pod-b", "pod-c"])?;
    node.agent
        .update_manifests(&ipv6_only(Proto::Udp, &[pod_ip_v6(1), pod_ip_v6(2)]))?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    let client: SocketAddr = (pod_ip_v6(0), 40_100).into();
    let socket = udp_socket(node.pod_ns("pod-a"), &client.to_string())?;
    let server = ask(&socket, service)?;
    let backend_ip = if server == "pod-b" {
        pod_ip_v6(1)
    } else {
        pod_ip_v6(2)
    };
    let backend = SocketAddr::from((backend_ip, TARGET_PORT_V6)).to_string();
    let candidates: Vec<String> = [pod_ip_v6(1), pod_ip_v6(2)]
        .iter()
        .map(|&ip| SocketAddr::from((ip, TARGET_PORT_V6)).to_string())
        .collect();

    let ns = &node.topology.node;
    let (_, before) = lb_json(ns, &["conntrack"], &bpffs_arg)?;
    let interface = node.topology.pod("pod-a").host_interface.clone();
    let trace = |from: SocketAddr| -> Result<serde_json::Value> {
        let (from, to) = (from.to_string(), service.to_string());
        let args = [
            "trace",
            "--proto",
            "udp",
            "--from",
            &from,
            "--to",
            &to,
            "--in-interface",
            &interface,
        ];
        Ok(lb_json(ns, &args, &bpffs_arg)?.1)
    };
    let open = trace(client)?;
    ensure!(
        open["verdict"] == "forwarded"
            && open["conntrack"] == "existing"
            && open["frontend"] == service.to_string()
            && open["backend"] == backend.as_str()
            && open["translation"]["dnat"] == backend.as_str()
            && open["translation"]["masquerade"].is_null(),
        "the open flow, answered by {server}: {open:#}"
    );
    let new = trace((pod_ip_v6(0), 40_101).into())?;
    let listed: Vec<String> = new["candidates"]
        .as_array()
        .context("candidates")?
        .iter()
        .filter_map(|c| c.as_str().map(str::to_owned))
        .collect();
    ensure!(
        new["verdict"] == "forwarded" && new["conntrack"] == "new" && listed == candidates,
        "a new flow: {new:#}"
    );
    let (_, after) = lb_json(ns, &["conntrack"], &bpffs_arg)?;
    let flows = |rows: &serde_json::Value| -> Result<Vec<String>> {
        Ok(rows
            .as_array()
            .context("a list")?
            .iter()
            .map(|row| format!("{} {} {}", row["client"], row["service"], row["backend"]))
            .collect())
    };
    ensure!(
        flows(&before)? == flows(&after)?,
        "tracing changed the connections: {before} then {after}"
    );
    // `lb conntrack`'s filters take IPv6 too: the open flow, by its service and its client.
    let client_ip = client.ip().to_string();
    let (service_arg, backend_arg) = (service.to_string(), backend.clone());
    let filters = [
        "conntrack",
        "--service",
        &service_arg,
        "--backend",
        &backend_arg,
        "--client",
        &client_ip,
    ];
    let (_, selected) = lb_json(ns, &filters, &bpffs_arg)?;
    ensure!(
        flows(&selected)? == [format!("\"{client}\" \"{service}\" \"{backend}\"")],
        "lb conntrack {filters:?}: {selected}"
    );
    Ok(())
}

/// A container on the docker bridge (outside the cluster CIDR) → an IPv6 ClusterIP: masqueraded,
/// as kube-proxy masquerades sources outside --cluster-cidr; the backend sees the node's address
/// towards the pods, the container the ClusterIP.
fn container_to_ipv6_cluster_ip(proto: Proto) -> Result<()> {
    let mut node = dual_stack_node(&[])?;
    node.add_pod_ipv6()?;
    node.topology.add_container_ipv6()?;
    let _servers = serve_ipv6(&node, &["pod-b", "pod-c"])?;
    node.agent
        .update_manifests(&ipv6_only(proto, &[pod_ip_v6(1), pod_ip_v6(2)]))?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    six_answered(
        &node.topology.container,
        proto,
        service,
        &["pod-b", "pod-c"],
        IpAddr::V6(POD_GATEWAY_V6),
    )?;
    Ok(())
}

#[test]
fn container_to_ipv6_cluster_ip_tcp() -> Result<()> {
    container_to_ipv6_cluster_ip(Proto::Tcp)
}

#[test]
fn container_to_ipv6_cluster_ip_udp() -> Result<()> {
    container_to_ipv6_cluster_ip(Proto::Udp)
}

/// IPv6 echo servers on TARGET_PORT_V6 in `pods` of `node`.
fn serve_ipv6(node: &Node, pods: &[&str]) -> Result<Vec<EchoServer>> {
    pods.iter()
        .map(|pod| EchoServer::start_v6(node.pod_ns(pod), pod, TARGET_PORT_V6))
        .collect()
}
