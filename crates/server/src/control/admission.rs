//! Admission: a create request checked against every bound, refused
//! (`unsupported_capability`, naming what is missing) unless the
//! deployment and its runners can enforce it exactly, counted against the
//! org's quotas and the fleet's ceiling under one lock, then written and
//! placed.

use api::ErrorCode;
use api::lifecycle::{DesiredState, Network, Placement, SandboxState, StorageClass};
use api::sandboxes::CreateSandboxRequest;
use sqlx::Row;

use super::AppState;
use crate::db::{WriteTx, now_ms};
use crate::error::ControlError;
use crate::limits;
use crate::records::{self, SandboxRow};
use crate::scheduler::{self, Needs, Placed};

/// Defaults written into the record, so it shows the limits enforced.
const DEFAULT_MEMORY_MIB: u64 = 512;
const DEFAULT_CPUS: f64 = 1.0;
const DEFAULT_PIDS: u64 = 1024;

fn unsupported(missing: Vec<String>, message: impl Into<String>) -> ControlError {
    ControlError::new(ErrorCode::UnsupportedCapability, message)
        .with_details(serde_json::json!({ "missing": missing }))
}

/// The create request with defaults applied and every bound checked.
pub fn validate(request: &mut CreateSandboxRequest) -> Result<(), ControlError> {
    limits::name("image", &request.image)?;
    limits::env("env", &request.env)?;
    limits::labels(&request.labels)?;
    let resources = &mut request.resources;
    let memory = *resources.memory_mib.get_or_insert(DEFAULT_MEMORY_MIB);
    let cpus = *resources.cpus.get_or_insert(DEFAULT_CPUS);
    let pids = *resources.pids.get_or_insert(DEFAULT_PIDS);
    // The runtime's minimums (`api::sandboxes::*_MIN`): a sandbox below
    // them would be admitted only to fail at launch.
    use api::sandboxes::{CPUS_MIN, MEMORY_MIB_MIN, PIDS_MIN};
    if !(MEMORY_MIB_MIN..=1 << 30).contains(&memory) {
        return Err(limits::invalid(
            "resources.memory_mib",
            format!("between {MEMORY_MIB_MIN} and {} (1 PiB)", 1u64 << 30),
        ));
    }
    if !(cpus.is_finite() && (CPUS_MIN..=4096.0).contains(&cpus)) {
        return Err(limits::invalid(
            "resources.cpus",
            format!("must be between {CPUS_MIN} and 4096"),
        ));
    }
    if !(PIDS_MIN..=1 << 22).contains(&pids) {
        return Err(limits::invalid(
            "resources.pids",
            format!("between {PIDS_MIN} and {}", 1u64 << 22),
        ));
    }
    use api::sandboxes::{HOME_MIB_MAX, HOME_MIB_MIN};
    if let Some(home) = resources.home_mib
        && !(HOME_MIB_MIN..=HOME_MIB_MAX).contains(&home)
    {
        return Err(limits::invalid(
            "resources.home_mib",
            format!("between {HOME_MIB_MIN} and {HOME_MIB_MAX} (16 TiB)"),
        ));
    }
    if let Some(ttl) = request.ttl
        && (ttl == 0 || ttl > limits::TTL_SECONDS_MAX)
    {
        return Err(limits::invalid(
            "ttl",
            format!("seconds, between 1 and {}", limits::TTL_SECONDS_MAX),
        ));
    }
    mounts(&request.mounts)
}

/// Most shared mounts one sandbox may ask for.
pub const MOUNTS_MAX: usize = 16;
/// Where a shared filesystem may appear: this, or below [`MOUNT_ROOT`].
pub const WORKSPACE_PATH: &str = "/workspace";
pub const MOUNT_ROOT: &str = "/mnt/";

