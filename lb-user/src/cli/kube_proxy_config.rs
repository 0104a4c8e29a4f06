//! `lb agent --config FILE`: kube-proxy's configuration file (KubeProxyConfiguration,
//! kubeproxy.config.k8s.io/v1alpha1) turned into the agent's flags.
//!
//! Each field that has a counterpart becomes that flag's value, unless the flag is on the
//! command line: flags override the file, as in kube-proxy. The values go through the flags' own
//! parsers, so a bad value in the file is refused as the flag would be. A field without a
//! counterpart is never silently dropped: when it sets anything, it is named in a warning.
use std::collections::BTreeMap;
use std::net::IpAddr;

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;
use yaml_serde::Value;

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// What a configuration file says, as flags.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FileFlags {
    /// `(argument id, value)`: the id is the agent's field name (`cluster_cidr`), whose flag is
    /// its kebab-case (`--cluster-cidr`).
    pub flags: Vec<(&'static str, String)>,
    /// Fields the file sets that the agent has no use for, each a sentence.
    pub ignored: Vec<String>,
}

impl FileFlags {
    fn set(&mut self, id: &'static str, value: impl Into<String>) {
        self.flags.push((id, value.into()));
    }

    fn ignore(&mut self, field: &str, why: &str) {
        self.ignored.push(format!("{field}: {why}"));
    }

    /// Fields the file sets that this version knows nothing of.
    fn unknown(&mut self, section: &str, rest: &BTreeMap<String, Value>) {
        for (name, value) in rest {
            if sets_something(value) {
                self.ignore(&format!("{section}{name}"), "not a field lb uses");
            }
        }
    }
}

/// The flag's long form for an argument id.
pub fn flag_of(id: &str) -> String {
    format!("--{}", id.replace('_', "-"))
}

/// The flags `text` (the file's YAML) sets. `cpus`: the node's CPUs, by which kube-proxy
/// scales its conntrack table.
pub fn flags_from(text: &str, cpus: u32) -> Result<FileFlags> {
    let config: Config = yaml_serde::from_str(text).context("not a KubeProxyConfiguration")?;
    if config.kind != KIND || config.api_version != API_VERSION {
        bail!(
            "kind {:?}, apiVersion {:?}: expected kind {KIND}, apiVersion {API_VERSION}",
            config.kind,
            config.api_version
        );
    }
    let mut out = FileFlags::default();
    config.map(&mut out, cpus);
    Ok(out)
}

/// Whether a field's value configures anything: kubeadm writes every field, most of them
/// empty, and an empty field sets nothing worth a warning.
fn sets_something(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Sequence(items) => !items.is_empty(),
        Value::Mapping(fields) => fields.values().any(sets_something),
        Value::Tagged(tagged) => sets_something(&tagged.value),
    }
}

