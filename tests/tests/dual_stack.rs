//! Dual-stack configuration (issue 22, steps 1 and 2): the agent takes one `--node-ip` and one
//! `--cluster-cidr` per family and a Service of both families, serves its IPv4 side as an
//! IPv4-only Service is served, and writes its IPv6 side into the IPv6 maps (which `lb services`
//! lists); the IPv6 datapath serves a pod's connection to an IPv6 ClusterIP (seed path 1 over
//! IPv6, TCP and UDP), hairpin and an external client's to a NodePort on the node's IPv6 address
//! (masqueraded), the rest of IPv6 is still pending.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    agent::{SYNC_DONE, lb_binary},
    bpffs::Bpffs,
    echo::{EchoServer, Proto, requests},
    netns::Netns,
    node::{CLUSTER_IP, Node, PORT, TARGET_PORT, vip},
    paths::{check_external_to_node_port, check_pod_to_service},
    topology::{CLUSTER_CIDR, EXTERNAL_INTERFACE, NODE_IP},
};

const NODE_PORT: u16 = 30080;
const NODE_IP_V6: &str = "2001:db8:100::10";
const CLUSTER_CIDR_V6: &str = "2001:db8:244::/56";
const CLUSTER_IP_V6: &str = "2001:db8:96::10";
const CLUSTER_IP_V6_ONLY: &str = "2001:db8:96::11";
/// Logged once a sync changes how many IPv6 frontends the model holds.
const IPV6_PENDING: &str = "IPv6 frontends: TCP and UDP served, masquerade included; not yet: source ranges, affinity, fragments, ICMPv6 errors, REJECT (IPv6 datapath partial)";

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
        let endpoints: String = addresses
            .iter()
            .map(|a| format!("  - addresses: [\"{a}\"]\n"))
            .collect();
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
    let proto = proto.manifest_name();
    let (slice_name, address_type, slice_port) = slice;
    let endpoints: String = addresses
        .iter()
        .map(|a| format!("  - addresses: [\"{a}\"]\n"))
        .collect();
    format!(
        "---
apiVersion: v1
kind: Service
metadata:
  name: web6
  namespace: default
spec:
  type: ClusterIP
  clusterIP: \"{CLUSTER_IP_V6_ONLY}\"
  clusterIPs: [\"{CLUSTER_IP_V6_ONLY}\"]
  ipFamilies: [IPv6]
  ports:
    - name: app
      protocol: {proto}
      port: {PORT}
      targetPort: app
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {slice_name}
  namespace: default
  labels:
    kubernetes.io/service-name: web6
addressType: {address_type}
ports:
  - name: app
    protocol: {proto}
    port: {slice_port}
endpoints:
{endpoints}"
    )
}

/// A node of three pods whose agent has both families' `--node-ip` and `--cluster-cidr`, and
/// `extra` flags.
fn dual_stack_node(extra: &[&str]) -> Result<Node> {
    let node_ips = format!("{NODE_IP},{NODE_IP_V6}");
    let cluster_cidrs = format!("{CLUSTER_CIDR},{CLUSTER_CIDR_V6}");
    let mut args = vec!["--node-ip", &node_ips, "--cluster-cidr", &cluster_cidrs];
    args.extend(extra);
    Node::start(3, &[], &args)
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
        &["--node-ip", NODE_IP_V6, "--cluster-cidr", CLUSTER_CIDR_V6],
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

/// The node's address on every pod veth: the pods' IPv6 gateway, as the topology's POD_GATEWAY.
const POD_GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x244, 0, 0, 0, 0, 1);
/// The IPv6 servers' port: the fixture's IPv4 servers hold TARGET_PORT on 0.0.0.0, which a
/// server on [::] of the same port would clash with.
const TARGET_PORT_V6: u16 = 8092;

/// Pod `index`'s IPv6 address in CLUSTER_CIDR_V6.
fn pod_ip_v6(index: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0x244, 0, 0, 0, 0, 2 + index as u16)
}

