//! A command's terminal: the pseudo-terminal pair the agent opens for a
//! command that asks for one (`tty: {rows, cols}`). The command gets the
//! slave as its stdin, stdout and stderr and as its controlling terminal
//! (in a session of its own); the agent reads its output from the master
//! and writes its input there, and resizes it on request.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use tokio::io::unix::AsyncFd;

/// The largest number of rows or columns a terminal may have.
pub const SIZE_MAX: u16 = 4096;

/// Checks a terminal size: 1 to [`SIZE_MAX`] rows and columns.
pub fn check_size(rows: u64, cols: u64) -> Result<(u16, u16), String> {
    let fits = |n: u64| (1..=u64::from(SIZE_MAX)).contains(&n);
    if fits(rows) && fits(cols) {
        Ok((rows as u16, cols as u16))
    } else {
        Err(format!(
            "a terminal is 1 to {SIZE_MAX} rows and columns, not {rows}x{cols}"
        ))
    }
}

/// The master side, non-blocking, for the agent's event loop.
#[derive(Debug)]
pub struct Master {
    fd: AsyncFd<OwnedFd>,
}

/// A new pair: the master, and the slave opened for the command.
pub fn open(rows: u16, cols: u16) -> io::Result<(Master, OwnedFd)> {
    use rustix::pty::{OpenptFlags, grantpt, openpt, ptsname, unlockpt};
    let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    grantpt(&master)?;
    unlockpt(&master)?;
    let name = ptsname(&master, Vec::new())?;
    let slave = rustix::fs::open(
        name.as_c_str(),
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    set_size(&master, rows, cols)?;
    let flags = rustix::fs::fcntl_getfl(&master)?;
    rustix::fs::fcntl_setfl(&master, flags | rustix::fs::OFlags::NONBLOCK)?;
    // SAFETY: `master` is an owned, open descriptor, moved into the
    // `AsyncFd`, which deregisters it before closing it (when dropped).
    #[allow(unsafe_code)]
    let fd = unsafe { AsyncFd::register(master)? };
    Ok((Master { fd }, slave))
}

fn set_size(fd: impl AsFd, rows: u16, cols: u16) -> io::Result<()> {
    let size = rustix::termios::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    rustix::termios::tcsetwinsize(fd, size)?;
    Ok(())
}

impl Master {
    /// Reads what the command wrote; 0 once every holder of the slave
    /// closed it (Linux says EIO then).
    pub async fn read(&self, buffer: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut ready = self.fd.readable().await?;
            match ready
                .try_io(|fd| rustix::io::read(fd.get_ref(), &mut *buffer).map_err(io::Error::from))
            {
                Ok(Ok(n)) => return Ok(n),
                Ok(Err(e)) if e.raw_os_error() == Some(rustix::io::Errno::IO.raw_os_error()) => {
                    return Ok(0);
                }
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `bytes` as the command's input.
    pub async fn write_all(&self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            let mut ready = self.fd.writable().await?;
            match ready.try_io(|fd| rustix::io::write(fd.get_ref(), bytes).map_err(io::Error::from))
            {
                Ok(Ok(n)) => bytes = &bytes[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    /// Sets the terminal's size (the command gets SIGWINCH).
    pub fn resize(&self, rows: u16, cols: u16) -> io::Result<()> {
        set_size(self.fd.get_ref(), rows, cols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_bounded() {
        assert_eq!(check_size(24, 80), Ok((24, 80)));
        assert_eq!(check_size(4096, 1), Ok((4096, 1)));
        for (rows, cols) in [(0, 80), (24, 0), (65535, 80), (24, 4097)] {
            assert!(check_size(rows, cols).is_err(), "{rows}x{cols}");
        }
    }
}
