//! The web dashboard in a real headless Chromium against a real server and
//! runner (runc): sign-in (a wrong token refused), a durable sandbox
//! appearing in the list and going `running` without a reload, a command
//! run from the CLI with its output shown, a stop seen as `securing` then
//! `stopped` in the open timeline, the admin view, hostile record text
//! shown as text. `ROOST_REGENERATE_SCREENSHOTS=1` writes the screenshots
//! README shows into `docs/screenshots/`.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::browser::Browser;
use crate::durable::Fleet;
use crate::harness::BIN;

const PATIENCE: Duration = Duration::from_secs(60);

/// A label a hostile client could set: shown as text, it runs nothing.
const HOSTILE: &str = r#"<img src=x onerror="window.__pwned=1">"#;

/// Where screenshots go: the README's when regenerating, else a temp dir
/// (the capture still runs).
fn screenshots(tmp: &tempfile::TempDir) -> PathBuf {
    if std::env::var_os("ROOST_REGENERATE_SCREENSHOTS").is_some_and(|v| v == "1") {
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/screenshots"
        ))
    } else {
        tmp.path().to_owned()
    }
}

/// A JS string literal for `text` (JSON is valid JavaScript).
fn js(text: &str) -> String {
    serde_json::to_string(text).expect("a string")
}

