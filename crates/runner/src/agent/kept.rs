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

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use api::runners::{KeptAssignment, KeptCopyReport};

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

/// After an assignments answer: reports every kept copy on disk that the
/// answer does not list (new ones, and ones the server let go), one sync
/// at a time.
pub(crate) fn sync(shared: &Arc<Shared>, listed: &[KeptAssignment], running: &Arc<AtomicBool>) {
    if running.swap(true, Ordering::AcqRel) {
        return;
    }
    let listed: HashSet<(String, String)> = listed
        .iter()
        .map(|copy| (copy.sandbox_id.clone(), copy.name.clone()))
        .collect();
    let (shared, running) = (shared.clone(), running.clone());
    tokio::spawn(async move {
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
