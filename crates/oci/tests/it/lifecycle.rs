//! A sandbox's life: its init as PID 1, its filesystem layout, pause and
//! resume, deaths and their causes, delete.

use std::time::Duration;

use oci::{DeathCause, Error, InitEnd, Limits, Observation, Signal, Status};

use crate::support::{TestSandbox, eventually, prepare, process_alive};

#[tokio::test]
async fn init_is_pid_1_and_reaps_orphans() {
    let t = TestSandbox::start("pid1", Limits::default()).await;
    let state = t.sandbox.state().await.expect("state").expect("exists");
    assert_eq!(state.status, Status::Running);
    assert!(state.init_pid.is_some());

    let cmdline = t.sh_ok("tr '\\0' ' ' < /proc/1/cmdline").await;
    assert_eq!(cmdline.trim(), "/.roost/init --agent-fd 3");

    // The shell exits at once, orphaning the sleep: the kernel re-parents
    // it to PID 1, which must reap it when it ends.
    let orphan = t
        .sh_ok("sleep 0.4 >/dev/null 2>&1 & echo $!")
        .await
        .trim()
        .to_owned();
    let parent = t.sh_ok(&format!("grep PPid /proc/{orphan}/status")).await;
    assert_eq!(parent.split_whitespace().nth(1), Some("1"), "{parent}");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let after = t
        .sh(&format!(
            "cat /proc/{orphan}/stat 2>/dev/null || echo reaped"
        ))
        .await;
    assert_eq!(
        after.stdout.trim(),
        "reaped",
        "the orphan is still there (a zombie the init did not reap?)"
    );
}

#[tokio::test]
async fn workspace_is_home_and_persists_on_the_host() {
    let t = TestSandbox::start("workspace", Limits::default()).await;
    let out = t
        .sh_ok("echo \"$HOME\"; pwd; echo hello > notes.txt; mkdir -p src && echo x > src/a")
        .await;
    assert_eq!(out, "/workspace\n/workspace\n");
    assert_eq!(
        std::fs::read_to_string(t.workspace.join("notes.txt")).expect("file on the host"),
        "hello\n"
    );
    assert!(t.workspace.join("src/a").is_file());

    // And the other way: what the host puts there, the sandbox sees.
    std::fs::write(t.workspace.join("from-host"), "hi").expect("host write");
    assert_eq!(t.sh_ok("cat /workspace/from-host").await, "hi");
}

#[tokio::test]
async fn the_host_system_is_read_only_and_the_top_layer_is_the_sandboxs() {
    let t = TestSandbox::start("layout", Limits::default()).await;
    for path in ["/usr/roost-probe", "/etc/roost-probe", "/.roost/init"] {
        let ran = t.sh(&format!("echo x > {path}")).await;
        assert_ne!(
            ran.end.outcome,
            oci::Outcome::Exited { code: 0 },
            "{path} is writable"
        );
        assert!(
            ran.stderr.contains("Read-only file system"),
            "{path}: {}",
            ran.stderr
        );
    }
    // The host's tools work (the default image is the host's own system).
    t.sh_ok("ls /usr/bin >/dev/null && /bin/true").await;

    // A top-level write lands in the sandbox's own root directory on the
    // host, never in the host's /.
    t.sh_ok("mkdir -p /opt/tool && echo v1 > /opt/tool/version")
        .await;
    let on_host = t.config.paths.rootfs().join("opt/tool/version");
    assert_eq!(std::fs::read_to_string(on_host).expect("in rootfs"), "v1\n");
    assert!(!std::path::Path::new("/opt/tool/version").exists());

    // Host secrets are masked.
    let shadow = t.sh("cat /etc/shadow | wc -c").await;
    assert_eq!(shadow.stdout.trim(), "0", "{}", shadow.stderr);

    // tmpfs /tmp and /run, only loopback in the network namespace.
    let mounts = t.sh_ok("grep -E ' /(tmp|run) ' /proc/mounts").await;
    assert_eq!(mounts.lines().count(), 2, "{mounts}");
    assert!(
        mounts.lines().all(|l| l.split(' ').nth(2) == Some("tmpfs")),
        "{mounts}"
    );
    assert_eq!(t.sh_ok("ls /sys/class/net").await.trim(), "lo");
}