fn sign_in(browser: &mut Browser, token: &str) {
    browser.wait_for(
        "the sign-in form",
        "!!document.getElementById('signin')",
        PATIENCE,
    );
    browser.eval(&format!(
        "document.getElementById('token').value = {}; document.getElementById('signin').requestSubmit(); true",
        js(token)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_follows_a_durable_sandbox_in_a_real_browser() {
    let mut fleet = Fleet::start_on(None, &[], &[]).await;
    fleet.runner("a");
    let url = fleet.plane.server.url.clone();
    let org_token = fleet.plane.org.token.clone();
    let admin_token = fleet.plane.admin_token.clone();
    let tmp = tempfile::tempdir().expect("tempdir");
    let shots = screenshots(&tmp);

    let mut browser = Browser::start();
    browser.navigate(&format!("{url}/ui"));

    // A wrong token is refused, and nothing is kept. By keyboard alone:
    // the token field has the focus, Enter submits.
    browser.wait_for(
        "the sign-in form, focused",
        "document.activeElement?.id === 'token'",
        PATIENCE,
    );
    browser.type_text("roost_org_not_a_real_token");
    browser.press("Enter");
    let refused = browser.wait_for(
        "the refusal",
        "(document.getElementById('signin-error') || {}).textContent.includes('refused') && document.getElementById('signin-error').textContent",
        PATIENCE,
    );
    assert_eq!(refused, "That token was refused.");
    assert_eq!(
        browser.eval("sessionStorage.length + localStorage.length"),
        0
    );
    browser.screenshot(&shots.join("sign-in.png"));

    // The org signs in: the list, empty, live.
    sign_in(&mut browser, &org_token);
    browser.wait_for(
        "the live list",
        "(document.getElementById('list-status') || {}).textContent?.includes('live')",
        PATIENCE,
    );
    assert!(
        !browser
            .eval("location.href")
            .as_str()
            .unwrap_or("")
            .contains("roost_"),
        "the token is in no URL"
    );

    // A durable sandbox appears and goes `running` without a reload.
    let created = fleet
        .api()
        .post(
            "/v1/sandboxes",
            json!({"storage_class": "durable", "labels": {"team": "agents", "note": HOSTILE}}),
        )
        .await;
    assert_eq!(created.status, 201, "{created:?}");
    let id = created.str("id");
    let row = format!(
        "document.querySelector('#sandboxes tr[data-id={}]')",
        js(&id)
    );
    browser.wait_for("the new sandbox's row", &format!("!!{row}"), PATIENCE);
    browser.wait_for(
        "the sandbox running in the list",
        &format!("{row}?.getAttribute('data-state') === 'running'"),
        PATIENCE,
    );
    // The hostile label is text: no element made of it, no script run.
    let shown = browser.eval(&format!("{row}.textContent"));
    assert!(
        shown.as_str().is_some_and(|t| t.contains(HOSTILE)),
        "{shown}"
    );
    assert_eq!(browser.eval("document.querySelectorAll('img').length"), 0);
    assert_eq!(browser.eval("typeof window.__pwned"), "undefined");
    assert_every_control_is_labelled(&mut browser);

    // Filters: by label (the sandbox stays), by a state it is not in.
    let filter = |label: &str, state: &str| {
        format!(
            "document.getElementById('filter-label').value = {}; document.getElementById('filter-state').value = {}; document.querySelector('form.filters').requestSubmit(); true",
            js(label),
            js(state)
        )
    };
    browser.eval(&filter("team=agents", "running"));
    browser.wait_for("the filtered list", &format!("!!{row}"), PATIENCE);
    browser.eval(&filter("team=agents", "stopped"));
    browser.wait_for(
        "no match",
        "document.querySelector('#sandboxes tbody')?.textContent === 'No sandboxes match.'",
        PATIENCE,
    );
    browser.eval(&filter("", ""));
    browser.wait_for("the whole list", &format!("!!{row}"), PATIENCE);
    browser.screenshot(&shots.join("sandboxes.png"));

    // A phone's width: still one readable card per sandbox.
    browser.viewport(390, 844, true);
    let width = browser.eval("document.documentElement.scrollWidth");
    assert!(width.as_u64().is_some_and(|w| w <= 390), "{width}");
    browser.screenshot(&shots.join("sandboxes-phone.png"));
    browser.viewport(1280, 900, false);

    // The sandbox's view: a command run from the CLI shows up with its output.
    browser.eval(&format!(
        "location.hash = '#/sandboxes/' + {}; true",
        js(&id)
    ));
    browser.wait_for(
        "the timeline",
        "document.querySelectorAll('#timeline tr[data-seq]').length > 0",
        PATIENCE,
    );
    let exec = {
        let (url, token, id) = (url.clone(), org_token.clone(), id.clone());
        tokio::task::spawn_blocking(move || {
            Command::new(BIN)
                .args([
                    "exec",
                    &id,
                    "--",
                    "sh",
                    "-c",
                    "echo hello-from-cli; echo oops >&2",
                ])
                .env("ROOST_URL", url)
                .env("ROOST_TOKEN", token)
                .env_remove("ROOST_LOG")
                .output()
                .expect("run roost exec")
        })
        .await
        .expect("join")
    };
    assert!(exec.status.success(), "{exec:?}");
    let command = "document.querySelector('#commands tr[data-command]')";
    browser.wait_for(
        "the command, exited",
        &format!("{command}?.getAttribute('data-state') === 'exited'"),
        PATIENCE,
    );
    browser.eval(&format!("{command}.querySelector('button').click(); true"));
    let stdout = browser.wait_for(
        "the command's output",
        "document.querySelector('pre.stdout[data-complete]')?.textContent",
        PATIENCE,
    );
    assert_eq!(stdout, "hello-from-cli\n");
    let stderr = browser.wait_for(
        "the command's stderr",
        "document.querySelector('pre.stderr[data-complete]')?.textContent",
        PATIENCE,
    );
    assert_eq!(stderr, "oops\n");

    // Stop, confirmed: the open timeline shows `securing`, then `stopped`.
    browser.eval("document.getElementById('action-stop').click(); true");
    browser.wait_for(
        "the confirmation",
        "document.getElementById('confirm').open",
        PATIENCE,
    );
    browser.eval("document.getElementById('confirm-ok').click(); true");
    browser.wait_for(
        "`stopped` in the timeline",
        "!!document.querySelector('#timeline tr[data-state=stopped]')",
        PATIENCE,
    );
    let states = browser.eval(
        "[...document.querySelectorAll('#timeline tr[data-seq]')].map(r => r.getAttribute('data-state'))",
    );
    let states: Vec<&str> = states
        .as_array()
        .expect("states")
        .iter()
        .filter_map(|s| s.as_str())
        .collect();
    let securing = states.iter().position(|s| *s == "securing");
    let stopped = states.iter().position(|s| *s == "stopped");
    assert!(
        securing.is_some() && securing < stopped,
        "securing before stopped: {states:?}"
    );
    browser.wait_for(
        "the record stopped",
        "document.querySelector('#sandbox-state .state')?.textContent === 'stopped'",
        PATIENCE,
    );
    browser.screenshot_full(&shots.join("sandbox.png"));

    // The admin: runners, orgs with quota use, quarantine.
    browser.eval("document.getElementById('signout').click(); true");
    sign_in(&mut browser, &admin_token);
    browser.wait_for(
        "the runner's row",
        "document.querySelector('#runners tr[data-runner]')?.getAttribute('data-state') === 'live'",
        PATIENCE,
    );
    browser.wait_for(
        "the org's row",
        &format!(
            "!!document.querySelector('#orgs tr[data-org={}]')",
            js(&fleet.plane.org_id)
        ),
        PATIENCE,
    );
    // Its quotas, the store's included (none set for this org).
    browser.wait_for(
        "the org's store limit",
        &format!(
            "document.querySelector('#orgs tr[data-org={}] td[data-label=\"Store limit\"]')?.textContent === 'no limit'",
            js(&fleet.plane.org_id)
        ),
        PATIENCE,
    );
    browser.eval(&format!(
        "document.getElementById('q-sandbox').value = {}; document.getElementById('q-reason').value = 'forensics'; document.getElementById('quarantine').requestSubmit(); true",
        js(&id)
    ));
    browser.wait_for(
        "the confirmation",
        "document.getElementById('confirm').open",
        PATIENCE,
    );
    browser.eval("document.getElementById('confirm-ok').click(); true");
    browser.wait_for(
        "the quarantine",
        "document.getElementById('q-status').textContent.includes('is quarantined')",
        PATIENCE,
    );
    let record = fleet.get(&id).await;
    assert_eq!(record["quarantined"], true, "{record}");
    assert_every_control_is_labelled(&mut browser);

    // Drain the runner, confirmed; then undrain it.
    for (action, drain) in [("drain", json!("drain")), ("undrain", Value::Null)] {
        // The runner's row is drawn again after each action: its button for
        // the next one is there only once the page has read the change.
        let button = format!("document.querySelector('#runners button[data-action={action}]')");
        browser.wait_for(
            &format!("the {action} button"),
            &format!("!!{button}"),
            PATIENCE,
        );
        browser.eval(&format!("{button}.click(); true"));
        browser.wait_for(
            "the confirmation",
            "document.getElementById('confirm').open",
            PATIENCE,
        );
        browser.eval("document.getElementById('confirm-ok').click(); true");
        let runners = fleet.plane.admin.clone();
        let deadline = std::time::Instant::now() + PATIENCE;
        loop {
            let list = runners.get("/v1/admin/runners").await.body;
            if list[0]["drain"] == drain {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{action}: {list}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    browser.screenshot(&shots.join("admin.png"));

    let problems = browser.problems();
    assert!(
        !problems
            .iter()
            .any(|p| p.contains("Content Security Policy") || p.starts_with("exception")),
        "{problems:#?}"
    );
}

/// The dashboard's benchmark (BENCHMARKS.md "Dashboard"; run by
/// `bench/dashboard/run.sh`, not by the suite): an org with
/// `ROOST_BENCH_SANDBOXES` sandboxes (default 10,000), the list's first
/// paint and the page's transfer, then how long after the server records an
/// event an open timeline shows it. Prints figures; asserts no timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: bench/dashboard/run.sh"]
async fn benchmark() {
    use crate::plane::{Plane, TestRunner};
    let count: usize = std::env::var("ROOST_BENCH_SANDBOXES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let plane = Plane::start(&[]).await;
    // Room for a few: the rest wait `pending` (no_capacity), as a busy
    // fleet's would; nothing runs, the records are what is measured.
    let runner = TestRunner::register(
        &plane.server.url,
        &plane.runner_token,
        "bench",
        "on_demand",
        &["image:default", "network:none", "storage:standard"],
        8,
    )
    .await;
    let started = std::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let per_task = count.div_ceil(8);
    for task in 0..8 {
        let org = plane.org.clone();
        let n = per_task.min(count.saturating_sub(task * per_task));
        tasks.spawn(async move {
            let mut ids = Vec::new();
            for i in 0..n {
                let labels =
                    json!({"team": format!("t{}", (task * per_task + i) % 100), "bench": "yes"});
                let created = org.post("/v1/sandboxes", json!({"labels": labels})).await;
                assert_eq!(created.status, 201, "{created:?}");
                ids.push(created.str("id"));
            }
            ids
        });
    }
    let mut ids = Vec::new();
    while let Some(done) = tasks.join_next().await {
        ids.extend(done.expect("joined"));
        runner.heartbeat().await;
    }
    ids.sort();
    println!(
        "created {} sandboxes in {:.1} s",
        ids.len(),
        started.elapsed().as_secs_f64()
    );

    let mut browser = Browser::start();
    // Marks, taken in the page, when the list's first row is in the
    // document and painted (the next animation frame), and when each
    // timeline row appears (wall clock, to compare with the server's `at`).
    browser.call(
        "Page.addScriptToEvaluateOnNewDocument",
        json!({"source": r#"
            window.__marks = {rows: {}};
            new MutationObserver(() => {
              if (!window.__marks.listShown && document.querySelector('#sandboxes tr[data-id]')) {
                window.__marks.listShown = performance.now();
                requestAnimationFrame(() => { window.__marks.listPainted = performance.now(); });
              }
              for (const r of document.querySelectorAll('#timeline tr[data-seq]')) {
                const seq = r.getAttribute('data-seq');
                if (!window.__marks.rows[seq]) window.__marks.rows[seq] = Date.now();
              }
            }).observe(document, {childList: true, subtree: true});
        "#}),
    );
    let url = plane.server.url.clone();
    browser.navigate(&format!("{url}/ui"));
    sign_in(&mut browser, &plane.org.token);
    browser.wait_for(
        "the list",
        "window.__marks.listPainted",
        Duration::from_secs(60),
    );

    // Cold and warm loads of the signed-in page (the token is in the tab's
    // session): navigation start to the first page of rows painted.
    browser.call("Network.enable", json!({}));
    let mut paints = Vec::new();
    let mut transfer = 0.0;
    let mut requests = 0;
    for _ in 0..5 {
        browser
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
        browser.call("Page.reload", json!({"ignoreCache": true}));
        let painted = browser.wait_for(
            "the list after a reload",
            "window.__marks && window.__marks.listPainted",
            Duration::from_secs(60),
        );
        paints.push(painted.as_f64().expect("ms"));
        let rows = browser.eval("document.querySelectorAll('#sandboxes tr[data-id]').length");
        assert_eq!(rows, 50);
        // Bytes on the wire (headers included) of every request finished
        // by then: the page's files, whoami, the first page of the list.
        let events = browser
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        // Per request: what it finished with, unless that is only its
        // headers (Chromium reports a fetch's body as 0 encoded bytes):
        // then its headers and body (the server compresses nothing, so
        // body bytes are wire bytes).
        #[derive(Debug, Default)]
        struct Wire {
            finished: f64,
            headers: f64,
            body: f64,
            done: bool,
        }
        let mut per_request: std::collections::HashMap<String, Wire> =
            std::collections::HashMap::new();
        for (method, params) in &events {
            let entry = per_request
                .entry(params["requestId"].to_string())
                .or_default();
            match method.as_str() {
                "Network.responseReceived" => {
                    entry.headers = params["response"]["encodedDataLength"]
                        .as_f64()
                        .unwrap_or(0.0);
                }
                "Network.dataReceived" => {
                    entry.body += params["dataLength"].as_f64().unwrap_or(0.0);
                }
                "Network.loadingFinished" => {
                    entry.finished = params["encodedDataLength"].as_f64().unwrap_or(0.0);
                    entry.done = true;
                }
                _ => {}
            }
        }
        let finished: Vec<f64> = per_request
            .values()
            .filter(|wire| wire.done)
            .map(|wire| {
                if wire.finished > wire.headers {
                    wire.finished
                } else {
                    wire.headers + wire.body
                }
            })
            .collect();
        if std::env::var_os("ROOST_BENCH_DEBUG").is_some() {
            println!("{per_request:?}");
        }
        requests = finished.len();
        transfer = finished.iter().sum();
    }
    paints.sort_by(f64::total_cmp);
    println!(
        "list first paint with {} sandboxes, ms (5 reloads, sorted): {paints:?}",
        ids.len()
    );
    println!(
        "page transfer until the list is painted: {transfer} bytes in {requests} requests (html, js, css, whoami, the first page of 50)"
    );

    // A filtered list (one label value in a hundred), the same way.
    browser.eval("document.getElementById('filter-label').value = 'team=t42'; document.querySelector('form.filters').requestSubmit(); true");
    browser.wait_for(
        "the filtered list",
        "[...document.querySelectorAll('#sandboxes tr[data-id]')].length > 0 && document.getElementById('list-status').textContent.includes('live')",
        Duration::from_secs(60),
    );

    // An open timeline: stop and start a waiting sandbox in turn; each
    // change is an event, shown when the long-poll answers.
    let id = ids.last().expect("a sandbox").clone();
    browser.eval(&format!(
        "location.hash = '#/sandboxes/' + {}; true",
        js(&id)
    ));
    browser.wait_for(
        "the timeline",
        "document.querySelectorAll('#timeline tr[data-seq]').length > 0",
        Duration::from_secs(60),
    );
    let opened = plane
        .org
        .get(&format!("/v1/sandboxes/{id}/events"))
        .await
        .body["events"]
        .as_array()
        .expect("events")
        .len();
    for round in 0..20 {
        let action = if round % 2 == 0 { "stop" } else { "start" };
        let answer = plane
            .org
            .post(&format!("/v1/sandboxes/{id}/{action}"), json!({}))
            .await;
        assert_eq!(answer.status, 202, "{answer:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let events = plane
        .org
        .get(&format!("/v1/sandboxes/{id}/events"))
        .await
        .body;
    let shown = browser.eval("window.__marks.rows");
    let mut delays = Vec::new();
    for event in events["events"]
        .as_array()
        .expect("events")
        .iter()
        .skip(opened)
    {
        let seq = event["seq"].to_string();
        let at = humantime::parse_rfc3339(event["at"].as_str().expect("at")).expect("a time");
        let at_ms = at
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_millis() as f64;
        if let Some(seen) = shown[&seq].as_f64() {
            delays.push(seen - at_ms);
        }
    }
    delays.sort_by(f64::total_cmp);
    let at = |q: f64| delays[((delays.len() - 1) as f64 * q).round() as usize];
    println!(
        "event → timeline row, ms over {} events: p50 {:.0}, p90 {:.0}, max {:.0}",
        delays.len(),
        at(0.5),
        at(0.9),
        at(1.0)
    );
}

/// Every form control of the view has a label (its accessible name), and
/// every button says what it does.
fn assert_every_control_is_labelled(browser: &mut Browser) {
    let unlabelled = browser.eval(
        "[...document.querySelectorAll('main input, main select')].filter(e => e.labels.length === 0).map(e => e.id || e.name)\
         .concat([...document.querySelectorAll('button')].filter(b => !b.textContent.trim()).map(b => b.id || 'a button'))",
    );
    assert_eq!(unlabelled, json!([]), "controls without a name");
}
