//! A headless Chromium for tests, driven over the DevTools protocol on a
//! pipe (`--remote-debugging-pipe`: JSON messages separated by NUL on the
//! browser's fds 3 and 4), so no websocket client is needed. The shell
//! that starts it hands our pipes to those fds.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// How long one protocol call may take before the test fails. Generous:
/// the first call waits for Chromium's cold start, which took over 30 s
/// once while CI loaded both cores (and the test's server missed its
/// runner's heartbeats in the same seconds).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

pub struct Browser {
    child: Child,
    input: ChildStdin,
    answers: Receiver<Value>,
    /// Events the browser sent (method, params), for assertions.
    pub events: Arc<Mutex<Vec<(String, Value)>>>,
    next_id: u64,
    session: String,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The Chromium binary (Debian's `chromium`), or `ROOST_TEST_CHROMIUM`.
fn chromium() -> String {
    if let Ok(path) = std::env::var("ROOST_TEST_CHROMIUM") {
        return path;
    }
    for candidate in ["/usr/bin/chromium", "/usr/bin/chromium-browser"] {
        if Path::new(candidate).exists() {
            return candidate.to_owned();
        }
    }
    panic!("the dashboard tests need Chromium: apt-get install chromium (scripts/test.sh does)");
}

impl Browser {
    /// Starts a headless browser with one page (a laptop-sized window).
    pub fn start() -> Browser {
        let profile = tempfile::Builder::new()
            .prefix("roost-chromium-")
            .tempdir()
            .expect("profile dir");
        let log = std::fs::File::create(profile.path().join("chromium.log")).expect("log file");
        let mut child = Command::new("sh")
            .arg("-c")
            // fd 3: what the browser reads (our stdin pipe); fd 4: what it
            // writes (our stdout pipe).
            .arg(r#"exec "$0" "$@" 3<&0 4>&1 </dev/null >/dev/null"#)
            .arg(chromium())
            .args([
                "--headless=new",
                "--remote-debugging-pipe",
                // Tests run as root, where Chromium's sandbox cannot start.
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--window-size=1280,900",
                "--hide-scrollbars",
                "--lang=en-US",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .env("TZ", "UTC")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start chromium");
        let input = child.stdin.take().expect("stdin");
        let output = child.stdout.take().expect("stdout");
        let (send, answers) = channel();
        let events = Arc::new(Mutex::new(Vec::new()));
        let seen = events.clone();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(output);
            loop {
                let mut message = Vec::new();
                match reader.read_until(0, &mut message) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                message.pop_if(|b| *b == 0);
                let Ok(value) = serde_json::from_slice::<Value>(&message) else {
                    continue;
                };
                if value.get("id").is_some() {
                    if send.send(value).is_err() {
                        return;
                    }
                } else if let Some(method) = value["method"].as_str() {
                    seen.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((method.to_owned(), value["params"].clone()));
                }
            }
        });
        let mut browser = Browser {
            child,
            input,
            answers,
            events,
            next_id: 0,
            session: String::new(),
            _profile: profile,
        };
        let target = browser.call_on(None, "Target.createTarget", json!({"url": "about:blank"}));
        let target_id = target["targetId"].as_str().expect("target id").to_owned();
        let attached = browser.call_on(
            None,
            "Target.attachToTarget",
            json!({"targetId": target_id, "flatten": true}),
        );
        browser.session = attached["sessionId"].as_str().expect("session").to_owned();
        browser.call("Page.enable", json!({}));
        browser.call("Runtime.enable", json!({}));
        browser.call("Log.enable", json!({}));
        browser
    }

    /// One protocol call on the page; its result (a protocol error fails).
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        let session = self.session.clone();
        self.call_on(Some(&session), method, params)
    }

    fn call_on(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({"id": id, "method": method, "params": params});
        if let Some(session) = session {
            message["sessionId"] = json!(session);
        }
        let mut bytes = message.to_string().into_bytes();
        bytes.push(0);
        tokio::task::block_in_place(|| {
            self.input.write_all(&bytes).expect("write to chromium");
            self.input.flush().expect("flush to chromium");
            let deadline = Instant::now() + CALL_TIMEOUT;
            let mut stray = HashMap::new();
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match self.answers.recv_timeout(left) {
                    Ok(answer) if answer["id"] == id => {
                        assert!(
                            answer.get("error").is_none(),
                            "{method} failed: {}",
                            answer["error"]
                        );
                        return answer["result"].clone();
                    }
                    Ok(answer) => {
                        stray.insert(answer["id"].to_string(), answer);
                    }
                    Err(RecvTimeoutError::Timeout) => {
                        panic!("{method}: no answer in {CALL_TIMEOUT:?}")
                    }
                    Err(RecvTimeoutError::Disconnected) => panic!("{method}: chromium exited"),
                }
            }
        })
    }

    pub fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url}));
    }

    /// Evaluates `expression` in the page (awaiting a promise); its value.
    pub fn eval(&mut self, expression: &str) -> Value {
        let result = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        );
        if let Some(exception) = result.get("exceptionDetails") {
            panic!("the page threw: {exception}");
        }
        result["result"]["value"].clone()
    }

    /// Polls `expression` until it is truthy (not null, false, 0 or "");
    /// returns its value. `what` names the wait in the failure.
    pub fn wait_for(&mut self, what: &str, expression: &str, patience: Duration) -> Value {
        let deadline = Instant::now() + patience;
        loop {
            let value = self.eval(expression);
            let truthy = match &value {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return value;
            }
            if Instant::now() >= deadline {
                let text = self.eval("document.getElementById('main').innerText");
                panic!("waited {patience:?} for {what}; the page shows: {text}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Types `text` into the focused element, as a keyboard would.
    pub fn type_text(&mut self, text: &str) {
        self.call("Input.insertText", json!({"text": text}));
    }

    /// Presses a key (`Enter`, `Tab`, `Escape`) on the focused element.
    pub fn press(&mut self, key: &str) {
        let code = match key {
            "Enter" => 13,
            "Tab" => 9,
            "Escape" => 27,
            _ => panic!("no key code for {key}"),
        };
        let mut event = json!({"key": key, "code": key, "windowsVirtualKeyCode": code});
        if key == "Enter" {
            event["text"] = json!("\r");
        }
        for kind in ["keyDown", "keyUp"] {
            event["type"] = json!(kind);
            self.call("Input.dispatchKeyEvent", event.clone());
        }
    }

    /// The page's width and height in CSS pixels (a phone: `mobile`).
    pub fn viewport(&mut self, width: u32, height: u32, mobile: bool) {
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile}),
        );
    }

    /// A PNG of the viewport at `path`.
    pub fn screenshot(&mut self, path: &Path) {
        let shot = self.call("Page.captureScreenshot", json!({"format": "png"}));
        write_png(path, &shot);
    }

    /// A PNG of the whole page (beyond the viewport) at `path`.
    pub fn screenshot_full(&mut self, path: &Path) {
        let metrics = self.call("Page.getLayoutMetrics", json!({}));
        let size = &metrics["cssContentSize"];
        let clip =
            json!({"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1});
        let shot = self.call(
            "Page.captureScreenshot",
            json!({"format": "png", "clip": clip, "captureBeyondViewport": true}),
        );
        write_png(path, &shot);
    }
}

fn write_png(path: &Path, shot: &Value) {
    let data = base64_decode(shot["data"].as_str().expect("png data"));
    assert!(data.starts_with(b"\x89PNG"), "not a PNG");
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).expect("screenshot dir");
    }
    std::fs::write(path, data).expect("write screenshot");
}

impl Browser {
    /// Console messages and uncaught exceptions the page produced, as text.
    pub fn problems(&self) -> Vec<String> {
        let events = self
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        events
            .iter()
            .filter_map(|(method, params)| match method.as_str() {
                "Runtime.exceptionThrown" => Some(format!("exception: {params}")),
                "Log.entryAdded" if params["entry"]["level"] == "error" => {
                    Some(format!("{}", params["entry"]["text"]))
                }
                _ => None,
            })
            .collect()
    }
}

/// Standard base64 (the protocol's binary encoding) to bytes.
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let clean: Vec<u8> = text.bytes().filter(|&c| c != b'=' && c != b'\n').collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for chunk in clean.chunks(4) {
        let mut bits = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            bits |= value(c) << (18 - 6 * i);
        }
        let bytes = bits.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}

#[test]
fn base64_decodes_what_the_protocol_sends() {
    assert_eq!(base64_decode("aGVsbG8="), b"hello");
    assert_eq!(base64_decode("aGk="), b"hi");
    assert_eq!(base64_decode("YWJj"), b"abc");
}