/// The shape of each shared mount: a filesystem id, a relative subpath
/// without `..`, a normalised path at `/workspace` or below `/mnt`, no
/// path twice or inside another.
fn mounts(mounts: &[api::sandboxes::Mount]) -> Result<(), ControlError> {
    if mounts.len() > MOUNTS_MAX {
        return Err(limits::invalid(
            "mounts",
            format!("at most {MOUNTS_MAX} mounts"),
        ));
    }
    for mount in mounts {
        if !filesystem_id_ok(&mount.filesystem) {
            return Err(limits::invalid(
                "mounts.filesystem",
                "use 1-64 of a-z 0-9 - _, starting with a letter or digit",
            ));
        }
        let subpath = &mount.subpath;
        if subpath.starts_with('/')
            || subpath.contains('\0')
            || subpath.len() > limits::PATH_BYTES_MAX
            || subpath.split('/').any(|c| c == "..")
        {
            return Err(limits::invalid(
                "mounts.subpath",
                format!("{subpath:?}: a directory relative to the filesystem's root, without `..`"),
            ));
        }
        let path = &mount.path;
        let below_mnt = path.strip_prefix(MOUNT_ROOT).is_some_and(|rest| {
            rest.split('/')
                .all(|c| !c.is_empty() && c != "." && c != "..")
        });
        if !(path == WORKSPACE_PATH || below_mnt)
            || path.contains('\0')
            || path.len() > limits::PATH_BYTES_MAX
        {
            return Err(limits::invalid(
                "mounts.path",
                format!("{path:?}: use /workspace or a normalised path below /mnt"),
            ));
        }
    }
    for (i, a) in mounts.iter().enumerate() {
        for b in &mounts[i + 1..] {
            let inside = |outer: &str, inner: &str| {
                inner == outer || inner.starts_with(&format!("{outer}/"))
            };
            if inside(&a.path, &b.path) || inside(&b.path, &a.path) {
                return Err(limits::invalid(
                    "mounts.path",
                    format!("{:?} and {:?} overlap", a.path, b.path),
                ));
            }
        }
    }
    Ok(())
}

/// A filesystem id: as an org name is written (`roost runner
/// --filesystem ID=…` checks the same).
pub fn filesystem_id_ok(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'_')
        && id.as_bytes()[0].is_ascii_alphanumeric()
}

/// A durable sandbox's save interval: the request's, within the
/// deployment's bounds, or the deployment's default. Others have none.
fn save_interval(
    state: &AppState,
    request: &CreateSandboxRequest,
) -> Result<Option<i64>, ControlError> {
    let config = &state.config;
    if request.storage_class != StorageClass::Durable.as_str() {
        if request.save_interval_s.is_some() {
            return Err(limits::invalid(
                "save_interval_s",
                "only durable sandboxes are saved on a schedule",
            ));
        }
        return Ok(None);
    }
    let (min, max) = (
        config.save_interval_min.as_secs(),
        config.save_interval_max.as_secs(),
    );
    let interval = request
        .save_interval_s
        .unwrap_or_else(|| config.save_interval.as_secs());
    if !(min..=max).contains(&interval) {
        return Err(limits::invalid(
            "save_interval_s",
            format!("seconds, between {min} and {max} in this deployment"),
        ));
    }
    Ok(Some(interval as i64))
}

/// The request's storage class, network and placement, or what no runner
/// of any deployment offers (refused as unsupported, naming it).
fn classes(
    request: &CreateSandboxRequest,
) -> Result<(StorageClass, Network, Placement), ControlError> {
    let storage_class = request.storage_class.parse().map_err(|_| {
        unsupported(
            vec![format!("storage_class:{}", request.storage_class)],
            format!("unknown storage class {:?}", request.storage_class),
        )
    })?;
    let network = request.network.parse().map_err(|_| {
        let missing = format!("network:{}", request.network);
        unsupported(
            vec![missing.clone()],
            format!("no registered runner offers {missing}"),
        )
    })?;
    let placement = request.placement.parse().map_err(|_| {
        unsupported(
            vec![format!("placement:{}", request.placement)],
            format!("unknown placement {:?}", request.placement),
        )
    })?;
    Ok((storage_class, network, placement))
}