#[tokio::test]
async fn pause_and_resume() {
    let t = TestSandbox::start("pause", Limits::default()).await;
    t.sandbox.pause().await.expect("pause");
    assert_eq!(
        t.sandbox.state().await.expect("state").map(|s| s.status),
        Some(Status::Paused)
    );
    assert!(matches!(
        t.sandbox.observe().await.expect("observe"),
        Observation::Paused { .. }
    ));
    let refused = t
        .sandbox
        .exec(&oci::CommandSpec::new(["true"]))
        .await
        .expect_err("exec into a paused sandbox");
    assert!(
        matches!(
            refused,
            Error::NotRunning {
                status: Status::Paused,
                ..
            }
        ),
        "{refused}"
    );
    t.sandbox.resume().await.expect("resume");
    assert_eq!(
        t.sandbox.state().await.expect("state").map(|s| s.status),
        Some(Status::Running)
    );
    assert_eq!(t.sh_ok("echo back").await, "back\n");
}

#[tokio::test]
async fn killing_the_init_from_the_host_is_workload_exited() {
    let t = TestSandbox::start("oob", Limits::default()).await;
    let Observation::Running { init_pid } = t.sandbox.observe().await.expect("observe") else {
        panic!("not running");
    };
    let waiter = {
        let sandbox = t.sandbox.clone();
        tokio::spawn(async move { sandbox.wait_for_exit().await })
    };
    // Out of band: nothing in this crate is asked; the host kills PID 1.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(init_pid).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill the init");
    let cause = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the death is noticed")
        .expect("join")
        .expect("wait_for_exit");
    // SIGKILL leaves the init no word to say: no exit code is knowable.
    assert_eq!(cause, DeathCause::WorkloadExited { end: None });
    assert_eq!(cause.reason(), "workload_exited");
    assert_eq!(
        t.sandbox.observe().await.expect("observe"),
        Observation::Stopped(DeathCause::WorkloadExited { end: None })
    );
}

/// Waits (a minute at most) for the sandbox to end by its workload
/// exiting with `code`, as its init reported it.
async fn ends_with_code(t: &TestSandbox, code: i32) -> DeathCause {
    let cause = tokio::time::timeout(Duration::from_secs(60), t.sandbox.wait_for_exit())
        .await
        .expect("the sandbox ended")
        .expect("wait_for_exit");
    assert_eq!(
        cause,
        DeathCause::WorkloadExited {
            end: Some(InitEnd::WorkloadExited { code })
        }
    );
    cause
}

#[tokio::test]
async fn a_workload_that_ends_ends_the_sandbox_with_its_code() {
    let (dir, mut config) = prepare("workload", Limits::default());
    config.workload = vec!["sh".into(), "-c".into(), "sleep 0.3; exit 7".into()];
    let t = TestSandbox::start_config(dir, config).await;
    let cause = ends_with_code(&t, 7).await;
    assert_eq!(cause.exit_code(), Some(7));
}

/// Audit finding: a workload's output went straight to files on the
/// runner's disk (`init.status`, `init.log`), outside every bound of the
/// sandbox, and any process of the sandbox could write there through
/// `/proc/1/fd`. The init now keeps at most the latest
/// `WORKLOAD_LOG_BYTES_MAX` of it, and its descriptors are closed to the
/// sandbox.
#[tokio::test]
async fn a_workloads_output_takes_a_bounded_place_on_the_host() {
    use std::os::unix::fs::MetadataExt;
    let (dir, mut config) = prepare("chatty", Limits::default());
    let script = "head -c 24000000 /dev/zero; head -c 24000000 /dev/zero >&2; \
                  echo 'x' > /proc/1/fd/1 || echo 'proc closed' >&2; \
                  echo 'last words' >&2; exit 3";
    config.workload = vec!["sh".into(), "-c".into(), script.into()];
    let t = TestSandbox::start_config(dir, config).await;
    ends_with_code(&t, 3).await;
    let log = t.config.paths.init_log();
    let metadata = std::fs::metadata(&log).expect("the init log");
    assert!(metadata.len() >= 48_000_000, "{} bytes", metadata.len());
    let on_disk = metadata.blocks() * 512;
    assert!(
        on_disk <= oci::init::WORKLOAD_LOG_BYTES_MAX + (1 << 20),
        "{on_disk} bytes of output kept on the host"
    );
    let tail = oci::host::read_lossy(&log);
    assert!(tail.contains("proc closed"), "{tail:?}");
    assert!(tail.trim_end().ends_with("last words"), "{tail:?}");
    // The status file has the init's line alone: no output, no line
    // written in the init's name.
    let status = std::fs::read_to_string(t.config.paths.init_status()).expect("status");
    assert_eq!(status, "roost-init: workload exited code=3\n");
}