/// A duration field's value, as the flags take it (Go's syntax). kube-proxy gives a zero
/// duration its default, so `0s` is unset, as an empty field is.
fn duration(value: &Option<String>) -> Option<&str> {
    value.as_deref().filter(|d| !d.is_empty() && !is_zero(d))
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Config {
    api_version: String,
    kind: String,
    bind_address: Option<String>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    node_port_addresses: Option<Vec<String>>,
    healthz_bind_address: Option<String>,
    metrics_bind_address: Option<String>,
    hostname_override: Option<String>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
    mode: Option<String>,
    detect_local_mode: Option<String>,
    detect_local: Option<DetectLocal>,
    client_connection: Option<ClientConnection>,
    conntrack: Option<Conntrack>,
    linux: Option<Linux>,
    iptables: Option<ModeSection>,
    ipvs: Option<ModeSection>,
    nftables: Option<ModeSection>,
    logging: Option<Logging>,
    #[serde(flatten)]
    rest: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct DetectLocal {
    #[serde(rename = "clusterCIDRs")]
    cluster_cidrs: Option<Vec<String>>,
    #[serde(flatten)]
    rest: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct ClientConnection {
    kubeconfig: Option<String>,
    #[serde(flatten)]
    rest: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Conntrack {
    max_per_core: Option<u32>,
    min: Option<u32>,
    tcp_established_timeout: Option<String>,
    tcp_close_wait_timeout: Option<String>,
    udp_timeout: Option<String>,
    udp_stream_timeout: Option<String>,
    #[serde(flatten)]
    rest: BTreeMap<String, Value>,
}

/// `linux`: where newer releases moved `conntrack` and `masqueradeAll`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Linux {
    conntrack: Option<Conntrack>,
    masquerade_all: Option<bool>,
    #[serde(flatten)]
    rest: BTreeMap<String, Value>,
}

/// `iptables`, `ipvs`, `nftables`: older releases' place for the sync periods.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct ModeSection {
    sync_period: Option<String>,
    min_sync_period: Option<String>,
    masquerade_all: Option<bool>,
    masquerade_bit: Option<i32>,
    scheduler: Option<String>,
    #[serde(flatten)]
    rest: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Logging {
    format: Option<String>,
    #[serde(flatten)]
    rest: BTreeMap<String, Value>,
}

impl Config {
    fn map(&self, out: &mut FileFlags, cpus: u32) {
        self.map_node(out);
        self.map_cluster_cidr(out);
        self.map_servers(out);
        self.map_sync_periods(out);
        self.map_modes(out);
        let conntrack = self
            .linux
            .as_ref()
            .and_then(|l| l.conntrack.as_ref())
            .or(self.conntrack.as_ref());
        if let Some(conntrack) = conntrack {
            conntrack.map(out, cpus);
        }
        if let Some(linux) = &self.linux {
            if linux.masquerade_all == Some(true) {
                out.set("masquerade_all", "true");
            }
            out.unknown("linux.", &linux.rest);
        }
        if let Some(logging) = &self.logging {
            match logging.format.as_deref() {
                Some("json") => out.set("log_format", "json"),
                Some("text") | Some("") | None => {}
                Some(other) => {
                    out.ignore("logging.format", &format!("{other:?}: not json or text"))
                }
            }
            out.unknown("logging.", &logging.rest);
        }
        if let Some(client) = &self.client_connection {
            if let Some(kubeconfig) = client.kubeconfig.as_deref().filter(|k| !k.is_empty()) {
                out.set("kubeconfig", kubeconfig);
            }
            out.unknown("clientConnection.", &client.rest);
        }
        out.unknown("", &self.rest);
    }

    fn map_node(&self, out: &mut FileFlags) {
        if let Some(name) = self.hostname_override.as_deref().filter(|n| !n.is_empty()) {
            out.set("hostname_override", name);
        }
        // kube-proxy takes the node's address from bindAddress when it names one.
        match self.bind_address.as_deref().map(str::parse::<IpAddr>) {
            Some(Ok(ip)) if !ip.is_unspecified() => out.set("node_ip", ip.to_string()),
            Some(Err(_)) => out.ignore("bindAddress", "not an IP address"),
            _ => {}
        }
    }

    /// `clusterCIDR`, or `detectLocal.clusterCIDRs` of newer releases; the first CIDR of each
    /// family.
    fn map_cluster_cidr(&self, out: &mut FileFlags) {
        let from_detect_local = self
            .detect_local
            .as_ref()
            .and_then(|d| d.cluster_cidrs.clone())
            .unwrap_or_default();
        let cidrs: Vec<String> = match self.cluster_cidr.as_deref().filter(|c| !c.is_empty()) {
            Some(list) => list.split(',').map(|c| c.trim().to_owned()).collect(),
            None => from_detect_local,
        };
        let (v4, v6): (Vec<_>, Vec<_>) = cidrs.into_iter().partition(|c| !c.contains(':'));
        let firsts: Vec<String> = v4
            .into_iter()
            .take(1)
            .chain(v6.into_iter().take(1))
            .collect();
        if !firsts.is_empty() {
            out.set("cluster_cidr", firsts.join(","));
        }
        match self.detect_local_mode.as_deref() {
            None | Some("") | Some("ClusterCIDR") => {}
            Some(mode) => out.ignore(
                "detectLocalMode",
                &format!("{mode}: lb tells local traffic by the cluster CIDR only"),
            ),
        }
        if let Some(detect_local) = &self.detect_local {
            out.unknown("detectLocal.", &detect_local.rest);
        }
    }

    fn map_servers(&self, out: &mut FileFlags) {
        if let Some(addresses) = &self.node_port_addresses {
            let (cidrs, others): (Vec<_>, Vec<_>) = addresses.iter().partition(|a| a.contains('/'));
            if !cidrs.is_empty() {
                let cidrs: Vec<&str> = cidrs.iter().map(|c| c.as_str()).collect();
                out.set("node_port_addresses", cidrs.join(","));
            }
            if !others.is_empty() {
                out.ignore(
                    "nodePortAddresses",
                    &format!("{others:?}: only CIDRs are served"),
                );
            }
        }
        if let Some(address) = &self.healthz_bind_address {
            out.set("healthz_bind_address", address.clone());
        }
        if let Some(address) = &self.metrics_bind_address {
            out.set("metrics_bind_address", address.clone());
        }
    }

    /// The top-level periods of newer releases win over the per-mode ones of older releases.
    fn map_sync_periods(&self, out: &mut FileFlags) {
        let sections = [&self.iptables, &self.ipvs, &self.nftables];
        let mode_value = |pick: fn(&ModeSection) -> &Option<String>| {
            sections
                .iter()
                .filter_map(|s| s.as_ref())
                .find_map(|s| duration(pick(s)).map(str::to_owned))
        };
        let sync = duration(&self.sync_period)
            .map(str::to_owned)
            .or_else(|| mode_value(|s| &s.sync_period));
        let min_sync = duration(&self.min_sync_period)
            .map(str::to_owned)
            .or_else(|| mode_value(|s| &s.min_sync_period));
        if let Some(period) = sync {
            out.set("sync_period", period);
        }
        if let Some(period) = min_sync {
            out.set("min_sync_period", period);
        }
    }

    fn map_modes(&self, out: &mut FileFlags) {
        if let Some(mode) = self.mode.as_deref().filter(|m| !m.is_empty()) {
            out.ignore("mode", &format!("{mode}: lb is its own proxy mode"));
        }
        let named = [
            ("iptables.", &self.iptables),
            ("ipvs.", &self.ipvs),
            ("nftables.", &self.nftables),
        ];
        for (section, mode) in named {
            let Some(mode) = mode else { continue };
            if mode.masquerade_all == Some(true) {
                out.set("masquerade_all", "true");
            }
            if let Some(bit) = mode.masquerade_bit {
                out.set("iptables_masquerade_bit", bit.to_string());
            }
            if let Some(scheduler) = mode.scheduler.as_deref().filter(|s| !s.is_empty()) {
                // IPVS's mh is consistent hashing, our maglev.
                match scheduler {
                    "rr" | "sh" => out.set("scheduler", scheduler),
                    "mh" => out.set("scheduler", "maglev"),
                    other => out.ignore(
                        "ipvs.scheduler",
                        &format!("{other}: lb schedules random, rr, sh or mh (maglev)"),
                    ),
                }
            }
            out.unknown(section, &mode.rest);
        }
    }
}

impl Conntrack {
    fn map(&self, out: &mut FileFlags, cpus: u32) {
        // kube-proxy sizes netfilter's table at maxPerCore × CPUs, at least min; each connection
        // takes two of our entries.
        let per_core = self.max_per_core.unwrap_or(0).saturating_mul(cpus);
        let connections = per_core.max(self.min.unwrap_or(0));
        if self.max_per_core.is_some_and(|m| m > 0) {
            out.set("conntrack_max", connections.saturating_mul(2).to_string());
        }
        let timeouts = [
            (
                "conntrack_tcp_timeout_established",
                &self.tcp_established_timeout,
            ),
            (
                "conntrack_tcp_timeout_close_wait",
                &self.tcp_close_wait_timeout,
            ),
            ("conntrack_udp_timeout", &self.udp_timeout),
            ("conntrack_udp_timeout_stream", &self.udp_stream_timeout),
        ];
        for (id, value) in timeouts {
            if let Some(timeout) = duration(value) {
                out.set(id, timeout);
            }
        }
        out.unknown("conntrack.", &self.rest);
    }
}

/// `0`, `0s`, `0h0m0s`, ...
fn is_zero(duration: &str) -> bool {
    duration.chars().all(|c| !c.is_ascii_digit() || c == '0')
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBEADM: &str = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: 12h0m0s
  udpTimeout: 0s
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 2s
  syncPeriod: 0s
ipvs:
  scheduler: ""
  syncPeriod: 0s
metricsBindAddress: 0.0.0.0:10249
mode: "iptables"
nodePortAddresses:
- 198.51.100.0/24
- primary
oomScoreAdj: -999
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
"#;

    fn value<'a>(flags: &'a FileFlags, id: &str) -> Option<&'a str> {
        flags
            .flags
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn kubeadm_file_maps_what_applies_and_names_what_does_not() {
        let flags = flags_from(KUBEADM, 4).unwrap();
        assert_eq!(
            value(&flags, "cluster_cidr"),
            Some("10.244.0.0/16,fd00:10:244::/56")
        );
        assert_eq!(
            value(&flags, "kubeconfig"),
            Some("/var/lib/kube-proxy/kubeconfig.conf")
        );
        assert_eq!(value(&flags, "metrics_bind_address"), Some("0.0.0.0:10249"));
        // "" disables a server in kube-proxy, as it does here.
        assert_eq!(value(&flags, "healthz_bind_address"), Some(""));
        assert_eq!(value(&flags, "min_sync_period"), Some("2s"));
        assert_eq!(value(&flags, "sync_period"), None, "0s is unset");
        assert_eq!(
            value(&flags, "node_port_addresses"),
            Some("198.51.100.0/24")
        );
        assert_eq!(
            value(&flags, "conntrack_tcp_timeout_established"),
            Some("12h0m0s")
        );
        assert_eq!(value(&flags, "conntrack_udp_timeout"), None, "0s is unset");
        assert_eq!(value(&flags, "conntrack_max"), None);
        assert_eq!(value(&flags, "node_ip"), None, "0.0.0.0 names no node");
        let ignored = flags.ignored.join("\n");
        for field in ["mode", "nodePortAddresses", "oomScoreAdj"] {
            assert!(ignored.contains(field), "{field} not named in {ignored}");
        }
        // Empty fields set nothing and are not worth a warning.
        for field in ["winkernel", "portRange", "masqueradeBit", "enableProfiling"] {
            assert!(!ignored.contains(field), "{field} named in {ignored}");
        }
    }

    #[test]
    fn newer_sections_win() {
        let flags = flags_from(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
syncPeriod: 45s
minSyncPeriod: 500ms
nftables: {syncPeriod: 10s, minSyncPeriod: 3s, masqueradeBit: 12}
ipvs: {scheduler: mh}
bindAddress: 198.51.100.10
detectLocal: {clusterCIDRs: [10.244.0.0/16]}
linux:
  masqueradeAll: true
  conntrack: {maxPerCore: 1000, min: 2000, udpStreamTimeout: 3m}
logging: {format: json}
",
            8,
        )
        .unwrap();
        assert_eq!(value(&flags, "sync_period"), Some("45s"));
        assert_eq!(value(&flags, "min_sync_period"), Some("500ms"));
        assert_eq!(value(&flags, "scheduler"), Some("maglev"));
        assert_eq!(value(&flags, "node_ip"), Some("198.51.100.10"));
        assert_eq!(value(&flags, "cluster_cidr"), Some("10.244.0.0/16"));
        assert_eq!(value(&flags, "masquerade_all"), Some("true"));
        assert_eq!(value(&flags, "conntrack_max"), Some("16000"));
        assert_eq!(value(&flags, "conntrack_udp_timeout_stream"), Some("3m"));
        assert_eq!(value(&flags, "log_format"), Some("json"));
        assert_eq!(value(&flags, "iptables_masquerade_bit"), Some("12"));
        assert!(flags.ignored.is_empty(), "{:?}", flags.ignored);
    }

    #[test]
    fn ipv6_node_address_and_the_first_cluster_cidr_of_each_family() {
        let flags = flags_from(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: '2001:db8:100::10'
detectLocal: {clusterCIDRs: ['fd00:10:244::/56', 10.244.0.0/16, 10.245.0.0/16]}
nodePortAddresses: [198.51.100.0/24, '2001:db8:100::/64']
",
            1,
        )
        .unwrap();
        assert_eq!(value(&flags, "node_ip"), Some("2001:db8:100::10"));
        assert_eq!(
            value(&flags, "cluster_cidr"),
            Some("10.244.0.0/16,fd00:10:244::/56")
        );
        assert_eq!(
            value(&flags, "node_port_addresses"),
            Some("198.51.100.0/24,2001:db8:100::/64")
        );
        assert!(flags.ignored.is_empty(), "{:?}", flags.ignored);
    }

    #[test]
    fn other_kinds_are_refused() {
        assert!(flags_from("apiVersion: v1\nkind: ConfigMap\n", 1).is_err());
        assert!(flags_from("kind: KubeProxyConfiguration\n", 1).is_err());
        assert!(flags_from("- not a mapping\n", 1).is_err());
    }

    #[test]
    fn flags_are_kebab_case() {
        assert_eq!(flag_of("cluster_cidr"), "--cluster-cidr");
    }
}
