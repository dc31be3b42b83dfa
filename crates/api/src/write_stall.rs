//! A connection that gives up on a peer that takes nothing.
//!
//! An HTTP server writes an answer only as fast as its peer reads it. A
//! peer that stops reading (a client gone quiet mid-download, with its
//! connection still open) leaves the write pending for as long as the
//! connection lives, and with it whatever the answer holds: a runner's
//! place among the streams it serves, an org's share of a server. hyper
//! has no write timeout, so both HTTP servers (the control plane's and a
//! runner's data listener) wrap each accepted connection in
//! [`WriteStall`]: a write that makes no progress for its limit fails with
//! `TimedOut`, which ends the connection and drops the answer.
//!
//! Only a pending write counts: a connection waiting for its next request,
//! or an answer not yet ready (a long-poll), is never timed here.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How long a peer may take nothing of an answer before its connection is
/// ended: longer than any client's pause that is not a stop (a laptop's
/// network handing over), short enough that what the answer holds comes
/// back within minutes.
pub const WRITE_STALL: Duration = Duration::from_secs(120);

/// `io`, whose writes fail once one has made no progress for `limit`.
pub struct WriteStall<IO> {
    io: IO,
    limit: Duration,
    /// Started when a write first found the peer taking nothing; cleared
    /// by any progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<IO> WriteStall<IO> {
    pub fn new(io: IO, limit: Duration) -> WriteStall<IO> {
        WriteStall {
            io,
            limit,
            stalled: None,
        }
    }

    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    /// `poll`'s answer, or `TimedOut` once pending answers have lasted
    /// `limit` with no progress in between.
    fn timed<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let limit = self.limit;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the peer took nothing for {} s", limit.as_secs()),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for WriteStall<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for WriteStall<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write(cx, buf);
        self.timed(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.timed(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_flush(cx);
        self.timed(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_shutdown(cx);
        self.timed(cx, poll)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Two ends of a loopback TCP connection.
    async fn connected() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let (dialed, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(address), listener.accept());
        (dialed.expect("connect"), accepted.expect("accept").0)
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_takes_nothing_fails_the_write_and_one_that_reads_does_not() {
        let (quiet, server) = connected().await;
        let mut writing = WriteStall::new(server, Duration::from_secs(30));
        let chunk = vec![7u8; 1 << 20];
        let started = tokio::time::Instant::now();
        let mut sent = 0usize;
        let err = loop {
            match writing.write(&chunk).await {
                Ok(n) => sent += n,
                Err(err) => break err,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(sent > 0, "the kernel's buffers took some first");
        assert!(started.elapsed() >= Duration::from_secs(30));
        drop(quiet);

        // A reader that keeps taking, a pause between its bursts, never
        // trips it.
        let (mut reader, server) = connected().await;
        let mut writing = WriteStall::new(server, Duration::from_secs(30));
        let drain = tokio::spawn(async move {
            let mut buffer = vec![0u8; 64 << 10];
            let mut total = 0usize;
            loop {
                tokio::time::sleep(Duration::from_secs(10)).await;
                let mut burst = 0usize;
                while burst < 2 << 20 {
                    match reader.read(&mut buffer).await {
                        Ok(0) | Err(_) => return total,
                        Ok(n) => {
                            burst += n;
                            total += n;
                        }
                    }
                }
            }
        });
        // More than loopback's buffers hold, so the writes wait on it.
        for _ in 0..64 {
            writing.write_all(&chunk[..256 << 10]).await.expect("taken");
        }
        writing.shutdown().await.expect("shut down");
        drop(writing);
        assert_eq!(drain.await.expect("drained"), 64 * (256 << 10));
    }
}