/// The MAC address of `interface` in `ns`.
fn mac(ns: &Netns, interface: &str) -> Result<String> {
    let path = format!("/sys/class/net/{interface}/address");
    let out = ns.exec("cat", &[&path])?;
    ensure!(out.status.success(), "{path}: {out:?}");
    Ok(String::from_utf8(out.stdout)?.trim().to_string())
}

/// Gives every pod an IPv6 address routed as its IPv4 one (a /128 on its veth, the node's
/// gateway address on every pod veth), with static neighbours so that no packet waits for
/// neighbour discovery or duplicate address detection.
fn add_pod_ipv6(node: &Node) -> Result<()> {
    let host = &node.topology.node;
    host.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    let gateway = POD_GATEWAY_V6.to_string();
    for (index, pod) in node.topology.pods.iter().enumerate() {
        let ip = pod_ip_v6(index).to_string();
        let veth = pod.host_interface.as_str();
        host.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{gateway}/128"),
            "dev",
            veth,
            "nodad",
        ])?;
        host.ip(&["-6", "route", "add", &format!("{ip}/128"), "dev", veth])?;
        let pod_mac = mac(&pod.ns, "eth0")?;
        host.ip(&["-6", "neigh", "add", &ip, "lladdr", &pod_mac, "dev", veth])?;
        pod.ns.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{ip}/128"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        pod.ns
            .ip(&["-6", "route", "add", &gateway, "dev", "eth0"])?;
        pod.ns.ip(&[
            "-6", "route", "add", "default", "via", &gateway, "dev", "eth0",
        ])?;
        let veth_mac = mac(host, veth)?;
        pod.ns.ip(&[
            "-6", "neigh", "add", &gateway, "lladdr", &veth_mac, "dev", "eth0",
        ])?;
    }
    Ok(())
}

/// An IPv6-only Service `web6` with an IPv6 slice of `endpoints` on TARGET_PORT_V6.
fn ipv6_only(proto: Proto, endpoints: &[Ipv6Addr]) -> String {
    let addresses: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
    ipv6_only_service(proto, ("web6-v6", "IPv6", TARGET_PORT_V6), &addresses)
}

