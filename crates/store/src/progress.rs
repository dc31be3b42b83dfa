//! Progress reporting hooks for long pushes and pulls. The engine calls
//! them; the command line draws bars; everything else ignores them.

pub trait Progress: Sync {
    /// A new phase begins; `total_bytes` when it is known up front.
    fn phase(&self, _name: &'static str, _total_bytes: Option<u64>) {}
    /// Bytes of work done in the current phase.
    fn advance(&self, _bytes: u64) {}
}

pub struct NoProgress;

impl Progress for NoProgress {}
