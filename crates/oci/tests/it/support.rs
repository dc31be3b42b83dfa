//! Real sandboxes for the tests: a private runtime state root and sandbox
//! directory per test, the crate's own `roost-test-init` as PID 1, and a
//! guard that force-deletes the container however the test ends.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use oci::{
    CommandEnd, CommandSpec, InitProgram, Limits, Runtime, RuntimeChoice, RuntimeConfig, Sandbox,
    SandboxConfig, SandboxId, SandboxPaths, Stream,
};

/// Cgroup parent of every test sandbox, apart from production's `roost`.
pub const CGROUP_PARENT: &str = "roost-test";

/// The init binary the tests bind into containers.
pub fn init_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_roost-test-init"))
}

/// Fails loudly where these tests cannot mean anything.
pub fn require_root_and_runc() {
    assert!(
        rustix::process::geteuid().is_root(),
        "the runner's container tests need root (scripts/test.sh runs them as root)"
    );
    assert!(
        oci::host::find_binary(&std::env::var_os("PATH").unwrap_or_default(), "runc").is_some(),
        "runc is not installed: scripts/test.sh installs it with apt-get"
    );
}

pub struct TestSandbox {
    pub sandbox: Sandbox,
    pub runtime: Runtime,
    pub config: SandboxConfig,
    /// Host side of /workspace.
    pub workspace: PathBuf,
    dir: tempfile::TempDir,
}

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// A fresh, unique sandbox config (not created yet) under a temp dir.
pub fn prepare(name: &str, limits: Limits) -> (tempfile::TempDir, SandboxConfig) {
    require_root_and_runc();
    let dir = tempfile::Builder::new()
        .prefix("roost-runner-it-")
        .tempdir()
        .expect("temp dir");
    let workspace = dir.path().join("workspace");
    std::fs::create_dir(&workspace).expect("workspace dir");
    let id = format!(
        "t-{name}-{}-{}",
        std::process::id(),
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    );
    let mut config = SandboxConfig::new(
        SandboxId::new(id).expect("valid id"),
        SandboxPaths::new(dir.path().join("sandbox")).expect("absolute"),
        workspace,
        InitProgram {
            host_path: init_binary(),
            args: Vec::new(),
        },
    );
    config.limits = limits;
    (dir, config)
}

pub fn runtime_in(dir: &Path, choice: RuntimeChoice) -> oci::Result<Runtime> {
    let mut config = RuntimeConfig::new(choice, dir.join("state"));
    config.cgroup_parent = CGROUP_PARENT.to_owned();
    Runtime::open(config)
}

impl TestSandbox {
    /// Creates and starts a sandbox with runc.
    pub async fn start(name: &str, limits: Limits) -> TestSandbox {
        let (dir, config) = prepare(name, limits);
        Self::start_config(dir, config).await
    }

    pub async fn start_config(dir: tempfile::TempDir, config: SandboxConfig) -> TestSandbox {
        let runtime = runtime_in(dir.path(), RuntimeChoice::Runc).expect("runc runtime");
        let sandbox = runtime.launch(&config).await.expect("sandbox launches");
        Self::from_parts(sandbox, runtime, config, dir)
    }

    pub fn from_parts(
        sandbox: Sandbox,
        runtime: Runtime,
        config: SandboxConfig,
        dir: tempfile::TempDir,
    ) -> TestSandbox {
        TestSandbox {
            sandbox,
            runtime,
            workspace: config.workspace.clone(),
            config,
            dir,
        }
    }

    pub fn state_root(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Runs a command to its end, collecting its output.
    pub async fn run(&self, command: &CommandSpec) -> Ran {
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        let end = self
            .sandbox
            .run(command, |stream, bytes| match stream {
                Stream::Stdout => stdout.extend_from_slice(bytes),
                Stream::Stderr => stderr.extend_from_slice(bytes),
            })
            .await
            .expect("command runs to an end");
        Ran {
            end,
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        }
    }

    /// Runs `sh -c SCRIPT`.
    pub async fn sh(&self, script: &str) -> Ran {
        self.run(&CommandSpec::new(["sh", "-c", script])).await
    }

    /// Runs `sh -c SCRIPT` and insists it exits 0.
    pub async fn sh_ok(&self, script: &str) -> String {
        let ran = self.sh(script).await;
        assert_eq!(
            ran.end.outcome,
            oci::Outcome::Exited { code: 0 },
            "`{script}` failed: stdout {:?}, stderr {:?}",
            ran.stdout,
            ran.stderr
        );
        ran.stdout
    }
}

impl Drop for TestSandbox {
    fn drop(&mut self) {
        // Whatever the test did, leave no container, process or cgroup.
        let _ = std::process::Command::new(self.runtime.binary())
            .arg(format!("--root={}", self.state_root().display()))
            .args(["delete", "--force", self.config.id.as_str()])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

pub struct Ran {
    pub end: CommandEnd,
    pub stdout: String,
    pub stderr: String,
}

/// Alive and not a zombie (whoever adopted a dead init may reap late).
pub fn process_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(|s| s != "Z"))
        })
        .unwrap_or(false)
}

/// The host pid of a running sandbox's init.
pub async fn init_pid(sandbox: &oci::Sandbox) -> i32 {
    sandbox
        .state()
        .await
        .expect("state")
        .and_then(|s| s.init_pid)
        .expect("the init's pid")
}

/// Polls `check` until it holds or `within` passes.
pub async fn eventually(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if check() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