/// Fail-closed admission: everything the deployment or its runners cannot
/// enforce exactly is refused, naming what is missing.
async fn check_admissible(
    state: &AppState,
    tx: &mut WriteTx,
    sandbox: &mut SandboxRow,
    request: &CreateSandboxRequest,
) -> Result<(), ControlError> {
    if sandbox.image != "default" {
        let root = records::images::root_of(tx, &sandbox.org_id, &sandbox.image).await?;
        match root {
            Some(root) if state.store.is_some() => sandbox.image_root = Some(root),
            _ => {
                return Err(unsupported(
                    vec![format!("image:{}", sandbox.image)],
                    format!(
                        "no image {:?} in this org (import one with `roost image import`)",
                        sandbox.image
                    ),
                ));
            }
        }
    }
    if sandbox.storage_class == StorageClass::Durable && state.config.store_url.is_none() {
        return Err(unsupported(
            vec!["storage_class:durable".to_owned()],
            "durable storage needs a home store, and this deployment has none (--store)",
        ));
    }
    // Each shared filesystem must be bound to the org; the binding may
    // force it read-only. Runners offering it are checked with the rest of
    // the sandbox's needs below (`filesystem:ID`).
    let mut mounts = Vec::with_capacity(request.mounts.len());
    for mount in &request.mounts {
        let binding = records::filesystems::binding(tx, &mount.filesystem, &sandbox.org_id).await?;
        let Some(binding) = binding else {
            return Err(unsupported(
                vec![format!("filesystem:{}", mount.filesystem)],
                format!(
                    "filesystem {:?} is not bound to this org (`roost admin filesystem bind`)",
                    mount.filesystem
                ),
            )
            .with_details(serde_json::json!({
                "missing": [format!("filesystem:{}", mount.filesystem)],
                "bound": false,
            })));
        };
        let mut mount = mount.clone();
        mount.read_only |= binding.read_only;
        mounts.push(mount);
    }
    sandbox.mounts = serde_json::to_string(&mounts).unwrap_or_else(|_| "[]".to_owned());
    super::secrets::check_request(state, tx, &sandbox.org_id, &request.secrets).await?;
    let needs = Needs::of(sandbox);
    // The runners as lately read; a refusal is checked against a read now.
    let mut best = None;
    for max_age in [scheduler::RUNNER_VIEW_TTL, std::time::Duration::ZERO] {
        let view = scheduler::RunnerView::read(tx, max_age).await?;
        best = view.missing(&needs);
        if best.as_ref().is_some_and(Vec::is_empty) {
            break;
        }
    }
    match best {
        None => Err(unsupported(
            vec!["runner".to_owned()],
            "no runner is registered, so nothing would run this sandbox",
        )),
        Some(missing) if !missing.is_empty() => Err(unsupported(
            missing.clone(),
            format!("no registered runner offers {}", missing.join(", ")),
        )),
        Some(_) => Ok(()),
    }
}

pub(crate) fn quota_exceeded(
    metric: &str,
    limit: i64,
    current: i64,
    retry_after_s: u64,
) -> ControlError {
    ControlError::new(
        ErrorCode::QuotaExceeded,
        format!("quota {metric} reached ({current} of {limit})"),
    )
    .with_details(serde_json::json!({
        "quota": { "metric": metric, "limit": limit, "current": current }
    }))
    .with_retry_after(retry_after_s)
}

/// Checks the org's quotas and the fleet ceiling for one more running
/// sandbox: a start (`created` is `None`), or the create of `created`,
/// already written in `tx` (also one more held; its own pending counts are
/// not held against it). Where any limit applies, it first takes the
/// admission lock (one row, updated): creates and starts on every server
/// then count one at a time, so no limit can be raced past. With no limit
/// set, nothing is locked or counted.
pub async fn check_quotas(
    state: &AppState,
    tx: &mut WriteTx,
    org_id: &str,
    created: Option<&SandboxRow>,
) -> Result<(), ControlError> {
    let new = created.is_some();
    let org = sqlx::query("SELECT max_running, max_total FROM orgs WHERE id = $1")
        .bind(org_id)
        .fetch_one(&mut *tx.tx)
        .await?;
    let max_running: Option<i64> = org.try_get("max_running")?;
    let max_total: Option<i64> = org.try_get("max_total")?;
    if max_running.is_none() && max_total.is_none() && state.config.fleet_max_running.is_none() {
        // Nothing to count against: no lock, no counting.
        return Ok(());
    }
    tx.take_turn("admission").await;
    sqlx::query("UPDATE admission SET creates = creates + 1 WHERE id = 1")
        .execute(&mut *tx.tx)
        .await?;
    // Kept counts (`records::counts`): a few rows, however many sandboxes.
    let (mut running, mut total) = records::counts::quota(tx, &format!("org:{org_id}")).await?;
    let (mut fleet, _) = records::counts::quota(tx, "fleet").await?;
    if let Some(created) = created {
        let own = records::counts::Counted::of(created);
        running -= i64::from(own.running());
        fleet -= i64::from(own.running());
        total -= i64::from(own.held());
    }
    if let Some(limit) = max_total.filter(|&limit| new && total >= limit) {
        state.metrics.quota_rejected("sandboxes.total");
        return Err(quota_exceeded("sandboxes.total", limit, total, 60));
    }
    if let Some(limit) = max_running.filter(|&limit| running >= limit) {
        state.metrics.quota_rejected("sandboxes.running");
        return Err(quota_exceeded("sandboxes.running", limit, running, 30));
    }
    if let Some(limit) = state.config.fleet_max_running {
        let limit = limit as i64;
        if fleet >= limit {
            state.metrics.quota_rejected("fleet.sandboxes.running");
            return Err(quota_exceeded("fleet.sandboxes.running", limit, fleet, 30));
        }
    }
    Ok(())
}

