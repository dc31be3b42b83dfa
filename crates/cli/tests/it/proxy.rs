//! A TCP proxy the tests cut and mend, to put a service (the S3 server,
//! PostgreSQL) out of reach of the processes under test and bring it back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

/// A TCP proxy in front of a service (the S3 server, PostgreSQL) that the
/// test cuts and mends.
/// Cut, it closes every connection it is offered at once and drops the
/// ones it carried: whoever dials it finds the service out of reach.
pub struct Proxy {
    pub port: u16,
    cut: Arc<AtomicBool>,
    carried: Arc<Mutex<Vec<AbortHandle>>>,
    accepting: JoinHandle<()>,
}

impl Proxy {
    pub async fn start(target: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        let cut = Arc::new(AtomicBool::new(false));
        let carried: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let accepting = {
            let (cut, carried) = (cut.clone(), carried.clone());
            tokio::spawn(async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    if cut.load(Ordering::SeqCst) {
                        continue;
                    }
                    let target = target.clone();
                    let relay = tokio::spawn(async move {
                        if let Ok(mut outbound) = TcpStream::connect(&target).await {
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        }
                    });
                    carried
                        .lock()
                        .expect("connections")
                        .push(relay.abort_handle());
                }
            })
        };
        Proxy {
            port,
            cut,
            carried,
            accepting,
        }
    }

    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for relay in self.carried.lock().expect("connections").drain(..) {
            relay.abort();
        }
    }

    pub fn mend(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accepting.abort();
    }
}
