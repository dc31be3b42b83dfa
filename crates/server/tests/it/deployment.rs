//! `GET /v1/deployment`: any token reads the live configuration; README's
//! host-failure table is the default deployment's, rendered by the same
//! function `roost info` uses; the document describes every field with its
//! unit.

use serde_json::Value;

use crate::support::TestServer;

const README: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
const TABLE_BEGIN: &str = "<!-- host-failure-table begin: generated from the server's defaults; see crates/server/tests/it/deployment.rs -->\n";
const TABLE_END: &str = "<!-- host-failure-table end -->";

/// The table as the default configuration makes it.
fn default_table() -> String {
    let config = server::Config::new(
        "127.0.0.1:0".parse().expect("an address"),
        std::path::PathBuf::from("/var/lib/roost"),
    );
    let deployment = server::control::deployment::of_config(
        &config,
        server::control::deployment::nothing_observed(),
    );
    api::deployment::host_failure_table(&deployment, "default")
}

/// README's table is exactly what the API's defaults render. To update it
/// after changing a default or the table: `ROOST_REGENERATE_README=1 cargo
/// test -p server --test it deployment::readme`.
#[test]
fn readme_host_failure_table_is_the_default_deployments() {
    let readme = std::fs::read_to_string(README).expect("README.md");
    let start = readme
        .find(TABLE_BEGIN)
        .expect("README has the table's begin marker")
        + TABLE_BEGIN.len();
    let end = start
        + readme[start..]
            .find(TABLE_END)
            .expect("README has the table's end marker");
    let expected = default_table();
    if readme[start..end] == expected {
        return;
    }
    if std::env::var_os("ROOST_REGENERATE_README").is_some() {
        let updated = format!("{}{expected}{}", &readme[..start], &readme[end..]);
        std::fs::write(README, updated).expect("write README.md");
        return;
    }
    panic!(
        "README.md's host-failure table differs from the API's defaults; regenerate it with \
         `ROOST_REGENERATE_README=1 cargo test -p server --test it deployment::readme`. \
         Expected:\n{expected}\nfound:\n{}",
        &readme[start..end]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_token_reads_the_live_configuration() {
    let server = TestServer::start().await;
    let (org, _) = server.org("deploy").await;
    let deployment = org.deployment().await.expect("an org token reads it");
    let c = &deployment.configured;
    assert_eq!(
        (c.lease_ttl_s, c.save_interval_s, c.stop_grace_s),
        (9.0, 300.0, 10.0)
    );
    assert_eq!(deployment.store.kind, "local");
    assert!(!deployment.store.independent_of_runners);
    assert!(!deployment.after_host_loss.commands_rerun);
    // Nothing happened yet: counts are 0, figures null.
    let observed = &deployment.observed;
    assert_eq!(observed.window_s, 86_400.0);
    for figure in [
        &observed.save_duration,
        &observed.save_lag,
        &observed.host_loss_to_running,
        &observed.wake_same_runner,
        &observed.wake_other_runner,
    ] {
        assert_eq!((figure.count, figure.p50_s, figure.max_s), (0, None, None));
    }
    let admin = server
        .admin
        .deployment()
        .await
        .expect("the admin token reads it");
    assert_eq!(admin.configured, deployment.configured);
    let anonymous = reqwest::get(format!("{}/v1/deployment", server.url))
        .await
        .expect("the server answers");
    assert_eq!(anonymous.status().as_u16(), 401);
}

/// The schemas `GET /v1/deployment` answers with, and the save status.
const SCHEMAS: &[&str] = &[
    "Deployment",
    "Configured",
    "StoreLocation",
    "Bounds",
    "AfterHostLoss",
    "Observed",
    "Figure",
    "SaveStatus",
];

/// Every field of the answer is described; every number names its unit
/// (seconds, a count or a share) and every time is RFC 3339.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_describes_every_field_with_its_unit() {
    let server = TestServer::start().await;
    let doc: Value = reqwest::get(format!("{}/v1/openapi.json", server.url))
        .await
        .expect("fetch the document")
        .json()
        .await
        .expect("JSON");
    assert!(
        doc["paths"]["/v1/deployment"]["get"].is_object(),
        "the operation is in the document"
    );
    let mut missing = Vec::new();
    for schema in SCHEMAS {
        let properties = doc["components"]["schemas"][schema]["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("schema {schema} in the document"));
        for (name, property) in properties {
            let described = property["description"].as_str().unwrap_or_default();
            let is_ref = property.get("$ref").is_some()
                || property.get("allOf").is_some()
                || property.get("oneOf").is_some();
            let types: Vec<&str> = match &property["type"] {
                Value::String(t) => vec![t.as_str()],
                Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            let numeric = types.iter().any(|t| *t == "number" || *t == "integer");
            let unit = ["Seconds", "seconds", "A count", "share", "Bytes"]
                .iter()
                .any(|u| described.contains(u));
            if numeric && !unit {
                missing.push(format!("{schema}.{name}: a number without its unit"));
            }
            if name.ends_with("_until") && !described.contains("RFC 3339") {
                missing.push(format!("{schema}.{name}: a time not said to be RFC 3339"));
            }
            let new_here =
                *schema != "SaveStatus" || ["safe_until", "at_risk_s"].contains(&name.as_str());
            if new_here && !is_ref && described.is_empty() {
                missing.push(format!("{schema}.{name}: no description"));
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// A server that cannot bind its address (another process holds it) stops
/// before it makes anything: its admin token, shown only by the server that
/// creates it, is made by the first start that serves.
#[tokio::test]
async fn a_server_that_cannot_listen_makes_no_admin_token() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let busy = held.local_addr().expect("its address");
    let data = tempfile::tempdir().expect("a temp dir");
    let data_dir = data.path().join("server");
    let config = server::Config::new(busy, data_dir.clone());
    let served = server::serve(config, std::future::pending(), |_| {
        panic!("started on a busy port")
    })
    .await;
    assert!(
        matches!(served, Err(server::ServerError::Bind { .. })),
        "{:?}",
        served.err()
    );
    assert!(
        !data_dir.join("admin-token").exists(),
        "an admin token no one was shown"
    );
}