/// The record a create request asks for, with defaults applied and every
/// bound checked; nothing is written yet.
pub fn prepare(
    state: &AppState,
    org_id: &str,
    request: &mut CreateSandboxRequest,
) -> Result<SandboxRow, ControlError> {
    validate(request)?;
    let (storage_class, network, placement) = classes(request)?;
    let now = now_ms();
    let id = records::new_id("sbx")?;
    let env = serde_json::to_string(&request.env).unwrap_or_default();
    let labels = serde_json::to_string(&request.labels).unwrap_or_default();
    let resources = &request.resources;
    let mut row = SandboxRow {
        id: id.clone(),
        org_id: org_id.to_owned(),
        image: request.image.clone(),
        image_root: None,
        storage_class,
        memory_mib: resources.memory_mib.map(|v| v as i64),
        millicpus: resources.cpus.map(|v| (v * 1000.0).round() as i64),
        pids: resources.pids.map(|v| v as i64),
        home_mib: resources.home_mib.map(|v| v as i64),
        network,
        placement,
        env,
        labels,
        state: SandboxState::Pending,
        state_reason: Some("admitted".to_owned()),
        state_message: None,
        desired: DesiredState::Running,
        runner_id: None,
        last_runner_id: None,
        epoch: 0,
        quarantined: false,
        created_at_ms: now,
        updated_at_ms: now,
        expires_at_ms: request.ttl.map(|ttl| now + ttl as i64 * 1000),
        ended_at_ms: None,
        home: records::HomeColumns::default(),
        kept_copies: None,
        mounts: "[]".to_owned(),
        idle: records::sandboxes::IdleColumns {
            timeout_s: super::idle::timeout_s(state, request.idle_timeout_s)?,
            auto_wake: request.auto_wake.unwrap_or(true),
            last_activity_at_ms: Some(now),
            last_activity: Some(api::lifecycle::Activity::Created.as_str().to_owned()),
            deadline_ms: None,
        },
        desired_reason: None,
        desired_message: None,
        start_after_stop: false,
    };

    row.home.save_interval_s = save_interval(state, request)?;
    Ok(row)
}

/// Admits the prepared sandbox in `tx`: its snapshot and image resolved,
/// what no runner offers refused, quotas counted; then written, placed (or
/// recorded as waiting), and a child of a snapshot given its home.
pub async fn admit(
    state: &AppState,
    tx: &mut WriteTx,
    row: &mut SandboxRow,
    request: &CreateSandboxRequest,
) -> Result<(), ControlError> {
    let id = row.id.clone();
    let org_id = row.org_id.clone();
    // A create locks nothing another transaction waits for before it
    // takes the admission row or its runner's: it may wait in line for
    // them (`WriteTx::take_turn`).
    tx.allow_turn();
    if let Some(snapshot_id) = &request.from_snapshot {
        let root = super::snapshots::replicated_root(tx, &org_id, snapshot_id).await?;
        row.home.root = Some(root);
        row.home.from_snapshot = Some(snapshot_id.clone());
    }
    check_admissible(state, tx, row, request).await?;
    // Written before the quotas are counted: the admission lock is then
    // held for as little as can be (`check_quotas`); a refusal rolls the
    // rows back with the transaction.
    records::sandboxes::insert(tx, row, &request.labels).await?;
    records::secrets::insert_for_sandbox(tx, &row.id, &request.secrets).await?;
    check_quotas(state, tx, &org_id, Some(row)).await?;
    let placed = scheduler::place(tx, row).await?;
    if let Placed::Waiting(reason) = placed {
        records::sandboxes::set_waiting_reason(tx, row, reason).await?;
    }
    if let Some(root) = &row.home.root {
        // The child's home starts as the snapshot: pinned under the
        // child's own name, so deleting the snapshot cannot take it. (The
        // snapshot's own pin was checked complete when it was replicated.)
        let digest: store::Digest = root
            .parse()
            .map_err(|_| ControlError::new(ErrorCode::Internal, "internal error"))?;
        let (home, _) = crate::control::home_store::home_names(&id)?;
        let org = crate::control::home_store::store_org(&org_id)?;
        let store = crate::control::home_store::store_of(state)?;
        crate::control::home_store::blocking(move || store.write_home(&org, &home, &digest))
            .await?
            .map_err(crate::control::home_store::store_error)?;
    }
    Ok(())
}
