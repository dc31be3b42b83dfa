//! One org's share of what a server serves at once. A request holds a
//! connection (and, streaming, a relay to a runner) for as long as it
//! lasts: a long-poll up to 25 s, a download or an upload as long as its
//! client reads or writes, an attached terminal for days. Without a share,
//! one org's token could hold every connection the server serves at once
//! (`Config::connections_max`) and every other org would wait. Each org
//! holds at most [`crate::Config::org_requests_max`] requests at once on a
//! server; past it, 429 `quota_exceeded` (metric `requests_at_once`).
//! `http::org_share::hold` takes the places.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::ControlError;
use api::ErrorCode;

/// How many requests each org has under way on this server.
pub struct OrgRequests {
    max: usize,
    counts: Mutex<HashMap<String, usize>>,
}

/// One request's place in its org's share, given back when dropped.
pub struct OrgPlace {
    requests: Arc<OrgRequests>,
    org_id: String,
}

impl OrgRequests {
    pub fn new(max: usize) -> OrgRequests {
        OrgRequests {
            max,
            counts: Mutex::default(),
        }
    }

    /// A place for one more of `org_id`'s requests, or the refusal.
    pub fn take(self: &Arc<Self>, org_id: &str) -> Result<OrgPlace, ControlError> {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(org_id.to_owned()).or_insert(0);
        if *count >= self.max {
            let current = *count as i64;
            return Err(ControlError::new(
                ErrorCode::QuotaExceeded,
                format!(
                    "quota requests_at_once reached ({current} of {}): this org's requests under way on this server",
                    self.max
                ),
            )
            .with_details(serde_json::json!({
                "quota": { "metric": "requests_at_once", "limit": self.max, "current": current }
            }))
            .with_retry_after(1));
        }
        *count += 1;
        Ok(OrgPlace {
            requests: self.clone(),
            org_id: org_id.to_owned(),
        })
    }

    /// What `org_id` has under way now.
    pub fn under_way(&self, org_id: &str) -> usize {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts.get(org_id).copied().unwrap_or(0)
    }
}

impl Drop for OrgPlace {
    fn drop(&mut self) {
        let mut counts = self
            .requests
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(count) = counts.get_mut(&self.org_id) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.org_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_org_holds_at_most_its_share_and_gets_it_back() {
        let requests = Arc::new(OrgRequests::new(3));
        let mut held: Vec<OrgPlace> = (0..3)
            .map(|_| requests.take("greedy").expect("a place"))
            .collect();
        let refused = requests.take("greedy").err().expect("refused");
        assert_eq!(refused.code, ErrorCode::QuotaExceeded);
        assert!(
            refused.message.contains("requests_at_once"),
            "{}",
            refused.message
        );
        let other = requests.take("other").expect("another org is served");
        held.pop();
        held.push(requests.take("greedy").expect("a place given back"));
        drop(held);
        drop(other);
        assert_eq!(requests.under_way("greedy"), 0);
        assert!(requests.counts.lock().expect("counts").is_empty());
    }
}
