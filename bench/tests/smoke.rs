//! The bench's smoke run (direct and tc at one service, tiny counts), so the harness cannot rot.
//! Run as root.
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
    assert_eq!(points.len(), 2, "direct and tc");
    for point in points {
        assert!(point["error"].is_null(), "{point}");
        assert!(point["connections"]["per_second"].as_f64().unwrap() > 0.0);
        assert!(point["requests"]["p99_us"].as_f64().unwrap() > 0.0);
    }
    assert!(!results["datapath"].as_array().unwrap().is_empty());
    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(report.contains("| 1 |"));
    assert!(dir.path().join("connections.svg").exists());
}