/// Seed path 1 over IPv6: pod-a → an IPv6 ClusterIP → pod-b or pod-c. The backend sees pod-a's
/// own address (no masquerade inside the cluster CIDR), the client sees the ClusterIP answer.
fn pod_to_ipv6_cluster_ip(proto: Proto) -> Result<()> {
    let mut node = dual_stack_node(&[])?;
    add_pod_ipv6(&node)?;
    let _servers = ["pod-b", "pod-c"]
        .iter()
        .map(|pod| EchoServer::start_v6(node.pod_ns(pod), pod, TARGET_PORT_V6))
        .collect::<Result<Vec<_>>>()?;
    node.agent
        .update_manifests(&ipv6_only(proto, &[pod_ip_v6(1), pod_ip_v6(2)]))?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    let answers = requests(node.pod_ns("pod-a"), proto, service, 6)?;
    ensure!(answers.len() == 6, "{answers:?}");
    for answer in &answers {
        ensure!(
            ["pod-b", "pod-c"].contains(&answer.server.as_str())
                && answer.seen_source.ip() == IpAddr::V6(pod_ip_v6(0))
                && answer.peer == service,
            "{answer:?}"
        );
    }
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

/// The hairpin path over IPv6: pod-a → an IPv6 ClusterIP whose only endpoint is pod-a. The
/// connection is masqueraded (else pod-a would answer itself directly): the backend sees the
/// node address routing picks towards it (the pods' gateway, as over IPv4), the client the
/// ClusterIP.
fn ipv6_hairpin(proto: Proto) -> Result<()> {
    let mut node = dual_stack_node(&[])?;
    add_pod_ipv6(&node)?;
    let _server = EchoServer::start_v6(node.pod_ns("pod-a"), "pod-a", TARGET_PORT_V6)?;
    node.agent
        .update_manifests(&ipv6_only(proto, &[pod_ip_v6(0)]))?;
    let service: SocketAddr = (CLUSTER_IP_V6_ONLY.parse::<Ipv6Addr>()?, PORT).into();
    let answers = requests(node.pod_ns("pod-a"), proto, service, 6)?;
    ensure!(answers.len() == 6, "{answers:?}");
    for answer in &answers {
        ensure!(
            answer.server == "pod-a"
                && answer.seen_source.ip() == IpAddr::V6(POD_GATEWAY_V6)
                && answer.peer == service,
            "{answer:?}"
        );
    }
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

/// The external client's IPv6 address, beside the node's on the external link.
const CLIENT_IP_V6: &str = "2001:db8:100::2";
const NODE_PORT_V6: u16 = 30081;

/// Gives the external link IPv6: NODE_IP_V6 on the node's side, CLIENT_IP_V6 on the client's,
/// with static neighbours, as `add_pod_ipv6` does for the pods.
fn add_external_ipv6(node: &Node) -> Result<()> {
    let (host, client) = (&node.topology.node, &node.topology.client);
    host.ip(&[
        "-6",
        "addr",
        "add",
        &format!("{NODE_IP_V6}/64"),
        "dev",
        EXTERNAL_INTERFACE,
        "nodad",
    ])?;
    client.ip(&[
        "-6",
        "addr",
        "add",
        &format!("{CLIENT_IP_V6}/64"),
        "dev",
        "eth0",
        "nodad",
    ])?;
    let (host_mac, client_mac) = (mac(host, EXTERNAL_INTERFACE)?, mac(client, "eth0")?);
    host.ip(&[
        "-6",
        "neigh",
        "add",
        CLIENT_IP_V6,
        "lladdr",
        &client_mac,
        "dev",
        EXTERNAL_INTERFACE,
    ])?;
    client.ip(&[
        "-6", "neigh", "add", NODE_IP_V6, "lladdr", &host_mac, "dev", "eth0",
    ])
}

/// The IPv6-only Service `web6` of `ipv6_only`, of type NodePort on NODE_PORT_V6.
fn ipv6_node_port(proto: Proto, endpoints: &[Ipv6Addr]) -> Result<String> {
    let service = ipv6_only(proto, endpoints);
    let (cluster_ip, port) = ("  type: ClusterIP\n", "      targetPort: app\n");
    ensure!(
        service.contains(cluster_ip) && service.contains(port),
        "{service}"
    );
    Ok(service
        .replacen(cluster_ip, "  type: NodePort\n", 1)
        .replacen(port, &format!("{port}      nodePort: {NODE_PORT_V6}\n"), 1))
}

/// External client → NodePort on the node's IPv6 address → pod-b or pod-c, externalTrafficPolicy
/// Cluster: masqueraded, the backend sees the node address routing picks towards it (the pods'
/// gateway), the client sees node:NodePort answer.
fn external_to_ipv6_node_port(proto: Proto) -> Result<()> {
    let mut node = dual_stack_node(&[])?;
    add_pod_ipv6(&node)?;
    add_external_ipv6(&node)?;
    let _servers = ["pod-b", "pod-c"]
        .iter()
        .map(|pod| EchoServer::start_v6(node.pod_ns(pod), pod, TARGET_PORT_V6))
        .collect::<Result<Vec<_>>>()?;
    node.agent
        .update_manifests(&ipv6_node_port(proto, &[pod_ip_v6(1), pod_ip_v6(2)])?)?;
    let node_port: SocketAddr = (NODE_IP_V6.parse::<Ipv6Addr>()?, NODE_PORT_V6).into();
    let answers = requests(&node.topology.client, proto, node_port, 6)?;
    ensure!(answers.len() == 6, "{answers:?}");
    for answer in &answers {
        ensure!(
            ["pod-b", "pod-c"].contains(&answer.server.as_str())
                && answer.seen_source.ip() == IpAddr::V6(POD_GATEWAY_V6)
                && answer.peer == node_port,
            "{answer:?}"
        );
    }
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
