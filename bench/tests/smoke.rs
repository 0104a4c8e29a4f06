//! The bench's smoke run (direct, tc and tc-redirect at one service, tiny counts, every
//! section), so the harness cannot rot. Run as root.
use std::process::Command;

#[test]
fn smoke_run_writes_results_report_and_plots() {
    let dir = tempfile::tempdir().unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_lb-bench"))
        .arg("--smoke")
        .arg("--out")
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success(), "lb-bench --smoke: {status}");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("results.json")).unwrap())
            .unwrap();
    let points = results["points"].as_array().unwrap();
    assert_eq!(
        points.len(),
        6,
        "direct, tc and tc-redirect, in both families"
    );
    for family in ["ipv4", "ipv6"] {
        assert_eq!(
            points.iter().filter(|p| p["family"] == family).count(),
            3,
            "{family}"
        );
    }
    for point in points {
        assert!(point["error"].is_null(), "{point}");
        assert!(point["connections"]["per_second"].as_f64().unwrap() > 0.0);
        assert!(point["requests"]["p99_us"].as_f64().unwrap() > 0.0);
    }
    // B1: both forwarding modes of IPv4, and IPv6's stack mode.
    let datapath = results["datapath"].as_array().unwrap();
    for (family, forwarding) in [("ipv4", "stack"), ("ipv4", "redirect"), ("ipv6", "stack")] {
        assert!(
            datapath
                .iter()
                .any(|c| c["family"] == family && c["forwarding"] == forwarding),
            "no B1 {family} {forwarding} cost"
        );
    }

    // B4: tc and tc-redirect (the smoke run has no iptables); frames reached the backend.
    let flood = results["flood"].as_array().unwrap();
    assert_eq!(flood.len(), 2, "{flood:?}");
    for point in flood {
        assert!(point["error"].is_null(), "{point}");
        assert!(point["forwarded"].as_u64().unwrap() > 0);
        assert!(point["forwarded"].as_u64() <= point["sent"].as_u64());
    }

    // B5: 0%, 50%, 100%, ports exhausted; the fills are in the map, every flow to the exhausted
    // NodePort was a counted drop, and pod connections went on.
    let conntrack = results["conntrack"].as_array().unwrap();
    assert_eq!(conntrack.len(), 4, "{conntrack:?}");
    let max = conntrack[0]["max_entries"].as_u64().unwrap();
    assert!(conntrack[1]["entries"].as_u64().unwrap() >= max / 2);
    assert!(conntrack[2]["entries"].as_u64().unwrap() > max * 9 / 10);
    for point in conntrack {
        assert!(
            point["connections"]["per_second"].as_f64().unwrap() > 0.0,
            "{point}"
        );
    }
    let exhausted = &conntrack[3];
    let attempts = exhausted["attempts"].as_u64().unwrap();
    assert!(attempts > 0);
    assert!(exhausted["drop_snat_ports_exhausted"].as_u64().unwrap() >= attempts);

    // B5's SYN flood: tc and tc-redirect; every SYN sent, every idle established connection
    // still echoes, new connections succeeded during and after it.
    let syn_flood = results["syn_flood"].as_array().unwrap();
    assert_eq!(syn_flood.len(), 2, "{syn_flood:?}");
    for point in syn_flood {
        assert!(point["error"].is_null(), "{point}");
        assert_eq!(
            point["established_surviving"], point["established"],
            "{point}"
        );
        assert!(point["during_succeeded"].as_u64().unwrap() > 0, "{point}");
        assert!(point["after_succeeded"].as_u64().unwrap() > 0, "{point}");
    }

    // B6: both --min-sync-period settings, every change seen.
    let control = results["control"].as_array().unwrap();
    assert_eq!(control.len(), 2, "{control:?}");
    for point in control {
        assert!(point["error"].is_null(), "{point}");
        let latencies = point["latencies_ms"].as_array().unwrap();
        assert_eq!(latencies.len(), 2, "{point}");
        assert!(latencies.iter().all(|l| l.as_f64().unwrap() > 0.0));
    }

    // B6 through the apiserver: started, every change seen, relisted after the 410.
    let control_api = results["control_api"].as_array().unwrap();
    assert_eq!(control_api.len(), 1, "{control_api:?}");
    let point = &control_api[0];
    assert!(point["error"].is_null(), "{point}");
    assert!(point["cold_start_s"].as_f64().unwrap() > 0.0, "{point}");
    assert_eq!(
        point["latencies_ms"].as_array().unwrap().len(),
        2,
        "{point}"
    );
    assert!(point["relist_s"].as_f64().unwrap() > 0.0, "{point}");
    assert!(point["rss_start_kib"].as_u64().unwrap() > 0, "{point}");

    // B6 restart, after SIGTERM and after SIGKILL: the new agent swapped its programs into the
    // pinned links, its first sync found the maps already written, and every probe connection
    // across the restart was answered.
    let restarts = results["restarts"].as_array().unwrap();
    assert_eq!(restarts.len(), 2, "{restarts:?}");
    for restart in restarts {
        assert!(restart["error"].is_null(), "{restart}");
        let loaded = restart["loaded_s"].as_f64().unwrap();
        let first_sync = restart["first_sync_s"].as_f64().unwrap();
        assert!(loaded > 0.0 && first_sync >= loaded, "{restart}");
        assert!(
            restart["swapped_s"].as_f64().unwrap() >= first_sync,
            "{restart}"
        );
        assert!(restart["links_replaced"].as_u64().unwrap() > 0, "{restart}");
        assert_eq!(restart["links_attached"], 0, "{restart}");
        assert_eq!(restart["first_sync_writes"], 0, "{restart}");
        assert_eq!(restart["probe"]["failed"], 0, "{restart}");
        assert!(
            restart["probe"]["answered"].as_u64().unwrap() >= 40,
            "{restart}"
        );
    }

    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(report.contains("| 1 |"));
    for section in [
        "## B4",
        "## B5",
        "## B6 control plane",
        "## B6 through the apiserver",
        "## B6 programming",
        "## B6 restart",
    ] {
        assert!(report.contains(section), "{section} missing:\n{report}");
    }
    assert!(dir.path().join("connections.svg").exists());
}
