//! Kept copies of homes (DESIGN.md §7, "never destroy the newest copy").
//! A home this runner no longer has assigned (it was fenced or lost and
//! came back, or the sandbox moved elsewhere) is not deleted: it is set
//! aside, read-only and never mounted (`Homes::keep_aside`), and reported
//! to the server, which lists it on the sandbox's record and says whether
//! to keep it. The copy is deleted only when the server says it may go:
//! its sandbox was deleted, its org or an admin discarded it, it expired
//! after the retention window, or it only duplicated the last completed
//! save and a new placement runs from the store.
//!
//! Level-triggered like everything else: each assignments answer lists the
//! copies still kept here; a copy on disk that is not listed is reported
//! (again), and the answer decides.
//!
//! A listed copy may carry salvages (snapshots its org asked to be made of
//! it): the copy is uploaded through the block service, as it is, and each
//! salvage reported `replicated` with the root (the server checks the tree
//! and pins it) or `failed` with why. The copy stays either way; it goes
//! only as above.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use api::runners::{KeptAssignment, KeptCopyReport, SnapshotReport};

use super::{Refusal, Shared, refusal};

/// Reports the kept copy `name` of sandbox `id` and deletes it if the
/// server says it may go. Transient failures are left to the next sync.
pub(crate) async fn report(shared: &Arc<Shared>, id: &str, name: &str) {
    let facts = {
        let (id, name, shared) = (id.to_owned(), name.to_owned(), shared.clone());
        tokio::task::spawn_blocking(move || shared.homes.kept_facts(&id, &name)).await
    };
    let facts = match facts {
        Ok(Ok(facts)) => facts,
        Ok(Err(err)) => {
            tracing::warn!(sandbox_id = %id, copy = %name, %err, "cannot read a kept copy; it stays");
            return;
        }
        Err(join) => {
            tracing::warn!(sandbox_id = %id, copy = %name, %join, "cannot read a kept copy; it stays");
            return;
        }
    };
    let request = KeptCopyReport {
        runner_id: shared.runner_id(),
        sandbox_id: id.to_owned(),
        name: name.to_owned(),
        bytes: facts.bytes,
        kept_at_ms: facts.kept_at_ms,
        secured_root: facts.secured_root,
    };
    let answer = match shared.control.runner_report_kept(&request).await {
        Ok(answer) => answer,
        Err(err) => {
            match refusal(err) {
                Ok(transient) => {
                    tracing::debug!(sandbox_id = %id, %transient, "kept copy not reported yet")
                }
                Err(Refusal::Fenced(message)) => {
                    tracing::debug!(sandbox_id = %id, %message, "kept copy not reported: not live")
                }
                Err(Refusal::Refused(err)) => {
                    tracing::warn!(sandbox_id = %id, %err, "the server refused a kept copy's report; it stays")
                }
            }
            return;
        }
    };
    if answer.keep {
        tracing::warn!(sandbox_id = %id, copy = %name, copy_id = ?answer.copy_id, bytes = facts.bytes, reason = %answer.reason, "home kept aside: it may be the newest copy of the work");
        return;
    }
    let discarded = {
        let (id, name, shared) = (id.to_owned(), name.to_owned(), shared.clone());
        tokio::task::spawn_blocking(move || shared.homes.discard_kept(&id, &name)).await
    };
    match discarded {
        Ok(Ok(())) => {
            tracing::info!(sandbox_id = %id, copy = %name, reason = %answer.reason, "kept copy deleted")
        }
        Ok(Err(err)) => {
            tracing::warn!(sandbox_id = %id, copy = %name, %err, "cannot delete a kept copy; tried again later")
        }
        Err(join) => {
            tracing::warn!(sandbox_id = %id, copy = %name, %join, "cannot delete a kept copy; tried again later")
        }
    }
}

/// Uploads the kept copy for its salvages and reports each: `replicated`
/// with the root, or `failed` with one line saying why. A report that
/// does not reach the server is left to the next sync (the copy is still
/// listed with the salvage until the server has it).
pub(crate) async fn salvage(shared: &Arc<Shared>, copy: &KeptAssignment) {
    if copy.salvage.is_empty() {
        return;
    }
    let (id, name) = (copy.sandbox_id.as_str(), copy.name.as_str());
    let uploaded = shared
        .homes
        .upload_kept(&shared.control, &copy.org_id, id, name)
        .await;
    let (durability, root, files, message) = match uploaded {
        Ok(report) => match report.root {
            Some(root) => ("replicated", Some(root.to_hex()), Some(report.files), None),
            None => (
                "failed",
                None,
                None,
                Some("the upload gave no root".to_owned()),
            ),
        },
        Err(err) => {
            // One line: the record's reason shows it as it is.
            let message = err.to_string().replace(['\n', '\r'], " ");
            ("failed", None, None, Some(message))
        }
    };
    for snapshot_id in &copy.salvage {
        let report = SnapshotReport {
            runner_id: shared.runner_id(),
            // No placement: the server checks this runner holds the copy.
            epoch: 0,
            durability: durability.to_owned(),
            root: root.clone(),
            files,
            captured_at_ms: None,
            message: message.clone(),
        };
        match shared
            .control
            .runner_report_snapshot(snapshot_id, &report)
            .await
        {
            Ok(_) => {
                tracing::info!(sandbox_id = %id, copy = %name, %snapshot_id, durability, root = ?root, message = ?message, "kept copy salvaged")
            }
            Err(err) => match refusal(err) {
                Ok(transient) => {
                    tracing::debug!(sandbox_id = %id, %snapshot_id, %transient, "salvage not reported yet")
                }
                Err(Refusal::Fenced(message)) => {
                    tracing::warn!(sandbox_id = %id, %snapshot_id, %message, "the server refused a salvage's report")
                }
                Err(Refusal::Refused(err)) => {
                    tracing::warn!(sandbox_id = %id, %snapshot_id, %err, "the server refused a salvage's report")
                }
            },
        }
    }
}

/// After an assignments answer: uploads the copies listed with salvages,
/// and reports every kept copy on disk that the answer does not list (new
/// ones, and ones the server let go), one sync at a time.
pub(crate) fn sync(shared: &Arc<Shared>, listed: &[KeptAssignment], running: &Arc<AtomicBool>) {
    if running.swap(true, Ordering::AcqRel) {
        return;
    }
    let salvages: Vec<KeptAssignment> = listed
        .iter()
        .filter(|copy| !copy.salvage.is_empty())
        .cloned()
        .collect();
    let listed: HashSet<(String, String)> = listed
        .iter()
        .map(|copy| (copy.sandbox_id.clone(), copy.name.clone()))
        .collect();
    let (shared, running) = (shared.clone(), running.clone());
    tokio::spawn(async move {
        for copy in &salvages {
            salvage(&shared, copy).await;
        }
        match shared.homes.kept_copies() {
            Ok(copies) => {
                for (id, name) in copies {
                    if !listed.contains(&(id.clone(), name.clone())) {
                        report(&shared, &id, &name).await;
                    }
                }
            }
            Err(err) => tracing::warn!(%err, "cannot list kept copies"),
        }
        running.store(false, Ordering::Release);
    });
}
