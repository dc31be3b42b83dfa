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

use serde_json::json;

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

    // A wrong token is refused, and nothing is kept.
    sign_in(&mut browser, "roost_org_not_a_real_token");
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
    browser.screenshot(&shots.join("admin.png"));

    let problems = browser.problems();
    assert!(
        !problems
            .iter()
            .any(|p| p.contains("Content Security Policy") || p.starts_with("exception")),
        "{problems:#?}"
    );
}