/// A workload that leaves a process printing without pause (its output
/// pipe never empty) still ends the sandbox when it exits: the init's
/// last copy of the output does not wait for the pipe to empty.
#[tokio::test]
async fn a_workload_that_leaves_a_printer_behind_still_ends_the_sandbox() {
    let (dir, mut config) = prepare("printer", Limits::default());
    config.workload = vec![
        "sh".into(),
        "-c".into(),
        "yes & yes >&2 & sleep 0.5; exit 4".into(),
    ];
    let t = TestSandbox::start_config(dir, config).await;
    ends_with_code(&t, 4).await;
}

#[tokio::test]
async fn stop_forwards_sigterm_to_the_workload() {
    let (dir, mut config) = prepare("stopwl", Limits::default());
    // A workload that would sleep for long: SIGTERM, forwarded by the
    // init, ends it (the init is PID 1 and the workload is not, so the
    // default action applies).
    config.workload = vec!["sleep".into(), "300".into()];
    let t = TestSandbox::start_config(dir, config).await;
    let started = std::time::Instant::now();
    let cause = t.sandbox.stop(Duration::from_secs(20)).await.expect("stop");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took the SIGKILL path"
    );
    assert_eq!(
        cause,
        DeathCause::WorkloadExited {
            end: Some(InitEnd::WorkloadKilled { signal: 15 })
        }
    );
}

#[tokio::test]
async fn stop_of_an_idle_sandbox_is_clean_and_delete_cleans_up() {
    let t = TestSandbox::start("delete", Limits::default()).await;
    let cause = t.sandbox.stop(Duration::from_secs(10)).await.expect("stop");
    assert_eq!(
        cause,
        DeathCause::WorkloadExited {
            end: Some(InitEnd::Stopped {
                signal: Signal::Term.number()
            })
        }
    );
    let cgroup_dirs = t.runtime.cgroups().all_dirs(t.sandbox.cgroups_path());
    assert!(
        cgroup_dirs.iter().any(|d| d.exists()),
        "a stopped container keeps its cgroups until delete: {cgroup_dirs:?}"
    );

    t.sandbox.delete().await.expect("delete");
    assert_eq!(t.sandbox.state().await.expect("state"), None);
    assert_eq!(
        t.sandbox.observe().await.expect("observe"),
        Observation::Missing
    );
    assert!(!t.state_root().join(t.config.id.as_str()).exists());
    assert!(!t.config.paths.bundle().exists());
    for dir in &cgroup_dirs {
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
    assert!(
        !t.runtime
            .container_ids()
            .expect("list")
            .contains(&t.config.id.to_string())
    );
    // The sandbox's own layer and its workspace are storage: kept.
    assert!(t.config.paths.rootfs().is_dir());
    assert!(t.workspace.is_dir());
    // Delete is idempotent; remove_files takes the layer too.
    t.sandbox.delete().await.expect("second delete");
    t.sandbox.remove_files().await.expect("remove files");
    assert!(!t.config.paths.dir().exists());
    assert!(t.workspace.is_dir());
}

#[tokio::test]
async fn delete_of_a_running_sandbox_kills_it() {
    let t = TestSandbox::start("delrun", Limits::default()).await;
    let Some(pid) = t
        .sandbox
        .state()
        .await
        .expect("state")
        .and_then(|s| s.init_pid)
    else {
        panic!("no init pid");
    };
    t.sandbox.delete().await.expect("delete");
    let gone = eventually(Duration::from_secs(5), || !process_alive(pid)).await;
    assert!(gone, "the init survived delete");
    assert_eq!(t.sandbox.state().await.expect("state"), None);
}

#[tokio::test]
async fn a_restarted_sandbox_keeps_its_layer_and_workspace_but_not_tmp() {
    let t = TestSandbox::start("restart", Limits::default()).await;
    t.sh_ok("echo kept > /opt-state; echo kept > /workspace/w; echo gone > /tmp/t")
        .await;
    let twice = t
        .runtime
        .create(&t.config)
        .await
        .expect_err("a second create of a live sandbox");
    assert!(matches!(twice, Error::AlreadyExists { .. }), "{twice}");
    assert_eq!(
        t.sh_ok("cat /opt-state").await,
        "kept\n",
        "the live one was disturbed"
    );

    t.sandbox.stop(Duration::from_secs(10)).await.expect("stop");
    t.sandbox.delete().await.expect("delete");
    let again = t.runtime.launch(&t.config).await.expect("relaunch");
    assert!(matches!(
        again.observe().await.expect("observe"),
        Observation::Running { .. }
    ));
    let out = t
        .sh_ok("cat /opt-state /workspace/w; cat /tmp/t 2>/dev/null || echo no-tmp")
        .await;
    assert_eq!(out, "kept\nkept\nno-tmp\n");
}
